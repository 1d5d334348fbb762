//! `gemm.wgsl`: the prefill projections, `Y [T][ys] (=|+=) X [T][xs] · Wᵀ` for the T tokens
//! of a block (`ctrl.prompt_len`), W a `DeviceMatrix` `[M, K]` in any format; X rows are
//! `xs = ceil32(K)` values, zero past K (what the batched norms write).

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;

const SOURCES: super::Sources = &[include_str!("../../../shaders/gemm.wgsl")];

/// Output tile: rows of W × tokens. (A 128-token tile with 8×8 values per invocation
/// measured slower on the H200: BENCHMARKS.md.)
pub const TILE: (usize, usize) = (128, 64);

/// Whether the product is stored or added (the residual).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmOutput {
    Store,
    Add,
}

/// The GEMM of a block of up to `max_tokens` tokens; `y` has rows of `ys` values.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    k: &Kernels,
    name: &str,
    w: &DeviceMatrix,
    max_tokens: usize,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    ys: usize,
    output: GemmOutput,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    let xs = w.cols.next_multiple_of(32);
    check_len(&format!("{name}: x"), x, max_tokens * xs)?;
    check_len(&format!("{name}: y"), y, (max_tokens - 1) * ys + w.rows)?;
    let coop = super::gemm_coop::applies(k, w);
    let (shader, sources, tile) = if coop {
        (
            "gemm_coop",
            super::gemm_coop::SOURCES,
            super::gemm_coop::TILE,
        )
    } else {
        ("gemm", SOURCES, TILE)
    };
    let consts = [
        ("M", Const::U32(w.rows as u32)),
        ("KP", Const::U32(w.kp as u32)),
        ("XS", Const::U32(xs as u32)),
        ("YS", Const::U32(ys as u32)),
    ];
    let out = match output {
        GemmOutput::Store => "O_STORE",
        GemmOutput::Add => "O_ADD",
    };
    let mut flags = vec![w.flag(), out];
    if coop {
        flags.extend(super::gemm_coop::extra_flag(w));
    }
    let pipeline = k.pipeline(shader, sources, &consts, &flags, false)?;
    let mut entries = w.bindings();
    entries.extend([(2, x), (3, y), (4, ctrl)]);
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (
            w.rows.div_ceil(tile.0) as u32,
            max_tokens.div_ceil(tile.1) as u32,
            1,
        ),
        name: name.to_string(),
        per_token: None,
        section: Section::Matmul,
        label: Label::default(),
    })
}
