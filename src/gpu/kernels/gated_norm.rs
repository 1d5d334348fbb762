//! `gated_norm.wgsl` (unfused graph, prefill): `dst [T][KP] = groupnorm(y ⊙ silu(z)) ⊙ w`
//! over G groups for T tokens (`y [T][d_inner]`, z the first d_inner of each `mix` row),
//! and with `q8` the q8 blocks of the result for out_proj.

use super::rmsnorm::{CHUNK, norm_dispatch_flags, workgroups_per_token};
use super::{Dispatch, Kernels, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/gated_norm.wgsl")];

/// How many tokens a call normalizes, and the row stride of `mix` (d_in_proj).
#[derive(Clone, Copy, Debug)]
pub struct Batch {
    pub tokens: usize,
    pub mix_stride: usize,
}

/// Buffers of the gated norm: `y`, the mixer row vector (z first), parameters, outputs.
pub struct GatedNormBuffers<'a> {
    pub y: &'a wgpu::Buffer,
    pub mix: &'a wgpu::Buffer,
    pub params: &'a wgpu::Buffer,
    pub dst: &'a wgpu::Buffer,
    pub q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
}

/// The most vec4s an invocation holds in registers (`REG`): 16 covers d_inner up to
/// 16384 channels.
const MAX_HELD: usize = 16;

#[allow(clippy::too_many_arguments)]
pub fn gated_norm(
    k: &Kernels,
    name: &str,
    d_inner: usize,
    groups: usize,
    eps: f64,
    nw_off: usize,
    batch: Batch,
    b: GatedNormBuffers,
) -> Result<Dispatch> {
    let Batch { tokens, mix_stride } = batch;
    let kp = d_inner.next_multiple_of(32);
    check_len(&format!("{name}: y"), b.y, tokens * d_inner)?;
    check_len(
        &format!("{name}: mix"),
        b.mix,
        (tokens - 1) * mix_stride + d_inner,
    )?;
    check_len(&format!("{name}: dst"), b.dst, (tokens - 1) * kp + d_inner)?;
    check_len(&format!("{name}: params"), b.params, nw_off + d_inner)?;
    let mut consts = vec![
        ("WG", Const::U32(CHUNK as u32)),
        ("NB", Const::U32(d_inner.div_ceil(32) as u32)),
        ("KP", Const::U32(kp as u32)),
        ("MIX", Const::U32(mix_stride as u32)),
        ("RV", Const::U32(groups as u32)),
        ("DI", Const::U32(d_inner as u32)),
        ("GS", Const::U32((d_inner / groups) as u32)),
        ("NW_OFF", Const::U32(nw_off as u32)),
        ("EPS", Const::F32(eps as f32)),
    ];
    let entries = vec![(0, b.y), (1, b.mix), (2, b.params), (3, b.dst)];
    let shader = ("gated_norm", SOURCES);
    // Four channels per load where no q8 output is made and the rows split into vec4s.
    let vec4 = b.q8.is_none()
        && d_inner.is_multiple_of(4)
        && (d_inner / groups).is_multiple_of(4)
        && mix_stride.is_multiple_of(4);
    // With one workgroup per token, each invocation keeps its channels in registers between
    // the sum and the scaling (up to MAX_HELD vec4s).
    let held = (d_inner / 4).div_ceil(CHUNK);
    let reg = vec4 && workgroups_per_token(d_inner, tokens, CHUNK) == 1 && held <= MAX_HELD;
    let extra: &[&'static str] = match (vec4, reg) {
        (true, true) => &["VEC4", "REG"],
        (true, false) => &["VEC4"],
        _ => &[],
    };
    consts.push(("PER", Const::U32(held.max(1) as u32)));
    norm_dispatch_flags(
        k,
        name,
        shader,
        &consts,
        entries,
        b.q8,
        (d_inner, CHUNK),
        tokens,
        extra,
        &[],
    )
}
