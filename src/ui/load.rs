//! Opening a model for the front-ends (on their worker thread): where it comes from (a
//! directory, the embedded model, a synthetic preset, or one already in memory), which
//! device and weight format, and the facts the windows show about it (adapter, features,
//! limits, memory, dispatches per token).

use std::path::PathBuf;
use std::sync::Arc;

use egui::{RichText, Ui};

use crate::config::ModelConfig;
use crate::gpu::context::{GpuContext, pick_adapter};
use crate::gpu::graph::Tail;
use crate::gpu::{DeviceChoice, Engine, EngineOptions, GpuBackend};
use crate::model::Model;
use crate::model::quant::WeightFormat;
use crate::session::Backend;
use crate::tokenizer::Tokenizer;

/// Where a model comes from.
pub enum ModelSource {
    /// The tiny trained model compiled into the binary.
    Embedded,
    /// A model directory (config + safetensors + tokenizer.json).
    Dir(PathBuf),
    /// Random weights at a preset's real shapes (`mamba2_wgpu::bench::PRESETS`), made on
    /// the device.
    Preset { name: String, seed: u64 },
    /// A model already loaded (tests, embedding applications).
    Memory {
        model: Box<Model>,
        tokenizer: Option<Box<Tokenizer>>,
        label: String,
    },
}

impl ModelSource {
    pub fn label(&self) -> String {
        match self {
            ModelSource::Embedded => crate::assets::NAME.into(),
            ModelSource::Dir(p) => p.display().to_string(),
            ModelSource::Preset { name, seed } => format!("synthetic {name} (seed {seed})"),
            ModelSource::Memory { label, .. } => label.clone(),
        }
    }
}

/// What to open, on which device, in which weight format.
pub struct LoadRequest {
    pub source: ModelSource,
    pub device: DeviceChoice,
    /// `None`: as stored, the model's own `Model::preferred_format` (a Q4_K GGUF stays
    /// Q4_K), the default of every front-end; known only once the model is read.
    pub format: Option<WeightFormat>,
    pub fused: bool,
}

impl LoadRequest {
    pub fn new(source: ModelSource, device: DeviceChoice) -> Self {
        LoadRequest {
            source,
            device,
            format: None,
            fused: EngineOptions::default().fused,
        }
    }
}

/// An opened model.
pub struct Loaded {
    pub backend: Box<dyn Backend>,
    pub tokenizer: Option<Tokenizer>,
    pub info: ModelInfo,
}

/// Facts about the device a model runs on.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub adapter: wgpu::AdapterInfo,
    /// Features enabled on the engine's device.
    pub features: Vec<String>,
    /// What the engine uses of them.
    pub caps: Vec<(&'static str, String)>,
    /// Limits of the engine's device (requested) and of the adapter.
    pub limits: Vec<(&'static str, u64, u64)>,
    pub weight_bytes: u64,
    pub state_bytes: u64,
    pub scratch_bytes: u64,
    pub bytes_per_token: u64,
    pub dispatches_greedy: usize,
    pub dispatches_sample: usize,
    pub format: &'static str,
    pub fused: bool,
    pub timestamps: bool,
}

impl GpuInfo {
    pub fn of(gpu: &GpuBackend) -> Self {
        let e = &gpu.engine;
        let ctx = e.ctx();
        let features = ctx
            .device
            .features()
            .iter_names()
            .map(|(n, _)| n.to_string())
            .collect();
        let c = &ctx.caps;
        let yn = |b: bool| {
            if b {
                "yes".to_string()
            } else {
                "no".to_string()
            }
        };
        let caps = vec![
            (
                "subgroups",
                if c.subgroups {
                    format!("yes ({}..{})", c.subgroup_min, c.subgroup_max)
                } else {
                    "no".into()
                },
            ),
            ("shader f16", yn(c.shader_f16)),
            ("timestamp queries", yn(c.timestamps)),
            ("timestamps inside passes", yn(c.timestamps_in_passes)),
        ];
        let (d, a) = (ctx.device.limits(), ctx.adapter.limits());
        let limits = vec![
            ("max buffer size", d.max_buffer_size, a.max_buffer_size),
            (
                "max storage binding",
                d.max_storage_buffer_binding_size,
                a.max_storage_buffer_binding_size,
            ),
            (
                "storage buffers / stage",
                d.max_storage_buffers_per_shader_stage as u64,
                a.max_storage_buffers_per_shader_stage as u64,
            ),
            (
                "workgroup memory (bytes)",
                d.max_compute_workgroup_storage_size as u64,
                a.max_compute_workgroup_storage_size as u64,
            ),
            (
                "invocations / workgroup",
                d.max_compute_invocations_per_workgroup as u64,
                a.max_compute_invocations_per_workgroup as u64,
            ),
            (
                "workgroups / dimension",
                d.max_compute_workgroups_per_dimension as u64,
                a.max_compute_workgroups_per_dimension as u64,
            ),
        ];
        GpuInfo {
            adapter: ctx.info.clone(),
            features,
            caps,
            limits,
            weight_bytes: e.weight_bytes(),
            state_bytes: e.state_bytes() + e.state.kv_bytes(),
            scratch_bytes: e.scratch_bytes(),
            bytes_per_token: e.bytes_per_token(e.len),
            dispatches_greedy: e.graph(Tail::Greedy).len(),
            dispatches_sample: e.graph(Tail::Sample).len(),
            format: e.format.name(),
            fused: e.fused,
            timestamps: c.timestamps,
        }
    }
}

/// Facts about an opened model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub source: String,
    pub config: ModelConfig,
    pub params: usize,
    /// `Backend::describe`.
    pub device: String,
    pub gpu: Option<GpuInfo>,
    /// One line about the tokenizer, if any.
    pub tokenizer: Option<String>,
}

impl ModelInfo {
    /// JSON for exports.
    pub fn to_json(&self) -> serde_json::Value {
        let c = &self.config;
        serde_json::json!({
            "model": self.source,
            "device": self.device,
            "adapter": self.gpu.as_ref().map(|g| g.adapter.name.clone()),
            "backend": self.gpu.as_ref().map(|g| format!("{:?}", g.adapter.backend)),
            "driver": self.gpu.as_ref().map(|g| format!("{} {}", g.adapter.driver, g.adapter.driver_info)),
            "weight_format": self.gpu.as_ref().map(|g| g.format),
            "fused": self.gpu.as_ref().map(|g| g.fused),
            "config": {
                "d_model": c.d_model, "n_layer": c.n_layer, "vocab_size": c.vocab_size,
                "n_heads": c.n_heads, "head_dim": c.head_dim, "n_groups": c.n_groups,
                "d_state": c.d_state, "d_conv": c.d_conv,
            },
        })
    }
}

fn mib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else if b >= 1 << 20 {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}

fn params(n: usize) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1} M", n as f64 / 1e6),
        n => format!("{:.1} K", n as f64 / 1e3),
    }
}

fn wrapped(ui: &mut Ui, text: &str) {
    ui.add(egui::Label::new(text).wrap());
}

/// A two-column grid of names and values (long values wrap).
fn kv_grid(ui: &mut Ui, id: &str, rows: impl IntoIterator<Item = (&'static str, String)>) {
    egui::Grid::new(id)
        .num_columns(2)
        .striped(true)
        .show(ui, |ui| {
            for (k, v) in rows {
                ui.label(k);
                wrapped(ui, &v);
                ui.end_row();
            }
        });
}

/// The model, device, features, limits and memory, as grids.
pub fn info_ui(ui: &mut Ui, info: &ModelInfo) {
    let c = &info.config;
    let mut model = vec![
        ("model", info.source.clone()),
        ("layers × d_model", format!("{} × {}", c.n_layer, c.d_model)),
        (
            "heads × head dim",
            format!("{} × {} (groups {})", c.n_heads, c.head_dim, c.n_groups),
        ),
        (
            "state size, conv",
            format!("N = {}, K = {}", c.d_state, c.d_conv),
        ),
        ("vocabulary", c.vocab_size.to_string()),
        ("parameters", params(info.params)),
    ];
    if info.gpu.is_none() {
        model.push(("device", info.device.clone()));
    }
    if let Some(t) = &info.tokenizer {
        model.push(("tokenizer", t.clone()));
    }
    kv_grid(ui, "model_info", model);
    let Some(g) = &info.gpu else {
        ui.add_space(4.0);
        ui.label(format!("state memory: {}", mib(c.state_bytes() as u64)));
        ui.weak("CPU reference: no GPU timings.");
        return;
    };
    ui.add_space(6.0);
    ui.strong("Adapter");
    let graph = if g.fused {
        "fused graph"
    } else {
        "unfused graph"
    };
    let adapter = [
        ("name", g.adapter.name.clone()),
        ("backend", format!("{:?}", g.adapter.backend)),
        ("type", format!("{:?}", g.adapter.device_type)),
        (
            "driver",
            format!("{} {}", g.adapter.driver, g.adapter.driver_info),
        ),
        ("weights", format!("{}, {graph}", g.format)),
        (
            "dispatches / token",
            format!(
                "{} greedy, {} sampled",
                g.dispatches_greedy, g.dispatches_sample
            ),
        ),
    ];
    kv_grid(
        ui,
        "adapter_info",
        adapter.into_iter().chain(g.caps.clone()),
    );
    ui.add_space(6.0);
    ui.strong("Memory on the device");
    let memory = [
        ("weights", g.weight_bytes),
        ("state (per sequence)", g.state_bytes),
        ("scratch", g.scratch_bytes),
        ("read+written per token", g.bytes_per_token),
    ];
    kv_grid(ui, "memory_info", memory.map(|(k, v)| (k, mib(v))));
    ui.add_space(6.0);
    egui::CollapsingHeader::new("Limits (device / adapter)")
        .default_open(false)
        .show(ui, |ui| {
            egui::Grid::new("limits_info")
                .num_columns(3)
                .striped(true)
                .show(ui, |ui| {
                    for (k, d, a) in &g.limits {
                        ui.label(*k);
                        ui.monospace(d.to_string());
                        ui.monospace(a.to_string());
                        ui.end_row();
                    }
                });
        });
    egui::CollapsingHeader::new(format!("Features enabled ({})", g.features.len()))
        .default_open(false)
        .show(ui, |ui| {
            ui.label(RichText::new(g.features.join(", ")).monospace());
        });
}

/// Opens `req` (blocking: run it on a worker). `notice` gets one-line notices (e.g. the
/// CPU fallback). Errors are sentences for the window.
pub fn open(req: LoadRequest, notice: &mut dyn FnMut(&str)) -> Result<Loaded, String> {
    let label = req.source.label();
    let mut opts = EngineOptions {
        fused: req.fused,
        ..Default::default()
    };
    let (model, tokenizer) = match req.source {
        ModelSource::Preset { name, seed } => {
            // Random weights have no stored format: the engine default unless one is asked.
            opts.format = req.format.unwrap_or(opts.format);
            return open_preset(&name, seed, &req.device, opts, notice);
        }
        ModelSource::Memory {
            model, tokenizer, ..
        } => (*model, tokenizer.map(|t| *t)),
        ModelSource::Embedded => embedded()?,
        ModelSource::Dir(dir) => {
            if !dir.exists() {
                return Err(format!(
                    "{} is not a directory or a GGUF file: it does not exist",
                    dir.display()
                ));
            }
            Model::load_with_tokenizer(&dir)
                .map_err(|e| format!("could not load {}: {e}", dir.display()))?
        }
    };
    opts.format = req.format.unwrap_or_else(|| model.preferred_format());
    let mut backend = crate::device::open_backend(&model, &req.device, opts, notice)
        .map_err(|e| format!("could not open {label}: {e}"))?;
    let info = ModelInfo {
        source: label,
        config: model.config.clone(),
        params: model.param_count(),
        device: backend.describe(),
        gpu: backend.gpu().map(|g| GpuInfo::of(g)),
        tokenizer: tokenizer.as_ref().map(tokenizer_line),
    };
    Ok(Loaded {
        backend,
        tokenizer,
        info,
    })
}

fn tokenizer_line(t: &Tokenizer) -> String {
    let eos = match (&t.eos_token, t.eos) {
        (Some(s), Some(id)) => format!("eos {s} = {id}"),
        _ => "no eos".into(),
    };
    let template = if t.chat_template.is_some() {
        ", chat template"
    } else {
        ""
    };
    format!("{} ids, {eos}{template}", t.vocab_size())
}

fn embedded() -> Result<(Model, Option<Tokenizer>), String> {
    let (model, tok) = crate::assets::embedded().map_err(|e| format!("the embedded model: {e}"))?;
    Ok((model, Some(tok)))
}

fn open_preset(
    name: &str,
    seed: u64,
    device: &DeviceChoice,
    opts: EngineOptions,
    notice: &mut dyn FnMut(&str),
) -> Result<Loaded, String> {
    let config = crate::bench::preset(name).ok_or_else(|| {
        format!(
            "unknown config `{name}`: expected one of {}",
            crate::bench::PRESETS.join(", ")
        )
    })?;
    let label = format!("synthetic {name} (random weights, seed {seed})");
    let adapter = pick_adapter(device).map_err(|e| e.to_string())?;
    let Some(adapter) = adapter else {
        // The CPU reference only for shapes it can hold comfortably.
        if config.param_count() > 50_000_000 {
            return Err(format!(
                "no hardware GPU adapter: synthetic `{name}` ({}) is too large for the CPU reference; use --device gpu (a software adapter counts) or --config tiny",
                params(config.param_count())
            ));
        }
        let model = Model::synthetic(config, seed);
        let mut backend = crate::device::open_backend(&model, &DeviceChoice::Cpu, opts, notice)
            .map_err(|e| e.to_string())?;
        let info = ModelInfo {
            source: label,
            config: model.config.clone(),
            params: model.param_count(),
            device: backend.describe(),
            gpu: backend.gpu().map(|g| GpuInfo::of(g)),
            tokenizer: None,
        };
        return Ok(Loaded {
            backend,
            tokenizer: None,
            info,
        });
    };
    let ctx = GpuContext::new(adapter, &Engine::needs(&config, opts.format))
        .map_err(|e| e.to_string())?;
    let engine =
        Engine::synthetic(Arc::new(ctx), &config, opts, seed).map_err(|e| e.to_string())?;
    let backend = GpuBackend::new(engine).map_err(|e| e.to_string())?;
    let info = ModelInfo {
        source: label,
        params: config.param_count(),
        config,
        device: backend.describe(),
        gpu: Some(GpuInfo::of(&backend)),
        tokenizer: None,
    };
    Ok(Loaded {
        backend: Box::new(backend),
        tokenizer: None,
        info,
    })
}
