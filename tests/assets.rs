//! The embedded model: it loads, the CPU reference and the GPU give the same greedy text,
//! and its held-out perplexity is the training script's figure (assets/training.json).

mod common;

use mamba2_wgpu::gpu::GpuBackend;
use mamba2_wgpu::gpu::engine::{Engine, EngineOptions};
use mamba2_wgpu::perplexity::perplexity;
use mamba2_wgpu::{CpuBackend, CpuModel, GenerateOptions, Session, WeightFormat, assets};

fn greedy_text(session: &mut Session, tok: &mamba2_wgpu::Tokenizer, prompt: &str) -> String {
    let ids = tok.encode(prompt).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 40,
        stop: tok.eos.into_iter().collect(),
        ..Default::default()
    };
    let (out, _) = session.generate(&ids, &opts, |_| true).unwrap();
    tok.decode(&out).unwrap()
}

#[test]
fn cpu_and_gpu_write_the_same_greedy_text() {
    let (model, tok) = assets::embedded().unwrap();
    assert_eq!(
        (
            model.config.n_layer,
            model.config.d_model,
            model.config.vocab_size
        ),
        (6, 320, 4096)
    );
    let mut cpu = Session::new(Box::new(CpuBackend::new(
        CpuModel::<f32>::new(&model.config, &model.weights).unwrap(),
    )));
    let Some(ctx) = common::gpu(&Engine::needs(&model.config, WeightFormat::F32)) else {
        return;
    };
    let engine = Engine::new(
        ctx,
        &model,
        EngineOptions {
            format: WeightFormat::F32,
            ..Default::default()
        },
    )
    .unwrap();
    let mut gpu = Session::new(Box::new(GpuBackend::new(engine).unwrap()));
    for prompt in ["The meaning of life", "A computer", "Love is"] {
        let (a, b) = (
            greedy_text(&mut cpu, &tok, prompt),
            greedy_text(&mut gpu, &tok, prompt),
        );
        assert!(!a.trim().is_empty(), "{prompt}: empty reply");
        assert_eq!(a, b, "{prompt}: CPU and GPU greedy text");
        cpu.reset().unwrap();
        gpu.reset().unwrap();
    }
}

#[test]
fn heldout_perplexity_is_the_training_figure() {
    let training: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/assets/training.json"))
            .unwrap(),
    )
    .unwrap();
    let want = training["heldout"]["heldout_ppl"].as_f64().unwrap();
    let ctx = training["heldout"]["ctx"].as_u64().unwrap() as usize;
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/heldout.txt"
    ))
    .unwrap();
    let (model, tok) = assets::embedded().unwrap();
    let tokens = tok.encode_with(&text, false).unwrap();
    assert_eq!(
        tokens.len() as u64,
        training["heldout"]["tokens"].as_u64().unwrap()
    );
    let mut s = Session::new(Box::new(CpuBackend::new(
        CpuModel::<f32>::new(&model.config, &model.weights).unwrap(),
    )));
    let p = perplexity(&mut s, &tokens, ctx, |_, _| {}).unwrap();
    assert_eq!(
        p.predicted as u64,
        training["heldout"]["predicted_positions"].as_u64().unwrap()
    );
    let rel = (p.ppl - want).abs() / want;
    assert!(
        rel <= 0.01,
        "held-out perplexity {} vs the training script's {want} ({:.3} %)",
        p.ppl,
        rel * 100.0
    );
}
