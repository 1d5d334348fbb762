//! clap definitions and dispatch for the `mamba2` binary.

#[cfg(feature = "ui")]
mod app;
mod bench;
mod chat;
mod devices;
mod generate;
mod info;
#[cfg(feature = "ui")]
mod inspect;
mod perplexity;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "mamba2", version, about = "Portable Mamba2 inference on wgpu")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Continue a prompt, streaming the text as it is produced.
    Generate(generate::GenerateArgs),
    /// A terminal conversation that carries the state between turns.
    Chat(chat::ChatArgs),
    /// Describe a model: format, normalized config, parameters, dtypes, state size.
    Info(info::InfoArgs),
    /// Perplexity of a text file (window by window from a fresh state).
    Perplexity(perplexity::PerplexityArgs),
    /// List the GPU adapters with their features and limits.
    Devices(devices::DevicesArgs),
    /// Decode speed at real model shapes (synthetic weights made on the GPU).
    Bench(bench::BenchArgs),
    /// The desktop chat window.
    #[cfg(feature = "ui")]
    App(app::AppArgs),
    /// The kernel-timing and state inspector window.
    #[cfg(feature = "ui")]
    Inspect(inspect::InspectArgs),
}

/// Where the model comes from.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model directory (config.json or params.json, *.safetensors, tokenizer.json);
    /// without it, the small model embedded in the binary.
    #[arg(long, short = 'm', value_name = "DIR")]
    pub model: Option<PathBuf>,
}

impl ModelArgs {
    /// The model and its tokenizer (when the directory has one).
    pub fn load(&self) -> anyhow::Result<(mamba2_wgpu::Model, Option<mamba2_wgpu::Tokenizer>)> {
        let loaded = match &self.model {
            Some(dir) => (
                mamba2_wgpu::Model::load(dir)?,
                mamba2_wgpu::Tokenizer::from_dir(dir)?,
            ),
            None => {
                let (m, t) = mamba2_wgpu::assets::embedded()?;
                (m, Some(t))
            }
        };
        for n in &loaded.0.config.notices {
            eprintln!("note: {n}");
        }
        Ok(loaded)
    }

    /// How to name the model in messages.
    pub fn name(&self) -> String {
        match &self.model {
            Some(dir) => dir.display().to_string(),
            None => mamba2_wgpu::assets::NAME.to_string(),
        }
    }
}

/// Which device runs the model and how its weights are stored there.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// auto (best GPU, else the CPU reference), cpu, gpu, gpu:INDEX or gpu:NAME.
    #[arg(long, default_value = "auto")]
    pub device: mamba2_wgpu::DeviceChoice,
    /// Storage of the big matrices on the GPU: f32, f16 or q8_0.
    #[arg(long, default_value = "f16")]
    pub dtype: mamba2_wgpu::WeightFormat,
    /// Run the unfused graph (one kernel per op) instead of the fused one (also: MAMBA2_NO_FUSE=1).
    #[arg(long)]
    pub no_fuse: bool,
    /// SSD chunk length of prefill, 8…256 (default: the model config's chunk_size).
    #[arg(long, value_name = "Q")]
    pub chunk_size: Option<usize>,
    /// Feed prompts token by token through the decode graph instead of the chunked prefill.
    #[arg(long)]
    pub prefill_by_decode: bool,
    /// Hybrid models: tokens the attention layers' KV caches hold (default: the config's
    /// max_position_embeddings, capped by what the adapter can bind).
    #[arg(long, value_name = "N")]
    pub ctx: Option<usize>,
    /// Hybrid models: how the KV caches store K and V on the GPU, f16 or f32.
    #[arg(long, default_value = "f16")]
    pub kv: mamba2_wgpu::gpu::state_store::KvFormat,
}

impl DeviceArgs {
    pub fn engine_options(&self) -> mamba2_wgpu::EngineOptions {
        let mut o = mamba2_wgpu::EngineOptions {
            format: self.dtype,
            chunk_size: self.chunk_size,
            context: self.ctx,
            kv: self.kv,
            ..Default::default()
        };
        if self.prefill_by_decode {
            o.prefill = mamba2_wgpu::gpu::engine::PrefillMode::Decode;
        }
        if self.no_fuse {
            o.fused = false;
        }
        o
    }

    /// The backend for a loaded model, printing a one-line notice on a CPU fallback.
    pub fn open(
        &self,
        model: &mamba2_wgpu::Model,
    ) -> anyhow::Result<Box<dyn mamba2_wgpu::Backend>> {
        Ok(mamba2_wgpu::open_backend(
            model,
            &self.device,
            self.engine_options(),
            &mut |n| eprintln!("note: {n}"),
        )?)
    }
}

pub fn run() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Info(a) => info::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Devices(a) => devices::run(a),
        Command::Bench(a) => bench::run(a),
        #[cfg(feature = "ui")]
        Command::App(a) => app::run(a),
        #[cfg(feature = "ui")]
        Command::Inspect(a) => inspect::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
