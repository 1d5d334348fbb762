//! Opening a model on the device a user asked for: the one place front-ends (CLI, chat
//! app, inspector) turn a `DeviceChoice` into a `Backend`.

use std::sync::Arc;

use crate::admission::{Footprint, admit, context_that_fits, host_available};
use crate::error::{Error, Result};
use crate::gpu::context::{DeviceChoice, GpuContext, is_software, pick_adapter, software_adapters};
use crate::gpu::{Engine, EngineOptions, GpuBackend};
use crate::model::Model;
use crate::reference::CpuModel;
use crate::session::{Backend, CpuBackend};

/// The backend for `choice`: a GPU engine with `opts`, or the CPU reference (asked for, or
/// `Auto` with no hardware adapter — then `notice` gets one line saying why).
pub fn open_backend(
    model: &Model,
    choice: &DeviceChoice,
    opts: EngineOptions,
    notice: &mut dyn FnMut(&str),
) -> Result<Box<dyn Backend>> {
    match pick_adapter(choice)? {
        Some(adapter) => {
            let software = is_software(&adapter.get_info());
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
            let context = opts.context.unwrap_or(0);
            let needs = Footprint::gpu(&model.config, opts.format, opts.kv.bytes(), context);
            // A software adapter's device memory is host memory; a GPU's capacity is not
            // known through wgpu, so there the allocation itself is checked (error scopes
            // and the instance's memory-budget threshold) and its error carries the sizes.
            if software {
                admit(
                    &needs,
                    context,
                    host_available(),
                    &format!("memory on {}", ctx.info.name),
                    "try --dtype q8_0, a smaller --ctx or --kv f16",
                )?;
            }
            let engine = Engine::new(ctx, model, opts).map_err(|e| match e {
                Error::Gpu(m) if m.contains("out of device memory") => Error::Gpu(format!(
                    "{m} (the model needs about {} on the device)",
                    needs.describe(context)
                )),
                e => e,
            })?;
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
                notice(&auto_fallback_notice(&software_adapters()));
            }
            let mut context = if model.config.attention.is_some() {
                opts.context_for(&model.config, u64::MAX, notice)?
            } else {
                0
            };
            // The default context (the model's longest) is capped to what host memory holds,
            // as the GPU caps it to what a buffer binds; an explicit --ctx is kept (and
            // refused below if it does not fit).
            let per_token = model.config.kv_bytes_per_token(4) as u64;
            let fixed = Footprint::cpu(&model.config, 0);
            if opts.context.is_none()
                && let Some(fit) = context_that_fits(&fixed, per_token, host_available())
                && fit > 0
                && fit < context
            {
                notice(&format!(
                    "KV caches capped at {fit} tokens (the model allows {context}): that is what \
                     the available host memory holds beside the weights"
                ));
                context = fit;
            }
            // Checked before the f32 copies of the weights are made.
            admit(
                &Footprint::cpu(&model.config, context),
                context,
                host_available(),
                "host memory on --device cpu",
                "run it on a GPU (--device gpu) or choose a smaller --ctx",
            )?;
            let mut cpu = CpuModel::<f32>::new(&model.config, &model.weights)?;
            if context > 0 {
                cpu = cpu.with_context(context);
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

/// Why `Auto` runs on the CPU reference: no adapter at all, or only software ones, which
/// it passes over because they are slower than the reference on the same cores.
fn auto_fallback_notice(software: &[String]) -> String {
    if software.is_empty() {
        "no GPU adapter found: running on the CPU reference (install a Vulkan driver for the GPU path)".into()
    } else {
        format!(
            "only a software GPU adapter ({}) found: running on the CPU reference (use --device gpu to run on it)",
            software.join(", ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::auto_fallback_notice;

    #[test]
    fn the_fallback_notice_says_why() {
        assert!(auto_fallback_notice(&[]).starts_with("no GPU adapter found"));
        let n = auto_fallback_notice(&["llvmpipe (LLVM 15.0.6, 256 bits)".into()]);
        assert!(
            n.starts_with("only a software GPU adapter (llvmpipe (LLVM 15.0.6, 256 bits)) found")
                && n.ends_with("(use --device gpu to run on it)"),
            "{n}"
        );
    }
}
