//! `fill.wgsl`: random (or constant) words written straight into a device buffer, so the
//! benchmark can build a 7B model at its real shapes in seconds.

use super::{Kernels, grid};
use crate::error::Result;

const SOURCES: super::Sources = &[include_str!("../../../shaders/fill.wgsl")];

/// What each 32-bit word receives.
#[derive(Clone, Copy, Debug)]
pub enum FillMode {
    F32 {
        lo: f32,
        hi: f32,
    },
    F16x2 {
        lo: f32,
        hi: f32,
    },
    I8x4,
    Word(u32),
    /// Four words repeated (word `i` gets `pattern[i % 4]`): a 16-byte field per block.
    Pattern([u32; 4]),
}

/// Records a fill of the first `words` words of `buffer` into `encoder`.
pub fn fill(
    k: &Kernels,
    encoder: &mut wgpu::CommandEncoder,
    buffer: &wgpu::Buffer,
    words: u64,
    seed: u32,
    mode: FillMode,
) -> Result<()> {
    let (m, word, lo, hi, pattern) = match mode {
        FillMode::F32 { lo, hi } => (0u32, 0u32, lo, hi, [0; 4]),
        FillMode::F16x2 { lo, hi } => (1, 0, lo, hi, [0; 4]),
        FillMode::I8x4 => (2, 0, 0.0, 0.0, [0; 4]),
        FillMode::Word(w) => (3, w, 0.0, 0.0, [0; 4]),
        FillMode::Pattern(p) => (4, 0, 0.0, 0.0, p),
    };
    let params: [u32; 12] = [
        words as u32,
        seed,
        m,
        word,
        lo.to_bits(),
        hi.to_bits(),
        0,
        0,
        pattern[0],
        pattern[1],
        pattern[2],
        pattern[3],
    ];
    let uniform = k.ctx.buffer(
        "fill params",
        48,
        wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
    )?;
    k.ctx
        .queue
        .write_buffer(&uniform, 0, bytemuck::cast_slice(&params));
    let pipeline = k.pipeline("fill", SOURCES, &[], &[], false)?;
    let bind_group = k.ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("fill"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: buffer.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: uniform.as_entire_binding(),
            },
        ],
    });
    let (x, y, z) = grid((words as u32).div_ceil(256));
    let mut pass = encoder.begin_compute_pass(&Default::default());
    pass.set_pipeline(&pipeline);
    pass.set_bind_group(0, &bind_group, &[]);
    pass.dispatch_workgroups(x, y, z);
    Ok(())
}
