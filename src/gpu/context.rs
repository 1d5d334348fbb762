//! The wgpu instance, adapter and device: adapter choice, feature and limit negotiation,
//! and error capture (validation errors, out-of-memory and device loss become `Error`s
//! instead of wgpu's default panic).

use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// Which device runs the model.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The best hardware adapter (discrete, integrated, virtual), else the CPU reference.
    /// A software rasterizer (lavapipe/llvmpipe, SwiftShader, WARP) is never chosen here:
    /// it runs on the same cores as the CPU reference, through Vulkan, and is an order of
    /// magnitude slower on small models. `Gpu(None)` still picks it.
    #[default]
    Auto,
    /// The CPU reference.
    Cpu,
    /// A GPU adapter: the best one (software ones included), or the one whose index (in
    /// `mamba2 devices`) or name (case-insensitive substring) is given.
    Gpu(Option<String>),
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "gpu" => Ok(DeviceChoice::Gpu(None)),
            _ => match s.strip_prefix("gpu:") {
                Some(which) if !which.is_empty() => Ok(DeviceChoice::Gpu(Some(which.to_string()))),
                _ => Err(format!(
                    "`{s}`: expected auto, cpu, gpu, gpu:INDEX or gpu:NAME"
                )),
            },
        }
    }
}

/// What the engine uses of an adapter, decided once at device creation.
#[derive(Clone, Debug)]
pub struct Caps {
    pub subgroups: bool,
    pub subgroup_min: u32,
    pub subgroup_max: u32,
    pub shader_f16: bool,
    pub timestamps: bool,
    pub timestamps_in_passes: bool,
    /// Cooperative matrices (16×16×16, f16 inputs, f32 accumulators) for the prefill GEMMs:
    /// on 32-wide subgroups, unless MAMBA2_NO_COOPMAT=1 or the load-time check failed.
    pub coop_matrix: bool,
    /// Why the device's cooperative matrices are not used although it has them (the
    /// load-time check failed), for `describe`.
    pub coop_failed: Option<String>,
    /// Tests only: run the cooperative kernels with portable stand-ins for their
    /// cooperative ops on a device without them (lavapipe), so the whole prefill graph takes
    /// the tensor-core paths' staging, indexing and epilogues. Never set by the engine.
    pub coop_emulated: bool,
}

impl Caps {
    /// Whether the prefill takes the cooperative kernels: on the tensor cores, or (tests)
    /// with their stand-ins. Their `emulate` argument is `!coop_matrix`.
    pub fn coop_kernels(&self) -> bool {
        self.coop_matrix || self.coop_emulated
    }
}

/// Workgroup memory the cooperative GEMM's tiles may use.
const COOP_WORKGROUP_BYTES: u32 = crate::gpu::kernels::gemm_coop::MAX_WORKGROUP_BYTES as u32;

/// Runs the cooperative kernels' load-time checks (`gemm_coop::self_check`, then
/// `ssd_coop_check::self_check`) on a device that
/// has cooperative matrices: the device back when it passes, else why not (the device is
/// dropped: it may be lost).
fn coop_verdict(ctx: GpuContext) -> std::result::Result<GpuContext, String> {
    let ctx = Arc::new(ctx);
    let verdict = {
        let k = crate::gpu::kernels::Kernels::new(ctx.clone());
        let run = crate::gpu::kernels::gemm_coop::self_check(&k, false)
            .and_then(|()| crate::gpu::kernels::ssd_coop_check::self_check(&k, false));
        // (Also drains what the device reported, so no error of the check outlives it.)
        run.and(ctx.check())
    };
    match verdict {
        Ok(()) => Arc::try_unwrap(ctx)
            .map_err(|_| "the cooperative-matrix check kept the device".to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// What a model needs from the device (computed by the engine before creating it).
#[derive(Clone, Debug, Default)]
pub struct Needs {
    /// The largest buffer, with a name for messages.
    pub largest_buffer: (String, u64),
    pub storage_buffers_per_stage: u32,
    pub workgroup_storage: u32,
    pub invocations_per_workgroup: u32,
}

/// A device ready for the engine.
pub struct GpuContext {
    pub adapter: wgpu::Adapter,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub caps: Caps,
    pub limits: wgpu::Limits,
    errors: Arc<Mutex<Vec<String>>>,
    lost: Arc<Mutex<Option<String>>>,
}

/// The process's one wgpu instance (made on first use): every device of a process comes
/// from it, so a process that opens many devices in turn (the test binaries, a server
/// switching models) does not also create and tear down a Vulkan instance each time.
fn instance() -> wgpu::Instance {
    static INSTANCE: std::sync::OnceLock<wgpu::Instance> = std::sync::OnceLock::new();
    INSTANCE
        .get_or_init(|| {
            let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
            desc.backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
            // A buffer that would take the device past 95% of the memory budget the driver
            // reports (Vulkan's VK_EXT_memory_budget, DX12) fails as out-of-memory — an
            // error naming the buffer and the model's footprint — instead of
            // oversubscribing until the device is lost.
            desc.memory_budget_thresholds.for_resource_creation = Some(95);
            wgpu::Instance::new(desc)
        })
        .clone()
}

/// Every adapter wgpu can see (Vulkan, Metal, DX12), in enumeration order.
pub fn adapters() -> Vec<wgpu::Adapter> {
    pollster::block_on(instance().enumerate_adapters(wgpu::Backends::all()))
        .into_iter()
        .filter(|a| a.get_info().backend != wgpu::Backend::Gl)
        .collect()
}

fn rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// Whether an adapter rasterizes in software on the CPU. The device type says so for
/// lavapipe and WARP; the names catch a driver that reports `Other`.
pub fn is_software(info: &wgpu::AdapterInfo) -> bool {
    const NAMES: [&str; 5] = [
        "llvmpipe",
        "lavapipe",
        "swiftshader",
        "softpipe",
        "microsoft basic render",
    ];
    let name = info.name.to_lowercase();
    info.device_type == wgpu::DeviceType::Cpu || NAMES.iter().any(|n| name.contains(n))
}

/// The names of the software adapters (what `Auto` passes over), for the one-line notice
/// of a CPU fallback.
pub fn software_adapters() -> Vec<String> {
    adapters()
        .iter()
        .map(|a| a.get_info())
        .filter(is_software)
        .map(|i| i.name)
        .collect()
}

/// The adapter a choice names; `Ok(None)` for `Cpu`, and for `Auto` when there is no
/// hardware adapter (software ones are only taken when asked for with `Gpu`).
pub fn pick_adapter(choice: &DeviceChoice) -> Result<Option<wgpu::Adapter>> {
    let mut all = adapters();
    let listing = || {
        let names: Vec<String> = adapters()
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{i}: {}", a.get_info().name))
            .collect();
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    };
    match choice {
        DeviceChoice::Cpu => Ok(None),
        DeviceChoice::Auto => {
            all.retain(|a| !is_software(&a.get_info()));
            all.sort_by_key(|a| rank(a.get_info().device_type));
            Ok(all.into_iter().next())
        }
        DeviceChoice::Gpu(None) => {
            // Hardware first, then software (a stable sort keeps enumeration order within).
            all.sort_by_key(|a| {
                let info = a.get_info();
                (is_software(&info), rank(info.device_type))
            });
            match all.into_iter().next() {
                Some(a) => Ok(Some(a)),
                None => Err(Error::Gpu(
                    "no GPU adapter found (install a Vulkan driver, e.g. mesa-vulkan-drivers, or use --device cpu)".into(),
                )),
            }
        }
        DeviceChoice::Gpu(Some(which)) => {
            if let Ok(i) = which.parse::<usize>() {
                return all.into_iter().nth(i).map(Some).ok_or_else(|| {
                    Error::Gpu(format!(
                        "no adapter with index {i} (adapters: {})",
                        listing()
                    ))
                });
            }
            let w = which.to_lowercase();
            all.into_iter()
                .find(|a| a.get_info().name.to_lowercase().contains(&w))
                .map(Some)
                .ok_or_else(|| {
                    Error::Gpu(format!(
                        "no adapter named like `{which}` (adapters: {})",
                        listing()
                    ))
                })
        }
    }
}

impl GpuContext {
    /// Creates the device, asking for the optional features the adapter has and for the
    /// limits `needs` names (never more than the adapter offers: a model that does not
    /// fit is an error naming the buffer, its size and the limit). Cooperative matrices are
    /// checked on the device first (`gemm_coop::self_check`); when the check fails, or loses
    /// the device (a driver that cannot compile the kernel), a fresh device without them
    /// takes its place and `caps.coop_failed` says why.
    pub fn new(adapter: wgpu::Adapter, needs: &Needs) -> Result<Self> {
        crate::gpu::kernels::gemm_coop::check_overrides()?;
        crate::gpu::kernels::gemv::check_overrides()?;
        crate::gpu::kernels::ssd_step::check_overrides()?;
        crate::gpu::kernels::attention_decode::check_overrides()?;
        crate::gpu::prefill::check_overrides()?;
        let ctx = Self::create(adapter.clone(), needs, true)?;
        if !ctx.caps.coop_matrix {
            return Ok(ctx);
        }
        match coop_verdict(ctx) {
            Ok(ctx) => Ok(ctx),
            Err(why) => {
                tracing::warn!(
                    "cooperative matrices off: {why}; the prefill GEMMs run on FMA tiles"
                );
                let mut ctx = Self::create(adapter, needs, false)?;
                ctx.caps.coop_failed = Some(why);
                Ok(ctx)
            }
        }
    }

    /// `new` with cooperative matrices allowed or not.
    fn create(adapter: wgpu::Adapter, needs: &Needs, allow_coop: bool) -> Result<Self> {
        let info = adapter.get_info();
        let have = adapter.features();
        let al = adapter.limits();
        let off = super::switched_off;
        let mut features = wgpu::Features::empty();
        for (f, env) in [
            (wgpu::Features::SUBGROUP, "MAMBA2_NO_SUBGROUPS"),
            (wgpu::Features::SHADER_F16, "MAMBA2_NO_F16"),
            (wgpu::Features::TIMESTAMP_QUERY, "MAMBA2_NO_TIMESTAMPS"),
            (
                wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES,
                "MAMBA2_NO_TIMESTAMPS",
            ),
            (
                wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS,
                "MAMBA2_NO_TIMESTAMPS",
            ),
        ] {
            if have.contains(f) && !off(env) {
                features |= f;
            }
        }
        if off("MAMBA2_NO_TIMESTAMPS_IN_PASSES") {
            features.remove(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES);
        }
        let (name, size) = &needs.largest_buffer;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        if *size > al.max_storage_buffer_binding_size || *size > al.max_buffer_size {
            return Err(Error::Gpu(format!(
                "`{name}` needs a {:.1} MiB buffer but adapter `{}` allows at most {:.1} MiB per storage binding \
                 ({:.1} MiB per buffer); try --dtype q8_0 or f16, or a device with larger limits",
                mib(*size),
                info.name,
                mib(al.max_storage_buffer_binding_size),
                mib(al.max_buffer_size),
            )));
        }
        let check = |what: &str, need: u32, max: u32| -> Result<u32> {
            if need > max {
                Err(Error::Gpu(format!(
                    "the model needs {need} {what}; adapter `{}` allows {max}",
                    info.name
                )))
            } else {
                Ok(need)
            }
        };
        let mut limits = wgpu::Limits::default();
        // All the adapter allows for buffer sizes: the KV caches are sized to it once the
        // device exists (`EngineOptions::context_for`).
        limits.max_buffer_size = al.max_buffer_size.max(*size);
        limits.max_storage_buffer_binding_size = al.max_storage_buffer_binding_size.max(*size);
        // Up to 16 where the adapter has them (the MoE up pass that routes its token binds
        // 12; with fewer the routing keeps its own dispatch).
        limits.max_storage_buffers_per_shader_stage =
            al.max_storage_buffers_per_shader_stage.min(16).max(check(
                "storage buffers per stage",
                needs.storage_buffers_per_stage,
                al.max_storage_buffers_per_shader_stage,
            )?);
        limits.max_compute_workgroup_storage_size =
            limits.max_compute_workgroup_storage_size.max(check(
                "bytes of workgroup memory",
                needs.workgroup_storage,
                al.max_compute_workgroup_storage_size,
            )?);
        check(
            "invocations per workgroup",
            needs.invocations_per_workgroup,
            al.max_compute_invocations_per_workgroup,
        )?;
        // Single-workgroup reductions (argmax) use up to 1024 invocations where allowed.
        let inv = al
            .max_compute_invocations_per_workgroup
            .min(al.max_compute_workgroup_size_x)
            .min(1024);
        limits.max_compute_invocations_per_workgroup =
            limits.max_compute_invocations_per_workgroup.max(inv);
        limits.max_compute_workgroup_size_x = limits.max_compute_workgroup_size_x.max(inv);
        limits.max_compute_workgroups_per_dimension = al.max_compute_workgroups_per_dimension;
        // Cooperative matrices (f16 × f16 → f32 16×16×16 tiles) for the prefill GEMMs, on
        // 32-wide subgroups; MAMBA2_NO_COOPMAT=1 keeps the FMA tiles.
        let coop = allow_coop
            && !off("MAMBA2_NO_COOPMAT")
            && have.contains(
                wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16,
            )
            && info.subgroup_min_size == 32
            && info.subgroup_max_size == 32
            && adapter.cooperative_matrix_properties().iter().any(|p| {
                (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
                    && p.ab_type == wgpu::CooperativeScalarType::F16
                    && p.cr_type == wgpu::CooperativeScalarType::F32
            })
            && COOP_WORKGROUP_BYTES <= al.max_compute_workgroup_storage_size;
        let experimental = if coop {
            features |=
                wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16;
            limits.max_compute_workgroup_storage_size = limits
                .max_compute_workgroup_storage_size
                .max(COOP_WORKGROUP_BYTES);
            // SAFETY: wgpu calls its cooperative matrices experimental (their implementation
            // may still have bugs); `checked_coop` runs a GEMM on them against the CPU before
            // the engine uses them, and turns them off when it differs.
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("mamba2"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: experimental,
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| Error::Gpu(format!("{}: could not create a device: {e}", info.name)))?;
        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut v) = sink.lock() {
                v.push(e.to_string());
            }
        }));
        let lost = Arc::new(Mutex::new(None));
        let lost_sink = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            if let Ok(mut l) = lost_sink.lock() {
                *l = Some(format!("{reason:?}: {message}"));
            }
        });
        let caps = Caps {
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            subgroup_min: info.subgroup_min_size,
            subgroup_max: info.subgroup_max_size,
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            timestamps_in_passes: features.contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES),
            coop_matrix: coop,
            coop_emulated: false,
            coop_failed: None,
        };
        Ok(GpuContext {
            adapter,
            device,
            queue,
            info,
            caps,
            limits,
            errors,
            lost,
        })
    }

    /// Turns any error wgpu reported since the last call (validation, device loss) into
    /// an `Error`.
    pub fn check(&self) -> Result<()> {
        if let Some(reason) = self.lost.lock().ok().and_then(|l| l.clone()) {
            return Err(Error::Gpu(format!("device lost ({reason})")));
        }
        let mut errors = self
            .errors
            .lock()
            .map_err(|_| Error::Gpu("error sink poisoned".into()))?;
        if errors.is_empty() {
            Ok(())
        } else {
            let all = errors.drain(..).collect::<Vec<_>>().join("; ");
            Err(Error::Gpu(all))
        }
    }

    /// Waits for all submitted work, then reports errors.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Gpu(format!("waiting for the GPU failed: {e}")))?;
        self.check()
    }

    /// Creates a buffer, turning an out-of-memory condition into an error naming it.
    pub fn buffer(
        &self,
        label: &str,
        size: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        self.check()?;
        let mib = size as f64 / (1024.0 * 1024.0);
        if size > self.limits.max_buffer_size {
            return Err(Error::Gpu(format!(
                "`{label}` needs a {mib:.1} MiB buffer; the device allows {:.1} MiB",
                self.limits.max_buffer_size as f64 / (1024.0 * 1024.0)
            )));
        }
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let invalid = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: size.max(4).next_multiple_of(4),
            usage,
            mapped_at_creation: false,
        });
        let invalid = pollster::block_on(invalid.pop());
        if let Some(e) = pollster::block_on(oom.pop()) {
            return Err(Error::Gpu(format!(
                "out of device memory allocating `{label}` ({mib:.1} MiB): {e}"
            )));
        }
        if let Some(e) = invalid {
            return Err(Error::Gpu(format!(
                "could not allocate `{label}` ({mib:.1} MiB): {e}"
            )));
        }
        Ok(buffer)
    }

    /// A storage buffer filled with `data`.
    pub fn storage_with(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer> {
        let buffer = self.buffer(label, data.len() as u64, storage_usage())?;
        let whole = data.len() / 4 * 4;
        if whole > 0 {
            self.queue.write_buffer(&buffer, 0, &data[..whole]);
        }
        if whole < data.len() {
            // Copies move whole words: pad the tail (e.g. an odd count of f16 scales).
            let mut tail = [0u8; 4];
            tail[..data.len() - whole].copy_from_slice(&data[whole..]);
            self.queue.write_buffer(&buffer, whole as u64, &tail);
        }
        Ok(buffer)
    }

    /// A zeroed storage buffer.
    pub fn storage_zeroed(&self, label: &str, size: u64) -> Result<wgpu::Buffer> {
        self.buffer(label, size, storage_usage())
    }

    /// Copies a buffer's first `size` bytes back to the host (blocking; never on the
    /// decode hot path).
    pub fn read(&self, buffer: &wgpu::Buffer, size: u64) -> Result<Vec<u8>> {
        let size = size.next_multiple_of(4);
        let staging = self.buffer(
            "readback",
            size,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        )?;
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buffer, 0, &staging, 0, Some(size));
        self.queue.submit([enc.finish()]);
        self.read_mapped(&staging, size)
    }

    /// Maps the first `size` bytes of a MAP_READ buffer once the submitted work is done,
    /// copies them out and unmaps it (blocking).
    pub fn read_mapped(&self, staging: &wgpu::Buffer, size: u64) -> Result<Vec<u8>> {
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, ..size, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|_| Error::Gpu("readback callback dropped (device lost?)".into()))?
            .map_err(|e| Error::Gpu(format!("readback failed: {e}")))?;
        let out = staging
            .get_mapped_range(..size)
            .map_err(|e| Error::Gpu(format!("readback failed: {e}")))?
            .to_vec();
        staging.unmap();
        Ok(out)
    }

    /// `read` as f32 values.
    pub fn read_f32(&self, buffer: &wgpu::Buffer, count: usize) -> Result<Vec<f32>> {
        let bytes = self.read(buffer, 4 * count as u64)?;
        Ok(bytemuck::cast_slice(&bytes[..4 * count]).to_vec())
    }

    /// One line for logs: name, backend, type.
    pub fn describe(&self) -> String {
        let gemms = match (&self.caps.coop_failed, self.caps.coop_matrix) {
            (Some(why), _) => format!(", cooperative matrices off: {why}"),
            (None, true) => ", tensor-core GEMMs".to_string(),
            (None, false) => String::new(),
        };
        format!(
            "{} ({:?}, {:?}{gemms})",
            self.info.name, self.info.backend, self.info.device_type
        )
    }
}

/// Usage of every storage buffer: bindable, copyable both ways (snapshots, readback).
pub fn storage_usage() -> wgpu::BufferUsages {
    wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC
}

/// A human-readable report of one adapter for `mamba2 devices`.
pub fn adapter_report(index: usize, a: &wgpu::Adapter) -> String {
    let info = a.get_info();
    let f = a.features();
    let l = a.limits();
    let mib = |b: u64| b / (1024 * 1024);
    let flag = |x: wgpu::Features, name: &str| {
        if f.contains(x) {
            name.to_string()
        } else {
            format!("no-{name}")
        }
    };
    let feats = [
        flag(wgpu::Features::SHADER_F16, "shader-f16"),
        flag(wgpu::Features::SUBGROUP, "subgroup"),
        flag(wgpu::Features::TIMESTAMP_QUERY, "timestamps"),
        flag(
            wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES,
            "timestamps-in-passes",
        ),
        flag(wgpu::Features::IMMEDIATES, "immediates"),
        flag(wgpu::Features::SHADER_INT64, "int64"),
        flag(
            wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
            "coop-matrix",
        ),
    ];
    format!(
        "{index}: {} | {:?} | {:?} | driver {} {}\n   features: {}\n   subgroup size {}..{}; max buffer {} MiB, storage binding {} MiB, {} storage buffers/stage, {} KiB workgroup memory, {} invocations/workgroup",
        info.name,
        info.backend,
        info.device_type,
        info.driver,
        info.driver_info,
        feats.join(" "),
        info.subgroup_min_size,
        info.subgroup_max_size,
        mib(l.max_buffer_size),
        mib(l.max_storage_buffer_binding_size),
        l.max_storage_buffers_per_shader_stage,
        l.max_compute_workgroup_storage_size / 1024,
        l.max_compute_invocations_per_workgroup,
    )
}
