//! Opening a model on the device a user asked for: the one place front-ends (CLI, chat
//! app, inspector) turn a `DeviceChoice` into a `Backend`.

use std::sync::Arc;

use crate::error::Result;
use crate::gpu::context::{DeviceChoice, GpuContext, pick_adapter};
use crate::gpu::{Engine, EngineOptions, GpuBackend};
use crate::model::Model;
use crate::reference::CpuModel;
use crate::session::{Backend, CpuBackend};

/// The backend for `choice`: a GPU engine with `opts`, or the CPU reference (asked for, or
/// `Auto` with no adapter — then `notice` gets one line saying so).
pub fn open_backend(
    model: &Model,
    choice: &DeviceChoice,
    opts: EngineOptions,
    notice: &mut dyn FnMut(&str),
) -> Result<Box<dyn Backend>> {
    match pick_adapter(choice)? {
        Some(adapter) => {
            let ctx = Arc::new(GpuContext::new(
                adapter,
                &Engine::needs(&model.config, opts.format),
            )?);
            // The KV cache length, decided here so that a capped default is said.
            let mut opts = opts;
            if model.config.count(crate::config::BlockKind::Attention) > 0 {
                let max_binding = ctx.limits.max_storage_buffer_binding_size;
                opts.context = Some(opts.context_for(&model.config, max_binding, notice)?);
            }
            let engine = Engine::new(ctx, model, opts)?;
            if engine.context() > 0 {
                notice(&format!(
                    "KV cache: {} tokens × {} attention layers in {} ({:.1} MiB)",
                    engine.context(),
                    model.config.count(crate::config::BlockKind::Attention),
                    opts.kv.name(),
                    engine.state.kv_bytes() as f64 / (1024.0 * 1024.0)
                ));
            }
            Ok(Box::new(GpuBackend::new(engine)?))
        }
        None => {
            if *choice == DeviceChoice::Auto {
                notice(
                    "no GPU adapter found: running on the CPU reference (install a Vulkan driver for the GPU path)",
                );
            }
            let mut cpu = CpuModel::<f32>::new(&model.config, &model.weights);
            if model.config.attention.is_some() {
                cpu = cpu.with_context(opts.context_for(&model.config, u64::MAX, notice)?);
            }
            // --chunk-size applies on the CPU too (checked to 8…256 as on the GPU).
            let backend = match opts.chunk_size {
                Some(_) => CpuBackend::new(cpu).with_chunk(opts.chunk_for(&model.config)?),
                None => CpuBackend::new(cpu),
            };
            Ok(Box::new(backend))
        }
    }
}
