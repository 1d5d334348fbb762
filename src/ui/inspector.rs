//! The inspector: timings (per kernel, per section, per token, tok/s), the device and
//! memory facts, and the live state heatmap with its NaN/Inf flag. `InspectorPanel` is
//! the view model both windows embed (the chat app's side panel and `mamba2 inspect`);
//! `InspectorApp` is the standalone window, which adds run / pause / step over a worker
//! that decodes continuously.

use std::path::PathBuf;

use egui::{Color32, RichText, Ui};

use crate::reference::State;
use crate::sampling::Sampling;
use crate::ui::expert_view::{ExpertLoad, expert_panel};
use crate::ui::inspect_worker::{InspectCommand, InspectEvent, InspectHandle};
use crate::ui::load::{LoadRequest, ModelInfo, info_ui};
use crate::ui::state_view::{StateNorm, StateSummary, nonfinite_banner, state_panel};
use crate::ui::timings::{ExportFormat, Timings, export, plots_ui, summary_ui};

/// What the panel asks its owner to tell the worker.
#[derive(Clone, Debug, PartialEq)]
pub enum PanelAction {
    Profiling(bool),
    LiveState { on: bool, hz: f32 },
    ReadState,
}

/// The inspector's view model.
pub struct InspectorPanel {
    pub timings: Timings,
    pub state: Option<StateSummary>,
    pub state_error: Option<String>,
    pub info: Option<ModelInfo>,
    /// MoE models: how often each expert was chosen.
    pub experts: Option<ExpertLoad>,
    pub norm: StateNorm,
    pub profiling: bool,
    pub live_state: bool,
    pub state_hz: f32,
    pub export_path: String,
    /// The last export: where it went, or why it failed.
    pub export_result: Option<Result<PathBuf, String>>,
}

impl InspectorPanel {
    pub fn new(profiling: bool) -> Self {
        InspectorPanel {
            timings: Timings::default(),
            state: None,
            state_error: None,
            info: None,
            experts: None,
            norm: StateNorm::Rms,
            profiling,
            live_state: true,
            state_hz: 2.0,
            export_path: "mamba2-timings.csv".into(),
            export_result: None,
        }
    }

    /// A model was opened: forget the old one's numbers.
    pub fn set_model(&mut self, info: ModelInfo) {
        self.timings.clear();
        self.state = None;
        self.state_error = None;
        self.experts = None;
        self.info = Some(info);
    }

    /// A summary arrived from the worker.
    pub fn set_summary(&mut self, s: Result<StateSummary, String>) {
        match s {
            Ok(s) => {
                self.state = Some(s);
                self.state_error = None;
            }
            Err(e) => self.state_error = Some(e),
        }
    }

    /// Shows `state` (summarized here, against the open model's config): tests inject
    /// states through this, and it is how a state read by other means can be shown.
    pub fn inject_state(&mut self, state: &State<f32>) -> Result<(), String> {
        let info = self.info.as_ref().ok_or("no model is open")?;
        let s = StateSummary::from_state(&info.config, state)?;
        self.set_summary(Ok(s));
        Ok(())
    }

    /// Whether the shown state holds NaN/Inf.
    pub fn nonfinite(&self) -> bool {
        self.state.as_ref().is_some_and(StateSummary::has_nonfinite)
    }

    fn meta(&self) -> serde_json::Value {
        self.info
            .as_ref()
            .map_or(serde_json::Value::Null, ModelInfo::to_json)
    }

    /// Profiling and live-state switches.
    pub fn switches_ui(&mut self, ui: &mut Ui, actions: &mut Vec<PanelAction>) {
        ui.horizontal_wrapped(|ui| {
            if ui
                .checkbox(&mut self.profiling, "GPU timings")
                .on_hover_text("timestamp queries around every dispatch; each token then waits for its timings")
                .changed()
            {
                actions.push(PanelAction::Profiling(self.profiling));
            }
            let mut live_changed = ui
                .checkbox(&mut self.live_state, "live state")
                .on_hover_text("read the state back at a low rate, off the decode path")
                .changed();
            ui.name_inputs("state reads per second", |ui| {
                live_changed |= ui
                    .add(egui::Slider::new(&mut self.state_hz, 0.2..=2.0).suffix(" Hz").max_decimals(1))
                    .changed();
            });
            if live_changed {
                actions.push(PanelAction::LiveState { on: self.live_state, hz: self.state_hz });
            }
            if ui.button("Read state now").clicked() {
                actions.push(PanelAction::ReadState);
            }
        });
    }

    /// The export path field and buttons, and where the last export went.
    pub fn export_ui(&mut self, ui: &mut Ui) {
        ui.horizontal(|ui| {
            let label = ui.label("Export timings to");
            ui.add(egui::TextEdit::singleline(&mut self.export_path).desired_width(220.0))
                .labelled_by(label.id);
        });
        ui.horizontal(|ui| {
            let path = PathBuf::from(self.export_path.trim());
            if ui.button("Export CSV").clicked() {
                self.export_result =
                    Some(export(&self.timings, &path, ExportFormat::Csv, self.meta()));
            }
            if ui.button("Export JSON").clicked() {
                self.export_result = Some(export(
                    &self.timings,
                    &path,
                    ExportFormat::Json,
                    self.meta(),
                ));
            }
        });
        match &self.export_result {
            Some(Ok(p)) => {
                ui.label(
                    RichText::new(format!("wrote {}", p.display()))
                        .color(Color32::from_rgb(120, 200, 120)),
                );
            }
            Some(Err(e)) => {
                ui.colored_label(Color32::from_rgb(255, 110, 110), e);
            }
            None => {}
        }
    }

    pub fn timings_ui(&mut self, ui: &mut Ui) {
        let g = self
            .info
            .as_ref()
            .and_then(|i| i.gpu.as_ref())
            .map(|g| g.dispatches_sample);
        summary_ui(ui, &self.timings, g);
    }

    pub fn plots_ui(&mut self, ui: &mut Ui) {
        plots_ui(ui, &self.timings);
    }

    pub fn state_ui(&mut self, ui: &mut Ui) {
        if let Some(e) = &self.state_error {
            ui.colored_label(Color32::from_rgb(255, 110, 110), format!("state: {e}"));
        }
        match &self.state {
            Some(s) => state_panel(ui, s, &mut self.norm),
            None => {
                ui.weak("No state read yet (turn on live state or press Read state now).");
            }
        }
    }

    /// The expert-load heatmap (MoE models).
    pub fn experts_ui(&mut self, ui: &mut Ui) {
        match &self.experts {
            Some(load) => expert_panel(ui, load),
            None => {
                ui.weak("No expert load yet (MoE models on the GPU).");
            }
        }
    }

    pub fn device_ui(&mut self, ui: &mut Ui) {
        match &self.info {
            Some(info) => info_ui(ui, info),
            None => {
                ui.weak("No model open.");
            }
        }
    }

    /// Everything stacked in collapsing sections (the chat app's side panel).
    pub fn stacked_ui(&mut self, ui: &mut Ui) -> Vec<PanelAction> {
        let mut actions = Vec::new();
        if let Some(s) = &self.state {
            nonfinite_banner(ui, s);
        }
        self.switches_ui(ui, &mut actions);
        egui::ScrollArea::vertical()
            .id_salt("inspector_scroll")
            .show(ui, |ui| {
                egui::CollapsingHeader::new("State")
                    .default_open(true)
                    .show(ui, |ui| self.state_ui(ui));
                egui::CollapsingHeader::new("Timings")
                    .default_open(true)
                    .show(ui, |ui| {
                        self.timings_ui(ui);
                        self.export_ui(ui);
                    });
                egui::CollapsingHeader::new("Plots")
                    .default_open(false)
                    .show(ui, |ui| self.plots_ui(ui));
                if self.experts.is_some() {
                    egui::CollapsingHeader::new("Expert load")
                        .default_open(true)
                        .show(ui, |ui| self.experts_ui(ui));
                }
                egui::CollapsingHeader::new("Device and memory")
                    .default_open(false)
                    .show(ui, |ui| self.device_ui(ui));
            });
        actions
    }
}

/// The standalone inspector window (`mamba2 inspect`).
pub struct InspectorApp {
    worker: InspectHandle,
    pub panel: InspectorPanel,
    pub running: bool,
    pub loading: Option<String>,
    pub error: Option<String>,
    pub notices: Vec<String>,
    /// Recent generated text (or ids without a tokenizer).
    pub text: String,
    pub temperature: f32,
}

/// Text kept in the token view.
const KEEP_TEXT: usize = 4000;

impl InspectorApp {
    /// Opens `req` on a worker and prefills `prompt`; decoding starts when `run` is set.
    pub fn new(req: LoadRequest, prompt: &str, run: bool) -> Self {
        let worker = InspectHandle::spawn();
        worker.send(InspectCommand::Load {
            req: Box::new(req),
            prompt: prompt.to_string(),
        });
        if run {
            worker.send(InspectCommand::Run);
        }
        InspectorApp {
            worker,
            panel: InspectorPanel::new(true),
            running: run,
            loading: Some("starting".into()),
            error: None,
            notices: Vec::new(),
            text: String::new(),
            temperature: 0.8,
        }
    }

    /// Applies the worker's events.
    pub fn poll(&mut self) {
        while let Ok(ev) = self.worker.try_recv() {
            match ev {
                InspectEvent::Loading(what) => self.loading = Some(what),
                InspectEvent::Loaded(info) => {
                    self.loading = None;
                    self.error = None;
                    self.text.clear();
                    self.panel.set_model(*info);
                }
                InspectEvent::LoadFailed(e) => {
                    self.loading = None;
                    self.error = Some(e);
                }
                InspectEvent::Notice(n) => self.notices.push(n),
                InspectEvent::Tokens(tokens) => {
                    for (id, piece, at) in tokens {
                        self.panel.timings.token(at);
                        match piece {
                            Some(p) => self.text.push_str(&p),
                            None if self
                                .panel
                                .info
                                .as_ref()
                                .is_some_and(|i| i.tokenizer.is_none()) =>
                            {
                                self.text.push_str(&format!("{id} "))
                            }
                            None => {}
                        }
                    }
                    if self.text.len() > KEEP_TEXT {
                        let mut cut = self.text.len() - KEEP_TEXT;
                        while !self.text.is_char_boundary(cut) {
                            cut += 1;
                        }
                        self.text.drain(..cut);
                    }
                }
                InspectEvent::Profiles(p) => self.panel.timings.add_profiles(p),
                InspectEvent::ExpertLoad(l) => self.panel.experts = Some(*l),
                InspectEvent::State(s) => self.panel.set_summary(*s),
                InspectEvent::Running(r) => self.running = r,
                InspectEvent::Restarted => {
                    self.panel.timings.clear();
                    self.text.clear();
                }
                InspectEvent::Error(e) => self.error = Some(e),
            }
        }
    }

    fn act(&mut self, actions: Vec<PanelAction>) {
        for a in actions {
            self.worker.send(match a {
                PanelAction::Profiling(on) => InspectCommand::Profiling(on),
                PanelAction::LiveState { on, hz } => InspectCommand::LiveState { on, hz },
                PanelAction::ReadState => InspectCommand::ReadState,
            });
        }
    }

    fn controls_ui(&mut self, ui: &mut Ui) {
        let ready = self.panel.info.is_some() && self.loading.is_none();
        ui.horizontal(|ui| {
            ui.heading("mamba2 inspector");
            ui.separator();
            if self.running {
                if ui.button("Pause").clicked() {
                    self.worker.send(InspectCommand::Pause);
                    self.running = false;
                }
            } else if ui.add_enabled(ready, egui::Button::new("Run")).clicked() {
                self.worker.send(InspectCommand::Run);
                self.running = true;
            }
            if ui
                .add_enabled(ready, egui::Button::new("Step 1 token"))
                .clicked()
            {
                self.worker.send(InspectCommand::Step(1));
                self.running = false;
            }
            if ui
                .add_enabled(ready, egui::Button::new("Reset state"))
                .clicked()
            {
                self.worker.send(InspectCommand::Reset);
            }
            ui.separator();
            let before = self.temperature;
            ui.name_inputs("temperature", |ui| {
                ui.add(
                    egui::Slider::new(&mut self.temperature, 0.0..=2.0)
                        .text("temperature (0 = greedy)"),
                );
            });
            if (before - self.temperature).abs() > f32::EPSILON {
                let s = Sampling {
                    temperature: self.temperature,
                    top_k: 40,
                    top_p: 0.95,
                    seed: 0,
                };
                self.worker.send(InspectCommand::Sampling(s));
            }
            if let Some(what) = &self.loading {
                ui.spinner();
                ui.label(format!("loading {what}…"));
            }
        });
        let mut actions = Vec::new();
        self.panel.switches_ui(ui, &mut actions);
        self.act(actions);
    }

    /// The whole window.
    pub fn show(&mut self, ui: &mut Ui) {
        self.worker.waker.set(ui.ctx());
        self.poll();
        egui::Panel::top("inspector_controls").show(ui, |ui| {
            ui.add_space(4.0);
            self.controls_ui(ui);
            if let Some(e) = self.error.clone() {
                ui.horizontal(|ui| {
                    ui.colored_label(
                        Color32::from_rgb(255, 110, 110),
                        RichText::new(format!("error: {e}")).strong(),
                    );
                    if ui.small_button("dismiss").clicked() {
                        self.error = None;
                    }
                });
            }
            if let Some(n) = self.notices.last() {
                ui.weak(n);
            }
            if let Some(s) = &self.panel.state {
                nonfinite_banner(ui, s);
            }
            ui.add_space(2.0);
        });
        egui::Panel::left("inspector_device")
            .default_size(310.0)
            .show(ui, |ui| {
                egui::ScrollArea::vertical()
                    .id_salt("device_scroll")
                    .show(ui, |ui| {
                        ui.heading("Device and model");
                        self.panel.device_ui(ui);
                        ui.separator();
                        ui.heading("Export");
                        self.panel.export_ui(ui);
                        ui.separator();
                        ui.heading("Generated text");
                        ui.label(RichText::new(tail(&self.text, 600)).monospace().size(11.0));
                    });
            });
        egui::Panel::right("inspector_state")
            .default_size(450.0)
            .show(ui, |ui| {
                egui::ScrollArea::vertical()
                    .id_salt("state_scroll")
                    .show(ui, |ui| {
                        ui.heading("State");
                        self.panel.state_ui(ui);
                        if self.panel.experts.is_some() {
                            ui.separator();
                            ui.heading("Expert load");
                            self.panel.experts_ui(ui);
                        }
                        ui.separator();
                        self.panel.plots_ui(ui);
                    });
            });
        egui::CentralPanel::default().show(ui, |ui| {
            egui::ScrollArea::vertical()
                .id_salt("timings_scroll")
                .show(ui, |ui| {
                    ui.heading("Timings");
                    self.panel.timings_ui(ui);
                });
        });
        if self.running || self.loading.is_some() {
            ui.ctx()
                .request_repaint_after(std::time::Duration::from_millis(100));
        }
    }
}

fn tail(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut cut = s.len() - max;
    while !s.is_char_boundary(cut) {
        cut += 1;
    }
    &s[cut..]
}

impl eframe::App for InspectorApp {
    fn ui(&mut self, ui: &mut Ui, _frame: &mut eframe::Frame) {
        self.show(ui);
    }
}
