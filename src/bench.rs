//! Benchmarks at real model shapes with synthetic weights: presets for the Mamba2 family,
//! the decode timing harness, and the anchors of PERFORMANCE.md the results are compared
//! with. Timings live here and in `mamba2 bench`, never in test assertions.

use std::time::Instant;

use serde::Serialize;

use crate::config::{AttentionConfig, BlockKind, MlpAct, MlpConfig, ModelConfig, ModelFormat};
use crate::error::{Error, Result};
use crate::gpu::GpuBackend;
use crate::gpu::kernels::Section;
use crate::gpu::profiler::TokenProfile;
use crate::sampling::Sampling;
use crate::session::Backend;

/// The preset names `mamba2 bench --config` accepts.
pub const PRESETS: [&str; 14] = [
    "tiny",
    "tiny-hybrid",
    "tiny-moe",
    "130m",
    "370m",
    "780m",
    "1.3b",
    "2.7b",
    "codestral-7b",
    "nemotron-h-8b",
    "nemotron-nano-9b-v2",
    "nemotron-3-nano-30b-a3b",
    "granite-4.0-h-tiny",
    "granite-4.0-h-small",
];

/// A config with the real shapes of a released model (state-spaces/mamba2-*, Mistral's
/// Mamba-Codestral-7B, NVIDIA's Nemotron-H-8B-Base-8K and Nemotron-Nano-9B-v2), or a tiny
/// one for smoke tests.
pub fn preset(name: &str) -> Option<ModelConfig> {
    if let Some(c) = hybrid_preset(name) {
        return Some(c);
    }
    if let Some(c) = moe_preset(name) {
        return Some(c);
    }
    mamba2_preset(name)
}

/// The MoE presets: the fields of the public `config.json` files that set the shapes
/// (NVIDIA-Nemotron-3-Nano-30B-A3B; ibm-granite/granite-4.0-h-tiny and -small, whose
/// `layer_types` put attention at layers 5, 15, 25 and 35), read by the config parser itself.
fn moe_preset(name: &str) -> Option<ModelConfig> {
    let granite_layers = || {
        let mut v = vec!["mamba"; 40];
        for i in [5, 15, 25, 35] {
            v[i] = "attention";
        }
        serde_json::json!(v)
    };
    let granite =
        |d: usize, heads: (usize, usize), mamba_heads: usize, moe: (usize, usize, usize, usize)| {
            serde_json::json!({
                "model_type": "granitemoehybrid",
                "hidden_size": d, "num_hidden_layers": 40, "layer_types": granite_layers(),
                "num_attention_heads": heads.0, "num_key_value_heads": heads.1,
                "num_local_experts": moe.0, "num_experts_per_tok": moe.1,
                "intermediate_size": moe.2, "shared_intermediate_size": moe.3,
                "vocab_size": 100352, "tie_word_embeddings": true,
                "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_n_heads": mamba_heads,
                "mamba_d_head": 64, "mamba_expand": 2, "mamba_d_conv": 4, "mamba_chunk_size": 256,
                "max_position_embeddings": 131072, "position_embedding_type": "nope",
                "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0078125, "logits_scaling": 6.0,
            })
        };
    let json = match name {
        "nemotron-3-nano-30b-a3b" => serde_json::json!({
            "model_type": "nemotron_h", "hidden_size": 2688,
            "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128,
            "conv_kernel": 4, "chunk_size": 128,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
            "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
            "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": true, "routed_scaling_factor": 2.5,
            "vocab_size": 131072, "tie_word_embeddings": false,
            "max_position_embeddings": 262144,
        }),
        "tiny-moe" => serde_json::json!({
            "model_type": "nemotron_h", "hidden_size": 256, "hybrid_override_pattern": "ME*EM-E",
            "mamba_num_heads": 8, "mamba_head_dim": 64, "n_groups": 1, "ssm_state_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "intermediate_size": 512, "n_routed_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 256,
            "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
            "vocab_size": 4096, "max_position_embeddings": 4096,
        }),
        "granite-4.0-h-tiny" => granite(1536, (12, 4), 48, (64, 6, 512, 1024)),
        "granite-4.0-h-small" => granite(4096, (32, 8), 128, (72, 10, 768, 1536)),
        _ => return None,
    };
    let c = ModelConfig::from_json_str(&json.to_string(), std::path::Path::new(name));
    Some(c.expect("the MoE presets are valid configs"))
}

/// The Nemotron-H presets, from the public `config.json` files: layer pattern, widths,
/// head counts, MLP width, vocabulary, trained context.
fn hybrid_preset(name: &str) -> Option<ModelConfig> {
    let (d, pattern, heads, head_dim, mlp, (q, kv), ctx) = match name {
        "tiny-hybrid" => (256, "M-M*-M-", 8, 64, 512, (4, 2), 4096),
        "nemotron-h-8b" => (
            4096,
            "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            128,
            64,
            21504,
            (32, 8),
            8192,
        ),
        "nemotron-nano-9b-v2" => (
            4480,
            "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
            128,
            80,
            15680,
            (40, 8),
            131072,
        ),
        _ => return None,
    };
    let attn_dim = if name == "tiny-hybrid" { 64 } else { 128 };
    let blocks: Vec<BlockKind> = pattern
        .chars()
        .map(|ch| match ch {
            'M' => BlockKind::Mamba2,
            '*' => BlockKind::Attention,
            _ => BlockKind::Mlp,
        })
        .collect();
    Some(ModelConfig {
        format: ModelFormat::NemotronH,
        d_model: d,
        n_layer: blocks.len(),
        vocab_size: if name == "tiny-hybrid" { 4096 } else { 131072 },
        d_inner: heads * head_dim,
        n_heads: heads,
        head_dim,
        n_groups: if name == "tiny-hybrid" { 1 } else { 8 },
        d_state: if name == "tiny-hybrid" { 64 } else { 128 },
        d_conv: 4,
        chunk_size: 128,
        norm_eps: 1e-5,
        tie_embeddings: false,
        conv_bias: true,
        time_step_limit: (0.001, f64::INFINITY),
        blocks,
        attention: Some(AttentionConfig {
            heads: q,
            kv_heads: kv,
            head_dim: attn_dim,
            bias: false,
            rope_theta: None,
            scale: 1.0 / (attn_dim as f64).sqrt(),
        }),
        mlp: Some(MlpConfig {
            intermediate: mlp,
            act: MlpAct::Relu2,
            bias: false,
        }),
        moe: None,
        scales: Default::default(),
        max_context: Some(ctx),
        notices: Vec::new(),
    })
}

/// The pure Mamba2 presets.
fn mamba2_preset(name: &str) -> Option<ModelConfig> {
    let (d, layers, groups, vocab, tied) = match name {
        "tiny" => (256, 4, 1, 4096, true),
        "130m" => (768, 24, 1, 50288, true),
        "370m" => (1024, 48, 1, 50288, true),
        "780m" => (1536, 48, 1, 50288, true),
        "1.3b" => (2048, 48, 1, 50288, true),
        "2.7b" => (2560, 64, 1, 50288, true),
        "codestral-7b" => (4096, 64, 8, 32768, false),
        _ => return None,
    };
    let d_inner = 2 * d;
    Some(ModelConfig {
        format: if name == "codestral-7b" {
            ModelFormat::Mistral
        } else {
            ModelFormat::MambaSsm
        },
        d_model: d,
        n_layer: layers,
        vocab_size: vocab,
        d_inner,
        n_heads: d_inner / 64,
        head_dim: 64,
        n_groups: groups,
        d_state: if name == "tiny" { 64 } else { 128 },
        d_conv: 4,
        chunk_size: 256,
        norm_eps: 1e-5,
        tie_embeddings: tied,
        conv_bias: true,
        time_step_limit: (0.0, f64::INFINITY),
        blocks: vec![crate::config::BlockKind::Mamba2; layers],
        attention: None,
        mlp: None,
        moe: None,
        scales: Default::default(),
        max_context: None,
        notices: Vec::new(),
    })
}

/// A reference figure a result is compared with (PERFORMANCE.md, same H200).
#[derive(Clone, Debug, Serialize)]
pub struct Anchor {
    pub what: &'static str,
    pub ms_per_token: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(context: usize, median_ms: f64) -> DecodeReport {
        DecodeReport {
            config: "nemotron-3-nano-30b-a3b".into(),
            context,
            format: "q8_0".into(),
            device: "d".into(),
            fused: true,
            tokens: 10,
            median_ms,
            mean_ms: median_ms,
            p10_ms: median_ms,
            p90_ms: median_ms,
            tokens_per_s: 1000.0 / median_ms,
            gb_per_s: 0.0,
            bytes_per_token: 0,
            dispatches_per_token: 0,
            sections_ms: Vec::new(),
            kernels_ms: Vec::new(),
            gpu_ms: 0.0,
            host_ms: (0.0, 0.0),
            host_p90_ms: (0.0, 0.0),
            slow_tokens: 0,
            host_encode_ms: 0.0,
            host_submit_ms: 0.0,
            anchors: Vec::new(),
        }
    }

    #[test]
    fn context_growth_compares_the_longest_with_the_shortest() {
        // Run 69's medians: 2.278 ms at 1k, 2.634 at 32k (16k in between, in any order).
        let g = ContextGrowth::of(&[
            report(16384, 2.42),
            report(32768, 2.634),
            report(1024, 2.278),
        ])
        .unwrap();
        assert_eq!((g.short_context, g.long_context), (1024, 32768));
        assert!((g.ratio - 2.634 / 2.278).abs() < 1e-12);
        assert_eq!(g.target, Some(1.25));
        assert!(
            g.text().ends_with("= 1.16× (target ≤ 1.25×: met)\n"),
            "{}",
            g.text()
        );
        let slow = ContextGrowth::of(&[report(1024, 2.0), report(32768, 2.6)]).unwrap();
        assert!(
            slow.text().contains("1.30× (target ≤ 1.25×: not met)"),
            "{}",
            slow.text()
        );
        assert!(ContextGrowth::of(&[report(1024, 2.0)]).is_none());
        // Other lengths: the ratio, without the 1k → 32k target.
        let other = ContextGrowth::of(&[report(4096, 2.0), report(32768, 2.2)]).unwrap();
        assert_eq!(other.target, None);
    }

    #[test]
    fn a_report_says_how_many_times_faster_or_slower() {
        // Run 235's Nano on an H100 against the 1.7 ms target and the 4.12 ms peer.
        let mut r = report(1024, 2.064);
        r.anchors = vec![
            (
                Anchor {
                    what: "target",
                    ms_per_token: 1.7,
                },
                1.7 / 2.064,
            ),
            (
                Anchor {
                    what: "peer",
                    ms_per_token: 4.12,
                },
                4.12 / 2.064,
            ),
        ];
        let text = r.text();
        assert!(
            text.contains("vs target: 1.700 ms → 1.21× slower"),
            "{text}"
        );
        assert!(text.contains("vs peer: 4.120 ms → 2.00× faster"), "{text}");
        assert_eq!(versus(1.0), "1.00× faster");
    }

    #[test]
    fn moe_presets_have_the_published_sizes() {
        // (preset, blocks of each kind [M, *, -, E], total B, active B): NVIDIA's card says
        // 31.6B / 3.2B; IBM's 7B / 1B (tiny) and 32B / 9B (small). Active counts the head,
        // not the embedding table.
        for (name, kinds, total, active) in [
            ("nemotron-3-nano-30b-a3b", [23, 6, 0, 23], 31.6, 3.2),
            ("granite-4.0-h-tiny", [36, 4, 0, 40], 6.9, 1.5),
            ("granite-4.0-h-small", [36, 4, 0, 40], 32.2, 8.8),
        ] {
            let c = preset(name).unwrap();
            let count = [
                BlockKind::Mamba2,
                BlockKind::Attention,
                BlockKind::Mlp,
                BlockKind::Moe,
            ]
            .map(|k| c.count(k));
            assert_eq!(count, kinds, "{name}");
            let (t, a) = (
                c.param_count() as f64 / 1e9,
                c.active_param_count() as f64 / 1e9,
            );
            assert!((t - total).abs() < 0.3, "{name}: {t:.2}B total");
            assert!((a - active).abs() < 0.3, "{name}: {a:.2}B active");
        }
    }
}

/// The anchors of a preset's decode (ms per token, batch 1).
pub fn anchors(preset: &str, format: &str) -> Vec<Anchor> {
    let mut a = Vec::new();
    let expert = "PyTorch cuBLAS bf16 + mamba_ssm Triton, CUDA graph";
    match preset {
        "130m" => {
            a.push(Anchor {
                what: expert,
                ms_per_token: 1.24,
            });
            a.push(Anchor {
                what: "HF transformers eager bf16",
                ms_per_token: 1000.0 / 40.9,
            });
            a.push(Anchor {
                what: "target",
                ms_per_token: 0.3,
            });
        }
        "2.7b" => {
            a.push(Anchor {
                what: expert,
                ms_per_token: 4.57,
            });
            if format == "f16" {
                a.push(Anchor {
                    what: "target (f16)",
                    ms_per_token: 2.0,
                });
            }
        }
        "codestral-7b" => {
            a.push(Anchor {
                what: expert,
                ms_per_token: 6.73,
            });
            a.push(Anchor {
                what: "HF transformers eager bf16",
                ms_per_token: 1000.0 / 13.6,
            });
            match format {
                "q8_0" => a.push(Anchor {
                    what: "target (q8_0)",
                    ms_per_token: 2.5,
                }),
                "f16" => a.push(Anchor {
                    what: "target (f16)",
                    ms_per_token: 4.0,
                }),
                _ => {}
            }
        }
        "nemotron-h-8b" => {
            let peer = "llama.cpp Vulkan, same H200 (1k context)";
            match format {
                "q8_0" => {
                    a.push(Anchor {
                        what: peer,
                        ms_per_token: 5.04,
                    });
                    a.push(Anchor {
                        what: "target (q8_0, 2x the 1.92 ms floor)",
                        ms_per_token: 3.85,
                    });
                }
                "f16" => a.push(Anchor {
                    what: peer,
                    ms_per_token: 5.92,
                }),
                _ => {}
            }
        }
        "nemotron-3-nano-30b-a3b" if format == "q8_0" => {
            a.push(Anchor {
                what: "llama.cpp Vulkan, same H200 (1k context)",
                ms_per_token: 4.12,
            });
            a.push(Anchor {
                what: "target (q8_0, 2x the active-weight floor)",
                ms_per_token: 1.7,
            });
        }
        _ => {}
    }
    a
}

/// How much slower decode runs with a long context than with a short one (`bench --ctx A,B`:
/// the longest against the shortest), against the preset's target where it has one.
#[derive(Clone, Debug, Serialize)]
pub struct ContextGrowth {
    pub config: String,
    pub format: String,
    pub short_context: usize,
    pub short_ms: f64,
    pub long_context: usize,
    pub long_ms: f64,
    /// long_ms / short_ms.
    pub ratio: f64,
    /// The most the ratio may be: Nemotron 3 Nano q8_0 from 1024 to 32768 tokens, 1.25 (the
    /// MoE issue).
    pub target: Option<f64>,
}

impl ContextGrowth {
    /// The longest against the shortest context of `reports` (decode runs of one model and
    /// format); None with fewer than two contexts.
    pub fn of(reports: &[DecodeReport]) -> Option<Self> {
        let short = reports.iter().min_by_key(|r| r.context)?;
        let long = reports.iter().max_by_key(|r| r.context)?;
        if long.context == short.context || short.median_ms <= 0.0 {
            return None;
        }
        let target = (long.config == "nemotron-3-nano-30b-a3b"
            && long.format == "q8_0"
            && (short.context, long.context) == (1024, 32768))
            .then_some(1.25);
        Some(ContextGrowth {
            config: long.config.clone(),
            format: long.format.clone(),
            short_context: short.context,
            short_ms: short.median_ms,
            long_context: long.context,
            long_ms: long.median_ms,
            ratio: long.median_ms / short.median_ms,
            target,
        })
    }

    /// A human-readable summary.
    pub fn text(&self) -> String {
        let target = match self.target {
            Some(t) => format!(
                " (target ≤ {t:.2}×: {})",
                if self.ratio <= t { "met" } else { "not met" }
            ),
            None => String::new(),
        };
        format!(
            "{} {}: decode at {} tokens of context {:.3} ms / at {} {:.3} ms = {:.2}×{target}\n",
            self.config,
            self.format,
            self.long_context,
            self.long_ms,
            self.short_context,
            self.short_ms,
            self.ratio,
        )
    }
}

/// One decode benchmark's figures.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeReport {
    pub config: String,
    /// Tokens already in the KV caches when timing started.
    pub context: usize,
    pub format: String,
    pub device: String,
    pub fused: bool,
    pub tokens: usize,
    pub median_ms: f64,
    /// The timed tokens' wall time over their count: what a throughput figure (llama.cpp's
    /// tokens/s) measures, slow tokens included, where the median does not see them.
    pub mean_ms: f64,
    pub p10_ms: f64,
    pub p90_ms: f64,
    pub tokens_per_s: f64,
    /// Weights + state read and written per token, over the median time.
    pub gb_per_s: f64,
    pub bytes_per_token: u64,
    pub dispatches_per_token: usize,
    /// Median GPU time per section over the profiled tokens (empty without timestamps).
    pub sections_ms: Vec<(String, f64)>,
    /// Median GPU time per kernel kind (name without the layer prefix), summed over layers.
    pub kernels_ms: Vec<(String, f64)>,
    pub gpu_ms: f64,
    /// Median host time per timed token recording and submitting its dispatches (no
    /// timestamps): the token rate's bound where the GPU is faster.
    pub host_ms: (f64, f64),
    /// The same times' 90th percentiles: slow tokens whose recording or submitting was
    /// slow too point at the host.
    pub host_p90_ms: (f64, f64),
    /// Timed tokens that arrived more than 1.5× the median after the one before.
    pub slow_tokens: usize,
    pub host_encode_ms: f64,
    pub host_submit_ms: f64,
    pub anchors: Vec<(Anchor, f64)>,
}

fn median(v: &mut [f64]) -> f64 {
    quantile(v, 0.5)
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Times `tokens` greedy decode steps (after `warmup`) as the host sees them arrive, then
/// profiles `profiled` more tokens when the adapter has timestamps.
pub fn decode(
    backend: &mut GpuBackend,
    preset_name: &str,
    tokens: usize,
    warmup: usize,
    profiled: usize,
    cached: usize,
) -> Result<DecodeReport> {
    if tokens < 2 {
        return Err(Error::InvalidInput("bench needs at least 2 tokens".into()));
    }
    // A GPU idle through the model's build is still ramping up for the first few hundred
    // tokens: `warmup` tokens alone left a job's first decode of a model slow (Granite-4.0-
    // H-Tiny 1.887 ms/token with 38 of 100 tokens over 1.5× the median, 1.751 once warm;
    // runs 186–187). (It leaves the state reset.)
    warm_up(backend)?;
    // Decode speed with `cached` tokens already in the KV caches: their values do not
    // change the work, so the caches are taken as filled (zeros) up to that length.
    backend
        .engine
        .check_room(cached + warmup + tokens + profiled + 2)?;
    backend.engine.len = cached;
    let greedy = Sampling::greedy();
    let first = backend.prefill_sample(&[1], &greedy, 1)?;
    let mut arrivals: Vec<Instant> = Vec::with_capacity(warmup + tokens);
    backend.host_times = Some(Vec::with_capacity(warmup + tokens + 1));
    let run = backend.decode(first, 2, warmup + tokens + 1, &greedy, &[], &mut |_| {
        arrivals.push(Instant::now());
        true
    });
    let host = backend.host_times.take().unwrap_or_default();
    run?;
    let skip = warmup.min(host.len());
    let host_q = |f: fn(&(f64, f64)) -> f64, q: f64| {
        let mut v: Vec<f64> = host[skip..].iter().map(f).collect();
        quantile(&mut v, q) / 1e6
    };
    let host_ms = (host_q(|h| h.0, 0.5), host_q(|h| h.1, 0.5));
    let host_p90_ms = (host_q(|h| h.0, 0.9), host_q(|h| h.1, 0.9));
    let mut gaps = gaps_ms(&arrivals, warmup);
    let mean = gaps.iter().sum::<f64>() / gaps.len().max(1) as f64;
    let (p10, p90) = (quantile(&mut gaps, 0.1), quantile(&mut gaps, 0.9));
    let med = median(&mut gaps);
    let slow_tokens = gaps.iter().filter(|g| **g > 1.5 * med).count();
    let mut profiles: Vec<TokenProfile> = Vec::new();
    if profiled > 0 && backend.set_profiling(true)? {
        backend.profiles.clear();
        backend.decode(first, 2, profiled, &greedy, &[], &mut |_| true)?;
        profiles = std::mem::take(&mut backend.profiles);
        backend.set_profiling(false)?;
    }
    let per = |f: &dyn Fn(&TokenProfile) -> f64| {
        let mut v: Vec<f64> = profiles.iter().map(f).collect();
        median(&mut v) / 1e6
    };
    let sections_ms = if profiles.is_empty() {
        Vec::new()
    } else {
        Section::ALL
            .iter()
            .map(|s| (s.name().to_string(), per(&|p| p.section_ns(*s)).max(0.0)))
            .collect()
    };
    let mut kinds: Vec<String> = Vec::new();
    for k in profiles
        .first()
        .map(|p| p.kernels.as_slice())
        .unwrap_or(&[])
    {
        let kind = k.kind();
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    let kernels_ms = kinds
        .into_iter()
        .map(|kind| {
            let v = per(&|p| {
                p.kernels
                    .iter()
                    .filter(|k| k.kind() == kind)
                    .map(|k| k.ns)
                    .sum()
            });
            (kind, v)
        })
        .collect();
    let engine = &backend.engine;
    let bytes = engine.bytes_per_token(cached);
    let format = engine.format.name().to_string();
    let anchors = anchors(preset_name, &format).into_iter().map(|a| {
        let ratio = a.ms_per_token / med;
        (a, ratio)
    });
    Ok(DecodeReport {
        config: preset_name.to_string(),
        context: cached,
        format,
        device: engine.ctx().describe(),
        fused: engine.fused,
        tokens,
        median_ms: med,
        mean_ms: mean,
        p10_ms: p10,
        p90_ms: p90,
        tokens_per_s: 1e3 / med,
        gb_per_s: bytes as f64 / (med * 1e-3) / 1e9,
        bytes_per_token: bytes,
        dispatches_per_token: engine.graph(crate::gpu::graph::Tail::Greedy).len(),
        sections_ms,
        kernels_ms,
        host_ms,
        host_p90_ms,
        slow_tokens,
        gpu_ms: if profiles.is_empty() {
            f64::NAN
        } else {
            per(&|p| p.gpu_ns())
        },
        host_encode_ms: if profiles.is_empty() {
            f64::NAN
        } else {
            per(&|p| p.encode_ns)
        },
        host_submit_ms: if profiles.is_empty() {
            f64::NAN
        } else {
            per(&|p| p.submit_ns)
        },
        anchors: anchors.collect(),
    })
}

/// The CPU reference's decode speed at a preset's shapes (random weights made on the host).
#[derive(Clone, Debug, Serialize)]
pub struct CpuReport {
    pub config: String,
    pub threads: usize,
    pub tokens: usize,
    pub median_ms: f64,
    pub tokens_per_s: f64,
}

/// Times `tokens` decode steps of the f32 CPU reference (after `warmup`).
pub fn decode_cpu(
    preset_name: &str,
    config: &ModelConfig,
    tokens: usize,
    warmup: usize,
) -> Result<CpuReport> {
    const MAX_PARAMS: usize = 1_500_000_000;
    if config.param_count() > MAX_PARAMS {
        return Err(Error::InvalidInput(format!(
            "`{preset_name}` has {:.1}B parameters; the CPU benchmark stops at 1.5B (f32 weights in host memory)",
            config.param_count() as f64 / 1e9
        )));
    }
    let model = crate::model::Model::synthetic(config.clone(), 7);
    let cpu = crate::reference::CpuModel::<f32>::new(config, &model.weights)?;
    drop(model);
    let mut backend = crate::session::CpuBackend::new(cpu);
    // A hybrid's KV cache ends at its context, where decoding stops short: timings of fewer
    // tokens than asked (or none) would be reported as the asked ones.
    let need = warmup.saturating_add(tokens).saturating_add(2);
    if let Some(ctx) = backend.context()
        && need > ctx
    {
        return Err(Error::InvalidInput(format!(
            "`{preset_name}` holds {ctx} tokens on the CPU reference (its context): --warmup \
             {warmup} + --tokens {tokens} need {need}"
        )));
    }
    let greedy = Sampling::greedy();
    let first = backend.prefill_sample(&[1], &greedy, 1)?;
    let mut arrivals = Vec::with_capacity(warmup + tokens + 1);
    arrivals.push(Instant::now());
    backend.decode(first, 2, warmup + tokens, &greedy, &[], &mut |_| {
        arrivals.push(Instant::now());
        true
    })?;
    if arrivals.len() != warmup + tokens + 1 {
        return Err(Error::InvalidInput(format!(
            "`{preset_name}`: the CPU reference decoded {} of the {} tokens asked",
            arrivals.len() - 1,
            warmup + tokens
        )));
    }
    let mut gaps = gaps_ms(&arrivals, warmup);
    let med = median(&mut gaps);
    Ok(CpuReport {
        config: preset_name.to_string(),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        tokens,
        median_ms: med,
        tokens_per_s: 1e3 / med,
    })
}

/// One prefill benchmark's figures.
#[derive(Clone, Debug, Serialize)]
pub struct PrefillReport {
    pub config: String,
    pub format: String,
    pub device: String,
    pub tokens: usize,
    pub chunk: usize,
    /// Median wall time of the whole prompt (prefill + first token), over the runs.
    pub median_ms: f64,
    pub tokens_per_s: f64,
    /// GPU time per section and per kernel kind, summed over the prompt's blocks.
    pub sections_ms: Vec<(String, f64)>,
    pub kernels_ms: Vec<(String, f64)>,
    /// FLOPs of the projections (2·T·params of in_proj, out_proj) and the rate achieved.
    pub gemm_tflops: f64,
    /// Each GEMM kind and weight shape: GPU time summed over layers and blocks, and rate.
    pub gemm_shapes: Vec<GemmRate>,
    pub anchors: Vec<(Anchor, f64)>,
}

/// One GEMM kind of a prefill profile (`mamba2/in_proj+conv` over `rows` × `cols` weights
/// in every layer that has it): its GPU time for the prompt and TFLOP/s.
#[derive(Clone, Debug, Serialize)]
pub struct GemmRate {
    pub kind: String,
    pub rows: usize,
    pub cols: usize,
    pub ms: f64,
    pub tflops: f64,
}

/// The GEMMs of a profile of a `tokens`-token prompt, by kind and shape.
fn gemm_rates(profile: &[crate::gpu::profiler::KernelTime], tokens: usize) -> Vec<GemmRate> {
    // Every block records the same dispatches: the first one's count is the block count.
    let blocks = match profile.first() {
        Some(first) => profile.iter().filter(|k| k.name == first.name).count(),
        None => return Vec::new(),
    };
    let mut out: Vec<GemmRate> = Vec::new();
    // FLOPs summed alongside, then turned into rates.
    let mut flops: Vec<f64> = Vec::new();
    for k in profile {
        let Some((rows, cols)) = k.label.gemm else {
            continue;
        };
        let kind = k.kind();
        let f = 2.0 * (tokens as f64 / blocks as f64) * rows as f64 * cols as f64;
        match out
            .iter()
            .position(|g| g.kind == kind && (g.rows, g.cols) == (rows, cols))
        {
            Some(i) => {
                out[i].ms += k.ns / 1e6;
                flops[i] += f;
            }
            None => {
                out.push(GemmRate {
                    kind,
                    rows,
                    cols,
                    ms: k.ns / 1e6,
                    tflops: 0.0,
                });
                flops.push(f);
            }
        }
    }
    for (g, f) in out.iter_mut().zip(flops) {
        g.tflops = if g.ms > 0.0 {
            f / (g.ms * 1e-3) / 1e12
        } else {
            f64::NAN
        };
    }
    out
}

/// Least time `prefill` spends in warm-up runs, after its first, before it times any.
const PREFILL_WARMUP: std::time::Duration = std::time::Duration::from_millis(2000);

/// Times prompts of `tokens` tokens: `runs` timed runs after one run and warm-up runs of at
/// least PREFILL_WARMUP, then one profiled run for the split.
pub fn prefill(
    backend: &mut GpuBackend,
    preset_name: &str,
    tokens: usize,
    runs: usize,
) -> Result<PrefillReport> {
    if tokens == 0 {
        return Err(Error::InvalidInput(
            "prefill length must be positive".into(),
        ));
    }
    let vocab = backend.engine.config.vocab_size as f32;
    let prompt: Vec<u32> = (0..tokens as u64)
        .map(|i| (crate::sampling::uniform(99, i) * vocab) as u32)
        .collect();
    let greedy = Sampling::greedy();
    // Warm-up runs for at least PREFILL_WARMUP: after the seconds of building a model the
    // GPU idles at low clocks, and one short prompt does not bring them back (H200: a 2.7b
    // 5-token block timed 43.7 ms first, 10.5 once warm, run 95; 0.3 s of warm-up still
    // left Nemotron 3 Nano's first 5-token blocks at 51.7 ms against 20.7 for 32 tokens
    // after them, run 97). The clock starts after the first run, which builds the prefill
    // blocks and compiles their pipelines (counted from before it, that run could be the
    // whole warm-up). 1 s was not always enough: Granite-4.0-H-Tiny's kernels ran at half
    // speed for ~1.3 s after its build, so a job's first prompt length measured 2–3× its
    // kernel time (run 189: 128 tokens measured first 71.8 ms against 33.0 of kernels; 512
    // tokens 27.3 ms measured next, 108.3 measured first in run 187).
    backend.reset()?;
    backend.prefill_sample(&prompt, &greedy, tokens as u64)?;
    let warm_start = Instant::now();
    while warm_start.elapsed() < PREFILL_WARMUP {
        backend.reset()?;
        backend.prefill_sample(&prompt, &greedy, tokens as u64)?;
    }
    let mut times = Vec::new();
    for _ in 0..runs {
        backend.reset()?;
        let t0 = Instant::now();
        backend.prefill_sample(&prompt, &greedy, tokens as u64)?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let med = median(&mut times);
    backend.reset()?;
    let profile = backend.profile_prefill(&prompt).unwrap_or_default();
    let sum_by = |key: &dyn Fn(&crate::gpu::profiler::KernelTime) -> String| {
        let mut out: Vec<(String, f64)> = Vec::new();
        for k in &profile {
            let name = key(k);
            match out.iter_mut().find(|(n, _)| *n == name) {
                Some((_, v)) => *v += k.ns / 1e6,
                None => out.push((name, k.ns / 1e6)),
            }
        }
        out
    };
    let c = &backend.engine.config;
    let flops = 2.0
        * tokens as f64
        * (c.d_in_proj() * c.d_model + c.d_model * c.d_inner) as f64
        * c.n_layer as f64;
    let gemm_ms: f64 = profile
        .iter()
        .filter(|k| k.section == Section::Matmul)
        .map(|k| k.ns / 1e6)
        .sum();
    let peers: &[(&str, f64)] = match (preset_name, tokens) {
        ("codestral-7b", 4096) => &[
            ("cuBLAS bf16 tensor cores + mamba_ssm Triton SSD", 176.0),
            ("target", 500.0),
        ],
        // 8068 tok/s (Q8_0, the same H200).
        ("nemotron-3-nano-30b-a3b", 4096) => &[("llama.cpp Vulkan, same H200", 507.7)],
        _ => &[],
    };
    let anchors: Vec<(Anchor, f64)> = peers
        .iter()
        .map(|&(what, ms)| {
            (
                Anchor {
                    what,
                    ms_per_token: ms,
                },
                ms / med,
            )
        })
        .collect();
    Ok(PrefillReport {
        config: preset_name.to_string(),
        format: backend.engine.format.name().to_string(),
        device: backend.engine.ctx().describe(),
        tokens,
        chunk: backend.engine.chunk,
        median_ms: med,
        tokens_per_s: tokens as f64 / (med / 1e3),
        sections_ms: sum_by(&|k| k.section.name().to_string()),
        kernels_ms: sum_by(&|k| k.kind()),
        gemm_tflops: if gemm_ms > 0.0 {
            flops / (gemm_ms * 1e-3) / 1e12
        } else {
            f64::NAN
        },
        gemm_shapes: gemm_rates(&profile, tokens),
        anchors,
    })
}

impl PrefillReport {
    pub fn text(&self) -> String {
        let mut s = format!(
            "{} {} prefill of {} tokens (chunk {}) on {}: {:.1} ms = {:.0} tok/s\n  GEMMs at {:.1} TFLOP/s\n  sections:",
            self.config,
            self.format,
            self.tokens,
            self.chunk,
            self.device,
            self.median_ms,
            self.tokens_per_s,
            self.gemm_tflops
        );
        s += &join_ms(&self.sections_ms, 1, "");
        s += "\n  kernels:";
        s += &join_ms(&self.kernels_ms, 2, ";");
        s += "\n  GEMM shapes:";
        for g in &self.gemm_shapes {
            s += &format!(
                " {} {}×{} {:.1} ms {:.1} TFLOP/s;",
                g.kind, g.rows, g.cols, g.ms, g.tflops
            );
        }
        s += "\n";
        for (a, ratio) in &self.anchors {
            s += &format!(
                "  vs {}: {:.0} ms → {}\n",
                a.what,
                a.ms_per_token,
                versus(*ratio)
            );
        }
        s
    }
}

/// A speed against an anchor's, `ratio` = the anchor's time over ours: "1.95× faster", or
/// "1.21× slower" (the anchor's speed over ours, never a "0.82× slower").
fn versus(ratio: f64) -> String {
    if !(ratio > 0.0 && ratio.is_finite()) {
        // (No anchor has a time of 0 or none; say what the ratio is rather than "inf×".)
        return format!("a ratio of {ratio}");
    }
    if ratio >= 1.0 {
        format!("{ratio:.2}× faster")
    } else {
        format!("{:.2}× slower", 1.0 / ratio)
    }
}

/// " name 1.234 name 0.567…" with `prec` decimals and `sep` after each value.
fn join_ms(items: &[(String, f64)], prec: usize, sep: &str) -> String {
    items
        .iter()
        .map(|(n, ms)| format!(" {n} {ms:.prec$}{sep}"))
        .collect()
}

/// Milliseconds between consecutive arrivals, the first `warmup` dropped.
fn gaps_ms(arrivals: &[Instant], warmup: usize) -> Vec<f64> {
    arrivals
        .windows(2)
        .skip(warmup)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .collect()
}

impl DecodeReport {
    /// A human-readable summary.
    pub fn text(&self) -> String {
        let mut s = format!(
            "{} {} on {} ({}{})\n  decode: {:.3} ms/token median (mean {:.3}, p10 {:.3}, p90 {:.3}) over {} tokens = {:.1} tok/s\n  traffic: {:.1} MB/token → {:.0} GB/s\n  dispatches/token: {}\n",
            self.config,
            self.format,
            self.device,
            if self.fused { "fused" } else { "unfused" },
            if self.context > 0 {
                format!(", {} tokens of context cached", self.context)
            } else {
                String::new()
            },
            self.median_ms,
            self.mean_ms,
            self.p10_ms,
            self.p90_ms,
            self.tokens,
            self.tokens_per_s,
            self.bytes_per_token as f64 / 1e6,
            self.gb_per_s,
            self.dispatches_per_token,
        );
        s += &format!(
            "  host per token: {:.3} ms recording the dispatches, {:.3} ms submitting them (p90 {:.3}, {:.3}); {} of {} tokens over 1.5× the median\n",
            self.host_ms.0,
            self.host_ms.1,
            self.host_p90_ms.0,
            self.host_p90_ms.1,
            self.slow_tokens,
            self.tokens
        );
        if !self.sections_ms.is_empty() {
            s += &format!(
                "  GPU time/token {:.3} ms (host encode {:.3} ms, submit {:.3} ms)\n  sections:",
                self.gpu_ms, self.host_encode_ms, self.host_submit_ms
            );
            s += &join_ms(&self.sections_ms, 3, "");
            s += "\n  kernels:";
            s += &join_ms(&self.kernels_ms, 3, ";");
            s += "\n";
        }
        for (a, ratio) in &self.anchors {
            s += &format!(
                "  vs {}: {:.3} ms → {}\n",
                a.what,
                a.ms_per_token,
                versus(*ratio)
            );
        }
        s
    }
}

/// Time to first token of a request whose first `prefix` tokens are in the prefix cache
/// and whose last `new` tokens are not: the state restored from a device snapshot (or from
/// host memory), the new tokens fed, the first token sampled.
#[derive(Clone, Debug, Serialize)]
pub struct CachedPrefixReport {
    pub config: String,
    pub format: String,
    pub device: String,
    pub prefix: usize,
    pub new_tokens: usize,
    /// Bytes of one cache entry (the snapshot).
    pub entry_bytes: u64,
    /// Median ms: restore from a device snapshot + feed `new` + sample.
    pub device_ms: f64,
    /// The same from a host-memory entry (uploaded first).
    pub host_ms: f64,
    /// Median ms of the whole prompt fed from a fresh state (no cache).
    pub cold_ms: f64,
    /// The target for a 4096-token cached prefix, and device_ms as a ratio to it.
    pub target_ms: f64,
}

/// Times `runs` cached-prefix requests after one warm-up (see `CachedPrefixReport`).
pub fn cached_prefix(
    backend: &mut GpuBackend,
    preset_name: &str,
    prefix: usize,
    new: usize,
    runs: usize,
) -> Result<CachedPrefixReport> {
    if prefix == 0 || new == 0 {
        return Err(Error::InvalidInput(
            "the cached prefix and the new tokens must both be at least 1".into(),
        ));
    }
    let vocab = backend.engine.config.vocab_size as f32;
    let prompt: Vec<u32> = (0..(prefix + new) as u64)
        .map(|i| (crate::sampling::uniform(98, i) * vocab) as u32)
        .collect();
    let greedy = Sampling::greedy();
    let pos = (prefix + new) as u64;
    backend.reset()?;
    backend.prefill_sample(&prompt[..prefix], &greedy, prefix as u64)?;
    let device = backend.snapshot()?;
    let entry_bytes = backend.snapshot_device_bytes();
    let host = backend.snapshot_state(device.as_ref())?;
    let time = |backend: &mut GpuBackend, what: &dyn Fn(&mut GpuBackend) -> Result<()>| {
        let mut times = Vec::new();
        for run in 0..=runs {
            let t0 = Instant::now();
            what(backend)?;
            if run > 0 {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok::<f64, Error>(median(&mut times))
    };
    let suffix = &prompt[prefix..];
    let device_ms = time(backend, &|b| {
        b.restore(device.as_ref())?;
        b.prefill_sample(suffix, &greedy, pos).map(|_| ())
    })?;
    let host_ms = time(backend, &|b| {
        b.restore(&host)?;
        b.prefill_sample(suffix, &greedy, pos).map(|_| ())
    })?;
    let cold_ms = time(backend, &|b| {
        b.reset()?;
        b.prefill_sample(&prompt, &greedy, pos).map(|_| ())
    })?;
    Ok(CachedPrefixReport {
        config: preset_name.to_string(),
        format: backend.engine.format.name().to_string(),
        device: backend.engine.ctx().describe(),
        prefix,
        new_tokens: new,
        entry_bytes,
        device_ms,
        host_ms,
        cold_ms,
        target_ms: 20.0,
    })
}

impl CachedPrefixReport {
    pub fn text(&self) -> String {
        format!(
            "{} {} on {}: first token after a cached {}-token prefix + {} new tokens\n  \
             from a device snapshot {:.2} ms, from host memory {:.2} ms, uncached {:.1} ms \
             ({:.1}× faster); entry {:.1} MB; target {:.0} ms\n",
            self.config,
            self.format,
            self.device,
            self.prefix,
            self.new_tokens,
            self.device_ms,
            self.host_ms,
            self.cold_ms,
            self.cold_ms / self.device_ms,
            self.entry_bytes as f64 / 1e6,
            self.target_ms,
        )
    }
}

/// Batched decode: `batch` sequences (each from its own one-token prompt, greedy) advanced
/// together, aggregate tokens per second; batch 1 is the one-sequence decode. `exact` says
/// whether every lane's tokens equal the same sequence decoded alone.
#[derive(Clone, Debug, Serialize)]
pub struct BatchReport {
    pub config: String,
    pub format: String,
    pub device: String,
    pub batch: usize,
    /// Steps timed (each lane samples one token per step).
    pub steps: usize,
    /// Wall ms per step (all lanes), median over the timed runs of `steps` steps.
    pub ms_per_step: f64,
    /// Tokens per second over all lanes.
    pub tokens_per_s: f64,
    /// Every lane's tokens equal its sequence decoded alone.
    pub exact: bool,
    /// GPU ms per kernel kind (summed over layers) of one profiled step, slowest first
    /// (empty without timestamp queries, and for batch 1: see the decode report).
    pub kernels_ms: Vec<(String, f64)>,
}

impl BatchReport {
    pub fn text(&self) -> String {
        format!(
            "{} {} on {}: batch {:>3}: {:.3} ms/step, {:.1} tok/s aggregate ({}) \n",
            self.config,
            self.format,
            self.device,
            self.batch,
            self.ms_per_step,
            self.tokens_per_s,
            if self.exact {
                "every lane equals its run alone"
            } else {
                "LANES DIFFER FROM THEIR RUNS ALONE"
            }
        ) + &if self.kernels_ms.is_empty() {
            String::new()
        } else {
            format!(
                "  GPU {:.3} ms/step; kernels:{}\n",
                self.kernels_ms.iter().map(|k| k.1).sum::<f64>(),
                join_ms(&self.kernels_ms, 3, ";")
            )
        }
    }
}

/// Times batched decode at `batch` lanes: `steps` steps after `warmup`, `runs` times.
pub fn batch(
    backend: &mut GpuBackend,
    preset_name: &str,
    batch: usize,
    steps: usize,
    warmup: usize,
    runs: usize,
) -> Result<BatchReport> {
    if batch == 0 || steps == 0 || runs == 0 {
        return Err(Error::InvalidInput(
            "batch, steps and runs must each be at least 1".into(),
        ));
    }
    let vocab = backend.engine.config.vocab_size as f32;
    let greedy = Sampling::greedy();
    let prompt = |lane: usize| (crate::sampling::uniform(77, lane as u64) * vocab) as u32;
    if batch == 1 {
        warm_up(backend)?;
    }
    // Each lane's tokens alone (and batch 1's timing).
    let mut alone: Vec<Vec<u32>> = Vec::new();
    let mut solo_ms = Vec::new();
    for lane in 0..batch {
        backend.reset()?;
        let first = backend.prefill_sample(&[prompt(lane)], &greedy, 1)?;
        let mut toks = vec![first];
        let mut last = first;
        let t0 = Instant::now();
        let mut mark = t0;
        for run in 0..=runs {
            let n = if run == 0 { warmup.max(1) } else { steps };
            backend.decode(last, toks.len() as u64 + 1, n, &greedy, &[], &mut |t| {
                toks.push(t);
                true
            })?;
            last = *toks.last().unwrap_or(&first);
            if run > 0 && batch == 1 {
                solo_ms.push(mark.elapsed().as_secs_f64() * 1e3 / steps as f64);
            }
            mark = Instant::now();
        }
        alone.push(toks);
        if batch > 1 && lane >= 3 {
            // Enough lanes checked against their runs alone; the rest share the graph.
            break;
        }
    }
    let (ms, exact, kernels) = if batch == 1 {
        (median(&mut solo_ms), true, Vec::new())
    } else {
        backend.enable_batch(batch)?;
        warm_up_batch(backend, batch, &prompt)?;
        join_lanes(backend, batch, &prompt)?;
        let mut got: Vec<Vec<u32>> = alone.iter().map(|a| a[..1].to_vec()).collect();
        got.resize(batch, Vec::new());
        let mut times = Vec::new();
        for run in 0..=runs {
            let n = if run == 0 { warmup.max(1) } else { steps };
            let t0 = Instant::now();
            let b = backend.batch.as_mut().ok_or_else(no_batch)?;
            b.step(&backend.engine, n, &mut |lane, c| {
                got[lane].push(c.token);
                true
            })?;
            if run > 0 {
                times.push(t0.elapsed().as_secs_f64() * 1e3 / steps as f64);
            }
        }
        let exact = alone.iter().zip(&got).all(|(a, g)| a == g);
        let b = backend.batch.as_mut().ok_or_else(no_batch)?;
        let kernels = b.profile_step(&backend.engine)?.unwrap_or_default();
        backend.batch = None;
        (median(&mut times), exact, kernels)
    };
    let mut kernels_ms: Vec<(String, f64)> = Vec::new();
    for k in &kernels {
        let kind = k.kind();
        match kernels_ms.iter_mut().find(|(n, _)| *n == kind) {
            Some(e) => e.1 += k.ns / 1e6,
            None => kernels_ms.push((kind, k.ns / 1e6)),
        }
    }
    kernels_ms.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok(BatchReport {
        config: preset_name.to_string(),
        format: backend.engine.format.name().to_string(),
        device: backend.engine.ctx().describe(),
        batch,
        steps,
        ms_per_step: ms,
        tokens_per_s: batch as f64 * 1e3 / ms,
        exact,
        kernels_ms,
    })
}

/// The least wall time `warm_up` decodes for.
const WARM_UP: std::time::Duration = std::time::Duration::from_millis(300);

/// The most tokens `warm_up` decodes.
const WARM_UP_TOKENS: usize = 512;

/// Decodes and drops tokens for `WARM_UP` (at most `WARM_UP_TOKENS`, and no more than the
/// KV caches hold) before a decode measurement and batch 1's timed runs: the latter's 2 ×
/// 32 steps after 4 warm-up tokens are over in a fraction of a second, and as a job's
/// first measurement on a fresh H200 they ran up to 1.8× slow (BENCHMARKS.md, runs
/// 129–133: Codestral batch 1 5.89 ms/step against 3.32), a GPU still ramping up.
fn warm_up(backend: &mut GpuBackend) -> Result<()> {
    const CHUNK: usize = 16;
    backend.reset()?;
    let greedy = Sampling::greedy();
    let mut last = backend.prefill_sample(&[1], &greedy, 1)?;
    let t0 = Instant::now();
    let mut done = 0;
    while done + CHUNK <= WARM_UP_TOKENS
        && t0.elapsed() < WARM_UP
        && backend.engine.check_room(CHUNK + 1).is_ok()
    {
        backend.decode(last, done as u64 + 2, CHUNK, &greedy, &[], &mut |t| {
            last = t;
            true
        })?;
        done += CHUNK;
    }
    backend.reset()
}

/// Steps `batch` throw-away lanes for `WARM_UP` (at most `WARM_UP_TOKENS` steps, and no
/// more than the KV caches hold), then frees them, before a batch's timed runs: the
/// store's allocation (KV caches for every slot on the hybrids) leaves the GPU idle long
/// enough to clock down, and a few warm-up steps did not bring it back (BENCHMARKS.md, runs
/// 131, 138 and 143: hybrid batch steps at 1.3–1.7× their GPU time, now and then).
fn warm_up_batch(
    backend: &mut GpuBackend,
    batch: usize,
    prompt: &dyn Fn(usize) -> u32,
) -> Result<()> {
    const CHUNK: usize = 16;
    join_lanes(backend, batch, prompt)?;
    // (Each lane holds 2 positions after joining; every step adds one.)
    let room = if backend.engine.state.kv_bytes() > 0 {
        backend.engine.context().saturating_sub(2)
    } else {
        usize::MAX
    };
    let t0 = Instant::now();
    let mut done = 0;
    while done + CHUNK <= WARM_UP_TOKENS.min(room) && t0.elapsed() < WARM_UP {
        let b = backend.batch.as_mut().ok_or_else(no_batch)?;
        b.step(&backend.engine, CHUNK, &mut |_, _| true)?;
        done += CHUNK;
    }
    let b = backend.batch.as_mut().ok_or_else(no_batch)?;
    for lane in 0..batch {
        b.leave(&mut backend.engine, lane, false)?;
    }
    backend.reset()
}

/// Joins `batch` greedy lanes to the batch, lane l after its one-token prompt `prompt(l)`.
fn join_lanes(backend: &mut GpuBackend, batch: usize, prompt: &dyn Fn(usize) -> u32) -> Result<()> {
    let greedy = Sampling::greedy();
    for lane in 0..batch {
        backend.reset()?;
        let first = backend.prefill_sample(&[prompt(lane)], &greedy, 1)?;
        let b = backend.batch.as_mut().ok_or_else(no_batch)?;
        b.join(&backend.engine, lane, first, 2, &greedy, &[])?;
    }
    Ok(())
}

fn no_batch() -> Error {
    Error::Gpu("the batch made for this benchmark is gone".into())
}
