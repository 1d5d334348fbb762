//! The wgpu engine: device setup, WGSL kernels, the per-token graph, profiling and the
//! `Backend` the session drives.

pub mod backend;
pub mod batch;
pub mod blocks;
pub mod context;
pub mod device_weights;
pub mod engine;
pub mod graph;
pub mod kernels;
pub mod prefill;
pub mod profiler;
pub mod scratch;
pub mod shader;
pub mod state_store;
pub mod synthetic;
pub mod weights;

pub use backend::GpuBackend;
pub use context::{DeviceChoice, GpuContext};
pub use engine::{Engine, EngineOptions};

/// The `MAMBA2_NO_*` switches (`MAMBA2_NO_FUSE=1`, `MAMBA2_NO_SUBGROUPS=1`…): on when set
/// to anything but empty, `0`, `false` or `no` (any case), so that `=0` means what it says.
pub fn switched_off(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| switch_on(&v))
}

/// Whether a switch's value turns it on.
fn switch_on(v: &std::ffi::OsStr) -> bool {
    !matches!(
        v.to_string_lossy().trim().to_ascii_lowercase().as_str(),
        "" | "0" | "false" | "no"
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_switch_set_to_zero_is_off() {
        for (v, on) in [
            ("1", true),
            ("yes", true),
            ("true", true),
            ("0", false),
            (" 0 ", false),
            ("", false),
            ("FALSE", false),
            ("No", false),
        ] {
            assert_eq!(super::switch_on(v.as_ref()), on, "{v:?}");
        }
    }
}
