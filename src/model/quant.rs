//! Device weight layouts and q8_0 quantization. Big matrices are stored row-major with each
//! row zero-padded to `kp` columns so kernels can load whole vectors:
//! - f32: `kp = ceil(K/4)·4`; f16 and bf16: `kp = ceil(K/8)·8` (halves packed two per u32;
//!   bf16 keeps a bf16 checkpoint's values exactly, with f32's range);
//! - q8_0: `kp = ceil(K/32)·32`; 32-weight blocks, `w = d·q` with `d = max|w|/127` stored as
//!   f16 and `q = round(w/d)` (ggml's rule), int8 packed four per u32; scales in their own
//!   array, two f16 per u32, block `b` of row `r` at index `r·kp/32 + b`.
//! - q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k: ggml's blocks (`ggml` has their layouts) as
//!   GGUF stores them, each split in two so the kernels load the bulk with aligned 16-byte
//!   reads: `data` holds the quants (q4_0, q4_1, q5_0 and q5_1: the 16 `qs` bytes; q4_k: the
//!   128 `qs` bytes; q5_k: `qs[128]` then `qh[32]`; q6_k: `ql[128] qh[64]`), `scales` the
//!   rest (q4_0: `d`, two per u32 as for q8_0; q4_1: `d m`, 4 bytes; q5_0: `qh` then `d` and
//!   two zero bytes, 8 bytes; q5_1: `qh` then `d m`, 8 bytes; q4_k and q5_k: `d dmin
//!   scales[12]`, 16 bytes; q6_k: `scales[16] d` and two zero bytes, 20 bytes). `kp` is a
//!   whole number of blocks (32 or 256), padded with zeros; a GGUF's blocks go up byte for
//!   byte.
//!
//! Every weight is checked for NaN and ±Inf on its way to a device, inside the conversion
//! pass that already touches each value (`finite_f32`, `map_finite`), and a packed matrix
//! for values its format cannot hold (an f16 weight or q8_0 scale past ±65504:
//! `pack_checked`).

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::model::Tensor;
use crate::model::ggml::GgmlType;
use crate::model::kquant;

/// How a big matrix is stored on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl WeightFormat {
    pub const ALL: [WeightFormat; 11] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q4_K,
        WeightFormat::Q5_K,
        WeightFormat::Q6_K,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::BF16 => "bf16",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q4_1 => "q4_1",
            WeightFormat::Q5_0 => "q5_0",
            WeightFormat::Q5_1 => "q5_1",
            WeightFormat::Q4_K => "q4_k",
            WeightFormat::Q5_K => "q5_k",
            WeightFormat::Q6_K => "q6_k",
        }
    }

    /// The ggml block type of a quantized format.
    pub fn ggml(self) -> Option<GgmlType> {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => None,
            WeightFormat::Q8_0 => Some(GgmlType::Q8_0),
            WeightFormat::Q4_0 => Some(GgmlType::Q4_0),
            WeightFormat::Q4_1 => Some(GgmlType::Q4_1),
            WeightFormat::Q5_0 => Some(GgmlType::Q5_0),
            WeightFormat::Q5_1 => Some(GgmlType::Q5_1),
            WeightFormat::Q4_K => Some(GgmlType::Q4_K),
            WeightFormat::Q5_K => Some(GgmlType::Q5_K),
            WeightFormat::Q6_K => Some(GgmlType::Q6_K),
        }
    }

    /// The format that holds a ggml block type as stored, if the GPU has one.
    pub fn from_ggml(t: GgmlType) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.ggml() == Some(t))
    }

    /// Whether GEMVs over this format read the q8 blocks of their input (integer dot
    /// products) rather than f32 values.
    pub fn reads_q8(self) -> bool {
        self.ggml().is_some()
    }

    /// Values per block (1 for the float formats).
    pub fn block(self) -> usize {
        self.ggml().map_or(1, |t| t.block().0)
    }

    /// `(data, scales)` bytes of one block of a quantized format (see the module doc).
    pub fn split(self) -> (usize, usize) {
        match self {
            WeightFormat::F32 => (4, 0),
            WeightFormat::F16 | WeightFormat::BF16 => (2, 0),
            WeightFormat::Q8_0 => (32, 2),
            WeightFormat::Q4_0 => (16, 2),
            WeightFormat::Q4_1 => (16, 4),
            WeightFormat::Q5_0 | WeightFormat::Q5_1 => (16, 8),
            WeightFormat::Q4_K => (128, 16),
            WeightFormat::Q5_K => (160, 16),
            WeightFormat::Q6_K => (192, 20),
        }
    }

    /// Columns a row is padded to.
    pub fn padded_cols(self, k: usize) -> usize {
        match self {
            WeightFormat::F32 => k.next_multiple_of(4),
            WeightFormat::F16 | WeightFormat::BF16 => k.next_multiple_of(8),
            f => k.next_multiple_of(f.block()),
        }
    }

    /// The format a `[rows, k]` matrix asked for in `self` is packed in: the k-quants'
    /// 256-value superblocks must tile its rows (zero-padding them would make the kernels
    /// read activations past K), so other widths go to q8_0 — llama.cpp likewise falls
    /// back to a 32-value block type for such rows.
    pub fn for_cols(self, k: usize) -> WeightFormat {
        match self {
            WeightFormat::Q4_K | WeightFormat::Q5_K | WeightFormat::Q6_K
                if !k.is_multiple_of(256) =>
            {
                WeightFormat::Q8_0
            }
            f => f,
        }
    }

    /// Bytes of the `data` buffer of a `[rows, k]` matrix (the quants, without scales).
    pub fn data_bytes(self, rows: usize, k: usize) -> usize {
        rows * self.padded_cols(k) / self.block() * self.split().0
    }

    /// Bytes of a `[rows, k]` matrix in this format (data + scales).
    pub fn bytes(self, rows: usize, k: usize) -> usize {
        let blocks = rows * self.padded_cols(k) / self.block();
        let (d, s) = self.split();
        blocks * (d + s)
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(WeightFormat::F32),
            "f16" => Ok(WeightFormat::F16),
            "bf16" => Ok(WeightFormat::BF16),
            "q8_0" | "q8" => Ok(WeightFormat::Q8_0),
            "q4_0" => Ok(WeightFormat::Q4_0),
            "q4_1" => Ok(WeightFormat::Q4_1),
            "q5_0" => Ok(WeightFormat::Q5_0),
            "q5_1" => Ok(WeightFormat::Q5_1),
            "q4_k" | "q4_K" => Ok(WeightFormat::Q4_K),
            "q5_k" | "q5_K" => Ok(WeightFormat::Q5_K),
            "q6_k" | "q6_K" => Ok(WeightFormat::Q6_K),
            _ => Err(format!(
                "`{s}`: expected f32, f16, bf16, q8_0, q6_k, q5_k, q5_1, q5_0, q4_k, q4_1 or q4_0"
            )),
        }
    }
}

/// A matrix converted to a device layout: `data` (and `scales` for q8_0) as bytes.
pub struct Packed {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub kp: usize,
    pub data: Vec<u8>,
    pub scales: Vec<u8>,
}

/// `t`'s values as f32, or an error naming the tensor and its first NaN or ±Inf. The check
/// rides along the conversion (`Tensor::to_f32_checked`); the bad element is only looked
/// for once one is known to exist.
pub fn finite_f32(t: &Tensor) -> Result<Vec<f32>> {
    match t.to_f32_checked() {
        (values, true) => Ok(values),
        (values, false) => Err(nonfinite_weight(t, &values)),
    }
}

/// `finite_f32` mapped by `f`.
pub fn map_finite<U>(t: &Tensor, f: impl FnMut(f32) -> U) -> Result<Vec<U>> {
    Ok(finite_f32(t)?.into_iter().map(f).collect())
}

/// The error for a tensor known to hold a NaN or ±Inf: names it and the first such element.
fn nonfinite_weight(t: &Tensor, values: &[f32]) -> Error {
    let Some(i) = values.iter().position(|v| !v.is_finite()) else {
        return Error::tensor(&t.name, "holds a non-finite value (NaN or ±Inf)");
    };
    Error::tensor(
        &t.name,
        format!(
            "holds a non-finite value ({}) at element {i}{}: the checkpoint is corrupt or \
             was saved from a diverged run",
            values[i],
            element_index(&t.shape, i)
        ),
    )
}

/// ` (index [a, b, …])` of flat element `i` in `shape`, for shapes of two or more axes.
fn element_index(shape: &[usize], mut i: usize) -> String {
    if shape.len() < 2 {
        return String::new();
    }
    let mut idx = vec![0; shape.len()];
    for (slot, &n) in idx.iter_mut().zip(shape).rev() {
        *slot = i % n.max(1);
        i /= n.max(1);
    }
    let idx: Vec<String> = idx.iter().map(usize::to_string).collect();
    format!(" (index [{}])", idx.join(", "))
}

/// Converts a row-major `[rows, cols]` f32 matrix to `format`'s device layout.
pub fn pack(format: WeightFormat, values: &[f32], rows: usize, cols: usize) -> Packed {
    pack_rows(format, values, rows, cols).0
}

/// `pack`, or `Err(i)` when value `i` does not fit `format`: an f16 weight past ±65504,
/// or the largest |w| of a q8_0 block whose f16 scale `amax/127` overflows (`unfit` words
/// it). NaN and ±Inf inputs are `map_finite`'s to catch.
pub fn pack_checked(
    format: WeightFormat,
    values: &[f32],
    rows: usize,
    cols: usize,
) -> std::result::Result<Packed, usize> {
    match pack_rows(format, values, rows, cols) {
        (p, None) => Ok(p),
        (_, Some(i)) => Err(i),
    }
}

/// The error for `value`, at `[r, c]` of the `cols`-column tensor `name`, not fitting
/// `format` (see `pack_checked`).
pub fn unfit(
    name: &str,
    format: WeightFormat,
    value: f32,
    r: usize,
    c: usize,
    cols: usize,
) -> Error {
    let per = format.block();
    let what = match format {
        WeightFormat::F32 | WeightFormat::F16 => format!(
            "the value {value} at index [{r}, {c}] is past {}'s range (±65504): use --dtype \
             bf16 or f32",
            format.name()
        ),
        WeightFormat::BF16 => format!(
            "the value {value} at index [{r}, {c}] rounds past bf16's range: use --dtype f32"
        ),
        _ => format!(
            "the {} block of row {r} at columns {}…{} has max |w| = {}, past what its f16 \
             scale holds: use --dtype f32",
            format.name(),
            c / per * per,
            (c / per * per + per - 1).min(cols.saturating_sub(1)),
            value.abs()
        ),
    };
    Error::tensor(name, what)
}

/// `pack`, and the index in `values` of the first value whose stored form is not finite
/// (f16 or bf16 overflow; for the block formats the largest |w| of a block whose f16 scale
/// overflows). The check is folded into the conversion loop and costs nothing for f32.
fn pack_rows(
    format: WeightFormat,
    values: &[f32],
    rows: usize,
    cols: usize,
) -> (Packed, Option<usize>) {
    assert_eq!(values.len(), rows * cols, "matrix data and shape disagree");
    let kp = format.padded_cols(cols);
    let row = |r: usize| &values[r * cols..(r + 1) * cols];
    let mut overflow = None;
    let (data, scales) = match format {
        WeightFormat::F32 => {
            let mut out = vec![0f32; rows * kp];
            for r in 0..rows {
                out[r * kp..r * kp + cols].copy_from_slice(row(r));
            }
            (bytemuck::cast_slice(&out).to_vec(), Vec::new())
        }
        WeightFormat::F16 => {
            let mut out = vec![f16::ZERO; rows * kp];
            let mut bad = false;
            for r in 0..rows {
                for (o, &v) in out[r * kp..].iter_mut().zip(row(r)) {
                    *o = f16::from_f32(v);
                    bad |= o.to_bits() & 0x7c00 == 0x7c00;
                }
            }
            if bad {
                overflow = values.iter().position(|v| !f16::from_f32(*v).is_finite());
            }
            (bytemuck::cast_slice(&out).to_vec(), Vec::new())
        }
        WeightFormat::BF16 => {
            // Exact for values read from a bf16 checkpoint; others round to nearest even.
            let mut out = vec![bf16::ZERO; rows * kp];
            for r in 0..rows {
                for (o, &v) in out[r * kp..].iter_mut().zip(row(r)) {
                    *o = bf16::from_f32(v);
                }
            }
            overflow = values.iter().position(|v| !bf16::from_f32(*v).is_finite());
            (bytemuck::cast_slice(&out).to_vec(), Vec::new())
        }
        WeightFormat::Q8_0
        | WeightFormat::Q4_0
        | WeightFormat::Q4_1
        | WeightFormat::Q5_0
        | WeightFormat::Q5_1
        | WeightFormat::Q4_K
        | WeightFormat::Q5_K
        | WeightFormat::Q6_K => {
            // ggml's block bytes (q8_0's rule is `quantize_block`), split for the device.
            let ty = format.ggml().expect("a quantized format");
            let (per, bytes) = ty.block();
            let (mut data, mut scales) = (Vec::new(), Vec::new());
            let (mut padded, mut blocks) = (vec![0f32; kp], Vec::with_capacity(kp / per * bytes));
            for r in 0..rows {
                padded[..cols].copy_from_slice(row(r));
                blocks.clear();
                kquant::quantize_row(ty, &padded, &mut blocks);
                for (b, block) in blocks.chunks_exact(bytes).enumerate() {
                    if overflow.is_none() && !scales_finite(ty, block) {
                        // The largest |w| of the block whose scale overflowed.
                        let lo = b * per;
                        let xs = &row(r)[lo.min(cols)..(lo + per).min(cols)];
                        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let j = xs.iter().position(|v| v.abs() == amax).unwrap_or(0);
                        overflow = Some(r * cols + lo + j);
                    }
                    split_block(format, block, &mut data, &mut scales);
                }
            }
            (data, scales)
        }
    };
    let p = Packed {
        format,
        rows,
        cols,
        kp,
        data,
        scales,
    };
    (p, overflow)
}

/// Whether a ggml block's f16 scale fields are finite (an f16 overflow otherwise).
fn scales_finite(ty: GgmlType, block: &[u8]) -> bool {
    let h = |at: usize| f16::from_le_bytes([block[at], block[at + 1]]).is_finite();
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => h(0) && h(2),
        GgmlType::Q6_K => h(208),
        _ => h(0),
    }
}

/// Appends one ggml block of `format` to the device layout's `data` and `scales`.
fn split_block(format: WeightFormat, block: &[u8], data: &mut Vec<u8>, scales: &mut Vec<u8>) {
    match format {
        WeightFormat::Q8_0 | WeightFormat::Q4_0 => {
            scales.extend_from_slice(&block[..2]);
            data.extend_from_slice(&block[2..]);
        }
        WeightFormat::Q4_1 => {
            // d, m, qs[16] → data qs; scales d, m.
            scales.extend_from_slice(&block[..4]);
            data.extend_from_slice(&block[4..]);
        }
        WeightFormat::Q5_1 => {
            // d, m, qh[4], qs[16] → data qs; scales qh, d, m.
            scales.extend_from_slice(&block[4..8]);
            scales.extend_from_slice(&block[..4]);
            data.extend_from_slice(&block[8..]);
        }
        WeightFormat::Q5_0 => {
            // d, qh[4], qs[16] → data qs; scales qh, d, two zero bytes.
            scales.extend_from_slice(&block[2..6]);
            scales.extend_from_slice(&block[..2]);
            scales.extend_from_slice(&[0, 0]);
            data.extend_from_slice(&block[6..]);
        }
        WeightFormat::Q4_K => {
            scales.extend_from_slice(&block[..16]);
            data.extend_from_slice(&block[16..]);
        }
        WeightFormat::Q5_K => {
            scales.extend_from_slice(&block[..16]);
            data.extend_from_slice(&block[48..176]);
            data.extend_from_slice(&block[16..48]);
        }
        WeightFormat::Q6_K => {
            data.extend_from_slice(&block[..192]);
            scales.extend_from_slice(&block[192..210]);
            scales.extend_from_slice(&[0, 0]);
        }
        WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => {
            unreachable!("not a block format")
        }
    }
}

/// A packed block-format matrix in ggml's byte layout, as a GGUF stores it (`repack_ggml`
/// undone); None for the float formats and for rows padded past their columns.
pub fn ggml_blocks(p: &Packed) -> Option<Vec<u8>> {
    let ty = p.format.ggml()?;
    if p.kp != p.cols {
        return None;
    }
    let blocks = p.rows * p.cols / ty.block().0;
    Some((0..blocks).flat_map(|i| join_block(p, i)).collect())
}

/// Block `i` of a packed matrix back in ggml's byte layout (`split_block` undone).
fn join_block(p: &Packed, i: usize) -> Vec<u8> {
    let (d, s) = p.format.split();
    let (data, sc) = (&p.data[i * d..(i + 1) * d], &p.scales[i * s..(i + 1) * s]);
    match p.format {
        WeightFormat::Q6_K => [data, &sc[..18]].concat(),
        WeightFormat::Q5_K => [sc, &data[128..], &data[..128]].concat(),
        WeightFormat::Q5_0 => [&sc[4..6], &sc[..4], data].concat(),
        WeightFormat::Q5_1 => [&sc[4..8], &sc[..4], data].concat(),
        _ => [sc, data].concat(),
    }
}

/// ggml's q8_0 block rule: `d = amax/127`, `q = round(w/d)`, `d` stored as f16.
pub fn quantize_block(block: &[f32; 32]) -> (f16, [i8; 32]) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i8; 32];
    for (o, &v) in q.iter_mut().zip(block) {
        *o = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
    (f16::from_f32(d), q)
}

/// The activation side of the q8_0 GEMV kernel, mirrored: per 32-block `d = amax/127`,
/// `q = clamp(round_ties_even(x·(1/d)), −127, 127)` (WGSL's `round` ties to even).
/// Returns (q, d) per block.
pub fn quantize_activation_block(x: &[f32; 32]) -> ([i8; 32], f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i8; 32];
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    (q, d)
}

/// The CPU reference of the q8_0 GEMV kernel: `y[r] = Σ_blocks d_w·d_x·Σ q_w·q_x` over a
/// packed matrix and a `K`-vector `x` (already normalized/scaled as the kernel's x).
pub fn q8_0_gemv_reference(p: &Packed, x: &[f32]) -> Vec<f32> {
    assert_eq!(p.format, WeightFormat::Q8_0);
    assert_eq!(x.len(), p.cols);
    let q: &[i8] = bytemuck::cast_slice(&p.data);
    let d: &[f16] = bytemuck::cast_slice(&p.scales);
    let blocks: Vec<([i8; 32], f32)> = (0..p.kp / 32)
        .map(|b| {
            let mut blk = [0f32; 32];
            for (j, slot) in blk.iter_mut().enumerate() {
                *slot = x.get(b * 32 + j).copied().unwrap_or(0.0);
            }
            quantize_activation_block(&blk)
        })
        .collect();
    (0..p.rows)
        .map(|r| {
            let mut acc = 0f32;
            for (b, (xq, xs)) in blocks.iter().enumerate() {
                // The kernel sums 16 weights (one vec4<u32>) per step.
                for half in 0..2 {
                    let base = r * p.kp + b * 32 + half * 16;
                    let dot: i32 = (0..16)
                        .map(|j| q[base + j] as i32 * xq[half * 16 + j] as i32)
                        .sum();
                    acc += dot as f32 * (d[r * p.kp / 32 + b].to_f32() * xs);
                }
            }
            acc
        })
        .collect()
}

/// GGUF tensors of one block type the GPU holds (stacked by rows, each `[rows, cols]`,
/// cols a whole number of blocks) in the device layout of `format`, as stored: each block
/// split into `data` and `scales` (see the module doc). No value is requantized.
pub fn repack_ggml(format: WeightFormat, parts: &[&Tensor]) -> Packed {
    let ty = format.ggml().expect("a quantized format");
    let cols = parts[0].shape[1];
    let rows: usize = parts.iter().map(|t| t.shape[0]).sum();
    let (mut data, mut scales) = (Vec::new(), Vec::new());
    for t in parts {
        debug_assert_eq!(t.dtype, crate::model::DType::Quant(ty));
        for block in t.bytes().chunks_exact(ty.block().1) {
            split_block(format, block, &mut data, &mut scales);
        }
    }
    Packed {
        format,
        rows,
        cols,
        kp: cols,
        data,
        scales,
    }
}

/// Dequantizes a packed matrix back to `[rows, cols]` f32 (what the kernels compute with).
pub fn unpack(p: &Packed) -> Vec<f32> {
    let mut out = Vec::with_capacity(p.rows * p.cols);
    if let Some(ty) = p.format.ggml() {
        let per_row = p.kp / ty.block().0;
        let mut row = Vec::with_capacity(p.kp);
        for r in 0..p.rows {
            row.clear();
            for b in 0..per_row {
                ty.dequantize(&join_block(p, r * per_row + b), &mut row);
            }
            out.extend_from_slice(&row[..p.cols]);
        }
        return out;
    }
    for r in 0..p.rows {
        for c in 0..p.cols {
            let i = r * p.kp + c;
            out.push(match p.format {
                WeightFormat::F32 => bytemuck::cast_slice::<u8, f32>(&p.data)[i],
                WeightFormat::F16 => bytemuck::cast_slice::<u8, f16>(&p.data)[i].to_f32(),
                WeightFormat::BF16 => bytemuck::cast_slice::<u8, bf16>(&p.data)[i].to_f32(),
                _ => unreachable!("block formats are dequantized above"),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_round_trip_is_close() {
        let vals: Vec<f32> = (0..3 * 70)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let p = pack(WeightFormat::Q8_0, &vals, 3, 70);
        assert_eq!(
            (p.kp, p.data.len(), p.scales.len()),
            (96, 3 * 96, 2 * 3 * 3)
        );
        let back = unpack(&p);
        for (a, b) in vals.iter().zip(&back) {
            assert!(
                (a - b).abs() <= 50.0 / 17.0 / 127.0 * 0.51 + 1e-3,
                "{a} vs {b}"
            );
        }
    }

    #[test]
    fn activation_quantization_uses_the_block_amax() {
        let mut x = [0f32; 32];
        x[3] = -5.08;
        x[7] = 2.54;
        let (q, d) = quantize_activation_block(&x);
        assert_eq!(d, 5.08 / 127.0);
        assert_eq!((q[3], q[7], q[0]), (-127, 64, 0));
        let (q, d) = quantize_activation_block(&[0.0; 32]);
        assert_eq!((q, d), ([0; 32], 0.0));
    }

    #[test]
    fn weights_are_checked_for_nonfinite_values_and_format_overflow() {
        let mut vals = vec![0.5f32; 2 * 40];
        let t = Tensor::from_f32("w", vec![2, 40], &vals);
        assert_eq!(finite_f32(&t).unwrap(), vals);
        vals[45] = f32::NEG_INFINITY;
        let e = finite_f32(&Tensor::from_f32("w", vec![2, 40], &vals))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "tensor `w`: holds a non-finite value (-inf) at element 45 (index [1, 5])"
            ),
            "{e}"
        );
        let h = [f16::ONE, f16::NAN];
        let e = map_finite(&Tensor::from_f16("h", vec![2], &h), f64::from)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("tensor `h`: holds a non-finite value (NaN) at element 1:"),
            "{e}"
        );
        vals[45] = 7e4;
        assert_eq!(
            pack_checked(WeightFormat::F16, &vals, 2, 40).err(),
            Some(45)
        );
        assert!(pack_checked(WeightFormat::Q8_0, &vals, 2, 40).is_ok());
        assert!(pack_checked(WeightFormat::F32, &vals, 2, 40).is_ok());
        vals[45] = -1e10;
        assert_eq!(
            pack_checked(WeightFormat::Q8_0, &vals, 2, 40).err(),
            Some(45)
        );
        let e = unfit("w", WeightFormat::Q8_0, vals[45], 1, 5, 40).to_string();
        assert!(e.contains("the q8_0 block of row 1 at columns 0…31"), "{e}");
    }
}
