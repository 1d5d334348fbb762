//! `attention_prefill.wgsl` (+ `attn_tile.wgsl`): causal attention for the T =
//! `ctrl.prompt_len` tokens of a prefill block at positions `ctrl.kv_len + t`, against the
//! cache rows `kv_store` filled. Shapes: `qkv [T][qkv_stride]`, the caches (see `attn`),
//! `o [T][ceil32(H·hd)]` f32 rows zero past H·hd (the o_proj GEMM's input). A workgroup
//! takes a tile of tokens × the query heads of one kv head (grid y counts token tiles).

use super::attn::{AttnBuffers, AttnConsts};
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::Result;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/attn_tile.wgsl"),
    include_str!("../../../shaders/attention_prefill.wgsl"),
];

/// `max_tokens`: the block's capacity (the grid's size; `ctrl.prompt_len` ≤ it). On the
/// tensor cores (`attention_prefill_coop`) where the device has them and the head dim fits.
pub fn attention_prefill(
    k: &Kernels,
    name: &str,
    c: AttnConsts,
    max_tokens: usize,
    b: &AttnBuffers,
    o: &wgpu::Buffer,
) -> Result<Dispatch> {
    if super::attention_prefill_coop::applies(k, &c) {
        let emulate = !k.ctx.caps.coop_matrix;
        return super::attention_prefill_coop::attention_prefill_coop(
            k, name, c, max_tokens, b, o, emulate,
        );
    }
    c.check(name)?;
    let max_tokens = max_tokens.max(1);
    c.check_buffers(name, b, max_tokens, c.dims.q_len())?;
    check_len(&format!("{name}: o"), o, max_tokens * c.o_stride())?;
    let tile = c.tile();
    let consts = c.tile_consts(name, tile)?;
    let pipeline = k.pipeline("attention_prefill", SOURCES, &consts, &c.flags(), false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &b.tile_entries(o)),
        pipeline,
        workgroups: (
            (c.dims.kv_heads * tile.chunks) as u32,
            max_tokens.div_ceil(tile.queries) as u32,
            1,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Attn,
        label: Label::default(),
    }
    .per_token(1, tile.queries, 1))
}
