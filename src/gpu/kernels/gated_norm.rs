//! `gated_norm.wgsl` (unfused graph): `dst [d_inner] = groupnorm(y ⊙ silu(z)) ⊙ w`, G groups.

use super::{Dispatch, Kernels, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/gated_norm.wgsl")];

#[allow(clippy::too_many_arguments)]
pub fn gated_norm(
    k: &Kernels,
    name: &str,
    d_inner: usize,
    groups: usize,
    eps: f64,
    nw_off: usize,
    y: &wgpu::Buffer,
    mix: &wgpu::Buffer,
    params: &wgpu::Buffer,
    dst: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len(&format!("{name}: y"), y, d_inner)?;
    check_len(&format!("{name}: dst"), dst, d_inner)?;
    check_len(&format!("{name}: params"), params, nw_off + d_inner)?;
    let consts = [
        ("WG", Const::U32(256)),
        ("RV", Const::U32(1)),
        ("GS", Const::U32((d_inner / groups) as u32)),
        ("NW_OFF", Const::U32(nw_off as u32)),
        ("EPS", Const::F32(eps as f32)),
    ];
    let pipeline = k.pipeline("gated_norm", SOURCES, &consts, &["REDUCE"], true)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &[(0, y), (1, mix), (2, params), (3, dst)]),
        pipeline,
        workgroups: (groups as u32, 1, 1),
        name: name.to_string(),
        section: Section::Norm,
    })
}
