//! `mamba2 app`: the desktop chat window (the embedded model unless `--model`).

use anyhow::anyhow;
use clap::Args;
use mamba2_wgpu::ui::{LoadRequest, ModelSource};

use super::{DeviceArgs, ModelArgs};

#[derive(Args)]
pub struct AppArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
}

pub fn run(args: AppArgs) -> anyhow::Result<()> {
    // Flags are refused here; only what needs the model is shown in the window.
    let source = match args.model.model {
        Some(dir) => ModelSource::Dir(dir),
        None => ModelSource::Embedded,
    };
    args.device.check()?;
    let mut req = LoadRequest::new(source, args.device.device);
    // No --dtype: as stored, decided once the window's worker has read the model (the
    // default of every other command, `EngineArgs::engine_options`).
    req.format = args.device.dtype;
    req.fused &= !args.device.no_fuse;
    // Model errors (a bad directory, a lost device) are shown in the window; only a
    // window that cannot open at all fails here.
    mamba2_wgpu::ui::run_chat(req).map_err(|e| anyhow!(e))
}
