//! The external oracles: HF transformers' Mamba2ForCausalLM (G = 1, tied),
//! NemotronHForCausalLM all-Mamba (G = 2, head dim 12, per-group gated norm) and two
//! NemotronH hybrids (Mamba2 + attention + MLP; GQA with 2 kv heads, and MQA with MLP
//! biases), run on the CPU in float32 by scripts/make_fixtures.py. Our CPU reference must match their logits at every
//! prompt position and their 24 greedy tokens.

mod common;

use std::path::Path;

use mamba2_wgpu::model::Model;
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};
use mamba2_wgpu::sampling::argmax;
use mamba2_wgpu::{CpuBackend, GenerateOptions, Session};
use safetensors::SafeTensors;

/// What the oracle saved.
pub struct Oracle {
    pub prompt: Vec<u32>,
    pub prompt_logits: Vec<Vec<f32>>,
    pub greedy: Vec<u32>,
    pub greedy_logits: Vec<Vec<f32>>,
    pub prompt_nll: f64,
}

pub fn oracle(dir: &Path) -> Oracle {
    let bytes = std::fs::read(dir.join("oracle.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = |name: &str| -> Vec<u32> {
        let t = st.tensor(name).unwrap();
        t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    };
    let rows = |name: &str| -> Vec<Vec<f32>> {
        let t = st.tensor(name).unwrap();
        let v: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        v.chunks(t.shape()[1]).map(<[f32]>::to_vec).collect()
    };
    let nll = st.tensor("prompt_nll").unwrap();
    Oracle {
        prompt: ids("prompt_ids"),
        prompt_logits: rows("prompt_logits"),
        greedy: ids("greedy_ids"),
        greedy_logits: rows("greedy_logits"),
        prompt_nll: f64::from_le_bytes(nll.data()[..8].try_into().unwrap()),
    }
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_fixture(name: &str) {
    let dir = common::fixture(name);
    let model = Model::load(&dir).unwrap();
    let o = oracle(&dir);
    assert_eq!(o.greedy.len(), 24);
    assert!(
        !o.prompt.len().is_multiple_of(model.config.chunk_size),
        "the prompt must end mid-chunk"
    );
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    // Chunked prefill: logits at every prompt position.
    let mut state = cpu.new_state();
    let logits = cpu
        .forward(
            &mut state,
            &o.prompt,
            Scan::Chunked(model.config.chunk_size),
            Logits::All,
        )
        .unwrap();
    for (t, (got, want)) in logits.iter().zip(&o.prompt_logits).enumerate() {
        let e = max_abs(got, want);
        assert!(e <= 1e-4, "{name}: prompt position {t}: max |Δlogit| {e:e}");
    }
    // Greedy continuation, one token at a time, compared with the oracle's logits.
    let mut next = argmax(logits.last().unwrap());
    // greedy_logits[i] are the logits that chose greedy_ids[i] (so [0] is the prompt's last).
    assert!(max_abs(logits.last().unwrap(), &o.greedy_logits[0]) <= 1e-4);
    for (i, &want_id) in o.greedy.iter().enumerate() {
        assert_eq!(next, want_id, "{name}: greedy token {i}");
        let l = cpu
            .forward(&mut state, &[next], Scan::Sequential, Logits::Last)
            .unwrap();
        if let Some(w) = o.greedy_logits.get(i + 1) {
            let e = max_abs(&l[0], w);
            assert!(
                e <= 1e-4,
                "{name}: greedy step {}: max |Δlogit| {e:e}",
                i + 1
            );
        }
        next = argmax(&l[0]);
    }
    // The same through the Session API (CPU device).
    let mut s = Session::new(Box::new(CpuBackend::new(cpu)));
    let opts = GenerateOptions {
        max_new_tokens: 24,
        ..Default::default()
    };
    let (ids, _) = s.generate(&o.prompt, &opts, |_| true).unwrap();
    assert_eq!(ids, o.greedy, "{name}: session greedy ids");
}

#[test]
fn hf_mamba2_g1_matches_transformers() {
    check_fixture("hf_mamba2_g1");
}

#[test]
fn nemotron_h_g2_matches_transformers() {
    check_fixture("nemotron_h_g2");
}

#[test]
fn nemotron_h_hybrid_matches_transformers() {
    check_fixture("nemotron_h_hybrid");
}

#[test]
fn nemotron_h_mqa_matches_transformers() {
    check_fixture("nemotron_h_mqa");
}

#[test]
fn nemotron_h_moe_matches_transformers() {
    check_fixture("nemotron_h_moe");
}

#[test]
fn nemotron_h_latent_matches_transformers() {
    check_fixture("nemotron_h_latent");
}

#[test]
fn granite_moe_hybrid_matches_transformers() {
    check_fixture("granite_moe_hybrid");
}

#[test]
fn granite_rope_matches_transformers() {
    // Granite with `position_embedding_type: rope` (attention first): the rotary embeddings
    // at model level, against transformers (ignoring them moves the logits by ~9).
    check_fixture("granite_rope");
}

#[test]
fn hybrid_fixtures_in_f64_and_in_prompt_pieces() {
    // The f64 reference matches the f32 oracle too, and a prompt fed in pieces (several
    // prefill calls, chunk 8) gives the same logits as the oracle's one pass.
    for name in [
        "nemotron_h_hybrid",
        "nemotron_h_mqa",
        "nemotron_h_moe",
        "nemotron_h_latent",
        "granite_moe_hybrid",
        "granite_rope",
    ] {
        let dir = common::fixture(name);
        let model = Model::load(&dir).unwrap();
        let o = oracle(&dir);
        let cpu = CpuModel::<f64>::new(&model.config, &model.weights).unwrap();
        let mut state = cpu.new_state();
        let mut logits = Vec::new();
        for piece in [&o.prompt[..3], &o.prompt[3..20], &o.prompt[20..]] {
            logits.extend(
                cpu.forward(&mut state, piece, Scan::Chunked(8), Logits::All)
                    .unwrap(),
            );
        }
        for (t, (got, want)) in logits.iter().zip(&o.prompt_logits).enumerate() {
            let got: Vec<f32> = got.iter().map(|&v| v as f32).collect();
            let e = max_abs(&got, want);
            assert!(
                e <= 1e-4,
                "{name} f64: prompt position {t}: max |Δlogit| {e:e}"
            );
        }
    }
}

#[test]
fn oracle_prompt_nll_is_what_its_logits_say() {
    // The fixture's own NLL figure agrees with its logits (guards the perplexity tests).
    for name in [
        "hf_mamba2_g1",
        "nemotron_h_g2",
        "nemotron_h_hybrid",
        "nemotron_h_mqa",
        "nemotron_h_moe",
        "nemotron_h_latent",
        "granite_moe_hybrid",
        "granite_rope",
    ] {
        let o = oracle(&common::fixture(name));
        let nll: f64 = o
            .prompt_logits
            .iter()
            .zip(&o.prompt[1..])
            .map(|(l, &t)| {
                let m = l.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
                let z: f64 = l.iter().map(|&v| (v as f64 - m).exp()).sum();
                m + z.ln() - l[t as usize] as f64
            })
            .sum::<f64>()
            / (o.prompt.len() - 1) as f64;
        assert!(
            (nll - o.prompt_nll).abs() < 1e-5,
            "{name}: {nll} vs {}",
            o.prompt_nll
        );
    }
}
