//! ggml's reference block quantizers for the 4-, 5- and 6-bit formats the GPU holds (Q4_0,
//! Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), producing the block bytes GGUF files store (layouts
//! in `ggml`). The rules are llama.cpp's `quantize_row_*_ref` (ggml-quants.c), followed
//! step by step so a matrix quantized here equals what `llama-quantize` (no importance
//! matrix) writes for the same f32 values; `tests/gguf.rs` checks Q8_0 and the k-quants
//! against llama-quantize's own output and the 32-value types (Q4_0, Q4_1, Q5_0, Q5_1)
//! against gguf-py's port of the same rules.

use half::f16;

use super::ggml::GgmlType;

/// ggml's `nearest_int`: round half away from… the float-add trick (ties to even), valid
/// for |x| ≤ 4194303.
fn nearest_int(x: f32) -> i32 {
    let v = x + 12582912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Below this a group counts as all zero (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// One row (a whole number of `ty`'s blocks) quantized to `ty`'s block bytes, appended to
/// `out`. `ty` must be Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K or Q8_0.
pub fn quantize_row(ty: GgmlType, row: &[f32], out: &mut Vec<u8>) {
    let (per, _) = ty.block();
    debug_assert!(row.len().is_multiple_of(per));
    for x in row.chunks_exact(per) {
        match ty {
            GgmlType::Q4_0 => q4_0_block(x.try_into().unwrap(), out),
            GgmlType::Q4_1 => q4_1_block(x.try_into().unwrap(), out),
            GgmlType::Q5_0 => q5_0_block(x.try_into().unwrap(), out),
            GgmlType::Q5_1 => q5_1_block(x.try_into().unwrap(), out),
            GgmlType::Q4_K => q4_k_block(x.try_into().unwrap(), out),
            GgmlType::Q5_K => q5_k_block(x.try_into().unwrap(), out),
            GgmlType::Q6_K => q6_k_block(x.try_into().unwrap(), out),
            GgmlType::Q8_0 => {
                let (d, q) = super::quant::quantize_block(x.try_into().unwrap());
                out.extend(d.to_le_bytes());
                out.extend(q.iter().map(|&v| v as u8));
            }
            other => unreachable!("no quantizer for {}", other.name()),
        }
    }
}

/// The value of largest magnitude, sign kept (the first of equals, as ggml's loop keeps).
fn signed_max(x: &[f32; 32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Q4_0: `d = max/−8` (the signed value of largest magnitude), `q = min(15, trunc(x/d + 8.5))`.
fn q4_0_block(x: &[f32; 32], out: &mut Vec<u8>) {
    let d = signed_max(x) / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    out.extend((0..16).map(|j| q(x[j]) | q(x[j + 16]) << 4));
}

/// Q5_0: `d = max/−16`, `q = min(31, trunc(x/d + 16.5))`; the low nibbles as Q4_0's, each
/// value's fifth bit at bit `j` of `qh` (values 0…15) or `j + 16` (16…31).
fn q5_0_block(x: &[f32; 32], out: &mut Vec<u8>) {
    let d = signed_max(x) / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    let q = |v: f32| ((v * id + 16.5) as i8).min(31) as u8;
    let qh = (0..32).fold(0u32, |h, j| h | (u32::from(q(x[j]) >> 4) << j));
    out.extend(qh.to_le_bytes());
    out.extend((0..16).map(|j| (q(x[j]) & 15) | (q(x[j + 16]) & 15) << 4));
}

/// The block's minimum and maximum, with ggml's `quantize_row_q4_1_ref` comparisons (the
/// first of equal values kept, so a −0 or +0 minimum is the one ggml stores).
fn min_max(x: &[f32; 32]) -> (f32, f32) {
    let (mut lo, mut hi) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < lo {
            lo = v;
        }
        if v > hi {
            hi = v;
        }
    }
    (lo, hi)
}

/// Q4_1: `d = (max − min)/15`, `m = min`, `q = min(15, trunc((x − min)/d + 0.5))`; nibbles
/// as Q4_0's.
fn q4_1_block(x: &[f32; 32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(f16::from_f32(min).to_le_bytes());
    let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
    out.extend((0..16).map(|j| q(x[j]) | q(x[j + 16]) << 4));
}

/// Q5_1: `d = (max − min)/31`, `m = min`, `q = min(31, trunc((x − min)/d + 0.5))`; low
/// nibbles as Q4_0's, fifth bits in `qh` as Q5_0's.
fn q5_1_block(x: &[f32; 32], out: &mut Vec<u8>) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16::from_f32(d).to_le_bytes());
    out.extend(f16::from_f32(min).to_le_bytes());
    let q = |v: f32| (((v - min) * id + 0.5) as u8).min(31);
    let qh = (0..32).fold(0u32, |h, j| h | (u32::from(q(x[j]) >> 4) << j));
    out.extend(qh.to_le_bytes());
    out.extend((0..16).map(|j| (q(x[j]) & 15) | (q(x[j + 16]) & 15) << 4));
}

/// The search parameters of ggml's `make_qkx2_quants` for a k-quant with levels 0…nmax.
#[derive(Clone, Copy)]
struct Qkx2 {
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
}

/// Q4_K's (`quantize_row_q4_K_ref`).
const Q4_K_SEARCH: Qkx2 = Qkx2 {
    nmax: 15,
    rmin: -1.0,
    rdelta: 0.1,
    nstep: 20,
};

/// Q5_K's (`quantize_row_q5_K_ref`).
const Q5_K_SEARCH: Qkx2 = Qkx2 {
    nmax: 31,
    rmin: -0.5,
    rdelta: 0.1,
    nstep: 15,
};

/// ggml's `make_qkx2_quants` for a 32-value sub-block with weights `w` (squared error):
/// levels into `l`, returns `(scale, −min)`.
fn make_qkx2(p: Qkx2, x: &[f32], w: &[f32], l: &mut [u8]) -> (f32, f32) {
    let Qkx2 {
        nmax,
        rmin,
        rdelta,
        nstep,
    } = p;
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best += w[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = q as u8;
            let q = q as f32;
            sum_l += w[i] * q;
            sum_l2 += w[i] * q * q;
            sum_xl += w[i] * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut err = 0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                err += w[i] * (diff * diff);
            }
            if err < best {
                l[..n].copy_from_slice(&aux[..n]);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Q4_K: `d dmin scales[12]` then the levels as nibbles (`kx_levels`).
fn q4_k_block(x: &[f32; 256], out: &mut Vec<u8>) {
    let (head, levels) = kx_levels(Q4_K_SEARCH, x);
    out.extend(head);
    for j in (0..256).step_by(64) {
        out.extend((0..32).map(|l| levels[j + l] | levels[j + l + 32] << 4));
    }
}

/// Q5_K: `d dmin scales[12]`, then `qh[32]` (bit 2i/2i+1 of byte l: the fifth bit of value l
/// of the i-th 64-value pair of sub-blocks), then the low nibbles as Q4_K lays them out.
fn q5_k_block(x: &[f32; 256], out: &mut Vec<u8>) {
    let (head, levels) = kx_levels(Q5_K_SEARCH, x);
    out.extend(head);
    let mut qh = [0u8; 32];
    let mut qs = Vec::with_capacity(128);
    for (i, j) in (0..256).step_by(64).enumerate() {
        for l in 0..32 {
            let (a, b) = (levels[j + l], levels[j + l + 32]);
            qh[l] |= (a >> 4) << (2 * i) | (b >> 4) << (2 * i + 1);
            qs.push((a & 0xf) | (b & 0xf) << 4);
        }
    }
    out.extend(qh);
    out.extend(qs);
}

/// The Q4_K/Q5_K rule: eight 32-value sub-blocks, each `make_qkx2` with weights
/// `rms + |x|`; their scales and mins quantized to 6 bits against the largest
/// (`d = max_scale/63`, `dmin = max_min/63`), then the levels (0…nmax) recomputed against
/// the stored scales. Returns the 16 header bytes `d dmin scales[12]` and the levels.
fn kx_levels(p: Qkx2, x: &[f32; 256]) -> ([u8; 16], [u8; 256]) {
    let mut levels = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    let mut w = [0f32; 32];
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for v in xs {
            sum_x2 += v * v;
        }
        let av = (sum_x2 / 32.0).sqrt();
        for (wi, v) in w.iter_mut().zip(xs) {
            *wi = av + v.abs();
        }
        let (s, m) = make_qkx2(p, xs, &w, &mut levels[32 * j..32 * j + 32]);
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 12];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    for j in 0..8 {
        let (s, m) = k4_scale_min(&sc, j);
        let dl = d.to_f32() * s as f32;
        if dl == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for i in 0..32 {
            levels[32 * j + i] = nearest_int((x[32 * j + i] + dm) / dl).clamp(0, p.nmax) as u8;
        }
    }
    let mut head = [0u8; 16];
    head[..2].copy_from_slice(&d.to_le_bytes());
    head[2..4].copy_from_slice(&dmin.to_le_bytes());
    head[4..].copy_from_slice(&sc);
    (head, levels)
}

/// Scale and min of sub-block `j` from a k-quant's 12 scale bytes (ggml's
/// `get_scale_min_k4`).
fn k4_scale_min(q: &[u8; 12], j: usize) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// ggml's `make_qx_quants(16, 32, x, L, rmse_type = 1, no weights)`: a signed scale for
/// 16 values searched over 19 candidate steps, weighted by x²; levels `l + 32` into `l`.
fn make_qx(x: &[f32], l: &mut [i8]) -> f32 {
    let nmax = 32i32;
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (i, &v) in x.iter().enumerate() {
        let q = level(iscale, v);
        l[i] = (q + nmax) as i8;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (mut sx, mut s2) = (0f32, 0f32);
        for &v in x {
            let q = level(iscale, v) as f32;
            let w = v * v;
            sx += w * v * q;
            s2 += w * q * q;
        }
        if s2 > 0.0 && sx * sx > best * s2 {
            for (i, &v) in x.iter().enumerate() {
                l[i] = (nmax + level(iscale, v)) as i8;
            }
            scale = sx / s2;
            best = scale * sx;
        }
    }
    scale
}

/// Q6_K: sixteen 16-value groups, each `make_qx` → a signed scale; scales to int8 against
/// the one of largest magnitude (`d = max_scale/−128`), levels recomputed against them.
fn q6_k_block(x: &[f32; 256], out: &mut Vec<u8>) {
    let mut levels = [0i8; 256];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs) = (0f32, 0f32);
    for ib in 0..16 {
        let s = make_qx(
            &x[16 * ib..16 * ib + 16],
            &mut levels[16 * ib..16 * ib + 16],
        );
        scales[ib] = s;
        if s.abs() > max_abs {
            max_abs = s.abs();
            max_scale = s;
        }
    }
    if max_abs < GROUP_MAX_EPS {
        out.extend([0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16::from_f32(1.0 / iscale);
    let mut sc = [0i8; 16];
    for ib in 0..16 {
        sc[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
    }
    for j in 0..16 {
        let dl = d.to_f32() * sc[j] as f32;
        if dl == 0.0 {
            continue;
        }
        for i in 0..16 {
            levels[16 * j + i] = (nearest_int(x[16 * j + i] / dl).clamp(-32, 31) + 32) as i8;
        }
    }
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    let lv = |i: usize| levels[i] as u8;
    for (h, j) in (0..256).step_by(128).enumerate() {
        for l in 0..32 {
            let (q1, q2, q3, q4) = (lv(j + l), lv(j + l + 32), lv(j + l + 64), lv(j + l + 96));
            ql[64 * h + l] = (q1 & 0xf) | (q3 & 0xf) << 4;
            ql[64 * h + l + 32] = (q2 & 0xf) | (q4 & 0xf) << 4;
            qh[32 * h + l] = (q1 >> 4) | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6;
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend(d.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
        let mut bytes = Vec::new();
        quantize_row(ty, x, &mut bytes);
        assert_eq!(bytes.len(), ty.bytes_of(x.len() as u64).unwrap() as usize);
        let mut back = Vec::new();
        assert!(ty.dequantize(&bytes, &mut back));
        back
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(
            [0.5, 1.5, -0.5, 2.4, -2.6].map(nearest_int),
            [0, 2, 0, 2, -3]
        );
    }

    #[test]
    fn quantizers_round_trip_within_their_step() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i / 64) as f32))
            .collect();
        for (ty, step) in [
            (GgmlType::Q4_0, 1.0 / 7.0),
            (GgmlType::Q4_1, 1.0 / 12.0),
            (GgmlType::Q5_0, 1.0 / 15.0),
            (GgmlType::Q5_1, 1.0 / 24.0),
            (GgmlType::Q4_K, 1.0 / 12.0),
            (GgmlType::Q5_K, 1.0 / 24.0),
            (GgmlType::Q6_K, 1.0 / 28.0),
        ] {
            let back = round_trip(ty, &x);
            for (blk, (xs, bs)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (a, b) in xs.iter().zip(bs) {
                    assert!(
                        (a - b).abs() <= amax * step,
                        "{} block {blk}: {a} vs {b}",
                        ty.name()
                    );
                }
            }
        }
        // All-zero input stays zero in every format.
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ] {
            assert!(round_trip(ty, &[0.0; 256]).iter().all(|v| *v == 0.0));
        }
    }
}
