//! `gemm_coop.wgsl`: the prefill projections on cooperative matrices (f16 × f16 → f32
//! 16×16×16 tiles), for f16 and q8_0 weights when the device has them and the user opted
//! in (MAMBA2_COOPMAT=1). Same contract as `gemm`: `Y [T][ys] (=|+=) X [T][xs] · Wᵀ`;
//! `gemm::gemm` builds the dispatch, this file says when and how it differs.

use super::Kernels;
use crate::gpu::weights::DeviceMatrix;
use crate::model::quant::WeightFormat;

pub(super) const SOURCES: super::Sources = &[include_str!("../../../shaders/gemm_coop.wgsl")];

/// Output tile: rows of W × tokens.
pub const TILE: (usize, usize) = (128, 64);

/// Whether the cooperative-matrix GEMM serves this matrix on this device.
pub fn applies(k: &Kernels, w: &DeviceMatrix) -> bool {
    k.ctx.caps.coop_matrix && matches!(w.format, WeightFormat::F16 | WeightFormat::Q8_0)
}

/// The f16 tiles come straight from the weight buffer when none can reach past its end.
pub fn extra_flag(w: &DeviceMatrix) -> Option<&'static str> {
    let direct =
        w.format == WeightFormat::F16 && w.rows.is_multiple_of(TILE.0) && w.kp.is_multiple_of(32);
    direct.then_some("DIRECT")
}
