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
    pub logits: wgpu::Buffer,
    pub probs: wgpu::Buffer,
    pub ctrl: wgpu::Buffer,
    pub prompt: wgpu::Buffer,
}

/// The widest vector a GEMV reads in this model (its q8 blocks are sized for it).
pub fn widest_input(c: &ModelConfig) -> usize {
    let attn = c.attention.as_ref().map_or(0, |a| a.q_width());
    let mlp = c.mlp.as_ref().map_or(0, |m| m.intermediate);
    c.d_model
        .max(c.d_inner)
        .max(attn)
        .max(mlp)
        .next_multiple_of(32)
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
        let f32s = |n: usize| 4 * n.max(1) as u64;
        let widest = widest_input(c);
        let pad = |n: usize| n.next_multiple_of(32);
        let qkv = c.attention.as_ref().map_or(0, |a| a.qkv_rows());
        let attn = c.attention.as_ref().map_or(0, |a| pad(a.q_width()));
        let (up, mlp) = c.mlp.as_ref().map_or((0, 0), |m| {
            let ups = if m.act == crate::config::MlpAct::SiluGated {
                2
            } else {
                1
            };
            (ups * m.intermediate, pad(m.intermediate))
        });
        Ok(Scratch {
            resid: ctx.storage_zeroed("resid", f32s(c.d_model))?,
            mix: ctx.storage_zeroed("mix", f32s(c.d_in_proj()))?,
            y: ctx.storage_zeroed("y", f32s(pad(c.d_inner)))?,
            part: ctx.storage_zeroed("part", f32s(ssd_blocks))?,
            h: ctx.storage_zeroed("h", f32s(pad(c.d_model)))?,
            v: ctx.storage_zeroed("v", f32s(pad(c.d_inner)))?,
            xq: ctx.storage_zeroed("xq", f32s(widest / 4))?,
            xd: ctx.storage_zeroed("xd", f32s(widest / 32))?,
            out: ctx.storage_zeroed("out", f32s(c.d_model))?,
            qkv: ctx.storage_zeroed("qkv", f32s(qkv))?,
            attn: ctx.storage_zeroed("attn", f32s(attn))?,
            attn_part: ctx.storage_zeroed("attn partials", f32s(attn_part))?,
            mlp_up: ctx.storage_zeroed("mlp up", f32s(up))?,
            mlp: ctx.storage_zeroed("mlp", f32s(mlp))?,
            logits: ctx.storage_zeroed("logits", f32s(c.vocab_size))?,
            probs: ctx.storage_zeroed("probs", f32s(c.vocab_size))?,
            ctrl: ctx.storage_zeroed("ctrl", std::mem::size_of::<Ctrl>() as u64)?,
            prompt: ctx.storage_zeroed("prompt", f32s(PROMPT_WINDOW))?,
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
            &self.logits,
            &self.probs,
            &self.ctrl,
            &self.prompt,
        ]
        .iter()
        .map(|b| b.size())
        .sum()
    }
}
