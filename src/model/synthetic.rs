//! Deterministic random weights at any config's shapes: for tests, benchmarks and bad-input
//! experiments. Scales keep activations and state in a realistic range, so a forward pass
//! over hundreds of tokens neither explodes nor vanishes.

use crate::config::{AttentionConfig, BlockKind, MlpAct, MlpConfig, ModelConfig};
use crate::model::{
    AttentionWeights, LayerWeights, MambaWeights, MixerWeights, MlpWeights, ModelWeights,
    MoeWeights, Tensor,
};
use crate::sampling::uniform;

/// A counter-based stream of uniform numbers (the sampler's hash, keyed by `seed`).
struct Stream {
    seed: u64,
    next: u64,
}

impl Stream {
    /// `count` values uniform in `[lo, hi)`.
    fn fill(&mut self, count: usize, lo: f32, hi: f32) -> Vec<f32> {
        let start = self.next;
        self.next += count as u64;
        (0..count as u64)
            .map(|i| lo + (hi - lo) * uniform(self.seed, start + i))
            .collect()
    }
}

/// Random weights named as HF transformers names them, f32.
pub fn random_weights(c: &ModelConfig, seed: u64) -> ModelWeights {
    let mut s = Stream { seed, next: 0 };
    let mut t = |name: String, shape: Vec<usize>, lo: f32, hi: f32| {
        let values = s.fill(shape.iter().product(), lo, hi);
        Tensor::from_f32(name, shape, &values)
    };
    let (d, di, h) = (c.d_model, c.d_inner, c.n_heads);
    let in_scale = (3.0 / d as f32).sqrt();
    let out_scale = (3.0 / di as f32).sqrt() * 0.5;
    let layers = c
        .blocks
        .iter()
        .enumerate()
        .map(|(i, &kind)| {
            let p = |n: &str| format!("backbone.layers.{i}.{n}");
            let norm = t(p("norm.weight"), vec![d], 0.6, 1.4);
            let mixer = match kind {
                BlockKind::Mamba2 => MixerWeights::Mamba2(MambaWeights {
                    in_proj: t(
                        p("mixer.in_proj.weight"),
                        vec![c.d_in_proj(), d],
                        -in_scale,
                        in_scale,
                    ),
                    conv_weight: t(
                        p("mixer.conv1d.weight"),
                        vec![c.conv_dim(), 1, c.d_conv],
                        -0.6,
                        0.6,
                    ),
                    conv_bias: c
                        .conv_bias
                        .then(|| t(p("mixer.conv1d.bias"), vec![c.conv_dim()], -0.2, 0.2)),
                    dt_bias: t(p("mixer.dt_bias"), vec![h], -4.0, -1.0),
                    a_log: t(p("mixer.A_log"), vec![h], 0.0, 2.5),
                    a_direct: false,
                    d_skip: t(p("mixer.D"), vec![h], 0.5, 1.5),
                    mixer_norm: t(p("mixer.norm.weight"), vec![di], 0.6, 1.4),
                    out_proj: t(
                        p("mixer.out_proj.weight"),
                        vec![d, di],
                        -out_scale,
                        out_scale,
                    ),
                }),
                BlockKind::Attention => {
                    let a = c.attention.as_ref().expect("attention layers have a shape");
                    let (qw, kw) = (a.q_width(), a.kv_width());
                    // Scores of order one: q·k over hd terms of (in_scale·|h|)² each.
                    let qk = in_scale * 2.0;
                    let o_scale = (3.0 / qw as f32).sqrt() * 0.5;
                    let mut m = |n: &str, shape: Vec<usize>, s: f32| t(p(n), shape, -s, s);
                    MixerWeights::Attention(AttentionWeights {
                        q: m("mixer.q_proj.weight", vec![qw, d], qk),
                        k: m("mixer.k_proj.weight", vec![kw, d], qk),
                        v: m("mixer.v_proj.weight", vec![kw, d], in_scale),
                        o: m("mixer.o_proj.weight", vec![d, qw], o_scale),
                        bias: a.bias.then(|| {
                            [
                                m("mixer.q_proj.bias", vec![qw], 0.1),
                                m("mixer.k_proj.bias", vec![kw], 0.1),
                                m("mixer.v_proj.bias", vec![kw], 0.1),
                                m("mixer.o_proj.bias", vec![d], 0.1),
                            ]
                        }),
                    })
                }
                BlockKind::Moe => {
                    let mc = c.moe.as_ref().expect("MoE layers have a shape");
                    let gated = mc.act == MlpAct::SiluGated;
                    let mut m = |n: String, shape: Vec<usize>, s: f32| t(p(&n), shape, -s, s);
                    // Width `w` in and out: d, or the latent width for latent routed experts.
                    let mut mlp = |prefix: &str, n: usize, w: usize, gated: bool| {
                        let down_scale = (3.0 / n as f32).sqrt() * 0.5;
                        let up_scale = (3.0 / w as f32).sqrt();
                        MlpWeights {
                            up: m(format!("{prefix}.up_proj.weight"), vec![n, w], up_scale),
                            gate: gated.then(|| {
                                m(format!("{prefix}.gate_proj.weight"), vec![n, w], up_scale)
                            }),
                            down: m(format!("{prefix}.down_proj.weight"), vec![w, n], down_scale),
                            up_bias: None,
                            gate_bias: None,
                            down_bias: None,
                        }
                    };
                    let x = mc.expert_width(d);
                    let experts = (0..mc.experts)
                        .map(|e| mlp(&format!("mixer.experts.{e}"), mc.intermediate, x, gated))
                        .collect();
                    let shared = mc.shared.as_ref().map(|s| {
                        mlp(
                            "mixer.shared_experts",
                            s.intermediate,
                            d,
                            s.act == MlpAct::SiluGated,
                        )
                    });
                    let latent = mc.latent.map(|lw| {
                        [
                            m("mixer.fc1_latent_proj.weight".into(), vec![lw, d], in_scale),
                            m(
                                "mixer.fc2_latent_proj.weight".into(),
                                vec![d, lw],
                                (3.0 / lw as f32).sqrt(),
                            ),
                        ]
                    });
                    // Router logits of order one, so the choices vary from token to token.
                    let router = m(
                        "mixer.gate.weight".into(),
                        vec![mc.experts, d],
                        in_scale * 2.0,
                    );
                    let correction_bias = mc.has_correction_bias().then(|| {
                        m(
                            "mixer.gate.e_score_correction_bias".into(),
                            vec![mc.experts],
                            0.2,
                        )
                    });
                    MixerWeights::Moe(Box::new(MoeWeights {
                        router,
                        correction_bias,
                        experts,
                        shared,
                        latent,
                    }))
                }
                BlockKind::Mlp => {
                    let mc = c.mlp.as_ref().expect("MLP layers have a shape");
                    let n = mc.intermediate;
                    let gated = mc.act == MlpAct::SiluGated;
                    let down_scale = (3.0 / n as f32).sqrt() * 0.5;
                    let mut m = |n: &str, shape: Vec<usize>, s: f32| t(p(n), shape, -s, s);
                    let up = m("mixer.up_proj.weight", vec![n, d], in_scale);
                    let gate = gated.then(|| m("mixer.gate_proj.weight", vec![n, d], in_scale));
                    let down = m("mixer.down_proj.weight", vec![d, n], down_scale);
                    MixerWeights::Mlp(MlpWeights {
                        up,
                        gate,
                        down,
                        up_bias: mc.bias.then(|| m("mixer.up_proj.bias", vec![n], 0.1)),
                        gate_bias: (mc.bias && gated)
                            .then(|| m("mixer.gate_proj.bias", vec![n], 0.1)),
                        down_bias: mc.bias.then(|| m("mixer.down_proj.bias", vec![d], 0.1)),
                    })
                }
            };
            LayerWeights { norm, mixer }
        })
        .collect();
    let embedding = t(
        "backbone.embeddings.weight".into(),
        vec![c.vocab_size, d],
        -1.0,
        1.0,
    );
    let final_norm = t("backbone.norm_f.weight".into(), vec![d], 0.6, 1.4);
    let head_scale = (3.0 / d as f32).sqrt() * 2.0;
    let lm_head = (!c.tie_embeddings).then(|| {
        t(
            "lm_head.weight".into(),
            vec![c.vocab_size, d],
            -head_scale,
            head_scale,
        )
    });
    ModelWeights {
        embedding,
        layers,
        final_norm,
        lm_head,
    }
}

/// A tiny HF-style config with the given groups and head dim (4 heads per group, expand 2),
/// for tests.
pub fn tiny_config(n_groups: usize, head_dim: usize) -> ModelConfig {
    let n_heads = 4 * n_groups;
    ModelConfig {
        format: crate::config::ModelFormat::HfMamba2,
        d_model: n_heads * head_dim / 2,
        n_layer: 2,
        vocab_size: 77,
        d_inner: n_heads * head_dim,
        n_heads,
        head_dim,
        n_groups,
        d_state: 12,
        d_conv: 4,
        chunk_size: 16,
        norm_eps: 1e-5,
        tie_embeddings: n_groups == 1,
        conv_bias: true,
        time_step_limit: (0.0, f64::INFINITY),
        blocks: vec![BlockKind::Mamba2; 2],
        attention: None,
        mlp: None,
        moe: None,
        scales: Default::default(),
        max_context: None,
        notices: Vec::new(),
    }
}

/// A tiny Nemotron-H-style hybrid for tests: `pattern` in Nemotron-H letters (`M`, `*`,
/// `-`), Mamba G = 2, attention with `kv_heads` of 4 heads (head_dim 8, not d/heads),
/// a relu² MLP of width 40.
pub fn tiny_hybrid(pattern: &str, kv_heads: usize) -> ModelConfig {
    let mut c = tiny_config(2, 8);
    c.format = crate::config::ModelFormat::NemotronH;
    c.blocks = pattern
        .chars()
        .map(|ch| match ch {
            '*' => BlockKind::Attention,
            '-' => BlockKind::Mlp,
            _ => BlockKind::Mamba2,
        })
        .collect();
    c.n_layer = c.blocks.len();
    c.tie_embeddings = false;
    c.attention = Some(AttentionConfig {
        heads: 4,
        kv_heads,
        head_dim: 8,
        bias: false,
        rope_theta: None,
        scale: 1.0 / 8f64.sqrt(),
    });
    c.mlp = Some(MlpConfig {
        intermediate: 40,
        act: MlpAct::Relu2,
        bias: false,
    });
    c
}

/// A tiny MoE hybrid for tests: `pattern` in Nemotron-H letters with `E` for MoE blocks.
/// `granite: false` — Nemotron-H's grouped sigmoid router (12 experts in 4 groups, 2 kept,
/// top 3, norm_topk_prob, scaling 2.5) with relu² experts of width 24 and a shared expert
/// of width 40; `granite: true` — Granite's softmax top-3 of 10 gated experts (width 16), a
/// gated shared MLP of width 32 and the µP multipliers (embedding 3, residual 0.5, logits
/// ÷ 2.5).
pub fn tiny_moe(pattern: &str, granite: bool) -> ModelConfig {
    use crate::config::{MoeConfig, Router, Scales};
    let mut c = tiny_hybrid(&pattern.replace('E', "-"), 2);
    for (k, ch) in c.blocks.iter_mut().zip(pattern.chars()) {
        if ch == 'E' {
            *k = BlockKind::Moe;
        }
    }
    if !c.blocks.contains(&BlockKind::Mlp) {
        c.mlp = None;
    }
    let (act, experts, width, shared) = if granite {
        (MlpAct::SiluGated, 10, 16, 32)
    } else {
        (MlpAct::Relu2, 12, 24, 40)
    };
    c.moe = Some(MoeConfig {
        experts,
        top_k: 3,
        intermediate: width,
        act,
        router: if granite {
            Router::SoftmaxTopK
        } else {
            Router::Grouped {
                n_group: 4,
                topk_group: 2,
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
            }
        },
        shared: Some(MlpConfig {
            intermediate: shared,
            act,
            bias: false,
        }),
        latent: None,
    });
    if granite {
        c.scales = Scales {
            embedding: 3.0,
            residual: 0.5,
            logits: 0.4,
        };
        c.tie_embeddings = true;
    }
    c
}

/// `tiny_moe` with latent projections of width 20 (not a multiple of 32: padded rows) around
/// the routed experts (Nemotron 3 Super's latent MoE).
pub fn tiny_latent_moe(pattern: &str) -> ModelConfig {
    let mut c = tiny_moe(pattern, false);
    if let Some(m) = c.moe.as_mut() {
        m.latent = Some(20);
    }
    c
}
