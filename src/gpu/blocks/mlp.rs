//! The MLP block's dispatches. Decode (3 after the pre-norm): up (or gate+up) GEMV, the
//! activation (relu² or silu-gated, biases added, with the q8 blocks of its output for a
//! q8_0 down),
//! down GEMV adding into the residual. Prefill: the same as GEMMs over the block's tokens.
//! A gate and up that a GGUF stores in different block types go up as two parts, one GEMV
//! or GEMM each into its rows (`parts`).

use super::{BlockCtx, parts};
use crate::config::MlpConfig;
use crate::error::{Error, Result};
use crate::gpu::kernels::gemm::{GemmOutput, projection};
use crate::gpu::kernels::gemv::{self, GemvInput, GemvOutput};
use crate::gpu::kernels::mlp_act::{ActBuffers, MlpBias, mlp_act, mlp_act_rows};
use crate::gpu::kernels::{Dispatch, Section};
use crate::gpu::prefill::Prefill;
use crate::gpu::weights::DeviceMatrix;

fn mlp_section(d: Dispatch) -> Dispatch {
    Dispatch {
        section: Section::Mlp,
        ..d
    }
}

/// The model's MLP shape.
pub fn shape<'a>(b: &BlockCtx<'a>) -> Result<&'a MlpConfig> {
    b.c.mlp
        .as_ref()
        .ok_or_else(|| Error::Gpu("an MLP layer in a config without MLP".into()))
}

/// One decode token through an MLP of shape `m` (after the pre-norm into `h`); `up` in
/// parts (`[gate; up]` of one type: one part).
pub fn decode(
    b: &BlockCtx,
    m: &MlpConfig,
    up: &[DeviceMatrix],
    down: &DeviceMatrix,
    bias: Option<MlpBias>,
) -> Result<Vec<Dispatch>> {
    let (k, s) = (b.k, b.s);
    let q8 = b.q8();
    // A batch's lanes: one activation row per lane, rows one GEMV input apart.
    let rows = if b.lanes.cap > 1 {
        b.s.lane_width
    } else {
        m.intermediate.next_multiple_of(32)
    };
    let up_rows = parts::rows(up);
    // A batch's lanes of the up projection's output lie as far apart as the widest MLP
    // needs (`Scratch`): a shared expert narrower than the model's MLP layers reads its
    // rows from there.
    let up_stride = match b.lanes.cap {
        1 => up_rows,
        _ => crate::gpu::kernels::lane_stride(&s.mlp_up, b.lanes) as usize,
    };
    let mut d: Vec<Dispatch> = parts::gemvs(b, "up_proj", up, up_rows, &s.h, &s.mlp_up)?
        .into_iter()
        .map(mlp_section)
        .collect();
    d.extend([
        mlp_act_rows(
            k,
            "act",
            m.act,
            m.intermediate,
            up_stride,
            b.lanes.n,
            rows,
            ActBuffers {
                src: &s.mlp_up,
                dst: &s.mlp,
                q8,
            },
            bias,
        )?,
        mlp_section(gemv::gemv(
            k,
            "down_proj+residual",
            down,
            GemvInput::Plain,
            GemvOutput::Add,
            b.gemv_in(&s.mlp, &s.resid),
        )?),
    ]);
    Ok(d)
}

/// A prefill block through an MLP of shape `m` (after the batched pre-norm into `p.h`).
pub fn prefill(
    b: &BlockCtx,
    p: &Prefill,
    tokens: usize,
    m: &MlpConfig,
    up: &[DeviceMatrix],
    down: &DeviceMatrix,
    bias: Option<MlpBias>,
) -> Result<Vec<Dispatch>> {
    let (k, s) = (b.k, b.s);
    let up_rows = parts::rows(up);
    let mut d: Vec<Dispatch> = parts::gemms(
        k, "up_proj", up, up_rows, tokens, &p.h, &p.part, &p.mlp_up, &s.ctrl,
    )?
    .into_iter()
    .map(mlp_section)
    .collect();
    d.push(
        mlp_act(
            k,
            "act",
            m.act,
            m.intermediate,
            up_rows,
            tokens,
            ActBuffers {
                src: &p.mlp_up,
                dst: &p.mlp,
                q8: None,
            },
            bias,
        )?
        .per_token(1, 1, 1),
    );
    d.extend(
        projection(
            k,
            "down_proj+residual",
            down,
            tokens,
            &p.mlp,
            &p.part,
            &p.resid,
            b.c.d_model,
            GemmOutput::Add,
            &s.ctrl,
        )?
        .into_iter()
        .map(mlp_section),
    );
    Ok(d)
}
