//! `GpuBackend`: the session's device on a GPU. A decode token is one encoder, one pass,
//! one submit; the token id stays on the device (the sampler writes it, the next embed
//! reads it) and comes back to the host through a ring of small staging buffers mapped
//! asynchronously, so the host never waits on the token it just submitted.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Instant;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gpu::context::GpuContext;
use crate::gpu::engine::{Engine, PROMPT_WINDOW, PrefillMode, SHORT_PROMPT, SHORT_PROMPT_COOP};
use crate::gpu::graph::{Ctrl, Tail};
use crate::gpu::prefill::{MAX_LOGITS_BLOCK, Prefill};
use crate::gpu::profiler::{KernelTime, Profiler, TokenProfile};
use crate::gpu::state_store::{DeviceSnapshot, KvFormat};
use crate::sampling::Sampling;
use crate::session::{Backend, nonfinite_row};
use crate::state::LayerState;

/// Tokens in flight in the decode loop.
pub const RING: usize = 3;
/// Prompt positions whose logits are read back per submit.
const LOGITS_WINDOW: usize = 32;

type MapResult = mpsc::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>;

/// A GPU device for `Session`.
pub struct GpuBackend {
    pub engine: Engine,
    /// The chunked-prefill blocks, made on first use.
    prefill: Option<Prefill>,
    ring: Vec<wgpu::Buffer>,
    profiler: Option<Profiler>,
    /// Profiles of the decoded tokens while profiling is on (most recent last).
    pub profiles: Vec<TokenProfile>,
    /// The batched-decode store, when sequences decode together (`enable_batch`).
    pub batch: Option<crate::gpu::batch::Batch>,
    /// When set, each unprofiled decode token's host times (recording its dispatches,
    /// submitting them; ns) are appended: what bounds the token rate where the GPU is faster.
    pub host_times: Option<Vec<(f64, f64)>>,
}

impl GpuBackend {
    pub fn new(engine: Engine) -> Result<Self> {
        let ctx = engine.ctx().clone();
        let ring = (0..RING)
            .map(|i| {
                ctx.buffer(
                    &format!("token ring {i}"),
                    64,
                    wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                )
            })
            .collect::<Result<_>>()?;
        Ok(GpuBackend {
            engine,
            ring,
            prefill: None,
            profiler: None,
            profiles: Vec::new(),
            batch: None,
            host_times: None,
        })
    }

    /// Makes a batch of `slots` sequences (replacing any), or says why this model cannot
    /// decode in batches.
    pub fn enable_batch(&mut self, slots: usize) -> Result<()> {
        self.batch = None;
        self.batch = Some(crate::gpu::batch::Batch::new(&self.engine, slots)?);
        Ok(())
    }

    /// Turns per-kernel GPU timing on or off (off costs nothing). Returns false when the
    /// adapter has no timestamp queries.
    pub fn set_profiling(&mut self, on: bool) -> Result<bool> {
        if !on {
            self.profiler = None;
            return Ok(true);
        }
        let max = self
            .engine
            .graph(Tail::Sample)
            .len()
            .max(self.engine.graph(Tail::Greedy).len());
        self.profiler = Profiler::new(self.engine.ctx(), max)?;
        Ok(self.profiler.is_some())
    }

    fn ctrl(&self, token: u32, pos: u64, sampling: &Sampling, stop: &[u32]) -> Result<Ctrl> {
        Ctrl::sequence(token, pos, self.engine.len, sampling, stop)
    }

    /// The error for non-finite logits at position `pos`, naming the layer at fault from
    /// the state read back (only done once the sampler has flagged it: never per token).
    fn nonfinite_error(&self, pos: u64) -> Error {
        let state = match self.engine.read_state() {
            Ok(s) => s,
            Err(e) => return e,
        };
        let mut e = state.nonfinite_logits_error(pos);
        // An Inf in a KV cache is most likely an f16 overflow.
        let kv_overflow = state.first_nonfinite().is_some_and(|b| {
            b.value.is_infinite() && matches!(state.layers[b.layer], LayerState::Attention { .. })
        });
        if let (Error::NonFinite(m), true, KvFormat::F16) =
            (&mut e, kv_overflow, self.engine.state.kv)
        {
            m.push_str(" (the KV cache holds f16, which ends at ±65504: try --kv f32)");
        }
        e
    }

    /// An error naming the layer at fault when a row of `logits` (the first at position
    /// `pos0`) holds a NaN or ±Inf.
    fn check_logits(&self, logits: &[Vec<f32>], pos0: u64) -> Result<()> {
        match nonfinite_row(logits) {
            Some(i) => Err(self.nonfinite_error(pos0 + i as u64)),
            None => Ok(()),
        }
    }

    /// Feeds `tokens` window by window through the decode graph; the last token gets
    /// `last` as its tail. With `logits`, each position's logits are copied out.
    fn feed(
        &mut self,
        tokens: &[u32],
        mut ctrl: Ctrl,
        last: Tail,
        mut logits: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<()> {
        let ctx = self.engine.ctx().clone();
        let vocab = self.engine.config.vocab_size;
        let window = if logits.is_some() {
            LOGITS_WINDOW
        } else {
            PROMPT_WINDOW
        };
        let readback = match logits {
            Some(_) => Some(logits_readback(&ctx, vocab, window)?),
            None => None,
        };
        self.engine.check_room(tokens.len())?;
        let start = self.engine.len;
        for (wi, chunk) in tokens.chunks(window).enumerate() {
            ctx.queue
                .write_buffer(&self.engine.scratch.prompt, 0, bytemuck::cast_slice(chunk));
            ctrl.kv_len = (start + wi * window) as u32;
            ctrl.token = chunk[0];
            ctrl.cursor = 0;
            ctrl.prompt_len = chunk.len() as u32;
            self.engine.write_ctrl(&ctrl);
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            for (i, _) in chunk.iter().enumerate() {
                let is_last = wi * window + i + 1 == tokens.len();
                let tail = match (is_last, &readback) {
                    (true, _) => last,
                    (false, Some(_)) => Tail::FeedLogits,
                    (false, None) => Tail::Feed,
                };
                {
                    let rows = (start + wi * window + i + 1) as u32;
                    let mut pass = enc.begin_compute_pass(&Default::default());
                    self.engine.graph(tail).record(&mut pass, None, Some(rows));
                }
                if let Some(rb) = &readback {
                    let off = (4 * vocab * i) as u64;
                    enc.copy_buffer_to_buffer(
                        &self.engine.scratch.logits,
                        0,
                        rb,
                        off,
                        Some(4 * vocab as u64),
                    );
                }
            }
            ctx.queue.submit([enc.finish()]);
            if let (Some(rb), Some(out)) = (&readback, logits.as_deref_mut()) {
                read_logits(&ctx, rb, vocab, chunk.len(), out)?;
            }
        }
        self.engine.len = start + tokens.len();
        ctx.check()
    }

    /// The chunked prefill of `tokens`, block by block. With `head`, the last token's
    /// residual then goes through final norm, lm_head and the sampler (`ctrl.token` holds
    /// the next token); with `logits`, every position's logits are read back instead.
    fn prefill_chunked(
        &mut self,
        tokens: &[u32],
        mut ctrl: Ctrl,
        head: Option<Tail>,
        mut logits: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<()> {
        let want_logits = logits.is_some();
        let p = prefill_blocks(&mut self.prefill, &self.engine, want_logits)?;
        let ctx = self.engine.ctx().clone();
        let (vocab, d) = (self.engine.config.vocab_size, self.engine.config.d_model);
        let block = if want_logits {
            p.max_tokens.min(MAX_LOGITS_BLOCK)
        } else {
            p.max_tokens
        };
        let readback = if want_logits {
            Some(logits_readback(&ctx, vocab, block)?)
        } else {
            None
        };
        let head_graph = head.map(|t| self.engine.head_graph(t));
        self.engine.check_room(tokens.len())?;
        let start = self.engine.len;
        let blocks: Vec<&[u32]> = tokens.chunks(block).collect();
        for (bi, chunk) in blocks.iter().enumerate() {
            let last = bi + 1 == blocks.len();
            ctx.queue
                .write_buffer(&p.prompt, 0, bytemuck::cast_slice(chunk));
            ctrl.prompt_len = chunk.len() as u32;
            ctrl.kv_len = (start + bi * block) as u32;
            self.engine.write_ctrl(&ctrl);
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                let graph = if want_logits {
                    p.logits_graph.as_ref().expect("logits graph")
                } else {
                    p.graph_for(chunk.len())
                };
                graph.record(&mut pass, None, Some(chunk.len() as u32));
            }
            if let (true, Some(g)) = (last, &head_graph) {
                let row = (4 * d * (chunk.len() - 1)) as u64;
                enc.copy_buffer_to_buffer(
                    &p.resid,
                    row,
                    &self.engine.scratch.resid,
                    0,
                    Some(4 * d as u64),
                );
                let mut pass = enc.begin_compute_pass(&Default::default());
                g.record(&mut pass, None, None);
            }
            if let (Some(rb), Some(src)) = (&readback, &p.logits) {
                let bytes = (4 * vocab * chunk.len()) as u64;
                enc.copy_buffer_to_buffer(src, 0, rb, 0, Some(bytes));
            }
            ctx.queue.submit([enc.finish()]);
            if let (Some(rb), Some(out)) = (&readback, logits.as_deref_mut()) {
                read_logits(&ctx, rb, vocab, chunk.len(), out)?;
            }
        }
        self.engine.len = start + tokens.len();
        ctx.check()
    }

    /// Feeds `tokens` through the chunked prefill with GPU timestamps (one block per
    /// submit, waited for): the kernel times of all blocks, in dispatch order per block.
    pub fn profile_prefill(&mut self, tokens: &[u32]) -> Result<Vec<KernelTime>> {
        // The checks every other way in makes (none, or an id the embedding gather would
        // read unchecked, is an error).
        self.check_tokens(tokens)?;
        let mut ctrl = self.ctrl(tokens[0], 0, &Sampling::greedy(), &[])?;
        let p = prefill_blocks(&mut self.prefill, &self.engine, false)?;
        let ctx = self.engine.ctx().clone();
        let profiler = Profiler::new(&ctx, p.most_dispatches())?
            .ok_or_else(|| Error::Gpu("this adapter has no timestamp queries".into()))?;
        let mut times = Vec::new();
        self.engine.check_room(tokens.len())?;
        for chunk in tokens.chunks(p.max_tokens) {
            ctx.queue
                .write_buffer(&p.prompt, 0, bytemuck::cast_slice(chunk));
            ctrl.prompt_len = chunk.len() as u32;
            ctrl.kv_len = self.engine.len as u32;
            self.engine.len += chunk.len();
            self.engine.write_ctrl(&ctrl);
            let graph = p.graph_for(chunk.len());
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            profiler.record(&mut enc, graph, Some(chunk.len() as u32))?;
            ctx.queue.submit([enc.finish()]);
            times.extend(profiler.read(&ctx, graph)?);
        }
        ctx.check()?;
        Ok(times)
    }

    /// Records one decode token (+ the ring copy) and submits it; with the profiler on,
    /// waits and keeps its profile. `rows`: the KV cache rows in use after the step.
    fn submit_token(
        &mut self,
        tail: Tail,
        slot: usize,
        rows: usize,
    ) -> Result<wgpu::SubmissionIndex> {
        let ctx = self.engine.ctx().clone();
        let t0 = Instant::now();
        let rows = Some(rows as u32);
        let graph = self.engine.graph(tail);
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        match &self.profiler {
            Some(p) => p.record(&mut enc, graph, rows)?,
            None => {
                let mut pass = enc.begin_compute_pass(&Default::default());
                graph.record(&mut pass, None, rows);
            }
        }
        enc.copy_buffer_to_buffer(&self.engine.scratch.ctrl, 0, &self.ring[slot], 0, Some(64));
        let cmd = enc.finish();
        let t1 = Instant::now();
        let index = ctx.queue.submit([cmd]);
        let t2 = Instant::now();
        if self.profiler.is_none()
            && let Some(v) = &mut self.host_times
        {
            v.push(((t1 - t0).as_nanos() as f64, (t2 - t1).as_nanos() as f64));
        }
        if let Some(p) = &self.profiler {
            let kernels = p.read(&ctx, self.engine.graph(tail))?;
            self.profiles.push(TokenProfile {
                kernels,
                encode_ns: (t1 - t0).as_nanos() as f64,
                submit_ns: (t2 - t1).as_nanos() as f64,
            });
        }
        Ok(index)
    }

    fn read_slot(&self, slot: usize, index: wgpu::SubmissionIndex, rx: MapResult) -> Result<Ctrl> {
        let ctx = self.engine.ctx();
        ctx.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map_err(|e| Error::Gpu(format!("waiting for a token: {e}")))?;
        recv(rx)?;
        // Mapped from here: unmapped whatever the read gives.
        let ctrl = self.ring[slot]
            .get_mapped_range(..)
            .map(|view| bytemuck::pod_read_unaligned::<Ctrl>(&view[..std::mem::size_of::<Ctrl>()]))
            .map_err(|e| Error::Gpu(format!("token readback: {e}")));
        self.ring[slot].unmap();
        let ctrl = ctrl?;
        ctx.check()?;
        Ok(ctrl)
    }

    /// After `err` ended a decode with steps still in flight: waits for them and unmaps
    /// their ring buffers (`settle_ring`); returns `err`.
    fn settle(
        &self,
        inflight: VecDeque<(usize, wgpu::SubmissionIndex, MapResult)>,
        err: Error,
    ) -> Error {
        settle_ring(&self.engine.ctx().device, &self.ring, inflight);
        err
    }
}

/// The chunked-prefill blocks for the engine's chunk size, with the logits graph when
/// `logits`: the ones in `slot` when they fit, else new ones (the old freed first).
fn prefill_blocks<'a>(
    slot: &'a mut Option<Prefill>,
    engine: &Engine,
    logits: bool,
) -> Result<&'a Prefill> {
    let p = match slot.take() {
        Some(p) if p.chunk == engine.chunk && (!logits || p.logits_graph.is_some()) => p,
        old => {
            drop(old); // free the old blocks before making new ones
            Prefill::new(engine, engine.chunk, logits)?
        }
    };
    Ok(slot.insert(p))
}

/// A mappable buffer for `rows` rows of logits.
fn logits_readback(ctx: &GpuContext, vocab: usize, rows: usize) -> Result<wgpu::Buffer> {
    ctx.buffer(
        "logits readback",
        (4 * vocab * rows) as u64,
        wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
    )
}

/// Appends the first `rows` rows of logits in `rb` to `out` (after the copies were submitted).
fn read_logits(
    ctx: &GpuContext,
    rb: &wgpu::Buffer,
    vocab: usize,
    rows: usize,
    out: &mut Vec<Vec<f32>>,
) -> Result<()> {
    let bytes = ctx.read_mapped(rb, (4 * vocab * rows) as u64)?;
    let values: &[f32] = bytemuck::cast_slice(&bytes);
    out.extend(values.chunks(vocab).map(<[f32]>::to_vec));
    Ok(())
}

/// Waits for the `pending` readbacks of an abandoned step loop and unmaps the ring buffers
/// they mapped, so the next loop finds the ring unmapped (a buffer left mapped fails every
/// later copy into it). Errors here echo the one that ended the loop and are dropped.
pub(crate) fn settle_ring(
    device: &wgpu::Device,
    ring: &[wgpu::Buffer],
    pending: impl IntoIterator<Item = (usize, wgpu::SubmissionIndex, MapResult)>,
) {
    for (slot, index, rx) in pending {
        let _ = device.poll(wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: None,
        });
        if let Ok(Ok(())) = rx.recv() {
            ring[slot].unmap();
        }
    }
}

pub(crate) fn recv(rx: MapResult) -> Result<()> {
    rx.recv()
        .map_err(|_| Error::Gpu("buffer map callback dropped (device lost?)".into()))?
        .map_err(|e| Error::Gpu(format!("buffer map failed: {e}")))
}

impl GpuBackend {
    /// Where ids enter the device: the embedding gather reads row `id` unchecked, so an id
    /// past the vocabulary must stop here (as `CpuModel::forward` does on the CPU).
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.engine.config.vocab_size;
        if tokens.is_empty() {
            return Err(Error::InvalidInput("no tokens to feed".into()));
        }
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(&bad) => Err(Error::InvalidInput(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            ))),
            None => Ok(()),
        }
    }

    /// The longest prompt `PrefillMode::Auto` feeds through the decode graph:
    /// MAMBA2_SHORT_PROMPT, else `SHORT_PROMPT_COOP` where the short block's projections
    /// run on the tensor cores (a device with cooperative matrices and projections the
    /// cooperative GEMM takes), else `SHORT_PROMPT`.
    fn short_prompt(&self) -> usize {
        use crate::gpu::kernels::gemm_coop;
        let coop = self.engine.ctx().caps.coop_matrix
            && self
                .engine
                .weights
                .dense_projections()
                .any(gemm_coop::takes);
        crate::gpu::prefill::short_prompt_override().unwrap_or(if coop {
            SHORT_PROMPT_COOP
        } else {
            SHORT_PROMPT
        })
    }
}

impl Backend for GpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.engine.config
    }

    fn describe(&self) -> String {
        // The asked format, and what the matrices are held in when that differs.
        let counts = self.engine.weights.format_counts();
        let mut format = self.engine.format.name().to_string();
        if counts.iter().any(|&(f, _)| f != self.engine.format) {
            let held: Vec<String> = counts
                .iter()
                .map(|(f, n)| format!("{n} {}", f.name()))
                .collect();
            format = format!("{format}: matrices in {}", held.join(", "));
        }
        format!(
            "{} ({}, {})",
            self.engine.ctx().describe(),
            format,
            if self.engine.fused {
                "fused"
            } else {
                "unfused"
            }
        )
    }

    fn reset(&mut self) -> Result<()> {
        self.engine.reset_state()
    }

    fn prefill_sample(&mut self, tokens: &[u32], sampling: &Sampling, pos: u64) -> Result<u32> {
        self.check_tokens(tokens)?;
        let tail = Tail::sampling(sampling);
        let ctrl = self.ctrl(tokens[0], pos, sampling, &[])?;
        match self.engine.prefill_mode {
            PrefillMode::Decode => self.feed(tokens, ctrl, tail, None)?,
            PrefillMode::Auto if tokens.len() <= self.short_prompt() => {
                self.feed(tokens, ctrl, tail, None)?
            }
            PrefillMode::Auto | PrefillMode::Chunked => {
                self.prefill_chunked(tokens, ctrl, Some(tail), None)?
            }
        }
        let c = self.engine.read_ctrl()?;
        if c.nonfinite != 0 {
            return Err(self.nonfinite_error(self.engine.len as u64));
        }
        Ok(c.token)
    }

    fn prefill_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.check_tokens(tokens)?;
        let ctrl = self.ctrl(tokens[0], 0, &Sampling::greedy(), &[])?;
        let first = self.engine.len as u64 + 1;
        let mut out = Vec::with_capacity(tokens.len());
        match self.engine.prefill_mode {
            PrefillMode::Decode => self.feed(tokens, ctrl, Tail::FeedLogits, Some(&mut out))?,
            PrefillMode::Auto | PrefillMode::Chunked => {
                self.prefill_chunked(tokens, ctrl, None, Some(&mut out))?
            }
        }
        self.check_logits(&out, first)?;
        Ok(out)
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
        self.check_tokens(&[first])?;
        let tail = Tail::sampling(sampling);
        // Each step feeds one token into the KV caches: stop where they are full.
        self.engine.check_room(1)?;
        let max_new = if self.engine.state.kv_bytes() > 0 {
            max_new.min(self.engine.context() - self.engine.len)
        } else {
            max_new
        };
        let ctrl = self.ctrl(first, pos, sampling, stop)?;
        self.engine.write_ctrl(&ctrl);
        let mut inflight: VecDeque<(usize, wgpu::SubmissionIndex, MapResult)> = VecDeque::new();
        let (mut sampled, mut submitted) = (0usize, 0usize);
        let mut done = false;
        // The position of the first step whose logits the sampler flagged as non-finite;
        // the steps still in flight are drained (their ring buffers unmapped) before the
        // error is returned.
        let mut fault: Option<u64> = None;
        // Step k fills cache row base + k (a stopped step fills none: an upper bound).
        let base = self.engine.len;
        while !(done || submitted == max_new) || !inflight.is_empty() {
            if !done && submitted < max_new && inflight.len() < RING {
                let slot = submitted % RING;
                let index = match self.submit_token(tail, slot, base + submitted + 1) {
                    Ok(index) => index,
                    Err(e) => return Err(self.settle(inflight, e)),
                };
                let (tx, rx) = mpsc::channel();
                self.ring[slot].map_async(wgpu::MapMode::Read, .., move |r| {
                    let _ = tx.send(r);
                });
                inflight.push_back((slot, index, rx));
                submitted += 1;
                continue;
            }
            let Some((slot, index, rx)) = inflight.pop_front() else {
                break;
            };
            let c = match self.read_slot(slot, index, rx) {
                Ok(c) => c,
                Err(e) => return Err(self.settle(inflight, e)),
            };
            // The device counts the tokens it fed: a step after a stop token feeds none
            // (and samples nothing), every other step feeds its input — even one in flight
            // when the caller said stop, which must then be counted and reported like any
            // other, or the state would hold a token the caller does not know of.
            let fed = c.kv_len as usize > self.engine.len;
            self.engine.len = c.kv_len as usize;
            if fault.is_some() {
                continue;
            }
            if c.nonfinite != 0 {
                fault = Some(c.kv_len as u64);
                done = true;
                continue;
            }
            if !fed {
                continue; // a no-op step after the stop token
            }
            sampled += 1;
            let go = on_token(c.token);
            if c.stopped != 0 || !go {
                done = true;
            }
        }
        if let Some(pos) = fault {
            return Err(self.nonfinite_error(pos));
        }
        Ok(sampled)
    }

    fn snapshot(&self) -> Result<Box<dyn Any + Send>> {
        Ok(Box::new(self.engine.snapshot()?))
    }

    fn gpu(&mut self) -> Option<&mut GpuBackend> {
        Some(self)
    }

    fn state(&self) -> Result<crate::state::State<f32>> {
        self.engine.read_state()
    }

    fn snapshot_state(&self, snapshot: &(dyn Any + Send)) -> Result<crate::state::State<f32>> {
        match snapshot.downcast_ref::<DeviceSnapshot>() {
            Some(s) => self.engine.read_snapshot(s),
            None => snapshot
                .downcast_ref::<crate::state::State<f32>>()
                .cloned()
                .ok_or_else(|| {
                    Error::InvalidInput("snapshot was taken on another kind of device".into())
                }),
        }
    }

    fn snapshot_device_bytes(&self) -> u64 {
        self.engine.state.snapshot_bytes(self.engine.len)
    }

    fn context(&self) -> Option<usize> {
        (self.engine.state.kv_bytes() > 0).then(|| self.engine.context())
    }

    fn prefill_granule(&mut self) -> Result<Option<usize>> {
        // The chunked prefill's blocks (`prefill_chunked` feeds a prompt in them), in Auto
        // mode enough of them that a piece is never short enough to be fed token by token
        // (MAMBA2_SHORT_PROMPT may set that length high); a prompt fed token by token
        // cuts anywhere.
        Ok(Some(match self.engine.prefill_mode {
            PrefillMode::Decode => 1,
            PrefillMode::Chunked => {
                prefill_blocks(&mut self.prefill, &self.engine, false)?.max_tokens
            }
            PrefillMode::Auto => {
                let block = prefill_blocks(&mut self.prefill, &self.engine, false)?.max_tokens;
                block.saturating_mul(self.short_prompt() / block.max(1) + 1)
            }
        }))
    }

    fn restore(&mut self, snapshot: &(dyn Any + Send)) -> Result<()> {
        if let Some(s) = snapshot.downcast_ref::<DeviceSnapshot>() {
            return self.engine.restore(s);
        }
        let state = snapshot
            .downcast_ref::<crate::state::State<f32>>()
            .ok_or_else(|| {
                Error::InvalidInput("snapshot was taken on another kind of device".into())
            })?;
        self.engine.write_state(state)
    }
}
