//! `embed.wgsl`: `resid [D] = embedding [V, D] row ctrl.token`, any weight format.

use super::{Dispatch, Kernels, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;
use crate::gpu::weights::DeviceMatrix;

const SOURCES: super::Sources = &[include_str!("../../../shaders/embed.wgsl")];

pub fn embed(
    k: &Kernels,
    table: &DeviceMatrix,
    ctrl: &wgpu::Buffer,
    resid: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len("embed: resid", resid, table.cols)?;
    let wg = 64u32;
    let consts = [
        ("WG", Const::U32(wg)),
        ("D", Const::U32(table.cols as u32)),
        ("V", Const::U32(table.rows as u32)),
        ("KP", Const::U32(table.kp as u32)),
    ];
    let pipeline = k.pipeline("embed", SOURCES, &consts, &[table.flag()], false)?;
    let mut entries = table.bindings();
    entries.extend([(2, ctrl), (3, resid)]);
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, "embed", &entries),
        pipeline,
        workgroups: ((table.cols as u32).div_ceil(wg), 1, 1),
        name: "embed".into(),
        per_token: None,
        section: Section::Other,
    })
}
