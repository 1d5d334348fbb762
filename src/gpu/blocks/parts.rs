//! Stacked projections in parts. Where a GGUF stores the matrices one projection stacks
//! (attention's q, k and v; a gated MLP's gate and up) in block types that differ, each run
//! of one type goes up as a GPU matrix of its own, as stored (`device_weights::type_runs`),
//! and is multiplied into its own rows of the projection's output: one GEMV (decode) or GEMM
//! (prefill) per part. A projection of one part is the plain case: one dispatch into rows
//! from 0.

use super::BlockCtx;
use crate::error::{Error, Result};
use crate::gpu::kernels::gemm::{GemmOutput, gemm_split};
use crate::gpu::kernels::gemv::{self, GemvBuffers, GemvInput, GemvOutput};
use crate::gpu::kernels::{Dispatch, Kernels};
use crate::gpu::weights::DeviceMatrix;

/// The parts of projection `name` with their dispatch names (`name` alone for one part,
/// `name[a..b]` for each of several) and first rows; an error unless the parts make up
/// exactly the projection's `rows` rows.
pub fn named<'a>(
    name: &str,
    parts: &'a [DeviceMatrix],
    rows: usize,
) -> Result<Vec<(String, usize, &'a DeviceMatrix)>> {
    named_per(name, parts, rows, 1)
}

/// `named` for parts that each stack `per` matrices of the same rows (an expert bank's:
/// one per expert): rows counted per matrix, each part's a whole number of them.
pub fn named_per<'a>(
    name: &str,
    parts: &'a [DeviceMatrix],
    rows: usize,
    per: usize,
) -> Result<Vec<(String, usize, &'a DeviceMatrix)>> {
    let mut row0 = 0;
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        let own = part.rows / per.max(1);
        if own * per != part.rows {
            break;
        }
        let label = match parts.len() {
            1 => name.to_string(),
            _ => format!("{name}[{row0}..{}]", row0 + own),
        };
        out.push((label, row0, part));
        row0 += own;
    }
    if parts.is_empty() || out.len() != parts.len() || row0 != rows {
        let all: Vec<usize> = parts.iter().map(|p| p.rows).collect();
        return Err(Error::Gpu(format!(
            "{name}: parts of {all:?} rows do not make {per} × {rows} rows"
        )));
    }
    Ok(out)
}

/// Rows of the projection the parts make up.
pub fn rows(parts: &[DeviceMatrix]) -> usize {
    parts.iter().map(|p| p.rows).sum()
}

/// Decode: one GEMV per part from `src` into its rows of each lane's `dst` (`rows` rows a
/// lane).
pub fn gemvs(
    b: &BlockCtx,
    name: &str,
    parts: &[DeviceMatrix],
    rows: usize,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
) -> Result<Vec<Dispatch>> {
    named(name, parts, rows)?
        .into_iter()
        .map(|(label, row0, part)| {
            gemv::gemv(
                b.k,
                &label,
                part,
                GemvInput::Plain,
                GemvOutput::Store,
                GemvBuffers {
                    dst_row0: row0,
                    ..b.gemv_in(src, dst)
                },
            )
        })
        .collect()
}

/// Prefill: the GEMMs of each part over a block of at most `tokens` tokens from `x`, each
/// into its rows of `y` (`rows` values a token; `part` holds the split GEMMs' partials).
#[allow(clippy::too_many_arguments)]
pub fn gemms(
    k: &Kernels,
    name: &str,
    parts: &[DeviceMatrix],
    rows: usize,
    tokens: usize,
    x: &wgpu::Buffer,
    part: &wgpu::Buffer,
    y: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Vec<Dispatch>> {
    let mut d = Vec::new();
    for (label, row0, w) in named(name, parts, rows)? {
        d.extend(gemm_split(
            k,
            &label,
            w,
            tokens,
            x,
            part,
            y,
            rows,
            row0,
            GemmOutput::Store,
            ctrl,
        )?);
    }
    Ok(d)
}
