//! `gated_norm.wgsl` (unfused graph): `dst [d_inner] = groupnorm(y ⊙ silu(z)) ⊙ w` over G
//! groups, and with `q8` the q8 blocks of the result for the out_proj GEMV.

use super::{Dispatch, Kernels, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

/// Elements each workgroup writes (whole q8 blocks).
const CHUNK: usize = 256;

const SOURCES: super::Sources = &[include_str!("../../../shaders/gated_norm.wgsl")];

/// Buffers of the gated norm: `y`, the mixer row vector (z first), parameters, outputs.
pub struct GatedNormBuffers<'a> {
    pub y: &'a wgpu::Buffer,
    pub mix: &'a wgpu::Buffer,
    pub params: &'a wgpu::Buffer,
    pub dst: &'a wgpu::Buffer,
    pub q8: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
}

pub fn gated_norm(
    k: &Kernels,
    name: &str,
    d_inner: usize,
    groups: usize,
    eps: f64,
    nw_off: usize,
    b: GatedNormBuffers,
) -> Result<Dispatch> {
    check_len(&format!("{name}: y"), b.y, d_inner)?;
    check_len(&format!("{name}: mix"), b.mix, d_inner)?;
    check_len(&format!("{name}: dst"), b.dst, d_inner)?;
    check_len(&format!("{name}: params"), b.params, nw_off + d_inner)?;
    let consts = [
        ("WG", Const::U32(256)),
        ("CHUNK", Const::U32(CHUNK as u32)),
        ("RV", Const::U32(groups as u32)),
        ("DI", Const::U32(d_inner as u32)),
        ("GS", Const::U32((d_inner / groups) as u32)),
        ("NW_OFF", Const::U32(nw_off as u32)),
        ("EPS", Const::F32(eps as f32)),
    ];
    let mut flags = vec!["REDUCE"];
    let mut entries = vec![(0, b.y), (1, b.mix), (2, b.params), (3, b.dst)];
    if let Some((q, s)) = b.q8 {
        check_len(&format!("{name}: xq"), q, d_inner.div_ceil(32) * 8)?;
        check_len(&format!("{name}: xd"), s, d_inner.div_ceil(32))?;
        flags.push("Q8_OUT");
        entries.extend([(4, q), (5, s)]);
    }
    let pipeline = k.pipeline("gated_norm", SOURCES, &consts, &flags, true)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (d_inner.div_ceil(CHUNK) as u32, 1, 1),
        name: name.to_string(),
        section: Section::Norm,
    })
}
