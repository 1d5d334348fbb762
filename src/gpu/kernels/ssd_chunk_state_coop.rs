//! `ssd_chunk_state_coop.wgsl`: `ssd_chunk_state` on cooperative matrices (f16 operands,
//! f32 sums), where the device has them and the mixer's shape fits its tiles (head dim a
//! multiple of 64, state a multiple of 128, rows of `u` in whole vec4s). Without the
//! feature the same kernel runs with stand-ins for the cooperative ops (`emulate`: the
//! tests on lavapipe).

use super::chunk::ChunkConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};

const SOURCE: &str = include_str!("../../../shaders/ssd_chunk_state_coop.wgsl");
/// How it reads `u` (f16 or f32: `ChunkConsts::u_f16`).
const CONV_OUT: &str = include_str!("../../../shaders/conv_out.wgsl");
const EMULATED: super::Sources = &[CONV_OUT, SOURCE];
const COOP: super::Sources = &["enable wgpu_cooperative_matrix;\n", CONV_OUT, SOURCE];

/// Whether the kernel takes this mixer's shape.
pub fn takes(cc: &ChunkConsts) -> bool {
    cc.head_dim.is_multiple_of(64)
        && cc.d_state.is_multiple_of(128)
        && cc.conv_dim.is_multiple_of(4)
        && cc.d_inner.is_multiple_of(4)
}

/// Whether it serves this mixer on this device.
pub fn applies(k: &Kernels, cc: &ChunkConsts) -> bool {
    k.ctx.caps.coop_kernels() && takes(cc)
}

/// `cst [NC][H][P][N]` on the tensor cores (or their stand-ins with `emulate`). Same
/// buffers as `ssd_chunk_state`.
#[allow(clippy::too_many_arguments)]
pub fn ssd_chunk_state_coop(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    mix: &wgpu::Buffer,
    u: &wgpu::Buffer,
    lam: &wgpu::Buffer,
    cst: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
    emulate: bool,
) -> Result<Dispatch> {
    if !takes(&cc) {
        return Err(Error::Gpu(format!(
            "{name}: the cooperative chunk state takes head dims that are multiples of 64 and \
             states of 128, not {} and {}",
            cc.head_dim, cc.d_state
        )));
    }
    super::require_coop(k, name, emulate)?;
    check_len(&format!("{name}: u"), u, cc.u_words())?;
    check_len(&format!("{name}: cst"), cst, cc.states_len())?;
    let mut flags = Vec::new();
    cc.u_flag(&mut flags);
    let sources = super::coop_sources(COOP, EMULATED, emulate, &mut flags);
    let pipeline = k.pipeline("ssd_chunk_state_coop", sources, &cc.consts(), &flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(
            &pipeline,
            name,
            &[(0, mix), (1, lam), (2, cst), (3, ctrl), (4, u)],
        ),
        pipeline,
        workgroups: (
            (cc.head_dim / 64) as u32,
            (cc.d_state / 128) as u32,
            (cc.chunks() * cc.heads) as u32,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}
