//! The chat's worker thread: it owns the `Session` (and so the device), takes commands
//! from the window over a channel and streams events back. The window never blocks on
//! it; Stop is an atomic the decode callback reads, so it works mid-reply.
//!
//! The turns are `chat::Chat`'s, as in `mamba2 chat` and the server: a turn feeds only
//! its new tokens (the state carries the whole conversation), rendered with the model's
//! chat template and special tokens when it has one, as end-of-text-separated plain text
//! when it has not. Regenerate restores the snapshot taken before the last turn and
//! samples again with the next seed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::time::Instant;

use crate::chat::{Chat, TurnEvent};
use crate::gpu::profiler::TokenProfile;
use crate::sampling::Sampling;
use crate::session::{Finish, GenerateOptions, Session};
use crate::ui::load::{LoadRequest, ModelInfo, open};
use crate::ui::state_view::StateSummary;
use crate::ui::worker::{
    Outbox, SHUTDOWN_WAIT, StateReader, Summarizer, Waker, WorkerThread, guarded, set_profiling,
    take_profiles,
};

/// Sampling settings of a reply.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenSettings {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: u64,
    pub max_tokens: usize,
    /// Keep sampling past the end-of-text token.
    pub ignore_eos: bool,
}

impl Default for GenSettings {
    fn default() -> Self {
        GenSettings {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: 0,
            max_tokens: 200,
            ignore_eos: false,
        }
    }
}

impl GenSettings {
    /// The sampler for the `variation`-th regeneration (the seed moves on, so a sampled
    /// reply changes).
    pub fn sampling(&self, variation: u64) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed.wrapping_add(variation),
        }
    }
}

/// What the worker's error says when it dropped the model after a panic (the window then
/// holds no conversation either).
pub const MODEL_CLOSED: &str = "the model was closed";

/// What the window asks of the worker.
pub enum ChatCommand {
    Load(LoadRequest),
    Send {
        id: u64,
        text: String,
        settings: GenSettings,
    },
    Regenerate {
        id: u64,
        settings: GenSettings,
    },
    Reset,
    Profiling(bool),
    LiveState {
        on: bool,
        hz: f32,
    },
    ReadState,
}

/// What the worker tells the window.
pub enum ChatEvent {
    Loading(String),
    Loaded(Box<ModelInfo>),
    LoadFailed(String),
    Notice(String),
    ReplyStarted {
        id: u64,
        prompt_tokens: usize,
    },
    /// Progress through a long prompt of the reply being made: `fed` of `total` tokens
    /// read (`Session::set_prompt_progress`).
    Reading {
        fed: usize,
        total: usize,
    },
    /// A token of reply `id`; `piece` is its text once whole characters are complete.
    Token {
        id: u64,
        piece: Option<String>,
        at: Instant,
    },
    /// Reply `id` ended; `in_conversation`: whether its turn is part of the conversation
    /// (false for a turn stopped before it began, which the chat left as it was).
    ReplyDone {
        id: u64,
        finish: Finish,
        tokens: usize,
        seconds: f64,
        in_conversation: bool,
    },
    /// Reply `id` failed; `in_conversation`: whether its turn is part of the conversation
    /// all the same (a reply made, then the live state not read), else the chat is as
    /// before the turn (`Chat::say_with`, `Chat::regenerate_with`: a new message is not
    /// in it, a regenerated reply is the old one again).
    ReplyFailed {
        id: u64,
        error: String,
        in_conversation: bool,
    },
    Profiles(Vec<TokenProfile>),
    /// How often each expert of each MoE layer was chosen so far.
    ExpertLoad(Box<crate::ui::expert_view::ExpertLoad>),
    State(Box<Result<StateSummary, String>>),
    Cleared,
    Error(String),
}

/// The window's side: commands out, events in, and the stop switch.
pub struct ChatHandle {
    tx: Option<Sender<ChatCommand>>,
    rx: Receiver<ChatEvent>,
    stop: Arc<AtomicU64>,
    pub waker: Waker,
    thread: WorkerThread,
}

impl ChatHandle {
    pub fn spawn() -> Self {
        let (tx, cmd_rx) = channel();
        let (ev_tx, rx) = channel();
        let stop = Arc::new(AtomicU64::new(0));
        let waker = Waker::default();
        let fail_tx = ev_tx.clone();
        let outbox = Outbox::new(ev_tx, waker.clone());
        let worker_stop = stop.clone();
        let thread = match WorkerThread::spawn("mamba2-chat-worker", move || {
            worker_loop(cmd_rx, outbox, worker_stop)
        }) {
            Ok(t) => t,
            Err(e) => {
                // The window still opens and says why nothing works.
                let _ = fail_tx.send(ChatEvent::LoadFailed(format!(
                    "could not start the worker thread: {e}"
                )));
                WorkerThread::none()
            }
        };
        ChatHandle {
            tx: Some(tx),
            rx,
            stop,
            waker,
            thread,
        }
    }

    /// Sends a command; false when the worker is gone.
    pub fn send(&self, cmd: ChatCommand) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(cmd).is_ok())
    }

    /// Stops reply `id` (and any earlier one) at its next token.
    pub fn stop(&self, id: u64) {
        self.stop.fetch_max(id, Ordering::SeqCst);
    }

    pub fn try_recv(&self) -> Result<ChatEvent, TryRecvError> {
        self.rx.try_recv()
    }
}

impl Drop for ChatHandle {
    fn drop(&mut self) {
        // Ends any reply in flight; the worker exits when it sees the channel closed, and
        // releases the device on its way out.
        self.stop.store(u64::MAX, Ordering::SeqCst);
        self.tx = None;
        self.thread.finish(SHUTDOWN_WAIT);
    }
}

struct Live {
    chat: Chat,
    reader: StateReader,
    /// Regenerations of the last reply so far (each moves the seed on by one).
    variation: u64,
}

struct Worker {
    out: Outbox<ChatEvent>,
    stop: Arc<AtomicU64>,
    /// The reply whose turn is running (its prompt's reading stops when it is stopped).
    current: Arc<AtomicU64>,
    live: Option<Live>,
    profiling: bool,
    live_state: (bool, f32),
}

fn worker_loop(rx: Receiver<ChatCommand>, out: Outbox<ChatEvent>, stop: Arc<AtomicU64>) {
    let mut w = Worker {
        out,
        stop,
        current: Arc::new(AtomicU64::new(0)),
        live: None,
        profiling: false,
        // Off until the window shows the inspector.
        live_state: (false, 2.0),
    };
    while let Ok(cmd) = rx.recv() {
        let what = match &cmd {
            ChatCommand::Load(_) => "loading the model",
            ChatCommand::Send { .. } | ChatCommand::Regenerate { .. } => "generating",
            _ => "handling a command",
        };
        let id = match &cmd {
            ChatCommand::Send { id, .. } | ChatCommand::Regenerate { id, .. } => Some(*id),
            _ => None,
        };
        if let Err(e) = guarded(what, || w.handle(cmd)) {
            let e = if e.starts_with("internal error") {
                // The session may be half-updated: drop it; the user reopens the model.
                w.live = None;
                format!("{e} ({MODEL_CLOSED}; open it again)")
            } else {
                e
            };
            match id {
                // A failed turn leaves the conversation as before it; a failure after the
                // reply was done (reading the live state) comes after its ReplyDone, which
                // the window already took as the turn's end.
                Some(id) => w.out.send(ChatEvent::ReplyFailed {
                    id,
                    error: e,
                    in_conversation: false,
                }),
                None => w.out.send(ChatEvent::Error(e)),
            };
        }
    }
}

impl Worker {
    fn handle(&mut self, cmd: ChatCommand) -> Result<(), String> {
        match cmd {
            ChatCommand::Load(req) => self.load(req),
            ChatCommand::Send { id, text, settings } => self.send(id, &text, settings),
            ChatCommand::Regenerate { id, settings } => self.regenerate(id, settings),
            ChatCommand::Reset => {
                if let Some(live) = self.live.as_mut() {
                    live.chat.reset().map_err(|e| e.to_string())?;
                    live.variation = 0;
                    let _ = take_profiles(live.chat.session.backend_mut());
                    self.out.send(ChatEvent::Cleared);
                    self.read_state_idle()?;
                }
                Ok(())
            }
            ChatCommand::Profiling(on) => {
                self.profiling = on;
                self.apply_profiling()
            }
            ChatCommand::LiveState { on, hz } => {
                self.live_state = (on, hz);
                if let Some(live) = self.live.as_mut() {
                    live.reader.set(on, hz)?;
                }
                if on { self.read_state_idle() } else { Ok(()) }
            }
            ChatCommand::ReadState => self.read_state_idle(),
        }
    }

    fn apply_profiling(&mut self) -> Result<(), String> {
        let Some(live) = self.live.as_mut() else {
            return Ok(());
        };
        if let Some(notice) = set_profiling(live.chat.session.backend_mut(), self.profiling)? {
            self.out.send(ChatEvent::Notice(notice));
        }
        Ok(())
    }

    fn load(&mut self, req: LoadRequest) -> Result<(), String> {
        self.out.send(ChatEvent::Loading(req.source.label()));
        // Free the old model's device memory before loading the next.
        self.live = None;
        let out = self.out.clone();
        let loaded = match open(req, &mut |n| {
            out.send(ChatEvent::Notice(n.to_string()));
        }) {
            Ok(l) => l,
            Err(e) => {
                self.out.send(ChatEvent::LoadFailed(e));
                return Ok(());
            }
        };
        let Some(tokenizer) = loaded.tokenizer else {
            self.out.send(ChatEvent::LoadFailed(format!(
                "{} has no tokenizer.json: the chat needs one (`mamba2 inspect` works without)",
                loaded.info.source
            )));
            return Ok(());
        };
        let mut session = Session::new(loaded.backend);
        let out = self.out.clone();
        let (stop, current) = (self.stop.clone(), self.current.clone());
        session.set_prompt_progress(Some(crate::session::PromptProgress {
            every: crate::progress::PROMPT_STEP,
            // Stop ends the reading between pieces; the turn then fails and is rolled back.
            on: Box::new(move |fed, total| {
                out.send(ChatEvent::Reading { fed, total });
                stop.load(Ordering::SeqCst) < current.load(Ordering::SeqCst)
            }),
        }));
        let out = self.out.clone();
        let summarizer = Summarizer::spawn(loaded.info.config.clone(), move |s| {
            out.send(ChatEvent::State(Box::new(s)));
        });
        let mut reader = StateReader::new(session.backend_mut(), summarizer);
        reader.set(self.live_state.0, self.live_state.1)?;
        self.out.send(ChatEvent::Loaded(Box::new(loaded.info)));
        self.live = Some(Live {
            chat: Chat::new(session, tokenizer),
            reader,
            variation: 0,
        });
        self.apply_profiling()?;
        self.read_state_idle()
    }

    fn live(&mut self) -> Result<&mut Live, String> {
        self.live
            .as_mut()
            .ok_or_else(|| "no model is open".to_string())
    }

    fn send(&mut self, id: u64, text: &str, settings: GenSettings) -> Result<(), String> {
        if text.trim().is_empty() {
            return Err("type a message first".into());
        }
        self.live()?.variation = 0;
        self.generate(id, Some(text), settings)
    }

    fn regenerate(&mut self, id: u64, settings: GenSettings) -> Result<(), String> {
        self.live()?.variation += 1;
        self.generate(id, None, settings)
    }

    /// A turn: `user`'s message, or (None) the last reply again.
    fn generate(
        &mut self,
        id: u64,
        user: Option<&str>,
        settings: GenSettings,
    ) -> Result<(), String> {
        if self.stop.load(Ordering::SeqCst) >= id {
            self.out.send(ChatEvent::ReplyDone {
                id,
                finish: Finish::Cancelled,
                tokens: 0,
                seconds: 0.0,
                in_conversation: false,
            });
            return Ok(());
        }
        self.current.store(id, Ordering::SeqCst);
        let out = self.out.clone();
        let stop = self.stop.clone();
        let live = self.live.as_mut().ok_or("no model is open")?;
        let Live {
            chat,
            reader,
            variation,
        } = live;
        let opts = GenerateOptions {
            max_new_tokens: settings.max_tokens.max(1),
            sampling: settings.sampling(*variation),
            // The end of text and the template's end of turn, as the server and `chat`
            // stop on (the latter even without an end-of-text token).
            stop: if settings.ignore_eos {
                Vec::new()
            } else {
                crate::chat::stop_ids(&chat.tokenizer)
            },
        };
        let start = Instant::now();
        // Where the state stands as tokens come (a regenerate starts from its snapshot,
        // and a pending token is fed before the turn's input: the event says where).
        let mut position = 0;
        let mut failure: Option<String> = None;
        let mut on = |e: TurnEvent| match e {
            TurnEvent::Started { fed, position: p } => {
                out.send(ChatEvent::ReplyStarted {
                    id,
                    prompt_tokens: fed,
                });
                position = p;
                true
            }
            TurnEvent::Token { piece, .. } => {
                out.send(ChatEvent::Token {
                    id,
                    piece: piece.map(str::to_string),
                    at: Instant::now(),
                });
                position += 1;
                if let Err(e) = reader.during_decode(position) {
                    failure = Some(e);
                    return false;
                }
                stop.load(Ordering::SeqCst) < id
            }
        };
        let result = match user {
            Some(text) => chat.say_with(text, &opts, &mut on),
            None => chat.regenerate_with(&opts, &mut on),
        };
        let seconds = start.elapsed().as_secs_f64();
        let backend = chat.session.backend_mut();
        let profiles = take_profiles(backend);
        if !profiles.is_empty() {
            out.send(ChatEvent::Profiles(profiles));
        }
        if let Some(load) = crate::ui::expert_view::read_expert_load(backend) {
            out.send(ChatEvent::ExpertLoad(Box::new(load)));
        }
        match (result, failure) {
            (Err(e), _) => {
                let msg = e.to_string();
                let msg = if msg.contains(crate::session::STOPPED_READING) {
                    format!("{msg}: the message was not sent (the conversation is as before it)")
                } else if msg.contains(crate::session::CONTEXT_FULL) {
                    // (A message that no new chat would take either.)
                    match user.and_then(|u| chat.too_long_alone(u)) {
                        Some((n, ctx)) => format!(
                            "{msg}: the message was not sent; it alone takes {n} of the \
                             {ctx}-token context, leaving no room for a reply: open the model \
                             with a larger context"
                        ),
                        None => format!(
                            "{msg}: the message was not sent; New chat starts a new conversation"
                        ),
                    }
                } else if msg.contains("device lost") {
                    format!("{msg}: the GPU device was lost; open the model again")
                } else {
                    msg
                };
                out.send(ChatEvent::ReplyFailed {
                    id,
                    error: msg,
                    in_conversation: false,
                });
            }
            (Ok(_), Some(e)) => {
                out.send(ChatEvent::ReplyFailed {
                    id,
                    error: e,
                    in_conversation: true,
                });
            }
            (Ok(reply), None) => {
                out.send(ChatEvent::ReplyDone {
                    id,
                    finish: reply.finish,
                    tokens: reply.tokens,
                    seconds,
                    in_conversation: true,
                });
            }
        }
        self.read_state_idle()
    }

    fn read_state_idle(&mut self) -> Result<(), String> {
        let Some(live) = self.live.as_mut() else {
            return Ok(());
        };
        if !live.reader.on {
            return Ok(());
        }
        let pos = live.chat.session.position();
        live.reader.now(live.chat.session.backend_mut(), pos)
    }
}
