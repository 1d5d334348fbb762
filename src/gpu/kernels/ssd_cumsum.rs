//! `ssd_cumsum.wgsl`: `lam [NC][H][Q]`, the per-chunk inclusive cumsum of δ·A.

use super::chunk::ChunkConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/ssd_cumsum.wgsl")];

#[allow(clippy::too_many_arguments)]
pub fn ssd_cumsum(
    k: &Kernels,
    name: &str,
    cc: ChunkConsts,
    a_off: usize,
    mix: &wgpu::Buffer,
    params: &wgpu::Buffer,
    lam: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
) -> Result<Dispatch> {
    check_len(&format!("{name}: lam"), lam, cc.chunks() * cc.heads * cc.q)?;
    let mut consts = cc.consts();
    consts.push(("A_OFF", Const::U32(a_off as u32)));
    let pipeline = k.pipeline("ssd_cumsum", SOURCES, &consts, &[], false)?;
    Ok(Dispatch {
        bind_group: k.bind(
            &pipeline,
            name,
            &[(0, mix), (1, params), (2, lam), (3, ctrl)],
        ),
        pipeline,
        workgroups: (cc.heads.div_ceil(32) as u32, cc.chunks() as u32, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Ssd,
        label: Label::default(),
    })
}
