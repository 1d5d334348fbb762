//! `rmsnorm.wgsl`: `dst [D] = src / rms(src) ⊙ params[nw_off..nw_off+D]` (unfused graph).

use super::{Dispatch, Kernels, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/rmsnorm.wgsl")];

#[allow(clippy::too_many_arguments)]
pub fn rmsnorm(
    k: &Kernels,
    name: &str,
    d: usize,
    eps: f64,
    nw_off: usize,
    src: &wgpu::Buffer,
    params: &wgpu::Buffer,
    dst: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len(&format!("{name}: src"), src, d)?;
    check_len(&format!("{name}: params"), params, nw_off + d)?;
    check_len(&format!("{name}: dst"), dst, d)?;
    let consts = [
        ("WG", Const::U32(256)),
        ("RV", Const::U32(1)),
        ("D", Const::U32(d as u32)),
        ("NW_OFF", Const::U32(nw_off as u32)),
        ("EPS", Const::F32(eps as f32)),
    ];
    let pipeline = k.pipeline("rmsnorm", SOURCES, &consts, &["REDUCE"], true)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &[(0, src), (1, params), (2, dst)]),
        pipeline,
        workgroups: (1, 1, 1),
        name: name.to_string(),
        section: Section::Norm,
    })
}
