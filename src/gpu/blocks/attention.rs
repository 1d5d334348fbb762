//! The attention block's dispatches. Decode (5 after the pre-norm): the `[q|k|v]` GEMV (one
//! per part where the projection's parts keep block types that differ, `DeviceMixer`),
//! `kv_store` (the token's K/V into cache row `ctrl.kv_len`, RoPE when asked; fused without
//! RoPE, the GEMV's epilogue stores them instead: 4), flash-decoding
//! over the cached rows in segments (`attention_decode`) and the merge of the segments
//! (`attention_combine`, with the q8 blocks of the heads' output for a q8_0 o_proj), then
//! o_proj adding into the residual. Prefill: the same with GEMMs, and causal tiled
//! attention of the block's tokens over every cached row (`attention_prefill`).

use super::BlockCtx;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gpu::kernels::attention_combine::attention_combine;
use crate::gpu::kernels::attention_decode::{attention_decode, decode_partials_len};
use crate::gpu::kernels::attention_prefill::attention_prefill;
use crate::gpu::kernels::attn::{AttnBuffers, AttnConsts};
use crate::gpu::kernels::gemm::{GemmOutput, projection};
use crate::gpu::kernels::gemv::{self, GemvBuffers, GemvInput, GemvOutput, KvOut};
use crate::gpu::kernels::kv_store::kv_store;
use crate::gpu::kernels::{Dispatch, Section};
use crate::gpu::prefill::Prefill;
use crate::gpu::state_store::KvFormat;
use crate::gpu::weights::DeviceMatrix;

/// The attention kernels' view of a layer of `c` with caches of `ctx` rows.
pub fn consts(c: &ModelConfig, ctx: usize, kv: KvFormat) -> Option<AttnConsts> {
    let a = c.attention.as_ref()?;
    Some(AttnConsts {
        dims: a.dims(),
        ctx,
        format: kv,
        qkv_stride: a.qkv_rows(),
        scale: a.scale,
        rope: a.rope_theta,
    })
}

/// The kernels' view of this model's attention layers with the store's caches.
fn layer_consts(b: &BlockCtx) -> Result<AttnConsts> {
    consts(b.c, b.state.ctx, b.state.kv)
        .ok_or_else(|| Error::Gpu("an attention layer in a config without attention".into()))
}

/// f32 values of the decode partials buffer (0 without attention layers).
pub fn partials_len(c: &ModelConfig, ctx: usize) -> usize {
    match consts(c, ctx, KvFormat::F16) {
        Some(ac) if ctx > 0 => decode_partials_len(&ac),
        _ => 0,
    }
}

fn attn_section(d: Dispatch) -> Dispatch {
    Dispatch {
        section: Section::Attn,
        ..d
    }
}

/// One decode token through an attention layer, after the pre-norm into `h` or (one token,
/// `pre_norm`: the layer's parameters and the norm weights' offset in them) with the
/// pre-norm folded into the qkv GEMV's prologue, which reads the residual
/// (`gemv::folds_norm` says where it can). `fused`, one token and no RoPE: the qkv GEMV
/// stores the k and v rows into the caches itself (one dispatch fewer). `qkv` in parts of
/// different formats: one GEMV each into its rows, after a pre-norm dispatch, and the K/V
/// store dispatch.
pub fn decode(
    b: &BlockCtx,
    qkv: &[DeviceMatrix],
    o: &DeviceMatrix,
    k_cache: &wgpu::Buffer,
    v_cache: &wgpu::Buffer,
    fused: bool,
    pre_norm: Option<(&wgpu::Buffer, usize)>,
) -> Result<Vec<Dispatch>> {
    let (k, s) = (b.k, b.s);
    let ac = layer_consts(b)?;
    let bufs = AttnBuffers {
        qkv: &s.qkv,
        k_cache,
        v_cache,
        ctrl: &s.ctrl,
        lanes: b.lanes,
    };
    let d = ac.dims;
    let f32 = ac.format == KvFormat::F32;
    let (q_rows, kv_rows) = (d.q_len(), d.kv_len());
    let qkv = match qkv {
        [whole] => whole,
        parts => {
            if pre_norm.is_some() {
                return Err(Error::Gpu(format!(
                    "{}: a qkv projection in {} parts takes its pre-norm from a dispatch",
                    parts[0].name,
                    parts.len()
                )));
            }
            let mut out: Vec<Dispatch> =
                super::parts::gemvs(b, "qkv_proj", parts, ac.qkv_stride, &s.h, &s.qkv)?
                    .into_iter()
                    .map(attn_section)
                    .collect();
            out.push(kv_store(k, "kv_store", ac, None, &bufs)?);
            out.extend(attend_and_project(b, ac, &bufs, o)?);
            return Ok(out);
        }
    };
    // The folded pre-norm's workgroup size: the norm kernel's, for the K/V check and the
    // GEMV alike.
    let norm_wg = pre_norm
        .map(|_| gemv::norm_wg_for(k, qkv, false))
        .transpose()?;
    let fold = fused
        && b.lanes.cap == 1
        && ac.rope.is_none()
        && gemv::stores_kv(k, qkv, q_rows, kv_rows, f32, norm_wg)?;
    let (input, src, params) = match pre_norm.zip(norm_wg) {
        Some(((params, nw_off), wg)) => (
            GemvInput::Norm {
                d: b.c.d_model,
                eps: b.c.norm_eps,
                nw_off,
                wg,
            },
            &s.resid,
            Some(params),
        ),
        None => (GemvInput::Plain, &s.h, None),
    };
    let name = match (pre_norm.is_some(), fold) {
        (false, false) => "qkv_proj",
        (false, true) => "qkv_proj+kv_store",
        (true, false) => "norm+qkv_proj",
        (true, true) => "norm+qkv_proj+kv_store",
    };
    let mut out = vec![attn_section(gemv::gemv(
        k,
        name,
        qkv,
        input,
        GemvOutput::Store,
        GemvBuffers {
            params,
            kv: fold.then_some(KvOut {
                k_cache,
                v_cache,
                ctrl: &s.ctrl,
                q_rows,
                kv_rows,
                ctx: ac.ctx,
                f32,
            }),
            ..b.gemv_in(src, &s.qkv)
        },
    )?)];
    if !fold {
        out.push(kv_store(k, "kv_store", ac, None, &bufs)?);
    }
    out.extend(attend_and_project(b, ac, &bufs, o)?);
    Ok(out)
}

/// Decode after the K/V store: flash-decoding over the cached rows, the merge of its
/// segments, and o_proj into the residual.
fn attend_and_project(
    b: &BlockCtx,
    ac: AttnConsts,
    bufs: &AttnBuffers,
    o: &DeviceMatrix,
) -> Result<Vec<Dispatch>> {
    let (k, s) = (b.k, b.s);
    Ok(vec![
        attention_decode(k, "attention", ac, bufs, &s.attn_part)?,
        attention_combine(
            k,
            "combine",
            ac,
            b.lanes,
            &s.attn_part,
            &s.ctrl,
            &s.attn,
            b.q8(),
        )?,
        attn_section(gemv::gemv(
            k,
            "o_proj+residual",
            o,
            GemvInput::Plain,
            GemvOutput::Add,
            b.gemv_in(&s.attn, &s.resid),
        )?),
    ])
}

/// A prefill block through an attention layer (after the batched pre-norm into `p.h`).
pub fn prefill(
    b: &BlockCtx,
    p: &Prefill,
    tokens: usize,
    qkv: &[DeviceMatrix],
    o: &DeviceMatrix,
    k_cache: &wgpu::Buffer,
    v_cache: &wgpu::Buffer,
) -> Result<Vec<Dispatch>> {
    let (k, s) = (b.k, b.s);
    let ac = layer_consts(b)?;
    let bufs = AttnBuffers {
        qkv: &p.qkv,
        k_cache,
        v_cache,
        ctrl: &s.ctrl,
        lanes: crate::gpu::kernels::Lanes::ONE,
    };
    // (A projection in parts of different formats: one GEMM each into its rows.)
    let mut d: Vec<Dispatch> = super::parts::gemms(
        k,
        "qkv_proj",
        qkv,
        ac.qkv_stride,
        tokens,
        &p.h,
        &p.part,
        &p.qkv,
        &s.ctrl,
    )?
    .into_iter()
    .map(attn_section)
    .collect();
    d.push(kv_store(k, "kv_store", ac, Some(tokens), &bufs)?);
    d.push(attention_prefill(
        k,
        "attention",
        ac,
        tokens,
        &bufs,
        &p.attn,
    )?);
    d.extend(
        projection(
            k,
            "o_proj+residual",
            o,
            tokens,
            &p.attn,
            &p.part,
            &p.resid,
            b.c.d_model,
            GemmOutput::Add,
            &s.ctrl,
        )?
        .into_iter()
        .map(attn_section),
    );
    Ok(d)
}
