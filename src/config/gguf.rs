//! The model config of a GGUF file, from its metadata as llama.cpp's converter writes it
//! for the `mamba2` architecture (`convert_hf_to_gguf.py`, `Mamba2Model`): the SSM shapes
//! under `mamba2.ssm.*`, the head count as `time_step_rank`, the vocabulary as the rows of
//! `token_embd`, a tied head when there is no `output.weight`.

use super::{BlockKind, ModelConfig, ModelFormat, mamba_only};
use crate::error::{Error, Result};
use crate::model::gguf::GgufFile;

/// The SSD chunk length GGUF files do not record: HF's default.
const DEFAULT_CHUNK: usize = 256;

impl ModelConfig {
    /// The normalized config of `file`; errors name the metadata key.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.str("general.architecture")?;
        if arch != "mamba2" {
            return Err(Error::Unsupported(format!(
                "{}: GGUF architecture `{arch}` (this engine reads `mamba2` GGUF files; convert \
                 hybrids from their safetensors checkpoints)",
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
        let config = ModelConfig {
            format: ModelFormat::GgufMamba2,
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
            norm_eps: file
                .opt_f64(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
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
        let config = ModelConfig {
            blocks: vec![BlockKind::Mamba2; n_layer],
            ..config
        };
        config.validate(&file.path)?;
        Ok(config)
    }
}
