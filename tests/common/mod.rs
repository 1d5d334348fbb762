//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod gguf;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use mamba2_wgpu::gpu::context::{DeviceChoice, GpuContext, Needs, pick_adapter};
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::quant::WeightFormat;

/// A directory of the test's own under the system's temp dir, `mamba2-{name}-{pid}`: empty
/// at first, removed when dropped (a failing test's too, as the panic unwinds). Derefs to
/// its path; keep it bound for as long as the test uses what it holds.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("mamba2-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A path in a `Scratch` directory that goes with it: dropping it removes the directory.
pub struct ScratchFile {
    _dir: Scratch,
    path: PathBuf,
}

impl ScratchFile {
    /// `file` inside `dir` (not made here).
    pub fn within(dir: Scratch, file: &str) -> Self {
        let path = dir.join(file);
        ScratchFile { _dir: dir, path }
    }
}

impl std::ops::Deref for ScratchFile {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for ScratchFile {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<std::ffi::OsStr> for ScratchFile {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.path.as_os_str()
    }
}

/// The token ids `tensor` (`prompt_ids`, `greedy_ids`) of a fixture's HF oracle
/// (`oracle.safetensors`, i64).
pub fn oracle_ids(fixture: &str, tensor: &str) -> Vec<u32> {
    let bytes = std::fs::read(self::fixture(fixture).join("oracle.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(tensor)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

/// `n` greedy tokens after `prompt` through a `Session` over `backend` (reset first).
pub fn session_greedy(
    mut backend: Box<dyn mamba2_wgpu::Backend>,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    backend.reset().unwrap();
    let mut s = mamba2_wgpu::Session::new(backend);
    let opts = mamba2_wgpu::GenerateOptions {
        max_new_tokens: n,
        ..Default::default()
    };
    s.generate(prompt, &opts, |_| true).unwrap().0
}

/// A device on the best adapter, software ones included (lavapipe in CI: `Auto` would pass
/// it over). Without one the test is skipped with a loud message, unless
/// MAMBA2_REQUIRE_GPU is set (CI), where it fails.
pub fn gpu(needs: &Needs) -> Option<Arc<GpuContext>> {
    match pick_adapter(&DeviceChoice::Gpu(None)) {
        Ok(Some(adapter)) => Some(Arc::new(
            GpuContext::new(adapter, needs).expect("device creation"),
        )),
        _ => {
            if std::env::var_os("MAMBA2_REQUIRE_GPU").is_some() {
                panic!(
                    "MAMBA2_REQUIRE_GPU is set but no GPU adapter was found (install mesa-vulkan-drivers)"
                );
            }
            eprintln!(
                "\n!!!!!!!! SKIPPED: no GPU adapter (install mesa-vulkan-drivers for lavapipe) !!!!!!!!\n"
            );
            None
        }
    }
}

/// As `gpu`, with the cooperative kernels run on their stand-ins where the device has no
/// cooperative matrices (`Caps::coop_emulated`): the tensor-core prefill paths on lavapipe.
pub fn gpu_coop_emulated(needs: &Needs) -> Option<Arc<GpuContext>> {
    // lavapipe's 32 KiB of workgroup memory: the tiles that fit it.
    let needs = Needs {
        workgroup_storage: needs.workgroup_storage.max(32768),
        ..needs.clone()
    };
    let ctx = gpu(&needs)?;
    let mut ctx = Arc::into_inner(ctx).expect("a fresh context");
    ctx.caps.coop_emulated = true;
    Some(Arc::new(ctx))
}

/// Kernels on a device that binds buffers of up to `largest` bytes, with the workgroup
/// limits every kernel test needs (lavapipe allows 32 KiB of workgroup memory: the
/// emulated tensor-core GEMM tiles take up to 24 KiB).
pub fn kernels(largest: u64) -> Option<mamba2_wgpu::gpu::kernels::Kernels> {
    let needs = Needs {
        largest_buffer: ("test".into(), largest),
        storage_buffers_per_stage: 8,
        workgroup_storage: 32768,
        invocations_per_workgroup: 256,
    };
    gpu(&needs).map(mamba2_wgpu::gpu::kernels::Kernels::new)
}

/// The bit patterns of `v`, for comparisons that must be exact (NaN included).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Normalized mean squared error: Σ(a−b)² / Σb².
pub fn nmse(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    num / den.max(1e-30)
}

/// Makes a FIFO at `path` (a file whose `open` waits for a writer: what hostile-input tests
/// put where a file is expected).
pub fn mkfifo(path: &std::path::Path) {
    let made = std::process::Command::new("mkfifo").arg(path).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo {}", path.display());
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// `model` with its big matrices (embedding, head, Mamba2 in_proj and out_proj, attention
/// q/k/v/o, MLP and expert matrices; not the MoE routers or latent projections) rounded
/// through the format `format_of(cols)` picks for their width: `|k| f.for_cols(k)` is what
/// the engine packs for `--dtype f`; `|_| f` keeps the k-quants' zero-padded superblocks on
/// any width (which only the CPU reference can run).
pub fn rounded(model: &Model, format_of: impl Fn(usize) -> WeightFormat) -> Model {
    use mamba2_wgpu::model::quant::{pack, unpack};
    use mamba2_wgpu::model::safetensors::Tensor;
    use mamba2_wgpu::model::{MixerWeights, MlpWeights};
    let round = |t: &mut Tensor| {
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let p = pack(format_of(cols), &t.to_f32(), rows, cols);
        *t = Tensor::from_f32(t.name.clone(), t.shape.clone(), &unpack(&p));
    };
    let round_mlp = |w: &mut MlpWeights| {
        round(&mut w.up);
        w.gate.as_mut().map(round);
        round(&mut w.down);
    };
    let mut m = model.clone();
    round(&mut m.weights.embedding);
    m.weights.lm_head.as_mut().map(round);
    for l in &mut m.weights.layers {
        match &mut l.mixer {
            MixerWeights::Mamba2(w) => {
                round(&mut w.in_proj);
                round(&mut w.out_proj);
            }
            MixerWeights::Attention(w) => {
                for t in [&mut w.q, &mut w.k, &mut w.v, &mut w.o] {
                    round(t);
                }
            }
            MixerWeights::Mlp(w) => round_mlp(w),
            MixerWeights::Moe(w) => {
                w.experts.iter_mut().for_each(round_mlp);
                w.shared.as_mut().map(round_mlp);
            }
        }
    }
    m
}

/// `t` (a float matrix) as ggml blocks of `format`, the bytes a GGUF file would hold.
pub fn in_blocks(
    t: &mamba2_wgpu::model::safetensors::Tensor,
    format: WeightFormat,
) -> mamba2_wgpu::model::safetensors::Tensor {
    use mamba2_wgpu::model::quant::{ggml_blocks, pack};
    let (rows, cols) = (t.shape[0], t.shape[1]);
    let p = pack(format, &t.to_f32(), rows, cols);
    let bytes = ggml_blocks(&p).expect("a block format over whole blocks");
    let ty = format.ggml().expect("a block format");
    mamba2_wgpu::model::safetensors::Tensor::from_ggml_blocks(
        t.name.clone(),
        ty,
        t.shape.clone(),
        bytes,
    )
    .unwrap()
}

/// `model` with every attention layer's q, k and v in ggml blocks of `types` (in that
/// order, as a GGUF whose quantization mixes them stores them: llama.cpp's Q4_K_M keeps
/// some v projections in Q6_K), and with `rest`, every other dense matrix (embedding, head,
/// Mamba2, o and MLP projections) in blocks of that type.
pub fn qkv_in_blocks(model: &Model, types: [WeightFormat; 3], rest: Option<WeightFormat>) -> Model {
    use mamba2_wgpu::model::MixerWeights;
    let mut m = model.clone();
    let other = |t: &mut mamba2_wgpu::model::safetensors::Tensor| {
        if let Some(f) = rest {
            *t = in_blocks(t, f);
        }
    };
    other(&mut m.weights.embedding);
    m.weights.lm_head.as_mut().map(other);
    for l in &mut m.weights.layers {
        match &mut l.mixer {
            MixerWeights::Mamba2(w) => {
                other(&mut w.in_proj);
                other(&mut w.out_proj);
            }
            MixerWeights::Attention(w) => {
                for (t, f) in [&mut w.q, &mut w.k, &mut w.v].into_iter().zip(types) {
                    *t = in_blocks(t, f);
                }
                other(&mut w.o);
            }
            MixerWeights::Mlp(w) => {
                other(&mut w.up);
                w.gate.as_mut().map(other);
                other(&mut w.down);
            }
            MixerWeights::Moe(_) => panic!("qkv_in_blocks: an MoE layer"),
        }
    }
    m
}
