//! Chunked prefill: a block of prompt tokens goes through each layer as matrices — GEMMs
//! for the projections; in Mamba2 blocks a causal conv that continues from the cached
//! columns and the chunked SSD (cumsum → C·Bᵀ → chunk states → state passing from the
//! sequence's current state → chunk outputs); in attention blocks the new K/V rows stored
//! after the cached ones and causal attention over all of them — so a prompt costs a few
//! dispatches per layer per block instead of a decode graph per token, and a new chat turn
//! continues from the carried state. The block graph comes from `gpu::blocks`.

use crate::config::{BlockKind, ModelConfig};
use crate::error::{Error, Result};
use crate::gpu::blocks::prefill_graph;
use crate::gpu::engine::Engine;
use crate::gpu::graph::Graph;
use crate::gpu::kernels::chunk::ChunkConsts;

/// Largest prompt block processed per submit.
pub const MAX_BLOCK: usize = 512;
/// Largest block whose logits are kept for every position (perplexity).
pub const MAX_LOGITS_BLOCK: usize = 128;

/// The block buffers and the block graphs (one that ends with the last token's residual,
/// one that also computes every position's logits).
pub struct Prefill {
    pub chunk: usize,
    pub max_tokens: usize,
    pub prompt: wgpu::Buffer,
    /// `[T][d]` residual rows; the last row feeds the decode head.
    pub resid: wgpu::Buffer,
    /// `[T][ceil32(d)]` normed rows (every block's first GEMM input).
    pub h: wgpu::Buffer,
    pub mix: wgpu::Buffer,
    /// The conv output `[T][conv_dim]` (x B C).
    pub u: wgpu::Buffer,
    pub y: wgpu::Buffer,
    pub v: wgpu::Buffer,
    pub lam: wgpu::Buffer,
    pub cb: wgpu::Buffer,
    pub cst: wgpu::Buffer,
    /// The states entering the chunks in f16, for the tensor-core chunk scan (where the
    /// device runs the cooperative kernels; one value otherwise).
    pub cst16: wgpu::Buffer,
    /// Attention: `[T][qkv_rows]` projections and `[T][ceil32(H·hd)]` outputs.
    pub qkv: wgpu::Buffer,
    pub attn: wgpu::Buffer,
    /// MLP: `[T][up rows]` projections and `[T][ceil32(I)]` activations.
    pub mlp_up: wgpu::Buffer,
    pub mlp: wgpu::Buffer,
    /// MoE: `[T][E]` router logits, `[T][K]` ids and weights; the pairs sorted by expert
    /// (`moe_sort`: `pairs [R]`, `pos [T·K]`, `tile_expert [R/64]`) and, per sorted row, the
    /// experts' up projections `[R][up rows]`, activations `[R][ceil32(I)]` and down
    /// projections `[R][d]`.
    pub router_logits: wgpu::Buffer,
    pub moe_ids: wgpu::Buffer,
    pub moe_weights: wgpu::Buffer,
    pub moe_pairs: wgpu::Buffer,
    pub moe_pos: wgpu::Buffer,
    pub tile_expert: wgpu::Buffer,
    pub moe_up: wgpu::Buffer,
    pub moe_mid: wgpu::Buffer,
    pub moe_down: wgpu::Buffer,
    /// Latent MoE: `[T][ceil32(L)]` latent inputs and weighted sums of the routed experts.
    pub moe_latent: wgpu::Buffer,
    pub moe_latent_sum: wgpu::Buffer,
    /// `[T][V]` logits (perplexity blocks only).
    pub logits: Option<wgpu::Buffer>,
    /// Split-K partial products of the dense projections that split (the short-block
    /// graph's, and the few-row ones such as MoE routers in full blocks), `[KS][PT][rows]`
    /// (4 bytes when none splits).
    pub part: wgpu::Buffer,
    /// Feeds a block: the state advances by its tokens.
    pub graph: Graph,
    /// Feeds a block of at most MAX_LOGITS_BLOCK tokens and writes every position's logits.
    pub logits_graph: Option<Graph>,
    /// Feeds a block of at most SHORT_BLOCK tokens, its dense projections split over K
    /// (`gemm_split`): a short prompt, the tail of a long one, a turn after a cached prefix.
    pub short_graph: Option<Graph>,
}

/// The most tokens the short-block graph takes: one GEMM token tile.
pub const SHORT_BLOCK: usize = crate::gpu::kernels::gemm::TILE.1;

/// Largest prompt block of a model with MoE blocks: each expert's rows are padded to whole
/// GEMM tiles, and a longer block fills them (Nemotron 3 Nano, 512 tokens × 8 slots over
/// 130 stored experts: 2.4× the rows in tiles; 2048 tokens: 1.5×).
pub const MAX_MOE_BLOCK: usize = 2048;

/// The smallest block: the floor of `block_tokens`, of MAMBA2_PREFILL_BLOCK and of the
/// halving that fits a block's buffers to the adapter's storage-binding limit.
pub const MIN_BLOCK: usize = 64;

/// Largest prompt block where the GEMMs run on the tensor cores: their 128 × 256 tiles
/// need many tokens to fill the GPU evenly (Codestral's 4096 tokens on the H200: 509.4 ms in
/// blocks of 2048, 499.4 ms in one of 4096; the block's buffers take ~1 GB for Codestral).
pub const MAX_COOP_BLOCK: usize = 4096;

/// The block capacity for a chunk length: 512 tokens (2048 with MoE blocks or with the
/// tensor-core GEMMs, `coop`), fewer for short chunks. MAMBA2_PREFILL_BLOCK overrides the
/// largest size (for measurements; `check_overrides` refused a bad value before any
/// device was made).
pub fn block_tokens(c: &ModelConfig, chunk: usize, coop: bool) -> usize {
    let max = if c.moe.is_some() {
        MAX_MOE_BLOCK
    } else if coop {
        MAX_COOP_BLOCK
    } else {
        MAX_BLOCK
    };
    let max = match std::env::var("MAMBA2_PREFILL_BLOCK") {
        Ok(v) => parse_block(&v).unwrap_or(max),
        Err(_) => max,
    };
    (32 * chunk).clamp(MIN_BLOCK, max)
}

/// A MAMBA2_PREFILL_BLOCK value: a number of tokens, at least 64.
fn parse_block(s: &str) -> Result<usize> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= MIN_BLOCK => Ok(n),
        _ => Err(Error::InvalidInput(format!(
            "MAMBA2_PREFILL_BLOCK={s}: want a number of tokens, at least {MIN_BLOCK}"
        ))),
    }
}

/// MAMBA2_SHORT_PROMPT: the longest prompt `PrefillMode::Auto` feeds through the decode
/// graph, for measurements (`check_overrides` refused a bad value before any device was
/// made).
pub fn short_prompt_override() -> Option<usize> {
    std::env::var("MAMBA2_SHORT_PROMPT")
        .ok()
        .and_then(|v| parse_short_prompt(&v).ok())
}

/// A MAMBA2_SHORT_PROMPT value: a number of tokens (0: every prompt takes the blocks).
fn parse_short_prompt(s: &str) -> Result<usize> {
    s.trim().parse::<usize>().map_err(|_| {
        crate::error::Error::InvalidInput(format!(
            "MAMBA2_SHORT_PROMPT={s}: want a number of tokens"
        ))
    })
}

/// Refuses a bad MAMBA2_PREFILL_BLOCK or MAMBA2_SHORT_PROMPT before a device is made (they
/// used to be ignored with a warning, so a typo silently measured the default).
pub fn check_overrides() -> Result<()> {
    if let Ok(s) = std::env::var("MAMBA2_PREFILL_BLOCK") {
        parse_block(&s)?;
    }
    if let Ok(s) = std::env::var("MAMBA2_SHORT_PROMPT") {
        parse_short_prompt(&s)?;
    }
    Ok(())
}

impl Prefill {
    /// Allocates the block buffers for chunks of `chunk` tokens and builds the graphs
    /// (`with_logits`: also the perplexity graph). The block takes `block_tokens` tokens,
    /// halved (down to `MIN_BLOCK`) while one of its buffers would exceed what the adapter
    /// binds: a 2048-token MoE block's expert rows need ~250 MiB at Nemotron 3 Nano's
    /// shapes, and lavapipe binds 128.
    pub fn new(e: &Engine, chunk: usize, with_logits: bool) -> Result<Self> {
        let mut t = block_tokens(&e.config, chunk, e.ctx().caps.coop_matrix);
        loop {
            let too_big = std::cell::Cell::new(false);
            match Self::with_block(e, chunk, t, with_logits, &too_big) {
                Err(err) if too_big.get() && t > MIN_BLOCK => {
                    t = (t / 2).max(MIN_BLOCK);
                    tracing::debug!("{err}; trying blocks of {t} tokens");
                }
                done => return done,
            }
        }
    }

    /// `new` with a block of `t` tokens; sets `too_big` when a buffer exceeds the
    /// adapter's storage-binding limit.
    fn with_block(
        e: &Engine,
        chunk: usize,
        t: usize,
        with_logits: bool,
        too_big: &std::cell::Cell<bool>,
    ) -> Result<Self> {
        let c = &e.config;
        let ctx = e.ctx();
        let max_binding = ctx.limits.max_storage_buffer_binding_size;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let buf = |label: &str, size: u64| -> Result<wgpu::Buffer> {
            if size > max_binding {
                too_big.set(true);
                return Err(Error::Gpu(format!(
                    "`{label}`: a prefill block of {t} tokens needs {:.1} MiB, more than the \
                     {:.1} MiB adapter `{}` binds",
                    mib(size),
                    mib(max_binding),
                    ctx.info.name
                )));
            }
            ctx.storage_zeroed(label, size)
        };
        let f32s = |n: usize| 4 * n.max(1) as u64;
        let cc = chunk_consts(c, chunk, t);
        let pad = |n: usize| n.next_multiple_of(32);
        let (qkv, attn) = c
            .attention
            .as_ref()
            .map_or((0, 0), |a| (a.qkv_rows(), pad(a.q_width())));
        let (up, mlp) = crate::gpu::scratch::mlp_widths(c);
        let (experts, top_k, expert_up, expert_mid) = c.moe.as_ref().map_or((0, 0, 0, 0), |m| {
            (
                m.stored_experts(),
                m.slots(),
                m.up_rows(),
                pad(m.intermediate),
            )
        });
        let latent = c
            .moe
            .as_ref()
            .and_then(|m| m.latent)
            .map_or(0, |l| l.next_multiple_of(32));
        // The block's (token, choice) pairs sorted by expert, in whole GEMM tiles.
        let rows = if experts > 0 {
            crate::gpu::kernels::moe_sort::sorted_rows(t, top_k, experts)
        } else {
            0
        };
        let mamba = c.count(BlockKind::Mamba2) > 0;
        // Rows of the GEMMs' outputs: enough for the tensor-core GEMM to store its tiles
        // straight into them (`gemm_coop::y_rows`).
        let yt = crate::gpu::kernels::gemm_coop::y_rows(t);
        let y_sorted = crate::gpu::kernels::gemm_coop::y_rows(rows);
        let m = |n: usize| if mamba { n } else { 1 };
        // Every buffer before any graph: a block too big for the binding limit is
        // refused before graphs are built for it.
        let logits_tokens = with_logits.then(|| t.min(MAX_LOGITS_BLOCK));
        let mut p = Prefill {
            chunk,
            max_tokens: t,
            prompt: buf("prefill prompt", f32s(t))?,
            resid: buf("prefill resid", f32s(yt * c.d_model))?,
            h: buf("prefill h", f32s(t * pad(c.d_model)))?,
            mix: buf("prefill mix", f32s(m(yt * c.d_in_proj())))?,
            u: buf("prefill u", f32s(m(t * c.conv_dim())))?,
            // Whole chunks of rows: the tensor-core chunk scan writes them.
            y: buf("prefill y", f32s(m(cc.chunks() * chunk * c.d_inner)))?,
            v: buf("prefill v", f32s(m(t * pad(c.d_inner))))?,
            lam: buf("prefill lam", f32s(m(cc.chunks() * c.n_heads * chunk)))?,
            cb: buf(
                "prefill cb",
                f32s(m(cc.chunks() * c.n_groups * chunk * chunk)),
            )?,
            cst: buf(
                "prefill chunk states",
                f32s(m(cc.chunks() * c.ssm_state_len())),
            )?,
            cst16: buf(
                "prefill entering states (f16)",
                f32s(if ctx.caps.coop_kernels() {
                    m(cc.states_f16_words())
                } else {
                    1
                }),
            )?,
            qkv: buf("prefill qkv", f32s(yt * qkv))?,
            attn: buf("prefill attn", f32s(t * attn))?,
            mlp_up: buf("prefill mlp up", f32s(yt * up))?,
            mlp: buf("prefill mlp", f32s(t * mlp))?,
            router_logits: buf("prefill router logits", f32s(t * experts))?,
            moe_ids: buf("prefill moe ids", f32s(t * top_k))?,
            moe_weights: buf("prefill moe weights", f32s(t * top_k))?,
            moe_pairs: buf("prefill moe pairs", f32s(rows))?,
            moe_pos: buf("prefill moe pos", f32s(t * top_k))?,
            tile_expert: buf("prefill moe tiles", f32s(rows / 64))?,
            moe_up: buf("prefill moe up", f32s(y_sorted * expert_up))?,
            moe_mid: buf("prefill moe mid", f32s(rows * expert_mid))?,
            moe_down: buf("prefill moe down", f32s(y_sorted * c.d_model))?,
            moe_latent: buf("prefill moe latent", f32s(t * latent))?,
            moe_latent_sum: buf("prefill moe latent sum", f32s(t * latent))?,
            logits: logits_tokens
                .map(|lt| buf("prefill logits", f32s(lt * c.vocab_size)))
                .transpose()?,
            part: buf("prefill split-K partials", f32s(part_len(e, t)))?,
            graph: Graph::default(),
            logits_graph: None,
            short_graph: None,
        };
        p.graph = prefill_graph(&e.block_ctx(), &e.weights, &p, cc, false)?;
        if part_len(e, SHORT_BLOCK) > 0 && t > SHORT_BLOCK {
            // Chunks no longer than the block: a 128-token chunk would pad the SSD
            // kernels' tiles of a ≤ 64-token block to 128 rows (C·Bᵀ's lower triangle: 3
            // tiles of 64 instead of 1).
            p.short_graph = Some(prefill_graph(
                &e.block_ctx(),
                &e.weights,
                &p,
                chunk_consts(c, chunk.min(SHORT_BLOCK), SHORT_BLOCK),
                false,
            )?);
        }
        if let Some(lt) = logits_tokens {
            p.logits_graph = Some(prefill_graph(
                &e.block_ctx(),
                &e.weights,
                &p,
                chunk_consts(c, chunk, lt),
                true,
            )?);
        }
        Ok(p)
    }

    /// The graph that feeds a block of `tokens` tokens without logits: the short-block graph
    /// (its GEMMs split over K) up to SHORT_BLOCK tokens where there is one, else the full
    /// one.
    pub fn graph_for(&self, tokens: usize) -> &Graph {
        match &self.short_graph {
            Some(g) if tokens <= SHORT_BLOCK => g,
            _ => &self.graph,
        }
    }

    /// The most dispatches a block graph records (what a profiler of any block must hold).
    pub fn most_dispatches(&self) -> usize {
        self.short_graph
            .as_ref()
            .map_or(0, Graph::len)
            .max(self.graph.len())
    }
}

/// Values of the split-K partial buffer: the largest over the dense projections (the
/// routers of MoE layers included) of what their split takes in the short-block graph, in
/// blocks of `max_tokens` and in the perplexity graph's (`gemm::part_values`; 0 when none
/// splits, or MAMBA2_NO_SPLITK is set).
fn part_len(e: &Engine, max_tokens: usize) -> usize {
    use crate::gpu::kernels::gemm::part_values;
    // (The perplexity graph's blocks are at most MAX_LOGITS_BLOCK tokens.)
    let blocks = [SHORT_BLOCK, max_tokens, max_tokens.min(MAX_LOGITS_BLOCK)];
    e.weights
        .dense_projections()
        .flat_map(|w| blocks.map(|t| part_values(&e.kernels, w, t)))
        .max()
        .unwrap_or(0)
}

/// The chunked-SSD sizes of a config for chunks of `q` in blocks of `max_tokens`.
pub fn chunk_consts(c: &ModelConfig, q: usize, max_tokens: usize) -> ChunkConsts {
    ChunkConsts {
        heads: c.n_heads,
        head_dim: c.head_dim,
        groups: c.n_groups,
        d_state: c.d_state,
        d_inner: c.d_inner,
        conv_dim: c.conv_dim(),
        d_in_proj: c.d_in_proj(),
        q,
        max_tokens,
        u_f16: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_prefill_block_names_the_variable() {
        assert_eq!(parse_block(" 2048 ").unwrap(), 2048);
        for bad in ["63", "0", "-5", "4k", ""] {
            let e = parse_block(bad).unwrap_err().to_string();
            assert!(e.contains("MAMBA2_PREFILL_BLOCK"), "{e}");
        }
        assert_eq!(parse_short_prompt(" 4 ").unwrap(), 4);
        for bad in ["-1", "x", ""] {
            let e = parse_short_prompt(bad).unwrap_err().to_string();
            assert!(e.contains("MAMBA2_SHORT_PROMPT"), "{e}");
        }
    }
}
