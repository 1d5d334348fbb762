//! ggml's tensor types as GGUF files store them: block sizes, names, and dequantization to
//! f32 in exactly the arithmetic of gguf-py's numpy `gguf.quants.dequantize` (the order of
//! the products matters for bit equality: `(d·sc)·q − dmin·m` for the k-quants).
//!
//! Block layouts (little-endian, `d`/`m`/`dmin` are f16):
//! - Q4_0 (32 values, 18 B): `d, qs[16]`; value `j` is nibble `j/16` of `qs[j%16]`, `d·(q−8)`.
//! - Q4_1 (32, 20 B): `d, m, qs[16]`; `d·q + m`.
//! - Q5_0 (32, 22 B): `d, qh: u32, qs[16]`; bit `j` of `qh` is the fifth bit, `d·(q−16)`.
//! - Q5_1 (32, 24 B): `d, m, qh: u32, qs[16]`; `d·q + m`.
//! - Q8_0 (32, 34 B): `d, qs[32]` (i8); `q·d`.
//! - Q4_K (256, 144 B): `d, dmin, scales[12], qs[128]`; eight 32-value sub-blocks with 6-bit
//!   scale and min; sub-block `j` is nibble `j%2` of `qs[32·(j/2) + l]`.
//! - Q5_K (256, 176 B): `d, dmin, scales[12], qh[32], qs[128]`; bit `j` of `qh[l]` is the
//!   fifth bit of sub-block `j`.
//! - Q6_K (256, 210 B): `ql[128], qh[64], scales[16]` (i8), `d`; sixteen 16-value groups.

use half::{bf16, f16};

/// The tensor types this engine reads from GGUF files (spelled as ggml spells them).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

/// Every type id ggml defines, with its name (for messages about the ones refused).
const TYPE_NAMES: [(u32, &str); 36] = [
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (4, "Q4_2 (removed)"),
    (5, "Q4_3 (removed)"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
    (40, "NVFP4"),
    (41, "Q1_0"),
];

impl GgmlType {
    /// The type of GGUF type id `id`, or, for one this engine does not read, `Err` with
    /// ggml's name for it (`None`: an id ggml does not define, from a newer ggml or a
    /// corrupt file — messages then name the bare id).
    pub fn from_id(id: u32) -> Result<Self, Option<&'static str>> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            30 => GgmlType::BF16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            _ => {
                return Err(TYPE_NAMES.iter().find(|(i, _)| *i == id).map(|(_, n)| *n));
            }
        })
    }

    /// ggml's spelling.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// `(values per block, bytes per block)`.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_K => (256, 144),
            GgmlType::Q5_K => (256, 176),
            GgmlType::Q6_K => (256, 210),
        }
    }

    /// Bytes of `n` values, or `None` when `n` is not a whole number of blocks (or the
    /// product overflows).
    pub fn bytes_of(self, n: u64) -> Option<u64> {
        let (per, bytes) = self.block();
        if !n.is_multiple_of(per as u64) {
            return None;
        }
        (n / per as u64).checked_mul(bytes as u64)
    }

    /// Dequantizes whole blocks: `src.len()` must be a multiple of the block size in bytes.
    /// Pushes `src.len() / bytes · per` values onto `out`; returns whether all are finite.
    pub fn dequantize(self, src: &[u8], out: &mut Vec<f32>) -> bool {
        let (per, bytes) = self.block();
        debug_assert!(src.len().is_multiple_of(bytes));
        out.reserve(src.len() / bytes * per);
        let start = out.len();
        let h = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        for b in src.chunks_exact(bytes) {
            match self {
                GgmlType::F32 => out.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                GgmlType::F16 => out.push(h(b, 0)),
                GgmlType::BF16 => out.push(bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                GgmlType::Q4_0 => {
                    let d = h(b, 0);
                    out.extend((0..32).map(|j| d * (nibble(&b[2..], j) as f32 - 8.0)));
                }
                GgmlType::Q4_1 => {
                    let (d, m) = (h(b, 0), h(b, 2));
                    out.extend((0..32).map(|j| d * nibble(&b[4..], j) as f32 + m));
                }
                GgmlType::Q5_0 => {
                    let d = h(b, 0);
                    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                    out.extend((0..32).map(|j| {
                        let q = nibble(&b[6..], j) | ((qh >> j) & 1) << 4;
                        d * (q as f32 - 16.0)
                    }));
                }
                GgmlType::Q5_1 => {
                    let (d, m) = (h(b, 0), h(b, 2));
                    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                    out.extend((0..32).map(|j| {
                        let q = nibble(&b[8..], j) | ((qh >> j) & 1) << 4;
                        d * q as f32 + m
                    }));
                }
                GgmlType::Q8_0 => {
                    let d = h(b, 0);
                    out.extend(b[2..].iter().map(|&q| q as i8 as f32 * d));
                }
                GgmlType::Q4_K | GgmlType::Q5_K => {
                    let (d, dmin) = (h(b, 0), h(b, 2));
                    let (sc, mn) = k_scale_min(&b[4..16]);
                    let (qh, qs) = match self {
                        GgmlType::Q5_K => (Some(&b[16..48]), &b[48..176]),
                        _ => (None, &b[16..144]),
                    };
                    for j in 0..8 {
                        let dl = d * sc[j] as f32;
                        let ml = dmin * mn[j] as f32;
                        for l in 0..32 {
                            let mut q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf;
                            if let Some(qh) = qh {
                                q |= ((qh[l] >> j) & 1) << 4;
                            }
                            out.push(dl * q as f32 - ml);
                        }
                    }
                }
                GgmlType::Q6_K => {
                    let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
                    let d = h(b, 208);
                    for e in 0..256 {
                        let (t, l) = (e / 32, e % 32);
                        let (half, shift, second) = (t / 4, (t / 2) % 2, t % 2);
                        let lo = (ql[64 * half + 32 * second + l] >> (4 * shift)) & 0xf;
                        let hi = (qh[32 * half + l] >> (2 * (t % 4))) & 3;
                        let q = (lo | hi << 4) as i32 - 32;
                        out.push((d * sc[e / 16] as i8 as f32) * q as f32);
                    }
                }
            }
        }
        out[start..].iter().all(|v| v.is_finite())
    }
}

/// Nibble `j` (0…31) of a 16-byte 4-bit block: low nibbles are values 0…15.
fn nibble(qs: &[u8], j: usize) -> u32 {
    ((qs[j % 16] >> (4 * (j / 16))) & 0xf) as u32
}

/// The eight 6-bit scales and mins of a Q4_K/Q5_K block's 12 scale bytes.
fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_sizes() {
        assert_eq!(GgmlType::from_id(12), Ok(GgmlType::Q4_K));
        assert_eq!(GgmlType::from_id(16), Err(Some("IQ2_XXS")));
        assert_eq!(GgmlType::from_id(999), Err(None));
        assert_eq!(GgmlType::Q6_K.bytes_of(512), Some(420));
        assert_eq!(GgmlType::Q4_K.bytes_of(100), None);
        assert_eq!(GgmlType::F32.bytes_of(u64::MAX), None);
    }

    #[test]
    fn q8_0_and_q4_0_by_hand() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2] = 4;
        b[3] = (-6i8) as u8;
        let mut out = Vec::new();
        assert!(GgmlType::Q8_0.dequantize(&b, &mut out));
        assert_eq!(&out[..3], &[2.0, -3.0, 0.0]);
        let mut b = vec![0x88u8; 18];
        b[..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b[2] = 0x3a; // value 0 = 0xa, value 16 = 0x3
        out.clear();
        GgmlType::Q4_0.dequantize(&b, &mut out);
        assert_eq!((out[0], out[16], out[1]), (4.0, -10.0, 0.0));
    }
}
