//! The desktop chat window: the conversation with streamed replies, the input box, Send /
//! Stop / Regenerate / New chat, sampling settings, opening another model, model and
//! device facts with tokens/s, and the inspector as a side panel. Every model operation
//! goes to the worker (`chat_worker`); this side only draws and sends commands.

use std::time::Instant;

use egui::{Align, Color32, Key, Layout, RichText, Ui};

use crate::gpu::DeviceChoice;
use crate::model::quant::WeightFormat;
use crate::session::Finish;
use crate::ui::chat_worker::{ChatCommand, ChatEvent, ChatHandle, GenSettings, MODEL_CLOSED};
use crate::ui::inspector::{InspectorPanel, PanelAction};
use crate::ui::load::{LoadRequest, ModelSource};

/// The weight-format choice that keeps the model's own (the default).
pub const AS_STORED: &str = "as stored";

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    User,
    Assistant,
}

/// One message of the conversation.
#[derive(Clone, Debug)]
pub struct Message {
    pub role: Role,
    pub text: String,
    /// The reply's id (assistant messages).
    pub id: u64,
    pub tokens: usize,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
    pub finish: Option<Finish>,
    pub error: Option<String>,
}

impl Message {
    /// A message with no tokens counted yet (`id`: the reply's, for assistant messages).
    pub fn new(role: Role, text: String, id: u64) -> Self {
        Message {
            role,
            text,
            id,
            tokens: 0,
            first_token: None,
            last_token: None,
            finish: None,
            error: None,
        }
    }

    /// Decode tokens/s of a reply (from its first to its last token).
    pub fn tokens_per_s(&self) -> Option<f64> {
        let (a, b) = (self.first_token?, self.last_token?);
        let s = (b - a).as_secs_f64();
        (self.tokens > 1 && s > 0.0).then(|| (self.tokens - 1) as f64 / s)
    }
}

/// What the window takes back when the turn being made does not enter the conversation
/// (it failed, or was stopped before it began): the chat leaves the conversation as it
/// was before such a turn (`Chat::say_with`, `Chat::regenerate_with`), and the window
/// must show what a next Regenerate or message would continue from.
enum Undo {
    /// A new message: it and its reply go; its text returns to the input box.
    Send(String),
    /// A regeneration: the old reply comes back.
    Regenerate(Message),
}

/// Where the model is, as the settings panel edits it.
pub struct ModelForm {
    pub path: String,
    pub device: String,
    /// `None`: as stored (the model's own format, `Model::preferred_format`).
    pub format: Option<WeightFormat>,
}

/// The chat window.
pub struct ChatApp {
    worker: ChatHandle,
    pub messages: Vec<Message>,
    pub input: String,
    pub settings: GenSettings,
    pub form: ModelForm,
    /// The reply being generated.
    pub generating: Option<u64>,
    /// Its long prompt's progress: tokens read of the total (`ChatEvent::Reading`).
    pub reading: Option<(usize, usize)>,
    /// What to take back if the reply being generated (`generating`, set with it) does not
    /// enter the conversation.
    undo: Option<Undo>,
    next_id: u64,
    pub loading: Option<String>,
    pub model: Option<String>,
    pub errors: Vec<String>,
    pub notices: Vec<String>,
    pub inspector: InspectorPanel,
    pub show_inspector: bool,
    /// Whether the inspector was shown last frame (the state is read only while it is).
    inspector_shown: bool,
}

impl ChatApp {
    /// Starts the worker and opens `req` on it.
    pub fn new(req: LoadRequest) -> Self {
        let worker = ChatHandle::spawn();
        let form = ModelForm {
            path: match &req.source {
                ModelSource::Dir(p) => p.display().to_string(),
                _ => String::new(),
            },
            device: device_text(&req.device),
            format: req.format,
        };
        worker.send(ChatCommand::Load(req));
        ChatApp {
            worker,
            messages: Vec::new(),
            input: String::new(),
            settings: GenSettings::default(),
            form,
            generating: None,
            reading: None,
            undo: None,
            next_id: 1,
            loading: Some("starting".into()),
            model: None,
            errors: Vec::new(),
            notices: Vec::new(),
            inspector: InspectorPanel::new(false),
            show_inspector: false,
            inspector_shown: false,
        }
    }

    /// Whether a model is open and idle.
    pub fn ready(&self) -> bool {
        self.model.is_some() && self.loading.is_none() && self.generating.is_none()
    }

    /// The text of the last assistant message.
    pub fn last_reply(&self) -> Option<&Message> {
        self.messages
            .iter()
            .rev()
            .find(|m| m.role == Role::Assistant)
    }

    fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Sends the input box as a new turn.
    pub fn send_input(&mut self) {
        let text = self.input.trim_end().to_string();
        if text.trim().is_empty() || !self.ready() {
            return;
        }
        self.input.clear();
        let id = self.fresh_id();
        self.messages
            .push(Message::new(Role::User, text.clone(), 0));
        self.messages
            .push(Message::new(Role::Assistant, String::new(), id));
        self.generating = Some(id);
        self.undo = Some(Undo::Send(text.clone()));
        if !self.worker.send(ChatCommand::Send {
            id,
            text,
            settings: self.settings,
        }) {
            self.worker_gone();
        }
    }

    /// Stops the reply being generated.
    pub fn stop(&mut self) {
        if let Some(id) = self.generating {
            self.worker.stop(id);
        }
    }

    /// Replaces the last reply with a new sample from the state before it.
    pub fn regenerate(&mut self) {
        if !self.ready()
            || self
                .messages
                .last()
                .is_none_or(|m| m.role != Role::Assistant)
        {
            return;
        }
        let id = self.fresh_id();
        if let Some(last) = self.messages.last_mut() {
            let old = std::mem::replace(last, Message::new(Role::Assistant, String::new(), id));
            self.undo = Some(Undo::Regenerate(old));
        }
        self.generating = Some(id);
        if !self.worker.send(ChatCommand::Regenerate {
            id,
            settings: self.settings,
        }) {
            self.worker_gone();
        }
    }

    /// Forgets the conversation (the state is zeroed).
    pub fn new_chat(&mut self) {
        self.stop();
        self.messages.clear();
        self.worker.send(ChatCommand::Reset);
    }

    /// Opens the model named in the settings panel.
    pub fn open_model(&mut self) {
        let device = match self.form.device.trim().parse::<DeviceChoice>() {
            Ok(d) => d,
            Err(e) => {
                self.errors.push(format!("device: {e}"));
                return;
            }
        };
        let path = self.form.path.trim();
        let source = if path.is_empty() {
            ModelSource::Embedded
        } else {
            ModelSource::Dir(path.into())
        };
        let mut req = LoadRequest::new(source, device);
        req.format = self.form.format;
        self.stop();
        self.messages.clear();
        self.model = None;
        self.loading = Some(req.source.label());
        self.worker.send(ChatCommand::Load(req));
    }

    fn worker_gone(&mut self) {
        self.generating = None;
        self.errors
            .push("the worker thread has stopped; restart the app".into());
    }

    fn reply_mut(&mut self, id: u64) -> Option<&mut Message> {
        self.messages
            .iter_mut()
            .rev()
            .find(|m| m.role == Role::Assistant && m.id == id)
    }

    /// Applies the worker's events.
    pub fn poll(&mut self) {
        while let Ok(ev) = self.worker.try_recv() {
            self.apply(ev);
        }
    }

    /// Ends reply `id` if it is the one being generated (a later event about it, such as
    /// a failure to read the live state after it, changes nothing), taking its turn back
    /// when it did not enter the conversation.
    fn end_reply(&mut self, id: u64, in_conversation: bool) {
        if self.generating != Some(id) {
            return;
        }
        self.generating = None;
        self.reading = None;
        let undo = match self.undo.take() {
            Some(undo) if !in_conversation => undo,
            _ => return,
        };
        let Some(at) = self
            .messages
            .iter()
            .rposition(|m| m.role == Role::Assistant && m.id == id)
        else {
            return;
        };
        match undo {
            Undo::Send(text) => {
                // The reply and the message before it, which the chat does not hold.
                let from = match at.checked_sub(1) {
                    Some(u) if self.messages[u].role == Role::User => u,
                    _ => at,
                };
                self.messages.drain(from..=at);
                // Before anything typed since, which is kept.
                self.input = match self.input.trim().is_empty() {
                    true => text,
                    false => format!("{text} {}", self.input),
                };
            }
            Undo::Regenerate(old) => self.messages[at] = old,
        }
    }

    /// Applies one of the worker's events (`poll`'s loop).
    pub fn apply(&mut self, ev: ChatEvent) {
        match ev {
            ChatEvent::Loading(what) => self.loading = Some(what),
            ChatEvent::Loaded(info) => {
                self.loading = None;
                self.model = Some(format!("{} on {}", info.source, info.device));
                self.inspector.set_model(*info);
                if self.inspector.profiling {
                    self.worker.send(ChatCommand::Profiling(true));
                }
            }
            ChatEvent::LoadFailed(e) => {
                self.loading = None;
                self.model = None;
                self.errors.push(e);
            }
            ChatEvent::Notice(n) => self.notices.push(n),
            ChatEvent::ReplyStarted { .. } => {}
            ChatEvent::Reading { fed, total } => {
                self.reading = (fed < total).then_some((fed, total));
            }
            ChatEvent::Token { id, piece, at } => {
                self.reading = None;
                self.inspector.timings.token(at);
                if let Some(m) = self.reply_mut(id) {
                    m.tokens += 1;
                    m.first_token.get_or_insert(at);
                    m.last_token = Some(at);
                    if let Some(p) = piece {
                        m.text.push_str(&p);
                    }
                }
            }
            ChatEvent::ReplyDone {
                id,
                finish,
                in_conversation,
                ..
            } => {
                if let Some(m) = self.reply_mut(id) {
                    m.finish = Some(finish);
                }
                self.end_reply(id, in_conversation);
            }
            ChatEvent::ReplyFailed {
                id,
                error,
                in_conversation,
            } => {
                // (A failure after the reply ended, reading the live state, is not the
                // reply's: it stays as it ended.)
                if self.generating == Some(id)
                    && let Some(m) = self.reply_mut(id)
                {
                    m.error = Some(error.clone());
                }
                self.end_reply(id, in_conversation);
                if error.contains(MODEL_CLOSED) {
                    // The worker dropped the chat: no conversation is held any more.
                    self.model = None;
                    self.messages.clear();
                }
                self.errors.push(error);
            }
            ChatEvent::Profiles(p) => self.inspector.timings.add_profiles(p),
            ChatEvent::ExpertLoad(l) => self.inspector.experts = Some(*l),
            ChatEvent::State(s) => self.inspector.set_summary(*s),
            ChatEvent::Cleared => self.inspector.timings.clear(),
            ChatEvent::Error(e) => {
                if e.contains(MODEL_CLOSED) {
                    self.model = None;
                }
                self.errors.push(e);
            }
        }
    }

    fn top_bar(&mut self, ui: &mut Ui) {
        ui.horizontal(|ui| {
            ui.heading("mamba2 chat");
            ui.separator();
            match (&self.loading, &self.model) {
                (Some(what), _) => {
                    ui.spinner();
                    ui.label(format!("loading {what}…"));
                }
                (None, Some(m)) => {
                    ui.label(RichText::new(m).weak());
                }
                (None, None) => {
                    ui.colored_label(Color32::from_rgb(255, 110, 110), "no model open");
                }
            }
            ui.with_layout(Layout::right_to_left(Align::Center), |ui| {
                ui.toggle_value(&mut self.show_inspector, "Inspector");
                if ui.button("New chat").clicked() {
                    self.new_chat();
                }
                let rate = self.inspector.timings.recent_rate(2.0);
                let last = self.last_reply().and_then(Message::tokens_per_s);
                match (self.generating, last) {
                    (Some(_), _) if rate > 0.0 => {
                        ui.label(format!("{rate:.1} tok/s"));
                    }
                    (_, Some(r)) => {
                        ui.label(format!("last reply {r:.1} tok/s"));
                    }
                    _ => {}
                }
            });
        });
    }

    fn settings_ui(&mut self, ui: &mut Ui) {
        ui.heading("Sampling");
        let s = &mut self.settings;
        ui.name_inputs("temperature", |ui| {
            ui.add(egui::Slider::new(&mut s.temperature, 0.0..=2.0).text("temperature"));
        });
        ui.weak("0 = greedy");
        ui.name_inputs("top-k", |ui| {
            ui.add(egui::Slider::new(&mut s.top_k, 0..=200).text("top-k"));
        });
        ui.name_inputs("top-p", |ui| {
            ui.add(egui::Slider::new(&mut s.top_p, 0.05..=1.0).text("top-p"));
        });
        ui.horizontal(|ui| {
            let l = ui.label("seed");
            ui.add(egui::DragValue::new(&mut s.seed)).labelled_by(l.id);
        });
        ui.horizontal(|ui| {
            let l = ui.label("max tokens");
            ui.add(egui::DragValue::new(&mut s.max_tokens).range(1..=100_000))
                .labelled_by(l.id);
        });
        ui.checkbox(&mut s.ignore_eos, "ignore end-of-text");
        ui.separator();
        ui.heading("Model");
        let l = ui.label("folder (empty = embedded model)");
        ui.add(
            egui::TextEdit::singleline(&mut self.form.path)
                .hint_text("path/to/model")
                .desired_width(f32::INFINITY),
        )
        .labelled_by(l.id);
        ui.horizontal(|ui| {
            let l = ui.label("device");
            ui.add(egui::TextEdit::singleline(&mut self.form.device).desired_width(90.0))
                .labelled_by(l.id)
                .on_hover_text("auto, cpu, gpu, gpu:INDEX or gpu:NAME");
        });
        // A drop-down: eleven formats in a row widened the side panel past the window.
        // "as stored" first, the default: a Q4_K GGUF stays Q4_K unless another is chosen.
        let open = self.inspector.info.as_ref().and_then(|i| i.gpu.as_ref());
        let shown = match (self.form.format, open) {
            (Some(f), _) => f.name().to_string(),
            (None, Some(g)) => format!("{AS_STORED} ({})", g.format),
            (None, None) => AS_STORED.to_string(),
        };
        egui::ComboBox::from_label("weights")
            .selected_text(shown)
            .show_ui(ui, |ui| {
                ui.selectable_value(&mut self.form.format, None, AS_STORED);
                for f in WeightFormat::ALL {
                    ui.selectable_value(&mut self.form.format, Some(f), f.name());
                }
            });
        if ui
            .add_enabled(self.loading.is_none(), egui::Button::new("Open model"))
            .clicked()
        {
            self.open_model();
        }
        if let Some(info) = &self.inspector.info {
            ui.add_space(6.0);
            let c = &info.config;
            ui.weak(format!(
                "{} layers · d_model {} · {} heads · vocab {}",
                c.n_layer, c.d_model, c.n_heads, c.vocab_size
            ));
            ui.weak(&info.device);
        }
        if let Some(n) = self.notices.last() {
            ui.add_space(6.0);
            ui.label(RichText::new(n).italics());
        }
    }

    fn input_ui(&mut self, ui: &mut Ui) {
        ui.add_space(6.0);
        ui.horizontal(|ui| {
            let ready = self.ready();
            let width = (ui.available_width() - 260.0).max(120.0);
            let label = ui.label("Message");
            let response = ui
                .add(
                    egui::TextEdit::singleline(&mut self.input)
                        .id_salt("chat_input")
                        .hint_text(if ready { "type and press Enter" } else { "…" })
                        .desired_width(width),
                )
                .labelled_by(label.id);
            let entered = response.lost_focus() && ui.input(|i| i.key_pressed(Key::Enter));
            if ui
                .add_enabled(
                    ready && !self.input.trim().is_empty(),
                    egui::Button::new("Send"),
                )
                .clicked()
                || (entered && ready)
            {
                self.send_input();
                response.request_focus();
            }
            if ui
                .add_enabled(self.generating.is_some(), egui::Button::new("Stop"))
                .clicked()
            {
                self.stop();
            }
            let can_regen = ready
                && self
                    .messages
                    .last()
                    .is_some_and(|m| m.role == Role::Assistant);
            if ui
                .add_enabled(can_regen, egui::Button::new("Regenerate"))
                .clicked()
            {
                self.regenerate();
            }
        });
        ui.add_space(6.0);
    }

    fn errors_ui(&mut self, ui: &mut Ui) {
        let mut dismiss = None;
        for (i, e) in self.errors.iter().enumerate() {
            egui::Frame::new()
                .fill(Color32::from_rgb(110, 20, 30))
                .inner_margin(6.0)
                .corner_radius(4.0)
                .show(ui, |ui| {
                    ui.horizontal(|ui| {
                        ui.label(RichText::new(format!("error: {e}")).color(Color32::WHITE));
                        if ui.small_button("dismiss").clicked() {
                            dismiss = Some(i);
                        }
                    });
                });
        }
        if let Some(i) = dismiss {
            self.errors.remove(i);
        }
    }

    fn conversation_ui(&mut self, ui: &mut Ui) {
        egui::ScrollArea::vertical().id_salt("conversation").stick_to_bottom(true).auto_shrink(false).show(ui, |ui| {
            if self.messages.is_empty() {
                ui.add_space(20.0);
                ui.weak(match self.model {
                    Some(_) => "Type a message below. The model continues your text; the conversation state carries over between turns.",
                    None => "Open a model to start.",
                });
            }
            for m in &self.messages {
                let streaming = self.generating == Some(m.id) && m.role == Role::Assistant;
                message_ui(ui, m, streaming, self.reading.filter(|_| streaming));
                ui.add_space(6.0);
            }
        });
    }

    /// The whole window.
    pub fn show(&mut self, ui: &mut Ui) {
        self.worker.waker.set(ui.ctx());
        self.poll();
        egui::Panel::top("chat_top").show(ui, |ui| {
            ui.add_space(4.0);
            self.top_bar(ui);
            ui.add_space(2.0);
        });
        egui::Panel::left("chat_settings")
            .default_size(250.0)
            .show(ui, |ui| {
                egui::ScrollArea::vertical()
                    .id_salt("settings_scroll")
                    .show(ui, |ui| self.settings_ui(ui));
            });
        if self.show_inspector != self.inspector_shown {
            self.inspector_shown = self.show_inspector;
            self.worker.send(ChatCommand::LiveState {
                on: self.show_inspector && self.inspector.live_state,
                hz: self.inspector.state_hz,
            });
        }
        if self.show_inspector {
            let actions = egui::Panel::right("chat_inspector")
                .default_size(460.0)
                .show(ui, |ui| {
                    ui.heading("Inspector");
                    self.inspector.stacked_ui(ui)
                })
                .inner;
            for a in actions {
                self.worker.send(match a {
                    PanelAction::Profiling(on) => ChatCommand::Profiling(on),
                    PanelAction::LiveState { on, hz } => ChatCommand::LiveState { on, hz },
                    PanelAction::ReadState => ChatCommand::ReadState,
                });
            }
        }
        egui::Panel::bottom("chat_input").show(ui, |ui| self.input_ui(ui));
        egui::CentralPanel::default().show(ui, |ui| {
            self.errors_ui(ui);
            self.conversation_ui(ui);
        });
        if self.generating.is_some() || self.loading.is_some() {
            ui.ctx()
                .request_repaint_after(std::time::Duration::from_millis(100));
        }
    }
}

/// One message; a reply being made shows a spinner, and the progress through its long
/// prompt (`reading`: tokens read, total) until its first token.
fn message_ui(ui: &mut Ui, m: &Message, streaming: bool, reading: Option<(usize, usize)>) {
    let (fill, who) = match m.role {
        Role::User => (Color32::from_rgb(38, 60, 96), "you"),
        Role::Assistant => (Color32::from_rgb(44, 44, 48), "model"),
    };
    egui::Frame::new()
        .fill(fill)
        .inner_margin(8.0)
        .corner_radius(6.0)
        .show(ui, |ui| {
            ui.set_width(ui.available_width());
            ui.horizontal(|ui| {
                ui.label(RichText::new(who).small().strong());
                if streaming {
                    ui.spinner();
                }
            });
            let progress;
            let text = match reading {
                Some((fed, total)) if m.text.is_empty() => {
                    progress = format!(
                        "reading the prompt: {fed} of {total} tokens ({:.0} %)",
                        100.0 * fed as f64 / total.max(1) as f64
                    );
                    progress.as_str()
                }
                _ if m.text.is_empty() && streaming => "…",
                _ => m.text.trim_start(),
            };
            ui.label(
                RichText::new(text)
                    .size(15.0)
                    .color(Color32::from_gray(235)),
            );
            if m.role == Role::Assistant && !streaming {
                let mut stats = format!("{} tokens", m.tokens);
                if let Some(r) = m.tokens_per_s() {
                    stats.push_str(&format!(" · {r:.1} tok/s"));
                }
                if let Some(f) = m.finish {
                    stats.push_str(match f {
                        Finish::Stop => " · end of text",
                        Finish::Length => " · max tokens",
                        Finish::Cancelled => " · stopped",
                        Finish::ContextFull => " · context full",
                    });
                }
                ui.label(RichText::new(stats).small().weak());
                if let Some(e) = &m.error {
                    ui.colored_label(Color32::from_rgb(255, 110, 110), e);
                }
            }
        });
}

fn device_text(d: &DeviceChoice) -> String {
    match d {
        DeviceChoice::Auto => "auto".into(),
        DeviceChoice::Cpu => "cpu".into(),
        DeviceChoice::Gpu(None) => "gpu".into(),
        DeviceChoice::Gpu(Some(w)) => format!("gpu:{w}"),
    }
}

impl eframe::App for ChatApp {
    fn ui(&mut self, ui: &mut Ui, _frame: &mut eframe::Frame) {
        self.show(ui);
    }
}
