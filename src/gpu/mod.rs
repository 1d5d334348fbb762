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
