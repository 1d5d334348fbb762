//! Hybrid models (Mamba2 + attention + MLP blocks) on the GPU (lavapipe in CI) against the
//! CPU reference: decode token by token, chunked prefill at several chunk lengths and over
//! several blocks, fused == unfused, f32 and f16 KV caches, the state read back (KV rows
//! included), snapshots in the middle of a sequence, and a full context refused.

mod common;

use mamba2_wgpu::gpu::GpuBackend;
use mamba2_wgpu::gpu::engine::{Engine, EngineOptions, PrefillMode};
use mamba2_wgpu::gpu::state_store::KvFormat;
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::quant::WeightFormat;
use mamba2_wgpu::model::synthetic::tiny_hybrid;
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};
use mamba2_wgpu::sampling::uniform;
use mamba2_wgpu::session::Backend;
use mamba2_wgpu::{CpuBackend, GenerateOptions, Session};

/// GQA (2 kv heads of 4) and MQA (1), every block kind, Mamba G = 2.
const MODELS: [(&str, usize); 2] = [("M*-M*-", 2), ("*M-*M", 1)];

struct Gpu {
    format: WeightFormat,
    fused: bool,
    prefill: PrefillMode,
    chunk: usize,
    kv: KvFormat,
    ctx: usize,
}

impl Default for Gpu {
    fn default() -> Self {
        Gpu {
            format: WeightFormat::F32,
            fused: true,
            prefill: PrefillMode::Chunked,
            chunk: 16,
            kv: KvFormat::F32,
            ctx: 1024,
        }
    }
}

fn backend(model: &Model, g: Gpu) -> Option<GpuBackend> {
    let ctx = common::gpu(&Engine::needs(&model.config, g.format))?;
    let opts = EngineOptions {
        format: g.format,
        fused: g.fused,
        chunk_size: Some(g.chunk),
        prefill: g.prefill,
        context: Some(g.ctx),
        kv: g.kv,
        expert_bank_bytes: None,
    };
    Some(GpuBackend::new(Engine::new(ctx, model, opts).unwrap()).unwrap())
}

fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (uniform(seed, i) * vocab as f32) as u32)
        .collect()
}

#[test]
fn decode_and_prefill_match_the_cpu_reference() {
    for (pattern, kv) in MODELS {
        let model = Model::synthetic(tiny_hybrid(pattern, kv), 21);
        let vocab = model.config.vocab_size;
        let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
        let toks = tokens(150, 3, vocab);
        let mut cpu_state = cpu.new_state();
        let want = cpu
            .forward(&mut cpu_state, &toks, Scan::Sequential, Logits::All)
            .unwrap();
        for fused in [true, false] {
            for prefill in [PrefillMode::Decode, PrefillMode::Chunked] {
                let Some(mut gpu) = backend(
                    &model,
                    Gpu {
                        fused,
                        prefill,
                        ..Default::default()
                    },
                ) else {
                    return;
                };
                let got = gpu.prefill_logits(&toks).unwrap();
                let e = common::nmse(&got.concat(), &want.concat());
                assert!(
                    e <= 1e-8,
                    "{pattern} fused={fused} {prefill:?}: logits NMSE {e:e}"
                );
                let st = gpu.state().unwrap();
                assert_eq!(st.len, toks.len());
                let e = common::nmse(&st.values(), &cpu_state.values());
                assert!(e <= 1e-8, "{pattern} {prefill:?}: state NMSE {e:e}");
            }
        }
    }
}

#[test]
fn chunked_prefill_equals_decode_from_any_position() {
    for (pattern, kv) in MODELS {
        let model = Model::synthetic(tiny_hybrid(pattern, kv), 5);
        let vocab = model.config.vocab_size;
        let dec = backend(
            &model,
            Gpu {
                prefill: PrefillMode::Decode,
                ..Default::default()
            },
        );
        let (Some(mut dec), Some(mut chk)) = (dec, backend(&model, Gpu::default())) else {
            return;
        };
        let warm = tokens(19, 5, vocab);
        for q in [8usize, 16, 64] {
            chk.engine.chunk = q;
            // 300 tokens span several prefill blocks when Q = 8 (256-token blocks).
            for len in [1, q + 3, 300] {
                let toks = tokens(len, (q * 7 + len) as u64, vocab);
                for b in [&mut dec, &mut chk] {
                    b.reset().unwrap();
                    b.prefill_logits(&warm).unwrap();
                }
                let want = dec.prefill_logits(&toks).unwrap();
                let got = chk.prefill_logits(&toks).unwrap();
                let e = common::nmse(&got.concat(), &want.concat());
                assert!(e <= 1e-8, "{pattern} Q={q} L={len}: logits NMSE {e:e}");
                let e = common::nmse(
                    &chk.state().unwrap().values(),
                    &dec.state().unwrap().values(),
                );
                assert!(e <= 1e-8, "{pattern} Q={q} L={len}: state NMSE {e:e}");
            }
        }
    }
}

#[test]
fn greedy_text_equals_the_cpu_and_snapshots_restore_mid_sequence() {
    let model = Model::synthetic(tiny_hybrid("M*-M*-", 2), 8);
    let vocab = model.config.vocab_size;
    let greedy = |n| GenerateOptions {
        max_new_tokens: n,
        ..Default::default()
    };
    let (a, b) = (tokens(40, 1, vocab), tokens(23, 2, vocab));
    let mut cpu = Session::new(Box::new(CpuBackend::new(
        CpuModel::<f32>::new(&model.config, &model.weights).unwrap(),
    )));
    let Some(be) = backend(&model, Gpu::default()) else {
        return;
    };
    let mut gpu = Session::new(Box::new(be));
    // Two turns: state and KV carried, only the new tokens fed.
    for turn in [&a, &b] {
        let (c, _) = cpu.generate(turn, &greedy(12), |_| true).unwrap();
        let (g, _) = gpu.generate(turn, &greedy(12), |_| true).unwrap();
        assert_eq!(g, c, "greedy ids of a turn");
    }
    // Snapshot mid-sequence, go on, restore, go on again: the same tokens.
    let snap = gpu.snapshot().unwrap();
    let (x1, _) = gpu.generate(&a[..7], &greedy(9), |_| true).unwrap();
    gpu.restore(&snap).unwrap();
    let (x2, _) = gpu.generate(&a[..7], &greedy(9), |_| true).unwrap();
    assert_eq!(
        x1, x2,
        "a restored snapshot continues exactly as the original"
    );
    let (c, _) = cpu.generate(&a[..7], &greedy(9), |_| true).unwrap();
    assert_eq!(x1, c, "and as the CPU does");
}

#[test]
fn f16_kv_cache_and_q8_weights_stay_close() {
    let model = Model::synthetic(tiny_hybrid("M*-M*-", 2), 13);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let toks = tokens(90, 4, model.config.vocab_size);
    let want = cpu
        .forward(&mut cpu.new_state(), &toks, Scan::Chunked(16), Logits::All)
        .unwrap();
    for (format, kv, tol) in [
        (WeightFormat::F32, KvFormat::F16, 1e-5),
        (WeightFormat::F16, KvFormat::F16, 1e-4),
        (WeightFormat::Q8_0, KvFormat::F16, 2e-3),
    ] {
        let Some(mut gpu) = backend(
            &model,
            Gpu {
                format,
                kv,
                ..Default::default()
            },
        ) else {
            return;
        };
        let got = gpu.prefill_logits(&toks).unwrap();
        let e = common::nmse(&got.concat(), &want.concat());
        assert!(e <= tol, "{format:?} weights, {kv:?} KV: logits NMSE {e:e}");
    }
}

#[test]
fn a_full_context_is_an_error_not_a_wrap() {
    let model = Model::synthetic(tiny_hybrid("M*-", 2), 2);
    let Some(mut gpu) = backend(
        &model,
        Gpu {
            ctx: 32,
            ..Default::default()
        },
    ) else {
        return;
    };
    let toks = tokens(30, 1, model.config.vocab_size);
    gpu.prefill_logits(&toks).unwrap();
    let err = gpu.prefill_logits(&toks[..3]).unwrap_err().to_string();
    assert!(
        err.contains("the context is full: 30 tokens so far + 3 new exceed the 32-token KV cache"),
        "{err}"
    );
    // Decode stops at the end of the cache instead of wrapping.
    let mut n = 0;
    gpu.decode(toks[0], 31, 10, &Default::default(), &[], &mut |_| {
        n += 1;
        true
    })
    .unwrap();
    assert_eq!(n, 2, "two free rows: two tokens fed");
    assert_eq!(gpu.engine.len, 32);
    let err = gpu
        .decode(toks[0], 33, 10, &Default::default(), &[], &mut |_| true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("the context is full"), "{err}");
}

#[test]
fn gated_mlps_with_biases_match_the_cpu() {
    // The gated form `down(silu(gate(x))·up(x))` (Granite and other families) with up,
    // gate and down biases: the GPU's fused [gate; up] projection and activation kernel
    // against the CPU reference, in decode and in chunked prefill.
    let mut config = tiny_hybrid("M-*-", 2);
    if let Some(m) = config.mlp.as_mut() {
        m.act = mamba2_wgpu::config::MlpAct::SiluGated;
        m.bias = true;
    }
    let model = Model::synthetic(config, 31);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let toks = tokens(70, 6, model.config.vocab_size);
    let want = cpu
        .forward(&mut cpu.new_state(), &toks, Scan::Sequential, Logits::All)
        .unwrap();
    for (prefill, format, tol) in [
        (PrefillMode::Decode, WeightFormat::F32, 1e-8),
        (PrefillMode::Chunked, WeightFormat::F32, 1e-8),
        (PrefillMode::Decode, WeightFormat::Q8_0, 2e-3),
    ] {
        let Some(mut gpu) = backend(
            &model,
            Gpu {
                prefill,
                format,
                ..Default::default()
            },
        ) else {
            return;
        };
        let got = gpu.prefill_logits(&toks).unwrap();
        let e = common::nmse(&got.concat(), &want.concat());
        assert!(e <= tol, "{prefill:?} {format:?}: logits NMSE {e:e}");
    }
}

#[test]
fn a_reply_that_fills_the_context_says_so() {
    let model = Model::synthetic(tiny_hybrid("M*-", 2), 2);
    let prompt = tokens(28, 1, model.config.vocab_size);
    let opts = GenerateOptions {
        max_new_tokens: 10,
        ..Default::default()
    };
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights)
        .unwrap()
        .with_context(32);
    let mut sessions = vec![Session::new(Box::new(CpuBackend::new(cpu)))];
    if let Some(gpu) = backend(
        &model,
        Gpu {
            ctx: 32,
            ..Default::default()
        },
    ) {
        sessions.push(Session::new(Box::new(gpu)));
    }
    let mut replies = Vec::new();
    for s in &mut sessions {
        // 28 prompt tokens + 4 fed replies fill the 32 rows; the fifth token is sampled
        // from the last row, and there the reply ends, saying why.
        let (ids, finish) = s.generate(&prompt, &opts, |_| true).unwrap();
        assert_eq!(finish, mamba2_wgpu::session::Finish::ContextFull);
        assert_eq!(ids.len(), 5, "{}", s.describe());
        replies.push(ids);
    }
    replies.dedup();
    assert_eq!(replies.len(), 1, "the CPU and the GPU give the same reply");
}
