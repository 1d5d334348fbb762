//! Chunked prefill: a block of prompt tokens goes through each layer as matrices — GEMMs
//! for the projections, a causal conv that continues from the cached columns, and the
//! chunked SSD (cumsum → C·Bᵀ → chunk states → state passing from the sequence's current
//! state → chunk outputs) — so a prompt costs a few dispatches per layer per block instead
//! of a decode graph per token, and a new chat turn continues from the carried state.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::gpu::engine::Engine;
use crate::gpu::graph::Graph;
use crate::gpu::kernels::chunk::ChunkConsts;
use crate::gpu::kernels::gated_norm::{self, Batch, GatedNormBuffers};
use crate::gpu::kernels::gemm::{GemmOutput, TILE, gemm};
use crate::gpu::kernels::prefill_conv::ConvBuffers;
use crate::gpu::kernels::rmsnorm::{self, NormBuffers};
use crate::gpu::kernels::ssd_chunk_scan::{ScanBuffers, ssd_chunk_scan};
use crate::gpu::kernels::{
    embed, prefill_conv, ssd_cb, ssd_chunk_state, ssd_cumsum, ssd_state_pass,
};

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
    h: wgpu::Buffer,
    mix: wgpu::Buffer,
    /// The conv output `[T][conv_dim]` (x B C).
    u: wgpu::Buffer,
    y: wgpu::Buffer,
    v: wgpu::Buffer,
    lam: wgpu::Buffer,
    cb: wgpu::Buffer,
    cst: wgpu::Buffer,
    /// `[T][V]` logits (perplexity blocks only).
    pub logits: Option<wgpu::Buffer>,
    /// Feeds a block: the state advances by its tokens.
    pub graph: Graph,
    /// Feeds a block of at most MAX_LOGITS_BLOCK tokens and writes every position's logits.
    pub logits_graph: Option<Graph>,
}

/// The block capacity for a chunk length: 512 tokens, fewer chunks for short chunks.
pub fn block_tokens(chunk: usize) -> usize {
    (32 * chunk).clamp(64, MAX_BLOCK)
}

impl Prefill {
    /// Allocates the block buffers for chunks of `chunk` tokens and builds the graphs
    /// (`with_logits`: also the perplexity graph).
    pub fn new(e: &Engine, chunk: usize, with_logits: bool) -> Result<Self> {
        let c = &e.config;
        let ctx = e.ctx();
        let t = block_tokens(chunk);
        let f32s = |n: usize| 4 * n as u64;
        let cc = chunk_consts(c, chunk, t);
        let pad = |n: usize| n.next_multiple_of(32);
        let mut p = Prefill {
            chunk,
            max_tokens: t,
            prompt: ctx.storage_zeroed("prefill prompt", f32s(t))?,
            resid: ctx.storage_zeroed("prefill resid", f32s(t * c.d_model))?,
            h: ctx.storage_zeroed("prefill h", f32s(t * pad(c.d_model)))?,
            mix: ctx.storage_zeroed("prefill mix", f32s(t * c.d_in_proj()))?,
            u: ctx.storage_zeroed("prefill u", f32s(t * c.conv_dim()))?,
            y: ctx.storage_zeroed("prefill y", f32s(t * c.d_inner))?,
            v: ctx.storage_zeroed("prefill v", f32s(t * pad(c.d_inner)))?,
            lam: ctx.storage_zeroed("prefill lam", f32s(cc.chunks() * c.n_heads * chunk))?,
            cb: ctx.storage_zeroed("prefill cb", f32s(cc.chunks() * c.n_groups * chunk * chunk))?,
            cst: ctx.storage_zeroed(
                "prefill chunk states",
                f32s(cc.chunks() * c.ssm_state_len()),
            )?,
            logits: None,
            graph: Graph::default(),
            logits_graph: None,
        };
        p.graph = p.build(e, cc, false)?;
        if with_logits {
            let lt = t.min(MAX_LOGITS_BLOCK);
            p.logits = Some(ctx.storage_zeroed("prefill logits", f32s(lt * c.vocab_size))?);
            p.logits_graph = Some(p.build(e, chunk_consts(c, chunk, lt), true)?);
        }
        Ok(p)
    }

    fn build(&self, e: &Engine, cc: ChunkConsts, logits: bool) -> Result<Graph> {
        let k = &e.kernels;
        let c = &e.config;
        let s = &e.scratch;
        let t = cc.max_tokens;
        let eps = c.norm_eps;
        let l = &e.layout;
        let mut d = vec![
            embed::embed_prompt(k, &e.embedding, t, &self.prompt, &self.resid, &s.ctrl)?
                .per_token(1, 1, 1),
        ];
        for (i, layer) in e.layers.iter().enumerate() {
            let name = |what: &str| format!("layers.{i}.{what}");
            let norm = NormBuffers {
                src: &self.resid,
                params: &layer.params,
                dst: &self.h,
                q8: None,
            };
            d.push(
                rmsnorm::rmsnorm(k, &name("norm"), c.d_model, eps, l.norm, t, norm)?
                    .per_token(1, 1, 1),
            );
            d.push(
                gemm(
                    k,
                    &name("in_proj"),
                    &layer.in_proj,
                    t,
                    &self.h,
                    &self.mix,
                    c.d_in_proj(),
                    GemmOutput::Store,
                    &s.ctrl,
                )?
                .per_token(1, TILE.1, 1),
            );
            let conv = ConvBuffers {
                mix: &self.mix,
                params: &layer.params,
                conv_state: &layer.conv_state,
                u: &self.u,
                ctrl: &s.ctrl,
            };
            d.push(prefill_conv::prefill_conv(
                k,
                &name("conv"),
                cc,
                e.mixer_consts(),
                conv,
            )?);
            d.push(prefill_conv::prefill_conv_state(
                k,
                &name("conv_state"),
                cc,
                e.mixer_consts(),
                &self.mix,
                &layer.conv_state,
                &s.ctrl,
            )?);
            d.push(
                ssd_cumsum::ssd_cumsum(
                    k,
                    &name("ssd_cumsum"),
                    cc,
                    l.a,
                    &self.mix,
                    &layer.params,
                    &self.lam,
                    &s.ctrl,
                )?
                .per_token(1, cc.q, 1),
            );
            d.push(
                ssd_cb::ssd_cb(k, &name("ssd_cb"), cc, &self.u, &self.cb, &s.ctrl)?
                    .per_token(2, cc.q, c.n_groups),
            );
            d.push(
                ssd_chunk_state::ssd_chunk_state(
                    k,
                    &name("ssd_chunk_state"),
                    cc,
                    &self.mix,
                    &self.u,
                    &self.lam,
                    &self.cst,
                    &s.ctrl,
                )?
                .per_token(2, cc.q, c.n_heads),
            );
            d.push(ssd_state_pass::ssd_state_pass(
                k,
                &name("ssd_state_pass"),
                cc,
                &self.lam,
                &self.cst,
                &layer.ssm_state,
                &s.ctrl,
            )?);
            let scan = ScanBuffers {
                mix: &self.mix,
                u: &self.u,
                params: &layer.params,
                lam: &self.lam,
                cb: &self.cb,
                cst: &self.cst,
                y: &self.y,
                ctrl: &s.ctrl,
            };
            d.push(
                ssd_chunk_scan(k, &name("ssd_chunk_scan"), cc, l.d, scan)?.per_token(2, cc.q, 1),
            );
            let gated = GatedNormBuffers {
                y: &self.y,
                mix: &self.mix,
                params: &layer.params,
                dst: &self.v,
                q8: None,
            };
            let batch = Batch {
                tokens: t,
                mix_stride: c.d_in_proj(),
            };
            d.push(
                gated_norm::gated_norm(
                    k,
                    &name("gated_norm"),
                    c.d_inner,
                    c.n_groups,
                    eps,
                    l.mixer_norm,
                    batch,
                    gated,
                )?
                .per_token(1, 1, 1),
            );
            d.push(
                gemm(
                    k,
                    &name("out_proj+residual"),
                    &layer.out_proj,
                    t,
                    &self.v,
                    &self.resid,
                    c.d_model,
                    GemmOutput::Add,
                    &s.ctrl,
                )?
                .per_token(1, TILE.1, 1),
            );
        }
        if logits {
            let out = self
                .logits
                .as_ref()
                .expect("logits buffer allocated before the logits graph");
            let norm = NormBuffers {
                src: &self.resid,
                params: &s.final_params,
                dst: &self.h,
                q8: None,
            };
            d.push(
                rmsnorm::rmsnorm(k, "final_norm", c.d_model, eps, 0, t, norm)?.per_token(1, 1, 1),
            );
            d.push(
                gemm(
                    k,
                    "lm_head",
                    e.head(),
                    t,
                    &self.h,
                    out,
                    c.vocab_size,
                    GemmOutput::Store,
                    &s.ctrl,
                )?
                .per_token(1, TILE.1, 1),
            );
        }
        Ok(Graph { dispatches: d })
    }
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
    }
}
