//! The `mamba2` binary end to end, as a user runs it.

mod common;

use std::process::Command;

fn mamba2(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mamba2"))
        .args(args)
        .env("XDG_RUNTIME_DIR", "/tmp")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn generate_prompt_ids_on_every_device() {
    for name in [
        "nemotron_h_g2",
        "nemotron_h_hybrid",
        "nemotron_h_moe",
        "nemotron_h_latent",
        "granite_moe_hybrid",
    ] {
        generate_fixture_greedy(name);
    }
}

/// The oracle's 24 greedy ids from `mamba2 generate` on the CPU and the GPU (f32).
fn generate_fixture_greedy(name: &str) {
    let dir = common::fixture(name);
    let (prompt, greedy) = (
        common::oracle_ids(name, "prompt_ids"),
        common::oracle_ids(name, "greedy_ids"),
    );
    let mut devices = vec!["cpu"];
    if common::gpu(&Default::default()).is_some() {
        devices.push("gpu");
    }
    for device in devices {
        let (ok, out, err) = mamba2(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            &join(&prompt),
            "-n",
            "24",
            "--device",
            device,
            "--dtype",
            "f32",
            "--kv",
            "f32",
        ]);
        assert!(ok, "{name} {device}: {err}");
        // The prompt ids are echoed, then each generated id streams as ",id".
        assert_eq!(
            out.trim(),
            join(&[prompt.clone(), greedy.clone()].concat()),
            "{name} {device}"
        );
        assert!(
            err.contains("37 prompt + 24 generated tokens"),
            "{name} {device}: {err}"
        );
    }
}

#[test]
fn info_describes_the_model() {
    let dir = common::fixture("nemotron_h_g2");
    let (ok, out, err) = mamba2(&["info", "--model", dir.to_str().unwrap()]);
    assert!(ok, "{err}");
    for want in [
        "format     HF transformers nemotron_h",
        "layers     3",
        "d_inner    96  (8 heads × head_dim 12)",
        "groups     2  (d_state 16, conv kernel 4)",
        "vocab      101",
        "tied head  no",
        "dtypes     f32 ×",
        "tokenizer  none",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }
    // A hybrid: its layer pattern, attention and MLP shapes, and the KV cache per token.
    let dir = common::fixture("nemotron_h_hybrid");
    let (ok, out, err) = mamba2(&["info", "--model", dir.to_str().unwrap(), "--ctx", "1000"]);
    assert!(ok, "{err}");
    for want in [
        "pattern    M*-M-*M  (3 Mamba2 `M`, 2 attention `*`, 2 MLP `-`)",
        "attention  4 heads, 2 key/value heads, head_dim 16, no positional encoding",
        "mlp        96 wide, relu²",
        // 2 layers × (K + V) × 2 kv heads × 16 × 2 bytes = 256 bytes per token.
        "KV cache   0.2 MiB at 1000 tokens in f16 (0.2 KiB per token",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }
    // An MoE hybrid (Granite: each layer a mixer block and an MoE block).
    let dir = common::fixture("granite_moe_hybrid");
    let (ok, out, err) = mamba2(&["info", "--model", dir.to_str().unwrap()]);
    assert!(ok, "{err}");
    for want in [
        "format     HF transformers granitemoehybrid",
        "pattern    ME*EMEME  (3 Mamba2 `M`, 1 attention `*`, 4 MoE `E`)",
        "moe        3 of 10 experts per token (softmax over the top k), 16 wide silu-gated, \
         shared expert 32 wide",
        "scales     embedding × 4, residual × 0.5, logits × 0.4000",
        "attention  4 heads, 2 key/value heads, head_dim 12, no positional encoding, scale 0.2000",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }
    // The embedded model needs no --model.
    let (ok, out, err) = mamba2(&["info"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("embedded fortunes model") && out.contains("tokenizer  4096 tokens"),
        "{out}"
    );
}

#[test]
fn bad_input_is_a_clear_error() {
    let weights = common::fixture("hf_mamba2_g1").join("model.safetensors");
    let weights = weights.to_str().unwrap();
    for (model, says) in [
        ("/nonexistent/model", "no such file or directory"),
        ("/dev/zero", "not a model directory or a .gguf file"),
        (weights, "a file of a model directory: pass the directory"),
    ] {
        let (ok, _, err) = mamba2(&["info", "--model", model]);
        assert!(!ok, "{model}");
        assert!(err.starts_with(&format!("error: {model}: {says}")), "{err}");
    }
    // The GPU's flags on the CPU reference are said to do nothing.
    let (ok, _, err) = mamba2(&[
        "generate",
        "--device",
        "cpu",
        "--dtype",
        "q8_0",
        "--no-fuse",
        "-n",
        "1",
        "-p",
        "hi",
    ]);
    assert!(
        ok && err.contains("note: --dtype, --no-fuse have no effect on the CPU reference"),
        "{err}"
    );
    // An OS error is said once.
    let (ok, _, err) = mamba2(&["perplexity", "--device", "cpu", "-f", "/nonexistent/text"]);
    assert!(!ok && err.matches("os error 2").count() == 1, "{err}");
    let dir = common::fixture("hf_mamba2_g1");
    let (ok, _, err) = mamba2(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "hello",
    ]);
    assert!(!ok);
    assert!(
        err.contains("has no tokenizer.json: pass the prompt as --prompt-ids"),
        "{err}"
    );
    let (ok, _, err) = mamba2(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1,100000",
        "--device",
        "cpu",
    ]);
    assert!(!ok);
    assert!(
        err.contains("token id 100000 is outside the vocabulary (size 100)"),
        "{err}"
    );
    let (ok, _, err) = mamba2(&["generate", "--device", "tpu", "x"]);
    assert!(!ok);
    assert!(
        err.contains("expected auto, cpu, gpu, gpu:INDEX or gpu:NAME"),
        "{err}"
    );
    assert!(!err.contains("panicked"));
}

/// `mamba2 chat` with `input` on stdin: (success, stdout, stderr).
fn chat(args: &[&str], input: &[u8]) -> (bool, String, String) {
    with_stdin(&[&["chat"], args].concat(), input)
}

/// `mamba2 ARGS` with `input` on its stdin: (success, stdout, stderr).
fn with_stdin(args: &[&str], input: &[u8]) -> (bool, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_mamba2"))
        .args(args)
        .env("XDG_RUNTIME_DIR", "/tmp")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A chat that refuses its flags exits before reading: the pipe may be closed.
    let _ = child.stdin.take().unwrap().write_all(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A line on stdin longer than a message may be (`chat < /dev/zero`, a file without line
/// ends) ends the chat with an error naming the limit, instead of taking all the memory
/// there is; a refused `/regen` does not move the seed of the turns after it (the reply is
/// the one the same message gets without it).
#[test]
fn chat_refuses_an_endless_line_and_a_refused_regen_keeps_the_seed() {
    let mut endless = vec![b'a'; (16 << 20) + 100];
    endless.push(b'\n');
    let (ok, _, err) = chat(&["--device", "cpu", "-n", "2"], &endless);
    assert!(
        !ok && err.contains("stdin: a line of more than 16.0 MiB") && !err.contains("panicked"),
        "{err}"
    );
    let flags = [
        "--device",
        "cpu",
        "-n",
        "8",
        "--temperature",
        "0.9",
        "--seed",
        "5",
    ];
    let (ok, plain, _) = chat(&flags, b"Hello there\n");
    assert!(ok && !plain.trim().is_empty(), "{plain}");
    let (ok, after, err) = chat(&flags, b"/regen\nHello there\n");
    assert!(!ok && err.contains("no reply to regenerate"), "{err}");
    assert_eq!(after, plain, "{err}");
}

#[test]
fn chat_survives_a_line_that_is_not_utf8_and_says_so_in_its_exit_status() {
    let (ok, out, err) = chat(
        &["--device", "cpu", "-n", "3"],
        b"\xff\xfe oops\nTell me a fortune\n/quit\n",
    );
    assert!(
        err.contains("that line is not valid UTF-8 (byte 0); nothing was sent"),
        "{err}"
    );
    assert!(!out.trim().is_empty(), "the next line was answered");
    // The conversation went on, but not everything asked was done: a script must see it.
    assert!(!ok, "{err}");
    assert!(
        err.contains("error: 1 line of this conversation failed"),
        "{err}"
    );
    let (ok, out, err) = chat(&["--device", "cpu", "-n", "3"], b"Tell me a fortune\n");
    assert!(ok && !out.trim().is_empty(), "{err}");
}

/// `generate --prompt-file` reads the prompt from a file or, with `-`, from stdin: the same
/// text as the prompt given inline; an empty, missing or non-UTF-8 file is named.
#[test]
fn generate_reads_its_prompt_from_a_file_or_stdin() {
    let dir = common::Scratch::new("prompt-file");
    let text = "Love is patient,\nlove is kind.";
    let file = dir.join("prompt.txt");
    std::fs::write(&file, text).unwrap();
    let f = file.to_str().unwrap();
    let flags = ["generate", "--device", "cpu", "-n", "6"];
    let (ok, inline, err) = mamba2(&[&flags[..], &["-p", text]].concat());
    assert!(ok, "{err}");
    let (ok, from_file, err) = mamba2(&[&flags[..], &["--prompt-file", f]].concat());
    assert!(ok, "{err}");
    assert_eq!(from_file, inline);
    let (ok, from_stdin, err) = with_stdin(&[&flags[..], &["-f", "-"]].concat(), text.as_bytes());
    assert!(ok, "{err}");
    assert_eq!(from_stdin, inline);
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let binary = dir.join("binary.txt");
    std::fs::write(&binary, b"ok\xff\xfe").unwrap();
    for (path, says) in [
        (empty.to_str().unwrap(), "empty"),
        (binary.to_str().unwrap(), "UTF-8"),
        ("/nonexistent/prompt.txt", "/nonexistent/prompt.txt"),
    ] {
        let (ok, _, err) = mamba2(&[&flags[..], &["--prompt-file", path]].concat());
        assert!(
            !ok && err.contains("--prompt-file") && err.contains(says),
            "{path}: {err}"
        );
    }
    // It takes no inline prompt beside it.
    let (ok, _, err) = mamba2(&[&flags[..], &["--prompt-file", f, "-p", "x"]].concat());
    assert!(!ok && err.contains("cannot be used with"), "{err}");
}

/// A mistyped command (`/foo`, with or without words after it) or a command with words
/// after it is refused, never sent to the model as a message; `//` sends a line that starts
/// with `/` (the saved conversation holds `/fortune please` for `//fortune please`).
#[test]
fn chat_refuses_an_unknown_command_and_sends_a_doubled_slash_as_text() {
    let flags = ["--device", "cpu", "-n", "6"];
    for (line, says) in [
        (&b"/fortune\n"[..], "unknown command `/fortune`"),
        (b"/fortune please\n", "unknown command `/fortune`"),
        (b"/quit now\n", "`/quit` takes nothing after it"),
    ] {
        let (ok, out, err) = chat(&flags, line);
        assert!(
            !ok && out.trim().is_empty() && err.contains(says) && err.contains("nothing was sent"),
            "{out}\n{err}"
        );
    }
    // The conversation a save holds shows what was sent: the line without its first `/`.
    let dir = common::Scratch::new("chat-escape");
    let file = dir.join("talk.safetensors");
    let save = [&flags[..], &["--save", file.to_str().unwrap()]].concat();
    let (ok, escaped, err) = chat(&save, b"//fortune please\n");
    assert!(ok && !escaped.trim().is_empty(), "{err}");
    let saved = String::from_utf8_lossy(&std::fs::read(&file).unwrap()).into_owned();
    assert!(
        saved.contains("/fortune please") && !saved.contains("//fortune please"),
        "the saved conversation: {}",
        &saved[..saved.len().min(600)]
    );
}

/// Issue class 6: every flag is judged before anything is loaded. Each run names a model
/// directory that does not exist, so an error about the model means the flag was checked
/// too late (or not at all).
#[test]
fn bad_flags_are_refused_before_the_model_is_read() {
    let missing = "/nonexistent/model";
    let cases: &[(&[&str], &str)] = &[
        (
            &["generate", "--temperature", "NaN", "x"],
            "--temperature: must be a finite number ≥ 0, found NaN",
        ),
        (
            &["generate", "--temperature", "-1", "x"],
            "--temperature: must be a finite number ≥ 0, found -1",
        ),
        (
            &["generate", "--top-p", "1.5", "x"],
            "--top-p: must be in (0, 1], found 1.5",
        ),
        (
            &["generate", "--top-p", "0", "x"],
            "--top-p: must be in (0, 1], found 0",
        ),
        (
            &["generate", "--top-p", "-0.5", "x"],
            "--top-p: must be in (0, 1], found -0.5",
        ),
        (
            &["generate", "--top-p", "1e-39", "x"],
            "--top-p: must be at least 1.1754944e-38 (a normal f32), found 1e-39",
        ),
        (
            &["generate", "--chunk-size", "4", "x"],
            "--chunk-size: must be in 8…256, found 4",
        ),
        (
            &["generate", "--chunk-size", "512", "x"],
            "--chunk-size: must be in 8…256, found 512",
        ),
        (
            &["generate", "--ctx", "0", "x"],
            "--ctx: must be at least 1, found 0",
        ),
        (
            &["generate", "--device", "gpu:no-such-adapter", "x"],
            "--device gpu:no-such-adapter: GPU: no adapter named like `no-such-adapter`",
        ),
        (&["generate"], "give a prompt"),
        (
            &["perplexity", "-f", "/dev/null", "--ctx", "1"],
            "--ctx: must be at least 2, found 1",
        ),
        (
            &["perplexity", "-f", "/dev/zero"],
            "--file: /dev/zero: is not a regular file",
        ),
        (
            &[
                "perplexity",
                "-f",
                "/nonexistent/text.txt",
                "--chunk-size",
                "300",
            ],
            "--chunk-size: must be in 8…256, found 300",
        ),
        (
            &["info", "--ctx", "0"],
            "--ctx: must be at least 1, found 0",
        ),
        (
            &["chat", "--temperature", "NaN"],
            "--temperature: must be a finite number ≥ 0, found NaN",
        ),
        (
            &["chat", "--top-p", "2"],
            "--top-p: must be in (0, 1], found 2",
        ),
        (
            &["chat", "--max-tokens", "0"],
            "--max-tokens: must be at least 1, found 0",
        ),
    ];
    for (args, want) in cases {
        let mut with_model = args.to_vec();
        with_model.extend(["--model", missing]);
        let (ok, _, err) = if args[0] == "chat" {
            // Nothing on stdin: a refusal must come before the conversation starts.
            chat(&with_model[1..], b"hello\n")
        } else {
            mamba2(&with_model)
        };
        assert!(!ok, "{args:?} was accepted: {err}");
        assert!(
            err.starts_with(&format!("error: {want}")),
            "{args:?}: {err}"
        );
        assert!(
            !err.contains(missing),
            "{args:?}: the model was read first: {err}"
        );
    }
    // Flags of commands without a model: bench checks every config and count first.
    for (args, want) in [
        (
            &["bench", "--config", "tiny,no-such-preset"][..],
            "--config: unknown `no-such-preset`",
        ),
        (
            &["bench", "--config", "tiny", "--tokens", "1"],
            "--tokens: must be at least 2, found 1",
        ),
        (
            &["bench", "--device", "cpu", "--prefill", "64"],
            "--prefill: the CPU reference benchmark times f32 decode",
        ),
        (
            &["bench", "--no-decode"],
            "--no-decode: nothing left to time",
        ),
    ] {
        let (ok, out, err) = mamba2(args);
        assert!(!ok, "{args:?} was accepted: {out}");
        assert!(
            err.starts_with(&format!("error: {want}")),
            "{args:?}: {err}"
        );
        assert!(out.is_empty(), "{args:?} ran something first: {out}");
    }
    // The window commands no longer offer flags they would ignore.
    #[cfg(feature = "ui")]
    for flag in ["--chunk-size", "--ctx", "--kv", "--prefill-by-decode"] {
        let (ok, _, err) = mamba2(&["app", flag, "8"]);
        assert!(!ok && err.contains(flag), "app {flag}: {err}");
    }
}

/// Issue class 8: `auto` takes a hardware GPU, else the CPU reference — a software adapter
/// (lavapipe, the only one in CI) only with `--device gpu` — and says which in one line.
#[test]
fn auto_prefers_a_hardware_gpu_then_the_cpu_reference() {
    use mamba2_wgpu::gpu::context::{adapters, is_software};
    let infos: Vec<_> = adapters().iter().map(|a| a.get_info()).collect();
    let hardware = infos.iter().any(|i| !is_software(i));
    let (ok, _, err) = mamba2(&["generate", "-n", "2", "hello"]);
    assert!(ok, "{err}");
    let status = err.lines().last().unwrap_or_default();
    if hardware {
        assert!(!status.contains("cpu (f32 reference)"), "{err}");
        assert!(!err.contains("running on the CPU reference"), "{err}");
    } else {
        assert!(status.contains("cpu (f32 reference)"), "{err}");
        let why = if infos.is_empty() {
            "note: no GPU adapter found: running on the CPU reference".to_string()
        } else {
            format!(
                "note: only a software GPU adapter ({}) found: running on the CPU reference (use --device gpu to run on it)",
                infos
                    .iter()
                    .map(|i| i.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        assert!(err.contains(&why), "{err}");
    }
    // Asked for, a software adapter runs the model.
    if common::gpu(&Default::default()).is_some() {
        let (ok, _, err) = mamba2(&["generate", "--device", "gpu", "-n", "2", "hello"]);
        assert!(ok, "{err}");
        let status = err.lines().last().unwrap_or_default();
        assert!(!status.contains("cpu (f32 reference)"), "{err}");
        assert!(!err.contains("running on the CPU reference"), "{err}");
    }
    // An adapter that does not exist is named with the flag, before the model is read.
    let (ok, _, err) = mamba2(&[
        "generate",
        "--device",
        "gpu:99",
        "--model",
        "/nonexistent/model",
        "x",
    ]);
    assert!(!ok);
    assert!(
        err.starts_with("error: --device gpu:99: GPU: no adapter with index 99"),
        "{err}"
    );
}

#[test]
fn chunk_size_is_checked_on_the_cpu_too() {
    let (ok, _, err) = mamba2(&[
        "generate",
        "--device",
        "cpu",
        "--chunk-size",
        "4",
        "-n",
        "2",
        "hello",
    ]);
    assert!(!ok);
    assert!(
        err.starts_with("error: --chunk-size: must be in 8…256, found 4"),
        "{err}"
    );
    let (ok, _, err) = mamba2(&[
        "generate",
        "--device",
        "cpu",
        "--chunk-size",
        "8",
        "-n",
        "2",
        "hello",
    ]);
    assert!(ok, "{err}");
}

/// `chat --save` then `chat --resume` continues the conversation exactly where it was: the
/// second turn after a resume equals the second turn of one uninterrupted chat. A file
/// saved with another engine format is refused, naming the field.
#[test]
fn chat_save_and_resume_continue_the_same_conversation() {
    let dir = common::Scratch::new("chat-save");
    let file = dir.join("talk.safetensors");
    let f = file.to_str().unwrap();
    let flags = ["--device", "cpu", "-n", "8", "--temperature", "0"];
    let (ok, whole, err) = chat(&flags, b"Tell me a fortune\nAnother one\n");
    assert!(ok, "{err}");
    let mut save = flags.to_vec();
    save.extend(["--save", f]);
    let (ok, first, err) = chat(&save, b"Tell me a fortune\n");
    assert!(ok, "{err}");
    let mut resume = flags.to_vec();
    resume.extend(["--resume", f]);
    let (ok, second, err) = chat(&resume, b"Another one\n");
    assert!(ok, "{err}");
    assert!(
        err.contains("resumed") && err.contains("2 messages"),
        "{err}"
    );
    assert_eq!(format!("{first}{second}"), whole);
    // The same file on the GPU engine (another format) is refused.
    let (ok, _, err) = chat(&["--device", "gpu", "-n", "2", "--resume", f], b"hello\n");
    if !err.contains("no GPU adapter") {
        assert!(!ok);
        assert!(
            err.contains("mamba2.format") && err.contains("talk.safetensors"),
            "{err}"
        );
    }
    let (ok, _, err) = chat(&["--device", "cpu", "--resume", "/nonexistent/x"], b"");
    assert!(
        !ok && err.contains("--resume /nonexistent/x: no such file"),
        "{err}"
    );
    let (ok, _, err) = chat(&["--device", "cpu", "--resume", "/dev/zero"], b"");
    assert!(
        !ok && err.contains("--resume /dev/zero") && err.contains("not a regular file"),
        "{err}"
    );
    // --save never replaces what is not a regular file (a save renames a temporary file
    // over its path): a FIFO or a directory is refused before the conversation starts, and
    // stays what it was; through a symlink the state replaces its target, the link stays.
    let fifo = dir.join("pipe");
    common::mkfifo(&fifo);
    let d = dir.to_str().unwrap();
    let save = |path: &str| chat(&["--device", "cpu", "-n", "2", "--save", path], b"hello\n");
    for bad in [fifo.to_str().unwrap(), d] {
        let (ok, _, err) = save(bad);
        assert!(
            !ok && err.contains(&format!("--save {bad}")) && err.contains("refusing to replace"),
            "{err}"
        );
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    let is_link = |p: &std::path::Path| std::fs::symlink_metadata(p).unwrap().is_symlink();
    let (target, link) = (dir.join("target.safetensors"), dir.join("link.safetensors"));
    std::fs::write(&target, b"old").unwrap();
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let l = link.to_str().unwrap();
    let (ok, _, err) = save(l);
    assert!(ok, "{err}");
    assert!(is_link(&link));
    let saved = std::fs::metadata(&target).unwrap().len();
    assert!(saved > 3, "the target holds the state: {saved} bytes");
    let (ok, _, err) = chat(&["--device", "cpu", "-n", "1", "--resume", l], b"again\n");
    assert!(ok && err.contains("resumed"), "{err}");
    // A dangling link (relative to its directory): its target is created, the link stays.
    let (made, dangling) = (
        dir.join("new.safetensors"),
        dir.join("dangling.safetensors"),
    );
    std::os::unix::fs::symlink("new.safetensors", &dangling).unwrap();
    let (ok, _, err) = save(dangling.to_str().unwrap());
    assert!(ok, "{err}");
    assert!(is_link(&dangling));
    let made_len = std::fs::metadata(&made).unwrap().len();
    assert!(made_len > 3, "the link's target was made");
}

/// `mamba2 serve --device cpu --port 0` with `extra` flags, started: the process (its
/// stderr piped) and the address it printed.
fn serve_on_cpu(extra: &[&str]) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_mamba2"))
        .args(["serve", "--device", "cpu", "--port", "0"])
        .args(extra)
        .env("XDG_RUNTIME_DIR", "/tmp")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let Some(addr) = line.trim().strip_prefix("listening on http://") else {
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        panic!("{line} {}", String::from_utf8_lossy(&out.stderr));
    };
    (child, addr.to_string())
}

/// `mamba2 serve --port 0` prints the address it bound, answers /health there, and
/// refuses bad flags before reading the model.
#[test]
fn serve_prints_its_address_and_answers() {
    use std::io::{Read, Write};
    let (mut child, addr) = serve_on_cpu(&[]);
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("\"status\":\"ok\""), "{reply}");
    for (args, says) in [
        (
            &["serve", "--slots", "0"][..],
            "--slots: must be at least 1",
        ),
        (
            &["serve", "--cache-mem", "lots"],
            "expected a size like 512M or 4G",
        ),
        (&["serve", "--cache-dtype", "f8"], "expected f32 or f16"),
        (
            &["serve", "--api-key", "a\nb"],
            "--api-key (or MAMBA2_API_KEY): '\\n' cannot be sent in an Authorization header",
        ),
        (&["serve", "--name", " "], "--name: empty"),
        (
            &[
                "serve",
                "--device",
                "cpu",
                "--port",
                "0",
                "--cache-dir",
                concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
            ],
            concat!(
                "--cache-dir: ",
                env!("CARGO_MANIFEST_DIR"),
                "/Cargo.toml: is not a directory"
            ),
        ),
    ] {
        let (ok, _, err) = mamba2(args);
        assert!(!ok && err.contains(says), "{args:?}: {err}");
    }
}

/// `serve` says which cache flags do nothing where it runs, and what `--cache-disk 0` does
/// to the files in `--cache-dir`, rather than start as if they worked.
#[test]
fn serve_notes_the_cache_flags_it_cannot_use() {
    // Starts the server, waits for its address, stops it: its stderr.
    let started = |extra: &[&str]| {
        let (mut child, _) = serve_on_cpu(extra);
        let _ = child.kill();
        String::from_utf8_lossy(&child.wait_with_output().unwrap().stderr).into_owned()
    };
    let err = started(&["--cache-device-mem", "1G", "--cache-disk", "2G"]);
    assert!(
        err.contains("note: --cache-device-mem has no effect on the CPU reference")
            && err.contains("note: --cache-disk has no effect without --cache-dir"),
        "{err}"
    );
    let dir = std::env::temp_dir().join(format!("mamba2-cli-disk0-{}", std::process::id()));
    let err = started(&["--cache-dir", dir.to_str().unwrap(), "--cache-disk", "0"]);
    assert!(
        err.contains("note: --cache-disk 0: no prefix-cache file is kept in"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let err = started(&[]);
    assert!(!err.contains("note:"), "{err}");
}

/// Sizes from flags go through checked arithmetic: a `--ctx` near `usize::MAX` on a hybrid
/// is refused by a run command and described by `info`, and bench's token counts are
/// bounded before any sum of them is formed; never an overflow panic.
#[test]
fn huge_counts_are_refused_not_overflowed() {
    let hybrid = common::fixture("nemotron_h_hybrid");
    let h = hybrid.to_str().unwrap();
    let max = usize::MAX.to_string();
    let (ok, _, err) = mamba2(&[
        "generate",
        "-m",
        h,
        "--device",
        "cpu",
        "--ctx",
        &max,
        "-n",
        "2",
        "--prompt-ids",
        "1,2,3",
    ]);
    // (On the CPU the bound is the 32-bit positions, not an adapter's binding.)
    let says = format!("--ctx {max}: positions are counted in 32 bits: at most 2147483647");
    assert!(!ok && err.contains(&says), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (ok, out, err) = mamba2(&["info", "-m", h, "--ctx", "288230376151711743"]);
    assert!(ok && out.contains("KV cache"), "{err}");
    // bench's refusal counts its own tokens beside the --ctx asked for, and says so (on a
    // GPU: the CPU reference's bench takes no --ctx).
    if common::gpu(&Default::default()).is_some() {
        let (ok, _, err) = mamba2(&[
            "bench",
            "--device",
            "gpu",
            "--config",
            "tiny-hybrid",
            "--ctx",
            "16000000",
            "--tokens",
            "2",
        ]);
        assert!(
            !ok && err.contains("the bench needs 16000") && err.contains("--ctx 16000000 plus"),
            "{err}"
        );
    }
    let cases: [(&[&str], &str); 6] = [
        (&["--config", "tiny", "--tokens", &max], "--tokens"),
        (&["--config", "tiny", "--warmup", &max], "--warmup"),
        (&["--config", "tiny-hybrid", "--ctx", &max], "--ctx"),
        (
            &["--config", "tiny", "--cached-prefix", &max],
            "--cached-prefix",
        ),
        (
            &["--config", "tiny", "--no-decode", "--prefill", &max],
            "--prefill",
        ),
        (
            &["--config", "tiny", "--batch", "4", "--prefill-runs", &max],
            "--prefill-runs",
        ),
    ];
    for (flags, flag) in cases {
        let mut args = vec!["bench"];
        args.extend(flags);
        let (ok, _, err) = mamba2(&args);
        assert!(
            !ok && err.contains(&format!("{flag}: at most 16777216")) && err.contains(&max),
            "{args:?}: {err}"
        );
    }
}

/// `generate --prompt-ids` with a model that has a tokenizer (the embedded one) stops at
/// its end of text as a text prompt does (it used to run on past it: the ids path dropped
/// the tokenizer, and with it the stop token); `--ignore-eos` still runs on.
#[test]
fn generate_prompt_ids_stops_at_the_end_of_text() {
    let run = |extra: &[&str]| {
        let args = [
            &[
                "generate",
                "--device",
                "cpu",
                "--prompt-ids",
                "1",
                "-n",
                "300",
            ][..],
            extra,
        ]
        .concat();
        let (ok, out, err) = mamba2(&args);
        assert!(ok, "{err}");
        (out, err)
    };
    let (out, err) = run(&[]);
    assert!(err.contains(", Stop,"), "{err}");
    let (long, err) = run(&["--ignore-eos"]);
    assert!(
        err.contains("300 generated tokens") && err.contains(", Length,"),
        "{err}"
    );
    assert!(long.trim().starts_with(out.trim()), "{out}\n{long}");
}

/// A message that does not fit the context (a hybrid's KV cache, `--ctx`) is not sent, and
/// the error says how to go on; the conversation then goes on from where it was.
#[test]
fn chat_says_how_to_go_on_when_the_context_is_full() {
    let dir = common::Scratch::new("cli-ctx-full");
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/nemotron_h_hybrid");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    // A word-level tokenizer of the fixture's 101 tokens.
    let vocab: serde_json::Map<String, serde_json::Value> = ["<unk>", "a", "b", "c", "d"]
        .into_iter()
        .map(String::from)
        .chain((5..101).map(|i| format!("t{i}")))
        .enumerate()
        .map(|(i, w)| (w, i.into()))
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let model = dir.to_str().unwrap();
    let flags = ["--model", model, "--device", "cpu", "--ctx", "8", "-n", "2"];
    // A message longer than the context alone: a new conversation would not help. Then one
    // that fits alone but not after the first turn.
    let (ok, out, err) = chat(&flags, b"a b c d a b c d a b c d\nb a\na b c d a\n");
    assert!(
        err.contains("the context is full")
            && err.contains(
                "nothing was sent: this message alone takes 12 of the 8-token context, leaving \
                 no room for a reply: run with a larger --ctx"
            ),
        "{err}"
    );
    assert!(
        err.contains("[2 new tokens fed, 2 generated"),
        "the next message is answered from an empty state: {err}"
    );
    assert!(
        err.contains("nothing was sent: /reset starts a new conversation"),
        "{err}"
    );
    assert!(!out.trim().is_empty(), "{err}");
    assert!(!ok, "a line failed: {err}");
}

/// A command whose output cannot be written (stdout full, or a pipe closed early) fails
/// with an error naming stdout, not a panic.
#[test]
fn output_that_cannot_be_written_is_an_error_not_a_panic() {
    for args in [
        &["info"][..],
        &["devices"],
        &[
            "bench", "--device", "cpu", "--config", "tiny", "--tokens", "2",
        ],
        &[
            "bench", "--device", "cpu", "--config", "tiny", "--tokens", "2", "--json",
        ],
    ] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_mamba2"))
            .args(args)
            .env("XDG_RUNTIME_DIR", "/tmp")
            .stdout(full)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains("error: writing to stdout: No space left on device")
                && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}

/// What a command cannot do is said, not skipped: the CPU bench of a hybrid preset refuses
/// more tokens than its context holds (it stopped short and reported the tokens asked, or
/// NaN), and `--profile-tokens`, which the CPU has no timestamps for; `generate` notes
/// sampling flags that greedy decoding ignores.
#[test]
fn bench_and_generate_say_what_they_do_not_do() {
    let bench = |extra: &[&str]| {
        mamba2(
            &[
                &["bench", "--device", "cpu", "--config", "tiny-hybrid"][..],
                extra,
            ]
            .concat(),
        )
    };
    let (ok, _, err) = bench(&["--tokens", "2", "--warmup", "5000"]);
    assert!(
        !ok && err.contains("--warmup 5000 + --tokens 2 need 5004"),
        "{err}"
    );
    let (ok, out, err) = bench(&["--tokens", "3", "--warmup", "1"]);
    assert!(ok && out.contains("median over 3 tokens"), "{out} {err}");
    let (ok, _, err) = bench(&["--tokens", "2", "--profile-tokens", "5"]);
    assert!(
        !ok && err.contains("--profile-tokens: the CPU reference"),
        "{err}"
    );
    let (ok, _, err) = bench(&["--tokens", "2", "--profile-tokens", "0"]);
    assert!(ok, "asking for no profile is what the CPU does: {err}");
    assert!(!err.contains("no effect"), "{err}");
    let (ok, _, err) = bench(&["--tokens", "2", "--prefill-runs", "2", "--new-tokens", "4"]);
    assert!(
        ok && err.contains(
            "note: --prefill-runs has no effect without --prefill, --cached-prefix or --batch"
        ) && err.contains("note: --new-tokens has no effect without --cached-prefix"),
        "{err}"
    );

    let (ok, _, err) = mamba2(&[
        "generate", "--device", "cpu", "-n", "2", "--top-k", "5", "--seed", "3", "Hi",
    ]);
    assert!(
        ok && err.contains("note: --top-k, --seed have no effect at --temperature 0"),
        "{err}"
    );
    let (ok, _, err) = mamba2(&["generate", "--device", "cpu", "-n", "2", "Hi"]);
    assert!(ok && !err.contains("no effect"), "{err}");
}
