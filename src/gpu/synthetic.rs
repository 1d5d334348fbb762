//! Random weights made directly on the device at a config's real shapes (benchmarks):
//! a 7B model is filled in seconds, where generating and uploading it from the host
//! would take minutes. Speed does not depend on the values; the scales keep activations
//! finite anyway.

use std::sync::Arc;

use crate::config::{BlockKind, MlpAct, ModelConfig};
use crate::error::Result;
use crate::gpu::context::GpuContext;
use crate::gpu::device_weights::{
    DeviceLayer, DeviceMixer, DeviceMoe, DeviceWeights, ParamLayout, experts_per_bank,
};
use crate::gpu::engine::{Engine, EngineOptions};
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
    let format = format.for_cols(cols);
    let kp = format.padded_cols(cols);
    let bytes = format.data_bytes(rows, cols) as u64;
    let data = ctx.storage_zeroed(name, bytes)?;
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    let words = bytes / 4;
    let mode = match format {
        WeightFormat::F32 => FillMode::F32 {
            lo: -scale,
            hi: scale,
        },
        // bf16 words filled with f16 bits of values in ±scale (≤ 1) read as bf16 values
        // of at most 2^-7: finite, which is all speed needs.
        WeightFormat::F16 | WeightFormat::BF16 => FillMode::F16x2 {
            lo: -scale,
            hi: scale,
        },
        // Random quants: every bit pattern is a valid block.
        _ => FillMode::I8x4,
    };
    fill(k, &mut enc, &data, words, seed, mode)?;
    let scales = if format.reads_q8() {
        // Every f16 field of the block scales set to one step (q6_k's i8 sub-block scales
        // then hold bytes of it too: finite, which is all speed needs; q5_0's scales are
        // `qh, d` word pairs). The k-quants with mins (q4_k, q5_k) get sub-block scales
        // and mins of 32 and dmin = d·(levels−1)/2,
        // so their random levels sit around zero as trained weights do: with the bytes of
        // d as scales and mins, every weight carried a large common offset, and Granite's
        // prefill overflowed the f16 inputs of its tensor-core SSD kernels.
        let n = (format.bytes(rows, cols) - format.data_bytes(rows, cols)) as u64;
        let buf = ctx.storage_zeroed(&format!("{name}.scales"), n)?;
        let step = match format {
            WeightFormat::Q8_0 => 127.0,
            WeightFormat::Q6_K => 32.0 * 64.0,
            WeightFormat::Q4_K => 32.0 * 8.0,
            WeightFormat::Q5_K => 32.0 * 16.0,
            _ => 8.0 * 16.0,
        };
        let half = |v: f32| half::f16::from_f32(v).to_bits() as u32;
        let d = half(scale / step);
        let mode = match format {
            WeightFormat::Q4_K | WeightFormat::Q5_K => {
                let levels = if format == WeightFormat::Q4_K {
                    16.0
                } else {
                    32.0
                };
                let dmin = half(scale / step * (levels - 1.0) / 2.0);
                // Scales and mins 0…3: low 6 bits of bytes 0…3 and 4…7 (32 = 0x20); 4…7:
                // their low nibbles in bytes 8…11 (0) and top bits from bytes 0…7 (bit 7).
                FillMode::Pattern([d | (dmin << 16), 0xA0A0_A0A0, 0xA0A0_A0A0, 0])
            }
            // q5_0: each block's fifth bits (qh) alternate along the row, so the levels
            // sit around zero there too (qh with d's bits gave every column one offset).
            WeightFormat::Q5_0 => FillMode::Pattern([0x5555_5555, d, 0x5555_5555, d]),
            // q4_1 and q5_1 (d·q + m): m = −d·(levels−1)/2 centres the levels on zero.
            WeightFormat::Q4_1 => FillMode::Word(d | (half(-scale / step * 7.5) << 16)),
            WeightFormat::Q5_1 => {
                let dm = d | (half(-scale / step * 15.5) << 16);
                FillMode::Pattern([0x5555_5555, dm, 0x5555_5555, dm])
            }
            _ => FillMode::Word(d | (d << 16)),
        };
        fill(k, &mut enc, &buf, n.div_ceil(4), 0, mode)?;
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
        out_scale: 1.0,
    })
}

impl Engine {
    /// An engine over random weights at `config`'s shapes, in `opts.format`.
    pub fn synthetic(
        ctx: Arc<GpuContext>,
        config: &ModelConfig,
        opts: EngineOptions,
        seed: u64,
    ) -> Result<Self> {
        let c = config;
        let format = opts.format;
        let k = Kernels::new(ctx.clone());
        let s = |i: u64| (seed as u32).wrapping_mul(7919).wrapping_add(i as u32);
        let in_scale = (3.0 / c.d_model as f32).sqrt();
        let out_scale = |k: usize| (3.0 / k as f32).sqrt() * 0.5;
        let mat = |name: &str, rows, cols, scale, i| {
            random_matrix(&k, name, rows, cols, format, scale, s(i))
        };
        let embedding = mat("embedding", c.vocab_size, c.d_model, 1.0, 0)?;
        let lm_head = if c.tie_embeddings {
            None
        } else {
            Some(mat("lm_head", c.vocab_size, c.d_model, in_scale * 2.0, 1)?)
        };
        let layout = ParamLayout::new(c);
        let mut layers = Vec::with_capacity(c.n_layer);
        for (i, &kind) in c.blocks.iter().enumerate() {
            let n = |what: &str| format!("layers.{i}.{what}");
            let (a, b) = (10 + 2 * i as u64, 11 + 2 * i as u64);
            let u = |j: usize, lo: f32, hi: f32| {
                lo + (hi - lo) * uniform(seed ^ ((i as u64) << 20), j as u64)
            };
            let (mixer, params) = match kind {
                BlockKind::Mamba2 => {
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
                    let m = DeviceMixer::Mamba2 {
                        in_proj: mat(&n("in_proj"), c.d_in_proj(), c.d_model, in_scale, a)?,
                        out_proj: mat(
                            &n("out_proj"),
                            c.d_model,
                            c.d_inner,
                            out_scale(c.d_inner),
                            b,
                        )?,
                    };
                    (m, v)
                }
                BlockKind::Attention => {
                    let at = c.attention.as_ref().expect("attention layers have a shape");
                    let m = DeviceMixer::Attention {
                        qkv: vec![mat(&n("qkv_proj"), at.qkv_rows(), c.d_model, in_scale, a)?],
                        o: mat(
                            &n("o_proj"),
                            c.d_model,
                            at.q_width(),
                            out_scale(at.q_width()),
                            b,
                        )?,
                    };
                    (m, (0..c.d_model).map(|j| u(j, 0.6, 1.4)).collect())
                }
                BlockKind::Mlp => {
                    let ml = c.mlp.as_ref().expect("MLP layers have a shape");
                    let ups = if ml.act == MlpAct::SiluGated { 2 } else { 1 };
                    let m = DeviceMixer::Mlp {
                        up: vec![mat(
                            &n("up_proj"),
                            ups * ml.intermediate,
                            c.d_model,
                            in_scale,
                            a,
                        )?],
                        down: mat(
                            &n("down_proj"),
                            c.d_model,
                            ml.intermediate,
                            out_scale(ml.intermediate),
                            b,
                        )?,
                        bias: None,
                    };
                    (m, (0..c.d_model).map(|j| u(j, 0.6, 1.4)).collect())
                }
                BlockKind::Moe => {
                    let mo = c.moe.as_ref().expect("MoE layers have a shape");
                    let bank_bytes = opts
                        .expert_bank_bytes
                        .unwrap_or(u64::MAX)
                        .min(ctx.limits.max_storage_buffer_binding_size);
                    let per_bank = experts_per_bank(c, format, bank_bytes);
                    let (mut up, mut down) = (Vec::new(), Vec::new());
                    let stored = mo.stored_experts();
                    let firsts: Vec<usize> = (0..stored).step_by(per_bank).collect();
                    let x = mo.expert_width(c.d_model);
                    let ef = crate::gpu::device_weights::expert_format(format);
                    for (bank, &first) in firsts.iter().enumerate() {
                        let n_e = per_bank.min(stored - first);
                        let seed = 1000 * (i as u64 + 1) + 2 * bank as u64;
                        up.push(vec![random_matrix(
                            &k,
                            &n(&format!("experts.up.bank{bank}")),
                            n_e * mo.up_rows(),
                            x,
                            ef,
                            in_scale,
                            s(seed),
                        )?]);
                        down.push(random_matrix(
                            &k,
                            &n(&format!("experts.down.bank{bank}")),
                            n_e * x,
                            mo.intermediate,
                            ef,
                            out_scale(mo.intermediate),
                            s(seed + 1),
                        )?);
                    }
                    let shared = match &mo.shared {
                        Some(sh) if mo.shared_slots() == 0 => {
                            let ups = if sh.act == MlpAct::SiluGated { 2 } else { 1 };
                            Some((
                                vec![mat(
                                    &n("shared.up"),
                                    ups * sh.intermediate,
                                    c.d_model,
                                    in_scale,
                                    a,
                                )?],
                                mat(
                                    &n("shared.down"),
                                    c.d_model,
                                    sh.intermediate,
                                    out_scale(sh.intermediate),
                                    b,
                                )?,
                            ))
                        }
                        _ => None,
                    };
                    // Latent projections in f16 under q8_0, as on load.
                    let latent_format = crate::gpu::device_weights::latent_format(format);
                    let latent = match mo.latent {
                        Some(lw) => Some((
                            random_matrix(
                                &k,
                                &n("fc1_latent_proj"),
                                lw,
                                c.d_model,
                                latent_format,
                                in_scale,
                                s(700 + i as u64),
                            )?,
                            random_matrix(
                                &k,
                                &n("fc2_latent_proj"),
                                c.d_model,
                                lw,
                                latent_format,
                                out_scale(lw),
                                s(800 + i as u64),
                            )?,
                        )),
                        None => None,
                    };
                    // The router stays f32, as on load; logits of order one.
                    let router = random_matrix(
                        &k,
                        &n("router"),
                        mo.experts,
                        c.d_model,
                        WeightFormat::F32,
                        in_scale * 2.0,
                        s(900 + i as u64),
                    )?;
                    let mut params: Vec<f32> = (0..c.d_model).map(|j| u(j, 0.6, 1.4)).collect();
                    let bias_off = mo.has_correction_bias().then(|| {
                        let off = params.len();
                        params.extend((0..mo.experts).map(|j| u(c.d_model + j, -0.05, 0.05)));
                        off
                    });
                    let m = DeviceMixer::Moe(Box::new(DeviceMoe {
                        router,
                        up,
                        down,
                        firsts,
                        shared,
                        bias_off,
                        d_model: x,
                        latent,
                    }));
                    (m, params)
                }
            };
            layers.push(DeviceLayer {
                kind,
                params: ctx.storage_with(&n("params"), bytemuck::cast_slice(&params))?,
                // (Granite's residual multiplier, as on load: the same kernels run.)
                mixer: mixer.with_block_ends_scaled(c.scales.residual as f32),
            });
            if i % 8 == 7 {
                ctx.wait()?;
            }
        }
        let final_norm: Vec<f32> = (0..c.d_model)
            .map(|j| 0.6 + 0.8 * uniform(seed, (1 << 40) + j as u64))
            .collect();
        let weights = DeviceWeights {
            embedding,
            lm_head,
            layers,
            final_params: ctx.storage_with("final_norm", bytemuck::cast_slice(&final_norm))?,
        };
        Self::assemble(ctx, c, weights, opts)
    }
}
