//! `attention_combine.wgsl`: flash-decoding's second half. Merges the partials
//! `part [H][NSEG][hd + 2]` of `attention_decode` (same `AttnConsts`) into
//! `o [ceil32(H·hd)]` f32 (zero past H·hd) and, with `q8`, its q8 blocks
//! `xq [ceil32(H·hd)/4]`, `xd [ceil32(H·hd)/32]` (the q8_0 o_proj GEMV's input).

use super::attention_decode::{decode_partials_len, segment_consts};
use super::attn::AttnConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/attention_combine.wgsl")];

/// Splits of the segments per output element (32 elements per workgroup).
const NSPLIT: usize = 8;

pub fn attention_combine(
    k: &Kernels,
    name: &str,
    c: AttnConsts,
    part: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
    o: &wgpu::Buffer,
    q8: Option<(&wgpu::Buffer, &wgpu::Buffer)>,
) -> Result<Dispatch> {
    c.check(name)?;
    let os = c.o_stride();
    check_len(&format!("{name}: partials"), part, decode_partials_len(&c))?;
    check_len(&format!("{name}: ctrl"), ctrl, 16)?;
    check_len(&format!("{name}: o"), o, os)?;
    let mut consts = c.consts();
    consts.extend(segment_consts(&c));
    consts.extend([
        ("WG", Const::U32((32 * NSPLIT) as u32)),
        ("NSPLIT", Const::U32(NSPLIT as u32)),
    ]);
    let mut entries = vec![(0, part), (1, ctrl), (2, o)];
    let mut flags = vec![];
    if let Some((xq, xd)) = q8 {
        check_len(&format!("{name}: xq"), xq, os / 4)?;
        check_len(&format!("{name}: xd"), xd, os / 32)?;
        entries.extend([(3, xq), (4, xd)]);
        flags.push("Q8");
    }
    let pipeline = k.pipeline("attention_combine", SOURCES, &consts, &flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: ((os / 32) as u32, 1, 1),
        name: name.to_string(),
        per_token: None,
        section: Section::Attn,
        label: Label::default(),
    })
}
