//! `Session`: one sequence's conversation with a model on some device — prompt → prefill →
//! decode loop → streamed tokens — with the state carried between calls so a new turn
//! only feeds its new tokens. Devices plug in through the `Backend` trait.

use std::any::Any;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::reference::{CpuModel, Logits, Scan, State};
use crate::sampling::{Sampling, sample};

/// What a device must do for a `Session`. Positions count tokens fed since the state was
/// zero; they seed sampling (see `sampling`).
pub trait Backend: Send {
    fn config(&self) -> &ModelConfig;
    /// One line naming the device, e.g. "cpu (f32 reference)".
    fn describe(&self) -> String;
    /// Zeroes the state (a fresh sequence).
    fn reset(&mut self) -> Result<()>;
    /// Feeds `tokens` (at least one) and returns the token sampled after the last of them,
    /// which is not fed. `pos` is the position of that sampled token.
    fn prefill_sample(&mut self, tokens: &[u32], sampling: &Sampling, pos: u64) -> Result<u32>;
    /// Feeds `tokens` and returns the logits after every one of them (perplexity).
    fn prefill_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>>;
    /// Feeds `first` (at position `pos − 1`), samples the next token at `pos`, feeds it, and
    /// so on, for at most `max_new` sampled tokens. `on_token` sees every sampled token in
    /// order, a stop token too, and returns false to stop early. A sampled token in `stop`
    /// ends the loop. The last sampled token is never fed; all earlier ones are.
    /// Returns how many tokens were sampled.
    fn decode(
        &mut self,
        first: u32,
        pos: u64,
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize>;
    /// A copy of the state, to restore later.
    fn snapshot(&self) -> Result<Box<dyn Any + Send>>;
    /// Puts a snapshot back: one this device took, or a `State<f32>` (a saved state; a
    /// prefix-cache entry in host memory).
    fn restore(&mut self, snapshot: &(dyn Any + Send)) -> Result<()>;
    /// A snapshot this device took, read to the host (blocking).
    fn snapshot_state(&self, snapshot: &(dyn Any + Send)) -> Result<State<f32>> {
        snapshot
            .downcast_ref::<State<f32>>()
            .cloned()
            .ok_or_else(|| Error::InvalidInput("snapshot was taken on another device".into()))
    }
    /// Bytes a snapshot of the current state holds on the device (0 where snapshots live
    /// in host memory).
    fn snapshot_device_bytes(&self) -> u64 {
        0
    }
    /// Tokens a sequence may hold (the KV caches' rows); `None` without a limit.
    fn context(&self) -> Option<usize> {
        None
    }
    /// Tokens a prompt may be cut into multiples of, fed by one `prefill_sample` call each,
    /// with results bit for bit those of one call (the device feeds a long prompt in such
    /// blocks anyway); `None` where no cut keeps them.
    fn prefill_granule(&mut self) -> Result<Option<usize>> {
        Ok(None)
    }
    /// The GPU backend behind this device, for front-ends that show timings and state.
    fn gpu(&mut self) -> Option<&mut crate::gpu::GpuBackend> {
        None
    }
    /// The recurrent state as the CPU reference lays it out (blocking; not for hot paths).
    fn state(&self) -> Result<State<f32>>;
}

/// The CPU device: the f32 reference.
pub struct CpuBackend {
    model: CpuModel<f32>,
    state: State<f32>,
    scan: Scan,
}

impl CpuBackend {
    pub fn new(model: CpuModel<f32>) -> Self {
        let state = model.new_state();
        let scan = Scan::Chunked(model.config.chunk_size);
        CpuBackend { model, state, scan }
    }

    pub fn state(&self) -> &State<f32> {
        &self.state
    }

    /// An error naming the layer at fault when a row of `logits` (the first at position
    /// `pos0`) holds a NaN or ±Inf.
    fn check_logits(&self, logits: &[Vec<f32>], pos0: u64) -> Result<()> {
        match nonfinite_row(logits) {
            Some(i) => Err(self.state.nonfinite_logits_error(pos0 + i as u64)),
            None => Ok(()),
        }
    }

    /// Prompt tokens fed per reference call: a call holds its tokens' activations
    /// (`[tokens][width]` per layer; a 60k-token prompt took over 1 GB on the embedded
    /// model), so a long prompt goes in blocks of at least 1024 tokens, whole chunks of the
    /// scan so that its chunks are those of a single call.
    fn prefill_block(&self) -> usize {
        let q = match self.scan {
            Scan::Chunked(q) => q.max(1),
            Scan::Sequential => 1,
        };
        q * 1024usize.div_ceil(q)
    }

    /// Prefill with chunks of `q` tokens instead of the config's chunk size.
    pub fn with_chunk(mut self, q: usize) -> Self {
        self.scan = Scan::Chunked(q);
        self
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn describe(&self) -> String {
        "cpu (f32 reference)".into()
    }

    fn reset(&mut self) -> Result<()> {
        self.state = self.model.new_state();
        Ok(())
    }

    fn prefill_sample(&mut self, tokens: &[u32], sampling: &Sampling, pos: u64) -> Result<u32> {
        // Checked whole first, so a refused prompt leaves the state as it was.
        self.model.check_feed(&self.state, tokens)?;
        let block = self.prefill_block();
        let (head, last) = tokens.split_at(tokens.len() - ((tokens.len() - 1) % block + 1));
        for b in head.chunks(block) {
            self.model
                .forward(&mut self.state, b, self.scan, Logits::None)?;
        }
        let logits = self
            .model
            .forward(&mut self.state, last, self.scan, Logits::Last)?;
        self.check_logits(&logits, self.state.len as u64)?;
        Ok(sample(&logits[0], sampling, pos))
    }

    fn prefill_granule(&mut self) -> Result<Option<usize>> {
        Ok(Some(self.prefill_block()))
    }

    fn prefill_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        let first = self.state.len as u64 + 1;
        let logits = self
            .model
            .forward(&mut self.state, tokens, self.scan, Logits::All)?;
        self.check_logits(&logits, first)?;
        Ok(logits)
    }

    fn decode(
        &mut self,
        first: u32,
        pos: u64,
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<usize> {
        // Each step feeds one token: stop where the KV caches are full (as the GPU does).
        let room = self.model.context.saturating_sub(self.state.len);
        if room == 0 {
            return Err(Error::InvalidInput(format!(
                "{CONTEXT_FULL}: {} tokens (--ctx)",
                self.state.len
            )));
        }
        let max_new = max_new.min(room);
        let mut token = first;
        for i in 0..max_new {
            let logits =
                self.model
                    .forward(&mut self.state, &[token], Scan::Sequential, Logits::Last)?;
            self.check_logits(&logits, self.state.len as u64)?;
            token = sample(&logits[0], sampling, pos + i as u64);
            let go = on_token(token);
            if !go || stop.contains(&token) || i + 1 == max_new {
                return Ok(i + 1);
            }
        }
        Ok(max_new)
    }

    fn snapshot(&self) -> Result<Box<dyn Any + Send>> {
        Ok(Box::new(self.state.clone()))
    }

    fn restore(&mut self, snapshot: &(dyn Any + Send)) -> Result<()> {
        let state = snapshot
            .downcast_ref::<State<f32>>()
            .ok_or_else(|| Error::InvalidInput("snapshot was taken on another device".into()))?;
        self.state = state.clone();
        Ok(())
    }

    fn state(&self) -> Result<State<f32>> {
        Ok(self.state.clone())
    }

    fn context(&self) -> Option<usize> {
        self.model
            .config
            .attention
            .is_some()
            .then_some(self.model.context)
    }
}

/// The first row of `rows` holding a NaN or ±Inf logit, if any (a device checks its
/// logits with it, then names the layer at fault from the state: see
/// `State::nonfinite_logits_error`; a non-finite logit never becomes a sampled token).
pub(crate) fn nonfinite_row(rows: &[Vec<f32>]) -> Option<usize> {
    rows.iter()
        .position(|r| !r.iter().fold(true, |ok, v| ok & v.is_finite()))
}

/// Options of one `generate` call.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Tokens that end the reply (typically the tokenizer's EOS); they are not reported.
    pub stop: Vec<u32>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 64,
            sampling: Sampling::default(),
            stop: Vec::new(),
        }
    }
}

/// Why a `generate` call returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Finish {
    /// `max_new_tokens` were produced.
    Length,
    /// A stop token was sampled.
    Stop,
    /// The callback asked to stop.
    Cancelled,
    /// The KV caches are full (`--ctx`): no further token fits.
    ContextFull,
}

/// A saved point of a session: state plus bookkeeping, to branch or regenerate.
pub struct Snapshot {
    state: Box<dyn Any + Send>,
    pos: u64,
    pending: Option<u32>,
}

/// The last position a sequence may reach: the device counts positions in 32 bits and
/// keeps them below 2^31 (its sampling seeds and KV lengths), and so do saved states.
pub const MAX_POSITION: u64 = (1 << 31) - 1;

/// One sequence on one device. The state persists across `generate` calls: each call
/// feeds only its new tokens (plus the last token of the previous reply, which was
/// sampled but not yet fed).
pub struct Session {
    backend: Box<dyn Backend>,
    pos: u64,
    pending: Option<u32>,
    progress: Option<PromptProgress>,
}

/// Progress through long prompts: `on(0, total)` before the first piece, then `on(fed,
/// total)` after every piece of about `every` tokens (whole prefill blocks of the device),
/// the last with `fed == total`, for front-ends that draw a bar. `on` returns false to
/// stop reading: `generate` then fails with `STOPPED_READING` (the state holds the pieces
/// already fed: a `Chat` turn rolls them back, as after any failed turn).
pub struct PromptProgress {
    pub every: usize,
    pub on: Box<dyn FnMut(usize, usize) -> bool + Send>,
}

/// How every refusal of tokens past the context (`--ctx`) begins, for front-ends that
/// say how to go on (a new conversation, a larger context).
pub const CONTEXT_FULL: &str = "the context is full";

/// The error of a prompt whose reading `PromptProgress::on` stopped.
pub const STOPPED_READING: &str = "stopped while the prompt was being read";

impl Session {
    pub fn new(backend: Box<dyn Backend>) -> Self {
        Session {
            backend,
            pos: 0,
            pending: None,
            progress: None,
        }
    }

    /// Reports progress through prompts of at least two pieces (`PromptProgress`); the
    /// tokens and state are those of feeding the prompt at once.
    pub fn set_prompt_progress(&mut self, progress: Option<PromptProgress>) {
        self.progress = progress;
    }

    /// The backend's `prefill_sample`, in pieces of whole prefill blocks with progress
    /// between them where a long prompt meets a `PromptProgress`. The last piece keeps the
    /// remainder (one to two pieces long), so no piece is short enough to take another path
    /// through the device (a short prompt is fed token by token on a GPU).
    fn prefill_sample(&mut self, input: &[u32], sampling: &Sampling, end: u64) -> Result<u32> {
        // A prompt past the context goes whole, so that the device refuses it before it
        // feeds anything (a piece fed before a refusal would leave the state advanced).
        let fits = self.backend.context().is_none_or(|ctx| end <= ctx as u64);
        let piece = match &self.progress {
            Some(p) if fits && input.len() >= p.every.max(1).saturating_mul(2) => {
                match self.backend.prefill_granule()? {
                    Some(g) => p
                        .every
                        .max(1)
                        .checked_next_multiple_of(g.max(1))
                        .unwrap_or(input.len()),
                    None => input.len(),
                }
            }
            _ => input.len(),
        };
        let total = input.len();
        let mut fed = 0;
        let stopped = || Error::InvalidInput(STOPPED_READING.into());
        if total >= piece.saturating_mul(2)
            && let Some(p) = self.progress.as_mut()
            && !(p.on)(0, total)
        {
            return Err(stopped());
        }
        while total - fed >= piece.saturating_mul(2) {
            let part = &input[fed..fed + piece];
            fed += piece;
            let at = end - (total - fed) as u64;
            self.backend.prefill_sample(part, &Sampling::greedy(), at)?;
            if let Some(p) = self.progress.as_mut()
                && !(p.on)(fed, total)
            {
                return Err(stopped());
            }
        }
        let token = self.backend.prefill_sample(&input[fed..], sampling, end)?;
        if fed > 0
            && let Some(p) = self.progress.as_mut()
        {
            let _ = (p.on)(total, total);
        }
        Ok(token)
    }

    pub fn config(&self) -> &ModelConfig {
        self.backend.config()
    }

    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    /// Tokens fed into the state so far.
    pub fn position(&self) -> u64 {
        self.pos
    }

    pub fn backend_mut(&mut self) -> &mut dyn Backend {
        self.backend.as_mut()
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// Forgets everything: a fresh sequence.
    pub fn reset(&mut self) -> Result<()> {
        self.pos = 0;
        self.pending = None;
        self.backend.reset()
    }

    /// Feeds `prompt` and samples up to `max_new_tokens` tokens, calling `on_token` with
    /// each (return false to stop). Returns the reply's tokens and why it ended. On a GPU
    /// the steps already in flight when `on_token` says stop (up to two) still run and feed
    /// the state, so their tokens still come to `on_token` and into the reply: the reply
    /// is always what the state has read.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, Finish)> {
        let (reply, finish, _) = self.generate_marked(prompt, opts, false, on_token)?;
        Ok((reply, finish))
    }

    /// `generate`, with `mark`: also a snapshot of the state right after the prompt was
    /// read, nothing pending (the first reply token sampled there is dropped from it), so
    /// that a later input which extends the prompt's text differently from the reply can
    /// go on from it (`Chat`: templates that rewrite past replies). None where the snapshot
    /// failed (the reply goes on: the mark only saves a later re-read).
    pub fn generate_marked(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mark: bool,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, Finish, Option<Snapshot>)> {
        let mut marked = None;
        let mut take_mark = |s: &Self| {
            if mark {
                match s.backend.snapshot() {
                    Ok(state) => {
                        marked = Some(Snapshot {
                            state,
                            pos: s.pos,
                            pending: None,
                        })
                    }
                    Err(e) => tracing::warn!("no snapshot at the end of the prompt: {e}"),
                }
            }
        };
        opts.sampling.validate()?;
        let mut input: Vec<u32> = self.pending.into_iter().collect();
        input.extend_from_slice(prompt);
        if prompt.is_empty() {
            return Err(Error::InvalidInput("the prompt is empty".into()));
        }
        self.check_ids(&input)?;
        // Past MAX_POSITION the device's positions would wrap (a forged saved state can
        // start a sequence near it): a prompt that crosses it is refused, a reply stops
        // there (its finish says Length).
        let fed_to = self.pos + input.len() as u64;
        if fed_to > MAX_POSITION {
            return Err(Error::InvalidInput(format!(
                "this prompt would take the sequence to position {fed_to}, past the \
                 {MAX_POSITION} a sequence can reach (positions are counted in 32 bits)"
            )));
        }
        let room = (MAX_POSITION - fed_to + 1).min(usize::MAX as u64) as usize;
        let clamped;
        let opts = if opts.max_new_tokens > room {
            clamped = GenerateOptions {
                max_new_tokens: room,
                ..opts.clone()
            };
            &clamped
        } else {
            opts
        };
        let mut reply = Vec::new();
        if opts.max_new_tokens == 0 {
            // Only fed (the logits of every position, as prefill_logits keeps them, would be
            // tokens × vocab floats: gigabytes for a long prompt).
            let pos = self.pos + input.len() as u64;
            let _ = self.prefill_sample(&input, &Sampling::greedy(), pos)?;
            self.pos = pos;
            self.pending = None;
            take_mark(self);
            return Ok((reply, Finish::Length, marked));
        }
        let first_pos = self.pos + input.len() as u64;
        let first = self.prefill_sample(&input, &opts.sampling, first_pos)?;
        self.pos = first_pos;
        self.pending = Some(first);
        take_mark(self);
        if opts.stop.contains(&first) {
            return Ok((reply, Finish::Stop, marked));
        }
        reply.push(first);
        if !on_token(first) {
            return Ok((reply, Finish::Cancelled, marked));
        }
        if opts.max_new_tokens == 1 {
            return Ok((reply, Finish::Length, marked));
        }
        // A prompt that filled the context leaves no room to feed the first token: the
        // reply ends here (a decode would be refused after a token was already given out).
        if self
            .backend
            .context()
            .is_some_and(|ctx| self.pos >= ctx as u64)
        {
            return Ok((reply, Finish::ContextFull, marked));
        }
        let mut cancelled = false;
        let mut last = first;
        let sampled = self.backend.decode(
            first,
            first_pos + 1,
            opts.max_new_tokens - 1,
            &opts.sampling,
            &opts.stop,
            &mut |t| {
                last = t;
                if opts.stop.contains(&t) {
                    return false;
                }
                reply.push(t);
                let go = on_token(t);
                cancelled |= !go;
                go
            },
        )?;
        // Every sampled token but the last has been fed.
        self.pos += sampled as u64;
        self.pending = Some(last);
        // A device stops decoding early only at a stop token, a cancel, or a full context.
        let finish = if opts.stop.contains(&last) {
            Finish::Stop
        } else if cancelled {
            Finish::Cancelled
        } else if sampled < opts.max_new_tokens - 1 {
            Finish::ContextFull
        } else {
            Finish::Length
        };
        Ok((reply, finish, marked))
    }

    /// The one check where token ids enter, for every device: each must index the model's
    /// vocabulary (a tokenizer may be larger than the model's embedding).
    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.config().vocab_size;
        match ids.iter().find(|&&t| t as usize >= vocab) {
            Some(&bad) => Err(Error::InvalidInput(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            ))),
            None => Ok(()),
        }
    }

    /// Logits after every token of `tokens`, fed from the current state (perplexity).
    pub fn logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        if tokens.is_empty() {
            return Err(Error::InvalidInput("no tokens to score".into()));
        }
        self.check_ids(tokens)?;
        let mut input: Vec<u32> = self.pending.take().into_iter().collect();
        let skip = input.len();
        input.extend_from_slice(tokens);
        let mut logits = self.backend.prefill_logits(&input)?;
        self.pos += input.len() as u64;
        Ok(logits.split_off(skip))
    }

    /// The last sampled token, not yet fed (the next `generate` feeds it first).
    pub fn pending(&self) -> Option<u32> {
        self.pending
    }

    /// Continues from a saved state (`state.len` tokens fed) with `pending` sampled and
    /// not yet fed.
    pub fn load_state(
        &mut self,
        state: &crate::state::State<f32>,
        pending: Option<u32>,
    ) -> Result<()> {
        if let Some(t) = pending {
            self.check_ids(&[t])?;
        }
        self.backend.restore(state)?;
        self.pos = state.len as u64;
        self.pending = pending;
        Ok(())
    }

    pub fn snapshot(&self) -> Result<Snapshot> {
        Ok(Snapshot {
            state: self.backend.snapshot()?,
            pos: self.pos,
            pending: self.pending,
        })
    }

    pub fn restore(&mut self, s: &Snapshot) -> Result<()> {
        self.backend.restore(s.state.as_ref())?;
        self.pos = s.pos;
        self.pending = s.pending;
        Ok(())
    }
}
