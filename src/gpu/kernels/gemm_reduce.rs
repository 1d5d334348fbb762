//! `gemm_reduce.wgsl`: the end of a split-K GEMM, `y [T][ys] (=|+=) Σ_z part [KS][TT][M]`
//! over the KS slices in order, for the T ≤ TT tokens of a block (`ctrl.prompt_len`).

use super::gemm::{GemmOutput, TILE};
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/gemm_reduce.wgsl")];

/// Invocations per workgroup (along the rows).
const WG: u32 = 256;

/// Sums `slices` partial products of `rows` outputs into `y` (rows of `ys` values).
#[allow(clippy::too_many_arguments)]
pub fn gemm_reduce(
    k: &Kernels,
    name: &str,
    rows: usize,
    slices: usize,
    part: &wgpu::Buffer,
    y: &wgpu::Buffer,
    ys: usize,
    output: GemmOutput,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    let tt = TILE.1;
    check_len(&format!("{name}: part"), part, slices * tt * rows)?;
    check_len(&format!("{name}: y"), y, (tt - 1) * ys + rows)?;
    let consts = [
        ("WG", Const::U32(WG)),
        ("M", Const::U32(rows as u32)),
        ("KS", Const::U32(slices as u32)),
        ("TT", Const::U32(tt as u32)),
        ("YS", Const::U32(ys as u32)),
    ];
    let flag = match output {
        GemmOutput::Store => "O_STORE",
        GemmOutput::Add => "O_ADD",
    };
    let pipeline = k.pipeline("gemm_reduce", SOURCES, &consts, &[flag], false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &[(0, part), (1, y), (2, ctrl)]),
        pipeline,
        workgroups: ((rows as u32).div_ceil(WG), tt as u32, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Matmul,
        label: Label::default(),
    }
    .per_token(1, 1, 1))
}
