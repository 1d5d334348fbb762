//! Pieces both workers share: waking the UI, summarizing states off the decode thread,
//! reading the state at a low rate (asynchronously on a GPU), and turning a panic inside
//! the engine into an error message instead of a dead window.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::ModelConfig;
use crate::reference::State;
use crate::session::Backend;
use crate::ui::state_tap::StateTap;
use crate::ui::state_view::StateSummary;

/// Asks the window for a repaint; set once the window's `egui::Context` is known.
#[derive(Clone, Default)]
pub struct Waker(Arc<Mutex<Option<egui::Context>>>);

impl Waker {
    pub fn set(&self, ctx: &egui::Context) {
        if let Ok(mut c) = self.0.lock()
            && c.is_none()
        {
            *c = Some(ctx.clone());
        }
    }

    pub fn wake(&self) {
        if let Ok(c) = self.0.lock()
            && let Some(ctx) = c.as_ref()
        {
            ctx.request_repaint();
        }
    }
}

/// Sends events to the window and wakes it.
pub struct Outbox<E> {
    tx: Sender<E>,
    waker: Waker,
}

impl<E> Clone for Outbox<E> {
    fn clone(&self) -> Self {
        Outbox {
            tx: self.tx.clone(),
            waker: self.waker.clone(),
        }
    }
}

impl<E> Outbox<E> {
    pub fn new(tx: Sender<E>, waker: Waker) -> Self {
        Outbox { tx, waker }
    }

    /// False when the window is gone.
    pub fn send(&self, e: E) -> bool {
        let ok = self.tx.send(e).is_ok();
        self.waker.wake();
        ok
    }
}

/// A state to summarize and the token position it was read at.
type StateJob = (State<f32>, u64);

/// Summarizes states on a thread of its own, so a large state never delays decode.
pub struct Summarizer {
    tx: Sender<StateJob>,
}

impl Summarizer {
    /// `deliver` gets each summary (or a shape error).
    pub fn spawn(
        config: ModelConfig,
        deliver: impl Fn(Result<StateSummary, String>) + Send + 'static,
    ) -> Self {
        let (tx, rx) = channel::<StateJob>();
        std::thread::Builder::new()
            .name("mamba2-state-summary".into())
            .spawn(move || {
                while let Ok(mut job) = rx.recv() {
                    // Only the newest state matters.
                    while let Ok(newer) = rx.try_recv() {
                        job = newer;
                    }
                    let (state, pos) = job;
                    deliver(
                        StateSummary::from_state(&config, &state).map(|s| s.with_position(pos)),
                    );
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| tracing::warn!("could not start the state summarizer: {e}"));
        Summarizer { tx }
    }

    pub fn submit(&self, state: State<f32>, position: u64) {
        let _ = self.tx.send((state, position));
    }
}

/// Reads the state at most `hz` times a second while decoding (asynchronously on a GPU:
/// the copy rides behind the submitted tokens), and on demand when idle.
pub struct StateReader {
    tap: Option<StateTap>,
    pub hz: f32,
    pub on: bool,
    last: Option<Instant>,
    summarizer: Summarizer,
}

impl StateReader {
    pub fn new(backend: &mut dyn Backend, summarizer: Summarizer) -> Self {
        StateReader {
            tap: backend.gpu().map(|g| StateTap::new(&g.engine)),
            hz: 2.0,
            on: true,
            last: None,
            summarizer,
        }
    }

    fn due(&self) -> bool {
        let period = Duration::from_secs_f32(1.0 / self.hz.clamp(0.05, 2.0));
        self.on && self.last.is_none_or(|t| t.elapsed() >= period)
    }

    /// Inside the decode loop (GPU only: the CPU state cannot be read while it decodes):
    /// queues a copy when one is due and hands over any copy that has landed.
    pub fn during_decode(&mut self, position: u64) -> Result<(), String> {
        let due = self.due();
        let Some(tap) = self.tap.as_mut() else {
            return Ok(());
        };
        if let Some((st, pos)) = tap.try_take().map_err(|e| e.to_string())? {
            self.summarizer.submit(st, pos);
        }
        if due && !tap.busy() && tap.request(position).map_err(|e| e.to_string())? {
            self.last = Some(Instant::now());
        }
        Ok(())
    }

    /// Between decode calls: hands over a landed copy, and starts one when due.
    pub fn between(&mut self, backend: &mut dyn Backend, position: u64) -> Result<(), String> {
        let due = self.due();
        match self.tap.as_mut() {
            Some(tap) => {
                if let Some((st, pos)) = tap.poll().map_err(|e| e.to_string())? {
                    self.summarizer.submit(st, pos);
                }
                self.during_decode(position)
            }
            None if due => {
                self.last = Some(Instant::now());
                self.now(backend, position)
            }
            None => Ok(()),
        }
    }

    /// Reads the state now (blocking; idle moments only).
    pub fn now(&mut self, backend: &mut dyn Backend, position: u64) -> Result<(), String> {
        match self.tap.as_mut() {
            Some(tap) => {
                if let Some((st, pos)) = tap.wait().map_err(|e| e.to_string())? {
                    self.summarizer.submit(st, pos);
                }
                tap.request(position).map_err(|e| e.to_string())?;
                if let Some((st, pos)) = tap.wait().map_err(|e| e.to_string())? {
                    self.summarizer.submit(st, pos);
                }
            }
            None => {
                let st = backend.state().map_err(|e| e.to_string())?;
                self.summarizer.submit(st, position);
            }
        }
        self.last = Some(Instant::now());
        Ok(())
    }

    pub fn set(&mut self, on: bool, hz: f32) -> Result<(), String> {
        self.on = on;
        self.hz = hz;
        if !on && let Some(tap) = self.tap.as_mut() {
            tap.release().map_err(|e| e.to_string())?;
        }
        Ok(())
    }
}

/// A worker thread that says when it has ended, so its owner can wait for the device to
/// be released (a process that exits while a thread still drives the GPU driver can crash
/// in the driver's teardown).
pub struct WorkerThread {
    done: Option<Receiver<()>>,
}

impl WorkerThread {
    pub fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<Self> {
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                f();
                let _ = tx.send(());
            })?;
        Ok(WorkerThread { done: Some(rx) })
    }

    /// A thread that never started (the owner reports why).
    pub fn none() -> Self {
        WorkerThread { done: None }
    }

    /// Waits up to `timeout` for the thread to end (its command channel must be closed
    /// first, and anything long-running asked to stop).
    pub fn finish(&mut self, timeout: Duration) {
        if let Some(done) = self.done.take() {
            let _ = done.recv_timeout(timeout);
        }
    }
}

/// How long a closing window waits for its worker to release the device.
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(10);

/// Runs `f`, turning a panic into an error message.
pub fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("internal error while {what}: {msg}"))
        }
    }
}

/// Drains the GPU backend's profiles, if any.
pub fn take_profiles(backend: &mut dyn Backend) -> Vec<crate::gpu::profiler::TokenProfile> {
    backend
        .gpu()
        .map(|g| std::mem::take(&mut g.profiles))
        .unwrap_or_default()
}

/// Turns GPU timings on or off for `backend`; the notice to show when they cannot be had.
pub fn set_profiling(backend: &mut dyn Backend, on: bool) -> Result<Option<String>, String> {
    match backend.gpu() {
        Some(g) => {
            let ok = g.set_profiling(on).map_err(|e| e.to_string())?;
            Ok((!ok).then(|| "this adapter has no timestamp queries: no GPU timings".into()))
        }
        None if on => Ok(Some(
            "GPU timings need a GPU device (this is the CPU reference)".into(),
        )),
        None => Ok(None),
    }
}
