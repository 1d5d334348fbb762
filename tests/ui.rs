//! The chat app and the inspector driven headless with egui_kittest: clicks and typing go
//! through egui's input (AccessKit nodes found by label), the model runs on the windows'
//! own worker threads, and the assertions read both the window (labels) and the view
//! models behind it.
//!
//! The chat uses the embedded model: a real trained model with a real tokenizer (byte-level
//! BPE, end-of-text id 0), 5.3 M parameters, fast on lavapipe and on the CPU reference.
//! A hand-made tokenizer over random weights would exercise the same code but prove less
//! (a chat template, EOS handling and UTF-8 streaming all come with the real one).
//!
//! Screenshots for docs/ are rendered through wgpu (lavapipe here) by the screenshot tests;
//! they are written to docs/ only with MAMBA2_UPDATE_SCREENSHOTS=1, and otherwise only
//! checked to be real pictures.

#![cfg(feature = "ui")]

use std::time::{Duration, Instant};

use egui_kittest::Harness;
use egui_kittest::kittest::Queryable;
use mamba2_wgpu::gpu::kernels::Section;
use mamba2_wgpu::reference::State;
use mamba2_wgpu::session::Finish;
use mamba2_wgpu::ui::chat::Role;
use mamba2_wgpu::ui::{ChatApp, InspectorApp, LoadRequest, ModelSource};
use mamba2_wgpu::{DeviceChoice, WeightFormat};

const TIMEOUT: Duration = Duration::from_secs(120);

/// Steps the harness until `cond` holds (the workers run on their own threads).
fn wait_until<S>(
    h: &mut Harness<'_, S>,
    what: &str,
    cond: impl Fn(&S) -> bool,
    errors: impl Fn(&S) -> String,
) {
    let start = Instant::now();
    loop {
        h.step();
        if cond(h.state()) {
            return;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "timed out waiting for {what}; window errors: {}",
            errors(h.state())
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn chat_errors(a: &ChatApp) -> String {
    format!("{:?} / notices {:?}", a.errors, a.notices)
}

fn inspector_errors(a: &InspectorApp) -> String {
    format!("{:?} / notices {:?}", a.error, a.notices)
}

fn chat_harness(size: [f32; 2]) -> Harness<'static, ChatApp> {
    let app = ChatApp::new(LoadRequest::new(ModelSource::Embedded, gpu_device()));
    let mut h = Harness::builder()
        .with_size(size)
        .build_ui_state(|ui, app: &mut ChatApp| app.show(ui), app);
    wait_until(&mut h, "the model to load", |a| a.ready(), chat_errors);
    h
}

/// A chat window whose model (`dir`, not there) failed to load, once it says so.
fn after_a_failed_load(dir: &std::path::Path) -> Harness<'static, ChatApp> {
    let app = ChatApp::new(LoadRequest::new(
        ModelSource::Dir(dir.to_path_buf()),
        DeviceChoice::Cpu,
    ));
    let mut h = Harness::builder()
        .with_size([900.0, 500.0])
        .build_ui_state(|ui, app: &mut ChatApp| app.show(ui), app);
    wait_until(
        &mut h,
        "the load error",
        |a| !a.errors.is_empty(),
        chat_errors,
    );
    h
}

fn type_and_send(h: &mut Harness<'_, ChatApp>, text: &str) {
    h.get_by_label("Message").focus();
    h.step();
    h.get_by_label("Message").type_text(text);
    h.step();
    assert_eq!(
        h.state().input,
        text,
        "the typed text reached the input box"
    );
    h.get_by_label("Send").click();
    h.step();
}

fn replies(a: &ChatApp) -> Vec<&mamba2_wgpu::ui::chat::Message> {
    a.messages
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .collect()
}

#[test]
fn chat_streams_stops_and_regenerates() {
    let mut h = chat_harness([1100.0, 700.0]);

    // A greedy reply that cannot end early: 12 tokens past any end-of-text.
    {
        let s = &mut h.state_mut().settings;
        s.temperature = 0.0;
        s.max_tokens = 12;
        s.ignore_eos = true;
    }
    type_and_send(&mut h, "The best way to");
    assert_eq!(
        h.state().messages.len(),
        2,
        "user message and reply placeholder"
    );
    wait_until(
        &mut h,
        "the first reply",
        |a| a.generating.is_none(),
        chat_errors,
    );
    let first = replies(h.state())[0].clone();
    assert_eq!(first.tokens, 12, "{first:?}");
    assert_eq!(first.finish, Some(Finish::Length));
    assert!(
        !first.text.trim().is_empty(),
        "the reply has text: {first:?}"
    );
    h.step();
    let shown = first.text.trim();
    assert!(
        h.query_by_label_contains(&shown[..shown.len().min(12)])
            .is_some(),
        "the reply is shown in the window: {shown:?}"
    );
    assert!(
        h.query_by_label_contains("12 tokens").is_some(),
        "the reply's stats are shown"
    );

    // Regenerate restores the state from before the reply: greedy, so the same text again
    // (had the reply stayed in the state, the continuation would differ).
    h.get_by_label("Regenerate").click();
    h.step();
    wait_until(
        &mut h,
        "the regenerated reply",
        |a| a.generating.is_none(),
        chat_errors,
    );
    let again = replies(h.state())[0].clone();
    assert_eq!(h.state().messages.len(), 2, "regenerate replaces the reply");
    assert_ne!(again.id, first.id);
    assert_eq!(
        again.text, first.text,
        "greedy regeneration from the restored state"
    );

    // A reply with no end: stream some tokens, see them in the window, then Stop.
    h.state_mut().settings.max_tokens = 100_000;
    type_and_send(&mut h, " Another");
    wait_until(
        &mut h,
        "streamed tokens",
        |a| {
            replies(a)
                .get(1)
                .is_some_and(|m| m.tokens >= 3 && !m.text.trim().is_empty())
        },
        chat_errors,
    );
    assert!(h.state().generating.is_some(), "still streaming");
    let partial = replies(h.state())[1].text.trim().to_string();
    h.step();
    assert!(
        h.query_by_label_contains(&partial[..partial.len().min(6)])
            .is_some(),
        "streamed text is shown while generating: {partial:?}"
    );
    h.get_by_label("Stop").click();
    h.step();
    wait_until(&mut h, "the stop", |a| a.generating.is_none(), chat_errors);
    let stopped = replies(h.state())[1].clone();
    assert_eq!(stopped.finish, Some(Finish::Cancelled), "{stopped:?}");
    assert!(stopped.tokens >= 3 && stopped.tokens < 100_000);

    // The conversation goes on after a stop (the state carries over).
    h.state_mut().settings.max_tokens = 4;
    type_and_send(&mut h, " And");
    wait_until(
        &mut h,
        "a third reply",
        |a| a.generating.is_none(),
        chat_errors,
    );
    assert_eq!(replies(h.state())[2].tokens, 4);
    assert!(h.state().errors.is_empty(), "{:?}", h.state().errors);

    // New chat empties the conversation.
    h.get_by_label("New chat").click();
    h.step();
    assert!(h.state().messages.is_empty());
}

/// A reply whose long prompt is still being read shows how far the reading has got (the
/// worker's `ChatEvent::Reading`, from `Session::set_prompt_progress`) in place of "…".
#[test]
fn chat_shows_its_progress_through_a_long_prompt() {
    use mamba2_wgpu::ui::chat::Message;
    let mut h = chat_harness([900.0, 600.0]);
    let message = |role, text: &str, id| Message::new(role, text.into(), id);
    {
        let a = h.state_mut();
        a.messages.push(message(Role::User, "a long document", 0));
        a.messages.push(message(Role::Assistant, "", 7));
        a.generating = Some(7);
        a.reading = Some((8192, 20480));
    }
    h.step();
    assert!(
        h.query_by_label_contains("reading the prompt: 8192 of 20480 tokens (40 %)")
            .is_some(),
        "the progress is shown"
    );
    // Once the reply is no longer being made, its progress is not shown.
    h.state_mut().generating = None;
    h.step();
    assert!(h.query_by_label_contains("reading the prompt").is_none());
}

#[test]
fn chat_shows_a_bad_model_dir_in_the_window() {
    let dir = std::env::temp_dir().join(format!("mamba2-ui-missing-{}", std::process::id()));
    let mut h = after_a_failed_load(&dir);
    assert!(
        h.state().errors[0].contains("is not a directory"),
        "{:?}",
        h.state().errors
    );
    assert!(h.state().model.is_none());
    h.step();
    assert!(
        h.query_by_label_contains("is not a directory").is_some(),
        "the error is in the window"
    );
    assert!(h.query_by_label_contains("no model open").is_some());
    // Then open the embedded model from the window (empty path field).
    h.state_mut().form.path.clear();
    h.get_by_label("Open model").click();
    h.step();
    wait_until(&mut h, "the embedded model", |a| a.ready(), chat_errors);
}

/// A turn that fails leaves the conversation as before it (`Chat::say_with`), so the
/// window takes it back: a new message goes back to the input box, a regenerated reply is
/// the old one again; a Regenerate after it then remakes the reply the chat really holds.
/// The worker here has no model (its load failed), so every turn fails at once, for real.
#[test]
fn chat_takes_back_a_turn_that_failed() {
    use mamba2_wgpu::ui::chat::Message;
    use mamba2_wgpu::ui::chat_worker::ChatEvent;
    let dir = std::env::temp_dir().join(format!("mamba2-ui-none-{}", std::process::id()));
    let mut h = after_a_failed_load(&dir);
    {
        let a = h.state_mut();
        a.errors.clear();
        // As if a model were open and had answered once (the worker has none).
        a.model = Some("a model".into());
        a.messages.push(Message::new(Role::User, "hello".into(), 0));
        a.messages
            .push(Message::new(Role::Assistant, "the old reply".into(), 1));
    }

    h.state_mut().regenerate();
    wait_until(
        &mut h,
        "the failed regeneration",
        |a| a.ready(),
        chat_errors,
    );
    let a = h.state();
    assert_eq!(a.messages.len(), 2, "{:?}", a.messages);
    assert_eq!(a.messages[1].text, "the old reply", "the old reply is back");
    assert!(a.messages[1].error.is_none(), "{:?}", a.messages[1]);
    assert!(
        a.errors.iter().any(|e| e.contains("no model is open")),
        "{:?}",
        a.errors
    );

    h.state_mut().input = "a question".into();
    h.state_mut().send_input();
    assert_eq!(h.state().messages.len(), 4, "sent: message and reply shown");
    assert!(h.state().input.is_empty());
    // Typed while the turn runs (the window applies the failure at its next frame).
    h.state_mut().input = "and more".into();
    wait_until(&mut h, "the failed message", |a| a.ready(), chat_errors);
    let a = h.state();
    assert_eq!(
        a.messages
            .iter()
            .map(|m| m.text.as_str())
            .collect::<Vec<_>>(),
        ["hello", "the old reply"],
        "the message that was not sent is not shown as sent"
    );
    assert_eq!(
        a.input, "a question and more",
        "its text is back in the input box, before what was typed since"
    );
    assert_eq!(a.errors.len(), 2, "{:?}", a.errors);

    // A failure that comes after its reply ended (reading the live state) leaves the
    // reply as it ended; a failure that closed the model leaves no conversation shown.
    let a = h.state_mut();
    a.apply(ChatEvent::ReplyFailed {
        id: 1,
        error: "the live state could not be read".into(),
        in_conversation: false,
    });
    assert_eq!(a.messages.len(), 2);
    assert!(a.messages[1].error.is_none(), "{:?}", a.messages[1]);
    a.regenerate();
    let id = a.generating.expect("a regeneration under way");
    a.apply(ChatEvent::ReplyFailed {
        id,
        error: "internal error: a panic (the model was closed; open it again)".into(),
        in_conversation: false,
    });
    assert!(a.model.is_none() && a.messages.is_empty() && a.generating.is_none());
}

/// Stop while a long prompt is being read: the message is not sent (the chat rolls the
/// read pieces back), the window takes it back into the input box, and Regenerate then
/// remakes the reply before it, which greedy decoding makes equal to the first. (On the
/// CPU reference: this is about the window and its worker, and lavapipe takes 100 s to
/// read the 8192 tokens of a piece, the CPU 15.)
#[test]
fn chat_stopped_while_reading_takes_the_message_back() {
    let app = ChatApp::new(LoadRequest::new(ModelSource::Embedded, DeviceChoice::Cpu));
    let mut h = Harness::builder()
        .with_size([1100.0, 700.0])
        .build_ui_state(|ui, app: &mut ChatApp| app.show(ui), app);
    wait_until(&mut h, "the model to load", |a| a.ready(), chat_errors);
    {
        let s = &mut h.state_mut().settings;
        s.temperature = 0.0;
        s.max_tokens = 6;
        s.ignore_eos = true;
    }
    type_and_send(&mut h, "The best way to");
    wait_until(&mut h, "the first reply", |a| a.ready(), chat_errors);
    let first = h.state().messages[1].text.clone();
    assert_eq!(h.state().messages[1].tokens, 6);

    // Two prompt pieces or more (`PROMPT_STEP` = 8192 tokens each) report progress and can
    // be stopped between them.
    // (15 tokens each: 18 000 tokens, of which the first piece is read.)
    let long = " The quick brown fox jumps over the lazy dog.".repeat(1200);
    h.state_mut().input = long.clone();
    h.get_by_label("Send").click();
    h.step();
    wait_until(
        &mut h,
        "the long prompt's reading",
        |a| a.reading.is_some(),
        chat_errors,
    );
    h.get_by_label("Stop").click();
    h.step();
    wait_until(&mut h, "the stop", |a| a.ready(), chat_errors);
    let a = h.state();
    assert_eq!(a.messages.len(), 2, "the long message is taken back");
    assert_eq!(a.messages[1].text, first);
    assert_eq!(
        a.input,
        long.trim_end(),
        "its text is back in the input box"
    );
    assert!(
        a.errors
            .iter()
            .any(|e| e.contains("the message was not sent")),
        "{:?}",
        a.errors
    );

    h.state_mut().errors.clear();
    h.get_by_label("Regenerate").click();
    h.step();
    wait_until(&mut h, "the regenerated reply", |a| a.ready(), chat_errors);
    let a = h.state();
    assert_eq!(a.messages.len(), 2);
    assert_eq!(
        a.messages[1].text, first,
        "the reply regenerated is the one shown (greedy: the same text)"
    );
    assert!(a.errors.is_empty(), "{:?}", a.errors);
}

/// A Q4_K GGUF opened with no format asked for (what `mamba2 app --model FILE` sends
/// without --dtype) goes up as stored, like every other command's default, and the
/// drop-down says so; a format chosen there still wins when the model is reopened.
#[test]
fn chat_opens_a_gguf_in_its_stored_format() {
    let file =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/k256.q4_k.gguf");
    let device = gpu_device();
    if device == DeviceChoice::Auto {
        // The CPU reference has no weight formats to check.
        return;
    }
    let app = ChatApp::new(LoadRequest::new(ModelSource::Dir(file), device));
    let mut h = Harness::builder()
        .with_size([1100.0, 700.0])
        .build_ui_state(|ui, app: &mut ChatApp| app.show(ui), app);
    wait_until(&mut h, "the GGUF to load", |a| a.ready(), chat_errors);
    let format = |a: &ChatApp| {
        a.inspector
            .info
            .as_ref()
            .and_then(|i| i.gpu.as_ref())
            .map(|g| g.format)
    };
    assert_eq!(h.state().form.format, None);
    assert_eq!(format(h.state()), Some("q4_k"));
    h.step();
    assert!(
        h.query_by(|n| n.value().is_some_and(|v| v == "as stored (q4_k)"))
            .is_some(),
        "the drop-down shows the stored format"
    );
    h.state_mut().form.format = Some(WeightFormat::F16);
    h.get_by_label("Open model").click();
    h.step();
    wait_until(
        &mut h,
        "the GGUF reopened as f16",
        |a| a.ready() && format(a) == Some("f16"),
        chat_errors,
    );
}

fn inspector_harness(size: [f32; 2]) -> Harness<'static, InspectorApp> {
    inspector_on("tiny", size)
}

/// The inspector over random weights at a preset's shapes, made on the device.
fn inspector_on(preset: &str, size: [f32; 2]) -> Harness<'static, InspectorApp> {
    let req = LoadRequest::new(
        ModelSource::Preset {
            name: preset.into(),
            seed: 3,
        },
        gpu_device(),
    );
    let app = InspectorApp::new(req, "The", false);
    let mut h = Harness::builder()
        .with_size(size)
        .build_ui_state(|ui, app: &mut InspectorApp| app.show(ui), app);
    wait_until(
        &mut h,
        "the model to load",
        |a| a.panel.info.is_some() && a.loading.is_none(),
        inspector_errors,
    );
    h
}

#[test]
fn inspector_steps_times_and_flags_nan() {
    let mut h = inspector_harness([1280.0, 820.0]);
    let config = h
        .state()
        .panel
        .info
        .as_ref()
        .map(|i| i.config.clone())
        .expect("model info");
    let gpu = h.state().panel.info.as_ref().and_then(|i| i.gpu.clone());
    assert!(!h.state().running, "opened paused");

    // Step three tokens, one at a time.
    for n in 0..3 {
        h.get_by_label("Step 1 token").click();
        h.step();
        wait_until(
            &mut h,
            "a stepped token",
            |a| a.panel.timings.tokens_seen >= 2 + n,
            inspector_errors,
        );
    }
    assert_eq!(
        h.state().panel.timings.tokens_seen,
        4,
        "the prefill's token and three steps"
    );

    // The heatmap has the model's layers and heads.
    wait_until(
        &mut h,
        "a state summary",
        |a| a.panel.state.is_some(),
        inspector_errors,
    );
    let s = h.state().panel.state.clone().expect("summary");
    assert_eq!(
        (s.layers, s.heads, s.head_dim, s.d_state),
        (
            config.n_layer,
            config.n_heads,
            config.head_dim,
            config.d_state
        )
    );
    assert!(!s.has_nonfinite());
    assert!(s.rms.iter().any(|&v| v > 0.0), "the state moved off zero");
    let label = format!(
        "SSM state: {} layers × {} heads",
        config.n_layer, config.n_heads
    );
    assert!(
        h.query_by_label_contains(&label).is_some(),
        "heatmap caption `{label}`"
    );

    // The timing table fills (GPU with timestamp queries: lavapipe has them).
    match gpu.as_ref().filter(|g| g.timestamps) {
        Some(g) => {
            wait_until(
                &mut h,
                "three profiles",
                |a| a.panel.timings.profiles.len() >= 3,
                inspector_errors,
            );
            let sum = h.state().panel.timings.summary();
            assert_eq!(
                sum.dispatches, g.dispatches_sample,
                "one timing per dispatch"
            );
            assert!(sum.gpu_ns > 0.0);
            h.step();
            assert!(
                h.query_by_label("mamba2/ssd_step+gate").is_some(),
                "kernel rows in the table"
            );
            assert!(
                h.query_all_by_label("MATMUL").count() >= 2,
                "a section bar and kernel rows"
            );
        }
        None => eprintln!(
            "\n!!!!!!!! no GPU with timestamp queries: timing table not checked !!!!!!!!\n"
        ),
    }

    // Run, then pause.
    h.get_by_label("Run").click();
    h.step();
    wait_until(
        &mut h,
        "running tokens",
        |a| a.panel.timings.tokens_seen >= 24,
        inspector_errors,
    );
    h.get_by_label("Pause").click();
    h.step();
    wait_until(&mut h, "the pause", |a| !a.running, inspector_errors);
    let seen = h.state().panel.timings.tokens_seen;
    std::thread::sleep(Duration::from_millis(200));
    h.run_steps(3);
    let after = h.state().panel.timings.tokens_seen;
    assert!(
        after <= seen + 8,
        "paused: at most the burst in flight ({seen} → {after})"
    );

    // Export CSV: where it went is shown.
    if gpu.as_ref().is_some_and(|g| g.timestamps) {
        let dir = std::env::temp_dir().join(format!("mamba2-ui-{}", std::process::id()));
        h.state_mut().panel.export_path = dir.join("timings").display().to_string();
        h.get_by_label("Export CSV").click();
        h.step();
        let written = match &h.state().panel.export_result {
            Some(Ok(p)) => p.clone(),
            other => panic!("export failed: {other:?}"),
        };
        let csv = std::fs::read_to_string(&written).expect("exported file");
        let rows =
            h.state().panel.timings.profiles.len() * h.state().panel.timings.summary().dispatches;
        assert_eq!(csv.lines().count(), 1 + rows);
        assert!(h.query_by_label_contains("wrote ").is_some());
        let _ = std::fs::remove_dir_all(dir);
    }

    // A NaN in the state raises the flag. Live reads off first, so no fresh read replaces
    // the injected state.
    h.get_by_label("live state").click();
    h.step();
    std::thread::sleep(Duration::from_millis(300));
    h.run_steps(3);
    assert_eq!(
        h.query_all_by_label_contains("NaN/Inf in the state!")
            .count(),
        0
    );
    let mut st = State::new(&config);
    for l in 0..config.n_layer {
        let (conv, ssm) = st.mamba_mut(l).expect("all layers are Mamba2");
        conv.fill(0.5);
        ssm.fill(0.25);
    }
    let head_len = config.head_dim * config.d_state;
    st.mamba_mut(2).expect("Mamba2").1[5 * head_len + 7] = f32::NAN;
    h.state_mut()
        .panel
        .inject_state(&st)
        .expect("state of the model's shape");
    h.run_steps(2);
    assert!(h.state().panel.nonfinite());
    assert!(
        h.query_all_by_label_contains("NaN/Inf in the state!")
            .count()
            >= 1,
        "the flag is up"
    );
    assert!(
        h.query_all_by_label_contains("layer 2 head 5").count() >= 1,
        "the flag names the head"
    );
    // A state of the wrong shape is refused, not shown.
    st.layers.pop();
    assert!(h.state_mut().panel.inject_state(&st).is_err());
}

#[test]
fn inspector_shows_the_expert_load_of_an_moe_model() {
    let mut h = inspector_on("tiny-moe", [1280.0, 820.0]);
    let gpu = h.state().panel.info.as_ref().and_then(|i| i.gpu.clone());
    if gpu.is_none() {
        eprintln!("\n!!!!!!!! no GPU: the expert load (GPU counters) is not checked !!!!!!!!\n");
        return;
    }
    let config = h.state().panel.info.as_ref().unwrap().config.clone();
    let m = config.moe.clone().expect("an MoE preset");
    for _ in 0..2 {
        h.get_by_label("Step 1 token").click();
        h.step();
    }
    wait_until(
        &mut h,
        "the expert load after two steps",
        |a| {
            a.panel
                .experts
                .as_ref()
                .is_some_and(|l| l.total(0) >= 3 * m.top_k as u64)
        },
        inspector_errors,
    );
    let load = h.state().panel.experts.clone().unwrap();
    assert_eq!(
        load.counts.len(),
        config.count(mamba2_wgpu::config::BlockKind::Moe)
    );
    for r in 0..load.counts.len() {
        assert_eq!(load.counts[r].len(), m.experts);
        assert_eq!(
            load.total(r),
            load.total(0),
            "every layer routes every token"
        );
        assert_eq!(load.total(r) % m.top_k as u64, 0, "top_k choices per token");
    }
    h.step();
    let caption = format!("{} MoE layers × {} experts", load.counts.len(), m.experts);
    assert!(
        h.query_by_label_contains(&caption).is_some(),
        "heatmap caption `{caption}`"
    );

    // The timing table has a MOE section: the router and the expert passes.
    if !gpu.is_some_and(|g| g.timestamps) {
        eprintln!(
            "\n!!!!!!!! no GPU timestamp queries: the MOE timing section is not checked !!!!!!!!\n"
        );
        return;
    }
    wait_until(
        &mut h,
        "a profile",
        |a| !a.panel.timings.profiles.is_empty(),
        inspector_errors,
    );
    let sum = h.state().panel.timings.summary();
    let moe = sum
        .sections
        .iter()
        .find(|(s, _)| *s == Section::Moe)
        .map(|&(_, ns)| ns);
    assert!(
        moe.is_some_and(|ns| ns > 0.0),
        "MOE time in {:?}",
        sum.sections
    );
    assert!(
        sum.kinds
            .iter()
            .any(|k| k.section == Section::Moe && k.count > 0),
        "MOE kernel rows in {:?}",
        sum.kinds
    );
    h.step();
    assert!(
        h.query_all_by_label("MOE").count() >= 2,
        "a MOE section bar and kernel rows"
    );
}

/// The device of the windows under test: any GPU adapter, software ones included (lavapipe
/// in CI, which `auto` passes over for the CPU reference), so that the GPU path is what is
/// tested wherever there is one. Without one, the CPU reference, unless MAMBA2_REQUIRE_GPU
/// is set (CI), where that fails.
fn gpu_device() -> DeviceChoice {
    if !mamba2_wgpu::gpu::context::adapters().is_empty() {
        return DeviceChoice::Gpu(None);
    }
    assert!(
        std::env::var_os("MAMBA2_REQUIRE_GPU").is_none(),
        "MAMBA2_REQUIRE_GPU is set but no GPU adapter was found (install mesa-vulkan-drivers)"
    );
    eprintln!("\n!!!!!!!! no GPU adapter: the windows run on the CPU reference !!!!!!!!\n");
    DeviceChoice::Auto
}

/// Whether a wgpu adapter exists to render screenshots with. Without one the screenshot
/// tests are skipped loudly, unless MAMBA2_REQUIRE_GPU is set (CI), where they fail.
fn can_render() -> bool {
    if !mamba2_wgpu::gpu::context::adapters().is_empty() {
        return true;
    }
    assert!(
        std::env::var_os("MAMBA2_REQUIRE_GPU").is_none(),
        "MAMBA2_REQUIRE_GPU is set but no GPU adapter was found (install mesa-vulkan-drivers)"
    );
    eprintln!("\n!!!!!!!! SKIPPED: no GPU adapter to render screenshots with !!!!!!!!\n");
    false
}

/// Renders the window through wgpu and checks it is a real picture; with
/// MAMBA2_UPDATE_SCREENSHOTS=1 also writes it to docs/.
fn screenshot<S>(h: &mut Harness<'_, S>, name: &str) {
    h.remove_cursor();
    h.run_steps(2);
    let image = h.render().expect("wgpu render");
    let (w, hgt) = image.dimensions();
    assert!(w >= 800 && hgt >= 500, "{w}×{hgt}");
    let first = *image.get_pixel(0, 0);
    let distinct = image.pixels().filter(|p| **p != first).count();
    assert!(
        distinct > (w * hgt / 10) as usize,
        "the picture has content"
    );
    if std::env::var_os("MAMBA2_UPDATE_SCREENSHOTS").is_some() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("docs")
            .join(format!("{name}.png"));
        std::fs::create_dir_all(path.parent().expect("docs/")).expect("docs/ folder");
        image.save(&path).expect("save screenshot");
        eprintln!("wrote {}", path.display());
    }
}

#[test]
fn screenshot_chat() {
    if !can_render() {
        return;
    }
    let app = ChatApp::new(LoadRequest::new(ModelSource::Embedded, gpu_device()));
    let mut h = Harness::builder()
        .with_size([1280.0, 800.0])
        .wgpu()
        .build_ui_state(|ui, app: &mut ChatApp| app.show(ui), app);
    wait_until(&mut h, "the model to load", |a| a.ready(), chat_errors);
    h.state_mut().settings.max_tokens = 60;
    h.state_mut().settings.temperature = 0.7;
    h.state_mut().show_inspector = true;
    h.run_steps(2);
    h.get_by_label("GPU timings").click();
    h.run_steps(2);
    for (i, prompt) in ["The secret of", "Never"].into_iter().enumerate() {
        h.state_mut().settings.seed = 7 + i as u64;
        type_and_send(&mut h, prompt);
        wait_until(&mut h, "a reply", |a| a.generating.is_none(), chat_errors);
    }
    wait_until(
        &mut h,
        "the state",
        |a| a.inspector.state.is_some(),
        chat_errors,
    );
    h.run_steps(4);
    screenshot(&mut h, "chat");
}

#[test]
fn screenshot_inspector() {
    if !can_render() {
        return;
    }
    let req = LoadRequest::new(ModelSource::Embedded, gpu_device());
    let app = InspectorApp::new(req, "The", false);
    let mut h = Harness::builder()
        .with_size([1280.0, 820.0])
        .wgpu()
        .build_ui_state(|ui, app: &mut InspectorApp| app.show(ui), app);
    wait_until(
        &mut h,
        "the model to load",
        |a| a.panel.info.is_some() && a.loading.is_none(),
        inspector_errors,
    );
    h.get_by_label("Run").click();
    h.step();
    wait_until(
        &mut h,
        "tokens",
        |a| a.panel.timings.tokens_seen >= 96,
        inspector_errors,
    );
    h.get_by_label("Pause").click();
    h.step();
    wait_until(
        &mut h,
        "the pause and a state",
        |a| !a.running && a.panel.state.is_some(),
        inspector_errors,
    );
    std::thread::sleep(Duration::from_millis(300));
    h.run_steps(4);
    screenshot(&mut h, "inspector");
}

#[test]
fn state_tap_reads_what_the_engine_holds() {
    use mamba2_wgpu::ui::state_tap::StateTap;
    use mamba2_wgpu::{EngineOptions, GenerateOptions, Model, Session, open_backend};
    let model = Model::synthetic(mamba2_wgpu::model::synthetic::tiny_config(2, 6), 5);
    let backend = open_backend(&model, &gpu_device(), EngineOptions::default(), &mut |_| {})
        .expect("backend");
    let mut session = Session::new(backend);
    let Some(gpu) = session.backend_mut().gpu() else {
        eprintln!("\n!!!!!!!! SKIPPED: no GPU adapter, the state tap is GPU-only !!!!!!!!\n");
        return;
    };
    let mut tap = StateTap::new(&gpu.engine);
    let opts = GenerateOptions {
        max_new_tokens: 5,
        ..Default::default()
    };
    session
        .generate(&[1, 2, 3], &opts, |_| true)
        .expect("generate");
    assert!(tap.request(7).expect("request"));
    assert!(
        !tap.request(8).expect("second request"),
        "one copy in flight at a time"
    );
    let (tapped, pos) = tap.wait().expect("wait").expect("a landed copy");
    assert_eq!(pos, 7);
    let blocking = session.backend().state().expect("blocking read");
    assert_eq!(
        tapped, blocking,
        "the asynchronous copy is the state, layer by layer"
    );
    assert!(tapped.values().iter().any(|&v| v != 0.0));
    // Nothing in flight: nothing to take.
    assert!(tap.poll().expect("poll").is_none());
}
