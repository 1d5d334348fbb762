//! Loading a model directory: config detection, safetensors (mmap, shards), name maps and
//! shape checks. What comes out is host-side and format-independent.

pub mod fingerprint;
pub mod ggml;
pub mod gguf;
pub mod kquant;
pub mod quant;
pub mod safetensors;
pub mod synthetic;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use self::gguf::{GgufFile, GgufInfo};
use self::quant::WeightFormat;
use crate::tokenizer::Tokenizer;

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
    /// The directory it came from (`None` for synthetic or embedded models; for a GGUF
    /// file, the file).
    pub dir: Option<PathBuf>,
    /// The GGUF file's header, when the model came from one.
    pub gguf: Option<Arc<GgufInfo>>,
}

/// How many of `tensors` have each dtype, in order of first appearance.
pub fn count_dtypes<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Vec<(DType, usize)> {
    let mut counts: Vec<(DType, usize)> = Vec::new();
    for t in tensors {
        match counts.iter_mut().find(|(d, _)| *d == t.dtype) {
            Some((_, n)) => *n += 1,
            None => counts.push((t.dtype, 1)),
        }
    }
    counts
}

impl Model {
    /// Loads a model: a GGUF file (or a directory holding one), else the
    /// `config.json`/`params.json` and safetensors weights of directory `path`.
    pub fn load(path: &Path) -> Result<Self> {
        if let Some(file) = gguf::gguf_path(path)? {
            return Self::load_gguf(&file);
        }
        let config = ModelConfig::from_dir(path)?;
        let store = TensorStore::open_dir(path)?;
        let weights = ModelWeights::from_tensors(&config, store.into_tensors())?;
        Ok(Model {
            config,
            weights,
            dir: Some(path.to_path_buf()),
            gguf: None,
        })
    }

    /// Loads a GGUF file: config from its metadata, its tensors mapped as stored.
    pub fn load_gguf(path: &Path) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&file)?;
        let info = Arc::new(file.info());
        let weights = ModelWeights::from_tensors(&config, file.tensors)?;
        Ok(Model {
            config,
            weights,
            dir: Some(path.to_path_buf()),
            gguf: Some(info),
        })
    }

    /// The model at `path` and its tokenizer: a GGUF file's own (its `tokenizer.ggml.*`
    /// metadata, unless a `tokenizer.json` sits beside it), or the directory's
    /// `tokenizer.json`.
    pub fn load_with_tokenizer(path: &Path) -> Result<(Self, Option<Tokenizer>)> {
        let model = Self::load(path)?;
        let tokenizer = match &model.gguf {
            Some(info) => crate::gguf_tokenizer::for_gguf_model(path, info)?,
            None => Tokenizer::from_dir(path)?,
        };
        Ok((model, tokenizer))
    }

    /// A model over random weights (tests, benchmarks).
    pub fn synthetic(config: ModelConfig, seed: u64) -> Self {
        let weights = synthetic::random_weights(&config, seed);
        Model {
            config,
            weights,
            dir: None,
            gguf: None,
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

    /// The GPU format that keeps this model's big matrices closest to how they are stored:
    /// for a GGUF file, the block type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) that
    /// most of them use — every block-format tensor goes up as stored, whatever its type,
    /// which `mamba2 info` says; all F32 → f32; BF16 without F16 → bf16; otherwise f16. Safetensors → f16 (its prefill GEMMs take the tensor cores where the
    /// adapter has them; `--dtype bf16` keeps a bf16 checkpoint exact instead).
    pub fn preferred_format(&self) -> WeightFormat {
        if self.gguf.is_none() {
            return WeightFormat::F16;
        }
        // The Mamba2 projections, the embedding and the head decide (every architecture
        // read from GGUF has Mamba2 layers); attention, MLP and expert matrices in a block
        // type go up as stored whatever this picks (README.md lists the one exception).
        let w = &self.weights;
        let mut big: Vec<&Tensor> = vec![w.head(), &w.embedding];
        for m in w.layers.iter().filter_map(|l| l.mixer.mamba()) {
            big.extend([&m.in_proj, &m.out_proj]);
        }
        let counts = count_dtypes(big);
        let held = counts
            .iter()
            .filter_map(|&(d, n)| match d {
                DType::Quant(t) => WeightFormat::from_ggml(t).map(|f| (f, n)),
                _ => None,
            })
            .max_by_key(|&(_, n)| n);
        if counts.iter().all(|(d, _)| *d == DType::F32) {
            WeightFormat::F32
        } else if let Some((f, _)) = held {
            f
        } else if counts.iter().any(|(d, _)| *d == DType::BF16)
            && !counts.iter().any(|(d, _)| *d == DType::F16)
        {
            // bf16 as stored (f16 would round them and could overflow).
            WeightFormat::BF16
        } else {
            WeightFormat::F16
        }
    }

    /// The dtypes present in the checkpoint with how many tensors use each.
    pub fn dtype_counts(&self) -> Vec<(DType, usize)> {
        count_dtypes(self.weights.checkpoint())
    }

    /// Parameters actually stored (a tied head is counted once).
    pub fn param_count(&self) -> usize {
        self.weights.all().iter().map(|t| t.numel()).sum()
    }
}
