//! `ssd_state_pass.wgsl`: the state entering each chunk (over `cst`), and the sequence's
//! state `[H][P][N]` after the block.

use super::chunk::ChunkConsts;
use super::{Dispatch, Kernels, Label, Section, check_len, grid};
use crate::error::Result;

const SOURCES: super::Sources = &[include_str!("../../../shaders/ssd_state_pass.wgsl")];

pub fn ssd_state_pass(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    lam: &wgpu::Buffer,
    cst: &wgpu::Buffer,
    state: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    let hpn = cc.heads * cc.head_dim * cc.d_state;
    check_len(&format!("{name}: state"), state, hpn)?;
    // Four values per invocation when a head's P·N values split into 16-byte vectors.
    let vec4 = (cc.head_dim * cc.d_state).is_multiple_of(4);
    let v = if vec4 { 4 } else { 1 };
    let flags: &[&str] = if vec4 { &["VEC4"] } else { &[] };
    let pipeline = k.pipeline("ssd_state_pass", SOURCES, &cc.consts(), flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(
            &pipeline,
            name,
            &[(0, lam), (1, cst), (2, state), (3, ctrl)],
        ),
        pipeline,
        workgroups: grid((hpn / v).div_ceil(256) as u32),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}
