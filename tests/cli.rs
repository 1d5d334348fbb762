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

fn oracle_ids(name: &str, tensor: &str) -> Vec<u32> {
    let bytes = std::fs::read(common::fixture(name).join("oracle.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(tensor)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn generate_prompt_ids_on_every_device() {
    for name in ["nemotron_h_g2", "nemotron_h_hybrid"] {
        generate_fixture_greedy(name);
    }
}

/// The oracle's 24 greedy ids from `mamba2 generate` on the CPU and the GPU (f32).
fn generate_fixture_greedy(name: &str) {
    let dir = common::fixture(name);
    let (prompt, greedy) = (
        oracle_ids(name, "prompt_ids"),
        oracle_ids(name, "greedy_ids"),
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
    let (ok, _, err) = mamba2(&["info", "--model", "/nonexistent/model"]);
    assert!(!ok);
    assert!(
        err.starts_with("error: /nonexistent/model: no config.json or params.json"),
        "{err}"
    );
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

#[test]
fn chat_survives_a_line_that_is_not_utf8() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_mamba2"))
        .args(["chat", "--device", "cpu", "-n", "3"])
        .env("XDG_RUNTIME_DIR", "/tmp")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"\xff\xfe oops\nTell me a fortune\n/quit\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("that line is not valid UTF-8 (byte 0); nothing was sent"),
        "{err}"
    );
    assert!(
        !String::from_utf8_lossy(&out.stdout).trim().is_empty(),
        "the next line was answered"
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
        err.contains("chunk size must be in 8…256, found 4"),
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
