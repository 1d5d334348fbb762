//! The embedded default model: a small Mamba2 trained on Debian's fortune cookies
//! (assets/README.md says how), compiled into the binary so `mamba2 generate "…"` works on
//! a fresh machine with no download.

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::{Model, ModelWeights, TensorStore};
use crate::tokenizer::Tokenizer;

const CONFIG: &str = include_str!("../assets/config.json");
const WEIGHTS: &[u8] = include_bytes!("../assets/model.safetensors");
const TOKENIZER: &[u8] = include_bytes!("../assets/tokenizer.json");

/// What `--model` defaults to, in messages.
pub const NAME: &str = "embedded fortunes model (assets/)";

/// The embedded model and its tokenizer.
pub fn embedded() -> Result<(Model, Tokenizer)> {
    let config = ModelConfig::from_json_str(CONFIG, Path::new("assets/config.json"))?;
    let store = TensorStore::from_static("assets/model.safetensors", WEIGHTS)?;
    let weights = ModelWeights::from_tensors(&config, store.into_tensors())?;
    let tokenizer = Tokenizer::from_bytes(TOKENIZER, None)
        .map_err(|e| Error::Tokenizer(format!("assets/tokenizer.json: {e}")))?;
    Ok((
        Model {
            config,
            weights,
            dir: None,
            gguf: None,
        },
        tokenizer,
    ))
}
