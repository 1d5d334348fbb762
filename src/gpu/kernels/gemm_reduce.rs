//! `gemm_reduce.wgsl`: the end of a split-K GEMM, `y [T][ys] (=|+=) Σ_z part [KS][PT][M]`
//! (from value `y0` of each row)
//! over the KS slices in order, for the T ≤ PT tokens of a block (`ctrl.prompt_len`).

use super::gemm::GemmOutput;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/gemm_reduce.wgsl")];

/// Invocations per workgroup (along the rows).
const WG: u32 = 256;

/// Sums `slices` partial products of `rows` outputs for up to `max_tokens` tokens (`pt`
/// apart: the partials' token stride, at least `max_tokens`) into `y` (rows of `ys` values,
/// the sums, times `rs`, from value `y0` of each).
#[allow(clippy::too_many_arguments)]
pub fn gemm_reduce(
    k: &Kernels,
    name: &str,
    rows: usize,
    slices: usize,
    (pt, max_tokens): (usize, usize),
    part: &wgpu::Buffer,
    y: &wgpu::Buffer,
    ys: usize,
    y0: usize,
    rs: f32,
    output: GemmOutput,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    if max_tokens == 0 || max_tokens > pt {
        return Err(crate::error::Error::Gpu(format!(
            "{name}: {max_tokens} tokens in partials {pt} tokens apart"
        )));
    }
    check_len(&format!("{name}: part"), part, slices * pt * rows)?;
    super::gemm::check_y(name, rows, max_tokens, y, ys, y0)?;
    let consts = [
        ("WG", Const::U32(WG)),
        ("M", Const::U32(rows as u32)),
        ("KS", Const::U32(slices as u32)),
        ("PT", Const::U32(pt as u32)),
        ("YS", Const::U32(ys as u32)),
        ("Y0", Const::U32(y0 as u32)),
        ("RS", Const::F32(rs)),
    ];
    let flag = match output {
        GemmOutput::Store => "O_STORE",
        GemmOutput::Add => "O_ADD",
    };
    let pipeline = k.pipeline("gemm_reduce", SOURCES, &consts, &[flag], false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &[(0, part), (1, y), (2, ctrl)]),
        pipeline,
        workgroups: ((rows as u32).div_ceil(WG), max_tokens as u32, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Matmul,
        label: Label::default(),
    }
    .per_token(1, 1, 1))
}
