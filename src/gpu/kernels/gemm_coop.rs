//! `gemm_coop.wgsl`: the prefill projections on cooperative matrices (f16 × f16 → f32
//! 16×16×16 tiles), for f16 and q8_0 weights when the device has them and the user opted
//! in (MAMBA2_COOPMAT=1). Same contract as `gemm`: `Y [T][ys] (=|+=) X [T][xs] · Wᵀ`.

use super::gemm::GemmOutput;
use super::{Dispatch, Kernels, Section};
use crate::error::Result;
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;
use crate::model::quant::WeightFormat;

const SOURCES: super::Sources = &[include_str!("../../../shaders/gemm_coop.wgsl")];

/// Output tile: rows of W × tokens.
pub const TILE: (usize, usize) = (128, 64);

/// Whether the cooperative-matrix GEMM serves this matrix on this device.
pub fn applies(k: &Kernels, w: &DeviceMatrix) -> bool {
    k.ctx.caps.coop_matrix && matches!(w.format, WeightFormat::F16 | WeightFormat::Q8_0)
}

#[allow(clippy::too_many_arguments)]
pub fn gemm_coop(
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
    // f16 tiles straight from the weight buffer when none can reach past its end.
    if w.format == WeightFormat::F16 && w.rows.is_multiple_of(TILE.0) && w.kp.is_multiple_of(32) {
        flags.push("DIRECT");
    }
    let pipeline = k.pipeline("gemm_coop", SOURCES, &consts, &flags, false)?;
    let mut entries = w.bindings();
    entries.extend([(2, x), (3, y), (4, ctrl)]);
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (
            w.rows.div_ceil(TILE.0) as u32,
            max_tokens.div_ceil(TILE.1) as u32,
            1,
        ),
        name: name.to_string(),
        per_token: None,
        section: Section::Matmul,
    })
}
