//! `kv_store.wgsl`: the k and v of the T tokens in `qkv [T][qkv_stride]` go to cache rows
//! `ctrl.kv_len + t` of `k_cache`, `v_cache` (`[ctx][Hkv][hd]`, f16 or f32; see `attn`);
//! with RoPE, q is rotated in place and k before it is stored. T = 1 (decode) or
//! `ctrl.prompt_len` ≤ the block's capacity (prefill). A stopped step stores nothing.

use super::attn::{AttnBuffers, AttnConsts};
use super::{Dispatch, Kernels, Label, Section};
use crate::error::Result;
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/kv_store.wgsl")];

/// `block`: None for one decode token, or the prefill block's capacity in tokens.
pub fn kv_store(
    k: &Kernels,
    name: &str,
    c: AttnConsts,
    block: Option<usize>,
    b: &AttnBuffers,
) -> Result<Dispatch> {
    c.check(name)?;
    let tokens = block.unwrap_or(1).max(1);
    let d = c.dims;
    c.check_buffers(name, b, tokens, (d.heads + 2 * d.kv_heads) * d.head_dim)?;
    let mut consts = c.consts();
    consts.push(AttnConsts::lane_consts(b));
    let mut flags = c.flags();
    let mut items = d.kv_len(); // k and v words: Hkv·hd/2 each
    if let Some(theta) = c.rope {
        consts.push(("THETA", Const::F32(theta as f32)));
        flags.push("ROPE");
        items += d.q_len() / 2;
    }
    if block.is_some() {
        flags.push("PREFILL");
    }
    let pipeline = k.pipeline("kv_store", SOURCES, &consts, &flags, false)?;
    let dispatch = Dispatch {
        bind_group: k.bind(
            &pipeline,
            name,
            &[(0, b.qkv), (1, b.k_cache), (2, b.v_cache), (3, b.ctrl)],
        ),
        pipeline,
        workgroups: (items.div_ceil(64) as u32, tokens as u32, b.lanes.n as u32),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Attn,
        label: Label::default(),
    };
    Ok(if block.is_some() {
        dispatch.per_token(1, 1, 1)
    } else {
        dispatch
    })
}
