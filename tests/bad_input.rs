//! Bad input gets a clear error naming the file, field or tensor — never a panic.

use std::path::{Path, PathBuf};

use mamba2_wgpu::model::synthetic::tiny_config;
use mamba2_wgpu::model::{Model, Tensor};
use mamba2_wgpu::{CpuBackend, CpuModel, GenerateOptions, Session};

/// A fresh directory under the target dir, removed first if it exists.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("bad_input")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn saved_model(name: &str) -> (PathBuf, Model) {
    let dir = scratch(name);
    let model = Model::synthetic(tiny_config(2, 6), 1);
    model.save(&dir).unwrap();
    (dir, model)
}

fn load_err(dir: &Path) -> String {
    Model::load(dir).unwrap_err().to_string()
}

/// Rewrites the model's safetensors with `edit` applied to its tensor list.
fn resave(dir: &Path, model: &Model, edit: impl FnOnce(&mut Vec<Tensor>)) {
    let mut tensors: Vec<Tensor> = model.weights.all().into_iter().cloned().collect();
    edit(&mut tensors);
    let refs: Vec<&Tensor> = tensors.iter().collect();
    mamba2_wgpu::model::safetensors::write_safetensors(&dir.join("model.safetensors"), &refs)
        .unwrap();
}

#[test]
fn a_good_model_loads() {
    let (dir, model) = saved_model("good");
    let loaded = Model::load(&dir).unwrap();
    assert_eq!(loaded.config, model.config);
    assert_eq!(
        loaded.weights.layers[1].out_proj.to_f32(),
        model.weights.layers[1].out_proj.to_f32()
    );
}

#[test]
fn truncated_safetensors() {
    let (dir, _) = saved_model("truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model.safetensors: not a valid safetensors file (truncated or corrupt?)"),
        "{e}"
    );
}

#[test]
fn corrupt_header() {
    let (dir, _) = saved_model("corrupt");
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..16].copy_from_slice(b"{garbage");
    std::fs::write(&path, &bytes).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("not a valid safetensors file") && e.contains("invalid JSON in header"),
        "{e}"
    );
    // A file shorter than the 8-byte header length.
    std::fs::write(&path, b"abc").unwrap();
    assert!(load_err(&dir).contains("header too small"));
}

#[test]
fn missing_tensor() {
    let (dir, model) = saved_model("missing");
    resave(&dir, &model, |t| {
        t.retain(|t| t.name != "backbone.layers.1.mixer.dt_bias")
    });
    assert_eq!(
        load_err(&dir),
        "tensor `backbone.layers.1.mixer.dt_bias`: missing from the checkpoint"
    );
}

#[test]
fn wrong_shape() {
    let (dir, model) = saved_model("shape");
    resave(&dir, &model, |t| {
        let i = t
            .iter()
            .position(|t| t.name == "backbone.layers.0.mixer.in_proj.weight")
            .unwrap();
        let values = vec![0.0f32; 10 * 24];
        t[i] = Tensor::from_f32(
            "backbone.layers.0.mixer.in_proj.weight",
            vec![10, 24],
            &values,
        );
    });
    let e = load_err(&dir);
    let (rows, d) = (model.config.d_in_proj(), model.config.d_model);
    assert_eq!(d, 24);
    assert_eq!(
        e,
        format!(
            "tensor `backbone.layers.0.mixer.in_proj.weight`: expected shape [{rows}, {d}], found [10, 24]"
        )
    );
}

#[test]
fn extra_tensor() {
    let (dir, model) = saved_model("extra");
    resave(&dir, &model, |t| {
        t.push(Tensor::from_f32(
            "backbone.layers.0.mixer.in_proj.bias",
            vec![2],
            &[0.0, 1.0],
        ))
    });
    assert_eq!(
        load_err(&dir),
        "tensor `backbone.layers.0.mixer.in_proj.bias`: unexpected tensor: not part of a Mamba2 model"
    );
    resave(&dir, &model, |t| {
        t.push(Tensor::from_f32(
            "backbone.layers.7.norm.weight",
            vec![2],
            &[0.0, 1.0],
        ))
    });
    assert_eq!(
        load_err(&dir),
        "tensor `backbone.layers.7.norm.weight`: layer 7 does not exist: the config has 2 layers"
    );
}

#[test]
fn missing_untied_head() {
    let (dir, model) = saved_model("head");
    assert!(
        model.weights.lm_head.is_some(),
        "G = 2 tiny config is untied"
    );
    resave(&dir, &model, |t| t.retain(|t| t.name != "lm_head.weight"));
    assert!(load_err(&dir).starts_with("tensor `lm_head.weight`: missing from the checkpoint"));
}

#[test]
fn malformed_and_unsupported_configs() {
    let (dir, _) = saved_model("config");
    let config = dir.join("config.json");
    let cases = [
        (
            "{\"model_type\": \"mamba2\",",
            "config.json: not valid JSON",
        ),
        (
            r#"{"model_type":"mamba2","hidden_size":48,"num_hidden_layers":2,"vocab_size":-3}"#,
            "field `vocab_size`: expected a non-negative integer, found -3",
        ),
        (
            r#"{"model_type":"mamba2","hidden_size":48,"num_hidden_layers":2,"vocab_size":77,"num_heads":8,"head_dim":12,"time_step_limit":[0.0]}"#,
            "field `time_step_limit`: expected [min, max], found [0.0]",
        ),
        (
            r#"{"model_type":"mamba2","hidden_size":48,"num_hidden_layers":2,"vocab_size":77,"num_heads":8,"head_dim":12,"use_bias":true}"#,
            "not supported yet: ",
        ),
        (r#"{"model_type":"gpt2"}"#, "not supported yet: "),
        (
            r#"[1, 2]"#,
            "config.json: expected a JSON object at the top level",
        ),
    ];
    for (text, want) in cases {
        std::fs::write(&config, text).unwrap();
        let e = load_err(&dir);
        assert!(e.contains(want), "{text}\n  gave: {e}\n  want: {want}");
        assert!(e.contains("config.json"), "the error names the file: {e}");
    }
    std::fs::remove_file(&config).unwrap();
    assert!(load_err(&dir).contains("no config.json or params.json"));
}

#[test]
fn empty_directory_and_missing_shard() {
    let dir = scratch("empty");
    assert!(load_err(&dir).contains("no config.json or params.json"));
    let (dir, model) = saved_model("shards");
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"backbone.norm_f.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("No such file"),
        "{e}"
    );
    let _ = model;
}

#[test]
fn empty_prompt_and_bad_sampling() {
    let model = Model::synthetic(tiny_config(1, 8), 1);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights);
    let mut s = Session::new(Box::new(CpuBackend::new(cpu)));
    let e = s
        .generate(&[], &GenerateOptions::default(), |_| true)
        .unwrap_err();
    assert_eq!(e.to_string(), "invalid input: the prompt is empty");
    let mut opts = GenerateOptions::default();
    opts.sampling.top_p = 1.5;
    let e = s.generate(&[1], &opts, |_| true).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: top-p must be in (0, 1], found 1.5"
    );
    let e = s
        .generate(&[1, 99], &GenerateOptions::default(), |_| true)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid input: token id 99 is outside the vocabulary (size 77)"
    );
}
