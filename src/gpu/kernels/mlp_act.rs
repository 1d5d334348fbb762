//! `mlp_act.wgsl`: the MLP's activation for T tokens — `relu(u)²` (Nemotron-H) or
//! `silu(g)·u` (gated MLPs) — from the up projection's rows `src [T][ss]` (`ss ≥ I`, or
//! `≥ 2I` laid out `[g | u]` when gated) into `dst [T][KP]` (KP = I rounded up to 32, zero
//! past I), with `q8` also the q8 blocks `xq [T][KP/4]`, `xd [T][KP/32]` for a q8_0 down
//! projection.

use super::rmsnorm::{CHUNK, norm_dispatch_flags, spread};
use super::{Dispatch, Section, check_len};
use crate::config::MlpAct;
use crate::error::{Error, Result};
use crate::gpu::kernels::Kernels;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/mlp_act.wgsl")];

/// The activation's input rows, output rows and optional q8 blocks of the output.
pub struct ActBuffers<'a> {
    pub src: &'a wgpu::Buffer,
    pub dst: &'a wgpu::Buffer,
    pub q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
}

/// An MLP's biases: in `params`, the up (or `[gate | up]`) biases at `up_off` and the
/// down bias (`d` values) at `down_off`, which is added to `resid [T][d]` here.
pub struct MlpBias<'a> {
    pub params: &'a wgpu::Buffer,
    pub up_off: usize,
    pub down_off: usize,
    pub resid: &'a wgpu::Buffer,
    pub d: usize,
}

/// The activation of `tokens` rows of width `intermediate`.
#[allow(clippy::too_many_arguments)]
pub fn mlp_act(
    k: &Kernels,
    name: &str,
    act: MlpAct,
    intermediate: usize,
    src_stride: usize,
    tokens: usize,
    b: ActBuffers,
    bias: Option<MlpBias>,
) -> Result<Dispatch> {
    let kp = intermediate.next_multiple_of(32);
    mlp_act_rows(k, name, act, intermediate, src_stride, tokens, kp, b, bias)
}

/// `mlp_act` with `dst` rows (and their q8 blocks) `dst_stride` values apart: a batch of
/// decode lanes, whose GEMV inputs share one stride.
#[allow(clippy::too_many_arguments)]
pub fn mlp_act_rows(
    k: &Kernels,
    name: &str,
    act: MlpAct,
    intermediate: usize,
    src_stride: usize,
    tokens: usize,
    dst_stride: usize,
    b: ActBuffers,
    bias: Option<MlpBias>,
) -> Result<Dispatch> {
    let kp = intermediate.next_multiple_of(32);
    if dst_stride < kp || !dst_stride.is_multiple_of(32) {
        return Err(Error::Gpu(format!(
            "{name}: dst rows {dst_stride} apart cannot hold {kp} values in q8 blocks"
        )));
    }
    let need = match act {
        MlpAct::Relu2 => intermediate,
        MlpAct::SiluGated => 2 * intermediate,
    };
    if src_stride < need {
        return Err(Error::Gpu(format!(
            "{name}: rows of {src_stride} values cannot hold the {need} the activation reads"
        )));
    }
    check_len(
        &format!("{name}: src"),
        b.src,
        (tokens - 1) * src_stride + need,
    )?;
    check_len(
        &format!("{name}: dst"),
        b.dst,
        (tokens - 1) * dst_stride + kp,
    )?;
    let mut consts = vec![
        ("WG", Const::U32(CHUNK as u32)),
        ("NB", Const::U32(kp as u32 / 32)),
        ("KP", Const::U32(kp as u32)),
        ("DS", Const::U32(dst_stride as u32)),
        ("RV", Const::U32(1)),
        ("I", Const::U32(intermediate as u32)),
        ("SS", Const::U32(src_stride as u32)),
        ("GATED", Const::U32((act == MlpAct::SiluGated) as u32)),
    ];
    let entries = vec![(0, b.src), (1, b.dst)];
    let mut tail = Vec::new();
    let mut flags: &[&str] = &[];
    if let Some(bias) = &bias {
        check_len(&format!("{name}: params"), bias.params, bias.up_off + need)?;
        check_len(
            &format!("{name}: params"),
            bias.params,
            bias.down_off + bias.d,
        )?;
        check_len(&format!("{name}: resid"), bias.resid, tokens * bias.d)?;
        let u = |v: usize| Const::U32(v as u32);
        consts.extend([
            ("UB_OFF", u(bias.up_off)),
            ("DB_OFF", u(bias.down_off)),
            ("D", u(bias.d)),
        ]);
        tail.extend([(4, bias.params), (5, bias.resid)]);
        flags = &["BIAS"];
    }
    let shader = ("mlp_act", SOURCES);
    let mut d = norm_dispatch_flags(
        k,
        name,
        shader,
        &consts,
        entries,
        b.q8,
        (kp, CHUNK),
        tokens,
        flags,
        &tail,
    )?;
    spread(&mut d, kp, tokens, CHUNK);
    d.section = Section::Mlp;
    Ok(d)
}
