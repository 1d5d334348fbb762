//! The CPU reference (the oracle): the exact math of MAMBA2.md, generic over f32 and f64.
//! Written for clarity first; the f32 build is fast enough to be the CPU device.

pub mod attention;
pub mod math;
pub mod model;
pub mod moe;
pub mod ssd;

pub use math::Real;
pub use model::{CpuModel, Logits, Scan, State};
pub use ssd::{ScanDims, ScanInputs, scan_chunked, scan_sequential};
