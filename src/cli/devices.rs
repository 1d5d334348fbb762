//! `mamba2 devices`: the adapters wgpu sees, with the features and limits that matter here,
//! and which one `--device auto` takes.

use clap::Args;
use mamba2_wgpu::gpu::context::{adapter_report, adapters, is_software};

#[derive(Args)]
pub struct DevicesArgs {}

pub fn run(_: DevicesArgs) -> anyhow::Result<()> {
    let all = adapters();
    if all.is_empty() {
        outln!("no GPU adapter found: `--device auto` runs on the CPU reference");
        outln!("(on Linux without a GPU: apt-get install mesa-vulkan-drivers for lavapipe)");
        return Ok(());
    }
    for (i, a) in all.iter().enumerate() {
        outln!("{}", adapter_report(i, a));
    }
    if all.iter().all(|a| is_software(&a.get_info())) {
        outln!(
            "only software adapters: `--device auto` runs on the CPU reference (faster on the same cores); `--device gpu` or `gpu:INDEX` runs on one"
        );
    }
    Ok(())
}
