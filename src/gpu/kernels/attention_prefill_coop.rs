//! `attention_prefill_coop.wgsl`: `attention_prefill` on cooperative matrices (f16 queries,
//! keys, values and probabilities, f32 scores and sums), flash-attention style: the scores
//! never leave the workgroup. Used where the device has them and the head dim is a multiple
//! of 16 up to 128 (its queries and outputs are HD/16 fragments per subgroup); the FMA tiles
//! of `attn_tile.wgsl` take every other shape. Without the feature the same kernel runs with
//! stand-ins for the cooperative ops (`emulate`: the tests on lavapipe). Same buffers and
//! output as `attention_prefill`.

use super::attn::{AttnBuffers, AttnConsts, KvFormat};
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

const SOURCE: &str = include_str!("../../../shaders/attention_prefill_coop.wgsl");
const EMULATED: super::Sources = &[SOURCE];
const COOP: super::Sources = &["enable wgpu_cooperative_matrix;\n", SOURCE];

/// Keys per tile (`KT` of the shader).
const KEYS: usize = 32;
/// The most subgroups of 32 (16 query rows each) a workgroup takes.
const MAX_SUBGROUPS: usize = 4;

/// How a workgroup splits the block: `subgroups` × 16 query rows of `queries` tokens ×
/// `heads` query heads of one kv head (`chunks` workgroups cover a kv head's H/Hkv heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoopTile {
    pub subgroups: usize,
    pub heads: usize,
    pub chunks: usize,
    pub queries: usize,
}

/// Whether the kernel takes this layer's shape.
pub fn takes(c: &AttnConsts) -> bool {
    let hd = c.dims.head_dim;
    hd.is_multiple_of(16) && (16..=128).contains(&hd)
}

/// Whether it serves this layer on this device: f16 caches only (their K and V are f16
/// already, so the kernel adds only the f16 rounding of the scaled queries and of the
/// weights; f32 caches ask for f32 attention, which the FMA tiles give).
pub fn applies(k: &Kernels, c: &AttnConsts) -> bool {
    k.ctx.caps.coop_kernels() && takes(c) && c.format == KvFormat::F16
}

/// Bytes of workgroup memory for head dim `hd` over `subgroups` subgroups: the queries and
/// one K/V tile (f16 rows of hd + 8), S (f32 rows of 36), P (f16 rows of 40), per-row
/// partials and limits, two words.
pub fn workgroup_bytes(hd: usize, subgroups: usize) -> usize {
    let rows = 16 * subgroups;
    rows * (hd + 8) * 2
        + KEYS * (hd + 8) * 2
        + rows * (KEYS + 4) * 4
        + rows * (KEYS + 8) * 2
        + rows * 3 * 4
        + 8
}

/// The tiling for `c` within `wg_bytes` of workgroup memory: as many subgroups as fit (up
/// to four), a kv head's query heads side by side so they share each K/V tile.
pub fn tile(c: &AttnConsts, wg_bytes: usize) -> Result<CoopTile> {
    let hd = c.dims.head_dim;
    let subgroups = (1..=MAX_SUBGROUPS)
        .rev()
        .find(|&s| workgroup_bytes(hd, s) <= wg_bytes)
        .ok_or_else(|| {
            Error::Gpu(format!(
                "cooperative prefill attention: head dim {hd} needs {} bytes of workgroup \
                 memory, the device allows {wg_bytes}",
                workgroup_bytes(hd, 1)
            ))
        })?;
    let rows = 16 * subgroups;
    let g = c.group();
    let chunks = g.div_ceil(rows);
    let heads = g.div_ceil(chunks);
    Ok(CoopTile {
        subgroups,
        heads,
        chunks,
        queries: rows / heads,
    })
}

/// The kernel's sources, constants and flags for `c` on tile `t`.
fn specialize(
    c: &AttnConsts,
    t: CoopTile,
    emulate: bool,
) -> (
    super::Sources,
    Vec<(&'static str, Const)>,
    Vec<&'static str>,
) {
    let u = |v: usize| Const::U32(v as u32);
    let mut consts = c.consts();
    consts.extend([
        ("NSG", u(t.subgroups)),
        ("GB", u(t.heads)),
        ("NGC", u(t.chunks)),
        ("QT", u(t.queries)),
        ("ND", u(c.dims.head_dim / 16)),
    ]);
    let mut flags = Vec::new();
    if c.format == KvFormat::F32 {
        flags.push("KV_F32");
    }
    let sources = super::coop_sources(COOP, EMULATED, emulate, &mut flags);
    (sources, consts, flags)
}

/// Causal attention of a block of up to `max_tokens` tokens on the tensor cores (or their
/// stand-ins with `emulate`).
pub fn attention_prefill_coop(
    k: &Kernels,
    name: &str,
    c: AttnConsts,
    max_tokens: usize,
    b: &AttnBuffers,
    o: &wgpu::Buffer,
    emulate: bool,
) -> Result<Dispatch> {
    c.check(name)?;
    if !takes(&c) {
        return Err(Error::Gpu(format!(
            "{name}: the cooperative prefill attention takes head dims that are multiples of \
             16 up to 128, not {}",
            c.dims.head_dim
        )));
    }
    super::require_coop(k, name, emulate)?;
    let max_tokens = max_tokens.max(1);
    c.check_buffers(name, b, max_tokens, c.dims.q_len())?;
    check_len(&format!("{name}: o"), o, max_tokens * c.o_stride())?;
    let wg_bytes = k.ctx.device.limits().max_compute_workgroup_storage_size as usize;
    let t = tile(&c, wg_bytes).map_err(|e| Error::Gpu(format!("{name}: {e}")))?;
    let (sources, consts, flags) = specialize(&c, t, emulate);
    let pipeline = k.pipeline("attention_prefill_coop", sources, &consts, &flags, false)?;
    Ok(Dispatch {
        bind_group: k.bind(&pipeline, name, &b.tile_entries(o)),
        pipeline,
        workgroups: (
            (c.dims.kv_heads * t.chunks) as u32,
            max_tokens.div_ceil(t.queries) as u32,
            1,
        ),
        name: name.to_string(),
        per_token: None,
        shorter: Vec::new(),
        section: Section::Attn,
        label: Label::default(),
    }
    .per_token(1, t.queries, 1))
}

/// The kernel's WGSL for `c` on the real cooperative ops (for validation without such a
/// device): the text `attention_prefill_coop` would compile, at `wg_bytes` of workgroup
/// memory.
pub fn coop_wgsl(c: &AttnConsts, wg_bytes: usize) -> Result<String> {
    let (sources, consts, flags) = specialize(c, tile(c, wg_bytes)?, false);
    crate::gpu::shader::assemble("attention_prefill_coop", sources, &consts, &flags)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_and_cover_the_heads() {
        for hd in (16..=128).step_by(16) {
            for (h, hkv) in [(32, 8), (12, 4), (16, 1), (9, 1), (8, 8), (128, 1)] {
                let c = super::super::attn::test_consts(h, hkv, hd);
                for wg in [32768, 49152] {
                    let t = tile(&c, wg).unwrap();
                    assert!(workgroup_bytes(hd, t.subgroups) <= wg, "{t:?}");
                    assert!(t.heads * t.chunks >= c.group() && t.queries >= 1, "{t:?}");
                    assert!(t.heads * t.queries <= 16 * t.subgroups, "{t:?}");
                }
            }
        }
    }
}
