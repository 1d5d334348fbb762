//! The prefill graph on the tensor-core kernels' paths, run on any device: a hybrid whose
//! every shape the cooperative kernels take (Mamba2 head dim 64 and state 128 for the chunk
//! state, attention head dim 32, MoE experts whose rows come in whole 16s, f16 and q8_0
//! weights) prefilled with `Caps::coop_emulated` — the cooperative GEMM (direct epilogue
//! into the prefill buffers, grouped and gathered expert tiles), C·Bᵀ, chunk state, chunk
//! scan (chunks of 64) and flash attention with the stand-ins of their cooperative ops — against the same model on the
//! FMA kernels. The cooperative paths round their operands to f16, so the two agree to f16
//! activation precision, not bit for bit.
//!
//! Two models, because a router's choice is a discontinuity: an f16-level difference in its
//! input can flip a near-tie between two experts, after which the paths rightly differ by
//! far more than rounding. Nemotron-H's `ME*E-M` did exactly that at one token of 150 once
//! the conv wrote u in f16 (every other token at NMSE ~5e-7, as before): so the Mamba2
//! layers are checked in a hybrid without experts (`M*-M`) at every token, and the experts
//! in one whose routers see only attention, MLP and embedding outputs (`*E-E`), where a
//! flipped choice stays at its own token: there at most `ROUTER_FLIPS` tokens of a block may
//! be off (q8_0 weights flipped two of 150, at NMSE 0.3 and 0.1), every other token and the
//! aggregate of those within the bound. A wrong tile, mask or expert row puts whole tiles
//! of tokens off.

mod common;

use mamba2_wgpu::config::ModelConfig;
use mamba2_wgpu::gpu::GpuBackend;
use mamba2_wgpu::gpu::engine::{Engine, EngineOptions, PrefillMode};
use mamba2_wgpu::gpu::state_store::KvFormat;
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::quant::WeightFormat;
use mamba2_wgpu::model::synthetic::tiny_moe;
use mamba2_wgpu::sampling::{Sampling, uniform};
use mamba2_wgpu::session::Backend;

/// Logits and states of the two paths: f16 inputs of every product (relative rounding
/// 2^-12, NMSE ~1e-8 per product) through six layers; a wrong tile, mask or row of experts
/// is off by NMSE 1e-2 and more.
const NMSE_TOL: f64 = 1e-5;

/// A Nemotron-H pattern (with or without MoE) in the cooperative kernels' shapes.
fn coop_config(pattern: &str) -> ModelConfig {
    let mut c = tiny_moe(pattern, false);
    c.n_groups = 2;
    c.n_heads = 8;
    c.head_dim = 64;
    c.d_inner = 512;
    c.d_model = 256;
    c.d_state = 128;
    if let Some(a) = c.attention.as_mut() {
        a.head_dim = 32;
        a.scale = 1.0 / 32f64.sqrt();
    }
    if let Some(m) = c.mlp.as_mut() {
        m.intermediate = 48;
    }
    if let Some(m) = c.moe.as_mut() {
        m.intermediate = 32;
        if let Some(s) = m.shared.as_mut() {
            s.intermediate = 48;
        }
    }
    c
}

fn backend(model: &Model, format: WeightFormat, emulated: bool) -> Option<GpuBackend> {
    let needs = Engine::needs(&model.config, format);
    let ctx = if emulated {
        common::gpu_coop_emulated(&needs)?
    } else {
        common::gpu(&needs)?
    };
    let opts = EngineOptions {
        format,
        fused: true,
        // (64: the smallest chunk the cooperative chunk scan takes.)
        chunk_size: Some(64),
        prefill: PrefillMode::Chunked,
        context: Some(512),
        kv: KvFormat::F16,
        expert_bank_bytes: None,
    };
    Some(GpuBackend::new(Engine::new(ctx, model, opts).unwrap()).unwrap())
}

#[test]
fn mamba2_attention_and_mlp_layers_on_the_cooperative_paths_match_the_fma_kernels() {
    compare_paths(
        "M*-M",
        0,
        &[
            "gemm_coop",
            "attention_prefill_coop",
            "ssd_chunk_state_coop",
            "ssd_chunk_scan_coop",
            "ssd_cb_coop",
        ],
    );
}

#[test]
fn expert_layers_on_the_cooperative_paths_match_the_fma_kernels() {
    compare_paths(
        "*E-E",
        ROUTER_FLIPS,
        &["gemm_coop", "attention_prefill_coop"],
    );
}

/// The short turn's last logits with q8_0 weights: through the decode head's q8 activations.
const Q8_HEAD_TOL: f64 = 1e-4;

/// Tokens of a block whose router may have chosen differently on the two paths.
const ROUTER_FLIPS: usize = 3;

/// Prefills two blocks of the `pattern` model on both paths (f16, q8_0 and block weights) and
/// compares logits (every token but at most `flips`, and the aggregate of those) and states,
/// then a short turn (the short-block graph) by its last logits and state; the cooperative
/// path must have built `kernels`.
fn compare_paths(pattern: &str, flips: usize, kernels: &[&str]) {
    let model = Model::synthetic(coop_config(pattern), 17);
    let vocab = model.config.vocab_size;
    // (The 4/5/6-bit block formats: dequantized to f16 on their way into the tiles; the
    // k-quants' 256-value blocks take the 256-wide matrices, the rest fall back to q8_0.)
    for format in [
        WeightFormat::F16,
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q4_K,
        WeightFormat::Q6_K,
    ] {
        let (Some(mut fma), Some(mut coop)) = (
            backend(&model, format, false),
            backend(&model, format, true),
        ) else {
            return;
        };
        if fma.engine.kernels.ctx.caps.coop_matrix {
            eprintln!("(this device has cooperative matrices: both paths run on them)");
        }
        // A first block, then one continuing from its state and cache.
        for (i, len) in [150usize, 37].into_iter().enumerate() {
            let toks: Vec<u32> = (0..len as u64)
                .map(|j| (uniform(i as u64 + 3, j) * vocab as f32) as u32)
                .collect();
            let want = fma.prefill_logits(&toks).unwrap();
            let got = coop.prefill_logits(&toks).unwrap();
            let per_token: Vec<f64> = got
                .iter()
                .zip(&want)
                .map(|(g, w)| common::nmse(g, w))
                .collect();
            let off: Vec<usize> = (0..len)
                .filter(|&t| per_token[t].is_nan() || per_token[t] > NMSE_TOL)
                .collect();
            assert!(
                off.len() <= flips,
                "{pattern} {format:?} block {i}: tokens {off:?} off (NMSE {:?})",
                off.iter().map(|&t| per_token[t]).collect::<Vec<_>>()
            );
            let kept = |v: &[Vec<f32>]| -> Vec<f32> {
                (0..len)
                    .filter(|t| !off.contains(t))
                    .flat_map(|t| v[t].iter().copied())
                    .collect()
            };
            let e = common::nmse(&kept(&got), &kept(&want));
            let s = common::nmse(
                &coop.state().unwrap().values(),
                &fma.state().unwrap().values(),
            );
            eprintln!(
                "{pattern} {format:?} block {i} ({len} tokens): logits NMSE {e:.2e} (tokens \
                 {off:?} off), state NMSE {s:.2e}"
            );
            assert!(
                e <= NMSE_TOL,
                "{pattern} {format:?} block {i}: logits NMSE {e:e}"
            );
            assert!(
                s <= NMSE_TOL,
                "{pattern} {format:?} block {i}: state NMSE {s:e}"
            );
        }
        // A short turn (one short block: the projections split over K, on the cooperative
        // GEMM's split path there), compared at its last token and in the state.
        let toks: Vec<u32> = (0..23u64)
            .map(|j| (uniform(9, j) * vocab as f32) as u32)
            .collect();
        let greedy = Sampling::greedy();
        let pos = 150 + 37 + toks.len() as u64;
        fma.prefill_sample(&toks, &greedy, pos).unwrap();
        coop.prefill_sample(&toks, &greedy, pos).unwrap();
        let e = common::nmse(
            &coop.engine.read_logits().unwrap(),
            &fma.engine.read_logits().unwrap(),
        );
        let s = common::nmse(
            &coop.state().unwrap().values(),
            &fma.state().unwrap().values(),
        );
        eprintln!("{pattern} {format:?} short turn: last logits NMSE {e:.2e}, state NMSE {s:.2e}");
        // (The last token's logits come from the decode head on both paths, which with q8_0
        // weights multiplies q8-quantized activations: an f16-level difference in the
        // residual can move an activation by one q8 step — 1.5e-5 seen here while the state
        // the short block wrote agreed at 3e-7.)
        let tol = if format.reads_q8() {
            Q8_HEAD_TOL
        } else {
            NMSE_TOL
        };
        assert!(
            e <= tol,
            "{pattern} {format:?} short turn: logits NMSE {e:e}"
        );
        assert!(
            s <= NMSE_TOL,
            "{pattern} {format:?} short turn: state NMSE {s:e}"
        );
        // The cooperative kernels did the work.
        let built = coop.engine.kernels.built();
        for name in kernels {
            assert!(
                built.iter().any(|b| b == name),
                "{format:?}: {name} never built ({built:?})"
            );
        }
    }
}
