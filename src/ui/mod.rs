//! The egui front-ends (cargo feature `ui`): the kernel-timing and state inspector, and the
//! desktop chat app, on eframe with its wgpu renderer.
//!
//! Layout:
//! - `chat` — the chat window; `chat_worker` — the thread that owns its `Session`.
//! - `inspector` — the inspector panel (embedded in the chat) and the standalone window;
//!   `inspect_worker` — the thread that decodes continuously, pauses and steps.
//! - `timings` — kernel timings: aggregates, plots, tables, CSV/JSON export.
//! - `state_view` — the state summary (per layer × head norms, NaN/Inf located) and its
//!   heatmaps; `state_tap` — asynchronous GPU state readback.
//! - `load` — opening a model (directory, embedded, synthetic preset) and its device facts;
//!   `worker` — what both workers share (waking the UI, summarizing, panic guard).
//!
//! # Threads
//! The UI thread only draws and sends commands over a channel; the model, its device and
//! every blocking call live on a worker thread, which streams events back and wakes the
//! window. Stop is an atomic read by the decode callback, so it acts mid-reply. A panic
//! inside the engine is caught on the worker and shown in the window as an error.
//!
//! # The engine owns its own wgpu device (it does not share eframe's)
//! eframe could be handed the engine's device (`WgpuSetup::Existing`), or the engine could
//! run on eframe's. Both windows instead create the engine's device themselves, through the
//! same `open_backend` path as the CLI, because:
//! - **Features and limits are the model's.** The engine asks for `SHADER_F16`, `SUBGROUP`,
//!   the timestamp-query features, and limits sized to the model's largest tensor, its
//!   storage buffers per stage and its workgroup memory (`Engine::needs`), never more than
//!   the adapter has. eframe creates its device before any model is known and asks for no
//!   features and default limits; and a model opened later from the window may need other
//!   limits — a device cannot be changed after creation, while the engine's own device is
//!   simply made anew with each model.
//! - **The model need not run where the window is drawn.** `--device cpu`, `gpu:1` (a
//!   compute GPU without a display, or the discrete GPU while the desktop composites on the
//!   integrated one) and the CPU fallback all work unchanged; a shared device would tie
//!   the model to the adapter the window surface picked.
//! - **Errors stay apart.** The engine's device captures validation errors and device loss
//!   and turns them into `Error`s; a lost engine device is reported in the window (and the
//!   model reopened) while the window keeps drawing. On one shared device a lost device
//!   takes the window down with it, and the UI's errors would land in the engine's sink.
//! - **Threads.** Generation runs on a worker that blocks in `device.poll(Wait)` for each
//!   token. wgpu 30 relaxed its locking so another thread can `submit` while one polls, so
//!   sharing would be *possible*; but the UI's frames would then queue behind a 7B model's
//!   token work on the same queue, and the engine's `poll` would also complete the UI's
//!   callbacks. Separate devices keep their queues and polling independent.
//! - **What sharing would buy is not needed:** nothing the engine computes is drawn as a
//!   GPU texture. The heatmaps are a few thousand rectangles from a small host-side summary,
//!   and the state readback goes to the host anyway. The cost of two devices on one GPU
//!   is egui's few MiB of textures and buffers.
//!
//! The state is read back asynchronously (`state_tap`): a copy queued behind the tokens in
//! flight, mapped without waiting, picked up when the decode loop's own polling completed
//! it — at most 2 Hz, and never a wait on the decode path.

pub mod chat;
pub mod chat_worker;
pub mod expert_view;
pub mod inspect_worker;
pub mod inspector;
pub mod load;
pub mod state_tap;
pub mod state_view;
pub mod timings;
pub mod worker;

pub use chat::ChatApp;
pub use chat_worker::GenSettings;
pub use inspector::{InspectorApp, InspectorPanel};
pub use load::{LoadRequest, ModelInfo, ModelSource};
pub use state_view::StateSummary;

fn native_options(title: &str) -> eframe::NativeOptions {
    eframe::NativeOptions {
        viewport: egui::ViewportBuilder::default()
            .with_title(title)
            .with_inner_size([1280.0, 820.0]),
        renderer: eframe::Renderer::Wgpu,
        ..Default::default()
    }
}

/// Opens the chat window on `req` and runs until it is closed.
pub fn run_chat(req: LoadRequest) -> Result<(), String> {
    eframe::run_native(
        "mamba2 chat",
        native_options("mamba2 chat"),
        Box::new(move |cc| {
            cc.egui_ctx.set_theme(egui::Theme::Dark);
            Ok(Box::new(ChatApp::new(req)))
        }),
    )
    .map_err(|e| format!("could not open a window: {e}"))
}

/// Opens the inspector window on `req` (prefilling `prompt`) and runs until it is closed.
pub fn run_inspector(req: LoadRequest, prompt: String, run: bool) -> Result<(), String> {
    eframe::run_native(
        "mamba2 inspector",
        native_options("mamba2 inspector"),
        Box::new(move |cc| {
            cc.egui_ctx.set_theme(egui::Theme::Dark);
            Ok(Box::new(InspectorApp::new(req, &prompt, run)))
        }),
    )
    .map_err(|e| format!("could not open a window: {e}"))
}
