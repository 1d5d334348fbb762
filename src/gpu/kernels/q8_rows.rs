//! `q8_rows.wgsl`: the q8 blocks of `tokens` rows of `k` f32 values, `src [T][ss]` →
//! `xq [T][ds/4]`, `xd [T][ds/32]` (`ds` ≥ k rounded up to 32, a multiple of 32; blocks
//! zero past k), by the rule of every other q8 output. A latent MoE's experts read their
//! f32 input (fc1's output) through it, so that their blocks multiply as stored against
//! 8-bit activations, as every other quantized GEMV's do.

use super::rmsnorm::{CHUNK, norm_dispatch_flags, spread};
use super::{Dispatch, Kernels, Section, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/q8_rows.wgsl")];

/// The q8 blocks of `tokens` rows of `k` values `ss` apart in `src`, into `q8` with rows
/// `ds` values apart.
#[allow(clippy::too_many_arguments)]
pub fn q8_rows(
    kernels: &Kernels,
    name: &str,
    k: usize,
    tokens: usize,
    src: &wgpu::Buffer,
    ss: usize,
    q8: (&wgpu::Buffer, &wgpu::Buffer),
    ds: usize,
) -> Result<Dispatch> {
    let kp = k.next_multiple_of(32);
    if k == 0 || tokens == 0 || ss < k || ds < kp || !ds.is_multiple_of(32) {
        return Err(Error::Gpu(format!(
            "{name}: {tokens} rows of {k} values {ss} apart, q8 rows {ds} apart"
        )));
    }
    check_len(&format!("{name}: src"), src, (tokens - 1) * ss + k)?;
    let (xq, xd) = q8;
    // (The shared checks size the q8 buffers for rows of kp; a wider stride needs more.)
    check_len(&format!("{name}: xq"), xq, ((tokens - 1) * ds + kp) / 4)?;
    check_len(&format!("{name}: xd"), xd, ((tokens - 1) * ds + kp) / 32)?;
    let consts = [
        ("WG", Const::U32(CHUNK as u32)),
        ("NB", Const::U32((kp / 32) as u32)),
        ("K", Const::U32(k as u32)),
        ("SS", Const::U32(ss as u32)),
        ("DS", Const::U32(ds as u32)),
        ("RV", Const::U32(1)),
    ];
    let mut d = norm_dispatch_flags(
        kernels,
        name,
        ("q8_rows", SOURCES),
        &consts,
        vec![(0, src)],
        Some(q8),
        (kp, CHUNK),
        tokens,
        &[],
        &[],
    )?;
    spread(&mut d, kp, tokens, CHUNK);
    d.section = Section::Moe;
    Ok(d)
}
