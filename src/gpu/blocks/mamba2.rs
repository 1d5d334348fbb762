//! The Mamba2 block's dispatches. Decode, fused (4): the pre-norm (+ q8 of its output;
//! for narrow quantized in_proj matrices folded into in_proj's prologue, `gemv::folds_norm`),
//! in_proj with the conv step and dt softplus in its epilogue, the SSD step with the gate
//! and the per-block Σv², out_proj with the group norm in its prologue and the residual
//! add in its epilogue. Unfused (7, the parity baseline): rmsnorm, gemv, conv_step,
//! ssd_step, gated_norm, gemv, residual_add. Prefill: norm, in_proj GEMM, conv (+ conv
//! state), the five chunked-SSD kernels, gated norm, out_proj GEMM with the residual.

use super::BlockCtx;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::gpu::device_weights::ParamLayout;
use crate::gpu::kernels::chunk::ChunkConsts;
use crate::gpu::kernels::gated_norm::{self, Batch, GatedNormBuffers};
use crate::gpu::kernels::gemm::{GemmOutput, projection};
use crate::gpu::kernels::gemv::{self, GemvBuffers, GemvInput, GemvOutput, MixerConsts};
use crate::gpu::kernels::prefill_conv::ConvBuffers;
use crate::gpu::kernels::ssd_chunk_scan::{ScanBuffers, ssd_chunk_scan};
use crate::gpu::kernels::ssd_step::{self, SsdBuffers, SsdConsts};
use crate::gpu::kernels::{
    Dispatch, conv_step, prefill_conv, residual_add, ssd_cb, ssd_chunk_state, ssd_cumsum,
    ssd_state_pass,
};
use crate::gpu::prefill::Prefill;
use crate::gpu::weights::DeviceMatrix;

/// A Mamba2 layer's device buffers.
pub struct MambaLayer<'a> {
    pub in_proj: &'a DeviceMatrix,
    pub out_proj: &'a DeviceMatrix,
    pub params: &'a wgpu::Buffer,
    pub conv_state: &'a wgpu::Buffer,
    pub ssm_state: &'a wgpu::Buffer,
}

impl<'a> MambaLayer<'a> {
    pub fn new(
        in_proj: &'a DeviceMatrix,
        out_proj: &'a DeviceMatrix,
        params: &'a wgpu::Buffer,
        conv_state: &'a wgpu::Buffer,
        ssm_state: &'a wgpu::Buffer,
    ) -> Self {
        MambaLayer {
            in_proj,
            out_proj,
            params,
            conv_state,
            ssm_state,
        }
    }
}

/// The SSD step's sizes for a config.
pub fn ssd_consts(c: &ModelConfig, layout: &ParamLayout) -> SsdConsts {
    SsdConsts {
        heads: c.n_heads,
        head_dim: c.head_dim,
        groups: c.n_groups,
        d_state: c.d_state,
        d_inner: c.d_inner,
        conv_dim: c.conv_dim(),
        a_off: layout.a,
        d_off: layout.d,
        nw_off: layout.mixer_norm,
    }
}

/// Sizes and parameter offsets of the conv step and the in_proj epilogue.
pub fn mixer_consts(c: &ModelConfig, layout: &ParamLayout) -> MixerConsts {
    MixerConsts {
        d_inner: c.d_inner,
        conv_dim: c.conv_dim(),
        heads: c.n_heads,
        kernel: c.d_conv,
        cw_off: layout.conv_w,
        cb_off: layout.conv_b,
        dtb_off: layout.dt_bias,
        dt_limit: c.time_step_limit,
    }
}

/// Whether the fused graph can run these shapes: its out_proj scales whole input vectors
/// (4 columns, or a 32-column q8 block for the quantized formats) by one group's 1/rms, so
/// groups must split into them.
pub fn fusable(c: &ModelConfig, format: crate::model::quant::WeightFormat) -> bool {
    c.group_size()
        .is_multiple_of(crate::gpu::kernels::gemv::group_unit(format))
}

/// Where a decode token's pre-norm comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreNorm {
    /// The norm kernel's dispatch before the block wrote `h` and its q8 blocks.
    Made,
    /// Folded into in_proj's prologue, which reads the residual (`gemv::folds_norm` says
    /// where it can): the norm weights' offset in the layer's parameters.
    Fold(usize),
    /// Made by the experts' down pass before the block (`moe::tail_takes_next_norm`): the
    /// q8 blocks of x ⊙ w without the 1/rms, which in_proj takes from the per-block Σx²
    /// in `norm_part` (the group-norm prologue with one group of d_model).
    Tail,
}

/// One decode token through the layer, its pre-norm where `pre_norm` says (the unfused
/// graph takes only `Made`).
pub fn decode(
    b: &BlockCtx,
    l: &MambaLayer,
    fused: bool,
    pre_norm: PreNorm,
) -> Result<Vec<Dispatch>> {
    let (k, c, s) = (b.k, b.c, b.s);
    let eps = c.norm_eps;
    let ssd = ssd_consts(c, b.layout);
    let q8 = b.q8();
    let gemv_in = |src| b.gemv_in(src, &s.mix);
    let mut d = Vec::new();
    if !fused && pre_norm != PreNorm::Made {
        return Err(crate::Error::Gpu(format!(
            "the unfused Mamba2 graph takes its pre-norm from the norm kernel, not {pre_norm:?}"
        )));
    }
    if fused {
        let (name, input, src) = match pre_norm {
            PreNorm::Made => ("in_proj+conv", GemvInput::Plain, &s.h),
            PreNorm::Fold(nw_off) => (
                "norm+in_proj+conv",
                GemvInput::Norm {
                    d: c.d_model,
                    eps,
                    nw_off,
                    wg: gemv::norm_wg_for(k, l.in_proj, true)?,
                },
                &s.resid,
            ),
            PreNorm::Tail => (
                "rms+in_proj+conv",
                GemvInput::Group {
                    groups: 1,
                    group_size: c.d_model,
                    blocks_per_group: c.d_model.div_ceil(32),
                    eps,
                },
                &s.h,
            ),
        };
        let part = (pre_norm == PreNorm::Tail).then_some(&s.norm_part);
        d.push(gemv::gemv(
            k,
            name,
            l.in_proj,
            input,
            GemvOutput::Mixer(mixer_consts(c, b.layout)),
            GemvBuffers {
                params: Some(l.params),
                conv_state: Some(l.conv_state),
                ctrl: Some(&s.ctrl),
                part,
                ..gemv_in(src)
            },
        )?);
        d.push(ssd_step::ssd_step(
            k,
            "ssd_step+gate",
            ssd,
            SsdBuffers {
                mix: &s.mix,
                params: l.params,
                state: l.ssm_state,
                y: &s.y,
                part: Some(&s.part),
                q8,
                ctrl: &s.ctrl,
                lanes: b.lanes,
            },
        )?);
        d.push(gemv::gemv(
            k,
            "out_proj+norm+residual",
            l.out_proj,
            GemvInput::Group {
                groups: c.n_groups,
                group_size: c.group_size(),
                blocks_per_group: ssd.blocks() / c.n_groups,
                eps,
            },
            GemvOutput::Add,
            GemvBuffers {
                dst: &s.resid,
                part: Some(&s.part),
                ..gemv_in(&s.y)
            },
        )?);
        return Ok(d);
    }
    d.push(gemv::gemv(
        k,
        "in_proj",
        l.in_proj,
        GemvInput::Plain,
        GemvOutput::Store,
        gemv_in(&s.h),
    )?);
    d.push(conv_step::conv_step(
        k,
        "conv_step",
        mixer_consts(c, b.layout),
        &s.mix,
        l.params,
        l.conv_state,
        &s.ctrl,
    )?);
    d.push(ssd_step::ssd_step(
        k,
        "ssd_step",
        ssd,
        SsdBuffers {
            mix: &s.mix,
            params: l.params,
            state: l.ssm_state,
            y: &s.y,
            part: None,
            q8: None,
            ctrl: &s.ctrl,
            lanes: b.lanes,
        },
    )?);
    d.push(gated_norm::gated_norm(
        k,
        "gated_norm",
        c.d_inner,
        c.n_groups,
        eps,
        b.layout.mixer_norm,
        Batch {
            tokens: 1,
            mix_stride: c.d_in_proj(),
        },
        GatedNormBuffers {
            y: &s.y,
            mix: &s.mix,
            params: l.params,
            dst: &s.v,
            q8,
        },
    )?);
    d.push(gemv::gemv(
        k,
        "out_proj",
        l.out_proj,
        GemvInput::Plain,
        GemvOutput::Store,
        GemvBuffers {
            dst: &s.out,
            ..gemv_in(&s.v)
        },
    )?);
    d.push(residual_add::residual_add(
        k, "residual", c.d_model, &s.out, &s.resid,
    )?);
    Ok(d)
}

/// A prefill block through the layer (after the batched pre-norm into `p.h`).
pub fn prefill(
    b: &BlockCtx,
    p: &Prefill,
    cc: ChunkConsts,
    l: &MambaLayer,
) -> Result<Vec<Dispatch>> {
    let (k, c, s) = (b.k, b.c, b.s);
    let t = cc.max_tokens;
    let lay = b.layout;
    let mc = mixer_consts(c, lay);
    let cc = ChunkConsts {
        u_f16: prefill_conv::u_in_f16(k, &cc, &mc, &p.y),
        ..cc
    };
    // In the short-block graph the projections split their K loops (`gemm_split`).
    let mut d = projection(
        k,
        "in_proj",
        l.in_proj,
        t,
        &p.h,
        &p.part,
        &p.mix,
        c.d_in_proj(),
        GemmOutput::Store,
        &s.ctrl,
    )?;
    let conv = ConvBuffers {
        mix: &p.mix,
        params: l.params,
        conv_state: l.conv_state,
        u: &p.u,
        ctrl: &s.ctrl,
    };
    d.push(prefill_conv::prefill_conv(k, "conv", cc, mc, conv)?);
    d.push(prefill_conv::prefill_conv_state(
        k,
        "conv_state",
        cc,
        mc,
        &p.mix,
        l.conv_state,
        &s.ctrl,
    )?);
    d.push(
        ssd_cumsum::ssd_cumsum(
            k,
            "ssd_cumsum",
            cc,
            lay.a,
            &p.mix,
            l.params,
            &p.lam,
            &s.ctrl,
        )?
        .per_token(1, cc.q, 1),
    );
    d.push(ssd_cb::ssd_cb(k, "ssd_cb", cc, &p.u, &p.cb, &s.ctrl)?.per_token(2, cc.q, c.n_groups));
    d.push(
        ssd_chunk_state::ssd_chunk_state(
            k,
            "ssd_chunk_state",
            cc,
            &p.mix,
            &p.u,
            &p.lam,
            &p.cst,
            &s.ctrl,
        )?
        .per_token(2, cc.q, c.n_heads),
    );
    // The tensor-core chunk scan reads the entering states in f16.
    let cst16 = crate::gpu::kernels::ssd_chunk_scan_coop::applies(k, &cc, &p.y).then_some(&p.cst16);
    d.push(ssd_state_pass::ssd_state_pass(
        k,
        "ssd_state_pass",
        cc,
        &p.lam,
        &p.cst,
        l.ssm_state,
        cst16,
        &s.ctrl,
    )?);
    let scan = ScanBuffers {
        mix: &p.mix,
        u: &p.u,
        params: l.params,
        lam: &p.lam,
        cb: &p.cb,
        cst: &p.cst,
        cst16,
        y: &p.y,
        ctrl: &s.ctrl,
    };
    d.push(ssd_chunk_scan(k, "ssd_chunk_scan", cc, lay.d, scan)?.per_token(2, cc.q, 1));
    let gated = GatedNormBuffers {
        y: &p.y,
        mix: &p.mix,
        params: l.params,
        dst: &p.v,
        q8: None,
    };
    let batch = Batch {
        tokens: t,
        mix_stride: c.d_in_proj(),
    };
    d.push(
        gated_norm::gated_norm(
            k,
            "gated_norm",
            c.d_inner,
            c.n_groups,
            c.norm_eps,
            lay.mixer_norm,
            batch,
            gated,
        )?
        .per_token(1, 1, 1),
    );
    d.extend(projection(
        k,
        "out_proj+residual",
        l.out_proj,
        t,
        &p.v,
        &p.part,
        &p.resid,
        c.d_model,
        GemmOutput::Add,
        &s.ctrl,
    )?);
    Ok(d)
}
