//! `mamba2 inspect`: the kernel-timing and state inspector window, on a model directory,
//! the embedded model, or random weights at a preset's real shapes (`--config`).

use anyhow::{anyhow, bail};
use clap::Args;
use mamba2_wgpu::bench::{PRESETS, preset};
use mamba2_wgpu::ui::{LoadRequest, ModelSource};

use super::{DeviceArgs, ModelArgs};

#[derive(Args)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Random weights made on the device at a preset's real shapes instead of a model
    /// (the presets of `mamba2 bench`, e.g. tiny, 130m, 2.7b or codestral-7b).
    #[arg(long, value_name = "NAME", conflicts_with = "model")]
    pub config: Option<String>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Text fed before decoding starts (models with a tokenizer).
    #[arg(long, default_value = "The")]
    pub prompt: String,
    /// Open paused (then press Run, or Step one token at a time).
    #[arg(long)]
    pub paused: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    // Flags are refused before the window opens; only what needs the model is shown there.
    if let Some(name) = &args.config
        && preset(name).is_none()
    {
        bail!("--config: unknown `{name}` (one of {})", PRESETS.join(", "));
    }
    args.device.check()?;
    let source = match (args.model.model, args.config) {
        (Some(dir), _) => ModelSource::Dir(dir),
        (None, Some(name)) => ModelSource::Preset {
            name,
            seed: args.seed,
        },
        (None, None) => ModelSource::Embedded,
    };
    let mut req = LoadRequest::new(source, args.device.device);
    // No --dtype: as stored, decided once the window's worker has read the model (the
    // default of every other command, `EngineArgs::engine_options`).
    req.format = args.device.dtype;
    req.fused &= !args.device.no_fuse;
    mamba2_wgpu::ui::run_inspector(req, args.prompt, !args.paused).map_err(|e| anyhow!(e))
}
