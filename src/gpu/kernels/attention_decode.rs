//! `attention_decode.wgsl` (+ `attn_tile.wgsl`): flash-decoding's first half for one token.
//! Cache rows `0 ..= ctrl.kv_len` are cut into segments of `decode_segment` keys; the grid
//! covers the whole capacity (`ctx`), and workgroups past the length only mark their
//! partial empty. Shapes: `qkv [qkv_stride]` (q of the token, already rotated), the caches
//! (see `attn`), `part [H][NSEG][hd + 2]` f32 (`decode_partials_len`); then
//! `attention_combine` turns the partials into `o`.

use super::attn::{AttnBuffers, AttnConsts};
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/attn_tile.wgsl"),
    include_str!("../../../shaders/attention_decode.wgsl"),
];

/// Segments the cached rows are cut into (at most): enough workgroups to fill a large GPU
/// at any length, few enough partials that the combine stays short. The segment length
/// follows the length in use, not the capacity (`seg_len` in the shaders: the rows over
/// NSEG, rounded up to whole key tiles), so a short context still spreads over the GPU
/// (measured on the H200: with segments sized by a 32k capacity, 1k tokens of context ran
/// on 5 segments per kv head and attention took 0.29 ms per layer).
pub const SEGMENTS: usize = 256;

/// Keys per segment at the full capacity: a multiple of the key tile, ≈ ctx / SEGMENTS.
pub fn decode_segment(c: &AttnConsts) -> usize {
    let kt = c.tile(false).keys;
    kt * c.ctx.div_ceil(kt * SEGMENTS).max(1)
}

/// Segments of the whole cache (the grid's x).
pub fn decode_segments(c: &AttnConsts) -> usize {
    c.ctx.div_ceil(decode_segment(c))
}

/// f32 values of the partials buffer: `H · NSEG · (hd + 2)`.
pub fn decode_partials_len(c: &AttnConsts) -> usize {
    c.dims.heads * decode_segments(c) * (c.dims.head_dim + 2)
}

/// Constants of both halves: the key tile the segment length is a multiple of, and the
/// segment count.
pub(super) fn segment_consts(c: &AttnConsts) -> [(&'static str, Const); 2] {
    [
        ("SEGK", Const::U32(c.tile(false).keys as u32)),
        ("NSEG", Const::U32(decode_segments(c) as u32)),
    ]
}

pub fn attention_decode(
    k: &Kernels,
    name: &str,
    c: AttnConsts,
    b: &AttnBuffers,
    part: &wgpu::Buffer,
) -> Result<Dispatch> {
    c.check(name)?;
    c.check_buffers(name, b, 1, c.dims.q_len())?;
    let lanes = b.lanes;
    check_len(
        &format!("{name}: partials"),
        part,
        lanes.cap * decode_partials_len(&c),
    )?;
    let tile = c.tile(false);
    let mut consts = c.tile_consts(name, tile)?;
    consts.extend(segment_consts(&c));
    consts.extend([
        AttnConsts::lane_consts(b),
        ("PART_LS", Const::U32(super::lane_stride(part, lanes))),
    ]);
    let nseg = decode_segments(&c);
    if nseg > 65535 {
        return Err(Error::Gpu(format!("{name}: {nseg} segments")));
    }
    let pipeline = k.pipeline("attention_decode", SOURCES, &consts, &c.flags(), false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &b.tile_entries(part)),
        pipeline,
        workgroups: (
            nseg as u32,
            (c.dims.kv_heads * tile.chunks) as u32,
            lanes.n as u32,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Attn,
        label: Label::default(),
    })
}
