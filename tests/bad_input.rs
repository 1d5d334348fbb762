//! Bad input gets a clear error naming the file, field or tensor — never a panic.

use std::path::{Path, PathBuf};

use mamba2_wgpu::model::synthetic::{tiny_config, tiny_hybrid};
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
    let mut tensors: Vec<Tensor> = model.weights.checkpoint().into_iter().cloned().collect();
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
    let out_proj = |m: &Model| {
        m.weights.layers[1]
            .mixer
            .mamba()
            .expect("a Mamba2 layer")
            .out_proj
            .to_f32()
    };
    assert_eq!(out_proj(&loaded), out_proj(&model));
}

#[test]
fn truncated_safetensors() {
    let (dir, _) = saved_model("truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(&dir);
    // The crate's own error does not say which tensor runs past the end; ours does.
    assert!(
        e.contains("tensor `lm_head.weight`")
            && e.contains("model.safetensors: data_offsets")
            && e.contains("fall outside the"),
        "{e}"
    );
}

#[test]
fn reversed_data_offsets_are_named_as_such() {
    let (dir, _) = saved_model("reversed");
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let offsets = &mut header["lm_head.weight"]["data_offsets"];
    let (a, b) = (offsets[0].clone(), offsets[1].clone());
    *offsets = serde_json::json!([b, a]);
    // The same digits swapped: the header keeps its length.
    let text = serde_json::to_vec(&header).unwrap();
    assert!(text.len() <= n);
    bytes[8..8 + n].fill(b' ');
    bytes[8..8 + text.len()].copy_from_slice(&text);
    std::fs::write(&path, &bytes).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("tensor `lm_head.weight`") && e.contains("end before they start"),
        "{e}"
    );
}

/// Tensors whose data overlap, or leave bytes between them, are named (the one that does not
/// fit, the same one every run), not a neighbour the safetensors crate happens to meet.
#[test]
fn overlapping_or_gapped_tensors_are_named() {
    let (dir, _) = saved_model("overlap");
    let path = dir.join("model.safetensors");
    let original = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&original[8..8 + n]).unwrap();
    let rewrite = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut h = header.clone();
        edit(&mut h);
        let text = serde_json::to_vec(&h).unwrap();
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend(&text);
        out.extend(&original[8 + n..]);
        std::fs::write(&path, out).unwrap();
        load_err(&dir)
    };
    let offsets = |h: &serde_json::Value, name: &str| h[name]["data_offsets"].clone();
    // A second name over the embedding's bytes; a small tensor inside another's.
    let embedding = "backbone.embeddings.weight";
    for _ in 0..3 {
        let e = rewrite(&|h| {
            let o = offsets(h, embedding);
            let shape = h[embedding]["shape"].clone();
            h["zz_alias"] = serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": o});
        });
        assert!(
            e.contains("tensor `zz_alias`") && e.contains("overlap"),
            "{e}"
        );
    }
    let e = rewrite(&|h| {
        let start = offsets(h, embedding)[0].as_u64().unwrap();
        h["junk"] =
            serde_json::json!({"dtype": "F32", "shape": [1], "data_offsets": [start, start + 4]});
    });
    assert!(e.contains("tensor `junk`") && e.contains("overlap"), "{e}");
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
        "tensor `backbone.layers.0.mixer.in_proj.bias`: unexpected tensor: not part of a supported model"
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
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
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

/// A tiny Nemotron-H hybrid saved as `save_pretrained` would name it.
fn saved_hybrid(name: &str) -> (PathBuf, Model) {
    let dir = scratch(name);
    let model = Model::synthetic(tiny_hybrid("M*-M", 2), 1);
    model.save(&dir).unwrap();
    (dir, model)
}

#[test]
fn a_hybrid_round_trips_and_its_tensors_are_checked() {
    let (dir, model) = saved_hybrid("hybrid");
    let loaded = Model::load(&dir).unwrap();
    assert_eq!(loaded.config, model.config);
    assert_eq!(loaded.config.pattern(), "M*-M");
    // An attention weight of the wrong shape, a missing MLP weight, an attention tensor
    // in a Mamba layer: each error names the tensor.
    resave(&dir, &model, |t| {
        let i = t
            .iter()
            .position(|t| t.name == "backbone.layers.1.mixer.k_proj.weight")
            .unwrap();
        t[i] = Tensor::from_f32(t[i].name.clone(), vec![8, 32], &[0.0; 8 * 32]);
    });
    let e = load_err(&dir);
    assert!(
        e.contains(
            "tensor `backbone.layers.1.mixer.k_proj.weight`: expected shape [16, 32], found [8, 32]"
        ),
        "{e}"
    );
    // Multi-token-prediction tensors (`mtp.*`, as Nemotron-H checkpoints may carry) are
    // skipped, as transformers skips them.
    resave(&dir, &model, |t| {
        t.push(Tensor::from_f32(
            "mtp.layers.0.mixer.in_proj.weight",
            vec![2, 2],
            &[0.0; 4],
        ))
    });
    assert_eq!(Model::load(&dir).unwrap().config, model.config);
    resave(&dir, &model, |t| {
        t.retain(|t| t.name != "backbone.layers.2.mixer.down_proj.weight")
    });
    assert!(
        load_err(&dir).starts_with(
            "tensor `backbone.layers.2.mixer.down_proj.weight`: missing from the checkpoint"
        ),
        "{}",
        load_err(&dir)
    );
    resave(&dir, &model, |t| {
        let q = t
            .iter()
            .find(|t| t.name == "backbone.layers.1.mixer.q_proj.weight")
            .unwrap()
            .clone();
        t.push(Tensor::from_f32(
            "backbone.layers.0.mixer.q_proj.weight",
            q.shape.clone(),
            &q.to_f32(),
        ));
    });
    let e = load_err(&dir);
    assert!(
        e.contains("backbone.layers.0.mixer.q_proj.weight")
            && e.contains("layer 0 is a mamba2 layer"),
        "{e}"
    );
}

#[test]
fn bad_hybrid_configs_name_the_field() {
    let (dir, _) = saved_hybrid("hybrid_config");
    let config = dir.join("config.json");
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    let with = |key: &str, v: serde_json::Value| {
        let mut c = good.clone();
        c[key] = v;
        c.to_string()
    };
    let cases = [
        (
            with("num_key_value_heads", 3.into()),
            "field `num_key_value_heads`: 4 attention heads cannot share 3 key/value heads evenly",
        ),
        (
            with("hybrid_override_pattern", "M*-X".into()),
            "field `hybrid_override_pattern`: layer 3 has the unknown block type `X`",
        ),
        (
            with("hybrid_override_pattern", "M*E-".into()),
            "field `n_routed_experts`: missing",
        ),
        (
            with("num_attention_heads", 0.into()),
            "field `num_attention_heads`: must be positive",
        ),
        (
            with("mlp_hidden_act", "gelu".into()),
            "`mlp_hidden_act`: the MLP activation `gelu`",
        ),
        (
            with("num_hidden_layers", 7.into()),
            "field `hybrid_override_pattern`: describes 4 layers but num_hidden_layers is 7",
        ),
    ];
    for (text, want) in cases {
        std::fs::write(&config, &text).unwrap();
        let e = load_err(&dir);
        assert!(e.contains(want), "{text}\n  gave: {e}\n  want: {want}");
        assert!(e.contains("config.json"), "the error names the file: {e}");
    }
}

/// A copy of a fixture in a scratch directory.
fn fixture_copy(fixture: &str, name: &str) -> PathBuf {
    let dir = scratch(name);
    let from = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(from.join(f), dir.join(f)).unwrap();
    }
    dir
}

#[test]
fn moe_checkpoints_and_configs_are_checked() {
    // A missing expert names its layer and expert; a stacked Granite tensor its layer.
    let dir = fixture_copy("nemotron_h_moe", "moe_missing_expert");
    let model = Model::load(&dir).unwrap();
    resave(&dir, &model, |t| {
        t.retain(|t| t.name != "backbone.layers.3.mixer.experts.7.up_proj.weight")
    });
    let e = load_err(&dir);
    assert!(
        e.starts_with("tensor `backbone.layers.3.mixer.experts.7.up_proj.weight`: missing"),
        "{e}"
    );
    resave(&dir, &model, |t| {
        let x = t
            .iter()
            .find(|t| t.name == "backbone.layers.3.mixer.experts.7.up_proj.weight")
            .unwrap()
            .clone();
        t.push(Tensor::from_f32(
            "backbone.layers.3.mixer.experts.16.up_proj.weight",
            x.shape.clone(),
            &x.to_f32(),
        ));
    });
    let e = load_err(&dir);
    assert!(
        e.contains("experts.16.up_proj.weight") && e.contains("unexpected tensor"),
        "{e}"
    );
    let dir = fixture_copy("granite_moe_hybrid", "granite_missing_experts");
    let model = Model::load(&dir).unwrap();
    resave(&dir, &model, |t| {
        t.retain(|t| {
            !t.name
                .starts_with("model.layers.2.block_sparse_moe.input_linear")
        })
    });
    let e = load_err(&dir);
    assert!(
        e.starts_with("tensor `model.layers.2.block_sparse_moe.input_linear.weight`: missing"),
        "{e}"
    );
    // Configs: too many experts per token, a latent MoE, Granite with several Mamba groups or
    // scaled rotary embeddings (either spelling).
    for (fixture, key, value, want) in [
        (
            "nemotron_h_moe",
            "num_experts_per_tok",
            serde_json::json!(17),
            "field `num_experts_per_tok`: num_experts_per_tok 17 is not within 1..=16",
        ),
        (
            "nemotron_h_moe",
            "topk_group",
            serde_json::json!(5),
            "field `topk_group`: topk_group 5 is not within 1..=4",
        ),
        (
            "nemotron_h_moe",
            "moe_latent_size",
            serde_json::json!(0),
            "field `moe_latent_size`: must be positive (or null)",
        ),
        (
            "granite_moe_hybrid",
            "num_experts_per_tok",
            serde_json::json!(11),
            "field `num_experts_per_tok`: num_experts_per_tok 11 is not within 1..=10",
        ),
        (
            "granite_moe_hybrid",
            "mamba_n_groups",
            serde_json::json!(2),
            "`mamba_n_groups`: 2 groups",
        ),
        (
            "granite_rope",
            "rope_scaling",
            serde_json::json!({"type": "linear", "factor": 2.0}),
            "`rope_scaling`: scaled rotary embeddings",
        ),
        (
            "granite_rope",
            "rope_parameters",
            serde_json::json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
            "`rope_parameters.rope_type`: scaled rotary embeddings",
        ),
        (
            "granite_rope",
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": 1e39}),
            "field `rope_theta`: must be positive and an f32",
        ),
        (
            "granite_rope",
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": 1e-50}),
            "field `rope_theta`: must be positive and an f32",
        ),
        (
            "granite_moe_hybrid",
            "logits_scaling",
            serde_json::json!(0.0),
            "field `logits_scaling`: must be a finite non-zero number",
        ),
        // Finite in f64 but not an f32, which the kernels and the reference multiply by:
        // 1e50 made every logit 0 (a silent run of token 0), 1e300 a late numerical fault
        // naming no key.
        (
            "granite_moe_hybrid",
            "logits_scaling",
            serde_json::json!(1e50),
            "field `logits_scaling`: must be a non-zero f32",
        ),
        (
            "granite_moe_hybrid",
            "embedding_multiplier",
            serde_json::json!(1e300),
            "field `embedding_multiplier`: must be a non-zero f32",
        ),
        (
            "granite_moe_hybrid",
            "residual_multiplier",
            serde_json::json!(1e-50),
            "field `residual_multiplier`: must be a non-zero f32",
        ),
        (
            "granite_moe_hybrid",
            "attention_multiplier",
            serde_json::json!(1e-50),
            "field `attention_multiplier`: must be positive and an f32",
        ),
        (
            "nemotron_h_moe",
            "routed_scaling_factor",
            serde_json::json!(1e39),
            "field `routed_scaling_factor`: must be 0 or an f32",
        ),
    ] {
        let dir = fixture_copy(fixture, "moe_config");
        let path = dir.join("config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        c[key] = value;
        std::fs::write(&path, c.to_string()).unwrap();
        let e = load_err(&dir);
        assert!(e.contains(want), "{fixture} {key}: {e}");
        assert!(e.contains("config.json"), "the error names the file: {e}");
    }
}

#[test]
fn an_moe_model_round_trips() {
    let dir = scratch("moe_round_trip");
    let model = Model::synthetic(mamba2_wgpu::model::synthetic::tiny_moe("ME*E-M", false), 3);
    model.save(&dir).unwrap();
    let loaded = Model::load(&dir).unwrap();
    assert_eq!(loaded.config, model.config);
    let cpu = |m: &Model| CpuModel::<f32>::new(&m.config, &m.weights).unwrap();
    let (a, b) = (cpu(&model), cpu(&loaded));
    let run = |c: &CpuModel<f32>| {
        c.forward(
            &mut c.new_state(),
            &[1, 2, 3],
            mamba2_wgpu::reference::Scan::Sequential,
            mamba2_wgpu::reference::Logits::Last,
        )
        .unwrap()
    };
    assert_eq!(run(&a), run(&b), "the saved model computes the same logits");
    // Granite: the stacked expert tensors are written back as they were read.
    let granite = Model::load(&fixture_copy("granite_moe_hybrid", "granite_src")).unwrap();
    let dir = scratch("granite_round_trip");
    granite.save(&dir).unwrap();
    let loaded = Model::load(&dir).unwrap();
    assert_eq!(loaded.config, granite.config);
    assert_eq!(
        run(&cpu(&granite)),
        run(&cpu(&loaded)),
        "the saved Granite model computes the same logits"
    );
}

#[test]
fn a_kv_cache_larger_than_the_adapter_binds_is_refused_with_sizes() {
    let model = Model::synthetic(tiny_hybrid("M*-", 2), 1);
    let opts = mamba2_wgpu::EngineOptions {
        context: Some(1 << 30),
        ..Default::default()
    };
    // 128 MiB per binding (lavapipe's limit): 2 kv heads × 8 values × 2 bytes per row.
    let e = opts
        .context_for(&model.config, 128 << 20, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--ctx 1073741824")
            && e.contains("32 bytes")
            && e.contains("128.0 MiB per buffer")
            && e.contains("at most 4194304 tokens fit"),
        "{e}"
    );
    // Without --ctx the config's context is taken, capped to what fits, and said so.
    let mut c = model.config.clone();
    c.max_context = Some(1 << 30);
    let mut said = String::new();
    let n = mamba2_wgpu::EngineOptions::default()
        .context_for(&c, 128 << 20, &mut |m| said = m.to_string())
        .unwrap();
    assert_eq!(n, 4194304);
    assert!(said.contains("KV cache capped at 4194304 tokens"), "{said}");
}

#[test]
fn ids_outside_the_vocabulary_are_refused_when_scored_too() {
    // Perplexity feeds ids through `Session::logits`: a tokenizer larger than the model
    // must not reach the logits.
    let model = Model::synthetic(tiny_config(1, 8), 1);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let mut s = Session::new(Box::new(CpuBackend::new(cpu)));
    let e = s.logits(&[1, 2, 77]).unwrap_err().to_string();
    assert_eq!(
        e,
        "invalid input: token id 77 is outside the vocabulary (size 77)"
    );
    assert_eq!(s.position(), 0, "nothing was fed");
}

// ---------------------------------------------------------------------------------------
// Non-finite values. A NaN or ±Inf weight (or one the device format cannot hold) is refused
// when the weights are converted or uploaded, naming the tensor; a non-finite logit is an
// error naming the layer at fault (found in the state), on the CPU and on the GPU, in
// prefill, decode and scoring alike — never garbage text.
// ---------------------------------------------------------------------------------------

mod common;

use mamba2_wgpu::gpu::state_store::KvFormat;
use mamba2_wgpu::gpu::{Engine, EngineOptions, GpuBackend};
use mamba2_wgpu::model::ModelWeights;
use mamba2_wgpu::model::quant::WeightFormat;
use mamba2_wgpu::sampling::Sampling;
use mamba2_wgpu::session::Backend;
use mamba2_wgpu::state::{LayerState, State};

/// `model` with tensor `name` replaced by `edit` of its values (as f32, or f16 with
/// `f16`).
fn edited(model: &Model, name: &str, f16: bool, edit: impl FnOnce(&mut [f32])) -> Model {
    let mut edit = Some(edit);
    let tensors = model.weights.all().into_iter().map(|t| {
        if t.name != name {
            return t.clone();
        }
        let mut v = t.to_f32();
        (edit.take().expect("one tensor of that name"))(&mut v);
        if f16 {
            let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            Tensor::from_f16(name, t.shape.clone(), &h)
        } else {
            Tensor::from_f32(name, t.shape.clone(), &v)
        }
    });
    Model {
        config: model.config.clone(),
        weights: ModelWeights::from_tensors(&model.config, tensors).unwrap(),
        dir: None,
        gguf: None,
    }
}

/// The engine's error for `model` in `format` (None: no adapter, the test is skipped).
fn gpu_load_err(model: &Model, format: WeightFormat) -> Option<String> {
    let ctx = common::gpu(&Engine::needs(&model.config, format))?;
    let opts = EngineOptions {
        format,
        context: Some(64),
        ..Default::default()
    };
    Some(match Engine::new(ctx, model, opts) {
        Ok(_) => panic!("{} weights loaded", format.name()),
        Err(e) => e.to_string(),
    })
}

fn gpu_backend(model: &Model, format: WeightFormat) -> Option<GpuBackend> {
    let ctx = common::gpu(&Engine::needs(&model.config, format))?;
    let opts = EngineOptions {
        format,
        context: Some(64),
        ..Default::default()
    };
    Some(GpuBackend::new(Engine::new(ctx, model, opts).unwrap()).unwrap())
}

/// Opens a model on one kind of device.
type Opener = Box<dyn Fn(&Model) -> Box<dyn Backend>>;

fn cpu_backend(model: &Model) -> Box<dyn Backend> {
    Box::new(CpuBackend::new(
        CpuModel::<f32>::new(&model.config, &model.weights).unwrap(),
    ))
}

#[test]
fn a_nonfinite_weight_is_refused_naming_the_tensor() {
    let (dir, model) = saved_model("nonfinite");
    let out_proj = "backbone.layers.1.mixer.out_proj.weight";
    let dt_bias = "backbone.layers.0.mixer.dt_bias";
    // Through a checkpoint on disk: a NaN in an f32 matrix, an Inf in an f16 vector.
    resave(
        &dir,
        &edited(&model, out_proj, false, |v| v[30] = f32::NAN),
        |_| {},
    );
    let nan = Model::load(&dir).unwrap();
    let e = CpuModel::<f32>::new(&nan.config, &nan.weights)
        .err()
        .expect("a NaN weight converts")
        .to_string();
    let cols = model.config.d_inner;
    let want = format!(
        "tensor `{out_proj}`: holds a non-finite value (NaN) at element 30 (index [{}, {}])",
        30 / cols,
        30 % cols
    );
    assert!(e.starts_with(&want), "{e}\n  want: {want}");
    resave(
        &dir,
        &edited(&model, dt_bias, true, |v| v[3] = f32::INFINITY),
        |_| {},
    );
    let inf = Model::load(&dir).unwrap();
    let e = CpuModel::<f64>::new(&inf.config, &inf.weights)
        .err()
        .expect("an Inf weight converts")
        .to_string();
    assert!(
        e.starts_with(&format!(
            "tensor `{dt_bias}`: holds a non-finite value (inf) at element 3"
        )),
        "{e}"
    );
    // The GPU upload checks the same, in every device format; a finite value the format
    // cannot hold (f16 past ±65504, a q8_0 scale past 65504) is refused too.
    for format in [WeightFormat::F32, WeightFormat::F16, WeightFormat::Q8_0] {
        let Some(e) = gpu_load_err(&nan, format) else {
            return;
        };
        assert!(e.starts_with(&want), "{}: {e}", format.name());
        let e = gpu_load_err(&inf, format).unwrap();
        assert!(
            e.contains(&format!("tensor `{dt_bias}`: holds a non-finite")),
            "{e}"
        );
    }
    let big = edited(&model, out_proj, false, |v| v[cols + 5] = 1e6);
    let e = gpu_load_err(&big, WeightFormat::F16).unwrap();
    assert!(
        e.starts_with(&format!(
            "tensor `{out_proj}`: the value 1000000 at index [1, 5] is past f16's range"
        )),
        "{e}"
    );
    let huge = edited(&model, out_proj, false, |v| v[cols + 5] = -1e10);
    let e = gpu_load_err(&huge, WeightFormat::Q8_0).unwrap();
    assert!(
        e.starts_with(&format!(
            "tensor `{out_proj}`: the q8_0 block of row 1 at columns 0…31"
        )),
        "{e}"
    );
    gpu_backend(&big, WeightFormat::F32).expect("f32 holds 1e6");
    // A part of a stacked matrix (the GPU's [q; k; v]) is named as the checkpoint names it.
    let hybrid = Model::synthetic(tiny_hybrid("M*-M", 2), 1);
    let k = "backbone.layers.1.mixer.k_proj.weight";
    let e = gpu_load_err(
        &edited(&hybrid, k, false, |v| v[40] = 7e4),
        WeightFormat::F16,
    )
    .unwrap();
    assert!(
        e.starts_with(&format!(
            "tensor `{k}`: the value 70000 at index [1, 8] is past f16's range"
        )),
        "{e}"
    );
}

/// The state of `b` with `poke` applied.
fn poked(b: &dyn Backend, poke: impl FnOnce(&mut State<f32>)) -> State<f32> {
    let mut s = b.state().unwrap();
    poke(&mut s);
    s
}

#[test]
fn a_nonfinite_logit_is_an_error_naming_the_layer() {
    let model = Model::synthetic(tiny_config(2, 6), 1);
    let hybrid = Model::synthetic(tiny_hybrid("M*-M", 2), 1);
    // Finite weights whose logits overflow: the head.
    let loud = edited(&model, "lm_head.weight", false, |v| v.fill(3e38));
    let mut devices: Vec<(&str, Opener)> = vec![("cpu", Box::new(cpu_backend))];
    if common::gpu(&Engine::needs(&model.config, WeightFormat::F32)).is_some() {
        devices.push((
            "gpu",
            Box::new(|m: &Model| Box::new(gpu_backend(m, WeightFormat::F32).unwrap()) as _),
        ));
    }
    let opts = GenerateOptions {
        max_new_tokens: 4,
        ..Default::default()
    };
    let greedy = Sampling::greedy();
    let ssm_nan = |s: &mut State<f32>| s.mamba_mut(1).unwrap().1[5] = f32::NAN;
    for (name, open) in &devices {
        // A NaN in layer 1's SSM state: prefill (sampled), scoring and decode all refuse.
        let mamba1 = "layer 1 (mamba2) is the first whose state is not finite (ssm element 5 \
                      is NaN), so the fault lies in layer 1 or layer 0's output";
        let mut s = Session::new(open(&model));
        let bad = poked(s.backend(), ssm_nan);
        s.backend_mut().restore(&bad).unwrap();
        let e = s
            .generate(&[1, 2, 3], &opts, |_| true)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!("numerical fault: non-finite logits (NaN or ±Inf) at position 3: {mamba1}"),
            "{name}"
        );
        let mut s = Session::new(open(&model));
        s.backend_mut().restore(&bad).unwrap();
        let e = s.logits(&[4, 5]).unwrap_err().to_string();
        assert!(
            e.contains(&format!("at position 1: {mamba1}")),
            "{name}: {e}"
        );
        // Decode: the step that sees it fails (through the GPU's ring of tokens in flight),
        // and the device is usable afterwards.
        let mut b = open(&model);
        let fresh = b.state().unwrap();
        b.restore(&bad).unwrap();
        let mut seen = Vec::new();
        let e = b
            .decode(1, 1, 6, &greedy, &[], &mut |t| {
                seen.push(t);
                true
            })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("at position 1: {mamba1}")),
            "{name}: {e}"
        );
        assert!(seen.is_empty(), "{name}: tokens from NaN logits: {seen:?}");
        b.restore(&fresh).unwrap();
        let n = b.decode(1, 1, 6, &greedy, &[], &mut |_| true).unwrap();
        assert_eq!(n, 6, "{name}");

        // Every state finite, the head overflows: it is named, with what feeds it.
        let mut s = Session::new(open(&loud));
        let e = s
            .generate(&[1, 2], &opts, |_| true)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "numerical fault: non-finite logits (NaN or ±Inf) at position 2: every layer's \
             state is finite, so the fault lies in layer 1's output, the final norm or the head",
            "{name}"
        );

        // A hybrid: a NaN in layer 3's SSM state (an MLP and an attention layer before it),
        // then in layer 1's cached K.
        let mut s = Session::new(open(&hybrid));
        s.generate(&[1, 2, 3], &opts, |_| true).unwrap();
        let at = s.position() + 3; // the pending token, 4 and 5
        let bad = poked(s.backend(), |st| st.mamba_mut(3).unwrap().1[0] = f32::NAN);
        s.backend_mut().restore(&bad).unwrap();
        let e = s
            .generate(&[4, 5], &opts, |_| true)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with(&format!(
                "at position {at}: layer 3 (mamba2) is the first whose state is not finite \
                 (ssm element 0 is NaN), so the fault lies in layer 3, the MLP layer 2 or \
                 layer 1's output"
            )),
            "{name}: {e}"
        );
        let mut s = Session::new(open(&hybrid));
        s.generate(&[1, 2, 3], &opts, |_| true).unwrap();
        let bad = poked(s.backend(), |st| {
            if let LayerState::Attention { k, .. } = &mut st.layers[1] {
                k[2] = f32::NAN;
            }
        });
        s.backend_mut().restore(&bad).unwrap();
        let e = s.generate(&[4], &opts, |_| true).unwrap_err().to_string();
        assert!(
            e.contains(
                "layer 1 (attention) is the first whose state is not finite (K element 2 is \
                 NaN), so the fault lies in layer 1 or layer 0's output"
            ),
            "{name}: {e}"
        );
    }
    // The f16 KV cache's overflow is hinted at.
    if let Some(ctx) = common::gpu(&Engine::needs(&hybrid.config, WeightFormat::F16)) {
        let opts_kv = EngineOptions {
            context: Some(64),
            kv: KvFormat::F16,
            ..Default::default()
        };
        let mut s = Session::new(Box::new(
            GpuBackend::new(Engine::new(ctx, &hybrid, opts_kv).unwrap()).unwrap(),
        ));
        s.generate(&[1, 2, 3], &opts, |_| true).unwrap();
        let bad = poked(s.backend(), |st| {
            if let LayerState::Attention { v, .. } = &mut st.layers[1] {
                v[0] = f32::INFINITY;
            }
        });
        s.backend_mut().restore(&bad).unwrap();
        let e = s.generate(&[4], &opts, |_| true).unwrap_err().to_string();
        assert!(
            e.contains("(V element 0 is inf)") && e.ends_with("try --kv f32)"),
            "{e}"
        );
    }
}
