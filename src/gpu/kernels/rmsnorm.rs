//! `rmsnorm.wgsl`: `dst [T][KP] = src [T][D] / rms ⊙ params[nw_off..nw_off+D]` for T
//! tokens (KP = D rounded up to 32), and with `q8` the q8 blocks `xq [T][KP/4]`,
//! `xd [T][KP/32]` of the result: the input of the next GEMV or GEMM, made once.

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

/// Elements each workgroup writes (one per invocation; whole q8 blocks) in the gated and
/// MLP-activation norms, the prefill and final RMS norms, and the decode pre-norms of the
/// blocks other than Mamba2 and attention (`gemv::norm_wg_for` for those).
pub const CHUNK: usize = 256;

/// A norm's workgroup size: a power of two of 32 (a q8 block) up to the device's limit.
pub(super) fn check_wg(k: &Kernels, name: &str, wg: usize) -> Result<()> {
    if !wg.is_power_of_two() || wg < 32 || wg > k.max_workgroup() as usize {
        return Err(crate::error::Error::Gpu(format!(
            "{name}: a norm workgroup of {wg} invocations (a power of two of 32 to {})",
            k.max_workgroup()
        )));
    }
    Ok(())
}

/// MAMBA2_NORM_WG, checked (`gemv::check_overrides`).
pub(super) fn norm_wg_override() -> Result<Option<usize>> {
    std::env::var("MAMBA2_NORM_WG")
        .ok()
        .map(|s| parse_norm_wg(&s))
        .transpose()
}

/// A MAMBA2_NORM_WG value: 256, 512 or 1024.
fn parse_norm_wg(s: &str) -> Result<usize> {
    match s.trim().parse::<usize>() {
        Ok(n @ (256 | 512 | 1024)) => Ok(n),
        _ => Err(crate::error::Error::InvalidInput(format!(
            "MAMBA2_NORM_WG={s}: want 256, 512 or 1024 invocations per norm workgroup"
        ))),
    }
}

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/norm_sum.wgsl"),
    include_str!("../../../shaders/rmsnorm.wgsl"),
];

/// Buffers of a norm: input, parameters, f32 output and optional q8 output.
pub struct NormBuffers<'a> {
    pub src: &'a wgpu::Buffer,
    pub params: &'a wgpu::Buffer,
    pub dst: &'a wgpu::Buffer,
    pub q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
}

/// `wg` invocations per workgroup (a power of two of 32 up to the device's limit): the
/// order of the sum of squares, which a GEMV folding the same norm in must share.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm(
    k: &Kernels,
    name: &str,
    d: usize,
    eps: f64,
    nw_off: usize,
    tokens: usize,
    wg: usize,
    b: NormBuffers,
) -> Result<Dispatch> {
    rows(
        k,
        name,
        d,
        eps,
        nw_off,
        tokens,
        d.next_multiple_of(32),
        wg,
        b,
        false,
    )
}

/// `rmsnorm` over a prefill block: four values per 16-byte load where no q8 output is made
/// and D is a multiple of 4 (decode keeps the scalar kernel, whose sums batched lanes
/// repeat bit for bit).
pub fn rmsnorm_block(
    k: &Kernels,
    name: &str,
    d: usize,
    eps: f64,
    nw_off: usize,
    tokens: usize,
    b: NormBuffers,
) -> Result<Dispatch> {
    let vec4 = b.q8.is_none() && d.is_multiple_of(4);
    rows(
        k,
        name,
        d,
        eps,
        nw_off,
        tokens,
        d.next_multiple_of(32),
        CHUNK,
        b,
        vec4,
    )
}

/// The decode norm of `lanes` lanes: `src [L][D]`, `dst [L][W]` and the q8 blocks
/// `xq [L][W/4]`, `xd [L][W/32]` with W the lane stride of `dst` (the one every GEMV input
/// of a batch shares); `wg` as for `rmsnorm`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_lanes(
    k: &Kernels,
    name: &str,
    d: usize,
    eps: f64,
    nw_off: usize,
    lanes: super::Lanes,
    wg: usize,
    b: NormBuffers,
) -> Result<Dispatch> {
    if lanes.cap <= 1 {
        return rmsnorm(k, name, d, eps, nw_off, 1, wg, b);
    }
    let w = super::lane_stride(b.dst, lanes) as usize;
    if let Some((q, s)) = b.q8
        && (4 * super::lane_stride(q, lanes) as usize != w
            || 32 * super::lane_stride(s, lanes) as usize != w)
    {
        return Err(crate::error::Error::Gpu(format!(
            "{name}: the q8 blocks' lane strides do not match the output's {w} values"
        )));
    }
    let mut dispatch = rows(k, name, d, eps, nw_off, lanes.n, w, wg, b, false)?;
    // Past 2¹⁶ values one workgroup per lane normalized a whole lane: Codestral's 64 lanes
    // took 18 µs per norm on 64 workgroups (run 142). Every workgroup of a lane sums the
    // whole lane and writes its own chunks, so any grid gives the same bits.
    spread(&mut dispatch, d, lanes.n, wg);
    Ok(dispatch)
}

#[allow(clippy::too_many_arguments)]
fn rows(
    k: &Kernels,
    name: &str,
    d: usize,
    eps: f64,
    nw_off: usize,
    tokens: usize,
    kp: usize,
    wg: usize,
    b: NormBuffers,
    vec4: bool,
) -> Result<Dispatch> {
    check_len(&format!("{name}: src"), b.src, tokens * d)?;
    check_len(&format!("{name}: params"), b.params, nw_off + d)?;
    check_len(&format!("{name}: dst"), b.dst, (tokens - 1) * kp + d)?;
    check_wg(k, name, wg)?;
    let consts = [
        ("WG", Const::U32(wg as u32)),
        ("NB", Const::U32(d.div_ceil(32) as u32)),
        ("KP", Const::U32(kp as u32)),
        ("RV", Const::U32(1)),
        ("D", Const::U32(d as u32)),
        ("SSL", Const::U32(d.div_ceil(wg) as u32)),
        ("NW_OFF", Const::U32(nw_off as u32)),
        ("EPS", Const::F32(eps as f32)),
    ];
    let entries = vec![(0, b.src), (1, b.params), (2, b.dst)];
    let shader = ("rmsnorm", SOURCES);
    let extra: &[&'static str] = if vec4 { &["VEC4"] } else { &["NORM_SUM"] };
    norm_dispatch_flags(
        k,
        name,
        shader,
        &consts,
        entries,
        b.q8,
        (d, wg),
        tokens,
        extra,
        &[],
    )
}

/// How many workgroups of `chunk` invocations (one channel each) share one token's `width`
/// channels: decode spreads one token over the GPU, and a few rows too, such as the MoE
/// activations of a token's chosen experts (measured on the H200: one workgroup per row
/// made that activation cost as much as the expert GEMVs); prefill gives each token one
/// workgroup.
pub(super) fn workgroups_per_token(width: usize, tokens: usize, chunk: usize) -> usize {
    if tokens * width <= 1 << 16 {
        width.div_ceil(chunk)
    } else {
        1
    }
}

/// Widens a grid where `workgroups_per_token` gives each token one (past 2¹⁶ values) to
/// about 1024 workgroups in all, for the batched decode norms and MLP activations, whose
/// work is split in chunks of `chunk` by a grid-stride loop (any split gives the same
/// bits). One per token left Nemotron-H 8B's batched activation (16 lanes × 21504 values)
/// on 16 workgroups: 1.32 GPU ms per step (run 128).
pub(super) fn spread(d: &mut Dispatch, width: usize, tokens: usize, chunk: usize) {
    if d.workgroups.0 == 1 {
        d.workgroups.0 = width
            .div_ceil(chunk)
            .min((1024 / tokens.max(1)).max(1))
            .max(1) as u32;
    }
}

/// What every norm shares after its own checks: the optional q8 output (bound right after
/// `entries`), the kernel's own `extra` flags, `tail` bindings after the q8 ones, the
/// pipeline, and the grid for `tokens` rows of `width` outputs over workgroups of `chunk`
/// invocations (the kernel's `WG`).
#[allow(clippy::too_many_arguments)]
pub(super) fn norm_dispatch_flags<'a>(
    k: &Kernels,
    name: &str,
    (shader, sources): (&str, super::Sources),
    consts: &[(&str, Const)],
    mut entries: Vec<(u32, &'a wgpu::Buffer)>,
    q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
    (width, chunk): (usize, usize),
    tokens: usize,
    extra: &[&'static str],
    tail: &[(u32, &'a wgpu::Buffer)],
) -> Result<Dispatch> {
    let kp = width.next_multiple_of(32);
    let mut flags = vec!["REDUCE"];
    flags.extend_from_slice(extra);
    let mut consts = consts.to_vec();
    if let Some((q, s)) = q8 {
        check_len(&format!("{name}: xq"), q, tokens * kp / 4)?;
        check_len(&format!("{name}: xd"), s, tokens * kp / 32)?;
        flags.push("Q8_OUT");
        if let Some(piece) = k.q8_shuffle() {
            flags.push("Q8_SHUFFLE");
            consts.push(piece);
        }
        let next = entries.len() as u32;
        entries.extend([(next, q), (next + 1, s)]);
    }
    entries.extend_from_slice(tail);
    let pipeline = k.pipeline(shader, sources, &consts, &flags, true)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (
            workgroups_per_token(width, tokens, chunk) as u32,
            tokens as u32,
            1,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Norm,
        label: Label::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workgroup_override_names_the_variable() {
        assert_eq!(parse_norm_wg(" 1024").unwrap(), 1024);
        assert_eq!(parse_norm_wg("256").unwrap(), 256);
        for bad in ["", "128", "2048", "300", "big"] {
            let e = parse_norm_wg(bad).unwrap_err().to_string();
            assert!(e.contains("MAMBA2_NORM_WG"), "{e}");
        }
    }
}
