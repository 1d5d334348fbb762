//! IBM Granite-4.0-H (`model_type: granitemoehybrid`, transformers' `GraniteMoeHybrid`).
//! Each of its layers is two blocks of this engine: the mixer (Mamba2 or attention, normed by
//! `input_layernorm`), then the feed-forward (normed by `post_attention_layernorm`): a shared
//! gated MLP plus an MoE, or the shared MLP alone in the dense models. Its µP multipliers
//! become `Scales`.

use serde_json::Value;

use super::moe::{MoeConfig, Router};
use super::{
    AttentionConfig, BlockKind, Fields, MlpAct, MlpConfig, ModelConfig, ModelFormat, NO_LIMIT,
    Scales,
};
use crate::error::Result;

pub(super) fn parse_granite(f: &Fields) -> Result<ModelConfig> {
    let Some(Value::Array(items)) = f.get("layer_types") else {
        return Err(f.err(
            "layer_types",
            "missing: a granitemoehybrid config lists its layers in `layer_types`",
        ));
    };
    let n = f.usize_or("num_hidden_layers", items.len())?;
    if items.len() != n {
        return Err(f.err(
            "layer_types",
            format!(
                "describes {} layers but num_hidden_layers is {n}",
                items.len()
            ),
        ));
    }
    // Absent keys take transformers' `GraniteMoeHybridConfig` defaults (5.17): 8 experts,
    // top 2, a shared MLP of 1024, untied embeddings, `mamba_d_head: "auto"`.
    let experts = f.usize_or("num_local_experts", 8)?;
    let ffn = if experts > 0 {
        BlockKind::Moe
    } else {
        BlockKind::Mlp
    };
    // Bounded before the block list is allocated (from_json_str checks the rest).
    if n > super::MAX_LAYERS {
        return Err(f.err(
            "num_hidden_layers",
            format!(
                "{n} layers is over the {} this engine accepts",
                super::MAX_LAYERS
            ),
        ));
    }
    let mut blocks = Vec::with_capacity(2 * n);
    for (i, item) in items.iter().enumerate() {
        let mixer = match item.as_str() {
            Some("mamba" | "linear_attention") => BlockKind::Mamba2,
            Some("attention" | "full_attention") => BlockKind::Attention,
            _ => {
                return Err(f.err(
                    "layer_types",
                    format!(
                        "layer {i} has the unknown type {item} (expected mamba / attention or \
                         linear_attention / full_attention)"
                    ),
                ));
            }
        };
        blocks.extend([mixer, ffn]);
    }
    let d_model = f.usize("hidden_size")?;
    if let Some(act) = f.opt_str("hidden_act")? {
        f.reject_if(
            "hidden_act",
            act != "silu",
            &format!("the MLP activation `{act}` (Granite's MLPs are silu-gated)"),
        )?;
    }
    f.require_flag("mamba_proj_bias", false, "in_proj/out_proj biases")?;
    f.require_flag("attention_bias", false, "attention projection biases")?;
    // transformers' Granite/Bamba Mamba layer normalizes the gated output over all of
    // d_inner: the grouped norm of mamba_ssm only when there is one group.
    let n_groups = f.usize_or("mamba_n_groups", 1)?;
    f.reject_if(
        "mamba_n_groups",
        n_groups > 1,
        &format!(
            "{n_groups} groups: transformers' Granite Mamba layer normalizes over all of d_inner, \
             which differs from the grouped norm for more than one group (released Granite-4.0-H \
             models use 1)"
        ),
    )?;
    let expand = f.usize_or("mamba_expand", 2)?;
    let n_heads = f.usize_or("mamba_n_heads", 128)?;
    let d_inner = expand.saturating_mul(d_model);
    // "auto" (transformers' default): d_inner split evenly over the heads.
    let head_dim = match f.get("mamba_d_head") {
        Some(Value::String(s)) if s == "auto" => {
            if n_heads == 0 || !d_inner.is_multiple_of(n_heads) {
                return Err(f.err(
                    "mamba_d_head",
                    format!(
                        "\"auto\" needs mamba_expand × hidden_size ({d_inner}) to be a multiple \
                         of mamba_n_heads ({n_heads})"
                    ),
                ));
            }
            d_inner / n_heads
        }
        _ => f.usize_or("mamba_d_head", d_inner / n_heads.max(1))?,
    };
    let attention = if blocks.contains(&BlockKind::Attention) {
        let heads = f.usize("num_attention_heads")?;
        let rope_theta = match f.opt_str("position_embedding_type")?.as_deref() {
            None | Some("nope") => None,
            Some("rope") => Some(match f.nested("rope_parameters")? {
                Some(p) => p.f64_or("rope_theta", 10_000.0)?,
                None => f.f64_or("rope_theta", 10_000.0)?,
            }),
            Some(other) => {
                return Err(f.err(
                    "position_embedding_type",
                    format!("`{other}` (expected nope or rope)"),
                ));
            }
        };
        if rope_theta.is_some() {
            if let Some(p) = f.nested("rope_parameters")? {
                let kind = p.opt_str("rope_type")?;
                p.reject_if(
                    "rope_type",
                    kind.as_deref().is_some_and(|k| k != "default"),
                    "scaled rotary embeddings",
                )?;
            }
            // Configs written before `rope_parameters` (transformers 4.x) carry the scaling
            // at the top level.
            f.reject_if(
                "rope_scaling",
                f.get("rope_scaling").is_some(),
                "scaled rotary embeddings",
            )?;
        }
        Some(AttentionConfig {
            heads,
            kv_heads: f.usize_or("num_key_value_heads", heads)?,
            head_dim: d_model / heads.max(1),
            bias: false,
            rope_theta,
            scale: f.f64_or("attention_multiplier", 1.0)?,
        })
    } else {
        None
    };
    let shared_width = f.usize_or("shared_intermediate_size", 1024)?;
    let gated = |intermediate| MlpConfig {
        intermediate,
        act: MlpAct::SiluGated,
        bias: false,
    };
    let (mlp, moe) = if experts > 0 {
        let moe = MoeConfig {
            experts,
            top_k: f.usize_or("num_experts_per_tok", 2)?,
            intermediate: f.usize("intermediate_size")?,
            act: MlpAct::SiluGated,
            router: Router::SoftmaxTopK,
            shared: (shared_width > 0).then(|| gated(shared_width)),
            latent: None,
        };
        (None, Some(moe))
    } else {
        if shared_width == 0 {
            return Err(f.err(
                "shared_intermediate_size",
                "must be positive in a model without experts (num_local_experts 0): it is the \
                 width of every layer's MLP",
            ));
        }
        (Some(gated(shared_width)), None)
    };
    let scale = |field: &str| -> Result<f64> {
        let v = f.f64_or(field, 1.0)?;
        if !(v.is_finite() && v != 0.0) {
            return Err(f.err(
                field,
                format!("must be a finite non-zero number, found {v}"),
            ));
        }
        Ok(v)
    };
    let scales = Scales {
        embedding: scale("embedding_multiplier")?,
        residual: scale("residual_multiplier")?,
        logits: 1.0 / scale("logits_scaling")?,
    };
    Ok(ModelConfig {
        format: ModelFormat::Granite,
        d_model,
        n_layer: blocks.len(),
        vocab_size: f.usize("vocab_size")?,
        d_inner,
        n_heads,
        head_dim,
        n_groups,
        d_state: f.usize_or("mamba_d_state", 256)?,
        d_conv: f.usize_or("mamba_d_conv", 4)?,
        chunk_size: f.usize_or("mamba_chunk_size", 256)?,
        norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
        tie_embeddings: f.bool_or("tie_word_embeddings", false)?,
        conv_bias: f.bool_or("mamba_conv_bias", true)?,
        time_step_limit: f.pair_or("time_step_limit", NO_LIMIT)?,
        blocks,
        attention,
        mlp,
        moe,
        scales,
        max_context: f.opt_usize("max_position_embeddings")?,
        notices: Vec::new(),
    })
}

/// A Granite config as transformers writes it (what `Model::save` writes for this format).
pub(super) fn to_granite_json(c: &ModelConfig) -> serde_json::Value {
    let layer_types: Vec<&str> = c
        .blocks
        .iter()
        .step_by(2)
        .map(|k| match k {
            BlockKind::Attention => "attention",
            _ => "mamba",
        })
        .collect();
    let limit = |x: f64| {
        if x.is_finite() {
            serde_json::json!(x)
        } else {
            serde_json::json!({"__float__": "Infinity"})
        }
    };
    let mut v = serde_json::json!({
        "model_type": "granitemoehybrid",
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "hidden_size": c.d_model,
        "num_hidden_layers": layer_types.len(),
        "layer_types": layer_types,
        "vocab_size": c.vocab_size,
        "mamba_n_heads": c.n_heads,
        "mamba_d_head": c.head_dim,
        "mamba_expand": c.d_inner / c.d_model.max(1),
        "mamba_n_groups": c.n_groups,
        "mamba_d_state": c.d_state,
        "mamba_d_conv": c.d_conv,
        "mamba_chunk_size": c.chunk_size,
        "mamba_conv_bias": c.conv_bias,
        "mamba_proj_bias": false,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "time_step_limit": [limit(c.time_step_limit.0), limit(c.time_step_limit.1)],
        "embedding_multiplier": c.scales.embedding,
        "residual_multiplier": c.scales.residual,
        "logits_scaling": 1.0 / c.scales.logits,
        "hidden_act": "silu",
    });
    if let Some(a) = &c.attention {
        v["num_attention_heads"] = a.heads.into();
        v["num_key_value_heads"] = a.kv_heads.into();
        v["attention_multiplier"] = a.scale.into();
        match a.rope_theta {
            Some(theta) => {
                v["position_embedding_type"] = "rope".into();
                v["rope_theta"] = theta.into();
            }
            None => v["position_embedding_type"] = "nope".into(),
        }
    }
    match (&c.moe, &c.mlp) {
        (Some(m), _) => {
            v["num_local_experts"] = m.experts.into();
            v["num_experts_per_tok"] = m.top_k.into();
            v["intermediate_size"] = m.intermediate.into();
            v["shared_intermediate_size"] = m.shared.as_ref().map_or(0, |s| s.intermediate).into();
        }
        (None, Some(m)) => {
            v["num_local_experts"] = 0.into();
            v["shared_intermediate_size"] = m.intermediate.into();
        }
        (None, None) => {}
    }
    if let Some(n) = c.max_context {
        v["max_position_embeddings"] = n.into();
    }
    v
}
