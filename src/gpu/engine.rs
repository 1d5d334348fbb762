//! `Engine`: a model resident on one device — its weights (`DeviceWeights`), one
//! sequence's state (`DeviceState`), the activation scratch (`Scratch`) — and its token
//! graphs (fused and unfused, for each `Tail`), built once by the graph builder
//! (`gpu::blocks`) with all their bind groups.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gpu::blocks::{self, BlockCtx, mamba2};
use crate::gpu::context::{GpuContext, Needs};
use crate::gpu::device_weights::{DeviceWeights, ParamLayout};
use crate::gpu::graph::{Ctrl, Graph, Tail};
use crate::gpu::kernels::Kernels;
use crate::gpu::scratch::{Scratch, widest_input};
use crate::gpu::state_store::{DeviceSnapshot, DeviceState, KvFormat};
use crate::model::Model;
use crate::model::quant::WeightFormat;
use crate::state::State;

pub use crate::gpu::device_weights::pack_parallel;
pub use crate::gpu::scratch::PROMPT_WINDOW;

/// A model resident on a device, with its token graphs.
pub struct Engine {
    pub kernels: Kernels,
    pub config: ModelConfig,
    pub format: WeightFormat,
    pub layout: ParamLayout,
    pub weights: DeviceWeights,
    pub state: DeviceState,
    pub scratch: Scratch,
    graphs: HashMap<(bool, Tail), Graph>,
    pub fused: bool,
    /// SSD chunk length of prefill.
    pub chunk: usize,
    pub prefill_mode: PrefillMode,
    /// Tokens fed into the state so far (the rows in use in every KV cache).
    pub len: usize,
}

/// Options of an engine.
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    pub format: WeightFormat,
    /// The fused graph (4 dispatches per layer) or the unfused baseline (7).
    pub fused: bool,
    /// SSD chunk length of prefill (8…256); `None` takes the config's `chunk_size`.
    pub chunk_size: Option<usize>,
    /// How prompts are fed.
    pub prefill: PrefillMode,
    /// Tokens the KV caches hold (`--ctx`); `None` takes the config's
    /// `max_position_embeddings`, capped by what the adapter can bind.
    pub context: Option<usize>,
    /// How the KV caches store K and V.
    pub kv: KvFormat,
    /// The most bytes one bank of MoE experts may hold; `None`: the adapter's storage-binding
    /// limit (tests set it small to run several banks).
    pub expert_bank_bytes: Option<u64>,
}

/// How a prompt is fed into the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillMode {
    /// `Chunked`, except that a prompt of at most `SHORT_PROMPT` tokens
    /// (`SHORT_PROMPT_COOP` where the short block runs on the tensor cores; a follow-up
    /// after a cached prefix, a short chat turn) is fed through the decode graph: a block
    /// costs about the same for 1 token as for 64 (H200, Codestral q8_0: 18.6 ms for 2
    /// tokens, 21.0 for 64 on the tensor cores, 83 and 97 on FMA; 3.9 ms per decoded token).
    Auto,
    /// Blocks of tokens through GEMMs and the chunked SSD.
    Chunked,
    /// Token by token through the decode graph (the slow baseline and test oracle).
    Decode,
}

/// The longest prompt `PrefillMode::Auto` feeds through the decode graph where a short
/// block's projections run on FMA (feeding token by token stays below one such block's
/// fixed cost on the H200: Codestral-7B ~20 tokens with the split GEMMs of run 28,
/// mamba2-130m ~17).
pub const SHORT_PROMPT: usize = 16;

/// `SHORT_PROMPT` where a short block's projections run on the tensor cores
/// (`gemm_coop::gemm_coop_split`: f16 and quantized weights on a device with cooperative
/// matrices), whose block costs 4–5 decode steps on every preset (H200, run 96, q8_0, a
/// 5-token block against a decoded token: Codestral-7B 17.6 against 3.9 ms, mamba2-2.7b 10.5
/// against 1.9, mamba2-130m 2.1 against 0.43, Nemotron-H-8B 15.3).
pub const SHORT_PROMPT_COOP: usize = 4;

/// The SSD chunk lengths prefill runs; the CLI checks a `--chunk-size` against the same
/// range before it reads a model.
pub const CHUNK_SIZES: std::ops::RangeInclusive<usize> = 8..=256;

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            format: WeightFormat::F16,
            fused: !super::switched_off("MAMBA2_NO_FUSE"),
            chunk_size: None,
            prefill: PrefillMode::Auto,
            context: None,
            expert_bank_bytes: None,
            kv: KvFormat::F16,
        }
    }
}

impl EngineOptions {
    /// The KV cache length for `config` on a device that binds at most `max_binding` bytes
    /// per buffer: `--ctx` if it fits (an error naming the sizes if not), else the config's
    /// `max_position_embeddings` (4096 when it has none), capped to what fits — `notice`
    /// says so. 0 for models without attention layers.
    pub fn context_for(
        &self,
        c: &ModelConfig,
        max_binding: u64,
        notice: &mut dyn FnMut(&str),
    ) -> Result<usize> {
        let Some(a) = &c.attention else {
            return Ok(0);
        };
        if c.count(crate::config::BlockKind::Attention) == 0 {
            return Ok(0);
        }
        let row = (a.kv_width() * self.kv.bytes()) as u64;
        let by_binding = max_binding / row.max(1);
        // Positions are 32-bit on the device (and kept below 2^31).
        let by_position = u32::MAX as u64 / 2;
        let fits = by_binding.min(by_position) as usize;
        let mib = |b: f64| b / (1024.0 * 1024.0);
        match self.context {
            Some(0) => Err(Error::InvalidInput("--ctx must be at least 1".into())),
            Some(n) if n > fits && by_position <= by_binding => Err(Error::InvalidInput(format!(
                "--ctx {n}: positions are counted in 32 bits: at most {fits} tokens"
            ))),
            Some(n) if n > fits => Err(Error::InvalidInput(format!(
                "--ctx {n}: each attention layer's K (and V) cache would need {:.1} MiB ({n} \
                 rows of {row} bytes, {} KV) but the adapter binds at most {:.1} MiB per \
                 buffer: at most {fits} tokens fit (try {}a smaller --ctx)",
                mib(n as f64 * row as f64),
                self.kv.name(),
                mib(max_binding as f64),
                match self.kv {
                    KvFormat::F32 => "--kv f16 or ",
                    KvFormat::F16 => "",
                }
            ))),
            Some(n) => Ok(n),
            None => {
                let want = c.max_context.unwrap_or(4096);
                if want > fits {
                    notice(&format!(
                        "KV cache capped at {fits} tokens (the model allows {want}): the \
                         adapter binds at most {:.1} MiB per buffer",
                        mib(max_binding as f64)
                    ));
                    Ok(fits)
                } else {
                    Ok(want)
                }
            }
        }
    }

    /// The chunk length for `config`: `--chunk-size`, refused outside `CHUNK_SIZES`, else
    /// the config's `chunk_size` brought into that range. The chunked SSD is exact at any
    /// chunk length, so a config's value is a speed hint (a checkpoint's 512 or 1024 runs
    /// at 256), never a reason to refuse the model.
    pub fn chunk_for(&self, config: &ModelConfig) -> Result<usize> {
        match self.chunk_size {
            Some(q) if !CHUNK_SIZES.contains(&q) => Err(Error::InvalidInput(format!(
                "--chunk-size: must be in {}…{}, found {q}",
                CHUNK_SIZES.start(),
                CHUNK_SIZES.end()
            ))),
            Some(q) => Ok(q),
            None => Ok(config
                .chunk_size
                .clamp(*CHUNK_SIZES.start(), *CHUNK_SIZES.end())),
        }
    }
}

/// The SSD chunk length prefill takes by default on a device with tensor cores: the
/// config's, at most 128. The chunked SSD is exact at any chunk length; with the GEMMs on the
/// tensor cores, Codestral's 256 leaves the intra-chunk scan the largest SSD cost (4096
/// tokens on the H200: 558.8 ms at 256, 536.8 at 128, 535.7 at 64, where the state passes
/// start to grow; BENCHMARKS.md).
fn coop_chunk(config_chunk: usize, coop: bool) -> usize {
    if coop {
        config_chunk.min(128)
    } else {
        config_chunk
    }
}

impl Engine {
    /// What a model needs of a device in `format`, for `GpuContext::new` (the KV caches are
    /// sized later, to what the device binds).
    pub fn needs(c: &ModelConfig, format: WeightFormat) -> Needs {
        let mut largest = (
            "SSM state (one layer)".to_string(),
            4 * c.ssm_state_len() as u64,
        );
        for (name, rows, cols, _) in c.matrices() {
            if rows == 0 || cols == 0 {
                continue;
            }
            // Expert banks are split to fit the binding limit: one expert must fit.
            let rows = match (name, &c.moe) {
                ("experts.up_proj" | "experts.down_proj", Some(m)) => rows / m.experts.max(1),
                // The shared expert is stored as slices of the experts' width.
                ("shared.up_proj" | "shared.down_proj", Some(m)) if m.shared_slots() > 0 => 0,
                _ => rows,
            };
            // A GGUF's quantized tensors go up as stored, which may be q8_0 under a 4-bit
            // format: size for the widest quantized format.
            let sized = if format.reads_q8() {
                WeightFormat::Q8_0
            } else {
                format
            };
            let bytes = sized.data_bytes(rows, cols) as u64;
            if bytes > largest.1 {
                largest = (
                    format!("{name} [{rows}, {cols}] in {}", format.name()),
                    bytes,
                );
            }
        }
        // The largest workgroup arrays: the gated norm's G sums and the sampler's; the MoE
        // router's three per-expert arrays, two per-slot and two per-group ones; the MoE
        // sort's three per stored expert.
        let reduce = 4 * 256 * c.n_groups.max(3) as u32;
        let router = c.moe.as_ref().map_or(0, |m| {
            let groups = match m.router {
                crate::config::Router::Grouped { n_group, .. } => n_group,
                crate::config::Router::SoftmaxTopK => 0,
            };
            (12 * m.experts + 8 * m.slots() + 8 * groups).max(12 * m.stored_experts()) as u32
        });
        Needs {
            largest_buffer: largest,
            storage_buffers_per_stage: 8,
            workgroup_storage: (reduce + 1024).max(router).max(16 * 1024),
            invocations_per_workgroup: 256,
        }
    }

    /// Uploads `model` (converting the big matrices to `opts.format`, with progress) and
    /// builds the graphs.
    pub fn new(ctx: Arc<GpuContext>, model: &Model, opts: EngineOptions) -> Result<Self> {
        let bank_bytes = opts
            .expert_bank_bytes
            .unwrap_or(u64::MAX)
            .min(ctx.limits.max_storage_buffer_binding_size);
        let weights = DeviceWeights::upload(&ctx, model, opts.format, bank_bytes)?;
        Self::assemble(ctx, &model.config, weights, opts)
    }

    /// Wires uploaded weights and fresh state/scratch into an engine and builds its graphs.
    pub(crate) fn assemble(
        ctx: Arc<GpuContext>,
        c: &ModelConfig,
        weights: DeviceWeights,
        opts: EngineOptions,
    ) -> Result<Self> {
        let format = opts.format;
        let layout = ParamLayout::new(c);
        let max_binding = ctx.limits.max_storage_buffer_binding_size;
        let context = opts.context_for(c, max_binding, &mut |m| tracing::warn!("{m}"))?;
        let state = DeviceState::new(&ctx, c, context, opts.kv)?;
        let blocks = mamba2::ssd_consts(c, &layout).blocks();
        let attn_part = blocks::attention::partials_len(c, context);
        let scratch = Scratch::new(&ctx, c, blocks, attn_part)?;
        let fusable = mamba2::fusable(c, format);
        // The chunk asked for, else the config's (at most 128 on the tensor cores).
        let chunk = match opts.chunk_size {
            Some(_) => opts.chunk_for(c)?,
            None => coop_chunk(opts.chunk_for(c)?, ctx.caps.coop_matrix),
        };
        let mut engine = Engine {
            kernels: Kernels::new(ctx),
            config: c.clone(),
            format,
            layout,
            weights,
            state,
            scratch,
            graphs: HashMap::new(),
            fused: opts.fused && fusable,
            chunk,
            prefill_mode: opts.prefill,
            len: 0,
        };
        for fused in [true, false] {
            for tail in [Tail::Greedy, Tail::Sample, Tail::Feed, Tail::FeedLogits] {
                let g = blocks::decode_graph(&engine.block_ctx(), &engine.weights, fused, tail)?;
                engine.graphs.insert((fused, tail), g);
            }
        }
        engine.ctx().check()?;
        Ok(engine)
    }

    pub fn ctx(&self) -> &Arc<GpuContext> {
        &self.kernels.ctx
    }

    /// What the graph builder reads.
    pub fn block_ctx(&self) -> BlockCtx<'_> {
        BlockCtx {
            k: &self.kernels,
            c: &self.config,
            format: self.format,
            layout: &self.layout,
            s: &self.scratch,
            state: &self.state,
            lanes: crate::gpu::kernels::Lanes::ONE,
        }
    }

    /// Tokens the KV caches hold (0 without attention layers: no limit).
    pub fn context(&self) -> usize {
        self.state.ctx
    }

    /// Checks that `n` more tokens fit the KV caches.
    pub fn check_room(&self, n: usize) -> Result<()> {
        if self.state.kv_bytes() > 0 && self.len + n > self.state.ctx {
            return Err(Error::InvalidInput(format!(
                "{}: {} tokens so far + {n} new exceed the {}-token KV cache \
                 (--ctx)",
                crate::session::CONTEXT_FULL,
                self.len,
                self.state.ctx
            )));
        }
        Ok(())
    }

    /// The token graph in the current fusion mode.
    pub fn graph(&self, tail: Tail) -> &Graph {
        &self.graphs[&(self.fused, tail)]
    }

    /// The end of a token graph that turns `resid` into the next token: final norm,
    /// lm_head and the sampler (`Greedy` or `Sample`), e.g. after a chunked prefill.
    pub fn head_graph(&self, tail: Tail) -> Graph {
        let all = &self.graph(tail).dispatches;
        Graph {
            dispatches: all[all.len() - 3..].to_vec(),
        }
    }

    /// The matrix that produces logits (lm_head, or the tied embedding).
    pub fn head(&self) -> &crate::gpu::weights::DeviceMatrix {
        self.weights.head()
    }

    pub fn write_ctrl(&self, ctrl: &Ctrl) {
        self.ctx()
            .queue
            .write_buffer(&self.scratch.ctrl, 0, bytemuck::bytes_of(ctrl));
    }

    pub fn read_ctrl(&self) -> Result<Ctrl> {
        let bytes = self
            .ctx()
            .read(&self.scratch.ctrl, std::mem::size_of::<Ctrl>() as u64)?;
        Ok(bytemuck::pod_read_unaligned(
            &bytes[..std::mem::size_of::<Ctrl>()],
        ))
    }

    pub fn read_logits(&self) -> Result<Vec<f32>> {
        self.ctx()
            .read_f32(&self.scratch.logits, self.config.vocab_size)
    }

    /// Zeroes the state (a fresh sequence).
    pub fn reset_state(&mut self) -> Result<()> {
        self.len = 0;
        self.state.reset(self.ctx())
    }

    /// The state as the CPU reference lays it out (blocking read; not for the hot path).
    pub fn read_state(&self) -> Result<State<f32>> {
        self.state.read(self.ctx(), &self.config, self.len)
    }

    /// A copy of the state kept on the device (no host round trip): for branching a
    /// conversation or regenerating a reply without re-reading the prompt.
    pub fn snapshot(&self) -> Result<DeviceSnapshot> {
        self.state.snapshot(self.ctx(), self.len)
    }

    /// A device snapshot read to the host as the CPU reference lays it out.
    pub fn read_snapshot(&self, s: &DeviceSnapshot) -> Result<State<f32>> {
        self.state.read_snapshot(self.ctx(), &self.config, s)
    }

    /// Puts a snapshot of this engine's state back.
    pub fn restore(&mut self, s: &DeviceSnapshot) -> Result<()> {
        self.state.restore(self.ctx(), s)?;
        self.len = s.len;
        Ok(())
    }

    /// Replaces the state (e.g. to continue from a CPU-computed one).
    pub fn write_state(&mut self, st: &State<f32>) -> Result<()> {
        self.state.write(self.ctx(), &self.config, st)?;
        self.len = st.len;
        Ok(())
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> u64 {
        self.weights.bytes()
    }

    /// Bytes of fixed-size recurrent state per sequence (the KV caches come on top).
    pub fn state_bytes(&self) -> u64 {
        self.state.fixed_bytes()
    }

    /// Bytes of activation scratch.
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch.bytes()
    }

    /// Bytes a decode step reads or writes with `cached` tokens in the KV caches: weights
    /// once, the recurrent state read and written, the cached K/V read.
    pub fn bytes_per_token(&self, cached: usize) -> u64 {
        let w = &self.weights;
        let embed_row = (w.embedding.bytes() / w.embedding.rows as u64).max(1);
        let mut b = embed_row + w.head().bytes() + 2 * self.state_bytes();
        for l in &w.layers {
            b += l.params.size();
            match (&l.mixer, &self.config.moe) {
                // Only the chosen experts' rows are read.
                (crate::gpu::device_weights::DeviceMixer::Moe(m), Some(mc)) => {
                    let experts: u64 =
                        m.up.iter()
                            .flatten()
                            .chain(&m.down)
                            .map(|x| x.bytes())
                            .sum();
                    b +=
                        experts * mc.slots() as u64 / mc.stored_experts() as u64 + m.router.bytes();
                    if let Some((u, d)) = &m.shared {
                        b += u.iter().map(|x| x.bytes()).sum::<u64>() + d.bytes();
                    }
                }
                _ => b += l.matrices().iter().map(|m| m.bytes()).sum::<u64>(),
            }
        }
        b + (cached as u64) * self.config.kv_bytes_per_token(self.state.kv.bytes()) as u64
    }

    /// How often each expert of each MoE layer was chosen since the engine was made (or the
    /// counters were reset): one row of `E` counts per MoE layer, prompt and generated
    /// tokens alike (a blocking read; for the inspector and tests).
    pub fn expert_counts(&self) -> Result<Vec<Vec<u32>>> {
        let Some(m) = &self.config.moe else {
            return Ok(Vec::new());
        };
        let layers = self.config.count(crate::config::BlockKind::Moe);
        let bytes = self
            .ctx()
            .read(&self.scratch.expert_counts, (4 * layers * m.experts) as u64)?;
        let counts: Vec<u32> = bytes
            .chunks_exact(4)
            .take(layers * m.experts)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(counts.chunks(m.experts).map(<[u32]>::to_vec).collect())
    }

    /// Zeroes the expert-load counters.
    pub fn reset_expert_counts(&self) {
        let c = &self.scratch.expert_counts;
        let mut enc = self
            .ctx()
            .device
            .create_command_encoder(&Default::default());
        enc.clear_buffer(c, 0, None);
        self.ctx().queue.submit([enc.finish()]);
    }

    /// The widest GEMV input (sizes the q8 activation blocks).
    pub fn widest_input(&self) -> usize {
        widest_input(&self.config)
    }
}
