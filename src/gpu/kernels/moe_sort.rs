//! `moe_sort.wgsl`: a prefill block's `(token, choice)` pairs sorted by expert — `ids
//! [T, K]` in, `pairs [rows]`, `pos [T·K]`, `tile_expert [rows / 64]` out — so each expert's
//! rows form whole GEMM tiles (`gemm::expert_gemm`). One workgroup: a block holds at most a
//! few thousand pairs.

use super::gemm::TILE;
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[include_str!("../../../shaders/moe_sort.wgsl")];
const WG: u32 = 256;

/// Sorted rows a block of `max_tokens` tokens with `top_k` of `experts` choices needs: every
/// pair, plus each expert's padding to a whole tile.
pub fn sorted_rows(max_tokens: usize, top_k: usize, experts: usize) -> usize {
    (max_tokens * top_k + experts * (TILE.1 - 1)).next_multiple_of(TILE.1)
}

/// The sort's buffers.
pub struct SortBuffers<'a> {
    pub ids: &'a wgpu::Buffer,
    pub ctrl: &'a wgpu::Buffer,
    pub pairs: &'a wgpu::Buffer,
    pub pos: &'a wgpu::Buffer,
    pub tile_expert: &'a wgpu::Buffer,
}

pub fn moe_sort(
    k: &Kernels,
    name: &str,
    experts: usize,
    top_k: usize,
    max_tokens: usize,
    b: SortBuffers,
) -> Result<Dispatch> {
    let rows = sorted_rows(max_tokens, top_k, experts);
    if rows > u32::MAX as usize / 2 {
        return Err(Error::Gpu(format!("{name}: {rows} sorted rows")));
    }
    check_len(&format!("{name}: ids"), b.ids, max_tokens * top_k)?;
    check_len(&format!("{name}: pairs"), b.pairs, rows)?;
    check_len(&format!("{name}: pos"), b.pos, max_tokens * top_k)?;
    check_len(
        &format!("{name}: tile experts"),
        b.tile_expert,
        rows / TILE.1,
    )?;
    let u = |v: usize| Const::U32(v as u32);
    let consts = [
        ("WG", Const::U32(WG)),
        ("E", u(experts)),
        ("K", u(top_k)),
        ("TMAX", u(max_tokens)),
        ("TR", u(rows)),
        ("TT", u(TILE.1)),
        ("NONE", Const::U32(u32::MAX)),
    ];
    let pipeline = k.pipeline("moe_sort", SOURCES, &consts, &[], false)?;
    let entries = [
        (0, b.ids),
        (1, b.ctrl),
        (2, b.pairs),
        (3, b.pos),
        (4, b.tile_expert),
    ];
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &entries),
        pipeline,
        workgroups: (1, 1, 1),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Moe,
        label: Label::default(),
    })
}
