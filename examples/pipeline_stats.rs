//! What the Vulkan driver made of each kernel: its compile-time statistics (registers,
//! spills, shared memory, instruction counts: whatever the driver reports through
//! `VK_KHR_pipeline_executable_properties`), for the kernels a run dumped with
//! MAMBA2_SHADER_DUMP. wgpu shows none of this; occupancy questions ("is the batch GEMV
//! register-bound?") need it.
//!
//!     MAMBA2_SHADER_DUMP=/tmp/wgsl mamba2 bench --config codestral-7b --dtype q8_0 --batch 16 …
//!     cargo run --release --example pipeline_stats -- /tmp/wgsl [NAME_FILTER] [--device SUBSTR]
//!
//! Each dumped WGSL goes through naga to SPIR-V the way wgpu's Vulkan backend writes it for
//! this engine (SPIR-V 1.6; array clamps, loop counters and division guards where the
//! dump's first line names `bounds`, `loops` and `divisions`; buffer accesses to the
//! driver's robustness; no workgroup zeroing), then into a compute pipeline on its own Vulkan device (every feature
//! the GPU has turned on) with statistics captured.

use std::ffi::CStr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use ash::vk;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let mut dir = None;
    let mut filter = None;
    let mut device_name = None;
    while let Some(a) = args.next() {
        if a == "--device" {
            device_name = Some(args.next().context("--device wants a name substring")?);
        } else if dir.is_none() {
            dir = Some(PathBuf::from(a));
        } else {
            filter = Some(a);
        }
    }
    let dir = dir.context("usage: pipeline_stats DIR [NAME_FILTER] [--device SUBSTR]")?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("{}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "wgsl"))
        .filter(|p| {
            filter.as_ref().is_none_or(|f| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().contains(f))
            })
        })
        .collect();
    files.sort();
    if files.is_empty() {
        bail!(
            "{}: no .wgsl files (run with MAMBA2_SHADER_DUMP={} first)",
            dir.display(),
            dir.display()
        );
    }
    let gpu = Gpu::new(device_name.as_deref())?;
    println!("device: {}", gpu.name);
    for f in &files {
        match gpu.stats(f) {
            Ok(lines) => {
                println!("{}", f.file_name().unwrap_or_default().to_string_lossy());
                for l in lines {
                    println!("  {l}");
                }
            }
            Err(e) => println!("{}: {e:#}", f.display()),
        }
    }
    Ok(())
}

/// A Vulkan device with pipeline statistics on.
struct Gpu {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    /// None where the driver lacks the extension (lavapipe 22): the kernels still go
    /// through SPIR-V into pipelines, with nothing to report.
    exec: Option<ash::khr::pipeline_executable_properties::Device>,
    name: String,
}

impl Gpu {
    fn new(want: Option<&str>) -> Result<Self> {
        // SAFETY: loads the system's Vulkan loader; every call below follows the spec's
        // valid usage for the structures it passes (filled by ash's builders).
        unsafe {
            let entry = ash::Entry::load().context("loading the Vulkan loader")?;
            let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
            let instance = entry
                .create_instance(
                    &vk::InstanceCreateInfo::default().application_info(&app),
                    None,
                )
                .context("vkCreateInstance")?;
            let mut chosen = None;
            for pd in instance.enumerate_physical_devices()? {
                let props = instance.get_physical_device_properties(pd);
                let name = CStr::from_ptr(props.device_name.as_ptr())
                    .to_string_lossy()
                    .into_owned();
                let fits = match want {
                    Some(w) => name.contains(w),
                    None => {
                        props.device_type == vk::PhysicalDeviceType::DISCRETE_GPU
                            || chosen.is_none()
                    }
                };
                if fits {
                    chosen = Some((pd, name));
                }
            }
            let (pd, name) = chosen.ok_or_else(|| {
                anyhow!(
                    "no Vulkan device{}",
                    want.map(|w| format!(" named *{w}*")).unwrap_or_default()
                )
            })?;
            let have = instance.enumerate_device_extension_properties(pd)?;
            let has = |ext: &CStr| {
                have.iter()
                    .any(|e| CStr::from_ptr(e.extension_name.as_ptr()) == ext)
            };
            let exec_name = ash::khr::pipeline_executable_properties::NAME;
            let mut probe = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
            let with_stats = has(exec_name) && {
                instance.get_physical_device_features2(
                    pd,
                    &mut vk::PhysicalDeviceFeatures2::default().push_next(&mut probe),
                );
                probe.pipeline_executable_info == vk::TRUE
            };
            let mut extensions = Vec::new();
            if with_stats {
                extensions.push(exec_name.as_ptr());
            }
            let coop_name = ash::khr::cooperative_matrix::NAME;
            let coop = has(coop_name);
            if coop {
                extensions.push(coop_name.as_ptr());
            }
            // Every feature the device has, so whatever the kernels' SPIR-V declares is on.
            let mut v11 = vk::PhysicalDeviceVulkan11Features::default();
            let mut v12 = vk::PhysicalDeviceVulkan12Features::default();
            let mut v13 = vk::PhysicalDeviceVulkan13Features::default();
            let mut ex = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
            let mut cm = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
            let mut all = vk::PhysicalDeviceFeatures2::default()
                .push_next(&mut v11)
                .push_next(&mut v12)
                .push_next(&mut v13);
            if with_stats {
                all = all.push_next(&mut ex);
            }
            if coop {
                all = all.push_next(&mut cm);
            }
            instance.get_physical_device_features2(pd, &mut all);
            let family = instance
                .get_physical_device_queue_family_properties(pd)
                .iter()
                .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
                .ok_or_else(|| anyhow!("{name}: no compute queue"))?
                as u32;
            let priority = [1.0];
            let queue = [vk::DeviceQueueCreateInfo::default()
                .queue_family_index(family)
                .queue_priorities(&priority)];
            let info = vk::DeviceCreateInfo::default()
                .queue_create_infos(&queue)
                .enabled_extension_names(&extensions)
                .push_next(&mut all);
            let device = instance
                .create_device(pd, &info, None)
                .context("vkCreateDevice")?;
            let exec = with_stats
                .then(|| ash::khr::pipeline_executable_properties::Device::new(&instance, &device));
            Ok(Gpu {
                _entry: entry,
                instance,
                device,
                exec,
                name,
            })
        }
    }

    /// The driver's statistics for the kernel in `path`, one line per executable and
    /// statistic.
    fn stats(&self, path: &Path) -> Result<Vec<String>> {
        let text = std::fs::read_to_string(path)?;
        // The header `// mamba2 kernel NAME; checks: bounds loops divisions` (or `none`).
        let checks: Vec<&str> = text
            .lines()
            .next()
            .and_then(|l| l.split_once("checks: "))
            .map(|(_, c)| c.split_whitespace().collect())
            .unwrap_or_default();
        let (spirv, bindings) = spirv(&text, |c| checks.contains(&c))?;
        // SAFETY: the objects are created from valid descriptions and destroyed before
        // returning; the pipeline is never bound.
        unsafe {
            let d = &self.device;
            let module =
                d.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&spirv), None)?;
            let layout_bindings: Vec<_> = bindings
                .iter()
                .map(|&(b, uniform)| {
                    vk::DescriptorSetLayoutBinding::default()
                        .binding(b)
                        .descriptor_type(if uniform {
                            vk::DescriptorType::UNIFORM_BUFFER
                        } else {
                            vk::DescriptorType::STORAGE_BUFFER
                        })
                        .descriptor_count(1)
                        .stage_flags(vk::ShaderStageFlags::COMPUTE)
                })
                .collect();
            let set = d.create_descriptor_set_layout(
                &vk::DescriptorSetLayoutCreateInfo::default().bindings(&layout_bindings),
                None,
            )?;
            let sets = [set];
            let layout = d.create_pipeline_layout(
                &vk::PipelineLayoutCreateInfo::default().set_layouts(&sets),
                None,
            )?;
            let stage = vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::COMPUTE)
                .module(module)
                .name(c"main");
            let flags = if self.exec.is_some() {
                vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR
            } else {
                vk::PipelineCreateFlags::empty()
            };
            let info = vk::ComputePipelineCreateInfo::default()
                .flags(flags)
                .stage(stage)
                .layout(layout);
            let made = d.create_compute_pipelines(vk::PipelineCache::null(), &[info], None);
            let result = match made {
                Ok(p) => {
                    let lines = self.describe(p[0]);
                    d.destroy_pipeline(p[0], None);
                    lines
                }
                Err((_, e)) => Err(anyhow!("vkCreateComputePipelines: {e}")),
            };
            d.destroy_pipeline_layout(layout, None);
            d.destroy_descriptor_set_layout(set, None);
            d.destroy_shader_module(module, None);
            result
        }
    }

    /// # Safety
    /// `pipeline` was created on this device with statistics captured.
    unsafe fn describe(&self, pipeline: vk::Pipeline) -> Result<Vec<String>> {
        let Some(exec) = &self.exec else {
            return Ok(vec![format!(
                "compiled; {} reports no statistics (no VK_KHR_pipeline_executable_properties)",
                self.name
            )]);
        };
        let mut out = Vec::new();
        let info = vk::PipelineInfoKHR::default().pipeline(pipeline);
        let execs = unsafe { exec.get_pipeline_executable_properties(&info)? };
        for (i, e) in execs.iter().enumerate() {
            let ename = unsafe { CStr::from_ptr(e.name.as_ptr()) }.to_string_lossy();
            out.push(format!(
                "executable {i}: {ename} (subgroup size {})",
                e.subgroup_size
            ));
            let ei = vk::PipelineExecutableInfoKHR::default()
                .pipeline(pipeline)
                .executable_index(i as u32);
            for s in unsafe { exec.get_pipeline_executable_statistics(&ei)? } {
                let sname = unsafe { CStr::from_ptr(s.name.as_ptr()) }.to_string_lossy();
                // SAFETY: `format` says which member of the union the driver wrote.
                let value = unsafe {
                    match s.format {
                        vk::PipelineExecutableStatisticFormatKHR::BOOL32 => {
                            (s.value.b32 != 0).to_string()
                        }
                        vk::PipelineExecutableStatisticFormatKHR::INT64 => s.value.i64.to_string(),
                        vk::PipelineExecutableStatisticFormatKHR::UINT64 => s.value.u64.to_string(),
                        vk::PipelineExecutableStatisticFormatKHR::FLOAT64 => {
                            format!("{:.3}", s.value.f64)
                        }
                        _ => "?".to_string(),
                    }
                };
                out.push(format!("  {sname}: {value}"));
            }
        }
        Ok(out)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: nothing made on the device outlives `stats`.
        unsafe {
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// A kernel's group-0 bindings: (binding, is a uniform buffer).
type Bindings = Vec<(u32, bool)>;

/// SPIR-V of a dumped kernel as wgpu's Vulkan backend writes it for this engine with the
/// run-time checks `on` names, and its bindings.
fn spirv(text: &str, on: impl Fn(&str) -> bool) -> Result<(Vec<u32>, Bindings)> {
    use naga::back::spv;
    use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy};
    let module =
        naga::front::wgsl::parse_str(text).map_err(|e| anyhow!("{}", e.emit_to_string(text)))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| anyhow!("{}", e.emit_to_string(text)))?;
    let index = if on("bounds") {
        BoundsCheckPolicy::Restrict
    } else {
        BoundsCheckPolicy::Unchecked
    };
    let options = spv::Options {
        lang_version: (1, 6),
        bounds_check_policies: BoundsCheckPolicies {
            index,
            buffer: BoundsCheckPolicy::Unchecked,
            image_load: BoundsCheckPolicy::Unchecked,
            binding_array: BoundsCheckPolicy::Unchecked,
        },
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: on("loops"),
        emit_int_div_checks: on("divisions"),
        ..spv::Options::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    let words = spv::write_vec(&module, &info, &options, Some(&pipeline))?;
    let bindings = module
        .global_variables
        .iter()
        .filter_map(|(_, g)| {
            let b = g.binding.as_ref()?;
            (b.group == 0).then_some((b.binding, matches!(g.space, naga::AddressSpace::Uniform)))
        })
        .collect();
    Ok((words, bindings))
}
