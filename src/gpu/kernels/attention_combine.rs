//! `attention_combine.wgsl`: flash-decoding's second half. Merges the partials
//! `part [H][NSEG][hd + 2]` of `attention_decode` (same `AttnConsts`) into
//! `o [ceil32(H·hd)]` f32 (zero past H·hd) and, with `q8`, its q8 blocks
//! `xq [ceil32(H·hd)/4]`, `xd [ceil32(H·hd)/32]` (the q8_0 o_proj GEMV's input).

use super::attention_decode::{decode_partials_len, segment_consts};
use super::attn::AttnConsts;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/decode_segments.wgsl"),
    include_str!("../../../shaders/attention_combine.wgsl"),
];

/// Splits of the segments per output element (32 elements per workgroup).
const NSPLIT: usize = 8;

/// Over `lanes` lanes (workgroup z): partials, `o` and its q8 blocks side by side, `o`'s
/// lane stride a multiple of 32 that the q8 blocks' strides match.
#[allow(clippy::too_many_arguments)]
pub fn attention_combine(
    k: &Kernels,
    name: &str,
    c: AttnConsts,
    lanes: super::Lanes,
    part: &wgpu::Buffer,
    ctrl: &wgpu::Buffer,
    o: &wgpu::Buffer,
    q8: Option<(&wgpu::Buffer, &wgpu::Buffer)>,
) -> Result<Dispatch> {
    c.check(name)?;
    let cap = lanes.cap;
    let os = c.o_stride();
    let o_ls = super::lane_stride(o, lanes) as usize;
    check_len(
        &format!("{name}: partials"),
        part,
        cap * decode_partials_len(&c),
    )?;
    check_len(&format!("{name}: ctrl"), ctrl, cap * super::CTRL_WORDS)?;
    check_len(&format!("{name}: o"), o, (cap - 1) * o_ls + os)?;
    if cap > 1 && (o_ls < os || !o_ls.is_multiple_of(32)) {
        return Err(Error::Gpu(format!(
            "{name}: o lanes {o_ls} apart cannot hold {os}"
        )));
    }
    let mut consts = c.consts();
    consts.extend(segment_consts(&c));
    consts.extend([
        ("WG", Const::U32((32 * NSPLIT) as u32)),
        ("NSPLIT", Const::U32(NSPLIT as u32)),
        ("O_LS", Const::U32(o_ls as u32)),
        ("PART_LS", Const::U32(super::lane_stride(part, lanes))),
    ]);
    let mut entries = vec![(0, part), (1, ctrl), (2, o)];
    let mut flags = vec![];
    if let Some((xq, xd)) = q8 {
        check_len(&format!("{name}: xq"), xq, (cap - 1) * o_ls / 4 + os / 4)?;
        check_len(&format!("{name}: xd"), xd, (cap - 1) * o_ls / 32 + os / 32)?;
        if cap > 1
            && (4 * super::lane_stride(xq, lanes) as usize != o_ls
                || 32 * super::lane_stride(xd, lanes) as usize != o_ls)
        {
            return Err(Error::Gpu(format!(
                "{name}: the q8 blocks' lane strides do not match o's {o_ls} values"
            )));
        }
        entries.extend([(3, xq), (4, xd)]);
        flags.push("Q8");
    }
    let pipeline = k.pipeline("attention_combine", SOURCES, &consts, &flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: ((os / 32) as u32, 1, lanes.n as u32),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Attn,
        label: Label::default(),
    })
}
