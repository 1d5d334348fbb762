//! Chunked prefill on the GPU (lavapipe in CI) against the decode graph fed token by token
//! and against the CPU reference; sessions carrying state across turns; snapshots;
//! perplexity against the oracle's logits.

mod common;

use mamba2_wgpu::gpu::GpuBackend;
use mamba2_wgpu::gpu::engine::{Engine, EngineOptions, PrefillMode};
use mamba2_wgpu::gpu::state_store::KvFormat;
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::quant::WeightFormat;
use mamba2_wgpu::model::synthetic::tiny_config;
use mamba2_wgpu::perplexity::perplexity;
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};
use mamba2_wgpu::sampling::uniform;
use mamba2_wgpu::session::Backend;
use mamba2_wgpu::{GenerateOptions, Sampling, Session};

fn backend(model: &Model, prefill: PrefillMode, chunk: usize) -> Option<GpuBackend> {
    let ctx = common::gpu(&Engine::needs(&model.config, WeightFormat::F32))?;
    let opts = EngineOptions {
        format: WeightFormat::F32,
        fused: true,
        chunk_size: Some(chunk),
        prefill,
        // The f32 oracle to 1e-5: hybrids keep K and V in f32 too.
        kv: KvFormat::F32,
        ..Default::default()
    };
    Some(GpuBackend::new(Engine::new(ctx, model, opts).unwrap()).unwrap())
}

fn tokens(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (uniform(seed, i) * vocab as f32) as u32)
        .collect()
}

#[test]
fn chunked_prefill_equals_decode_token_by_token() {
    // G = 2, head dim 6, N = 12: every chunk size of the issue, lengths around a chunk.
    let model = Model::synthetic(tiny_config(2, 6), 11);
    let vocab = model.config.vocab_size;
    let Some(mut dec) = backend(&model, PrefillMode::Decode, 16) else {
        return;
    };
    let Some(mut chk) = backend(&model, PrefillMode::Chunked, 16) else {
        return;
    };
    let warm = tokens(11, 5, vocab);
    for q in [8usize, 16, 32, 64, 128, 256] {
        chk.engine.chunk = q;
        for len in [1, q - 1, q, q + 1, 3 * q + 5] {
            let toks = tokens(len, (q * 7 + len) as u64, vocab);
            // Both start from the same non-zero state: a previous turn.
            for b in [&mut dec, &mut chk] {
                b.reset().unwrap();
                b.prefill_logits(&warm).unwrap();
            }
            let want = dec.prefill_logits(&toks).unwrap();
            let got = chk.prefill_logits(&toks).unwrap();
            assert_eq!(got.len(), len);
            let e = common::nmse(&got.concat(), &want.concat());
            assert!(e <= 1e-6, "Q={q} L={len}: logits NMSE {e:e}");
            let (sd, sc) = (dec.state().unwrap(), chk.state().unwrap());
            let e = common::nmse(&sc.values(), &sd.values());
            assert!(e <= 1e-6, "Q={q} L={len}: state NMSE {e:e}");
        }
    }
}

#[test]
fn chunked_prefill_equals_the_cpu_reference() {
    let model = Model::synthetic(tiny_config(2, 6), 4);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let Some(mut gpu) = backend(&model, PrefillMode::Chunked, 16) else {
        return;
    };
    let toks = tokens(700, 9, model.config.vocab_size);
    let want = cpu
        .forward(&mut cpu.new_state(), &toks, Scan::Chunked(16), Logits::All)
        .unwrap();
    let got = gpu.prefill_logits(&toks).unwrap();
    let e = common::nmse(&got.concat(), &want.concat());
    assert!(
        e <= 1e-7,
        "logits NMSE {e:e} over 700 tokens (several blocks)"
    );
}

/// A config's `chunk_size` beyond what the GPU's chunked SSD runs (a checkpoint's 1024) is
/// a speed hint: the engine runs the nearest length it has (the SSD is exact at any), and
/// the logits equal the CPU reference's, which scans in the config's 1024-token chunks.
#[test]
fn a_config_chunk_size_beyond_the_kernels_runs_at_their_largest() {
    let mut config = tiny_config(2, 6);
    config.chunk_size = 1024;
    let model = Model::synthetic(config, 4);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let Some(ctx) = common::gpu(&Engine::needs(&model.config, WeightFormat::F32)) else {
        return;
    };
    let opts = EngineOptions {
        format: WeightFormat::F32,
        ..Default::default()
    };
    let engine = Engine::new(ctx, &model, opts).unwrap();
    assert!((8..=256).contains(&engine.chunk), "chunk {}", engine.chunk);
    let mut gpu = GpuBackend::new(engine).unwrap();
    let toks = tokens(300, 3, model.config.vocab_size);
    let want = cpu
        .forward(
            &mut cpu.new_state(),
            &toks,
            Scan::Chunked(1024),
            Logits::All,
        )
        .unwrap();
    let got = gpu.prefill_logits(&toks).unwrap();
    let e = common::nmse(&got.concat(), &want.concat());
    assert!(e <= 1e-7, "logits NMSE {e:e}");
}

/// Blocks of at most one GEMM token tile go through the short-block graph (the Mamba2
/// projections split over K, `gemm_split`): a short prompt from a fresh state and a short
/// continuation after a long one, against the CPU reference's last-position logits. With
/// chunks of 128 the short graph runs its SSD in chunks of 64 (one block's worth) while the
/// long blocks keep 128.
#[test]
fn short_blocks_take_the_split_k_graph_and_equal_the_cpu_reference() {
    let model = Model::synthetic(tiny_config(2, 6), 4);
    for chunk in [64, 128] {
        short_blocks_with_chunks(&model, chunk);
    }
}

fn short_blocks_with_chunks(model: &Model, chunk: usize) {
    use mamba2_wgpu::gpu::prefill::SHORT_BLOCK;
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let Some(mut gpu) = backend(model, PrefillMode::Chunked, chunk) else {
        return;
    };
    let v = model.config.vocab_size;
    for (first, then) in [(17, 0), (SHORT_BLOCK, 0), (100, 30), (530, 1)] {
        let toks = tokens(first + then, 11 + first as u64, v);
        let mut state = cpu.new_state();
        let want = cpu
            .forward(&mut state, &toks, Scan::Chunked(64), Logits::Last)
            .unwrap();
        gpu.reset().unwrap();
        let greedy = Sampling::greedy();
        gpu.prefill_sample(&toks[..first], &greedy, first as u64)
            .unwrap();
        if then > 0 {
            gpu.prefill_sample(&toks[first..], &greedy, (first + then) as u64)
                .unwrap();
        }
        let got = gpu.engine.read_logits().unwrap();
        let e = common::nmse(&got, &want[0]);
        assert!(
            e <= 1e-7,
            "chunks of {chunk}, {first} + {then} tokens: last logits NMSE {e:e}"
        );
    }
}

/// The same for a hybrid (the nemotron_h_hybrid fixture: attention and MLP projections split
/// too), a short prompt and a short turn after it, against the CPU reference.
#[test]
fn hybrid_short_blocks_equal_the_cpu_reference() {
    let model = Model::load(&common::fixture("nemotron_h_hybrid")).unwrap();
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let Some(ctx) = common::gpu(&Engine::needs(&model.config, WeightFormat::F32)) else {
        return;
    };
    let opts = EngineOptions {
        format: WeightFormat::F32,
        prefill: PrefillMode::Chunked,
        chunk_size: Some(16),
        context: Some(256),
        kv: KvFormat::F32,
        ..Default::default()
    };
    let mut gpu = GpuBackend::new(Engine::new(ctx, &model, opts).unwrap()).unwrap();
    let toks = tokens(60, 5, model.config.vocab_size);
    let want = cpu
        .forward(&mut cpu.new_state(), &toks, Scan::Chunked(16), Logits::Last)
        .unwrap();
    let greedy = Sampling::greedy();
    gpu.prefill_sample(&toks[..37], &greedy, 37).unwrap();
    gpu.prefill_sample(&toks[37..], &greedy, 60).unwrap();
    let got = gpu.engine.read_logits().unwrap();
    let e = common::nmse(&got, &want[0]);
    assert!(e <= 1e-7, "37 + 23 tokens: last logits NMSE {e:e}");
}

#[test]
fn two_turns_equal_one_prefill_and_snapshots_restore() {
    let model = Model::synthetic(tiny_config(2, 6), 8);
    let vocab = model.config.vocab_size;
    let (a, b) = (tokens(40, 1, vocab), tokens(23, 2, vocab));
    let greedy = |n| GenerateOptions {
        max_new_tokens: n,
        ..Default::default()
    };
    // One session: turn 1 then turn 2 (only the new tokens are fed each time).
    let Some(be) = backend(&model, PrefillMode::Chunked, 16) else {
        return;
    };
    let mut s = Session::new(Box::new(be));
    let (r1, _) = s.generate(&a, &greedy(5), |_| true).unwrap();
    let (r2, _) = s.generate(&b, &greedy(7), |_| true).unwrap();
    // Another: the whole conversation as one prompt.
    let Some(be) = backend(&model, PrefillMode::Chunked, 16) else {
        return;
    };
    let mut whole = Session::new(Box::new(be));
    let all = [a.clone(), r1.clone(), b.clone()].concat();
    let (r2_whole, _) = whole.generate(&all, &greedy(7), |_| true).unwrap();
    assert_eq!(
        r2, r2_whole,
        "turn 2 after turn 1 must equal one prefill of everything"
    );
    // Snapshot, sample a branch, restore, sample again: the same tokens.
    let snap = s.snapshot().unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 9,
        sampling: Sampling {
            temperature: 0.9,
            top_k: 20,
            top_p: 0.95,
            seed: 3,
        },
        stop: vec![],
    };
    let (x1, _) = s.generate(&b, &opts, |_| true).unwrap();
    s.restore(&snap).unwrap();
    let (x2, _) = s.generate(&b, &opts, |_| true).unwrap();
    assert_eq!(
        x1, x2,
        "a restored snapshot continues exactly as the original"
    );
}

#[test]
fn perplexity_equals_the_oracle_figure() {
    // All-Mamba, both hybrids (attention + MLP blocks, KV caches carried over the blocks),
    // the MoE hybrids and Granite with rotary embeddings.
    for name in [
        "nemotron_h_g2",
        "nemotron_h_hybrid",
        "nemotron_h_mqa",
        "nemotron_h_moe",
        "nemotron_h_latent",
        "granite_moe_hybrid",
        "granite_rope",
    ] {
        perplexity_of(name);
    }
}

fn perplexity_of(name: &str) {
    let dir = common::fixture(name);
    let model = Model::load(&dir).unwrap();
    let bytes = std::fs::read(dir.join("oracle.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let prompt: Vec<u32> = st
        .tensor("prompt_ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let nll = f64::from_le_bytes(
        st.tensor("prompt_nll").unwrap().data()[..8]
            .try_into()
            .unwrap(),
    );
    let Some(be) = backend(&model, PrefillMode::Chunked, 16) else {
        return;
    };
    let mut s = Session::new(Box::new(be));
    let p = perplexity(&mut s, &prompt, prompt.len(), |_, _| {}).unwrap();
    assert_eq!(p.predicted, prompt.len() - 1);
    assert!(
        (p.nll - nll).abs() < 1e-5,
        "{name}: perplexity NLL {} vs the oracle's {nll}",
        p.nll
    );
}

/// A long prompt read in pieces of whole prefill blocks, with progress between them (what
/// `generate` and `chat` draw a bar with), gives the tokens and the state of one read, bit
/// for bit, on the GPU and the CPU reference, for a Mamba2 model and a hybrid (its KV
/// cache rows written piece by piece). Three pieces: a block, a block, and the rest.
#[test]
fn a_long_prompt_read_in_pieces_with_progress_equals_one_read() {
    use std::sync::{Arc, Mutex};
    let mut hybrid = Model::load(&common::fixture("nemotron_h_hybrid")).unwrap();
    // Room for two long turns on the CPU reference too (its KV cache takes the config's).
    hybrid.config.max_context = Some(16384);
    for model in [Model::synthetic(tiny_config(2, 6), 5), hybrid] {
        let ctx = common::gpu(&Engine::needs(&model.config, WeightFormat::F32));
        let open = |gpu: bool| -> Option<Box<dyn mamba2_wgpu::Backend>> {
            if !gpu {
                let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
                return Some(Box::new(mamba2_wgpu::CpuBackend::new(cpu)));
            }
            let opts = EngineOptions {
                format: WeightFormat::F32,
                kv: KvFormat::F32,
                context: model.config.attention.as_ref().map(|_| 16384),
                ..Default::default()
            };
            let engine = Engine::new(ctx.clone()?, &model, opts).unwrap();
            Some(Box::new(GpuBackend::new(engine).unwrap()))
        };
        for gpu in [false, true] {
            let (Some(whole), Some(mut cut)) = (open(gpu), open(gpu)) else {
                continue;
            };
            let block = cut.prefill_granule().unwrap().unwrap();
            let n = 3 * block + 5;
            let prompt = tokens(n, 12, model.config.vocab_size);
            let opts = GenerateOptions {
                max_new_tokens: 4,
                ..Default::default()
            };
            let mut one = Session::new(whole);
            let (want, _) = one.generate(&prompt, &opts, |_| true).unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let log = seen.clone();
            let mut pieces = Session::new(cut);
            pieces.set_prompt_progress(Some(mamba2_wgpu::PromptProgress {
                every: 1,
                on: Box::new(move |fed, total| {
                    log.lock().unwrap().push((fed, total));
                    true
                }),
            }));
            let (got, _) = pieces.generate(&prompt, &opts, |_| true).unwrap();
            let what = format!(
                "{} on the {}",
                model.config.pattern(),
                if gpu { "GPU" } else { "CPU" }
            );
            assert_eq!(
                *seen.lock().unwrap(),
                vec![(0, n), (block, n), (2 * block, n), (n, n)],
                "{what}: progress in blocks of {block}"
            );
            assert_eq!(got, want, "{what}: tokens");
            let bits = |s: &Session| -> Vec<u32> {
                s.backend()
                    .state()
                    .unwrap()
                    .values()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert!(
                bits(&pieces) == bits(&one),
                "{what}: the state, bit for bit"
            );
            // A second turn: its pending token first, from a position past zero.
            let more = tokens(2 * block + 7, 13, model.config.vocab_size);
            let (want, _) = one.generate(&more, &opts, |_| true).unwrap();
            let (got, _) = pieces.generate(&more, &opts, |_| true).unwrap();
            assert_eq!(got, want, "{what}: the second turn's tokens");
            assert!(
                bits(&pieces) == bits(&one),
                "{what}: the state after the second turn, bit for bit"
            );
            // A prompt past a KV cache's context is refused before any piece is fed.
            if gpu && model.config.attention.is_some() {
                let opts = EngineOptions {
                    format: WeightFormat::F32,
                    context: Some(2 * block),
                    ..Default::default()
                };
                let engine = Engine::new(ctx.clone().unwrap(), &model, opts).unwrap();
                let mut short = Session::new(Box::new(GpuBackend::new(engine).unwrap()));
                short.set_prompt_progress(Some(mamba2_wgpu::PromptProgress {
                    every: 1,
                    on: Box::new(|_, _| panic!("no piece may be fed")),
                }));
                let e = short
                    .generate(&prompt, &opts_greedy(), |_| true)
                    .unwrap_err();
                assert!(e.to_string().contains("context"), "{e}");
                assert_eq!(
                    short.backend().state().unwrap().len,
                    0,
                    "{what}: nothing fed"
                );
            }
        }
    }
}

fn opts_greedy() -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: 4,
        ..Default::default()
    }
}
