//! Whole-model decode on the GPU (lavapipe in CI) against the CPU reference.

mod common;

use mamba2_wgpu::gpu::engine::{Engine, EngineOptions};
use mamba2_wgpu::gpu::graph::{Ctrl, Tail};
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::quant::WeightFormat;
use mamba2_wgpu::model::synthetic::tiny_config;
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};

#[test]
fn synthetic_decode_matches_reference() {
    for (groups, head_dim) in [(1, 8), (2, 6)] {
        let model = Model::synthetic(tiny_config(groups, head_dim), 3);
        let Some(ctx) = common::gpu(&Engine::needs(&model.config, WeightFormat::F32)) else {
            return;
        };
        for fused in [true, false] {
            let engine = Engine::new(
                ctx.clone(),
                &model,
                EngineOptions {
                    format: WeightFormat::F32,
                    fused,
                    ..Default::default()
                },
            )
            .unwrap();
            // embed + per layer (fused: norm, in_proj+conv, ssd, out_proj; unfused: 7) +
            // final norm, lm_head, argmax.
            let per_layer = if fused { 4 } else { 7 };
            assert_eq!(
                engine.graph(Tail::Greedy).len(),
                1 + per_layer * model.config.n_layer + 3
            );
            let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
            let mut state = cpu.new_state();
            let tokens = [5u32, 17, 3, 60, 2, 9, 9, 41];
            for &t in &tokens {
                let want = &cpu
                    .forward(&mut state, &[t], Scan::Sequential, Logits::Last)
                    .unwrap()[0];
                engine.write_ctrl(&Ctrl {
                    token: t,
                    ..Default::default()
                });
                let mut enc = ctx.device.create_command_encoder(&Default::default());
                {
                    let mut pass = enc.begin_compute_pass(&Default::default());
                    engine.graph(Tail::Greedy).record(&mut pass, None, None);
                }
                ctx.queue.submit([enc.finish()]);
                let got = engine.read_logits().unwrap();
                let e = common::nmse(&got, want);
                assert!(
                    e <= 1e-7,
                    "G={groups} fused={fused} token {t}: logits NMSE {e:e}"
                );
                let ctrl = engine.read_ctrl().unwrap();
                assert_eq!(ctrl.token, mamba2_wgpu::sampling::argmax(want));
            }
            let gpu_state = engine.read_state().unwrap();
            assert!(common::nmse(&gpu_state.values(), &state.values()) <= 1e-7);
        }
    }
}

mod fixtures_on_gpu {
    use super::common;
    use mamba2_wgpu::gpu::GpuBackend;
    use mamba2_wgpu::gpu::engine::{Engine, EngineOptions};
    use mamba2_wgpu::gpu::state_store::KvFormat;
    use mamba2_wgpu::model::Model;
    use mamba2_wgpu::model::quant::WeightFormat;
    use mamba2_wgpu::reference::{CpuModel, Logits, Scan};
    use mamba2_wgpu::session::Backend;
    use mamba2_wgpu::{GenerateOptions, Session};
    use safetensors::SafeTensors;

    fn oracle(name: &str) -> (Vec<u32>, Vec<Vec<f32>>, Vec<u32>) {
        let bytes = std::fs::read(common::fixture(name).join("oracle.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let ids = |n: &str| -> Vec<u32> {
            st.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
                .collect()
        };
        let t = st.tensor("prompt_logits").unwrap();
        let v: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        (
            ids("prompt_ids"),
            v.chunks(t.shape()[1]).map(<[f32]>::to_vec).collect(),
            ids("greedy_ids"),
        )
    }

    fn backend(model: &Model, format: WeightFormat, fused: bool) -> Option<GpuBackend> {
        let ctx = common::gpu(&Engine::needs(&model.config, format))?;
        let options = EngineOptions {
            format,
            fused,
            // The oracle's f32 to 1e-4: KV caches in f32 too (f16 rounding moves hybrid
            // logits by a few 1e-3).
            kv: KvFormat::F32,
            ..Default::default()
        };
        Some(backend_on(&ctx, model, options))
    }

    /// A GPU backend for `model` on the device `ctx`.
    fn backend_on(
        ctx: &std::sync::Arc<mamba2_wgpu::gpu::context::GpuContext>,
        model: &Model,
        options: EngineOptions,
    ) -> GpuBackend {
        GpuBackend::new(Engine::new(ctx.clone(), model, options).unwrap()).unwrap()
    }

    fn check(name: &str) {
        let model = Model::load(&common::fixture(name)).unwrap();
        let (prompt, oracle_logits, greedy) = oracle(name);
        let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
        let cpu_logits = cpu
            .forward(&mut cpu.new_state(), &prompt, Scan::Sequential, Logits::All)
            .unwrap();
        let mut fused_logits = Vec::new();
        for fused in [true, false] {
            let Some(mut b) = backend(&model, WeightFormat::F32, fused) else {
                return;
            };
            // Logits at every prompt position, token by token through the decode graph.
            let logits = b.prefill_logits(&prompt).unwrap();
            for (t, ((g, c), o)) in logits
                .iter()
                .zip(&cpu_logits)
                .zip(&oracle_logits)
                .enumerate()
            {
                let e = common::nmse(g, c);
                assert!(
                    e <= 1e-7,
                    "{name} fused={fused} position {t}: NMSE vs CPU {e:e}"
                );
                let d = g
                    .iter()
                    .zip(o)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    d <= 1e-4,
                    "{name} fused={fused} position {t}: max |Δ| vs oracle {d:e}"
                );
            }
            if fused {
                fused_logits = logits;
            } else {
                let e = common::nmse(&logits.concat(), &fused_logits.concat());
                assert!(e <= 1e-10, "{name}: fused vs unfused NMSE {e:e}");
            }
            // 24 greedy tokens through the session, device-side argmax and token ring.
            let ids = common::session_greedy(Box::new(b), &prompt, 24);
            assert_eq!(ids, greedy, "{name} fused={fused}: greedy ids");
        }
    }

    #[test]
    fn hf_mamba2_g1_on_gpu() {
        check("hf_mamba2_g1");
    }

    #[test]
    fn nemotron_h_hybrid_on_gpu() {
        // Mamba2 + attention (GQA, 2 kv heads of 4) + MLP blocks.
        check("nemotron_h_hybrid");
    }

    #[test]
    fn nemotron_h_mqa_on_gpu() {
        // One kv head, head_dim 24, MLP biases.
        check("nemotron_h_mqa");
    }

    #[test]
    fn nemotron_h_g2_on_gpu() {
        check("nemotron_h_g2");
    }

    #[test]
    fn nemotron_h_moe_on_gpu() {
        // Mamba2, attention, MLP and MoE blocks: grouped sigmoid routing, shared expert.
        check("nemotron_h_moe");
    }

    #[test]
    fn nemotron_h_latent_on_gpu() {
        // Latent MoE: the routed experts between fc1_latent_proj and fc2_latent_proj.
        check("nemotron_h_latent");
    }

    #[test]
    fn granite_moe_hybrid_on_gpu() {
        // Granite-4.0-H: mixer + (MoE + shared MLP) per layer, all µP multipliers ≠ 1.
        check("granite_moe_hybrid");
    }

    #[test]
    fn granite_rope_on_gpu() {
        // Granite with rotary embeddings on its attention layers (the released models are
        // NoPE).
        check("granite_rope");
    }

    /// A decode the caller cancels while later steps are in flight: those steps still feed
    /// the state, one of them sampling a stop token (it feeds its input, then stops), so the
    /// session must count it. Its position must then be the state's length, and the state
    /// must be that of a fresh run fed the same tokens (the hybrid: KV rows too).
    #[test]
    fn a_cancel_with_a_stop_token_in_flight_keeps_the_count() {
        let name = "nemotron_h_hybrid";
        let model = Model::load(&common::fixture(name)).unwrap();
        let (prompt, _, greedy) = oracle(name);
        // Cancel on reply token k, whose successor (then in flight) is made a stop token;
        // it must not occur earlier in the reply.
        let k = (2..greedy.len() - 2)
            .find(|&k| !greedy[..=k].contains(&greedy[k + 1]))
            .expect("a reply token not seen before");
        let Some(b) = backend(&model, WeightFormat::F32, true) else {
            return;
        };
        let mut s = Session::new(Box::new(b));
        let opts = GenerateOptions {
            max_new_tokens: 24,
            stop: vec![greedy[k + 1]],
            ..Default::default()
        };
        let mut seen = 0;
        let (ids, _) = s
            .generate(&prompt, &opts, |_| {
                seen += 1;
                seen <= k
            })
            .unwrap();
        assert_eq!(ids[..=k], greedy[..=k], "the reply up to the cancel");
        let state = s.backend().state().unwrap();
        assert_eq!(
            s.position() as usize,
            state.len,
            "the session's position is the state's length"
        );
        // The state is a fresh run's over the prompt and the reply tokens fed.
        let fed: Vec<u32> = prompt.iter().chain(&ids).copied().collect();
        assert_eq!(state.len, fed.len(), "the prompt and the reply fed");
        let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
        let mut want = cpu.new_state();
        cpu.forward(&mut want, &fed, Scan::Sequential, Logits::None)
            .unwrap();
        let e = common::nmse(&state.values(), &want.values());
        assert!(e <= 1e-8, "state NMSE vs a fresh run {e:e}");
    }

    /// A prompt that fills the context exactly: the first token comes, then the reply ends
    /// as `ContextFull` (not an error after a token was given out), on the GPU and the CPU.
    #[test]
    fn a_prompt_that_fills_the_context_ends_the_reply_cleanly() {
        use mamba2_wgpu::{CpuBackend, Finish};
        let name = "nemotron_h_hybrid";
        let model = Model::load(&common::fixture(name)).unwrap();
        let (prompt, _, greedy) = oracle(name);
        let Some(ctx) = common::gpu(&Engine::needs(&model.config, WeightFormat::F32)) else {
            return;
        };
        let options = EngineOptions {
            context: Some(prompt.len()),
            kv: KvFormat::F32,
            ..Default::default()
        };
        let gpu = backend_on(&ctx, &model, options);
        let cpu = CpuBackend::new(
            CpuModel::<f32>::new(&model.config, &model.weights)
                .unwrap()
                .with_context(prompt.len()),
        );
        let opts = GenerateOptions {
            max_new_tokens: 4,
            ..Default::default()
        };
        for backend in [Box::new(gpu) as Box<dyn Backend>, Box::new(cpu)] {
            let mut s = Session::new(backend);
            let (ids, finish) = s.generate(&prompt, &opts, |_| true).unwrap();
            assert_eq!((ids, finish), (vec![greedy[0]], Finish::ContextFull));
            assert_eq!(s.position() as usize, prompt.len());
        }
    }

    /// A device snapshot goes back only into a state of its own kind: one taken with f16 KV
    /// caches is refused by an engine with f32 ones (its bytes would be misread).
    #[test]
    fn a_snapshot_from_another_kv_format_is_refused() {
        let name = "nemotron_h_hybrid";
        let model = Model::load(&common::fixture(name)).unwrap();
        let (prompt, _, _) = oracle(name);
        let Some(ctx) = common::gpu(&Engine::needs(&model.config, WeightFormat::F32)) else {
            return;
        };
        let engine = |kv| {
            let options = EngineOptions {
                kv,
                ..Default::default()
            };
            backend_on(&ctx, &model, options)
        };
        let mut f16 = engine(KvFormat::F16);
        f16.prefill_sample(&prompt, &Default::default(), prompt.len() as u64)
            .unwrap();
        let snap = f16.engine.snapshot().unwrap();
        let mut f32 = engine(KvFormat::F32);
        let err = f32.engine.restore(&snap).unwrap_err().to_string();
        assert!(err.contains("KV format"), "{err}");
        // Its own kind takes it back.
        let mut again = engine(KvFormat::F16);
        again.engine.restore(&snap).unwrap();
        assert_eq!(again.engine.len, prompt.len());
    }

    /// The profiled prefill (bench) refuses what every other way in refuses: no tokens, an
    /// id outside the vocabulary (the embedding gather reads rows unchecked).
    #[test]
    fn profiled_prefill_checks_its_tokens() {
        let model = Model::load(&common::fixture("hf_mamba2_g1")).unwrap();
        let Some(mut b) = backend(&model, WeightFormat::F32, true) else {
            return;
        };
        let vocab = model.config.vocab_size as u32;
        let e = b.profile_prefill(&[]).unwrap_err().to_string();
        assert!(e.contains("no tokens"), "{e}");
        let e = b.profile_prefill(&[1, vocab]).unwrap_err().to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");
        assert_eq!(b.engine.len, 0, "nothing fed");
    }

    #[test]
    fn q8_0_keeps_the_logits() {
        // A pure Mamba2 model and the MoE hybrids (routers stay f32; experts, shared expert
        // and the tied head in q8_0).
        for name in ["hf_mamba2_g1", "nemotron_h_moe", "granite_moe_hybrid"] {
            q8_0_keeps_the_logits_of(name);
        }
    }

    fn q8_0_keeps_the_logits_of(name: &str) {
        let model = Model::load(&common::fixture(name)).unwrap();
        let (prompt, _, _) = oracle(name);
        let Some(mut f32b) = backend(&model, WeightFormat::F32, true) else {
            return;
        };
        let Some(mut q8b) = backend(&model, WeightFormat::Q8_0, true) else {
            return;
        };
        let a = f32b.prefill_logits(&prompt).unwrap();
        let b = q8b.prefill_logits(&prompt).unwrap();
        // The MoE fixtures route on gaps as small as 1e-5 (chosen so that f32 rounding cannot
        // flip a choice); q8_0's noise can, which changes that token's experts wholesale.
        let moe = model.config.moe.is_some();
        let mut flipped = 0;
        for (t, (x, y)) in a.iter().zip(&b).enumerate() {
            let dot: f64 = x.iter().zip(y).map(|(p, q)| *p as f64 * *q as f64).sum();
            let nx: f64 = x.iter().map(|p| (*p as f64).powi(2)).sum::<f64>().sqrt();
            let ny: f64 = y.iter().map(|p| (*p as f64).powi(2)).sum::<f64>().sqrt();
            let cos = dot / (nx * ny);
            if moe && cos < 0.995 {
                // A near-tie routing choice flipped by q8_0's noise: this token's experts
                // differ (counted below).
                flipped += 1;
                continue;
            }
            assert!(
                cos >= if moe { 0.995 } else { 0.999 },
                "{name} position {t}: q8_0 vs f32 logits cosine {cos}"
            );
            // The top-1 may only change where f32's own margin is within the q8_0 error.
            let best = mamba2_wgpu::sampling::argmax(x) as usize;
            let second = x
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != best)
                .map(|(_, v)| *v)
                .fold(f32::MIN, f32::max);
            let err = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max);
            if x[best] - second > 2.0 * err {
                assert_eq!(
                    mamba2_wgpu::sampling::argmax(y) as usize,
                    best,
                    "{name} position {t}: top-1 changed despite a clear margin"
                );
            }
        }
        assert!(
            flipped * 10 <= a.len(),
            "{name}: {flipped} of {} positions far off (more than a tenth)",
            a.len()
        );
    }
}

mod device_errors {
    use super::common;
    use mamba2_wgpu::bench::preset;
    use mamba2_wgpu::gpu::context::{DeviceChoice, GpuContext, pick_adapter};
    use mamba2_wgpu::gpu::engine::Engine;
    use mamba2_wgpu::model::quant::WeightFormat;

    #[test]
    fn a_model_too_big_for_the_adapter_is_a_clear_error() {
        let Ok(Some(adapter)) = pick_adapter(&DeviceChoice::Gpu(None)) else {
            assert!(
                std::env::var_os("MAMBA2_REQUIRE_GPU").is_none(),
                "no adapter"
            );
            eprintln!("!!!!!!!! SKIPPED: no GPU adapter !!!!!!!!");
            return;
        };
        let limit = adapter.limits().max_storage_buffer_binding_size;
        // mamba2-2.7b's f32 embedding is 515 MB: more than lavapipe's 128 MiB binding limit.
        let config = preset("2.7b").unwrap();
        let needs = Engine::needs(&config, WeightFormat::F32);
        if needs.largest_buffer.1 <= limit {
            eprintln!("adapter allows {limit} bytes per binding; nothing to provoke here");
            return;
        }
        let err = GpuContext::new(adapter, &needs)
            .err()
            .expect("must not fit")
            .to_string();
        assert!(
            err.contains("embedding / lm_head [50288, 2560] in f32")
                && err.contains("MiB per storage binding"),
            "{err}"
        );
    }

    #[test]
    fn impossible_allocation_and_device_loss_are_errors() {
        let Some(ctx) = common::gpu(&Default::default()) else {
            return;
        };
        let err = ctx
            .buffer("huge", 1 << 50, wgpu::BufferUsages::STORAGE)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`huge` needs a") && err.contains("the device allows"),
            "{err}"
        );
        ctx.device.destroy();
        let err = ctx
            .wait()
            .and_then(|_| {
                ctx.buffer("after", 64, wgpu::BufferUsages::STORAGE)
                    .map(|_| ())
            })
            .unwrap_err();
        assert!(err.to_string().contains("device lost"), "{err}");
    }
}
