//! Regression tests for the classes of hostile input a campaign against the CLI found
//! (issue "No input may panic, hang, exhaust memory or silently succeed"): each input is
//! refused with an error naming the field, tensor, file or flag at fault.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mamba2_wgpu::DeviceChoice;
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::synthetic::tiny_config;

/// A fresh directory under the target dir, removed first if it exists.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("hostile_input")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn saved_model(name: &str) -> PathBuf {
    let dir = scratch(name);
    Model::synthetic(tiny_config(2, 6), 1).save(&dir).unwrap();
    dir
}

fn load_err(dir: &Path) -> String {
    Model::load(dir).unwrap_err().to_string()
}

/// A safetensors file with the header `json` (tensor name → (dtype, shape)), laid out
/// contiguously in the given order, its data `fill` bytes or a hole (`None`: a sparse file
/// that takes no disk space, for models larger than the machine).
fn write_safetensors(path: &Path, tensors: &[(String, &str, Vec<usize>)], fill: Option<u8>) {
    let mut header = String::from("{");
    let mut offset = 0usize;
    for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
        let size = if *dtype == "F32" { 4 } else { 2 };
        let len = size * shape.iter().product::<usize>();
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{offset},{}]}}"#,
            offset + len
        ));
        offset += len;
    }
    header.push('}');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    match fill {
        Some(b) => {
            bytes.resize(bytes.len() + offset, b);
            std::fs::write(path, bytes).unwrap();
        }
        None => {
            std::fs::write(path, &bytes).unwrap();
            let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            file.set_len((bytes.len() + offset) as u64).unwrap();
        }
    }
}

/// The HF `mamba2` tensors of a model of width `d`, `layers` layers, `H` heads of 64,
/// N = 128, G = 1, K = 4, vocabulary `v`, untied.
fn hf_mamba2_tensors(
    d: usize,
    layers: usize,
    h: usize,
    v: usize,
) -> Vec<(String, &'static str, Vec<usize>)> {
    let (di, n) = (64 * h, 128);
    let conv_dim = di + 2 * n;
    let mut t = vec![("backbone.embeddings.weight".to_string(), "BF16", vec![v, d])];
    for i in 0..layers {
        let p = |s: &str| format!("backbone.layers.{i}.{s}");
        t.extend([
            (p("norm.weight"), "BF16", vec![d]),
            (
                p("mixer.in_proj.weight"),
                "BF16",
                vec![2 * di + 2 * n + h, d],
            ),
            (p("mixer.conv1d.weight"), "BF16", vec![conv_dim, 1, 4]),
            (p("mixer.conv1d.bias"), "BF16", vec![conv_dim]),
            (p("mixer.dt_bias"), "BF16", vec![h]),
            (p("mixer.A_log"), "BF16", vec![h]),
            (p("mixer.D"), "BF16", vec![h]),
            (p("mixer.norm.weight"), "BF16", vec![di]),
            (p("mixer.out_proj.weight"), "BF16", vec![d, di]),
        ]);
    }
    t.push(("backbone.norm_f.weight".into(), "BF16", vec![d]));
    t.push(("lm_head.weight".into(), "BF16", vec![v, d]));
    t
}

fn hf_mamba2_config(d: usize, layers: usize, h: usize, v: usize) -> String {
    format!(
        r#"{{"model_type":"mamba2","hidden_size":{d},"num_hidden_layers":{layers},"vocab_size":{v},
        "num_heads":{h},"head_dim":64,"state_size":128,"n_groups":1,"expand":{},"tie_word_embeddings":false}}"#,
        64 * h / d
    )
}

/// An HF `mamba2` model of the given shape whose weights are a hole in a sparse file.
fn sparse_model(name: &str, d: usize, layers: usize, h: usize, v: usize) -> (PathBuf, Model) {
    let dir = scratch(name);
    std::fs::write(dir.join("config.json"), hf_mamba2_config(d, layers, h, v)).unwrap();
    write_safetensors(
        &dir.join("model.safetensors"),
        &hf_mamba2_tensors(d, layers, h, v),
        None,
    );
    let model = Model::load(&dir).expect("the checkpoint itself is valid");
    (dir, model)
}

/// The error opening `model` on `device` gives (it must not be admitted).
fn refusal(model: &Model, device: &DeviceChoice) -> String {
    match mamba2_wgpu::open_backend(model, device, Default::default(), &mut |_| {}) {
        Ok(_) => panic!("a model larger than the machine was admitted on {device:?}"),
        Err(e) => e.to_string(),
    }
}

// Class 1: sizes from configs go through bounds and checked arithmetic.
#[test]
fn config_sizes_that_would_wrap_name_the_field() {
    let dir = saved_model("huge_fields");
    let base = r#"{"model_type":"mamba2","hidden_size":48,"num_hidden_layers":2,"vocab_size":77,
        "num_heads":8,"head_dim":12,"state_size":12,"n_groups":2,"chunk_size":16,"tie_word_embeddings":false,EXTRA}"#;
    let cases = [
        // 2^63 + 16 passed every check and then overflowed.
        (
            r#""state_size":9223372036854775824"#,
            "`state_size`: 9223372036854775824 is too large",
        ),
        (
            r#""chunk_size":4294967296"#,
            "`chunk_size`: 4294967296 is too large",
        ),
        (
            r#""chunk_size":1000000"#,
            "`chunk_size`: 1000000 is over the 4096",
        ),
        (r#""hidden_size":1e20"#, "`hidden_size`: 1e+20 is too large"),
        (
            r#""num_hidden_layers":1000000000"#,
            "`num_hidden_layers`: 1000000000 layers is over the 4096",
        ),
        (
            r#""vocab_size":4194304,"hidden_size":4096,"expand":0.1875"#,
            "`vocab_size`: embedding / lm_head would hold 17179869184 values",
        ),
        (r#""expand":1e300"#, "`expand`: expand × hidden_size"),
        (
            r#""hidden_size":65536,"expand":16,"num_heads":16384,"head_dim":64,"state_size":4096,"n_groups":1"#,
            "`hidden_size`: in_proj would hold",
        ),
    ];
    for (extra, want) in cases {
        // Later keys win in serde_json: the case's values replace the base's.
        let text = base.replace("EXTRA", extra);
        std::fs::write(dir.join("config.json"), &text).unwrap();
        let e = load_err(&dir);
        assert!(e.contains(want), "{extra}\n  gave: {e}\n  want: {want}");
        assert!(e.contains("config.json"), "names the file: {e}");
    }
}

// Class 2: a model larger than the machine is refused with its sizes before allocation.
#[test]
fn a_model_larger_than_the_machine_is_refused_with_sizes() {
    // ~420 G parameters: 840 GB of bf16 in a sparse file (no disk used), 1.7 TB as the CPU
    // reference's f32 copies — more than any machine the tests run on.
    let (dir, model) = sparse_model("larger_than_the_machine", 16384, 256, 512, 65536);
    let start = Instant::now();
    let e = refusal(&model, &DeviceChoice::Cpu);
    assert!(
        e.contains("the model needs 1.")
            && e.contains("(weights 1.")
            && e.contains("of host memory on --device cpu, but only"),
        "{e}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "refused before converting"
    );
    drop(model);
    let _ = std::fs::remove_dir_all(&dir);

    // On a GPU adapter (lavapipe in CI: its device memory is host memory) too.
    if mamba2_wgpu::gpu::context::adapters().is_empty() {
        assert!(
            std::env::var_os("MAMBA2_REQUIRE_GPU").is_none(),
            "no GPU adapter"
        );
        eprintln!("SKIPPED the GPU half: no GPU adapter (set MAMBA2_REQUIRE_GPU=1 to fail)");
        return;
    }
    // Every matrix within lavapipe's 128 MiB binding, 4096 layers: 420 GB in f16.
    let (dir, model) = sparse_model("larger_than_the_device", 4096, 4096, 64, 8192);
    let start = Instant::now();
    let e = refusal(&model, &DeviceChoice::Gpu(None));
    drop(model);
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("GPU refusal: {e}");
    // A hardware GPU cannot be asked its capacity; a software one shares host memory.
    let software = mamba2_wgpu::gpu::context::pick_adapter(&DeviceChoice::Gpu(None))
        .unwrap()
        .is_some_and(|a| mamba2_wgpu::gpu::context::is_software(&a.get_info()));
    if software {
        assert!(
            e.contains("the model needs 4")
                && e.contains("GiB (weights 39")
                && e.contains("of memory on llvmpipe"),
            "{e}"
        );
    } else {
        assert!(
            e.contains("GiB") || e.contains("out of device memory"),
            "names the sizes: {e}"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "refused before uploading"
    );
}

// Class 4: only regular files are opened; shard names stay inside the model directory.
#[test]
fn fifos_devices_and_escaping_shards_are_refused() {
    let dir = saved_model("fifo");
    let weights = dir.join("model.safetensors");
    std::fs::remove_file(&weights).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&weights)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    let e = load_err(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains("not a regular file"),
        "{e}"
    );

    // A config.json that is a device reads nothing forever.
    let dir = saved_model("device_config");
    let config = dir.join("config.json");
    std::fs::remove_file(&config).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &config).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("config.json") && e.contains("not a regular file"),
        "{e}"
    );

    // An index naming a shard outside the directory.
    let dir = saved_model("escaping_shard");
    let outside = dir.parent().unwrap().join("other");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::copy(
        dir.join("model.safetensors"),
        outside.join("model.safetensors"),
    )
    .unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    for name in ["../other/model.safetensors", "/etc/passwd"] {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            format!(r#"{{"weight_map": {{"backbone.norm_f.weight": "{name}"}}}}"#),
        )
        .unwrap();
        let e = load_err(&dir);
        assert!(
            e.contains("model.safetensors.index.json")
                && e.contains("weight_map.backbone.norm_f.weight")
                && e.contains("leaves the model directory"),
            "{e}"
        );
    }
}

// Class 7: a name repeated inside one file, and headers whose sizes do not add up.
#[test]
fn tensors_repeated_or_misdescribed_in_one_file_are_named() {
    let dir = saved_model("duplicate_in_one_file");
    let weights = dir.join("model.safetensors");
    let t = |n: &str, shape: Vec<usize>| (n.to_string(), "F32", shape);
    write_safetensors(
        &weights,
        &[
            t("backbone.norm_f.weight", vec![24]),
            t("backbone.norm_f.weight", vec![24]),
        ],
        Some(0),
    );
    let e = load_err(&dir);
    assert!(
        e.contains("tensor `backbone.norm_f.weight`") && e.contains("appears twice in the header"),
        "{e}"
    );

    // A shape that needs more bytes than its offsets hold: the crate's own error does
    // not say which tensor.
    let header = r#"{"a.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"backbone.norm_f.weight":{"dtype":"F32","shape":[24],"data_offsets":[8,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + 16, 0);
    std::fs::write(&weights, bytes).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("tensor `backbone.norm_f.weight`") && e.contains("needs 96 bytes"),
        "{e}"
    );
}

// A chat template comes with the model: one that would loop for ever is an error.
#[test]
fn a_chat_template_that_never_ends_is_an_error() {
    let bytes =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer.json")).unwrap();
    let config = serde_json::json!({
        "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    });
    let tok = mamba2_wgpu::Tokenizer::from_bytes(&bytes, Some(&config)).unwrap();
    let start = Instant::now();
    let e = tok
        .render_chat(&[("user".into(), "hi".into())], true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("chat template") && e.contains("fuel"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

// One that would write hundreds of MB in one instruction (a repeated list printed: it
// allocated 268 MB before its fuel was charged; the fuzz harness found it) is stopped at
// the output cap, one that builds them runs out of fuel.
#[test]
fn a_chat_template_that_writes_hundreds_of_megabytes_is_an_error() {
    let bytes =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tokenizer.json")).unwrap();
    for template in ["{{ messages * 1000000 }}", "{{ 'x' * 99999999 }}"] {
        let config = serde_json::json!({ "chat_template": template });
        let tok = mamba2_wgpu::Tokenizer::from_bytes(&bytes, Some(&config)).unwrap();
        let e = tok
            .render_chat(&[("user".into(), "hi".into())], true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("chat template") && (e.contains("fuel") || e.contains("more than 16 MiB")),
            "{template}: {e}"
        );
    }
}

// Class 3: ids enter every backend through one check, whoever calls it.
#[test]
fn ids_outside_the_vocabulary_are_refused_by_every_backend() {
    let model = Model::synthetic(tiny_config(2, 6), 1);
    let mut devices = vec![DeviceChoice::Cpu];
    if mamba2_wgpu::gpu::context::adapters().is_empty() {
        assert!(
            std::env::var_os("MAMBA2_REQUIRE_GPU").is_none(),
            "no GPU adapter"
        );
        eprintln!("SKIPPED the GPU backend: no GPU adapter (set MAMBA2_REQUIRE_GPU=1 to fail)");
    } else {
        devices.push(DeviceChoice::Gpu(None));
    }
    let greedy = mamba2_wgpu::Sampling::greedy();
    for device in devices {
        let mut b =
            mamba2_wgpu::open_backend(&model, &device, Default::default(), &mut |_| {}).unwrap();
        let want = "token id 77 is outside the vocabulary (size 77)";
        let e = b
            .prefill_sample(&[1, 77], &greedy, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{device:?}: {e}");
        let e = b.prefill_logits(&[77]).unwrap_err().to_string();
        assert!(e.contains(want), "{device:?}: {e}");
        let e = b
            .decode(u32::MAX, 1, 4, &greedy, &[], &mut |_| true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("token id 4294967295 is outside"),
            "{device:?}: {e}"
        );
        let e = b.prefill_logits(&[]).unwrap_err().to_string();
        assert!(e.contains("no tokens to feed"), "{device:?}: {e}");
        // Nothing was fed: the backend still works.
        b.prefill_sample(&[1, 2], &greedy, 2).unwrap();
    }
}
