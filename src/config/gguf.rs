//! The model config of a GGUF file, from its metadata as llama.cpp's converter writes it
//! for the `mamba2` architecture (`convert_hf_to_gguf.py`, `Mamba2Model`): the SSM shapes
//! under `mamba2.ssm.*`, the head count as `time_step_rank`, the vocabulary as the rows of
//! `token_embd`, a tied head when there is no `output.weight`; and for `nemotron_h`
//! (`NemotronHModel`): the same SSM keys under `nemotron_h.ssm.*`, and the layer kinds from
//! the per-layer arrays `feed_forward_length` and `attention.head_count_kv` as llama.cpp's
//! loader reads them (both 0: Mamba2; only the first 0: attention; else an MLP).

use super::{AttentionConfig, BlockKind, MlpAct, MlpConfig, ModelConfig, ModelFormat, mamba_only};
use crate::error::{Error, Result};
use crate::model::gguf::{GgufFile, Value};

/// The SSD chunk length GGUF files do not record: HF's default.
const DEFAULT_CHUNK: usize = 256;

impl ModelConfig {
    /// The normalized config of `file`; errors name the metadata key.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.str("general.architecture")?;
        if arch != "mamba2" && arch != "nemotron_h" {
            return Err(Error::Unsupported(format!(
                "{}: GGUF architecture `{arch}` (this engine reads `mamba2` and `nemotron_h` \
                 GGUF files; run other models from their safetensors checkpoints)",
                file.path.display()
            )));
        }
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
        let n_layer = file.usize(&key("block_count"))?;
        let nemotron = arch == "nemotron_h";
        let config = ModelConfig {
            format: if nemotron {
                ModelFormat::GgufNemotronH
            } else {
                ModelFormat::GgufMamba2
            },
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
            norm_eps: match file.opt_f64(&key("attention.layer_norm_rms_epsilon"))? {
                Some(e) => e,
                None => file
                    .opt_f64(&key("attention.layer_norm_epsilon"))?
                    .unwrap_or(1e-5),
            },
            tie_embeddings: !has("output.weight"),
            conv_bias: has("blk.0.ssm_conv1d.bias"),
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
        let config = if nemotron {
            nemotron_h_layers(file, config)?
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

/// Nemotron-H's blocks, attention and MLP shapes (see the module doc). llama.cpp's graph
/// runs attention without positional encoding, with scale 1/√head_dim, and MLPs as
/// `down(relu(up(x))²)`; its SSM scan clamps nothing, so neither does this config.
fn nemotron_h_layers(file: &GgufFile, config: ModelConfig) -> Result<ModelConfig> {
    let n = config.n_layer;
    let ff_key = "nemotron_h.feed_forward_length";
    let kv_key = "nemotron_h.attention.head_count_kv";
    let ff = per_layer(file, ff_key, n)?;
    let kv = per_layer(file, kv_key, n)?;
    let blocks: Vec<BlockKind> = ff
        .iter()
        .zip(&kv)
        .map(|(&f, &k)| match (f, k) {
            (0, 0) => BlockKind::Mamba2,
            (0, _) => BlockKind::Attention,
            _ => BlockKind::Mlp,
        })
        .collect();
    let attention = if blocks.contains(&BlockKind::Attention) {
        let heads_key = "nemotron_h.attention.head_count";
        let heads = file.usize(heads_key)?;
        let kv_heads = common(file, kv_key, &kv)?;
        if heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(file.key_error(
                heads_key,
                format!("{heads} query heads do not share {kv_heads} key/value heads evenly"),
            ));
        }
        let head_dim = match file.opt_usize("nemotron_h.attention.key_length")? {
            Some(h) => h,
            None => config.d_model / heads,
        };
        if let Some(v) = file.opt_usize("nemotron_h.attention.value_length")?
            && v != head_dim
        {
            return Err(file.key_error(
                "nemotron_h.attention.value_length",
                format!("{v} differs from the key length {head_dim}"),
            ));
        }
        Some(AttentionConfig::nemotron_h(heads, kv_heads, head_dim))
    } else {
        None
    };
    let mlp = if blocks.contains(&BlockKind::Mlp) {
        Some(MlpConfig {
            intermediate: common(file, ff_key, &ff)?,
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
        ..config
    })
}
