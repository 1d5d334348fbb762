//! The inspector's worker thread: it owns the backend and decodes continuously (in short
//! bursts, so commands are seen between them), or one token per Step while paused. It
//! drives the `Backend` directly rather than a `Session`, so that a step is exactly one
//! token: one `decode` call that feeds the last token and samples the next, after which
//! the state read back is the state at that token.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::time::Instant;

use crate::gpu::profiler::TokenProfile;
use crate::sampling::Sampling;
use crate::session::Backend;
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::ui::load::{LoadRequest, ModelInfo, open};
use crate::ui::state_view::StateSummary;
use crate::ui::worker::{
    Outbox, SHUTDOWN_WAIT, StateReader, Summarizer, Waker, WorkerThread, guarded, set_profiling,
    take_profiles,
};

/// Tokens per decode call while running.
const BURST: usize = 8;

pub enum InspectCommand {
    /// Open a model and prefill `prompt` (text; ignored without a tokenizer).
    Load {
        req: Box<LoadRequest>,
        prompt: String,
    },
    Run,
    Pause,
    /// Decode this many tokens, then pause.
    Step(usize),
    /// Zero the state and prefill the prompt again.
    Reset,
    Sampling(Sampling),
    Profiling(bool),
    LiveState {
        on: bool,
        hz: f32,
    },
    ReadState,
}

pub enum InspectEvent {
    Loading(String),
    Loaded(Box<ModelInfo>),
    LoadFailed(String),
    Notice(String),
    /// Decoded tokens: id, text piece, arrival.
    Tokens(Vec<(u32, Option<String>, Instant)>),
    Profiles(Vec<TokenProfile>),
    /// How often each expert of each MoE layer was chosen so far.
    ExpertLoad(Box<crate::ui::expert_view::ExpertLoad>),
    State(Box<Result<StateSummary, String>>),
    Running(bool),
    /// The state was zeroed and the prompt fed again.
    Restarted,
    Error(String),
}

/// The window's side of the inspector worker.
pub struct InspectHandle {
    tx: Option<Sender<InspectCommand>>,
    rx: Receiver<InspectEvent>,
    pause: Arc<AtomicBool>,
    pub waker: Waker,
    thread: WorkerThread,
}

impl InspectHandle {
    pub fn spawn() -> Self {
        let (tx, cmd_rx) = channel();
        let (ev_tx, rx) = channel();
        let pause = Arc::new(AtomicBool::new(true));
        let waker = Waker::default();
        let fail_tx = ev_tx.clone();
        let outbox = Outbox::new(ev_tx, waker.clone());
        let p = pause.clone();
        let thread = match WorkerThread::spawn("mamba2-inspect-worker", move || {
            worker_loop(cmd_rx, outbox, p)
        }) {
            Ok(t) => t,
            Err(e) => {
                // The window still opens and says why nothing works.
                let _ = fail_tx.send(InspectEvent::LoadFailed(format!(
                    "could not start the worker thread: {e}"
                )));
                WorkerThread::none()
            }
        };
        InspectHandle {
            tx: Some(tx),
            rx,
            pause,
            waker,
            thread,
        }
    }

    pub fn send(&self, cmd: InspectCommand) -> bool {
        match cmd {
            InspectCommand::Pause => self.pause.store(true, Ordering::SeqCst),
            InspectCommand::Run => self.pause.store(false, Ordering::SeqCst),
            _ => {}
        }
        self.tx.as_ref().is_some_and(|tx| tx.send(cmd).is_ok())
    }

    pub fn try_recv(&self) -> Result<InspectEvent, TryRecvError> {
        self.rx.try_recv()
    }
}

impl Drop for InspectHandle {
    fn drop(&mut self) {
        // Ends a burst in flight; the worker exits when it sees the channel closed, and
        // releases the device on its way out.
        self.pause.store(true, Ordering::SeqCst);
        self.tx = None;
        self.thread.finish(SHUTDOWN_WAIT);
    }
}

struct Live {
    backend: Box<dyn Backend>,
    tokenizer: Option<Tokenizer>,
    decoder: StreamDecoder,
    prompt: Vec<u32>,
    /// The last sampled token (not yet fed).
    last: u32,
    /// Position of the next token to be sampled.
    next_pos: u64,
    reader: StateReader,
}

struct Worker {
    out: Outbox<InspectEvent>,
    pause: Arc<AtomicBool>,
    live: Option<Live>,
    running: bool,
    sampling: Sampling,
    profiling: bool,
    live_state: (bool, f32),
}

fn worker_loop(rx: Receiver<InspectCommand>, out: Outbox<InspectEvent>, pause: Arc<AtomicBool>) {
    let mut w = Worker {
        out,
        pause,
        live: None,
        running: false,
        sampling: Sampling {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: 0,
        },
        profiling: true,
        live_state: (true, 2.0),
    };
    loop {
        let cmd = if w.running && w.live.is_some() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => return,
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        };
        let result = match cmd {
            Some(c) => guarded("handling a command", || w.handle(c)),
            None => guarded("decoding", || w.decode(BURST)),
        };
        if let Err(e) = result {
            if e.starts_with("internal error") {
                w.live = None;
            }
            w.set_running(false);
            w.out.send(InspectEvent::Error(e));
        }
    }
}

impl Worker {
    fn set_running(&mut self, on: bool) {
        if self.running != on {
            self.running = on;
            self.out.send(InspectEvent::Running(on));
        }
        self.pause.store(!on, Ordering::SeqCst);
    }

    fn handle(&mut self, cmd: InspectCommand) -> Result<(), String> {
        match cmd {
            InspectCommand::Load { req, prompt } => self.load(*req, &prompt),
            InspectCommand::Run => {
                self.set_running(self.live.is_some());
                Ok(())
            }
            InspectCommand::Pause => {
                self.set_running(false);
                self.read_state_idle()
            }
            InspectCommand::Step(n) => {
                self.set_running(false);
                self.decode(n.max(1))?;
                self.read_state_idle()
            }
            InspectCommand::Reset => {
                if let Some(live) = self.live.as_mut() {
                    live.backend.reset().map_err(|e| e.to_string())?;
                    let _ = take_profiles(live.backend.as_mut());
                    self.out.send(InspectEvent::Restarted);
                    self.prefill()?;
                    self.read_state_idle()?;
                }
                Ok(())
            }
            InspectCommand::Sampling(s) => {
                s.validate().map_err(|e| e.to_string())?;
                self.sampling = s;
                Ok(())
            }
            InspectCommand::Profiling(on) => {
                self.profiling = on;
                self.apply_profiling()
            }
            InspectCommand::LiveState { on, hz } => {
                self.live_state = (on, hz);
                if let Some(live) = self.live.as_mut() {
                    live.reader.set(on, hz)?;
                }
                if on { self.read_state_idle() } else { Ok(()) }
            }
            InspectCommand::ReadState => self.read_state_idle(),
        }
    }

    fn apply_profiling(&mut self) -> Result<(), String> {
        let Some(live) = self.live.as_mut() else {
            return Ok(());
        };
        if let Some(notice) = set_profiling(live.backend.as_mut(), self.profiling)? {
            self.out.send(InspectEvent::Notice(notice));
        }
        Ok(())
    }

    fn load(&mut self, req: LoadRequest, prompt: &str) -> Result<(), String> {
        self.set_running(false);
        self.out.send(InspectEvent::Loading(req.source.label()));
        self.live = None;
        let out = self.out.clone();
        let mut loaded = match open(req, &mut |n| {
            out.send(InspectEvent::Notice(n.to_string()));
        }) {
            Ok(l) => l,
            Err(e) => {
                self.out.send(InspectEvent::LoadFailed(e));
                return Ok(());
            }
        };
        let vocab = loaded.info.config.vocab_size as u32;
        let prompt_ids = match &loaded.tokenizer {
            Some(t) => {
                let mut ids: Vec<u32> = t.eos.into_iter().collect();
                ids.extend(t.encode_with(prompt, false).map_err(|e| e.to_string())?);
                ids
            }
            None => Vec::new(),
        };
        let prompt_ids = if prompt_ids.is_empty() {
            vec![1 % vocab.max(1)]
        } else {
            prompt_ids
        };
        let out = self.out.clone();
        let summarizer = Summarizer::spawn(loaded.info.config.clone(), move |s| {
            out.send(InspectEvent::State(Box::new(s)));
        });
        let mut reader = StateReader::new(loaded.backend.as_mut(), summarizer);
        reader.set(self.live_state.0, self.live_state.1)?;
        self.out.send(InspectEvent::Loaded(Box::new(loaded.info)));
        self.live = Some(Live {
            backend: loaded.backend,
            decoder: StreamDecoder::default(),
            tokenizer: loaded.tokenizer,
            prompt: prompt_ids,
            last: 0,
            next_pos: 0,
            reader,
        });
        self.apply_profiling()?;
        self.prefill()?;
        self.read_state_idle()
    }

    /// Feeds the prompt from a zero state and samples the first token.
    fn prefill(&mut self) -> Result<(), String> {
        let sampling = self.sampling;
        let Some(live) = self.live.as_mut() else {
            return Ok(());
        };
        let n = live.prompt.len() as u64;
        let first = live
            .backend
            .prefill_sample(&live.prompt, &sampling, n)
            .map_err(|e| e.to_string())?;
        // Prefill goes through the decode graph window by window: not per-token profiles.
        let _ = take_profiles(live.backend.as_mut());
        if let Some(load) = crate::ui::expert_view::read_expert_load(live.backend.as_mut()) {
            self.out.send(InspectEvent::ExpertLoad(Box::new(load)));
        }
        live.decoder = StreamDecoder::default();
        live.last = first;
        live.next_pos = n + 1;
        let piece = match &live.tokenizer {
            Some(t) => live.decoder.step(t, first).map_err(|e| e.to_string())?,
            None => None,
        };
        self.out
            .send(InspectEvent::Tokens(vec![(first, piece, Instant::now())]));
        Ok(())
    }

    /// Decodes up to `n` tokens (fewer when paused meanwhile).
    fn decode(&mut self, n: usize) -> Result<(), String> {
        let sampling = self.sampling;
        let running = self.running;
        let pause = self.pause.clone();
        let Some(live) = self.live.as_mut() else {
            self.set_running(false);
            return Ok(());
        };
        let Live {
            backend,
            tokenizer,
            decoder,
            last,
            next_pos,
            reader,
            ..
        } = live;
        let mut got: Vec<u32> = Vec::with_capacity(n);
        let out = self.out.clone();
        let mut failure = None;
        let mut pos = *next_pos;
        let result = backend.decode(*last, *next_pos, n, &sampling, &[], &mut |id| {
            let piece = match tokenizer.as_ref().map(|t| decoder.step(t, id)) {
                Some(Ok(p)) => p,
                Some(Err(e)) => {
                    failure = Some(e.to_string());
                    return false;
                }
                None => None,
            };
            // Each token goes to the window as it comes (a slow device still looks alive).
            out.send(InspectEvent::Tokens(vec![(id, piece, Instant::now())]));
            got.push(id);
            pos += 1;
            if let Err(e) = reader.during_decode(pos) {
                failure = Some(e);
                return false;
            }
            !(running && pause.load(Ordering::SeqCst))
        });
        let sampled = result.map_err(|e| e.to_string())?;
        if let Some(id) = got.last() {
            *last = *id;
        }
        *next_pos += sampled as u64;
        let profiles = take_profiles(backend.as_mut());
        if !profiles.is_empty() {
            self.out.send(InspectEvent::Profiles(profiles));
        }
        if let Some(load) = crate::ui::expert_view::read_expert_load(backend.as_mut()) {
            self.out.send(InspectEvent::ExpertLoad(Box::new(load)));
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let position = *next_pos - 1;
        reader.between(backend.as_mut(), position)
    }

    fn read_state_idle(&mut self) -> Result<(), String> {
        let Some(live) = self.live.as_mut() else {
            return Ok(());
        };
        if !live.reader.on {
            return Ok(());
        }
        // The state after the last fed token: the last sampled token is not fed yet.
        let pos = live.next_pos.saturating_sub(1);
        live.reader.now(live.backend.as_mut(), pos)
    }
}
