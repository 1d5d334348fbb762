//! `ModelConfig`: one normalized description of a Mamba2 model, parsed from any of the
//! config formats in the wild (HF transformers `mamba2`, mamba_ssm, Mistral `params.json`,
//! HF `nemotron_h` with an all-Mamba layer pattern), with every derived size in one place.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

mod gguf;
mod granite;
mod moe;

pub use moe::{MoeConfig, Router};

/// Which on-disk convention a model directory follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    /// HF transformers, `config.json` with `model_type: mamba2`.
    HfMamba2,
    /// state-spaces/mamba (mamba_ssm), `config.json` with `d_model`, `n_layer`, `ssm_cfg`.
    MambaSsm,
    /// Mistral's Mamba-Codestral, `params.json`.
    Mistral,
    /// HF transformers `nemotron_h`: Mamba2, attention, MLP and MoE layers.
    NemotronH,
    /// HF transformers `granitemoehybrid` (Granite-4.0-H): each layer a mixer block, then an
    /// MoE (or MLP) block.
    Granite,
    /// A GGUF file of llama.cpp's `mamba2` architecture (metadata keys `mamba2.*`).
    GgufMamba2,
    /// A GGUF file of llama.cpp's `nemotron_h` architecture (`nemotron_h.*`).
    GgufNemotronH,
    /// A GGUF file of llama.cpp's `nemotron_h_moe` architecture (`nemotron_h_moe.*`:
    /// Nemotron 3 Nano), its experts stacked per layer.
    GgufNemotronHMoe,
    /// A GGUF file of llama.cpp's `granitehybrid` architecture (`granitehybrid.*`:
    /// Granite-4.0-H with experts); each of its layers is two blocks, as for `Granite`.
    GgufGranite,
}

impl ModelFormat {
    /// How this format spells the field behind a normalized `ModelConfig` name, so that
    /// errors name what the user can find in their file.
    pub fn field(self, normalized: &str) -> String {
        use ModelFormat::*;
        if let Some(arch) = self.gguf_arch() {
            return self.gguf_field(arch, normalized);
        }
        match (self, normalized) {
            (HfMamba2 | NemotronH, "d_model") => "hidden_size",
            (HfMamba2 | NemotronH, "n_layer") => "num_hidden_layers",
            (HfMamba2 | NemotronH, "norm_eps") => "layer_norm_epsilon",
            (MambaSsm, "norm_eps") => "norm_epsilon",
            (HfMamba2, "d_inner") => "expand",
            (HfMamba2, "n_heads") => "num_heads",
            (HfMamba2, "d_state") => "state_size",
            (HfMamba2 | NemotronH, "d_conv") => "conv_kernel",
            (NemotronH, "d_inner" | "n_heads") => "mamba_num_heads",
            (NemotronH, "head_dim") => "mamba_head_dim",
            (NemotronH, "d_state") => "ssm_state_size",
            (MambaSsm, "d_inner") => "ssm_cfg.expand",
            (MambaSsm, "n_heads" | "head_dim") => "ssm_cfg.headdim",
            (MambaSsm, "n_groups") => "ssm_cfg.ngroups",
            (MambaSsm, "d_state") => "ssm_cfg.d_state",
            (MambaSsm, "d_conv") => "ssm_cfg.d_conv",
            (MambaSsm, "chunk_size") => "ssm_cfg.chunk_size",
            (Mistral, "d_model" | "d_inner") => "dim",
            (Mistral, "n_layer") => "n_layers",
            (Mistral, "n_heads" | "head_dim") => "dim",
            (Granite, "d_model") => "hidden_size",
            (Granite, "n_layer") => "num_hidden_layers",
            (Granite, "d_inner") => "mamba_expand",
            (Granite, "n_heads") => "mamba_n_heads",
            (Granite, "head_dim") => "mamba_d_head",
            (Granite, "n_groups") => "mamba_n_groups",
            (Granite, "d_state") => "mamba_d_state",
            (Granite, "d_conv") => "mamba_d_conv",
            (Granite, "chunk_size") => "mamba_chunk_size",
            (Granite, "norm_eps") => "rms_norm_eps",
            (Granite, "attention.head_dim") => "num_attention_heads",
            (Granite, "intermediate_size") => "shared_intermediate_size",
            (Granite, "moe_intermediate_size") => "intermediate_size",
            (Granite, "n_routed_experts") => "num_local_experts",
            (Granite, "attention scale") => "attention_multiplier",
            (Granite, "moe_shared_expert_intermediate_size") => "shared_intermediate_size",
            (_, "attention.head_dim") => "head_dim",
            _ => normalized,
        }
        .to_string()
    }

    /// The GGUF architecture name of a GGUF format (its metadata keys' prefix).
    pub fn gguf_arch(self) -> Option<&'static str> {
        match self {
            ModelFormat::GgufMamba2 => Some("mamba2"),
            ModelFormat::GgufNemotronH => Some("nemotron_h"),
            ModelFormat::GgufNemotronHMoe => Some("nemotron_h_moe"),
            ModelFormat::GgufGranite => Some("granitehybrid"),
            _ => None,
        }
    }

    /// The metadata key (or tensor) of a GGUF file of architecture `arch` that a
    /// normalized field comes from, as `config/gguf.rs` reads it; a field it reads from no
    /// key (a default of this engine) keeps its normalized name and says so.
    fn gguf_field(self, arch: &str, normalized: &str) -> String {
        let key = match (self, normalized) {
            (_, "vocab_size") => return "token_embd.weight (rows)".into(),
            (_, "d_model") => "embedding_length",
            // Granite's layers are two blocks each (mixer, then MoE).
            (ModelFormat::GgufGranite, "n_layer") => "block_count (two blocks per layer)",
            (_, "n_layer") => "block_count",
            (_, "d_inner") => "ssm.inner_size",
            (_, "n_heads" | "head_dim") => "ssm.time_step_rank",
            (_, "n_groups") => "ssm.group_count",
            (_, "d_state") => "ssm.state_size",
            (_, "d_conv") => "ssm.conv_kernel",
            (_, "norm_eps") => "attention.layer_norm_rms_epsilon",
            (_, "num_attention_heads") => "attention.head_count",
            (_, "num_key_value_heads") => "attention.head_count_kv",
            (ModelFormat::GgufGranite, "attention.head_dim") => {
                "attention.key_length (or embedding_length / attention.head_count)"
            }
            (_, "attention.head_dim") => "attention.key_length",
            (_, "attention scale") => "attention.scale",
            (ModelFormat::GgufGranite, "moe_intermediate_size") => "feed_forward_length",
            (_, "intermediate_size") => "feed_forward_length",
            (_, "moe_intermediate_size") => "expert_feed_forward_length",
            (_, "moe_shared_expert_intermediate_size") => "expert_shared_feed_forward_length",
            (_, "n_routed_experts") => "expert_count",
            (_, "num_experts_per_tok") => "expert_used_count",
            (_, "n_group") => "expert_group_count",
            (_, "topk_group") => "expert_group_used_count",
            (_, "routed_scaling_factor") => "expert_weights_scale",
            (_, "moe_latent_size") => "moe_latent_size",
            (_, "embedding_multiplier") => "embedding_scale",
            (_, "residual_multiplier") => "residual_scale",
            (_, "logits_scaling") => "logit_scale (the value shown is its inverse)",
            (_, "max_position_embeddings") => "context_length",
            _ => return format!("{normalized} (not a GGUF key: this engine's default)"),
        };
        format!("{arch}.{key}")
    }

    pub fn name(self) -> &'static str {
        match self {
            ModelFormat::HfMamba2 => "HF transformers mamba2",
            ModelFormat::MambaSsm => "mamba_ssm",
            ModelFormat::Mistral => "Mistral params.json",
            ModelFormat::NemotronH => "HF transformers nemotron_h",
            ModelFormat::Granite => "HF transformers granitemoehybrid",
            ModelFormat::GgufMamba2 => "GGUF mamba2 (llama.cpp)",
            ModelFormat::GgufNemotronH => "GGUF nemotron_h (llama.cpp)",
            ModelFormat::GgufNemotronHMoe => "GGUF nemotron_h_moe (llama.cpp)",
            ModelFormat::GgufGranite => "GGUF granitehybrid (llama.cpp)",
        }
    }
}

/// What a layer's mixer is: every layer is `x ← x + μr · mixer(rmsnorm(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockKind {
    Mamba2,
    Attention,
    Mlp,
    /// Mixture of experts: a router, `top_k` of `E` expert MLPs, a shared expert.
    Moe,
}

impl BlockKind {
    /// The letter of Nemotron-H's `hybrid_override_pattern`.
    pub fn letter(self) -> char {
        match self {
            BlockKind::Mamba2 => 'M',
            BlockKind::Attention => '*',
            BlockKind::Mlp => '-',
            BlockKind::Moe => 'E',
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            BlockKind::Mamba2 => "mamba2",
            BlockKind::Attention => "attention",
            BlockKind::Mlp => "mlp",
            BlockKind::Moe => "moe",
        }
    }
}

/// The attention layers' shape: `H` query heads and `Hkv` key/value heads of `head_dim`.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionConfig {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// q/k/v/o projection biases.
    pub bias: bool,
    /// Rotary embeddings with this base, or none (Nemotron-H has no positional encoding).
    pub rope_theta: Option<f64>,
    /// The softmax scale, `1/sqrt(head_dim)` unless the format says otherwise.
    pub scale: f64,
}

impl AttentionConfig {
    /// Nemotron-H's attention (HF and GGUF): no biases (transformers' NemotronH builds
    /// q/k/v/o without them whatever `attention_bias` says, and llama.cpp likewise), no
    /// positional encoding, softmax scale 1/√head_dim.
    pub fn nemotron_h(heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        AttentionConfig {
            heads,
            kv_heads,
            head_dim,
            bias: false,
            rope_theta: None,
            scale: 1.0 / (head_dim.max(1) as f64).sqrt(),
        }
    }

    pub fn dims(&self) -> crate::reference::attention::AttnDims {
        crate::reference::attention::AttnDims {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }
    /// Rows of the fused `[q | k | v]` projection, `(H + 2·Hkv)·hd`.
    pub fn qkv_rows(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
    /// `H·hd`, the width of the attention output (o_proj's input).
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    /// `Hkv·hd`, one cached row of K (or V).
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// The activation of an MLP block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpAct {
    /// `down(relu(up(x))²)` (Nemotron-H).
    Relu2,
    /// `down(silu(gate(x)) · up(x))`.
    SiluGated,
}

/// The MLP layers' shape.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpConfig {
    pub intermediate: usize,
    pub act: MlpAct,
    /// up/gate/down biases.
    pub bias: bool,
}

/// Constant factors some formats put around the blocks (Granite's µP multipliers); all 1
/// elsewhere.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scales {
    /// The embedding's output is multiplied by this (`embedding_multiplier`).
    pub embedding: f64,
    /// Every block's output is multiplied by this before the residual add
    /// (`residual_multiplier`).
    pub residual: f64,
    /// Logits are multiplied by this (`1 / logits_scaling`).
    pub logits: f64,
}

impl Default for Scales {
    fn default() -> Self {
        Scales {
            embedding: 1.0,
            residual: 1.0,
            logits: 1.0,
        }
    }
}

/// The normalized model description. Field names follow MAMBA2.md: `d` model width,
/// `H` heads of `P` channels, `G` groups, `N` state size, `K` conv width.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub format: ModelFormat,
    /// `d`
    pub d_model: usize,
    pub n_layer: usize,
    /// Rows of the embedding (and of lm_head): the vocabulary after any padding.
    pub vocab_size: usize,
    /// `H·P`
    pub d_inner: usize,
    /// `H`
    pub n_heads: usize,
    /// `P`
    pub head_dim: usize,
    /// `G`
    pub n_groups: usize,
    /// `N`
    pub d_state: usize,
    /// `K`
    pub d_conv: usize,
    /// `Q`, the SSD chunk length of prefill.
    pub chunk_size: usize,
    pub norm_eps: f64,
    pub tie_embeddings: bool,
    pub conv_bias: bool,
    /// `(min, max)` clamp on dt. Applied in prefill and decode alike (as HF does; mamba_ssm
    /// clamps in prefill only), so both paths agree. The default `(0, inf)` is a no-op.
    pub time_step_limit: (f64, f64),
    /// The mixer of each layer (`n_layer` entries).
    pub blocks: Vec<BlockKind>,
    /// The attention layers' shape (when there are any).
    pub attention: Option<AttentionConfig>,
    /// The MLP layers' shape (when there are any).
    pub mlp: Option<MlpConfig>,
    /// The MoE layers' shape (when there are any).
    pub moe: Option<MoeConfig>,
    pub scales: Scales,
    /// The longest context the model was trained for (`max_position_embeddings`).
    pub max_context: Option<usize>,
    /// What the parser noticed and ignored (e.g. multi-token-prediction layers), one line
    /// each, for the front-ends to show.
    pub notices: Vec<String>,
}

impl ModelConfig {
    /// How many layers have mixer `kind`.
    pub fn count(&self, kind: BlockKind) -> usize {
        self.blocks.iter().filter(|&&k| k == kind).count()
    }
    /// Whether any layer is not Mamba2.
    pub fn is_hybrid(&self) -> bool {
        self.blocks.iter().any(|&k| k != BlockKind::Mamba2)
    }
    /// The layer pattern in Nemotron-H's letters, e.g. `M-M*-M`.
    pub fn pattern(&self) -> String {
        self.blocks.iter().map(|k| k.letter()).collect()
    }
    /// Bytes of K and V one token adds to the caches (all attention layers), at `elem`
    /// bytes per value.
    pub fn kv_bytes_per_token(&self, elem: usize) -> usize {
        self.attention.as_ref().map_or(0, |a| {
            2 * a.kv_width() * elem * self.count(BlockKind::Attention)
        })
    }
    /// Every kind of weight matrix the model holds, as `(name, rows, cols, copies)`: the
    /// embedding (twice when the head is untied) and each block kind's projections, one copy
    /// per layer of that kind. The GPU's buffer limits and the admission footprint read it.
    pub fn matrices(&self) -> Vec<(&'static str, usize, usize, usize)> {
        let d = self.d_model;
        let (mamba, attention, mlp) = (
            self.count(BlockKind::Mamba2),
            self.count(BlockKind::Attention),
            self.count(BlockKind::Mlp),
        );
        let head = if self.tie_embeddings { 1 } else { 2 };
        let mut out = vec![
            ("embedding / lm_head", self.vocab_size, d, head),
            ("in_proj", self.d_in_proj(), d, mamba),
            ("out_proj", d, self.d_inner, mamba),
        ];
        if let Some(a) = &self.attention {
            out.push(("qkv_proj", a.qkv_rows(), d, attention));
            out.push(("o_proj", d, a.q_width(), attention));
        }
        if let Some(m) = &self.mlp {
            let ups = if m.act == MlpAct::SiluGated { 2 } else { 1 };
            out.push(("up_proj", ups * m.intermediate, d, mlp));
            out.push(("down_proj", d, m.intermediate, mlp));
        }
        if let Some(m) = &self.moe {
            let layers = self.count(BlockKind::Moe);
            let x = m.expert_width(d);
            out.push(("router", m.experts, d, layers));
            out.push(("experts.up_proj", m.experts * m.up_rows(), x, layers));
            out.push(("experts.down_proj", m.experts * x, m.intermediate, layers));
            if let Some(l) = m.latent {
                out.push(("fc1_latent_proj", l, d, layers));
                out.push(("fc2_latent_proj", d, l, layers));
            }
            if let Some(s) = &m.shared {
                let ups = if s.act == MlpAct::SiluGated { 2 } else { 1 };
                out.push(("shared.up_proj", ups * s.intermediate, d, layers));
                out.push(("shared.down_proj", d, s.intermediate, layers));
            }
        }
        out
    }

    /// Parameters one token reads: every dense matrix, but only `top_k` of each MoE layer's
    /// experts (the bytes decode streams per token; lm_head counted, the embedding row not).
    pub fn active_param_count(&self) -> usize {
        let mut n = self.param_count();
        if let Some(m) = &self.moe {
            let x = m.expert_width(self.d_model);
            let per_expert = m.up_rows() * x + x * m.intermediate;
            n -= (m.experts - m.top_k) * per_expert * self.count(BlockKind::Moe);
        }
        if !self.tie_embeddings {
            n -= self.vocab_size * self.d_model;
        }
        n
    }
    /// `conv_dim = d_inner + 2·G·N`
    pub fn conv_dim(&self) -> usize {
        self.d_inner + 2 * self.n_groups * self.d_state
    }
    /// `d_in_proj = 2·d_inner + 2·G·N + H` (order: z | xBC | dt).
    pub fn d_in_proj(&self) -> usize {
        2 * self.d_inner + 2 * self.n_groups * self.d_state + self.n_heads
    }
    /// Channels per group of the gated norm, `d_inner / G`.
    pub fn group_size(&self) -> usize {
        self.d_inner / self.n_groups
    }
    /// Heads sharing one B/C group, `H / G`.
    pub fn heads_per_group(&self) -> usize {
        self.n_heads / self.n_groups
    }
    /// f32 values of SSM state per layer, `H·P·N`.
    pub fn ssm_state_len(&self) -> usize {
        self.n_heads * self.head_dim * self.d_state
    }
    /// f32 values of conv state per layer, `conv_dim·(K−1)`.
    pub fn conv_state_len(&self) -> usize {
        self.conv_dim() * (self.d_conv - 1)
    }
    /// Bytes of fixed-size recurrent state one sequence carries (f32, all Mamba layers);
    /// the KV caches come on top (`kv_bytes_per_token`).
    pub fn state_bytes(&self) -> usize {
        4 * self.count(BlockKind::Mamba2) * (self.ssm_state_len() + self.conv_state_len())
    }
    /// Parameter count implied by the config (lm_head counted once when tied).
    pub fn param_count(&self) -> usize {
        let d = self.d_model;
        let mamba = self.d_in_proj() * d
            + self.conv_dim() * self.d_conv
            + if self.conv_bias { self.conv_dim() } else { 0 }
            + 3 * self.n_heads
            + self.d_inner
            + d * self.d_inner;
        let attention = self.attention.as_ref().map_or(0, |a| {
            let bias = if a.bias { a.qkv_rows() + d } else { 0 };
            a.qkv_rows() * d + d * a.q_width() + bias
        });
        let mlp_params = |m: &MlpConfig| {
            let ups = if m.act == MlpAct::SiluGated { 2 } else { 1 };
            let bias = if m.bias { ups * m.intermediate + d } else { 0 };
            (ups + 1) * m.intermediate * d + bias
        };
        let mlp = self.mlp.as_ref().map_or(0, mlp_params);
        let moe = self.moe.as_ref().map_or(0, |m| {
            let bias = if m.has_correction_bias() {
                m.experts
            } else {
                0
            };
            // router row + up rows + down, per expert; the latent projections
            let x = m.expert_width(d);
            m.experts * (d + m.up_rows() * x + x * m.intermediate)
                + bias
                + m.latent.map_or(0, |l| 2 * l * d)
                + m.shared.as_ref().map_or(0, mlp_params)
        });
        let layers: usize = self
            .blocks
            .iter()
            .map(|k| {
                d + match k {
                    BlockKind::Mamba2 => mamba,
                    BlockKind::Attention => attention,
                    BlockKind::Mlp => mlp,
                    BlockKind::Moe => moe,
                }
            })
            .sum();
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.vocab_size * d + layers + d + head
    }

    /// This config as an HF transformers `mamba2` `config.json` (what `Model::save` writes).
    /// Nemotron-H configs with G > 1 stay exact: HF's own Mamba2 would normalize over all of
    /// d_inner, but this engine reads the field back with its per-group meaning.
    pub fn to_hf_json(&self) -> serde_json::Value {
        if self.is_hybrid() {
            return self.to_nemotron_h_json();
        }
        serde_json::json!({
            "model_type": "mamba2",
            "architectures": ["Mamba2ForCausalLM"],
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layer,
            "vocab_size": self.vocab_size,
            "expand": if self.d_inner.is_multiple_of(self.d_model) {
                serde_json::json!(self.d_inner / self.d_model)
            } else {
                serde_json::json!(self.d_inner as f64 / self.d_model as f64)
            },
            "num_heads": self.n_heads,
            "head_dim": self.head_dim,
            "n_groups": self.n_groups,
            "state_size": self.d_state,
            "conv_kernel": self.d_conv,
            "chunk_size": self.chunk_size,
            "layer_norm_epsilon": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "use_conv_bias": self.conv_bias,
            "use_bias": false,
            "time_step_limit": [
                json_limit(self.time_step_limit.0),
                json_limit(self.time_step_limit.1)
            ],
        })
    }

    /// A hybrid config as HF transformers `nemotron_h` writes it (the pattern spelling).
    fn to_nemotron_h_json(&self) -> serde_json::Value {
        if matches!(self.format, ModelFormat::Granite | ModelFormat::GgufGranite) {
            return granite::to_granite_json(self);
        }
        let mut v = serde_json::json!({
            "model_type": "nemotron_h",
            "architectures": ["NemotronHForCausalLM"],
            "hidden_size": self.d_model,
            "hybrid_override_pattern": self.pattern(),
            "vocab_size": self.vocab_size,
            "mamba_num_heads": self.n_heads,
            "mamba_head_dim": self.head_dim,
            "n_groups": self.n_groups,
            "ssm_state_size": self.d_state,
            "conv_kernel": self.d_conv,
            "chunk_size": self.chunk_size,
            "layer_norm_epsilon": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "use_conv_bias": self.conv_bias,
            "time_step_limit": [
                json_limit(self.time_step_limit.0),
                json_limit(self.time_step_limit.1)
            ],
        });
        if let Some(a) = &self.attention {
            v["num_attention_heads"] = a.heads.into();
            v["num_key_value_heads"] = a.kv_heads.into();
            v["head_dim"] = a.head_dim.into();
            v["attention_bias"] = a.bias.into();
        }
        if let Some(m) = &self.mlp {
            v["intermediate_size"] = m.intermediate.into();
            v["mlp_bias"] = m.bias.into();
            v["mlp_hidden_act"] = "relu2".into();
        }
        if let Some(m) = &self.moe {
            v["n_routed_experts"] = m.experts.into();
            v["num_experts_per_tok"] = m.top_k.into();
            v["moe_intermediate_size"] = m.intermediate.into();
            v["moe_shared_expert_intermediate_size"] =
                m.shared.as_ref().map_or(0, |s| s.intermediate).into();
            v["moe_latent_size"] = m.latent.into();
            if let Router::Grouped {
                n_group,
                topk_group,
                norm_topk_prob,
                routed_scaling_factor,
            } = m.router
            {
                v["n_group"] = n_group.into();
                v["topk_group"] = topk_group.into();
                v["norm_topk_prob"] = norm_topk_prob.into();
                v["routed_scaling_factor"] = routed_scaling_factor.into();
            }
        }
        if let Some(n) = self.max_context {
            v["max_position_embeddings"] = n.into();
        }
        v
    }

    /// Reads the config of a model directory: `config.json` (HF, mamba_ssm, nemotron_h) or
    /// `params.json` (Mistral).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let config = dir.join("config.json");
        let params = dir.join("params.json");
        // `exists`, not `is_file`: a config.json that is a FIFO or a directory gets an
        // error saying so, not "no config.json".
        if config.exists() {
            Self::from_file(&config)
        } else if params.exists() {
            Self::from_file(&params)
        } else if !dir.exists() {
            Err(Error::format(dir, "no such file or directory"))
        } else if !dir.is_dir() {
            let what = if crate::model::gguf::is_directory_file(dir) {
                "a file of a model directory: pass the directory that holds it with its \
                 config.json (or a .gguf file)"
            } else {
                "not a model directory or a .gguf file"
            };
            Err(Error::format(dir, what))
        } else {
            Err(Error::format(
                dir,
                "no config.json or params.json in this model directory",
            ))
        }
    }

    /// Parses one config file, detecting its format from its fields.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::files::read_text(path, crate::files::MAX_JSON_BYTES)?;
        Self::from_json_str(&text, path)
    }

    /// Parses config JSON text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(&quote_non_finite(text))
            .map_err(|e| Error::format(path, format!("not valid JSON: {e}")))?;
        let Value::Object(obj) = value else {
            return Err(Error::format(
                path,
                "expected a JSON object at the top level",
            ));
        };
        let f = Fields {
            obj: &obj,
            path: path.to_path_buf(),
            prefix: String::new(),
        };
        let model_type = f.opt_str("model_type")?;
        let config = match model_type.as_deref() {
            Some("mamba2") => parse_hf_mamba2(&f)?,
            Some("nemotron_h") => parse_nemotron_h(&f)?,
            Some("granitemoehybrid") => granite::parse_granite(&f)?,
            Some("mamba") if obj.contains_key("dim") => parse_mistral(&f)?,
            _ if obj.contains_key("d_model") && obj.contains_key("n_layer") => parse_mamba_ssm(&f)?,
            _ if obj.contains_key("dim") && obj.contains_key("n_layers") => parse_mistral(&f)?,
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{}: model_type `{other}` (supported: mamba2, nemotron_h, granitemoehybrid, mamba_ssm and Mistral Mamba2 configs)",
                    path.display()
                )));
            }
            None => {
                return Err(Error::format(
                    path,
                    "unrecognised config: expected an HF `model_type`, mamba_ssm `d_model`/`n_layer` or Mistral `dim`/`n_layers`",
                ));
            }
        };
        let mut config = config;
        // Checked before the per-layer list below is allocated.
        if config.n_layer > MAX_LAYERS {
            return Err(Error::Config {
                path: path.to_path_buf(),
                field: config.format.field("n_layer"),
                message: format!(
                    "{} layers is over the {MAX_LAYERS} this engine accepts",
                    config.n_layer
                ),
            });
        }
        if config.blocks.is_empty() {
            config.blocks = vec![BlockKind::Mamba2; config.n_layer];
        }
        config.validate(path)?;
        Ok(config)
    }

    /// Upper bounds on every size, far above any released model, and checked products: every
    /// matrix, state and cache row a kernel indexes must fit a u32 count of elements.
    fn check_bounds(&self, path: &Path) -> Result<()> {
        let err = |field: &str, message: String| Error::Config {
            path: path.to_path_buf(),
            field: self.format.field(field),
            message,
        };
        let mut bounds = vec![
            ("n_layer", self.n_layer, MAX_LAYERS),
            ("d_model", self.d_model, MAX_WIDTH),
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("d_inner", self.d_inner, MAX_D_INNER),
            ("n_heads", self.n_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_HEAD_DIM),
            ("n_groups", self.n_groups, MAX_HEADS),
            ("d_state", self.d_state, MAX_STATE),
            ("d_conv", self.d_conv, MAX_CONV),
            ("chunk_size", self.chunk_size, MAX_CHUNK),
            (
                "max_position_embeddings",
                self.max_context.unwrap_or(0),
                MAX_CONTEXT,
            ),
        ];
        if let Some(a) = &self.attention {
            bounds.extend([
                ("num_attention_heads", a.heads, MAX_HEADS),
                ("num_key_value_heads", a.kv_heads, MAX_HEADS),
                ("attention.head_dim", a.head_dim, MAX_HEAD_DIM),
            ]);
        }
        if let Some(m) = &self.mlp {
            bounds.push(("intermediate_size", m.intermediate, MAX_D_INNER));
        }
        if let Some(m) = &self.moe {
            bounds.extend([
                ("n_routed_experts", m.experts, MAX_EXPERTS),
                ("moe_intermediate_size", m.intermediate, MAX_D_INNER),
                ("moe_latent_size", m.latent.unwrap_or(0), MAX_WIDTH),
            ]);
            if let Some(s) = &m.shared {
                bounds.push((
                    "moe_shared_expert_intermediate_size",
                    s.intermediate,
                    MAX_D_INNER,
                ));
            }
        }
        for (field, v, max) in bounds {
            if v > max {
                return Err(err(
                    field,
                    format!("{v} is over the {max} this engine accepts"),
                ));
            }
        }
        // Products of bounded values cannot overflow a u64, but may exceed a u32.
        let mul = |xs: &[usize]| xs.iter().try_fold(1u64, |a, &x| a.checked_mul(x as u64));
        let gn = 2 * self.n_groups as u64 * self.d_state as u64;
        let conv_dim = self.d_inner as u64 + gn;
        let d_in_proj = 2 * self.d_inner as u64 + gn + self.n_heads as u64;
        let mut sizes = vec![
            (
                "vocab_size",
                "embedding / lm_head",
                mul(&[self.vocab_size, self.d_model]),
            ),
            (
                "d_model",
                "in_proj",
                d_in_proj.checked_mul(self.d_model as u64),
            ),
            ("d_model", "out_proj", mul(&[self.d_model, self.d_inner])),
            (
                "d_state",
                "SSM state",
                mul(&[self.n_heads, self.head_dim, self.d_state]),
            ),
            (
                "d_conv",
                "conv state",
                conv_dim.checked_mul(self.d_conv as u64),
            ),
        ];
        if let Some(a) = &self.attention {
            let qkv = mul(&[a.heads + 2 * a.kv_heads, a.head_dim]);
            sizes.push((
                "num_attention_heads",
                "q/k/v projections",
                qkv.and_then(|r| r.checked_mul(self.d_model as u64)),
            ));
        }
        if let Some(m) = &self.mlp {
            sizes.push((
                "intermediate_size",
                "an MLP projection",
                mul(&[
                    if m.act == MlpAct::SiluGated { 2 } else { 1 },
                    m.intermediate,
                    self.d_model,
                ]),
            ));
        }
        if let Some(m) = &self.moe {
            // Each expert bank is indexed as one matrix of all its experts' rows.
            let x = m.expert_width(self.d_model);
            sizes.push((
                "moe_intermediate_size",
                "the stacked experts' up projections",
                mul(&[m.experts, m.up_rows(), x]),
            ));
            sizes.push((
                "moe_intermediate_size",
                "the stacked experts' down projections",
                mul(&[m.experts, x, m.intermediate]),
            ));
            if let Some(s) = &m.shared {
                sizes.push((
                    "moe_shared_expert_intermediate_size",
                    "the shared expert",
                    mul(&[2, s.intermediate, self.d_model]),
                ));
            }
        }
        for (field, what, n) in sizes {
            match n {
                Some(n) if n <= u32::MAX as u64 => {}
                _ => {
                    return Err(err(
                        field,
                        format!(
                            "{what} would hold {} values, over the {} a kernel can index",
                            n.map_or("too many".to_string(), |n| n.to_string()),
                            u32::MAX
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks the invariants every kernel relies on; errors name the offending field.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let err = |field: &str, message: String| Error::Config {
            path: path.to_path_buf(),
            field: self.format.field(field),
            message,
        };
        let positive = [
            ("d_model", self.d_model),
            ("n_layer", self.n_layer),
            ("vocab_size", self.vocab_size),
            ("d_inner", self.d_inner),
            ("n_heads", self.n_heads),
            ("head_dim", self.head_dim),
            ("n_groups", self.n_groups),
            ("d_state", self.d_state),
            ("chunk_size", self.chunk_size),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(err(field, "must be positive".into()));
            }
        }
        self.check_bounds(path)?;
        if self.d_conv < 2 {
            return Err(err(
                "d_conv",
                format!("must be at least 2, found {}", self.d_conv),
            ));
        }
        if self.n_heads * self.head_dim != self.d_inner {
            return Err(err(
                "head_dim",
                format!(
                    "heads × head_dim = {} × {} must equal d_inner = {}",
                    self.n_heads, self.head_dim, self.d_inner
                ),
            ));
        }
        if !self.n_heads.is_multiple_of(self.n_groups) {
            return Err(err(
                "n_groups",
                format!(
                    "{} heads cannot be split into {} groups",
                    self.n_heads, self.n_groups
                ),
            ));
        }
        // The kernels take ε as an f32: a positive normal one (1e300 would be inf there).
        if !(self.norm_eps > 0.0 && f32_normal(self.norm_eps)) {
            return Err(err(
                "norm_eps",
                format!(
                    "must be a positive f32 ({}), found {:e}",
                    f32_range(),
                    self.norm_eps
                ),
            ));
        }
        let (lo, hi) = self.time_step_limit;
        if lo.is_nan() || hi.is_nan() || lo < 0.0 || hi < lo {
            return Err(err(
                "time_step_limit",
                format!("must be 0 ≤ min ≤ max, found ({lo}, {hi})"),
            ));
        }
        if self.blocks.len() != self.n_layer {
            return Err(err(
                "n_layer",
                format!(
                    "{} layers but {} block kinds",
                    self.n_layer,
                    self.blocks.len()
                ),
            ));
        }
        match (&self.attention, self.count(BlockKind::Attention)) {
            (None, n) if n > 0 => {
                return Err(err(
                    "num_attention_heads",
                    format!("{n} attention layers but no attention shape"),
                ));
            }
            (Some(a), _) => {
                for (field, v) in [
                    ("num_attention_heads", a.heads),
                    ("num_key_value_heads", a.kv_heads),
                    ("attention.head_dim", a.head_dim),
                ] {
                    if v == 0 {
                        return Err(err(field, "must be positive".into()));
                    }
                }
                if !a.heads.is_multiple_of(a.kv_heads) {
                    return Err(err(
                        "num_key_value_heads",
                        format!(
                            "{} attention heads cannot share {} key/value heads evenly",
                            a.heads, a.kv_heads
                        ),
                    ));
                }
                if a.rope_theta.is_some() && !a.head_dim.is_multiple_of(2) {
                    return Err(err(
                        "attention.head_dim",
                        format!(
                            "rotary embeddings need an even head_dim, found {}",
                            a.head_dim
                        ),
                    ));
                }
                // The kernels take θ as an f32: it must stay a positive normal number there
                // (1e39 would be inf, 1e-50 zero, and either makes every angle NaN).
                if let Some(t) = a.rope_theta
                    && !(t > 0.0 && f32_normal(t))
                {
                    return Err(err(
                        "rope_theta",
                        format!("must be positive and an f32 ({}), found {t}", f32_range()),
                    ));
                }
                // (An f32 in the kernels and the reference, as θ is.)
                if !(a.scale > 0.0 && f32_normal(a.scale)) {
                    return Err(err(
                        "attention scale",
                        format!(
                            "must be positive and an f32 ({}), found {}",
                            f32_range(),
                            a.scale
                        ),
                    ));
                }
            }
            _ => {}
        }
        match (&self.mlp, self.count(BlockKind::Mlp)) {
            (None, n) if n > 0 => {
                return Err(err(
                    "intermediate_size",
                    format!("{n} MLP layers but no MLP shape"),
                ));
            }
            (Some(m), _) if m.intermediate == 0 => {
                return Err(err("intermediate_size", "must be positive".into()));
            }
            _ => {}
        }
        match (&self.moe, self.count(BlockKind::Moe)) {
            (None, n) if n > 0 => {
                return Err(err(
                    "n_routed_experts",
                    format!("{n} MoE layers but no MoE shape"),
                ));
            }
            (Some(m), _) => {
                m.check().map_err(|(field, message)| err(field, message))?;
                if let Some(s) = &m.shared
                    && s.intermediate == 0
                {
                    return Err(err(
                        "moe_shared_expert_intermediate_size",
                        "must be positive".into(),
                    ));
                }
            }
            _ => {}
        }
        for (field, v) in [
            ("embedding_multiplier", self.scales.embedding),
            ("residual_multiplier", self.scales.residual),
            ("logits_scaling", self.scales.logits),
        ] {
            // The kernels and the reference multiply by it as an f32: 1e300 would be inf
            // there and 1e-50 zero (every logit 0, a silent run of token 0).
            if !f32_normal(v) {
                return Err(err(
                    field,
                    format!(
                        "must be a non-zero f32 (magnitude {}), found {v}",
                        f32_range()
                    ),
                ));
            }
        }
        if self.max_context == Some(0) {
            return Err(err("max_position_embeddings", "must be positive".into()));
        }
        Ok(())
    }
}

/// Whether a config value is a normal number as the f32 the kernels and the reference
/// take it in (not 0, subnormal or infinite there: 1e300 would be inf, 1e-50 zero).
fn f32_normal(v: f64) -> bool {
    (v as f32).is_normal()
}

/// The magnitudes `f32_normal` takes, for the errors that refuse others.
fn f32_range() -> String {
    format!("{:e} to {:e}", f32::MIN_POSITIVE, f32::MAX)
}

/// serde_json rejects the bare `Infinity`/`NaN` tokens Python's json writes; quote them
/// (outside string literals) so they parse as strings that `Fields::f64` understands.
fn quote_non_finite(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 16);
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            rest = &rest[c.len_utf8()..];
            continue;
        }
        if c == '"' {
            in_string = true;
        }
        let token = ["-Infinity", "Infinity", "NaN"]
            .into_iter()
            .find(|t| rest.starts_with(t));
        if let Some(t) = token {
            out.push('"');
            out.push_str(t);
            out.push('"');
            rest = &rest[t.len()..];
        } else {
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// Typed access to a JSON object with errors that name the file and field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: PathBuf,
    prefix: String,
}

impl<'a> Fields<'a> {
    fn err(&self, field: &str, message: impl Into<String>) -> Error {
        Error::Config {
            path: self.path.clone(),
            field: format!("{}{field}", self.prefix),
            message: message.into(),
        }
    }

    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        let Some(v) = self.get(field) else {
            return Ok(None);
        };
        // Every integer a config holds becomes a size or an index of some kernel: refuse
        // what does not fit a u32 here, before any arithmetic on it can wrap.
        let too_large = || self.err(field, format!("{v} is too large (at most {})", u32::MAX));
        match v.as_u64() {
            Some(n) if n <= u32::MAX as u64 => Ok(Some(n as usize)),
            Some(_) => Err(too_large()),
            None => match v.as_f64() {
                Some(x) if x >= 0.0 && x.fract() == 0.0 && x <= u32::MAX as f64 => {
                    Ok(Some(x as usize))
                }
                Some(x) if x.fract() == 0.0 && x > u32::MAX as f64 => Err(too_large()),
                _ => Err(self.err(field, format!("expected a non-negative integer, found {v}"))),
            },
        }
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.opt_usize(field)?
            .ok_or_else(|| self.err(field, "missing (required)"))
    }

    fn usize_or(&self, field: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(field)?.unwrap_or(default))
    }

    fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        self.get(field)
            .map(|v| {
                json_f64(v).ok_or_else(|| self.err(field, format!("expected a number, found {v}")))
            })
            .transpose()
    }

    fn f64_or(&self, field: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(field)?.unwrap_or(default))
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.err(field, format!("expected true or false, found {v}"))),
        }
    }

    fn opt_str(&self, field: &str) -> Result<Option<String>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.err(field, format!("expected a string, found {v}"))),
        }
    }

    /// A `[min, max]` pair of numbers (either may be `Infinity` in any JSON spelling).
    fn pair_or(&self, field: &str, default: (f64, f64)) -> Result<(f64, f64)> {
        let Some(v) = self.get(field) else {
            return Ok(default);
        };
        let bad = || self.err(field, format!("expected [min, max], found {v}"));
        let Value::Array(items) = v else {
            return Err(bad());
        };
        if items.len() != 2 {
            return Err(bad());
        }
        let lo = json_f64(&items[0]).ok_or_else(bad)?;
        let hi = json_f64(&items[1]).ok_or_else(bad)?;
        Ok((lo, hi))
    }

    fn nested(&self, field: &str) -> Result<Option<Fields<'a>>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Object(obj)) => Ok(Some(Fields {
                obj,
                path: self.path.clone(),
                prefix: format!("{}{field}.", self.prefix),
            })),
            Some(v) => Err(self.err(field, format!("expected an object, found {v}"))),
        }
    }

    /// Rejects a boolean option set to anything but `supported` (also its default).
    fn require_flag(&self, field: &str, supported: bool, why: &str) -> Result<()> {
        let bad = self.bool_or(field, supported)? != supported;
        self.reject_if(field, bad, why)
    }

    /// Rejects options that change the math in ways this engine does not implement.
    fn reject_if(&self, field: &str, bad: bool, why: &str) -> Result<()> {
        if bad {
            Err(Error::Unsupported(format!(
                "{}: `{}{field}`: {why}",
                self.path.display(),
                self.prefix
            )))
        } else {
            Ok(())
        }
    }
}

/// A δ limit as JSON: a number, or infinity as the `{"__float__": "Infinity"}` that
/// `json_f64` reads back.
fn json_limit(x: f64) -> Value {
    if x.is_finite() {
        serde_json::json!(x)
    } else {
        serde_json::json!({"__float__": "Infinity"})
    }
}

/// A JSON number, or one of the spellings of a non-finite float seen in the wild:
/// `Infinity` (bare, quoted by `quote_non_finite`) and `{"__float__": "Infinity"}`.
fn json_f64(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => match s.as_str() {
            "Infinity" | "inf" | "+inf" => Some(f64::INFINITY),
            "-Infinity" | "-inf" => Some(f64::NEG_INFINITY),
            "NaN" | "nan" => Some(f64::NAN),
            other => other.parse().ok(),
        },
        Value::Object(o) if o.len() == 1 => o.get("__float__").and_then(json_f64),
        _ => None,
    }
}

const NO_LIMIT: (f64, f64) = (0.0, f64::INFINITY);

// Upper bounds on config values (`check_bounds`). The largest released models use 118
// layers, width 8192, 256k vocabularies, 128/256-wide heads, N = 256, K = 4, Q = 256 and
// 1M-token contexts; these leave room for anything plausible and refuse the absurd before
// it becomes an allocation.
const MAX_LAYERS: usize = 4096;
const MAX_WIDTH: usize = 1 << 16;
const MAX_VOCAB: usize = 1 << 22;
const MAX_D_INNER: usize = 1 << 20;
const MAX_HEADS: usize = 1 << 16;
const MAX_HEAD_DIM: usize = 1 << 12;
const MAX_STATE: usize = 1 << 12;
const MAX_CONV: usize = 64;
const MAX_CHUNK: usize = 4096;
const MAX_CONTEXT: usize = 1 << 24;
const MAX_EXPERTS: usize = 1 << 12;

fn parse_hf_mamba2(f: &Fields) -> Result<ModelConfig> {
    let d_model = f.usize("hidden_size")?;
    let expand = f.f64_or("expand", 2.0)?;
    let head_dim = f.usize_or("head_dim", 64)?;
    if !(expand > 0.0 && expand.is_finite()) {
        return Err(f.err(
            "expand",
            format!("must be a positive number, found {expand}"),
        ));
    }
    // HF: intermediate_size = int(expand * hidden_size)
    let d_inner = expand * d_model as f64;
    if d_inner > MAX_D_INNER as f64 {
        return Err(f.err(
            "expand",
            format!(
                "expand × hidden_size = {expand} × {d_model} is over the {MAX_D_INNER} inner channels \
                 this engine accepts"
            ),
        ));
    }
    let d_inner = d_inner as usize;
    let n_heads = match f.opt_usize("num_heads")? {
        Some(h) => h,
        None => d_inner / head_dim.max(1),
    };
    f.require_flag("use_bias", false, "in_proj/out_proj biases")?;
    f.require_flag("rms_norm", true, "LayerNorm blocks (only RMSNorm)")?;
    // transformers' Mamba2 applies `hidden_act` after the conv (silu in every released
    // checkpoint; `swish` is its other name).
    if let Some(act) = f.opt_str("hidden_act")? {
        f.reject_if(
            "hidden_act",
            !matches!(act.as_str(), "silu" | "swish"),
            &format!("the conv's activation `{act}` (silu only)"),
        )?;
    }
    // transformers' Mamba2 gates before the norm whatever this flag says (its gated norm
    // takes no such option; its CUDA path passes `norm_before_gate=False`), and
    // Mamba-Codestral-7B's config.json, written when the flag still defaulted to true,
    // carries `true`: the flag is read, and a true one noted and ignored.
    let mut notices = Vec::new();
    if f.bool_or("norm_before_gate", false)? {
        notices.push(
            "ignoring `norm_before_gate: true`: transformers' Mamba2 applies the gate before \
             the norm whatever it says (as mamba_ssm's Codestral does)"
                .to_string(),
        );
    }
    Ok(ModelConfig {
        format: ModelFormat::HfMamba2,
        notices,
        d_model,
        n_layer: f.usize("num_hidden_layers")?,
        vocab_size: f.usize("vocab_size")?,
        d_inner,
        n_heads,
        head_dim,
        n_groups: f.usize_or("n_groups", 1)?,
        d_state: f.usize_or("state_size", 128)?,
        d_conv: f.usize_or("conv_kernel", 4)?,
        chunk_size: f.usize_or("chunk_size", 256)?,
        norm_eps: f.f64_or("layer_norm_epsilon", 1e-5)?,
        tie_embeddings: f.bool_or("tie_word_embeddings", true)?,
        conv_bias: f.bool_or("use_conv_bias", true)?,
        time_step_limit: f.pair_or("time_step_limit", NO_LIMIT)?,
        ..mamba_only()
    })
}

/// Nemotron-H's block kinds from `field`'s entries: each kind has a letter in the pattern,
/// an old name and the name transformers 5.x writes.
fn block_kinds(f: &Fields, field: &str, kinds: &[String]) -> Result<Vec<BlockKind>> {
    kinds
        .iter()
        .enumerate()
        .map(|(i, kind)| match kind.as_str() {
            "M" | "mamba" | "linear_attention" => Ok(BlockKind::Mamba2),
            "*" | "attention" | "full_attention" => Ok(BlockKind::Attention),
            "-" | "mlp" => Ok(BlockKind::Mlp),
            "E" | "moe" => Ok(BlockKind::Moe),
            _ => Err(f.err(
                field,
                format!(
                    "layer {i} has the unknown block type `{kind}` (expected M, *, - or E / \
                     mamba, attention, mlp, moe / linear_attention, full_attention)"
                ),
            )),
        })
        .collect()
}

fn parse_nemotron_h(f: &Fields) -> Result<ModelConfig> {
    // The layer list: the pattern (a letter a layer) or transformers 5.x's names; a
    // config holding both must agree.
    let pattern = f
        .opt_str("hybrid_override_pattern")?
        .map(|p| p.chars().map(|c| c.to_string()).collect::<Vec<_>>());
    let names = match f.get("layers_block_type") {
        None => None,
        Some(Value::Array(items)) => Some(
            items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| f.err("layers_block_type", "expected a list of strings"))?,
        ),
        Some(v) => {
            return Err(f.err(
                "layers_block_type",
                format!("expected a list of strings, found {v}"),
            ));
        }
    };
    let (blocks, field) = match (pattern, names) {
        (Some(p), names) => {
            let blocks = block_kinds(f, "hybrid_override_pattern", &p)?;
            if let Some(names) = names {
                let listed = block_kinds(f, "layers_block_type", &names)?;
                if listed != blocks {
                    let at = (0..blocks.len().max(listed.len()))
                        .find(|&i| blocks.get(i) != listed.get(i))
                        .unwrap_or(0);
                    return Err(f.err(
                        "layers_block_type",
                        format!(
                            "disagrees with `hybrid_override_pattern` ({} layers against {}, \
                             first at layer {at})",
                            listed.len(),
                            blocks.len()
                        ),
                    ));
                }
            }
            (blocks, "hybrid_override_pattern")
        }
        (None, Some(names)) => (
            block_kinds(f, "layers_block_type", &names)?,
            "layers_block_type",
        ),
        (None, None) => {
            return Err(f.err(
                "hybrid_override_pattern",
                "missing: a nemotron_h config needs `hybrid_override_pattern` or \
                 `layers_block_type`",
            ));
        }
    };
    // transformers 5.x writes no num_hidden_layers: the pattern is the layer list.
    let n_layer = f.usize_or("num_hidden_layers", blocks.len())?;
    if blocks.len() != n_layer {
        return Err(f.err(
            field,
            format!(
                "describes {} layers but num_hidden_layers is {n_layer}",
                blocks.len()
            ),
        ));
    }
    let mut notices = Vec::new();
    let mtp = f.usize_or("num_nextn_predict_layers", 0)?;
    if mtp > 0 {
        notices.push(format!(
            "{}: ignoring the {mtp} multi-token-prediction layer(s) (`num_nextn_predict_layers`): \
             they serve speculative decoding only",
            f.path.display()
        ));
    }
    let n_heads = f.usize("mamba_num_heads")?;
    let head_dim = f.usize("mamba_head_dim")?;
    f.require_flag("mamba_proj_bias", false, "in_proj/out_proj biases")?;
    f.require_flag("use_bias", false, "Mamba in_proj/out_proj biases")?;
    if let Some(act) = f.opt_str("mamba_hidden_act")? {
        f.reject_if(
            "mamba_hidden_act",
            act != "silu",
            "activations other than silu",
        )?;
    }
    let d_model = f.usize("hidden_size")?;
    let attention = if blocks.contains(&BlockKind::Attention) {
        let heads = f.usize("num_attention_heads")?;
        let kv_heads = f.usize_or("num_key_value_heads", heads)?;
        let head_dim = match f.opt_usize("head_dim")? {
            Some(h) => h,
            None => match f.opt_usize("attention_head_dim")? {
                Some(h) => h,
                None => d_model / heads.max(1),
            },
        };
        f.reject_if(
            "sliding_window",
            f.get("sliding_window").is_some(),
            "sliding-window attention",
        )?;
        Some(AttentionConfig::nemotron_h(heads, kv_heads, head_dim))
    } else {
        None
    };
    let mlp = if blocks.contains(&BlockKind::Mlp) {
        if let Some(act) = f.opt_str("mlp_hidden_act")? {
            f.reject_if(
                "mlp_hidden_act",
                act != "relu2",
                &format!("the MLP activation `{act}` (Nemotron-H MLPs are relu2)"),
            )?;
        }
        Some(MlpConfig {
            intermediate: f.usize("intermediate_size")?,
            act: MlpAct::Relu2,
            bias: f.bool_or("mlp_bias", false)?,
        })
    } else {
        None
    };
    let moe = if blocks.contains(&BlockKind::Moe) {
        Some(moe::parse_nemotron_h_moe(f)?)
    } else {
        None
    };
    // Older configs spell the Mamba options with a `mamba_` prefix.
    let either = |a: &str, b: &str, default: usize| -> Result<usize> {
        match f.opt_usize(a)? {
            Some(v) => Ok(v),
            None => f.usize_or(b, default),
        }
    };
    Ok(ModelConfig {
        format: ModelFormat::NemotronH,
        d_model,
        n_layer,
        vocab_size: f.usize("vocab_size")?,
        d_inner: n_heads * head_dim,
        n_heads,
        head_dim,
        n_groups: either("n_groups", "mamba_n_groups", 8)?,
        d_state: f.usize_or("ssm_state_size", 128)?,
        d_conv: either("conv_kernel", "mamba_d_conv", 4)?,
        chunk_size: either("chunk_size", "mamba_chunk_size", 128)?,
        norm_eps: f.f64_or("layer_norm_epsilon", 1e-5)?,
        tie_embeddings: f.bool_or("tie_word_embeddings", false)?,
        conv_bias: f.bool_or("use_conv_bias", true)?,
        // δ is limited by `time_step_limit` (released configs: (0, inf), i.e. not at all),
        // as in the CUDA paths of transformers and the model's own remote code, mamba_ssm,
        // vLLM and llama.cpp. transformers' slow path clamps δ at `time_step_min` instead,
        // a floor no fast path applies (transformers issue #47246).
        time_step_limit: f.pair_or("time_step_limit", NO_LIMIT)?,
        blocks,
        attention,
        mlp,
        moe,
        scales: Scales::default(),
        max_context: f.opt_usize("max_position_embeddings")?,
        notices,
    })
}

/// The non-Mamba fields of a pure Mamba2 config (`blocks` is filled in by `finish`).
pub(crate) fn mamba_only() -> ModelConfig {
    ModelConfig {
        format: ModelFormat::HfMamba2,
        d_model: 0,
        n_layer: 0,
        vocab_size: 0,
        d_inner: 0,
        n_heads: 0,
        head_dim: 0,
        n_groups: 0,
        d_state: 0,
        d_conv: 0,
        chunk_size: 0,
        norm_eps: 0.0,
        tie_embeddings: false,
        conv_bias: false,
        time_step_limit: NO_LIMIT,
        blocks: Vec::new(),
        attention: None,
        mlp: None,
        moe: None,
        scales: Scales {
            embedding: 1.0,
            residual: 1.0,
            logits: 1.0,
        },
        max_context: None,
        notices: Vec::new(),
    }
}

/// mamba_ssm's `MambaConfig`: the mixer options live in `ssm_cfg` with `Mamba2`'s
/// constructor defaults (d_state 128, d_conv 4, expand 2, headdim 64, ngroups 1, chunk 256).
fn parse_mamba_ssm(f: &Fields) -> Result<ModelConfig> {
    let d_model = f.usize("d_model")?;
    let vocab = f.usize("vocab_size")?;
    let pad = f.usize_or("pad_vocab_size_multiple", 8)?.max(1);
    if let Some(Value::Array(a)) = f.get("attn_layer_idx") {
        f.reject_if(
            "attn_layer_idx",
            !a.is_empty(),
            "hybrid models with attention layers",
        )?;
    }
    f.require_flag("rms_norm", true, "LayerNorm blocks (only RMSNorm)")?;
    let empty = Map::new();
    let ssm = f.nested("ssm_cfg")?.unwrap_or(Fields {
        obj: &empty,
        path: f.path.clone(),
        prefix: "ssm_cfg.".into(),
    });
    match ssm.opt_str("layer")?.as_deref() {
        Some("Mamba2") => {}
        Some(other) => ssm.reject_if("layer", true, &format!("`{other}` layers (only Mamba2)"))?,
        None => ssm.reject_if(
            "layer",
            true,
            "no layer given, which means Mamba1 (only Mamba2)",
        )?,
    }
    ssm.require_flag("bias", false, "in_proj/out_proj biases")?;
    ssm.require_flag("rmsnorm", true, "an ungated mixer norm")?;
    ssm.require_flag("norm_before_gate", false, "norm before gate")?;
    ssm.require_flag("D_has_hdim", false, "D per channel")?;
    ssm.reject_if(
        "d_ssm",
        ssm.get("d_ssm").is_some(),
        "a partial SSM with an MLP branch",
    )?;
    let expand = ssm.usize_or("expand", 2)?;
    let head_dim = ssm.usize_or("headdim", 64)?;
    let d_inner = expand * d_model;
    Ok(ModelConfig {
        format: ModelFormat::MambaSsm,
        d_model,
        n_layer: f.usize("n_layer")?,
        vocab_size: vocab.div_ceil(pad) * pad,
        d_inner,
        n_heads: d_inner / head_dim.max(1),
        head_dim,
        n_groups: ssm.usize_or("ngroups", 1)?,
        d_state: ssm.usize_or("d_state", 128)?,
        d_conv: ssm.usize_or("d_conv", 4)?,
        chunk_size: ssm.usize_or("chunk_size", 256)?,
        norm_eps: f.f64_or("norm_epsilon", 1e-5)?,
        tie_embeddings: f.bool_or("tie_embeddings", true)?,
        conv_bias: ssm.bool_or("conv_bias", true)?,
        time_step_limit: ssm.pair_or("dt_limit", NO_LIMIT)?,
        ..mamba_only()
    })
}

/// Mistral's `params.json` (mistral-inference `MambaArgs`): a mamba_ssm model built with
/// `ssm_cfg = {ngroups: n_groups, layer: Mamba2}` and the Mamba2 defaults otherwise.
fn parse_mistral(f: &Fields) -> Result<ModelConfig> {
    let d_model = f.usize("dim")?;
    let vocab = f.usize("vocab_size")?;
    let pad = f.usize_or("pad_vocab_size_multiple", 1)?.max(1);
    f.require_flag("rms_norm", true, "LayerNorm blocks (only RMSNorm)")?;
    let head_dim = 64;
    let d_inner = 2 * d_model;
    Ok(ModelConfig {
        format: ModelFormat::Mistral,
        d_model,
        n_layer: f.usize("n_layers")?,
        vocab_size: vocab.div_ceil(pad) * pad,
        d_inner,
        n_heads: d_inner / head_dim,
        head_dim,
        n_groups: f.usize_or("n_groups", 1)?,
        d_state: 128,
        d_conv: 4,
        chunk_size: 256,
        norm_eps: f.f64_or("norm_eps", 1e-5)?,
        tie_embeddings: f.bool_or("tie_embeddings", false)?,
        conv_bias: true,
        time_step_limit: NO_LIMIT,
        ..mamba_only()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(text, Path::new("config.json"))
    }

    /// A value written back by `to_hf_json` reads back with the same bits: serde_json's
    /// default float parser is off by an ulp on long mantissas such as this epsilon (the
    /// config fuzz target's find), hence its `float_roundtrip` feature.
    #[test]
    fn floats_round_trip_through_to_hf_json() {
        let c = parse(
            r#"{"model_type":"mamba2","hidden_size":64,"num_hidden_layers":2,"vocab_size":100,
            "num_heads":8,"head_dim":16,"state_size":16,"layer_norm_epsilon":0.00018446744073709554}"#,
        )
        .unwrap();
        let back = parse(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back.norm_eps.to_bits(), c.norm_eps.to_bits());
        assert_eq!(c.norm_eps, 0.00018446744073709554);
    }

    #[test]
    fn infinity_spellings() {
        let base = r#"{"model_type":"mamba2","hidden_size":64,"num_hidden_layers":2,"vocab_size":100,
            "num_heads":8,"head_dim":16,"state_size":16,"time_step_limit":LIMIT}"#;
        for limit in ["[0.0, Infinity]", r#"[0.0, {"__float__": "Infinity"}]"#] {
            let c = parse(&base.replace("LIMIT", limit)).unwrap();
            assert_eq!(c.time_step_limit, (0.0, f64::INFINITY));
        }
    }

    /// A Granite config that leaves keys out gets what transformers 5.17's
    /// `GraniteMoeHybridConfig()` gives them (printed by that version: untied embeddings, 8
    /// experts, top 2, shared MLP 1024, `mamba_d_head` "auto" = d_inner / mamba_n_heads).
    #[test]
    fn granite_defaults_are_transformers_defaults() {
        let c = parse(
            r#"{"model_type":"granitemoehybrid","hidden_size":128,"vocab_size":100,
            "layer_types":["mamba","attention"],"num_attention_heads":4,"intermediate_size":32}"#,
        )
        .unwrap();
        assert!(!c.tie_embeddings);
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.experts, m.top_k), (8, 2));
        assert_eq!(m.shared.as_ref().unwrap().intermediate, 1024);
        assert_eq!((c.n_heads, c.head_dim, c.d_inner), (128, 2, 256));
        assert_eq!(c.attention.as_ref().unwrap().rope_theta, None);
        // "auto" spelled out, and one that does not divide.
        let auto = r#"{"model_type":"granitemoehybrid","hidden_size":96,"vocab_size":100,
            "layer_types":["mamba"],"mamba_n_heads":HEADS,"mamba_d_head":"auto","intermediate_size":8}"#;
        assert_eq!(parse(&auto.replace("HEADS", "8")).unwrap().head_dim, 24);
        let e = parse(&auto.replace("HEADS", "7")).unwrap_err().to_string();
        assert!(e.contains("mamba_d_head") && e.contains("multiple"), "{e}");
    }

    #[test]
    fn infinity_inside_strings_is_untouched() {
        assert_eq!(
            quote_non_finite(r#"{"a":"Infinity x","b":Infinity}"#),
            r#"{"a":"Infinity x","b":"Infinity"}"#
        );
    }

    #[test]
    fn mamba_ssm_defaults_and_vocab_padding() {
        let c = parse(
            r#"{"d_model":768,"n_layer":24,"vocab_size":50277,"ssm_cfg":{"layer":"Mamba2"},
            "pad_vocab_size_multiple":16,"tie_embeddings":true}"#,
        )
        .unwrap();
        assert_eq!(
            (c.vocab_size, c.n_heads, c.head_dim, c.d_state),
            (50288, 24, 64, 128)
        );
        assert_eq!((c.conv_dim(), c.d_in_proj()), (1792, 3352));
    }

    #[test]
    fn mistral_codestral_shapes() {
        let c = parse(
            r#"{"dim":4096,"n_layers":64,"vocab_size":32768,"n_groups":8,"rms_norm":true,
            "residual_in_fp32":true,"fused_add_norm":true,"pad_vocab_size_multiple":1,
            "tie_embeddings":false,"model_type":"mamba"}"#,
        )
        .unwrap();
        assert_eq!(
            (c.n_heads, c.conv_dim(), c.d_in_proj()),
            (128, 10240, 18560)
        );
        assert_eq!(c.ssm_state_len() * 4, 4 << 20);
    }

    #[test]
    fn errors_name_the_field() {
        let e =
            parse(r#"{"model_type":"mamba2","num_hidden_layers":2,"vocab_size":100}"#).unwrap_err();
        assert!(e.to_string().contains("`hidden_size`: missing"), "{e}");
        let e = parse(
            r#"{"model_type":"mamba2","hidden_size":"big","num_hidden_layers":2,"vocab_size":100}"#,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("`hidden_size`: expected a non-negative integer"),
            "{e}"
        );
        let e = parse(
            r#"{"model_type":"mamba2","hidden_size":64,"num_hidden_layers":2,"vocab_size":100,
            "num_heads":7,"head_dim":16}"#,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("`head_dim`: heads × head_dim = 7 × 16 must equal d_inner = 128"),
            "{e}"
        );
        // ε beyond f32 (inf in the kernels) and a conv activation other than silu.
        let base = r#"{"model_type":"mamba2","hidden_size":64,"num_hidden_layers":2,"vocab_size":100,EXTRA}"#;
        for (extra, says) in [
            (
                r#""layer_norm_epsilon":1e300"#,
                "`layer_norm_epsilon`: must be a positive f32",
            ),
            (
                r#""layer_norm_epsilon":1e-50"#,
                "`layer_norm_epsilon`: must be a positive f32",
            ),
            (
                r#""hidden_act":"gelu""#,
                "`hidden_act`: the conv's activation `gelu`",
            ),
        ] {
            let e = parse(&base.replace("EXTRA", extra))
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{extra}: {e}");
        }
        for act in ["silu", "swish"] {
            let extra = format!(r#""hidden_act":"{act}""#);
            parse(&base.replace("EXTRA", &extra)).unwrap();
        }
        let e = parse(r#"{"d_model":64,"n_layer":2,"vocab_size":10,"ssm_cfg":{"ngroups":3,"layer":"Mamba2"}}"#)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("`ssm_cfg.ngroups`: 2 heads cannot be split into 3 groups"),
            "{e}"
        );
    }

    #[test]
    fn nemotron_h_hybrids_in_every_spelling() {
        let base = r#"{"model_type":"nemotron_h","hidden_size":48,"vocab_size":100,
            "mamba_num_heads":8,"mamba_head_dim":12,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":16,"intermediate_size":96,KINDS}"#;
        let spellings = [
            r#""hybrid_override_pattern":"M*-M""#,
            r#""layers_block_type":["mamba","attention","mlp","mamba"]"#,
            r#""layers_block_type":["linear_attention","full_attention","mlp","linear_attention"]"#,
        ];
        for kinds in spellings {
            let c = parse(&base.replace("KINDS", kinds)).unwrap();
            assert_eq!(c.pattern(), "M*-M", "{kinds}");
            assert_eq!(c.n_groups, 8, "transformers' default n_groups");
            let a = c.attention.as_ref().unwrap();
            assert_eq!(
                (a.heads, a.kv_heads, a.head_dim, a.q_width()),
                (4, 2, 16, 64)
            );
            assert_eq!(c.mlp.as_ref().unwrap().intermediate, 96);
            assert!(c.notices.is_empty());
        }
        // Both keys: they must agree; a list of another type is named as such.
        let both = r#""hybrid_override_pattern":"M*-M","layers_block_type":["mamba","attention","mlp","mamba"]"#;
        assert_eq!(
            parse(&base.replace("KINDS", both)).unwrap().pattern(),
            "M*-M"
        );
        for (kinds, want) in [
            (
                r#""hybrid_override_pattern":"M*-M","layers_block_type":["mamba","mlp","mlp","mamba"]"#,
                "`layers_block_type`: disagrees with `hybrid_override_pattern` (4 layers against 4, first at layer 1)",
            ),
            (
                r#""hybrid_override_pattern":"M*-M","layers_block_type":["mamba","attention","mlp"]"#,
                "`layers_block_type`: disagrees with `hybrid_override_pattern` (3 layers against 4, first at layer 3)",
            ),
            (
                r#""layers_block_type":"M*-M""#,
                "`layers_block_type`: expected a list of strings, found \"M*-M\"",
            ),
        ] {
            let e = parse(&base.replace("KINDS", kinds))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}\nwanted: {want}");
        }
        // Older option names, MTP layers noticed and ignored, attention_head_dim.
        let c = parse(&base.replace(
            "KINDS",
            r#""hybrid_override_pattern":"M*","mamba_n_groups":2,"mamba_d_conv":3,
            "num_nextn_predict_layers":1,"attention_head_dim":16"#,
        ))
        .unwrap();
        assert_eq!((c.n_groups, c.d_conv), (2, 3));
        assert!(
            c.notices[0].contains("ignoring the 1 multi-token-prediction layer"),
            "{:?}",
            c.notices
        );
    }

    /// Mamba-Codestral-7B's config.json as published (transformers 4.44's writing:
    /// `norm_before_gate` true, a Python tuple for `time_step_limit` spelled as a list)
    /// loads, the flag noted and ignored; a Nemotron-H config's δ limit is its
    /// `time_step_limit`, not `time_step_min` (transformers' slow-path floor).
    #[test]
    fn codestral_and_nemotron_h_dt_settings_read_as_the_fast_paths_do() {
        let c = parse(
            r#"{"architectures":["Mamba2ForCausalLM"],"chunk_size":256,"conv_kernel":4,
            "expand":2,"head_dim":64,"hidden_size":4096,"layer_norm_epsilon":1e-05,
            "model_type":"mamba2","n_groups":8,"norm_before_gate":true,"num_heads":128,
            "num_hidden_layers":64,"residual_in_fp32":true,"rms_norm":true,"state_size":128,
            "tie_word_embeddings":false,"time_step_limit":[0.0,{"__float__":"Infinity"}],
            "time_step_max":0.1,"time_step_min":0.001,"use_bias":false,"use_conv_bias":true,
            "vocab_size":32768}"#,
        )
        .unwrap();
        assert_eq!((c.n_heads, c.n_groups, c.d_inner), (128, 8, 8192));
        assert!(c.notices[0].contains("norm_before_gate"), "{:?}", c.notices);
        let nemotron = r#"{"model_type":"nemotron_h","hidden_size":48,"num_hidden_layers":2,
            "vocab_size":100,"hybrid_override_pattern":"MM","mamba_num_heads":8,
            "mamba_head_dim":12,"n_groups":1,"time_step_min":0.001LIMIT}"#;
        let c = parse(&nemotron.replace("LIMIT", "")).unwrap();
        assert_eq!(c.time_step_limit, (0.0, f64::INFINITY));
        let c = parse(&nemotron.replace("LIMIT", r#","time_step_limit":[0.01,5.0]"#)).unwrap();
        assert_eq!(c.time_step_limit, (0.01, 5.0));
    }

    #[test]
    fn unsupported_configs_say_why() {
        let moe = r#"{"model_type":"nemotron_h","hidden_size":48,"num_hidden_layers":3,"vocab_size":100,
            "hybrid_override_pattern":"MEM","mamba_num_heads":8,"mamba_head_dim":12,"n_groups":1,
            "n_routed_experts":8,"moe_intermediate_size":16,"n_group":2,"topk_group":1,
            "num_experts_per_tok":TOPK}"#;
        let c = parse(&moe.replace("TOPK", "2")).unwrap();
        assert_eq!(c.pattern(), "MEM");
        assert_eq!(c.moe.as_ref().map(|m| (m.experts, m.top_k)), Some((8, 2)));
        let e = parse(&moe.replace("TOPK", "9")).unwrap_err();
        assert!(
            e.to_string()
                .contains("`num_experts_per_tok`: num_experts_per_tok 9"),
            "{e}"
        );
        let e = parse(
            &moe.replace("TOPK", "2")
                .replace("\"n_routed_experts\":8,", ""),
        )
        .unwrap_err();
        assert!(e.to_string().contains("`n_routed_experts`: missing"), "{e}");
        let e = parse(r#"{"d_model":64,"n_layer":2,"vocab_size":10,"ssm_cfg":{}}"#).unwrap_err();
        assert!(e.to_string().contains("Mamba1"), "{e}");
        let e = parse(r#"{"model_type":"llama","hidden_size":64}"#).unwrap_err();
        assert!(e.to_string().contains("model_type `llama`"), "{e}");
        let e = parse("{not json").unwrap_err();
        assert!(
            e.to_string().starts_with("config.json: not valid JSON"),
            "{e}"
        );
    }
}
