//! The engine thread: one backend, many sequences. Requests join and leave between steps;
//! each step gives one sequence a prefill chunk or a few decode tokens, so a new prompt is
//! read in chunks between the running streams' tokens instead of stalling them. A sequence
//! whose state is not the backend's is kept as a device snapshot and put back when its
//! turn comes (one buffer copy each way). Tokens are sampled at their absolute positions
//! with the request's seed, so a stream's tokens do not depend on what else runs.
//!
//! Every prompt first looks up the prefix cache; the state at the end of each prompt and
//! of each reply (and every `CacheConfig::every` tokens of long prompts) is cached.
//!
//! On a GPU with more than one slot the replies decode together: a sequence whose prompt
//! is read joins a slot of the backend's batch (`gpu::batch`), and each step gives every
//! joined sequence `DECODE_QUANTUM` tokens in one pass over the weights per token, between
//! the prompt chunks of the sequences still reading theirs. Models the batch cannot run
//! (MoE) fall back to taking turns.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use super::stop::StopText;
use crate::error::Result;
use crate::prefix_cache::PrefixCache;
use crate::sampling::Sampling;
use crate::session::Backend;
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// Tokens of a prompt fed per step by default (`Engine::prefill_chunk`).
pub const PREFILL_CHUNK: usize = 512;
/// Decode tokens per step while other sequences wait.
const DECODE_QUANTUM: usize = 16;
/// Decode tokens per step when a sequence runs alone (new requests are still looked at
/// between steps).
const SOLO_QUANTUM: usize = 64;

/// One request for the engine.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_new: usize,
    pub sampling: Sampling,
    /// Token ids that end the reply (`chat::stop_ids`: the EOS and the template's
    /// end-of-turn token).
    pub stop_ids: Vec<u32>,
    /// Strings that end the reply (not included in it).
    pub stop_text: Vec<String>,
    pub events: UnboundedSender<Event>,
    /// The request's place among the server's slots and queue (None for a job made
    /// outside a server): let go of when the reply's last event is sent (`Done` or an
    /// error) or the engine drops the job (cancelled), not when the client has read the
    /// reply, so a client that stops reading a stream holds no place.
    pub place: Option<super::api::Place>,
}

/// Why a reply ended, as OpenAI names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens restored from the prefix cache instead of fed.
    pub cached_tokens: usize,
}

/// What a request hears back, in order: text pieces, then `Done` or `Error`.
#[derive(Clone, Debug)]
pub enum Event {
    Text(String),
    Done { finish: FinishReason, usage: Usage },
    Error(String),
}

/// A request in flight.
struct Seq {
    job: Job,
    /// Its state when the backend holds another's.
    parked: Option<Box<dyn Any + Send>>,
    /// Whether it has started (its first state was set up).
    started: bool,
    /// Tokens fed so far (the state's position is its length).
    fed: Vec<u32>,
    /// The last sampled token, not yet fed.
    pending: Option<u32>,
    completion: usize,
    cached: usize,
    decoder: StreamDecoder,
    stop: StopText,
    /// Its batch slot once it decodes in the batch.
    slot: Option<usize>,
    /// The reply is over (what the batch still feeds it only goes into `fed`).
    over: bool,
    /// It ended on an error (non-finite logits, a device error): its state is not cached.
    failed: bool,
    /// Its client heard the end (`Done` or `Error`).
    answered: bool,
    /// Counted in `requests_cancelled_total` (once, whichever check saw the client go).
    cancelled: bool,
}

/// What the engine thread owns.
pub struct Engine {
    pub backend: Box<dyn Backend>,
    pub tokenizer: Arc<Tokenizer>,
    pub cache: PrefixCache,
    pub metrics: Arc<Metrics>,
    /// Sequences decoded at once (the others wait in the queue).
    pub slots: usize,
    /// Tokens of a prompt fed per step, `PREFILL_CHUNK` unless a test wants a prompt read
    /// in many steps (chunks end at multiples of it, counted from position 0, so a prompt
    /// is cut the same way whatever runs beside it).
    pub prefill_chunk: usize,
}

impl Engine {
    /// Runs until `jobs` closes, then writes the prefix cache to its directory.
    pub fn run(mut self, jobs: Receiver<Job>) {
        if self.slots > 1
            && let Some(gpu) = self.backend.gpu()
        {
            let ready = gpu.enable_batch(self.slots).and_then(|()| {
                let t0 = Instant::now();
                let batch = gpu.batch.as_mut().ok_or_else(no_batch)?;
                batch.prepare(&gpu.engine)?;
                tracing::info!("batch graphs built in {:.1} s", t0.elapsed().as_secs_f64());
                Ok(())
            });
            match ready {
                Ok(()) => {
                    tracing::info!("batched decode: {} slots", self.slots);
                    return self.run_batched(jobs);
                }
                Err(e) => {
                    gpu.batch = None;
                    tracing::info!("batched decode off ({e}): sequences take turns");
                }
            }
        }
        self.run_turns(jobs)
    }

    /// Takes whatever `jobs` has into `waiting` (blocking a while when `idle`); false once
    /// the channel is closed.
    fn intake(jobs: &Receiver<Job>, waiting: &mut VecDeque<Job>, open: &mut bool, idle: bool) {
        loop {
            let job = if idle && waiting.is_empty() && *open {
                match jobs.recv_timeout(Duration::from_millis(200)) {
                    Ok(j) => Some(j),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => {
                        *open = false;
                        None
                    }
                }
            } else if *open {
                match jobs.try_recv() {
                    Ok(j) => Some(j),
                    Err(std::sync::mpsc::TryRecvError::Empty) => None,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        *open = false;
                        None
                    }
                }
            } else {
                None
            };
            match job {
                Some(j) => waiting.push_back(j),
                None => break,
            }
        }
    }

    /// Takes whatever `jobs` has into `waiting` without blocking; whether a request waits
    /// (a running round or turn then gives way to it where a slot is free).
    fn newcomer_waits(jobs: &Receiver<Job>, waiting: &mut VecDeque<Job>, open: &mut bool) -> bool {
        Self::intake(jobs, waiting, open, false);
        !waiting.is_empty()
    }

    /// Takes new requests and admits waiting ones up to the slots (a client that left
    /// before its turn frees its place); false when nothing is active.
    fn admit(
        &self,
        jobs: &Receiver<Job>,
        waiting: &mut VecDeque<Job>,
        active: &mut Vec<Seq>,
        open: &mut bool,
    ) -> bool {
        Self::intake(jobs, waiting, open, active.is_empty());
        waiting.retain(|j| {
            let gone = j.events.is_closed();
            if gone {
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            !gone
        });
        while active.len() < self.slots.max(1)
            && let Some(job) = waiting.pop_front()
        {
            active.push(Seq::new(job));
        }
        self.metrics.queued.store(waiting.len(), Ordering::Relaxed);
        self.metrics.active.store(active.len(), Ordering::Relaxed);
        !active.is_empty()
    }

    /// Removes finished sequence `i`, keeping `loaded` pointing at the same sequence (None
    /// if it was `i`), and refreshes the cache metrics.
    fn remove(&self, active: &mut Vec<Seq>, loaded: &mut Option<usize>, i: usize) -> Seq {
        let seq = active.remove(i);
        *loaded = match *loaded {
            Some(l) if l == i => None,
            Some(l) if l > i => Some(l - 1),
            other => other,
        };
        if let Ok(mut c) = self.metrics.cache.lock() {
            *c = self.cache.stats();
        }
        seq
    }

    /// `prefill_chunk`, at least one token.
    fn chunk(&self) -> usize {
        self.prefill_chunk.max(1)
    }

    /// After the last request: metrics to zero, the prefix cache written to its directory.
    fn shut_down(&mut self) {
        self.metrics.queued.store(0, Ordering::Relaxed);
        self.metrics.active.store(0, Ordering::Relaxed);
        match self.cache.persist(self.backend.as_mut()) {
            Ok(0) => {}
            Ok(n) => tracing::info!("prefix cache: {n} entries written to disk"),
            Err(e) => tracing::warn!("prefix cache: {e}"),
        }
    }

    /// The batched loop: each round, prompt chunks (up to `prefill_chunk` tokens) of the
    /// sequences still reading their prompts (in the backend's own store), then
    /// `DECODE_QUANTUM` steps of the batch.
    fn run_batched(mut self, jobs: Receiver<Job>) {
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut active: Vec<Seq> = Vec::new();
        let mut loaded: Option<usize> = None;
        let mut open = true;
        let mut turn = 0usize;
        loop {
            if !self.admit(&jobs, &mut waiting, &mut active, &mut open) {
                if !open {
                    break;
                }
                continue;
            }
            // Prompt chunks of the sequences not yet in the batch, in turn, up to
            // prefill_chunk prompt tokens per round (at least one chunk): short prompts
            // join together instead of one per round, long ones do not stall the batch.
            let mut budget = self.chunk();
            let mut tried = 0;
            loop {
                let reading: Vec<usize> = (0..active.len())
                    .filter(|&i| active[i].slot.is_none() && !active[i].over)
                    .collect();
                if reading.is_empty() || tried >= reading.len() || budget == 0 {
                    break;
                }
                tried += 1;
                turn %= reading.len();
                let i = reading[turn];
                turn += 1;
                let before = active[i].fed.len();
                let r = self
                    .switch_to(&mut active, &mut loaded, i)
                    .and_then(|()| self.step(&mut active[i], 0, &mut || false));
                budget = budget.saturating_sub((active[i].fed.len() - before).max(1));
                match r {
                    Ok(true) => active[i].over = true,
                    Ok(false) if active[i].pending.is_some() => {
                        if let Err(e) = self.join(&mut active[i]) {
                            self.fail(&mut active[i], &e);
                        }
                        loaded = None;
                    }
                    Ok(false) => {}
                    Err(e) => self.fail(&mut active[i], &e),
                }
            }
            self.decode_batch(&mut active, &jobs, &mut waiting, &mut open);
            // Replies that are over leave (their state cached) and free their slot.
            let mut i = 0;
            while i < active.len() {
                if !active[i].over {
                    i += 1;
                    continue;
                }
                let seq = self.remove(&mut active, &mut loaded, i);
                if let Some(slot) = seq.slot {
                    self.leave(&mut active, &mut loaded, slot, &seq);
                }
            }
            self.metrics.active.store(active.len(), Ordering::Relaxed);
        }
        self.shut_down();
    }

    /// Sends `e` to a sequence and ends it.
    fn fail(&self, seq: &mut Seq, e: &crate::Error) {
        fail_with(&self.metrics, seq, e.to_string());
    }

    /// Moves a sequence whose prompt was just read (its state the backend's own) into a
    /// free batch slot.
    fn join(&mut self, seq: &mut Seq) -> Result<()> {
        let Some(first) = seq.pending else {
            return Ok(());
        };
        let pos = seq.fed.len() as u64 + 1;
        let gpu = self.backend.gpu().ok_or_else(no_batch)?;
        let batch = gpu.batch.as_mut().ok_or_else(no_batch)?;
        let slot = batch.free_slot().ok_or_else(no_batch)?;
        batch.join(
            &gpu.engine,
            slot,
            first,
            pos,
            &seq.job.sampling,
            &seq.job.stop_ids,
        )?;
        seq.slot = Some(slot);
        Ok(())
    }

    /// Frees `seq`'s slot; its state goes back to the backend's own store (whoever held
    /// that is parked first) and into the prefix cache.
    fn leave(&mut self, active: &mut [Seq], loaded: &mut Option<usize>, slot: usize, seq: &Seq) {
        if let Some(l) = loaded.take()
            && l < active.len()
        {
            match self.backend.snapshot() {
                Ok(s) => active[l].parked = Some(s),
                Err(e) => self.fail(&mut active[l], &e),
            }
        }
        // A reply that failed leaves its state behind: non-finite logits most likely left
        // a non-finite state, which a cached entry would hand to the next request.
        let keep = !seq.failed;
        let r = (|| {
            let gpu = self.backend.gpu().ok_or_else(no_batch)?;
            let batch = gpu.batch.as_mut().ok_or_else(no_batch)?;
            batch.leave(&mut gpu.engine, slot, keep)
        })();
        match r {
            Ok(()) if keep => self.remember(&seq.fed),
            Ok(()) => {}
            Err(e) => tracing::warn!("batch slot {slot}: {e}"),
        }
    }

    /// Caches the state the backend holds under `fed`, best effort: the request it came
    /// from has run (or is running) whatever the cache does, so a failure is only logged.
    fn remember(&mut self, fed: &[u32]) {
        if let Err(e) = self.cache.insert(fed, self.backend.as_mut()) {
            tracing::warn!(
                "prefix cache: not keeping a state of {} tokens: {e}",
                fed.len()
            );
        }
    }

    /// Up to `DECODE_QUANTUM` steps of every sequence in the batch.
    fn decode_batch(
        &mut self,
        active: &mut [Seq],
        jobs: &Receiver<Job>,
        waiting: &mut VecDeque<Job>,
        open: &mut bool,
    ) {
        let ctx = self.backend.context();
        // Sequences that cannot go on end before the step: a closed client, a full context.
        let mut steps = DECODE_QUANTUM;
        for seq in active.iter_mut().filter(|s| s.slot.is_some() && !s.over) {
            if seq.job.events.is_closed() {
                seq.cancel(&self.metrics);
                seq.over = true;
                continue;
            }
            if let Some(ctx) = ctx {
                let room = ctx.saturating_sub(seq.fed.len());
                if room == 0 {
                    seq.end(FinishReason::Length, &self.metrics);
                    seq.over = true;
                    continue;
                }
                steps = steps.min(room);
            }
        }
        // Lanes of replies already over are stopped: the step feeds them nothing.
        let mut by_slot: Vec<Option<usize>> = vec![None; self.slots];
        {
            let Some(gpu) = self.backend.gpu() else {
                return;
            };
            let Some(batch) = gpu.batch.as_mut() else {
                return;
            };
            for (i, s) in active.iter().enumerate() {
                match s.slot {
                    Some(slot) if s.over => batch.stop(&gpu.engine, slot),
                    Some(slot) => by_slot[slot] = Some(i),
                    None => {}
                }
            }
        }
        if by_slot.iter().all(Option::is_none) {
            return;
        }
        // With a slot free (from the start, or once a reply ends during the round), a
        // request that comes in ends the round early: it waits for the steps in flight, not
        // for the whole quantum, before its prompt is read (its time to first token, on top
        // of its prompt's).
        let free_at_start = active.len() < self.slots;
        let one_ended = std::cell::Cell::new(false);
        let mut more =
            || !((free_at_start || one_ended.get()) && Self::newcomer_waits(jobs, waiting, open));
        let t0 = Instant::now();
        let (tok, metrics) = (self.tokenizer.clone(), self.metrics.clone());
        let mut on_token = |slot: usize, c: &crate::gpu::graph::Ctrl| -> bool {
            let Some(i) = by_slot.get(slot).copied().flatten() else {
                return false;
            };
            let seq = &mut active[i];
            if let Some(p) = seq.pending.replace(c.token) {
                seq.fed.push(p);
            }
            if seq.over {
                return false;
            }
            if c.nonfinite != 0 {
                let e = format!(
                    "the logits at position {} hold a NaN or an infinity",
                    c.kv_len
                );
                fail_with(&metrics, seq, e);
                return false;
            }
            if handle_token(seq, c.token, &tok, &metrics) {
                seq.over = true;
                return false;
            }
            if seq.completion >= seq.job.max_new {
                seq.end(FinishReason::Length, &metrics);
                seq.over = true;
                return false;
            }
            true
        };
        let r = {
            let Some(gpu) = self.backend.gpu() else {
                return;
            };
            let Some(batch) = gpu.batch.as_mut() else {
                return;
            };
            batch.step_while(
                &gpu.engine,
                steps,
                &mut |slot, c| {
                    let go = on_token(slot, c);
                    if !go {
                        one_ended.set(true);
                    }
                    go
                },
                &mut more,
            )
        };
        self.metrics
            .decode_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if let Err(e) = r {
            for seq in active.iter_mut().filter(|s| s.slot.is_some() && !s.over) {
                self.fail(seq, &e);
            }
        }
    }

    /// The loop of sequences taking turns with the backend's one state.
    fn run_turns(mut self, jobs: Receiver<Job>) {
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut active: Vec<Seq> = Vec::new();
        // Which sequence's state the backend holds (an index into `active`).
        let mut loaded: Option<usize> = None;
        let mut open = true;
        let mut turn = 0usize;
        loop {
            if !self.admit(&jobs, &mut waiting, &mut active, &mut open) {
                if !open {
                    break;
                }
                continue;
            }
            turn %= active.len();
            let quantum = if active.len() == 1 {
                SOLO_QUANTUM
            } else {
                DECODE_QUANTUM
            };
            // With a place free, a request that comes in ends the turn early: it waits for
            // the tokens in flight, not for the whole quantum, before its prompt is read.
            let free = active.len() < self.slots.max(1);
            let mut arrived = || free && Self::newcomer_waits(&jobs, &mut waiting, &mut open);
            let done = match self.switch_to(&mut active, &mut loaded, turn) {
                Ok(()) => self.step(&mut active[turn], quantum, &mut arrived),
                Err(e) => Err(e),
            };
            let finished = match done {
                Ok(false) => false,
                Ok(true) => true,
                Err(e) => {
                    active[turn].error(e.to_string());
                    self.metrics.failed.fetch_add(1, Ordering::Relaxed);
                    // A device error may leave the state anywhere: start the next one afresh.
                    true
                }
            };
            if finished {
                self.remove(&mut active, &mut loaded, turn);
                self.metrics.active.store(active.len(), Ordering::Relaxed);
            } else {
                turn += 1;
            }
        }
        self.shut_down();
    }

    /// Makes the backend hold sequence `i`'s state: parks the one it holds, then restores
    /// `i`'s snapshot (or sets up its first state from the prefix cache).
    fn switch_to(
        &mut self,
        active: &mut [Seq],
        loaded: &mut Option<usize>,
        i: usize,
    ) -> Result<()> {
        if *loaded == Some(i) {
            return Ok(());
        }
        if let Some(l) = *loaded
            && l < active.len()
        {
            active[l].parked = Some(self.backend.snapshot()?);
        }
        *loaded = None;
        let seq = &mut active[i];
        if let Some(snap) = seq.parked.take() {
            self.backend.restore(snap.as_ref())?;
        } else if !seq.started {
            self.backend.reset()?;
            let prompt = &seq.job.prompt;
            if prompt.is_empty() {
                return Err(crate::Error::InvalidInput("the prompt is empty".into()));
            }
            // At least one token is fed: its logits sample the first reply token.
            let hit =
                self.cache
                    .resume(prompt, prompt.len() - 1, self.backend.as_mut(), &mut |n| {
                        tracing::warn!("{n}")
                    });
            seq.fed.extend_from_slice(&prompt[..hit]);
            seq.cached = hit;
            seq.started = true;
            let m = &self.metrics;
            m.prompt_tokens
                .fetch_add(prompt.len() as u64, Ordering::Relaxed);
            m.cached_tokens.fetch_add(hit as u64, Ordering::Relaxed);
            if hit > 0 {
                m.cache_hits.fetch_add(1, Ordering::Relaxed);
            } else {
                m.cache_misses.fetch_add(1, Ordering::Relaxed);
            }
        }
        *loaded = Some(i);
        Ok(())
    }

    /// One step of `seq`, whose state the backend holds. Returns whether it finished.
    fn step(
        &mut self,
        seq: &mut Seq,
        quantum: usize,
        yield_now: &mut dyn FnMut() -> bool,
    ) -> Result<bool> {
        if seq.job.events.is_closed() {
            seq.cancel(&self.metrics);
            return Ok(true);
        }
        let prompt_len = seq.job.prompt.len();
        let pos = seq.fed.len();
        if pos < prompt_len {
            // Chunks end at multiples of prefill_chunk and of `--cache-every`, so that an
            // entry is left every `every` tokens whatever it is.
            let every = self.cache.config().every;
            let chunk = self.chunk();
            let mut end = ((pos / chunk + 1) * chunk).min(prompt_len);
            if let Some(k) = pos.checked_div(every) {
                end = end.min((k + 1) * every);
            }
            let piece = seq.job.prompt[pos..end].to_vec();
            if let Some(ctx) = self.backend.context()
                && prompt_len > ctx
            {
                return Err(crate::Error::InvalidInput(format!(
                    "the prompt has {prompt_len} tokens, the context holds {ctx}"
                )));
            }
            // Every chunk's time counts as prefill (the metric once took the last only).
            let t0 = Instant::now();
            let last = end == prompt_len;
            // A middle chunk's sampled token is not used.
            let sampling = if last {
                seq.job.sampling
            } else {
                Sampling::greedy()
            };
            let first = self.backend.prefill_sample(&piece, &sampling, end as u64)?;
            seq.fed.extend_from_slice(&piece);
            if last || (every > 0 && end.is_multiple_of(every)) {
                self.remember(&seq.fed);
            }
            self.metrics
                .prefill_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if !last {
                return Ok(false);
            }
            seq.pending = Some(first);
            return Ok(self.emit(seq, first));
        }
        let Some(first) = seq.pending else {
            return Ok(true);
        };
        if let Some(ctx) = self.backend.context()
            && seq.fed.len() >= ctx
        {
            return self.finish(seq, FinishReason::Length);
        }
        let want = quantum.min(seq.job.max_new - seq.completion);
        let t0 = Instant::now();
        let mut sampled = Vec::with_capacity(want);
        let mut ended = false;
        // The turn gave way to a new request (`yield_now`): the reply goes on next turn.
        let mut yielded = false;
        let job_stop = seq.job.stop_ids.clone();
        let sampling = seq.job.sampling;
        let next_pos = seq.fed.len() as u64 + 1;
        let n = {
            let backend = self.backend.as_mut();
            let mut on_token = |t: u32| {
                sampled.push(t);
                // Tokens still in flight after the reply ended are fed, not sent.
                if !ended {
                    ended = handle_token(seq, t, &self.tokenizer, &self.metrics);
                }
                if !ended && !yielded {
                    yielded = yield_now();
                }
                !ended && !yielded
            };
            backend.decode(first, next_pos, want, &sampling, &job_stop, &mut on_token)?
        };
        self.metrics
            .decode_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        // Every sampled token but the last has been fed; the last is pending.
        seq.fed.push(first);
        if n > 0 {
            seq.fed.extend_from_slice(&sampled[..n - 1]);
            seq.pending = Some(sampled[n - 1]);
        }
        if ended || seq.job.events.is_closed() {
            if seq.job.events.is_closed() {
                seq.cancel(&self.metrics);
            }
            self.remember(&seq.fed);
            return Ok(true);
        }
        if seq.completion >= seq.job.max_new || (n < want && !yielded) {
            // The caches filled up (n < want without a stop) or the length was reached.
            return self.finish(seq, FinishReason::Length);
        }
        Ok(false)
    }

    /// Handles a sampled token; true when the reply is over (the `Done` event sent).
    fn emit(&mut self, seq: &mut Seq, t: u32) -> bool {
        let ended = handle_token(seq, t, &self.tokenizer, &self.metrics);
        if ended {
            self.remember(&seq.fed);
            return true;
        }
        if seq.completion >= seq.job.max_new {
            let _ = self.finish(seq, FinishReason::Length);
            return true;
        }
        false
    }

    fn finish(&mut self, seq: &mut Seq, why: FinishReason) -> Result<bool> {
        seq.end(why, &self.metrics);
        self.remember(&seq.fed);
        Ok(true)
    }
}

fn no_batch() -> crate::Error {
    crate::Error::Gpu("the batch is gone".into())
}

/// Sends `message` to a sequence as its error and ends it (`Engine::fail`, and the decode
/// step's callback, which cannot borrow the engine).
fn fail_with(metrics: &Metrics, seq: &mut Seq, message: String) {
    seq.error(message);
    metrics.failed.fetch_add(1, Ordering::Relaxed);
    seq.over = true;
    seq.failed = true;
}

/// Handles sampled token `t` of `seq`: a stop id, a stop string or a closed client ends
/// the reply (sending `Done` where the client still listens); else its text goes out.
fn handle_token(seq: &mut Seq, t: u32, tok: &Tokenizer, metrics: &Metrics) -> bool {
    if seq.job.events.is_closed() {
        seq.cancel(metrics);
        return true;
    }
    if seq.job.stop_ids.contains(&t) {
        seq.end(FinishReason::Stop, metrics);
        return true;
    }
    seq.completion += 1;
    metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
    let piece = match seq.decoder.step(tok, t) {
        Ok(p) => p.unwrap_or_default(),
        Err(e) => {
            seq.error(e.to_string());
            metrics.failed.fetch_add(1, Ordering::Relaxed);
            seq.answered = true;
            return true;
        }
    };
    let (out, hit) = seq.stop.push(&piece);
    if !out.is_empty() {
        let _ = seq.job.events.send(Event::Text(out));
    }
    if hit {
        seq.end(FinishReason::Stop, metrics);
        return true;
    }
    false
}

impl Seq {
    fn new(job: Job) -> Self {
        let stop = StopText::new(job.stop_text.clone());
        Seq {
            job,
            parked: None,
            started: false,
            fed: Vec::new(),
            pending: None,
            completion: 0,
            cached: 0,
            decoder: StreamDecoder::default(),
            stop,
            slot: None,
            over: false,
            failed: false,
            answered: false,
            cancelled: false,
        }
    }

    /// Counts the request as cancelled, once: its client went away before the reply's end
    /// (one that leaves after hearing it is not counted).
    fn cancel(&mut self, metrics: &Metrics) {
        if !self.cancelled && !self.answered && !self.failed {
            self.cancelled = true;
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Ends the reply with an error, and lets its place go.
    fn error(&mut self, message: String) {
        // The place first: a client that sends its next request on hearing the end must
        // find it free.
        self.job.place = None;
        let _ = self.job.events.send(Event::Error(message));
    }

    /// Ends the reply: the text still held back for the stop strings (none after a stop
    /// string was found), then `Done`.
    fn end(&mut self, why: FinishReason, metrics: &Metrics) {
        let tail = self.stop.flush();
        if !tail.is_empty() {
            let _ = self.job.events.send(Event::Text(tail));
        }
        // The reply is over: its place goes to the next request before the client hears
        // so (this sequence may stay in `active` for a few more steps, and its slot is
        // only taken by a newcomer after it leaves).
        self.job.place = None;
        let _ = self.job.events.send(Event::Done {
            finish: why,
            usage: self.usage(),
        });
        self.answered = true;
        metrics.completed.fetch_add(1, Ordering::Relaxed);
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.job.prompt.len(),
            completion_tokens: self.completion,
            cached_tokens: self.cached,
        }
    }
}
