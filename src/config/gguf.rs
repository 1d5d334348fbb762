//! The model config of a GGUF file, from its metadata as llama.cpp's converter writes it
//! for the `mamba2` architecture (`convert_hf_to_gguf.py`, `Mamba2Model`): the SSM shapes
//! under `mamba2.ssm.*`, the head count as `time_step_rank`, the vocabulary as the rows of
//! `token_embd`, a tied head when there is no `output.weight`; and for `nemotron_h`
//! (`NemotronHModel`): the same SSM keys under `nemotron_h.ssm.*`, and the layer kinds from
//! the per-layer arrays `feed_forward_length` and `attention.head_count_kv` as llama.cpp's
//! loader reads them (both 0: Mamba2; only the first 0: attention; else an MLP); and for
//! `nemotron_h_moe` (Nemotron 3 Nano) the same with every feed-forward layer an MoE block
//! (llama.cpp's loader: any non-zero `expert_count` makes them so) whose routing comes
//! from the `expert_*` keys.

use super::moe::{MoeConfig, Router};
use super::{AttentionConfig, BlockKind, MlpAct, MlpConfig, ModelConfig, ModelFormat, mamba_only};
use crate::error::{Error, Result};
use crate::model::gguf::{GgufFile, Value};

/// The SSD chunk length GGUF files do not record: HF's default.
const DEFAULT_CHUNK: usize = 256;

impl ModelConfig {
    /// The normalized config of `file`; errors name the metadata key.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.str("general.architecture")?;
        let gguf = [
            ModelFormat::GgufMamba2,
            ModelFormat::GgufNemotronH,
            ModelFormat::GgufNemotronHMoe,
            ModelFormat::GgufGranite,
        ];
        let format = match gguf.into_iter().find(|f| f.gguf_arch() == Some(arch)) {
            Some(f) => f,
            None => {
                return Err(Error::Unsupported(format!(
                    "{}: GGUF architecture `{arch}` (this engine reads `mamba2`, `nemotron_h`, \
                     `nemotron_h_moe` and `granitehybrid` GGUF files; run other models from \
                     their safetensors checkpoints)",
                    file.path.display()
                )));
            }
        };
        let key = |k: &str| format!("{arch}.{k}");
        let d_inner = file.usize(&key("ssm.inner_size"))?;
        let n_heads = file.usize(&key("ssm.time_step_rank"))?;
        if n_heads == 0 || !d_inner.is_multiple_of(n_heads) {
            return Err(file.key_error(
                &key("ssm.time_step_rank"),
                format!("{n_heads} heads do not divide the {d_inner} inner channels"),
            ));
        }
        let embd = file
            .tensors
            .iter()
            .find(|t| t.name == "token_embd.weight")
            .ok_or_else(|| {
                Error::tensor(
                    "token_embd.weight",
                    format!("{}: missing", file.path.display()),
                )
            })?;
        let has = |name: &str| file.tensors.iter().any(|t| t.name == name);
        // Keys this engine takes from elsewhere are still checked: a file that contradicts
        // itself is refused, not run on one of its two answers.
        if let Some(v) = file.opt_usize(&key("vocab_size"))?
            && v != embd.shape[0]
        {
            return Err(file.key_error(
                &key("vocab_size"),
                format!(
                    "{v} tokens, but token_embd.weight has {} rows",
                    embd.shape[0]
                ),
            ));
        }
        // The trained context (llama.cpp's converter writes `max_position_embeddings` here):
        // the default KV cache length, as a JSON config's is.
        let max_context = file.opt_usize(&key("context_length"))?;
        if max_context == Some(0) {
            return Err(file.key_error(&key("context_length"), "must be at least 1"));
        }
        let n_layer = file.usize(&key("block_count"))?;
        let config = ModelConfig {
            format,
            d_model: file.usize(&key("embedding_length"))?,
            n_layer,
            vocab_size: embd.shape[0],
            d_inner,
            n_heads,
            head_dim: d_inner / n_heads,
            n_groups: file.opt_usize(&key("ssm.group_count"))?.unwrap_or(1),
            d_state: file.usize(&key("ssm.state_size"))?,
            d_conv: file.usize(&key("ssm.conv_kernel"))?,
            chunk_size: DEFAULT_CHUNK,
            norm_eps: norm_eps(file, &key)?,
            tie_embeddings: !has("output.weight"),
            conv_bias: has("blk.0.ssm_conv1d.bias"),
            max_context,
            blocks: Vec::new(),
            ..mamba_only()
        };
        // The block list is made after the layer count is bounded (as for JSON configs).
        if n_layer > super::MAX_LAYERS {
            return Err(file.key_error(
                &key("block_count"),
                format!(
                    "{n_layer} layers is over the {} this engine accepts",
                    super::MAX_LAYERS
                ),
            ));
        }
        let config = if format == ModelFormat::GgufGranite {
            granite_layers(file, config)?
        } else if format != ModelFormat::GgufMamba2 {
            nemotron_h_layers(file, arch, config)?
        } else {
            ModelConfig {
                blocks: vec![BlockKind::Mamba2; n_layer],
                ..config
            }
        };
        config.validate(&file.path)?;
        Ok(config)
    }
}

/// A per-layer value of `key`: an array of one value per layer, or one value for all.
fn per_layer(file: &GgufFile, key: &str, n_layer: usize) -> Result<Vec<usize>> {
    let Some(Value::Array(items)) = file.get(key) else {
        return Ok(vec![file.opt_usize(key)?.unwrap_or(0); n_layer]);
    };
    if items.len() != n_layer {
        return Err(file.key_error(key, format!("{} values for {n_layer} layers", items.len())));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    file.key_error(key, format!("value {i} is not a non-negative integer"))
                })
        })
        .collect()
}

/// The one non-zero value of `values` (every layer that has one must agree), or 0.
fn common(file: &GgufFile, key: &str, values: &[usize]) -> Result<usize> {
    let mut found = 0;
    for (i, &v) in values.iter().enumerate() {
        if v != 0 && found != 0 && v != found {
            return Err(file.key_error(
                key,
                format!("layer {i} has {v}, an earlier layer {found}: this engine needs one value"),
            ));
        }
        if v != 0 {
            found = v;
        }
    }
    Ok(found)
}

/// The attention layers' shape of a hybrid `arch` whose per-layer kv head counts are `kv`:
/// `attention.head_count` query heads sharing the one non-zero kv count evenly, heads of
/// `attention.key_length` (else d_model / heads) that `attention.value_length` must repeat,
/// no positional encoding and scale 1/√head_dim (llama.cpp's graph without
/// `attention.scale`).
fn attention_shape(
    file: &GgufFile,
    arch: &str,
    kv: &[usize],
    d_model: usize,
) -> Result<AttentionConfig> {
    let key = |k: &str| format!("{arch}.{k}");
    let heads_key = key("attention.head_count");
    let heads = file.usize(&heads_key)?;
    let kv_heads = common(file, &key("attention.head_count_kv"), kv)?;
    if heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(file.key_error(
            &heads_key,
            format!("{heads} query heads do not share {kv_heads} key/value heads evenly"),
        ));
    }
    let head_dim = match file.opt_usize(&key("attention.key_length"))? {
        Some(h) => h,
        None => d_model / heads,
    };
    if let Some(v) = file.opt_usize(&key("attention.value_length"))?
        && v != head_dim
    {
        return Err(file.key_error(
            &key("attention.value_length"),
            format!("{v} differs from the key length {head_dim}"),
        ));
    }
    Ok(AttentionConfig::nemotron_h(heads, kv_heads, head_dim))
}

/// A multiplier key: its value, or 1 when absent or 0 (llama.cpp writes the Granite scales
/// only when non-zero, and its graph skips an expert weights scale of 0).
fn scale_or_one(file: &GgufFile, key: &str) -> Result<f64> {
    Ok(match file.opt_f64(key)? {
        Some(v) if v != 0.0 => v,
        _ => 1.0,
    })
}

/// Nemotron-H's blocks, attention and MLP shapes (see the module doc). llama.cpp's graph
/// runs attention without positional encoding, with scale 1/√head_dim, and MLPs as
/// `down(relu(up(x))²)`; its SSM scan clamps nothing, so neither does this config.
fn nemotron_h_layers(file: &GgufFile, arch: &str, config: ModelConfig) -> Result<ModelConfig> {
    let n = config.n_layer;
    let key = |k: &str| format!("{arch}.{k}");
    let ff_key = key("feed_forward_length");
    let kv_key = key("attention.head_count_kv");
    let ff = per_layer(file, &ff_key, n)?;
    let kv = per_layer(file, &kv_key, n)?;
    // With experts, a feed-forward layer is an MoE block unless it holds a dense MLP's
    // `ffn_up` (llama.cpp's loader makes every one an MoE; the converter writes no dense
    // layer into a `nemotron_h_moe` file, but one with a dense layer reads here too).
    let experts = file.opt_usize(&key("expert_count"))?.unwrap_or(0);
    // The tensor names once (a layer's checks look up to five names: a scan of the list
    // each time made a file of 4096 layers and 200 000 tensors take seconds a MB).
    let names: std::collections::HashSet<&str> =
        file.tensors.iter().map(|t| t.name.as_str()).collect();
    let has = |name: &str| names.contains(name);
    let dense = |i: usize| experts == 0 || has(&format!("blk.{i}.ffn_up.weight"));
    let blocks: Vec<BlockKind> = ff
        .iter()
        .zip(&kv)
        .enumerate()
        .map(|(i, (&f, &k))| match (f, k) {
            (0, 0) => BlockKind::Mamba2,
            (0, _) => BlockKind::Attention,
            _ if dense(i) => BlockKind::Mlp,
            _ => BlockKind::Moe,
        })
        .collect();
    // The metadata decide each layer's kind; a layer whose tensors are another kind's is a
    // file that contradicts itself: said by the keys, not as a tensor missing later.
    let marker = |kind: BlockKind| match kind {
        BlockKind::Mamba2 => "ssm_in.weight",
        BlockKind::Attention => "attn_q.weight",
        BlockKind::Mlp => "ffn_up.weight",
        BlockKind::Moe => "ffn_gate_inp.weight",
    };
    for (i, &kind) in blocks.iter().enumerate() {
        if has(&format!("blk.{i}.{}", marker(kind))) {
            continue;
        }
        let other = [
            BlockKind::Mamba2,
            BlockKind::Attention,
            BlockKind::Mlp,
            BlockKind::Moe,
        ]
        .into_iter()
        .find(|&k| k != kind && has(&format!("blk.{i}.{}", marker(k))));
        if let Some(other) = other {
            return Err(file.key_error(
                &format!("{ff_key}` / `{kv_key}"),
                format!(
                    "they make layer {i} a block of kind `{}` ({ff_key}[{i}] = {}, \
                     {kv_key}[{i}] = {}), but its tensors are of kind `{}` (blk.{i}.{})",
                    kind.name(),
                    ff[i],
                    kv[i],
                    other.name(),
                    marker(other)
                ),
            ));
        }
    }
    // The feed-forward lengths of the layers of one kind.
    let widths = |kind: BlockKind| -> Vec<usize> {
        ff.iter()
            .zip(&blocks)
            .map(|(&f, &b)| if b == kind { f } else { 0 })
            .collect()
    };
    let moe = if blocks.contains(&BlockKind::Moe) {
        let ff_moe = common(file, &ff_key, &widths(BlockKind::Moe))?;
        Some(nemotron_h_moe(file, arch, experts, ff_moe)?)
    } else {
        None
    };
    let attention = if blocks.contains(&BlockKind::Attention) {
        Some(attention_shape(file, arch, &kv, config.d_model)?)
    } else {
        None
    };
    let mlp = if blocks.contains(&BlockKind::Mlp) {
        Some(MlpConfig {
            intermediate: common(file, &ff_key, &widths(BlockKind::Mlp))?,
            act: MlpAct::Relu2,
            bias: false,
        })
    } else {
        None
    };
    Ok(ModelConfig {
        blocks,
        attention,
        mlp,
        moe,
        ..config
    })
}

/// The MoE blocks of a `nemotron_h_moe` file (`E` experts): relu² experts of
/// `expert_feed_forward_length` (which the per-layer feed-forward lengths, `ff`, must
/// repeat), a shared expert of `expert_shared_feed_forward_length` (none at 0), sigmoid
/// routing with the correction bias (`exp_probs_b`), limited to `expert_group_used_count` of
/// `expert_group_count` groups, weights normalised when `expert_weights_norm`, times
/// `expert_weights_scale` (0 or absent: 1, as llama.cpp's graph skips it), and latent
/// projections of `moe_latent_size`. llama.cpp's graph takes sigmoid gating for this
/// architecture whatever `expert_gating_func` says, and so does this config.
fn nemotron_h_moe(file: &GgufFile, arch: &str, experts: usize, ff: usize) -> Result<MoeConfig> {
    let key = |k: &str| format!("{arch}.{k}");
    let width_key = key("expert_feed_forward_length");
    let intermediate = match file.opt_usize(&width_key)? {
        Some(w) => w,
        None => ff,
    };
    if ff != 0 && ff != intermediate {
        return Err(file.key_error(
            &key("feed_forward_length"),
            format!("{ff} on the MoE layers differs from {width_key} {intermediate}"),
        ));
    }
    let shared = match file
        .opt_usize(&key("expert_shared_feed_forward_length"))?
        .unwrap_or(0)
    {
        0 => None,
        width => Some(MlpConfig {
            intermediate: width,
            act: MlpAct::Relu2,
            bias: false,
        }),
    };
    let groups = |k: &str| -> Result<usize> { Ok(file.opt_usize(&key(k))?.unwrap_or(1).max(1)) };
    let n_group = groups("expert_group_count")?;
    // (llama.cpp's converter writes no used-group count: with groups, routing within one
    // group would differ from the checkpoint's `topk_group`.)
    if n_group > 1 && file.get(&key("expert_group_used_count")).is_none() {
        return Err(file.key_error(
            &key("expert_group_used_count"),
            "missing: the file has expert groups but does not say how many a token may use",
        ));
    }
    Ok(MoeConfig {
        experts,
        top_k: file.usize(&key("expert_used_count"))?,
        intermediate,
        act: MlpAct::Relu2,
        router: Router::Grouped {
            n_group,
            topk_group: groups("expert_group_used_count")?,
            norm_topk_prob: file.opt_bool(&key("expert_weights_norm"))?.unwrap_or(false),
            routed_scaling_factor: scale_or_one(file, &key("expert_weights_scale"))?,
        },
        shared,
        latent: file.opt_usize(&key("moe_latent_size"))?,
    })
}

/// Granite-4.0-H's blocks (`granitehybrid`, llama.cpp's `GraniteHybridModel` converter and
/// loader): each layer a mixer block — Mamba2 where its `attention.head_count_kv` is 0,
/// attention (no positional encoding, scale `attention.scale`) elsewhere — then an MoE
/// block: softmax top-`expert_used_count` of `expert_count` gated experts of
/// `feed_forward_length`, plus the shared gated MLP of `expert_shared_feed_forward_length`;
/// the µP scales from `embedding_scale`, `residual_scale` and `logit_scale` (logits divided
/// by it). The gated Mamba norm spans all of d_inner (one group only, as for the safetensors
/// config). Dense Granite files (no experts) and rotary ones are refused: no fixture of
/// either was made.
fn granite_layers(file: &GgufFile, config: ModelConfig) -> Result<ModelConfig> {
    let key = |k: &str| format!("granitehybrid.{k}");
    let n = config.n_layer;
    let kv_key = key("attention.head_count_kv");
    let kv = per_layer(file, &kv_key, n)?;
    let experts = file.opt_usize(&key("expert_count"))?.unwrap_or(0);
    if experts == 0 {
        return Err(Error::Unsupported(format!(
            "{}: a granitehybrid GGUF without experts (`granitehybrid.expert_count` 0 or \
             absent): dense Granite-4.0-H files are not read yet; run the safetensors checkpoint",
            file.path.display()
        )));
    }
    // llama.cpp reads this key as the switch for rotary embeddings, on when absent.
    if file.opt_bool(&key("rope.scaling.finetuned"))? != Some(false) {
        return Err(Error::Unsupported(format!(
            "{}: `granitehybrid.rope.scaling.finetuned` true or absent (rotary embeddings, whose q/k rows \
             llama.cpp's converter permutes): only Granite-4.0-H's position-free attention is \
             read from GGUF; run the safetensors checkpoint",
            file.path.display()
        )));
    }
    if config.n_groups > 1 {
        return Err(file.key_error(
            &key("ssm.group_count"),
            format!(
                "{} groups: Granite's Mamba layer normalizes over all of d_inner, which differs \
                 from the grouped norm for more than one group",
                config.n_groups
            ),
        ));
    }
    let blocks: Vec<BlockKind> = kv
        .iter()
        .flat_map(|&k| {
            let mixer = if k == 0 {
                BlockKind::Mamba2
            } else {
                BlockKind::Attention
            };
            [mixer, BlockKind::Moe]
        })
        .collect();
    let attention = if blocks.contains(&BlockKind::Attention) {
        let shape = attention_shape(file, "granitehybrid", &kv, config.d_model)?;
        // llama.cpp's graph takes a scale of 0 as absent (1/√head_dim), as it does here.
        Some(AttentionConfig {
            scale: file
                .opt_f64(&key("attention.scale"))?
                .filter(|&s| s != 0.0)
                .unwrap_or(shape.scale),
            ..shape
        })
    } else {
        None
    };
    let gated = |intermediate| MlpConfig {
        intermediate,
        act: MlpAct::SiluGated,
        bias: false,
    };
    let shared = file
        .opt_usize(&key("expert_shared_feed_forward_length"))?
        .unwrap_or(0);
    let moe = MoeConfig {
        experts,
        top_k: file.usize(&key("expert_used_count"))?,
        intermediate: file.usize(&key("feed_forward_length"))?,
        act: MlpAct::SiluGated,
        router: Router::SoftmaxTopK,
        shared: (shared > 0).then(|| gated(shared)),
        latent: None,
    };
    let scale = |k: &str| scale_or_one(file, &key(k));
    let scales = super::Scales {
        embedding: scale("embedding_scale")?,
        residual: scale("residual_scale")?,
        logits: 1.0 / scale("logit_scale")?,
    };
    Ok(ModelConfig {
        n_layer: blocks.len(),
        blocks,
        attention,
        moe: Some(moe),
        scales,
        ..config
    })
}

/// The norms' epsilon: `attention.layer_norm_rms_epsilon`, else llama.cpp's LayerNorm key
/// `attention.layer_norm_epsilon` (which some converters write), else 1e-5; a value that is
/// not positive is refused naming the key the file holds (the config check would name the
/// first).
fn norm_eps(file: &GgufFile, key: &dyn Fn(&str) -> String) -> Result<f64> {
    for name in [
        key("attention.layer_norm_rms_epsilon"),
        key("attention.layer_norm_epsilon"),
    ] {
        if let Some(e) = file.opt_f64(&name)? {
            if !(e > 0.0 && e.is_finite()) {
                return Err(file.key_error(&name, format!("must be a positive number, found {e}")));
            }
            return Ok(e);
        }
    }
    Ok(1e-5)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF v3 file of one f32 metadata value and one tensor (`t`, a single f32).
    fn one_f32_file(key: &str, value: f32) -> std::path::PathBuf {
        let mut b = Vec::new();
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key.as_bytes());
        b.extend(6u32.to_le_bytes());
        b.extend(value.to_le_bytes());
        // Tensor `t`: 1 dimension of 1, type F32, at offset 0 of the aligned data.
        b.extend(1u64.to_le_bytes());
        b.extend(b"t");
        b.extend(1u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.resize(b.len().next_multiple_of(32), 0);
        b.extend(1f32.to_le_bytes());
        b.resize(b.len().next_multiple_of(32), 0);
        let path = std::env::temp_dir().join(format!(
            "norm-eps-{}-{}.gguf",
            std::process::id(),
            key.len()
        ));
        std::fs::write(&path, b).unwrap();
        path
    }

    #[test]
    fn a_bad_norm_epsilon_names_the_key_the_file_holds() {
        let key = |k: &str| format!("mamba2.{k}");
        for name in [
            "mamba2.attention.layer_norm_rms_epsilon",
            "mamba2.attention.layer_norm_epsilon",
        ] {
            let path = one_f32_file(name, -1.0);
            let file = GgufFile::open(&path).unwrap();
            let err = norm_eps(&file, &key).unwrap_err().to_string();
            assert!(err.contains(&format!("`{name}`")), "{err}");
            std::fs::remove_file(&path).ok();
            let path = one_f32_file(name, 1e-6);
            let file = GgufFile::open(&path).unwrap();
            assert_eq!(norm_eps(&file, &key).unwrap(), 1e-6f32 as f64);
            std::fs::remove_file(&path).ok();
        }
        let path = one_f32_file("general.other", 1.0);
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(norm_eps(&file, &key).unwrap(), 1e-5);
        std::fs::remove_file(&path).ok();
    }
}
