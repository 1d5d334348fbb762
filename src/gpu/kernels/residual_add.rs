//! `residual_add.wgsl` (unfused graph): `resid [D] += src [D]`.

use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/residual_add.wgsl")];

pub fn residual_add(
    k: &Kernels,
    name: &str,
    d: usize,
    src: &wgpu::Buffer,
    resid: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len(&format!("{name}: src"), src, d)?;
    check_len(&format!("{name}: resid"), resid, d)?;
    let consts = [("WG", Const::U32(64)), ("D", Const::U32(d as u32))];
    let pipeline = k.pipeline("residual_add", SOURCES, &consts, &[], false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &[(0, src), (1, resid)]),
        pipeline,
        workgroups: ((d as u32).div_ceil(64), 1, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Other,
        label: Label::default(),
    })
}
