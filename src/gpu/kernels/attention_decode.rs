//! `attention_decode.wgsl`: flash-decoding's first half for one token (per lane).
//! Cache rows `0 ..= ctrl.kv_len` are cut into at most NSEG segments (`decode_segments`);
//! the grid's x is the segments the rows in use fill (the whole capacity's where the step's
//! rows are not known), and a workgroup walks segments x, x + X, … that hold rows. It takes
//! a few query heads of one kv head and walks each segment
//! in tiles of keys: one pipeline per tile of `TILES`, the narrower ones in
//! `Dispatch::shorter` for the context lengths whose segments they fit. Shapes:
//! `qkv [qkv_stride]` (q of the token, already rotated), the caches (see `attn`), `part
//! [H][NSEG][hd + 2]` f32 (`decode_partials_len`); then `attention_combine` turns the
//! partials into `o`.

use super::attn::{AttnBuffers, AttnConsts, KvFormat, WG, WG_BYTES};
use super::{Dispatch, Kernels, Label, Section, check_len};
use crate::error::{Error, Result};
use crate::gpu::shader::Const;

const SOURCES: super::Sources = &[
    include_str!("../../../shaders/decode_segments.wgsl"),
    include_str!("../../../shaders/attention_decode.wgsl"),
];

/// Segments the cached rows are cut into (at most): enough workgroups to fill a large GPU
/// at any length, few enough partials that the combine stays short. The segment length
/// follows the length in use, not the capacity (`seg_len` in the shaders: the rows over
/// NSEG, rounded up to whole SEGK), so a short context still spreads over the GPU
/// (measured on the H200: with segments sized by a 32k capacity, 1k tokens of context ran
/// on 5 segments per kv head and attention took 0.29 ms per layer).
pub const SEGMENTS: usize = 256;

/// The granule of a segment's length: the narrowest tile's keys, so that short contexts
/// still make many workgroups (a tile's keys past the segment are masked).
const SEGK: usize = 32;

/// Keys per segment at the full capacity: a multiple of SEGK, ≈ ctx / SEGMENTS.
pub fn decode_segment(c: &AttnConsts) -> usize {
    SEGK * c.ctx.div_ceil(SEGK * SEGMENTS).max(1)
}

/// Segments of the whole cache (the grid's x at the longest length). Recorded for a
/// known number of rows in use (`Dispatch::record_tokens`), the grid's x is the segments
/// those rows fill, `min(NSEG, ceil(rows / SEGK))`: up to SEGK·NSEG rows a segment is SEGK
/// keys, past it every segment is in use. A workgroup takes the segments x, x + X, … (X the
/// grid's width), so a narrower grid than a lane needs is slower, never wrong; the
/// workgroups it leaves out would only have marked their partials empty (at 1k rows of a
/// 262 144-row cache, 1 792 of 2 048 in Nemotron 3 Nano's layers).
pub fn decode_segments(c: &AttnConsts) -> usize {
    c.ctx.div_ceil(decode_segment(c))
}

/// f32 values of the partials buffer: `H · NSEG · (hd + 2)`.
pub fn decode_partials_len(c: &AttnConsts) -> usize {
    c.dims.heads * decode_segments(c) * (c.dims.head_dim + 2)
}

/// Constants of both halves: the granule of the segment length and the segment count.
pub(super) fn segment_consts(c: &AttnConsts) -> [(&'static str, Const); 2] {
    [
        ("SEGK", Const::U32(SEGK as u32)),
        ("NSEG", Const::U32(decode_segments(c) as u32)),
    ]
}

/// A pipeline of the kernel: `keys` per tile (a divisor of WG: WG / keys invocations share
/// a key, each with some of the rows) and at most `max_rows` query heads per workgroup.
#[derive(Clone, Copy, Debug)]
struct DecodeTile {
    keys: usize,
    max_rows: usize,
}

/// The kernel's pipelines, narrowest first; `Dispatch::record_tokens` picks the narrowest
/// whose segments of the context in use fit one tile. Measured on the H200 (Nemotron 3
/// Nano q8_0: 16 query heads per kv head, hd 128; attention GPU ms per token over its 6
/// layers at 1k / 32k tokens of context): 128 keys × 8 rows 0.175 / 0.500, 64 × 8 0.154 /
/// 0.589, 32 × 8 0.135 / 0.578, 32 × 4 0.107 / 0.789, 16 × 8 0.153 / 0.889, 128 × 16
/// 0.278 / 0.584. Every invocation computes its key's scores whether the key is in the
/// segment or not, so a short segment on a wide tile wastes them, and a long one on a
/// narrow tile pays the softmax's barriers more often; fewer rows make more, shorter
/// workgroups, which pays where there is little work.
const TILES: [DecodeTile; 3] = [
    DecodeTile {
        keys: 32,
        max_rows: 4,
    },
    DecodeTile {
        keys: 64,
        max_rows: 8,
    },
    DecodeTile {
        keys: 128,
        max_rows: 8,
    },
];

/// V loads each invocation issues before using them.
const V_IN_FLIGHT: usize = 8;

/// K loads each invocation issues before using them: the most of 16, 8, 4, 2, 1 that
/// divides the row's `loads` (16: a whole hd-128 row of f16), at most 8 in a workgroup of 8
/// query heads, or at most `MAMBA2_ATTN_KU`. Measured on the H200 (BENCHMARKS.md, runs 65
/// and 166, ms/token at 32k tokens of context, 16 → 8): Nemotron 3 Nano (a kv head serves
/// 16 query heads, 8 per workgroup) 2.122, 2.113 → 2.072, 2.067; Nemotron-H-8B (4 per
/// workgroup) 3.298, 3.296 → 3.321, 3.323; Granite-4.0-H-Tiny and every 1k context unchanged.
fn in_flight(loads: usize, rows: usize) -> usize {
    let most = knob("MAMBA2_ATTN_KU", &[1, 2, 4, 8, 16]).unwrap_or(if rows >= 8 { 8 } else { 16 });
    [16, 8, 4, 2, 1]
        .into_iter()
        .find(|u| *u <= most && loads.is_multiple_of(*u))
        .unwrap_or(1)
}

/// The narrowest tile's query heads per workgroup: `TILES[0].max_rows`, or
/// `MAMBA2_ATTN_ROWS` (a probe: at 1k tokens of context Nemotron 3 Nano's attention went
/// 0.135 → 0.107 GPU ms per token from 8 to 4 rows, run 66, and fewer were never timed).
fn narrowest(t: DecodeTile) -> DecodeTile {
    DecodeTile {
        max_rows: knob("MAMBA2_ATTN_ROWS", &[1, 2, 4, 8]).unwrap_or(t.max_rows),
        ..t
    }
}

/// A tuning override among `allowed` values (`check_overrides` refused any other before
/// a device was made, so a bad value here is not possible; it reads as unset).
fn knob(var: &str, allowed: &[usize]) -> Option<usize> {
    std::env::var(var)
        .ok()
        .and_then(|s| parse_knob(var, &s, allowed).ok())
}

fn parse_knob(var: &str, s: &str, allowed: &[usize]) -> Result<usize> {
    match s.trim().parse::<usize>() {
        Ok(n) if allowed.contains(&n) => Ok(n),
        _ => Err(Error::InvalidInput(format!(
            "{var}={s}: want one of {allowed:?}"
        ))),
    }
}

/// The decode attention's tuning overrides (MAMBA2_ATTN_KU, MAMBA2_ATTN_ROWS), checked
/// before a device is made.
pub fn check_overrides() -> Result<()> {
    for (var, allowed) in [
        ("MAMBA2_ATTN_KU", &[1, 2, 4, 8, 16][..]),
        ("MAMBA2_ATTN_ROWS", &[1, 2, 4, 8][..]),
    ] {
        if let Ok(s) = std::env::var(var) {
            parse_knob(var, &s, allowed)?;
        }
    }
    Ok(())
}

/// Softmax invocations per row, P, the same for every tile of a graph: a power of two, at
/// most 32 (each reads the row's P partial maxima and sums), the smallest that the tiles'
/// rows (`rows`, one count per tile) would each take, so that rows × P fits every tile's
/// workgroup. Each of a row's P partial sums adds the keys ≡ its index (mod P)
/// of a tile, so a tile's sum of exp(score − max) depends on P: with one P, every tile that
/// holds a segment adds its keys in the same order (the keys past the segment add exact
/// zeros), and a lane batched with a longer one, which may run a wider tile, keeps the
/// bits of its run alone. (A P per tile, the most each allowed, made the 4-row tile's sums
/// differ from the 8-row tiles' wherever a kv head serves more than 4 query heads.)
fn softmax_share(wg: usize, rows: impl Iterator<Item = usize>) -> usize {
    rows.map(|r| (1usize << (wg / r).ilog2()).min(32))
        .min()
        .expect("tiles")
}

/// Workgroup memory of a pipeline: the queries (rows × hd), the scores (rows × keys), two
/// WG-long reduction arrays and three per-row values, all 4-byte.
fn workgroup_bytes(hd: usize, rows: usize, keys: usize) -> usize {
    4 * (rows * hd + rows * keys + 2 * WG + 3 * rows)
}

/// How the query heads of a kv head split over workgroups of at most `max_rows` (each a
/// register per invocation in the scores and CW of them in P·V): `(rows, chunks)`, rows
/// per workgroup as even as the chunks allow (9 heads: 5 + 4).
fn head_rows(c: &AttnConsts, max_rows: usize) -> (usize, usize) {
    let g = c.group();
    let chunks = g.div_ceil(max_rows);
    (g.div_ceil(chunks), chunks)
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
    let hd = c.dims.head_dim;
    // Four values per load where rows split into them, else two (hd is even).
    let cw = if hd.is_multiple_of(4) { 4 } else { 2 };
    let nch = hd / cw;
    let u = |v: usize| Const::U32(v as u32);
    let mut consts = c.consts();
    consts.extend(segment_consts(&c));
    consts.extend([
        ("WG", u(WG)),
        ("CW", u(cw)),
        ("NCH", u(nch)),
        ("KG", u(WG / nch)),
        ("VU", u(V_IN_FLIGHT)),
        AttnConsts::lane_consts(b),
        ("PART_LS", Const::U32(super::lane_stride(part, lanes))),
    ]);
    let mut flags = Vec::new();
    if c.format == KvFormat::F32 {
        flags.push("KV_F32");
    }
    if cw == 4 {
        flags.push("CW4");
    }
    // K's loads per row: 16-byte ones for f16 rows of whole eights.
    let k16 = c.format == KvFormat::F16 && hd.is_multiple_of(8);
    if k16 {
        flags.push("K16");
    }
    let k_loads = if k16 { hd / 8 } else { nch };
    let nseg = decode_segments(&c);
    if nseg > 65535 {
        return Err(Error::Gpu(format!("{name}: {nseg} segments")));
    }
    // The tiles in use: the narrowest maybe overridden (`MAMBA2_ATTN_ROWS`).
    let tiles: Vec<DecodeTile> = TILES
        .iter()
        .enumerate()
        .map(|(i, &t)| if i == 0 { narrowest(t) } else { t })
        .collect();
    let p = softmax_share(WG, tiles.iter().map(|t| head_rows(&c, t.max_rows).0));
    // One pipeline per tile; the widest serves any length.
    let dispatch = |t: DecodeTile| -> Result<Dispatch> {
        let (rows, chunks) = head_rows(&c, t.max_rows);
        let bytes = workgroup_bytes(hd, rows, t.keys);
        if bytes > WG_BYTES {
            return Err(Error::Gpu(format!(
                "{name}: {bytes} bytes of workgroup memory ({t:?}, {rows} heads, hd {hd})"
            )));
        }
        let mut consts = consts.clone();
        consts.extend([
            ("R", u(rows)),
            ("NGC", u(chunks)),
            ("P", u(p)),
            ("KT", u(t.keys)),
            ("RG", u(WG / t.keys)),
            ("RPT", u(rows.div_ceil(WG / t.keys))),
            ("KU", u(in_flight(k_loads, rows))),
        ]);
        let pipeline = k.pipeline("attention_decode", SOURCES, &consts, &flags, false)?;
        Ok(Dispatch {
            bind_group: k.bind(&pipeline, name, &b.tile_entries(part)),
            pipeline,
            workgroups: (
                nseg as u32,
                (c.dims.kv_heads * chunks) as u32,
                lanes.n as u32,
            ),
            name: name.to_string(),
            per_token: None,
            shorter: Vec::new(),
            section: Section::Attn,
            label: Label::default(),
        }
        .per_token(0, SEGK, 1))
    };
    // Contexts whose segments fit a narrower tile take it (segments of `keys` keys up to
    // keys·NSEG rows in use).
    let (widest, narrower) = tiles.split_last().expect("tiles");
    let shorter = narrower
        .iter()
        .map(|&t| Ok(((t.keys * nseg) as u32, dispatch(t)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(Dispatch {
        shorter,
        ..dispatch(*widest)?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pipeline of every shape the checks admit (even hd ≤ 256, any grouping) fits
    /// the 16 KiB of workgroup memory every device has, covers its kv head's query heads,
    /// and splits its workgroup evenly.
    #[test]
    fn every_pipeline_fits_and_covers_its_heads() {
        for hd in (2..=256).step_by(2) {
            for (h, hkv) in [(1, 1), (32, 8), (12, 4), (32, 1), (9, 1), (64, 1), (32, 2)] {
                let c = super::super::attn::test_consts(h, hkv, hd);
                // The tiles, and the narrowest with every MAMBA2_ATTN_ROWS.
                let probes = [1, 2, 4, 8].map(|max_rows| DecodeTile {
                    max_rows,
                    ..TILES[0]
                });
                for t in TILES.into_iter().chain(probes) {
                    let (rows, chunks) = head_rows(&c, t.max_rows);
                    assert!(
                        rows <= t.max_rows && rows * chunks >= c.group(),
                        "{t:?} {h}/{hkv}"
                    );
                    assert!(WG.is_multiple_of(t.keys), "{t:?}");
                    assert!(
                        workgroup_bytes(hd, rows, t.keys) <= WG_BYTES,
                        "{t:?} hd {hd}"
                    );
                }
                // One softmax share for the tiles a graph holds (any narrowest): a power
                // of two of at most 32 whose rows × share fit every tile's workgroup.
                for probe in probes {
                    let tiles = [probe, TILES[1], TILES[2]];
                    let p = softmax_share(WG, tiles.iter().map(|t| head_rows(&c, t.max_rows).0));
                    assert!(p.is_power_of_two() && p <= 32, "{h}/{hkv}: P {p}");
                    for t in tiles {
                        assert!(head_rows(&c, t.max_rows).0 * p <= WG, "{t:?} {h}/{hkv}");
                    }
                }
            }
        }
    }

    #[test]
    fn overrides_take_only_their_values() {
        assert_eq!(
            parse_knob("MAMBA2_ATTN_ROWS", " 2", &[1, 2, 4, 8]).unwrap(),
            2
        );
        for bad in ["0", "3", "16", "two", ""] {
            let e = parse_knob("MAMBA2_ATTN_ROWS", bad, &[1, 2, 4, 8])
                .unwrap_err()
                .to_string();
            assert!(e.contains("MAMBA2_ATTN_ROWS"), "{bad}: {e}");
        }
    }
}
