//! Matrices on the device in their storage format (see `model::quant` for the layouts).

use crate::error::Result;
use crate::gpu::context::GpuContext;
use crate::model::quant::{Packed, WeightFormat};

/// A `[rows, cols]` matrix resident on the device.
pub struct DeviceMatrix {
    pub name: String,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    /// Columns each row is padded to.
    pub kp: usize,
    pub data: wgpu::Buffer,
    /// The block scales of the quantized formats (`model::quant` has their layouts).
    pub scales: Option<wgpu::Buffer>,
    /// What every product with this matrix is multiplied by before it is stored or added
    /// (the kernels' RS): Granite's residual multiplier on the projections that end a
    /// block, kept out of the values so that a GGUF's blocks go up as stored; 1 elsewhere.
    pub out_scale: f32,
}

impl DeviceMatrix {
    pub fn upload(ctx: &GpuContext, name: &str, p: &Packed) -> Result<Self> {
        let data = ctx.storage_with(name, &p.data)?;
        let scales = match p.format.reads_q8() {
            true => Some(ctx.storage_with(&format!("{name}.scales"), &p.scales)?),
            false => None,
        };
        Ok(DeviceMatrix {
            name: name.to_string(),
            format: p.format,
            rows: p.rows,
            cols: p.cols,
            kp: p.kp,
            data,
            scales,
            out_scale: 1.0,
        })
    }

    /// The matrix with its products multiplied by `s` (`out_scale`).
    pub fn scaled(self, s: f32) -> Self {
        DeviceMatrix {
            out_scale: s,
            ..self
        }
    }

    /// Device bytes (data + scales).
    pub fn bytes(&self) -> u64 {
        self.data.size() + self.scales.as_ref().map_or(0, |s| s.size())
    }

    /// The WGSL flags selecting this matrix's format (`format_flags`).
    pub fn flags(&self) -> Vec<&'static str> {
        format_flags(self.format)
    }

    /// The WGSL flag selecting this format.
    pub fn flag(&self) -> &'static str {
        format_flag(self.format)
    }

    /// `(binding, buffer)` pairs of the weight bindings 0 (data) and 1 (scales).
    pub fn bindings(&self) -> Vec<(u32, &wgpu::Buffer)> {
        let mut v = vec![(0, &self.data)];
        if let Some(s) = &self.scales {
            v.push((1, s));
        }
        v
    }
}

/// The WGSL flags selecting weights of `format`: its own, and the families
/// `block_quant.wgsl` serves: `W_HALF` (f16, bf16: `half2`), `W_BLOCK` for the 4/5/6-bit
/// block formats (`bq_weights8`), and among them `W_Q5` for q5_0 and q5_1 (fifth bits and
/// scales in one vec2) and `W_K4` for q4_k and q5_k (one scale layout).
pub fn format_flags(format: WeightFormat) -> Vec<&'static str> {
    let mut f = vec![format_flag(format)];
    match format {
        WeightFormat::F16 | WeightFormat::BF16 => f.push("W_HALF"),
        WeightFormat::Q4_K | WeightFormat::Q5_K => f.extend(["W_BLOCK", "W_K4"]),
        WeightFormat::Q5_0 | WeightFormat::Q5_1 => f.extend(["W_BLOCK", "W_Q5"]),
        WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q6_K => f.push("W_BLOCK"),
        WeightFormat::F32 | WeightFormat::Q8_0 => {}
    }
    f
}

/// The WGSL flag selecting weights of `format`.
pub fn format_flag(format: WeightFormat) -> &'static str {
    match format {
        WeightFormat::F32 => "W_F32",
        WeightFormat::F16 => "W_F16",
        WeightFormat::BF16 => "W_BF16",
        WeightFormat::Q8_0 => "W_Q8",
        WeightFormat::Q4_0 => "W_Q4_0",
        WeightFormat::Q4_1 => "W_Q4_1",
        WeightFormat::Q5_0 => "W_Q5_0",
        WeightFormat::Q5_1 => "W_Q5_1",
        WeightFormat::Q4_K => "W_Q4_K",
        WeightFormat::Q5_K => "W_Q5_K",
        WeightFormat::Q6_K => "W_Q6_K",
    }
}
