//! Helpers shared by the GGUF test files (tests/gguf.rs, gguf_mamba2.rs, gguf_hybrid.rs,
//! gguf_tokenizer.rs, gguf_broken.rs, gguf_cli.rs): the fixtures' directory and oracle, the
//! CPU reference's logits and their distance, and byte-level edits of GGUF headers.

use std::path::{Path, PathBuf};

use mamba2_wgpu::EngineOptions;
use mamba2_wgpu::gpu::GpuBackend;
use mamba2_wgpu::gpu::engine::Engine;
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::gguf::GgufFile;
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};
use serde_json::Value as Json;

pub fn dir() -> PathBuf {
    super::fixture("gguf")
}

pub fn oracle() -> Json {
    serde_json::from_str(&std::fs::read_to_string(dir().join("oracle.json")).unwrap()).unwrap()
}

pub fn prompt(o: &Json, file: &str) -> Vec<u32> {
    o["files"][file]["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

pub fn files(o: &Json) -> Vec<String> {
    o["files"].as_object().unwrap().keys().cloned().collect()
}

pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn cpu_logits(model: &Model, prompt: &[u32]) -> Vec<Vec<f32>> {
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    cpu.forward(&mut cpu.new_state(), prompt, Scan::Sequential, Logits::All)
        .unwrap()
}

/// The largest |Δ| between two runs' logits.
pub fn worst(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| max_abs(g, w))
        .fold(0f32, f32::max)
}

/// Where tensor `name`'s info (after its name) starts in the header.
pub fn info_at(bytes: &[u8], name: &str) -> usize {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend(name.as_bytes());
    bytes
        .windows(key.len())
        .position(|w| w == key.as_slice())
        .unwrap()
        + key.len()
}

/// A fresh directory of its own for `name` (no tokenizer.json of /tmp's beside a file),
/// removed when dropped.
pub fn scratch(name: &str) -> super::Scratch {
    super::Scratch::new(&format!("gguf-{name}"))
}

/// `src`'s bytes with metadata key `key` (GGUF value type `ty`, value bytes `value`) added
/// in front of the others, the data section moved to the next multiple of 32 after the
/// grown header: still a valid file.
pub fn with_key(src: &Path, key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let g = GgufFile::open(src).unwrap();
    assert_eq!(g.alignment, 32);
    let bytes = std::fs::read(src).unwrap();
    // The header ends after the last tensor info (name, n_dims, ne[n_dims], type, offset).
    let at = info_at(&bytes, &g.tensors.last().unwrap().name);
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let header_end = at + 4 + 8 * n_dims + 4 + 8;
    let count = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
    let mut out = bytes[..16].to_vec();
    out.extend((count + 1).to_le_bytes());
    out.extend((key.len() as u64).to_le_bytes());
    out.extend(key.as_bytes());
    out.extend(ty.to_le_bytes());
    out.extend(value);
    out.extend(&bytes[24..header_end]);
    out.resize(out.len().next_multiple_of(32), 0);
    out.extend(&bytes[g.data_offset as usize..]);
    out
}

/// A GPU backend running `model` with `opts`, or None (the test is skipped, loudly, or fails
/// under MAMBA2_REQUIRE_GPU) without an adapter.
pub fn gpu_with(model: &Model, opts: EngineOptions) -> Option<GpuBackend> {
    let ctx = super::gpu(&Engine::needs(&model.config, opts.format))?;
    Some(GpuBackend::new(Engine::new(ctx, model, opts).unwrap()).unwrap())
}
