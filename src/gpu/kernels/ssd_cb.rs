//! `ssd_cb.wgsl`: `cb [NC][G][Q][Q]`, C_i·B_j per chunk and group (j ≤ i), from the conv
//! output `u [T][conv_dim]` (on the tensor cores, `ssd_cb_coop`, where they serve the
//! shape).

use super::chunk::ChunkConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/tile64.wgsl"),
    include_str!("../../../shaders/ssd_cb.wgsl"),
];

pub fn ssd_cb(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    u: &wgpu::Buffer,
    cb: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    if super::ssd_cb_coop::applies(k, &cc) {
        let emulate = !k.ctx.caps.coop_matrix;
        return super::ssd_cb_coop::ssd_cb_coop(k, name, cc, u, cb, ctrl, emulate);
    }
    cc.require_u_f32(name)?;
    check_len(
        &format!("{name}: cb"),
        cb,
        cc.chunks() * cc.groups * cc.q * cc.q,
    )?;
    let pipeline = k.pipeline("ssd_cb", SOURCES, &cc.consts(), &[], false)?;
    let tiles = cc.q.div_ceil(64) as u32;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &[(0, u), (1, cb), (2, ctrl)]),
        pipeline,
        workgroups: (tiles, tiles, (cc.chunks() * cc.groups) as u32),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}
