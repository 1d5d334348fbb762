//! Activation scratch of the decode graph: one token's intermediate vectors, shared by
//! every layer (each block overwrites what it uses), plus the control block and the
//! prompt window.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::gpu::context::GpuContext;
use crate::gpu::graph::Ctrl;

/// Prompt tokens fed per submit when prefilling through the decode graph.
pub const PROMPT_WINDOW: usize = 256;

/// Activation scratch and control buffers.
pub struct Scratch {
    /// Decode lanes the per-token buffers hold side by side (1 for an engine's own
    /// scratch; a batch's sequence slots). With more than one, every GEMV input (and its
    /// q8 blocks) takes `lane_width` values per lane.
    pub lanes: usize,
    pub lane_width: usize,
    pub resid: wgpu::Buffer,
    /// `[z | xBC → u | dt → δ]`, d_in_proj values.
    pub mix: wgpu::Buffer,
    /// The SSD step's output (fused: `y·silu(z)·w_norm`, the out_proj input).
    pub y: wgpu::Buffer,
    /// Σv² per SSD channel block (fused).
    pub part: wgpu::Buffer,
    /// The normed input of a block's first projection / lm_head (f32, zero-padded to a
    /// multiple of 32).
    pub h: wgpu::Buffer,
    /// The gated-normed input of out_proj (unfused).
    pub v: wgpu::Buffer,
    /// q8 blocks of the next q8_0 GEMV's input: int8 ×4 per u32, and one scale per block.
    pub xq: wgpu::Buffer,
    pub xd: wgpu::Buffer,
    pub out: wgpu::Buffer,
    /// Attention: the `[q | k | v]` projection of the token.
    pub qkv: wgpu::Buffer,
    /// Attention: the heads' outputs `[H·hd]` (o_proj's input), zero-padded to 32.
    pub attn: wgpu::Buffer,
    /// Attention: the flash-decoding partials of every (head, segment).
    pub attn_part: wgpu::Buffer,
    /// MLP: the up (or gate+up) projection.
    pub mlp_up: wgpu::Buffer,
    /// MLP: the activation (down's input), zero-padded to 32.
    pub mlp: wgpu::Buffer,
    /// MoE: router logits `[E]`, the chosen ids `[K]` (u32) and weights `[K]`, the experts'
    /// up projections `[K][up rows]`, activations `[K][ceil32(I)]` and their q8 blocks.
    pub router_logits: wgpu::Buffer,
    pub moe_ids: wgpu::Buffer,
    pub moe_weights: wgpu::Buffer,
    pub moe_up: wgpu::Buffer,
    pub moe_mid: wgpu::Buffer,
    pub moe_xq: wgpu::Buffer,
    pub moe_xd: wgpu::Buffer,
    /// The next pre-norm made by an experts' down pass (`expert_gemv::NormTail`): Σx² per
    /// block of 32 residual values, and how many of each block's workgroups finished (u32,
    /// zero between tokens).
    pub norm_part: wgpu::Buffer,
    pub norm_count: wgpu::Buffer,
    /// MoE: how often each expert of each MoE layer was chosen `[MoE layers][E]` (u32).
    pub expert_counts: wgpu::Buffer,
    /// Latent MoE: the latent input of the routed experts and their weighted sum
    /// (`ceil32(L)` each, a batch's lanes a lane width apart; zero past L).
    pub latent: wgpu::Buffer,
    pub latent_sum: wgpu::Buffer,
    /// The q8 blocks of `latent`, which block-format experts read (`q8_rows`).
    pub latent_xq: wgpu::Buffer,
    pub latent_xd: wgpu::Buffer,
    pub logits: wgpu::Buffer,
    /// One-token greedy decode: each lm_head workgroup's best logit, its id and whether
    /// any of its logits was NaN or ±Inf (`[workgroups]` of 4 u32; at most one per row,
    /// plus a 2-D grid's spare workgroups), which the argmax reduces instead of the logits.
    pub argmax_part: wgpu::Buffer,
    pub probs: wgpu::Buffer,
    pub ctrl: wgpu::Buffer,
    pub prompt: wgpu::Buffer,
}

/// The widest vector a GEMV reads in this model (its q8 blocks are sized for it).
pub fn widest_input(c: &ModelConfig) -> usize {
    let attn = c.attention.as_ref().map_or(0, |a| a.q_width());
    let mlp = mlp_shapes(c).map(|m| m.intermediate).max().unwrap_or(0);
    // (A latent MoE's fc2 reads the latent sum.)
    let latent = c.moe.as_ref().and_then(|m| m.latent).unwrap_or(0);
    c.d_model
        .max(c.d_inner)
        .max(attn)
        .max(mlp)
        .max(latent)
        .next_multiple_of(32)
}

/// Every dense MLP shape: the MLP blocks' and the MoE blocks' shared expert.
pub fn mlp_shapes(c: &ModelConfig) -> impl Iterator<Item = &crate::config::MlpConfig> {
    c.mlp
        .iter()
        .chain(c.moe.as_ref().and_then(|m| m.shared.as_ref()))
}

/// `(up rows, ceil32(I))` of the widest dense MLP (scratch sizes), zeros without one.
pub fn mlp_widths(c: &ModelConfig) -> (usize, usize) {
    mlp_shapes(c).fold((0, 0), |(u, i), m| {
        let ups = if m.act == crate::config::MlpAct::SiluGated {
            2
        } else {
            1
        };
        (
            u.max(ups * m.intermediate),
            i.max(m.intermediate.next_multiple_of(32)),
        )
    })
}

impl Scratch {
    /// `ssd_blocks`: the fused SSD step's channel blocks; `attn_part`: f32 values of the
    /// attention partials (0 without attention layers).
    pub fn new(
        ctx: &GpuContext,
        c: &ModelConfig,
        ssd_blocks: usize,
        attn_part: usize,
    ) -> Result<Self> {
        Self::with_lanes(ctx, c, ssd_blocks, attn_part, 1)
    }

    /// Scratch for `lanes` decode lanes side by side (the prompt and expert-count buffers
    /// stay single: a batch counts no expert load). One lane is an engine's scratch.
    pub fn with_lanes(
        ctx: &GpuContext,
        c: &ModelConfig,
        ssd_blocks: usize,
        attn_part: usize,
        lanes: usize,
    ) -> Result<Self> {
        let lanes = lanes.max(1);
        let widest = widest_input(c);
        // A lane's GEMV input row: a whole number of 256-value k-quant superblocks, so no
        // GEMV reads past its lane.
        let lane_width = if lanes > 1 {
            widest.next_multiple_of(256)
        } else {
            widest
        };
        let f32s = |n: usize| 4 * (lanes * n).max(1) as u64;
        let single = |n: usize| 4 * n.max(1) as u64;
        let input = |n: usize| if lanes > 1 { lane_width } else { n };
        let pad = |n: usize| input(n.next_multiple_of(32));
        let qkv = c.attention.as_ref().map_or(0, |a| a.qkv_rows());
        let attn = c.attention.as_ref().map_or(0, |a| pad(a.q_width()));
        let y = pad(c.d_inner);
        let (up, mlp) = mlp_widths(c);
        let (experts, top_k, expert_up, expert_mid) = c.moe.as_ref().map_or((0, 0, 0, 0), |m| {
            (
                m.experts,
                m.slots(),
                m.up_rows(),
                m.intermediate.next_multiple_of(32),
            )
        });
        let moe_layers = c.count(crate::config::BlockKind::Moe);
        let latent = c
            .moe
            .as_ref()
            .and_then(|m| m.latent)
            .map_or(0, |l| l.next_multiple_of(32));
        // (GEMV inputs and outputs: a batch's lanes a lane width apart; none without a
        // latent MoE.)
        let latent_lane = if latent > 0 { input(latent) } else { 0 };
        Ok(Scratch {
            lanes,
            lane_width,
            resid: ctx.storage_zeroed("resid", f32s(c.d_model))?,
            mix: ctx.storage_zeroed("mix", f32s(c.d_in_proj()))?,
            y: ctx.storage_zeroed("y", f32s(y))?,
            part: ctx.storage_zeroed("part", f32s(ssd_blocks))?,
            h: ctx.storage_zeroed("h", f32s(pad(c.d_model)))?,
            v: ctx.storage_zeroed("v", f32s(pad(c.d_inner)))?,
            xq: ctx.storage_zeroed("xq", f32s(lane_width / 4))?,
            xd: ctx.storage_zeroed("xd", f32s(lane_width / 32))?,
            out: ctx.storage_zeroed("out", f32s(c.d_model))?,
            qkv: ctx.storage_zeroed("qkv", f32s(qkv))?,
            attn: ctx.storage_zeroed("attn", f32s(attn))?,
            attn_part: ctx.storage_zeroed("attn partials", f32s(attn_part))?,
            mlp_up: ctx.storage_zeroed("mlp up", f32s(up))?,
            mlp: ctx.storage_zeroed("mlp", f32s(if mlp > 0 { input(mlp) } else { 0 }))?,
            // (A batch's lanes side by side: a lane's rows are the one-token layout's, so
            // the expert passes take the lanes as tokens.)
            router_logits: ctx.storage_zeroed("router logits", f32s(experts))?,
            moe_ids: ctx.storage_zeroed("moe ids", f32s(top_k))?,
            moe_weights: ctx.storage_zeroed("moe weights", f32s(top_k))?,
            moe_up: ctx.storage_zeroed("moe up", f32s(top_k * expert_up))?,
            moe_mid: ctx.storage_zeroed("moe mid", f32s(top_k * expert_mid))?,
            moe_xq: ctx.storage_zeroed("moe xq", f32s(top_k * expert_mid / 4))?,
            moe_xd: ctx.storage_zeroed("moe xd", f32s(top_k * expert_mid / 32))?,
            norm_part: ctx.storage_zeroed("norm partials", f32s(c.d_model.div_ceil(32)))?,
            norm_count: ctx.storage_zeroed("norm counts", f32s(c.d_model.div_ceil(32)))?,
            expert_counts: ctx.storage_zeroed("expert counts", single(moe_layers * experts))?,
            latent: ctx.storage_zeroed("moe latent", f32s(latent_lane))?,
            latent_sum: ctx.storage_zeroed("moe latent sum", f32s(latent_lane))?,
            latent_xq: ctx.storage_zeroed("moe latent xq", f32s(latent_lane / 4))?,
            latent_xd: ctx.storage_zeroed("moe latent xd", f32s(latent_lane / 32))?,
            logits: ctx.storage_zeroed("logits", f32s(c.vocab_size))?,
            // (Only a one-token greedy lm_head writes its workgroups' winners; batches read
            // the logits.)
            argmax_part: ctx.storage_zeroed(
                "argmax partials",
                if lanes > 1 {
                    16
                } else {
                    16 * (c.vocab_size as u64 + crate::gpu::kernels::GRID_X as u64)
                },
            )?,
            probs: ctx.storage_zeroed("probs", f32s(c.vocab_size))?,
            ctrl: ctx.storage_zeroed("ctrl", (lanes * std::mem::size_of::<Ctrl>()) as u64)?,
            prompt: ctx.storage_zeroed("prompt", single(PROMPT_WINDOW))?,
        })
    }

    /// Bytes of all scratch buffers.
    pub fn bytes(&self) -> u64 {
        [
            &self.resid,
            &self.mix,
            &self.y,
            &self.part,
            &self.h,
            &self.v,
            &self.xq,
            &self.xd,
            &self.out,
            &self.qkv,
            &self.attn,
            &self.attn_part,
            &self.mlp_up,
            &self.mlp,
            &self.router_logits,
            &self.moe_ids,
            &self.moe_weights,
            &self.moe_up,
            &self.moe_mid,
            &self.moe_xq,
            &self.moe_xd,
            &self.norm_part,
            &self.norm_count,
            &self.expert_counts,
            &self.latent,
            &self.latent_sum,
            &self.latent_xq,
            &self.latent_xd,
            &self.logits,
            &self.argmax_part,
            &self.probs,
            &self.ctrl,
            &self.prompt,
        ]
        .iter()
        .map(|b| b.size())
        .sum()
    }
}
