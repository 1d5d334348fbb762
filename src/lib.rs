//! mamba2-wgpu: a portable Mamba2 inference engine — Rust on wgpu with WGSL kernels, and
//! an f64/f32 CPU reference that every kernel is tested against.
//!
//! ```no_run
//! use mamba2_wgpu::{Model, Session, CpuBackend, CpuModel, GenerateOptions};
//! let model = Model::load(std::path::Path::new("path/to/mamba2-130m"))?;
//! let cpu = CpuModel::<f32>::new(&model.config, &model.weights)?;
//! let mut session = Session::new(Box::new(CpuBackend::new(cpu)));
//! let (ids, _) = session.generate(&[1, 2, 3], &GenerateOptions::default(), |_| true)?;
//! # Ok::<(), mamba2_wgpu::Error>(())
//! ```

pub mod admission;
pub mod assets;
pub mod bench;
pub mod chat;
pub mod config;
pub mod device;
pub mod error;
pub mod files;
pub mod gguf_tokenizer;
pub mod gpu;
pub mod model;
pub mod perplexity;
pub mod prefix_cache;
pub mod progress;
pub mod reference;
pub mod sampling;
pub mod server;
pub mod session;
pub mod state;
pub mod state_file;
pub mod tokenizer;
#[cfg(feature = "ui")]
pub mod ui;

pub use config::{ModelConfig, ModelFormat};
pub use device::open_backend;
pub use error::{Error, Result};
pub use gpu::{DeviceChoice, EngineOptions};
pub use model::Model;
pub use model::quant::WeightFormat;
pub use reference::CpuModel;
pub use sampling::Sampling;
pub use session::{
    Backend, CpuBackend, Finish, GenerateOptions, PromptProgress, Session, Snapshot,
};
pub use tokenizer::Tokenizer;
