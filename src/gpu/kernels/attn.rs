//! What the attention kernels share (`kv_store`, `attention_decode`, `attention_combine`,
//! `attention_prefill`): one layer's sizes, cache format and constants, the tiling of
//! `attn_tile.wgsl` (prefill), and the buffers they bind. Layouts:
//! - `qkv [T][qkv_stride]` f32, each token row `[q (H·hd) | k (Hkv·hd) | v (Hkv·hd)]`;
//! - caches `k, v [ctx][Hkv][hd]`: f16, two per u32 (element 2i in the low half), or f32;
//! - `o [T][ceil32(H·hd)]` f32, zero past H·hd (the o_proj GEMV/GEMM input);
//!   head `h` reads kv head `h / (H / Hkv)`.

use super::check_len;
use crate::error::{Error, Result};
use crate::gpu::shader::Const;
use crate::reference::attention::AttnDims;

/// Invocations per workgroup of the tiled kernels (decode and prefill).
pub(super) const WG: usize = 128;
/// Query rows × hd values kept in workgroup memory (4 KiB of f32).
const Q_VALUES: usize = 1024;
/// Keys × hd values of one K (then V) tile in workgroup memory (8 KiB of f32).
const KV_VALUES: usize = 2048;
/// Workgroup memory the tiled kernels may use.
pub(super) const WG_BYTES: usize = 16384;

pub use crate::gpu::state_store::KvFormat;

/// One attention layer as its kernels see it.
#[derive(Clone, Copy, Debug)]
pub struct AttnConsts {
    pub dims: AttnDims,
    /// Rows of each cache: the context capacity.
    pub ctx: usize,
    pub format: KvFormat,
    /// Values per token row of `qkv`, at least `(H + 2·Hkv)·hd`.
    pub qkv_stride: usize,
    /// Score scale: `1/sqrt(hd)` (Nemotron-H) or the model's `attention_multiplier` (Granite).
    pub scale: f64,
    /// RoPE θ (HF `rotate_half` convention), or None (NoPE: Nemotron-H, Granite-4.0-H).
    pub rope: Option<f64>,
}

/// The buffers every attention kernel but the combine binds.
pub struct AttnBuffers<'a> {
    /// `qkv [T][qkv_stride]` (kv_store rotates q in place when RoPE is on).
    pub qkv: &'a wgpu::Buffer,
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    pub ctrl: &'a wgpu::Buffer,
    /// Decode lanes side by side (1: one sequence): `qkv` rows per lane, a cache slot of
    /// `ctx` rows and a control block each.
    pub lanes: super::Lanes,
}

impl<'a> AttnBuffers<'a> {
    /// The bindings of the tiled kernels (decode and prefill): qkv, the caches, ctrl, and
    /// their output at binding 4.
    pub(super) fn tile_entries(&self, out: &'a wgpu::Buffer) -> [(u32, &'a wgpu::Buffer); 5] {
        [
            (0, self.qkv),
            (1, self.k_cache),
            (2, self.v_cache),
            (3, self.ctrl),
            (4, out),
        ]
    }
}

/// How a tiled kernel splits its work: a workgroup takes `queries` tokens × `heads` query
/// heads of one kv head (`chunks` workgroups cover the H/Hkv heads of a kv head) and walks
/// the keys in tiles of `keys`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tile {
    /// Query rows (queries × heads) per workgroup.
    pub rows: usize,
    pub keys: usize,
    pub heads: usize,
    pub chunks: usize,
    pub queries: usize,
}

impl AttnConsts {
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.dims.heads / self.dims.kv_heads
    }

    /// Values per row of `o`: `ceil32(H·hd)`.
    pub fn o_stride(&self) -> usize {
        self.dims.q_len().next_multiple_of(32)
    }

    /// 4-byte words of each cache: `ctx·Hkv·hd` (f32) or half that (f16).
    pub fn cache_words(&self) -> usize {
        let values = self.ctx * self.dims.kv_len();
        match self.format {
            KvFormat::F16 => values / 2,
            KvFormat::F32 => values,
        }
    }

    /// Rejects shapes the kernels do not take.
    pub(super) fn check(&self, name: &str) -> Result<()> {
        let AttnDims {
            heads,
            kv_heads,
            head_dim: hd,
        } = self.dims;
        let bad = |why: String| Err(Error::Gpu(format!("{name}: {why}")));
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return bad(format!(
                "{heads} query heads do not share {kv_heads} kv heads"
            ));
        }
        if hd == 0 || !hd.is_multiple_of(2) || hd > 256 {
            return bad(format!("head dim {hd} is not even and ≤ 256"));
        }
        if self.ctx == 0 {
            return bad("an empty KV cache".into());
        }
        if self.qkv_stride < (heads + 2 * kv_heads) * hd {
            return bad(format!(
                "qkv rows of {} values cannot hold q, k and v ({})",
                self.qkv_stride,
                (heads + 2 * kv_heads) * hd
            ));
        }
        Ok(())
    }

    /// Checks the caches (and `qkv` for `tokens` rows, the first `row` values of the last).
    pub(super) fn check_buffers(
        &self,
        name: &str,
        b: &AttnBuffers,
        tokens: usize,
        row: usize,
    ) -> Result<()> {
        let cap = b.lanes.cap;
        check_len(
            &format!("{name}: qkv"),
            b.qkv,
            (cap - 1) * super::lane_stride(b.qkv, b.lanes) as usize
                + (tokens - 1) * self.qkv_stride
                + row,
        )?;
        check_len(
            &format!("{name}: k cache"),
            b.k_cache,
            cap * self.cache_words(),
        )?;
        check_len(
            &format!("{name}: v cache"),
            b.v_cache,
            cap * self.cache_words(),
        )?;
        check_len(&format!("{name}: ctrl"), b.ctrl, cap * super::CTRL_WORDS)
    }

    /// The lane stride of `qkv` (a constant of the decode kernels).
    pub(super) fn lane_consts(b: &AttnBuffers) -> (&'static str, Const) {
        ("QKV_LS", Const::U32(super::lane_stride(b.qkv, b.lanes)))
    }

    /// The tiling of `attn_tile.wgsl` (prefill): a workgroup takes several tokens of a few
    /// query heads.
    pub(super) fn tile(&self) -> Tile {
        let hd = self.dims.head_dim;
        let g = self.group();
        let max_rows = (Q_VALUES / hd).min(64);
        let chunks = g.div_ceil(max_rows);
        let heads = g.div_ceil(chunks);
        let queries = max_rows / heads;
        let rows = heads * queries;
        // What workgroup memory has left once qs and the per-row arrays are in.
        let row = self.row_values();
        let room = (WG_BYTES / 4 - rows * row - 4 * rows) / (row + rows);
        let keys = (KV_VALUES / hd).min(Q_VALUES / rows).min(64).min(room);
        Tile {
            rows,
            keys,
            heads,
            chunks,
            queries,
        }
    }

    /// Constants of the tiled kernels (their flags are `flags`).
    pub(super) fn tile_consts(&self, name: &str, t: Tile) -> Result<Vec<(&'static str, Const)>> {
        let hd = self.dims.head_dim;
        // qs, kvs (rows padded by one), ps, and four per-row arrays.
        let row = self.row_values();
        let bytes = 4 * (t.rows * row + t.keys * row + t.rows * t.keys + 4 * t.rows);
        if bytes > WG_BYTES {
            return Err(Error::Gpu(format!(
                "{name}: {bytes} bytes of workgroup memory (tiling {t:?})"
            )));
        }
        let u = |v: usize| Const::U32(v as u32);
        let mut consts = self.consts();
        consts.extend([
            ("WG", u(WG)),
            ("R", u(t.rows)),
            ("KT", u(t.keys)),
            ("GB", u(t.heads)),
            ("NGC", u(t.chunks)),
            ("QT", u(t.queries)),
            ("NO", u((t.rows * hd).div_ceil(WG))),
        ]);
        Ok(consts)
    }

    /// Sizes every attention kernel knows.
    pub(super) fn consts(&self) -> Vec<(&'static str, Const)> {
        let u = |v: usize| Const::U32(v as u32);
        vec![
            ("H", u(self.dims.heads)),
            ("HKV", u(self.dims.kv_heads)),
            ("HD", u(self.dims.head_dim)),
            ("G", u(self.group())),
            ("QS", u(self.qkv_stride)),
            ("OS", u(self.o_stride())),
            ("CTX", u(self.ctx)),
            ("SCALE", Const::F32(self.scale as f32)),
        ]
    }

    /// `KV_F32` for f32 caches.
    pub(super) fn flags(&self) -> Vec<&'static str> {
        let hd = self.dims.head_dim;
        let mut flags = match self.format {
            // 16-byte loads of eight f16 values where rows split into them.
            KvFormat::F16 if hd.is_multiple_of(8) => vec!["KV_VEC"],
            KvFormat::F16 => vec![],
            KvFormat::F32 => vec!["KV_F32"],
        };
        if hd.is_multiple_of(4) {
            flags.push("VEC4");
        }
        flags
    }

    /// f32 values of one query or key row in workgroup memory: padded by a value, or by
    /// a vec4 in the VEC4 layout.
    fn row_values(&self) -> usize {
        let hd = self.dims.head_dim;
        if hd.is_multiple_of(4) { hd + 4 } else { hd + 1 }
    }
}

/// A layer of `heads` query heads over `kv_heads`, head dim `head_dim`, 100 rows of f16
/// cache: the shape the kernels' tiling tests sweep.
#[cfg(test)]
pub(super) fn test_consts(heads: usize, kv_heads: usize, head_dim: usize) -> AttnConsts {
    AttnConsts {
        dims: AttnDims {
            heads,
            kv_heads,
            head_dim,
        },
        ctx: 100,
        format: KvFormat::F16,
        qkv_stride: (heads + 2 * kv_heads) * head_dim,
        scale: 0.1,
        rope: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_workgroup_memory() {
        for hd in (2..=256).step_by(2) {
            for (h, hkv) in [(1, 1), (32, 8), (12, 4), (32, 1), (9, 1), (64, 1), (7, 7)] {
                let c = test_consts(h, hkv, hd);
                let t = c.tile();
                assert!(t.heads * t.chunks >= c.group() && t.keys >= 1, "{t:?}");
                assert!(t.rows * hd <= Q_VALUES && t.queries >= 1, "{t:?}");
                c.tile_consts("t", t).unwrap();
            }
        }
    }
}
