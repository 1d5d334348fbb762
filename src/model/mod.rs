//! Loading a model directory: config detection, safetensors (mmap, shards), name maps and
//! shape checks. What comes out is host-side and format-independent.

pub mod quant;
pub mod safetensors;
pub mod synthetic;
pub mod weights;

use std::path::{Path, PathBuf};

pub use self::safetensors::{DType, Tensor, TensorStore};
pub use self::weights::{
    AttentionWeights, LayerWeights, MambaWeights, MixerWeights, MlpWeights, ModelWeights,
    MoeWeights,
};
use crate::config::ModelConfig;
use crate::error::Result;

/// A loaded model: its normalized config and its weights (still memory-mapped).
#[derive(Clone, Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    /// The directory it came from (`None` for synthetic or embedded models).
    pub dir: Option<PathBuf>,
}

impl Model {
    /// Loads `config.json`/`params.json` and the safetensors weights of `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let store = TensorStore::open_dir(dir)?;
        let weights = ModelWeights::from_tensors(&config, store.into_tensors())?;
        Ok(Model {
            config,
            weights,
            dir: Some(dir.to_path_buf()),
        })
    }

    /// A model over random weights (tests, benchmarks).
    pub fn synthetic(config: ModelConfig, seed: u64) -> Self {
        let weights = synthetic::random_weights(&config, seed);
        Model {
            config,
            weights,
            dir: None,
        }
    }

    /// Writes the model as an HF `mamba2` directory: `config.json` + `model.safetensors`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| crate::Error::io(dir, e))?;
        let config = dir.join("config.json");
        let text =
            serde_json::to_string_pretty(&self.config.to_hf_json()).expect("JSON of plain values");
        std::fs::write(&config, text).map_err(|e| crate::Error::io(&config, e))?;
        self::safetensors::write_safetensors(
            &dir.join("model.safetensors"),
            &self.weights.checkpoint(),
        )
    }

    /// The dtypes present in the checkpoint with how many tensors use each.
    pub fn dtype_counts(&self) -> Vec<(DType, usize)> {
        let mut counts: Vec<(DType, usize)> = Vec::new();
        for t in self.weights.checkpoint() {
            match counts.iter_mut().find(|(d, _)| *d == t.dtype) {
                Some((_, n)) => *n += 1,
                None => counts.push((t.dtype, 1)),
            }
        }
        counts
    }

    /// Parameters actually stored (a tied head is counted once).
    pub fn param_count(&self) -> usize {
        self.weights.all().iter().map(|t| t.numel()).sum()
    }
}
