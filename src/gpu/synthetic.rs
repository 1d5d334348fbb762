//! Random weights made directly on the device at a config's real shapes (benchmarks):
//! a 7B model is filled in seconds, where generating and uploading it from the host
//! would take minutes. Speed does not depend on the values; the scales keep activations
//! finite anyway.

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::gpu::context::GpuContext;
use crate::gpu::engine::{Engine, LayerParams, ParamLayout};
use crate::gpu::kernels::Kernels;
use crate::gpu::kernels::fill::{FillMode, fill};
use crate::gpu::weights::DeviceMatrix;
use crate::model::quant::WeightFormat;
use crate::sampling::uniform;

fn random_matrix(
    k: &Kernels,
    name: &str,
    rows: usize,
    cols: usize,
    format: WeightFormat,
    scale: f32,
    seed: u32,
) -> Result<DeviceMatrix> {
    let ctx = &k.ctx;
    let kp = format.padded_cols(cols);
    let bytes = match format {
        WeightFormat::Q8_0 => rows * kp,
        _ => format.bytes(rows, cols),
    } as u64;
    let data = ctx.storage_zeroed(name, bytes)?;
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    let words = bytes / 4;
    let mode = match format {
        WeightFormat::F32 => FillMode::F32 {
            lo: -scale,
            hi: scale,
        },
        WeightFormat::F16 => FillMode::F16x2 {
            lo: -scale,
            hi: scale,
        },
        WeightFormat::Q8_0 => FillMode::I8x4,
    };
    fill(k, &mut enc, &data, words, seed, mode)?;
    let scales = if format == WeightFormat::Q8_0 {
        let n = rows * kp / 32;
        let buf = ctx.storage_zeroed(&format!("{name}.scales"), (2 * n) as u64)?;
        let d = half::f16::from_f32(scale / 127.0).to_bits() as u32;
        fill(
            k,
            &mut enc,
            &buf,
            (n as u64).div_ceil(2),
            0,
            FillMode::Word(d | (d << 16)),
        )?;
        Some(buf)
    } else {
        None
    };
    ctx.queue.submit([enc.finish()]);
    Ok(DeviceMatrix {
        name: name.to_string(),
        format,
        rows,
        cols,
        kp,
        data,
        scales,
    })
}

impl Engine {
    /// An engine over random weights at `config`'s shapes, in `format`.
    pub fn synthetic(
        ctx: Arc<GpuContext>,
        config: &ModelConfig,
        format: WeightFormat,
        fused: bool,
        seed: u64,
    ) -> Result<Self> {
        let c = config;
        let k = Kernels::new(ctx.clone());
        let s = |i: u64| (seed as u32).wrapping_mul(7919).wrapping_add(i as u32);
        let in_scale = (3.0 / c.d_model as f32).sqrt();
        let out_scale = (3.0 / c.d_inner as f32).sqrt() * 0.5;
        let embedding = random_matrix(&k, "embedding", c.vocab_size, c.d_model, format, 1.0, s(0))?;
        let lm_head = if c.tie_embeddings {
            None
        } else {
            Some(random_matrix(
                &k,
                "lm_head",
                c.vocab_size,
                c.d_model,
                format,
                in_scale * 2.0,
                s(1),
            )?)
        };
        let layout = ParamLayout::new(c);
        let mut mats = Vec::with_capacity(c.n_layer);
        let mut params = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer as u64 {
            mats.push((
                random_matrix(
                    &k,
                    &format!("layers.{i}.in_proj"),
                    c.d_in_proj(),
                    c.d_model,
                    format,
                    in_scale,
                    s(10 + 2 * i),
                )?,
                random_matrix(
                    &k,
                    &format!("layers.{i}.out_proj"),
                    c.d_model,
                    c.d_inner,
                    format,
                    out_scale,
                    s(11 + 2 * i),
                )?,
            ));
            let u =
                |j: usize, lo: f32, hi: f32| lo + (hi - lo) * uniform(seed ^ (i << 20), j as u64);
            let mut v = vec![0f32; layout.len];
            for (j, x) in v.iter_mut().enumerate() {
                *x = if j < layout.conv_b {
                    u(j, -0.6, 0.6)
                } else if j < layout.dt_bias {
                    u(j, -0.2, 0.2)
                } else if j < layout.a {
                    u(j, -4.0, -1.0)
                } else if j < layout.d {
                    -u(j, 1.0, 12.0)
                } else if j < layout.norm {
                    u(j, 0.5, 1.5)
                } else {
                    u(j, 0.6, 1.4)
                };
            }
            params.push(LayerParams { values: v });
            if i % 8 == 7 {
                ctx.wait()?;
            }
        }
        let final_norm: Vec<f32> = (0..c.d_model)
            .map(|j| 0.6 + 0.8 * uniform(seed, (1 << 40) + j as u64))
            .collect();
        Self::assemble(
            ctx,
            c,
            format,
            fused,
            embedding,
            lm_head,
            mats,
            params,
            &final_norm,
        )
    }
}
