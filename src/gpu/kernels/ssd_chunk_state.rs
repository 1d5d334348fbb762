//! `ssd_chunk_state.wgsl`: `cst [NC][H][P][N]`, the state each chunk adds (on the tensor
//! cores, `ssd_chunk_state_coop`, where they serve the shape).

use super::chunk::ChunkConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/tile64.wgsl"),
    include_str!("../../../shaders/ssd_chunk_state.wgsl"),
];

#[allow(clippy::too_many_arguments)]
pub fn ssd_chunk_state(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    mix: &wgpu::Buffer,
    u: &wgpu::Buffer,
    lam: &wgpu::Buffer,
    cst: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    if super::ssd_chunk_state_coop::applies(k, &cc) {
        let emulate = !k.ctx.caps.coop_matrix;
        return super::ssd_chunk_state_coop::ssd_chunk_state_coop(
            k, name, cc, mix, u, lam, cst, ctrl, emulate,
        );
    }
    cc.require_u_f32(name)?;
    check_len(&format!("{name}: cst"), cst, cc.states_len())?;
    let pipeline = k.pipeline("ssd_chunk_state", SOURCES, &cc.consts(), &[], false)?;
    Ok(Dispatch {
        bind_group: k.bind(
            &pipeline,
            name,
            &[(0, mix), (1, lam), (2, cst), (3, ctrl), (4, u)],
        ),
        pipeline,
        workgroups: (
            cc.head_dim.div_ceil(64) as u32,
            cc.d_state.div_ceil(64) as u32,
            (cc.chunks() * cc.heads) as u32,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}
