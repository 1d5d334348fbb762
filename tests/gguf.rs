//! GGUF files against external oracles (tests/fixtures/gguf, made by
//! scripts/make_gguf_fixtures.py): gguf-py's numpy dequantization of every tensor (bit for
//! bit), HF transformers' logits for the f32 conversion of hf_mamba2_g1, and llama.cpp's own
//! CPU logits for every file; then the tokenizer rebuilt from GGUF metadata against the
//! tokenizer.json it came from, and broken files against clear errors.

mod common;

use std::path::{Path, PathBuf};

use mamba2_wgpu::gpu::backend::GpuBackend;
use mamba2_wgpu::gpu::engine::{Engine, EngineOptions};
use mamba2_wgpu::model::gguf::{GgufFile, GgufInfo, Value};
use mamba2_wgpu::model::{DType, Model};
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};
use mamba2_wgpu::{Backend, WeightFormat};
use serde_json::Value as Json;

fn dir() -> PathBuf {
    common::fixture("gguf")
}

fn oracle() -> Json {
    serde_json::from_str(&std::fs::read_to_string(dir().join("oracle.json")).unwrap()).unwrap()
}

/// llama.cpp's logits for `file`'s prompt, `[T][V]`.
fn llama_logits(file: &str, vocab: usize) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(dir().join(format!("{file}.logits"))).unwrap();
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    v.chunks(vocab).map(<[f32]>::to_vec).collect()
}

fn prompt(o: &Json, file: &str) -> Vec<u32> {
    o["files"][file]["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn fnv64(values: &[f32]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for v in values {
        for b in v.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    format!("{h:016x}")
}

fn files(o: &Json) -> Vec<String> {
    o["files"].as_object().unwrap().keys().cloned().collect()
}

/// Every tensor of `file` against gguf-py's record of it (`want`: type, count, first values,
/// hash of all f32 bits); the dtypes met go into `types`.
fn dequantizes_as_recorded(
    file: &str,
    want: &serde_json::Map<String, Json>,
    types: &mut std::collections::BTreeSet<&'static str>,
) {
    let g = GgufFile::open(&dir().join(file)).unwrap();
    assert_eq!(g.tensors.len(), want.len(), "{file}");
    for t in &g.tensors {
        let w = &want[&t.name];
        assert_eq!(
            t.dtype.ggml().name(),
            w["type"].as_str().unwrap(),
            "{file} {}",
            t.name
        );
        let (v, finite) = t.to_f32_checked();
        assert!(finite);
        assert_eq!(v.len() as u64, w["n"].as_u64().unwrap());
        for (a, b) in v.iter().zip(w["first"].as_array().unwrap()) {
            assert_eq!(*a, b.as_f64().unwrap() as f32, "{file} {}", t.name);
        }
        assert_eq!(
            fnv64(&v),
            w["fnv64"].as_str().unwrap(),
            "{file} {}: bits",
            t.name
        );
        types.insert(t.dtype.name());
    }
}

#[test]
fn every_tensor_dequantizes_as_gguf_py_does() {
    let o = oracle();
    let mut types = std::collections::BTreeSet::new();
    for file in files(&o) {
        let want = o["files"][&file]["dequant"].as_object().unwrap();
        dequantizes_as_recorded(&file, want, &mut types);
    }
    // The moe64 files' record (scripts/make_nemotron_h_gguf.py): Q4_1, Q5_0, Q5_1 among
    // them.
    let text = std::fs::read_to_string(dir().join("moe64.dequant.json")).unwrap();
    let moe: Json = serde_json::from_str(&text).unwrap();
    for (file, want) in moe.as_object().unwrap() {
        dequantizes_as_recorded(file, want.as_object().unwrap(), &mut types);
    }
    for ty in [
        "f32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K",
    ] {
        assert!(types.contains(ty), "no fixture holds {ty}");
    }
}

#[test]
fn gpu_block_types_reach_the_device_layout_as_stored() {
    use mamba2_wgpu::model::quant::{WeightFormat, repack_ggml, unpack};
    for (file, format) in [
        ("k256.q8_0.gguf", WeightFormat::Q8_0),
        ("k256.q4_0.gguf", WeightFormat::Q4_0),
        ("k256.q4_k.gguf", WeightFormat::Q4_K),
        ("k256.q5_k.gguf", WeightFormat::Q5_K),
        ("k256.q6_k.gguf", WeightFormat::Q6_K),
    ] {
        let g = GgufFile::open(&dir().join(file)).unwrap();
        let t = g
            .tensors
            .iter()
            .find(|t| t.name == "blk.0.ssm_in.weight")
            .unwrap();
        assert_eq!(t.dtype.name(), format.ggml().unwrap().name(), "{file}");
        let p = repack_ggml(format, &[t]);
        assert_eq!((p.rows, p.cols, p.kp), (1064, 256, 256), "{file}");
        // Split into the device's quants and scales and back, the values are gguf-py's.
        assert_eq!(unpack(&p), t.to_f32(), "{file}");
    }
}

/// The quantizers `--dtype` uses against llama.cpp's: the f32 rows the k256 files were
/// quantized from (k256.rows.safetensors) through `kquant::quantize_row`, byte for byte
/// against the blocks llama-quantize wrote for them.
#[test]
fn quantizers_write_llama_quantize_blocks() {
    use mamba2_wgpu::model::TensorStore;
    use mamba2_wgpu::model::kquant::quantize_row;
    let store = TensorStore::from_static(
        "k256.rows.safetensors",
        include_bytes!("fixtures/gguf/k256.rows.safetensors"),
    )
    .unwrap();
    let rows: Vec<_> = store.into_tensors().collect();
    assert_eq!(rows.len(), 2);
    for file in [
        "k256.q8_0.gguf",
        "k256.q4_0.gguf",
        "k256.q4_k.gguf",
        "k256.q5_k.gguf",
        "k256.q6_k.gguf",
    ] {
        let g = GgufFile::open(&dir().join(file)).unwrap();
        for src in &rows {
            let t = g.tensors.iter().find(|t| t.name == src.name).unwrap();
            let DType::Quant(ty) = t.dtype else {
                panic!("{file} {}: not a block type", t.name)
            };
            let (n, cols) = (src.shape[0], src.shape[1]);
            assert_eq!(t.shape[1], cols, "{file} {}", t.name);
            let (per, bytes) = ty.block();
            let row_bytes = cols / per * bytes;
            let values = src.to_f32();
            let mut differ = Vec::new();
            for r in 0..n {
                let mut ours = Vec::new();
                quantize_row(ty, &values[r * cols..(r + 1) * cols], &mut ours);
                assert_eq!(ours.len(), row_bytes, "{file} {}: row {r}", t.name);
                let theirs = &t.bytes()[r * row_bytes..(r + 1) * row_bytes];
                for (b, (x, y)) in ours.chunks(bytes).zip(theirs.chunks(bytes)).enumerate() {
                    if x != y {
                        differ.push((r, b));
                    }
                }
            }
            assert!(
                differ.is_empty(),
                "{file} {}: {} of {} blocks differ from llama-quantize's (row, block): {:?}",
                t.name,
                differ.len(),
                n * cols / per,
                &differ[..differ.len().min(8)]
            );
        }
    }
}

/// The 32-value block quantizers against gguf-py's (a port of ggml's reference
/// quantizers): the stacked experts of moe64.f32.gguf through `kquant::quantize_row`, byte
/// for byte against the Q4_0, Q4_1, Q5_0 and Q5_1 blocks scripts/make_nemotron_h_gguf.py
/// had gguf-py write for them.
#[test]
fn block_quantizers_write_gguf_py_blocks() {
    use mamba2_wgpu::model::kquant::quantize_row;
    let f32_file = GgufFile::open(&dir().join("moe64.f32.gguf")).unwrap();
    for file in [
        "moe64.q4_0.gguf",
        "moe64.q4_1.gguf",
        "moe64.q5_0.gguf",
        "moe64.q5_1.gguf",
    ] {
        let g = GgufFile::open(&dir().join(file)).unwrap();
        let mut checked = 0;
        for t in g
            .tensors
            .iter()
            .filter(|t| t.name.ends_with("_exps.weight"))
        {
            let DType::Quant(ty) = t.dtype else {
                panic!("{file} {}: not a block type", t.name)
            };
            let src = f32_file.tensors.iter().find(|s| s.name == t.name).unwrap();
            let cols = *src.shape.last().unwrap();
            let mut ours = Vec::new();
            for row in src.to_f32().chunks(cols) {
                quantize_row(ty, row, &mut ours);
            }
            let bytes = ty.block().1;
            let differ = ours
                .chunks(bytes)
                .zip(t.bytes().chunks(bytes))
                .filter(|(x, y)| x != y)
                .count();
            assert_eq!(ours.len(), t.bytes().len(), "{file} {}", t.name);
            assert_eq!(differ, 0, "{file} {}: blocks unlike gguf-py's", t.name);
            checked += 1;
        }
        assert_eq!(checked, 4, "{file}: the stacked expert matrices");
    }
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn cpu_logits(model: &Model, prompt: &[u32]) -> Vec<Vec<f32>> {
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    cpu.forward(&mut cpu.new_state(), prompt, Scan::Sequential, Logits::All)
        .unwrap()
}

#[test]
fn f32_gguf_matches_its_safetensors_and_both_oracles() {
    let o = oracle();
    let file = "g1.f32.gguf";
    let gguf = Model::load(&dir().join(file)).unwrap();
    let st = Model::load(&common::fixture("hf_mamba2_g1")).unwrap();
    // The converter pads the vocabulary to a multiple of 16 (zero rows).
    assert_eq!((gguf.config.vocab_size, st.config.vocab_size), (112, 100));
    assert_eq!(gguf.config.d_inner, st.config.d_inner);
    assert_eq!(gguf.config.n_heads, st.config.n_heads);
    assert!(gguf.config.tie_embeddings && gguf.config.conv_bias);
    let p = prompt(&o, file);
    let a = cpu_logits(&gguf, &p);
    let b = cpu_logits(&st, &p);
    let ll = llama_logits(file, 112);
    for t in 0..p.len() {
        // Same weights; A was stored as −exp(A_log) by numpy, so allow float rounding.
        let e = max_abs(&a[t][..100], &b[t]);
        assert!(e <= 1e-5, "position {t}: GGUF vs safetensors {e:e}");
        assert!(
            a[t][100..].iter().all(|&v| v == 0.0),
            "padded rows give zero logits"
        );
        let e = max_abs(&a[t], &ll[t]);
        assert!(e <= 1e-4, "position {t}: vs llama.cpp {e:e}");
    }
}

/// The quantized files through the CPU reference (exact dequantization, f32 activations)
/// against llama.cpp's CPU (which quantizes activations to 8 bits for its dot products, so
/// the two differ by that rounding: measured ≤ 2 % of the logit range).
#[test]
fn quantized_ggufs_match_llama_cpp() {
    let o = oracle();
    for file in files(&o).into_iter().filter(|f| f.starts_with("k256")) {
        let model = Model::load(&dir().join(&file)).unwrap();
        let p = prompt(&o, &file);
        let ours = cpu_logits(&model, &p);
        let ll = llama_logits(&file, model.config.vocab_size);
        let range = ll.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        let worst = ours
            .iter()
            .zip(&ll)
            .map(|(a, b)| max_abs(a, b))
            .fold(0f32, f32::max);
        let nmse = common::nmse(&ours.concat(), &ll.concat());
        eprintln!("{file}: max |Δlogit| {worst:.4} of range {range:.2}, nmse {nmse:e}");
        assert!(
            worst <= 0.02 * range,
            "{file}: max |Δlogit| {worst} (range {range})"
        );
        assert!(nmse <= 1e-3, "{file}: nmse {nmse:e}");
    }
}

/// The GPU engine (lavapipe in CI) on GGUF weights, in every engine format, against the
/// CPU reference on the same file: prompt logits through the prefill GEMMs (f32
/// activations) and through the decode graph (the GEMVs, q8 activations for the quantized
/// formats). Under a quantized engine format the k256 files' blocks go up as stored, so
/// the GEMMs reproduce the reference's exact dequantization.
#[test]
fn gguf_models_on_the_gpu() {
    use mamba2_wgpu::gpu::engine::PrefillMode;
    let o = oracle();
    for file in [
        "g1.f32.gguf",
        "k256.q4_0.gguf",
        "k256.q4_k.gguf",
        "k256.q5_k.gguf",
        "k256.q8_0.gguf",
        "k256.q6_k.gguf",
    ] {
        let model = Model::load(&dir().join(file)).unwrap();
        let p = prompt(&o, file);
        let want = cpu_logits(&model, &p);
        let range = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        let stored = file != "g1.f32.gguf";
        // (format, prefill mode, tolerance relative to the logit range, absolute floor):
        // f16 rounds the (dequantized) weights once more, the quantized formats requantize
        // the f32 file and (decode graph) round the activations to 8 bits.
        let mut runs = vec![
            (WeightFormat::F32, PrefillMode::Chunked, 1e-5, 0.0),
            (WeightFormat::F16, PrefillMode::Chunked, 2e-3, 5e-3),
            (WeightFormat::Q8_0, PrefillMode::Decode, 2e-2, 0.1),
        ];
        if stored {
            runs.push((WeightFormat::Q8_0, PrefillMode::Chunked, 1e-5, 1e-4));
        }
        for (format, prefill, rel, floor) in runs {
            let Some(ctx) = common::gpu(&Engine::needs(&model.config, format)) else {
                return;
            };
            let opts = EngineOptions {
                format,
                prefill,
                ..Default::default()
            };
            let mut b = GpuBackend::new(Engine::new(ctx, &model, opts).unwrap()).unwrap();
            let got = b.prefill_logits(&p).unwrap();
            let e = got
                .iter()
                .zip(&want)
                .map(|(g, w)| max_abs(g, w))
                .fold(0f32, f32::max);
            eprintln!("{file} as {format:?} ({prefill:?}): max |Δlogit| {e:e} of range {range:.1}");
            assert!(
                e <= rel * range + floor,
                "{file} as {format:?} ({prefill:?}): max |Δlogit| {e:e} (range {range})"
            );
        }
    }
}

/// `--dtype` conversion of an f32 GGUF: the GPU (prefill GEMMs) against the CPU reference
/// on the same weights rounded through the format, and how far each format moves the
/// logits from the f32 ones.
#[test]
fn f32_gguf_in_every_gpu_format() {
    let o = oracle();
    let file = "g1.f32.gguf";
    let model = Model::load(&dir().join(file)).unwrap();
    let p = prompt(&o, file);
    let exact = cpu_logits(&model, &p);
    for format in [
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::Q8_0,
        WeightFormat::Q6_K,
        WeightFormat::Q5_K,
        WeightFormat::Q4_K,
        WeightFormat::Q5_1,
        WeightFormat::Q5_0,
        WeightFormat::Q4_1,
        WeightFormat::Q4_0,
    ] {
        let want = cpu_logits(&common::rounded(&model, |k| format.for_cols(k)), &p);
        let range = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        let Some(ctx) = common::gpu(&Engine::needs(&model.config, format)) else {
            return;
        };
        let opts = EngineOptions {
            format,
            ..Default::default()
        };
        let mut b = GpuBackend::new(Engine::new(ctx, &model, opts).unwrap()).unwrap();
        let got = b.prefill_logits(&p).unwrap();
        let (e, moved) = (worst(&got, &want), worst(&want, &exact));
        eprintln!(
            "{file} as {format:?}: max |Δlogit| {e:e} vs its rounded weights ({moved:.3} from f32) of range {range:.1}"
        );
        assert!(
            e <= 1e-5 * range + 1e-4,
            "{file} as {format:?}: max |Δlogit| {e:e}"
        );
    }
}

#[test]
fn cli_runs_a_gguf_file_with_its_own_tokenizer() {
    let bin = env!("CARGO_BIN_EXE_mamba2");
    let file = dir().join("k256.q4_k.gguf");
    let out = std::process::Command::new(bin)
        .args(["info", "--model"])
        .arg(&file)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for want in [
        "format     GGUF mamba2 (llama.cpp)",
        "gguf       version 3, 20 tensors (f32 ×15, Q4_K ×4, Q6_K ×1)",
        "  mamba2.ssm.inner_size = 512",
        "tokenizer  256 tokens",
        "gpu        --dtype q4_k by default (Q4_K, Q6_K blocks go up as stored)",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
    // Generation from text through the GGUF's byte-level vocabulary, on the CPU reference:
    // the same ids as the reference run directly on the tokens of the prompt.
    let out = std::process::Command::new(bin)
        .args(["generate", "--device", "cpu", "-n", "6", "--model"])
        .arg(&file)
        .arg("hi!\"")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (model, tok) = Model::load_with_tokenizer(&file).unwrap();
    let tok = tok.unwrap();
    let ids = tok.encode("hi!\"").unwrap();
    // `!"` is one token (the vocabulary's one merge); h and i are byte tokens.
    assert_eq!(ids, vec![71, 72, 255]);
    let cpu = CpuModel::<f32>::new(&model.config, &model.weights).unwrap();
    let mut state = cpu.new_state();
    let mut logits = cpu
        .forward(&mut state, &ids, Scan::Sequential, Logits::Last)
        .unwrap();
    let mut text = String::from("hi!\"");
    for _ in 0..6 {
        let next = mamba2_wgpu::sampling::argmax(&logits[0]);
        text.push_str(&tok.decode(&[next]).unwrap());
        logits = cpu
            .forward(&mut state, &[next], Scan::Sequential, Logits::Last)
            .unwrap();
    }
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim_end(), text);
}

/// The embedded model's tokenizer.json, rewritten as `gpt2` GGUF metadata (tokens, merges,
/// types), rebuilt by the GGUF path: the same ids on real text.
#[test]
fn gpt2_metadata_tokenizes_like_its_tokenizer_json() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let json: Json =
        serde_json::from_str(&std::fs::read_to_string(root.join("assets/tokenizer.json")).unwrap())
            .unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    let merges: Vec<Value> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Json::String(s) => Value::Str(s.clone()),
            Json::Array(p) => Value::Str(format!(
                "{} {}",
                p[0].as_str().unwrap(),
                p[1].as_str().unwrap()
            )),
            _ => panic!("merge {m}"),
        })
        .collect();
    let types: Vec<Value> = (0..tokens.len())
        .map(|i| Value::I32(if i == 0 { 3 } else { 1 }))
        .collect();
    let info = GgufInfo {
        path: "test.gguf".into(),
        version: 3,
        metadata: vec![
            ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::Str("gpt-2".into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(tokens.into_iter().map(Value::Str).collect()),
            ),
            ("tokenizer.ggml.token_type".into(), Value::Array(types)),
            ("tokenizer.ggml.merges".into(), Value::Array(merges)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
            // Its post-processor adds `<|endoftext|>` first.
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(0)),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
            (
                "tokenizer.chat_template".into(),
                Value::Str("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
            ),
        ],
        types: Vec::new(),
        tensors: 0,
        file_len: 0,
    };
    let ours = mamba2_wgpu::gguf_tokenizer::from_gguf(&info)
        .unwrap()
        .unwrap();
    let (_, theirs) = mamba2_wgpu::assets::embedded().unwrap();
    let text = std::fs::read_to_string(root.join("assets/fortunes-copyright.txt")).unwrap();
    for line in text
        .lines()
        .chain(["  two  spaces, ünïcödé — and <|endoftext|> too"])
    {
        assert_eq!(
            ours.encode(line).unwrap(),
            theirs.encode(line).unwrap(),
            "{line:?}"
        );
    }
    assert_eq!(ours.eos, Some(0));
    let chat = ours
        .render_chat(&[("user".into(), "hello".into())], true)
        .unwrap();
    assert_eq!(chat.as_deref(), Some("hello"));
}

/// A SentencePiece BPE model trained by scripts/make_spm_tokenizer_fixture.py, written as
/// `llama` GGUF metadata (as llama.cpp's converter writes it), rebuilt by the GGUF path:
/// the ids SentencePiece itself gives each text, with the `▁` prefix (key absent: the
/// default) and without it (`add_space_prefix = false`), and the text back from them.
#[test]
fn llama_metadata_tokenizes_like_sentencepiece() {
    let text = std::fs::read_to_string(dir().join("spm.tokens.json")).unwrap();
    let oracle: Json = serde_json::from_str(&text).unwrap();
    let bos = oracle["bos"].as_u64().unwrap() as u32;
    let ids = |v: &Json| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect()
    };
    // (file, the oracle's ids for it, whether the file asks for BOS: llama.cpp adds it in
    // front, SentencePiece's own encode never does).
    for (file, key, with_bos) in [
        ("spm.gguf", "space_prefix", true),
        ("spm.no_space_prefix.gguf", "no_space_prefix", false),
    ] {
        let info = GgufFile::open(&dir().join(file)).unwrap().info();
        let tok = mamba2_wgpu::gguf_tokenizer::from_gguf(&info)
            .unwrap()
            .unwrap();
        assert_eq!(
            tok.vocab_size() as u64,
            oracle["vocab_size"].as_u64().unwrap()
        );
        assert_eq!(tok.eos, Some(2), "{file}");
        for case in oracle["cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let mut want = ids(&case[key]);
            if with_bos {
                want.insert(0, bos);
            }
            assert_eq!(
                tok.encode(text).unwrap(),
                want,
                "{file}: {text:?} (SentencePiece's pieces: {})",
                case[format!("{key}_pieces")]
            );
            assert_eq!(tok.decode(&want).unwrap(), text, "{file}: decoded");
        }
    }
    // A flag stored as another type is refused, naming the key (read as its default it
    // would tokenize wrongly without a word).
    let mut info = GgufFile::open(&dir().join("spm.gguf")).unwrap().info();
    info.metadata
        .push(("tokenizer.ggml.add_space_prefix".into(), Value::U8(0)));
    let e = mamba2_wgpu::gguf_tokenizer::from_gguf(&info)
        .err()
        .expect("a uint8 flag is refused")
        .to_string();
    assert!(
        e.contains("`tokenizer.ggml.add_space_prefix`: expected a bool, found uint8 0"),
        "{e}"
    );
}

/// A copy of `g1.f32.gguf` with `edit` applied, written to a temporary file.
fn broken(name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(dir().join("g1.f32.gguf")).unwrap();
    edit(&mut bytes);
    let path = std::env::temp_dir().join(format!("mamba2-gguf-{}-{name}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A fresh directory of its own for `name` (no tokenizer.json of /tmp's beside a file).
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("mamba2-gguf-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A copy of fixture `src` with `edit` applied, as `name`.gguf in a scratch directory.
fn edited(src: &str, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(dir().join(src)).unwrap();
    edit(&mut bytes);
    let path = scratch(name).join(format!("{name}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

/// `src`'s bytes with metadata key `key` (GGUF value type `ty`, value bytes `value`) added
/// in front of the others, the data section moved to the next multiple of 32 after the
/// grown header: still a valid file.
fn with_key(src: &Path, key: &str, ty: u32, value: &[u8]) -> Vec<u8> {
    let g = GgufFile::open(src).unwrap();
    assert_eq!(g.alignment, 32);
    let bytes = std::fs::read(src).unwrap();
    // The header ends after the last tensor info (name, n_dims, ne[n_dims], type, offset).
    let at = info_at(&bytes, &g.tensors.last().unwrap().name);
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let header_end = at + 4 + 8 * n_dims + 4 + 8;
    let count = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
    let mut out = bytes[..16].to_vec();
    out.extend((count + 1).to_le_bytes());
    out.extend((key.len() as u64).to_le_bytes());
    out.extend(key.as_bytes());
    out.extend(ty.to_le_bytes());
    out.extend(value);
    out.extend(&bytes[24..header_end]);
    out.resize(out.len().next_multiple_of(32), 0);
    out.extend(&bytes[g.data_offset as usize..]);
    out
}

/// A GGUF string value's bytes.
fn gguf_str(s: &str) -> Vec<u8> {
    [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat()
}

/// `g1.f32.gguf` with its matrices (the embedding, every ssm_in and ssm_out) stored as
/// ggml type `ty`, each value written by `encode`, the rest as it was (f32): how llama.cpp's
/// converter stores a model with `--outtype f16|bf16` (2-D weights halved, norms and
/// vectors f32). The header keeps its length (types and offsets are rewritten in place);
/// the data section is laid out anew. Returns the file and how many tensors changed type.
fn g1_matrices_as(name: &str, ty: u32, encode: impl Fn(f32) -> Vec<u8>) -> (PathBuf, usize) {
    let src = dir().join("g1.f32.gguf");
    let g = GgufFile::open(&src).unwrap();
    let mut bytes = std::fs::read(&src).unwrap();
    let mut data: Vec<u8> = Vec::new();
    let mut changed = 0;
    for t in &g.tensors {
        assert_eq!(t.dtype, DType::F32, "{}", t.name);
        let at = info_at(&bytes, &t.name);
        let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let ty_at = at + 4 + 8 * n_dims;
        let matrix = ["token_embd.", ".ssm_in.", ".ssm_out."]
            .iter()
            .any(|m| t.name.contains(m));
        let (id, payload) = if matrix {
            changed += 1;
            (ty, t.to_f32().into_iter().flat_map(&encode).collect())
        } else {
            (0, t.bytes().to_vec())
        };
        data.resize(data.len().next_multiple_of(32), 0);
        bytes[ty_at..ty_at + 4].copy_from_slice(&id.to_le_bytes());
        bytes[ty_at + 4..ty_at + 12].copy_from_slice(&(data.len() as u64).to_le_bytes());
        data.extend(payload);
    }
    bytes.truncate(g.data_offset as usize);
    bytes.extend(data);
    let path = scratch(name).join("g1.gguf");
    std::fs::write(&path, bytes).unwrap();
    (path, changed)
}

/// F16 and BF16 GGUF tensors (`g1_matrices_as`). The oracle is the f32 file with the same
/// matrices rounded by the `half` crate: both widen to exactly the same f32 values, so on
/// the CPU reference the logits are equal bit for bit. On the GPU, as stored (the file's
/// preferred format is its half type), they are held to the tolerance the f32 file has in
/// each GPU format (`f32_gguf_in_every_gpu_format`). How far the rounding moves the logits
/// from the f32 file's is bounded too (relative weight error 2^-11 for f16, 2^-8 for
/// bf16): measured 6.1e-4 and 6.0e-3 of the logit range (3.7), allowed 2e-3 and 1e-2.
#[test]
fn f16_and_bf16_gguf_tensors_load_and_match_the_rounded_f32_path() {
    use half::{bf16, f16};
    let o = oracle();
    let p = prompt(&o, "g1.f32.gguf");
    let exact = cpu_logits(&Model::load(&dir().join("g1.f32.gguf")).unwrap(), &p);
    let range = exact.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    type Case = (&'static str, u32, DType, WeightFormat, fn(f32) -> f32, f32);
    let cases: [Case; 2] = [
        (
            "f16",
            1,
            DType::F16,
            WeightFormat::F16,
            |v| f16::from_f32(v).to_f32(),
            2e-3,
        ),
        (
            "bf16",
            30,
            DType::BF16,
            WeightFormat::BF16,
            |v| bf16::from_f32(v).to_f32(),
            1e-2,
        ),
    ];
    for (name, ty, dtype, format, round, allowed) in cases {
        let (file, changed) = g1_matrices_as(name, ty, |v| match ty {
            1 => f16::from_f32(v).to_le_bytes().to_vec(),
            _ => bf16::from_f32(v).to_le_bytes().to_vec(),
        });
        let (rounded, _) = g1_matrices_as(&format!("{name}-rounded"), 0, |v| {
            round(v).to_le_bytes().to_vec()
        });
        let model = Model::load(&file).unwrap();
        let g = model.gguf.as_ref().unwrap();
        assert!(
            g.types.contains(&(dtype, changed)),
            "{name}: {:?} (want {changed} {dtype:?})",
            g.types
        );
        assert_eq!(model.preferred_format(), format, "{name}");
        let want = cpu_logits(&Model::load(&rounded).unwrap(), &p);
        let got = cpu_logits(&model, &p);
        assert_eq!(
            got, want,
            "{name}: CPU logits vs the f32 file rounded by `half`"
        );
        let moved = worst(&want, &exact);
        eprintln!("{name}: rounding moves the logits {moved:e} of range {range:.1}");
        assert!(moved <= allowed * range, "{name}: moved {moved:e}");
        let Some(ctx) = common::gpu(&Engine::needs(&model.config, format)) else {
            return;
        };
        let opts = EngineOptions {
            format,
            ..Default::default()
        };
        let mut b = GpuBackend::new(Engine::new(ctx, &model, opts).unwrap()).unwrap();
        let gpu = b.prefill_logits(&p).unwrap();
        let e = worst(&gpu, &want);
        eprintln!("{name} on the GPU as stored: max |Δlogit| {e:e}");
        assert!(e <= 1e-5 * range + 1e-4, "{name} on the GPU: {e:e}");
    }
}

fn mamba2(args: &[&str], model: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_mamba2"))
        .args(args)
        .arg("--model")
        .arg(model)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `--model DIR` where DIR holds one `.gguf` runs that file (the same text as naming it);
/// with a second `.gguf` beside it, every command refuses the directory naming both.
#[test]
fn model_dir_holding_one_gguf_runs_it_and_two_are_refused() {
    let d = scratch("dir");
    let file = d.join("k256.q4_k.gguf");
    std::fs::copy(dir().join("k256.q4_k.gguf"), &file).unwrap();
    let generate = ["generate", "--device", "cpu", "-n", "5", "hi!"];
    let (by_dir, by_file) = (mamba2(&generate, &d), mamba2(&generate, &file));
    assert!(by_dir.status.success(), "{}", stderr(&by_dir));
    assert!(by_file.status.success(), "{}", stderr(&by_file));
    assert!(stdout(&by_dir).starts_with("hi!"), "{}", stdout(&by_dir));
    assert_eq!(stdout(&by_dir), stdout(&by_file));
    let info = mamba2(&["info"], &d);
    assert!(
        stdout(&info).contains("format     GGUF mamba2 (llama.cpp)"),
        "{}",
        stdout(&info)
    );
    std::fs::copy(dir().join("g1.f32.gguf"), d.join("g1.f32.gguf")).unwrap();
    for args in [&["info"][..], &generate[..]] {
        let out = mamba2(args, &d);
        assert!(!out.status.success(), "{args:?}");
        let e = stderr(&out);
        assert!(
            e.contains(&format!(
                "{}: holds 2 GGUF files (g1.f32.gguf, k256.q4_k.gguf): name one with --model",
                d.display()
            )),
            "{args:?}: {e}"
        );
    }
}

/// `mamba2 info` on a GGUF whose tokenizer cannot be built (an unknown
/// `tokenizer.ggml.pre`) still describes the whole file, the tokenizer's problem as a line.
#[test]
fn info_describes_a_gguf_whose_tokenizer_cannot_be_built() {
    let file = edited("k256.q4_k.gguf", "pre", |b| {
        let k = b"tokenizer.ggml.pre";
        let at = b.windows(k.len()).position(|w| w == k).unwrap() + k.len() + 4 + 8;
        assert_eq!(&b[at..at + 5], b"gpt-2");
        b[at..at + 5].copy_from_slice(b"qwen9");
    });
    let out = mamba2(&["info"], &file);
    let text = stdout(&out);
    assert!(out.status.success(), "{}\n{text}", stderr(&out));
    for want in [
        "format     GGUF mamba2 (llama.cpp)",
        "tokenizer  cannot be built, so text commands refuse this model (use --prompt-ids): ",
        "metadata key `tokenizer.ggml.pre`: pre-tokenizer `qwen9` is not known",
        "gguf       version 3, 20 tensors (f32 ×15, Q4_K ×4, Q6_K ×1)",
        "  tokenizer.ggml.pre = \"qwen9\"",
        "gpu        --dtype q4_k by default",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
}

/// `mamba2 info --chat-template` prints a template longer than the description's summary
/// in full, as stored; a model without one is an error naming the key.
#[test]
fn info_prints_the_whole_chat_template() {
    let template = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}\
                    {% if add_generation_prompt %}<|assistant|>\n{% endif %}";
    let d = scratch("template");
    let file = d.join("t.gguf");
    let src = dir().join("k256.q4_k.gguf");
    std::fs::write(
        &file,
        with_key(&src, "tokenizer.chat_template", 8, &gguf_str(template)),
    )
    .unwrap();
    let out = mamba2(&["info", "--chat-template"], &file);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{template}\n"));
    let out = mamba2(&["info"], &file);
    let text = stdout(&out);
    assert!(
        text.contains(&format!(
            "chat template yes ({} chars; `mamba2 info --chat-template` prints it)",
            template.chars().count()
        )),
        "{text}"
    );
    let out = mamba2(&["info", "--chat-template"], &src);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("has no chat template (no `tokenizer.chat_template` metadata key)"),
        "{}",
        stderr(&out)
    );
}

/// A GGUF without tokenizer metadata: the commands that need text name the file and the
/// `tokenizer.ggml.*` keys it lacks (not a tokenizer.json it was never meant to have);
/// `info` says the same in its tokenizer line, and ids still run.
#[test]
fn text_commands_name_the_missing_gguf_tokenizer_keys() {
    let file = edited("k256.q4_k.gguf", "notok", |b| {
        for k in [&b"tokenizer.ggml.model"[..], b"tokenizer.ggml.tokens"] {
            let at = b.windows(k.len()).position(|w| w == k).unwrap();
            b[at + k.len() - 1] = b'X';
        }
    });
    let want = format!(
        "{} has no tokenizer: its metadata lacks `tokenizer.ggml.model` and \
         `tokenizer.ggml.tokens` and no tokenizer.json lies beside it",
        file.display()
    );
    let text = file.with_file_name("text.txt");
    std::fs::write(&text, "some text to score").unwrap();
    let text = text.to_str().unwrap();
    for (args, hint) in [
        (
            &["generate", "--device", "cpu", "hello"][..],
            "pass the prompt as --prompt-ids",
        ),
        (&["chat", "--device", "cpu"][..], "chat needs one"),
        (
            &["perplexity", "--device", "cpu", "--file", text][..],
            "perplexity scores text",
        ),
    ] {
        let out = mamba2(args, &file);
        assert!(!out.status.success(), "{args:?}");
        let e = stderr(&out);
        assert!(e.contains(&format!("{want}: {hint}")), "{args:?}: {e}");
    }
    let out = mamba2(&["info"], &file);
    assert!(
        stdout(&out).contains(&format!("tokenizer  none: {want} (use --prompt-ids)")),
        "{}",
        stdout(&out)
    );
    let out = mamba2(
        &[
            "generate",
            "--device",
            "cpu",
            "-n",
            "3",
            "--prompt-ids",
            "71,72",
        ],
        &file,
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Where tensor `name`'s info (after its name) starts in the header.
fn info_at(bytes: &[u8], name: &str) -> usize {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend(name.as_bytes());
    bytes
        .windows(key.len())
        .position(|w| w == key.as_slice())
        .unwrap()
        + key.len()
}

fn load_error(path: &Path) -> String {
    let e = Model::load(path)
        .expect_err("a broken file must not load")
        .to_string();
    std::fs::remove_file(path).ok();
    e
}

#[test]
fn broken_gguf_files_are_refused_with_clear_errors() {
    // ssm_out of layer 1: n_dims (2), ne[0], ne[1], type, offset.
    let t = "blk.1.ssm_out.weight";
    type Edit = Box<dyn FnOnce(&mut Vec<u8>)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "truncated",
            Box::new(|b: &mut Vec<u8>| b.truncate(b.len() - 100)),
            "run past the end of the file",
        ),
        (
            "offset",
            Box::new(|b: &mut Vec<u8>| {
                let at = info_at(b, t) + 4 + 16 + 4;
                b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
            }),
            "tensor `blk.1.ssm_out.weight`",
        ),
        (
            "type",
            Box::new(|b: &mut Vec<u8>| {
                let at = info_at(b, t) + 4 + 16;
                b[at..at + 4].copy_from_slice(&16u32.to_le_bytes());
            }),
            "tensor `blk.1.ssm_out.weight`: ",
        ),
        (
            "alignment",
            Box::new(|b: &mut Vec<u8>| {
                let at = info_at(b, t) + 4 + 16 + 4;
                let off = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
                b[at..at + 8].copy_from_slice(&(off + 2).to_le_bytes());
            }),
            "is not a multiple of the file's alignment 32",
        ),
        (
            "key",
            Box::new(|b: &mut Vec<u8>| {
                let k = b"mamba2.ssm.inner_size";
                let at = b.windows(k.len()).position(|w| w == k).unwrap();
                b[at + k.len() - 1] = b'X';
            }),
            "metadata key `mamba2.ssm.inner_size`: missing",
        ),
        (
            "magic",
            Box::new(|b: &mut Vec<u8>| b[0] = b'X'),
            "not a GGUF file",
        ),
        (
            "count",
            Box::new(|b: &mut Vec<u8>| b[8..16].copy_from_slice(&u64::MAX.to_le_bytes())),
            "declares 18446744073709551615 tensor infos",
        ),
    ];
    for (name, edit, want) in cases {
        let e = load_error(&broken(name, edit));
        assert!(e.contains(want), "{name}: {e}");
    }
    let e = load_error(&broken("type2", |b| {
        let at = info_at(b, t) + 4 + 16;
        b[at..at + 4].copy_from_slice(&16u32.to_le_bytes());
    }));
    assert!(e.contains("type IQ2_XXS (id 16) is not supported"), "{e}");
    // An id ggml does not define at all: the message names the tensor and the bare id.
    let e = load_error(&broken("type200", |b| {
        let at = info_at(b, t) + 4 + 16;
        b[at..at + 4].copy_from_slice(&200u32.to_le_bytes());
    }));
    assert!(
        e.contains("tensor `blk.1.ssm_out.weight`") && e.contains("type id 200 is not a ggml type"),
        "{e}"
    );
    // `general.alignment` (the fixture has none: 32) must be a power of two stored as
    // uint32, as the GGUF spec defines it; anything else is refused naming the key.
    for (name, ty, value, want) in [
        (
            "align24",
            4u32,
            24u32.to_le_bytes().to_vec(),
            "found uint32 24",
        ),
        ("align0", 4, 0u32.to_le_bytes().to_vec(), "found uint32 0"),
        (
            "align-u64",
            10,
            32u64.to_le_bytes().to_vec(),
            "found uint64 32",
        ),
        (
            "align-str",
            8,
            [&2u64.to_le_bytes()[..], b"32"].concat(),
            "found string \"32\"",
        ),
    ] {
        let g1 = dir().join("g1.f32.gguf");
        let e = load_error(&broken(name, |b| {
            *b = with_key(&g1, "general.alignment", ty, &value);
        }));
        assert!(
            e.contains("metadata key `general.alignment`: expected a power of two as uint32")
                && e.contains(want),
            "{name}: {e}"
        );
    }
    // Every truncation point of the header: an error, never a panic.
    let bytes = std::fs::read(dir().join("g1.f32.gguf")).unwrap();
    let g = GgufFile::open(&dir().join("g1.f32.gguf")).unwrap();
    for cut in (0..g.data_offset as usize).step_by(7) {
        let path = broken("cut", |b| b.truncate(cut));
        assert!(GgufFile::open(&path).is_err(), "cut at {cut}");
        std::fs::remove_file(&path).ok();
    }
    assert_eq!(bytes.len() as u64, g.file_len);
    // Random bytes over the header (a fixed xorshift sequence): loads or clean errors.
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for round in 0..200 {
        let mut b = bytes.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() % g.data_offset) as usize;
            b[at] = next() as u8;
        }
        let path = std::env::temp_dir().join(format!(
            "mamba2-gguf-{}-flip{round}.gguf",
            std::process::id()
        ));
        std::fs::write(&path, &b).unwrap();
        if let Ok(m) = Model::load(&path) {
            // What loads must also run (or refuse cleanly).
            let _ = CpuModel::<f32>::new(&m.config, &m.weights).map(|cpu| {
                cpu.forward(
                    &mut cpu.new_state(),
                    &[1, 2],
                    Scan::Sequential,
                    Logits::Last,
                )
            });
        }
        std::fs::remove_file(&path).ok();
    }
}

/// The prompt and prompt logits of a safetensors fixture's HF oracle.
fn hf_oracle(fixture: &str) -> (Vec<u32>, Vec<Vec<f32>>) {
    let prompt = common::oracle_ids(fixture, "prompt_ids");
    let bytes = std::fs::read(common::fixture(fixture).join("oracle.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let l = st.tensor("prompt_logits").unwrap();
    let v = l.shape()[1];
    let logits: Vec<f32> = l
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (prompt, logits.chunks(v).map(<[f32]>::to_vec).collect())
}

/// llama.cpp's `nemotron_h` layout (scripts/make_nemotron_h_gguf.py, from the
/// nemotron_h_hybrid fixture): the layer kinds come from the per-layer metadata arrays, the
/// attention and MLP tensors from their GGUF names, and the logits equal HF transformers'
/// (f32 file) or stay within Q8_0's rounding (the Q8_0 file, whose 96- and 64-wide rows are
/// Q8_0 blocks), on the CPU reference and on the GPU.
#[test]
fn nemotron_h_gguf_matches_the_hf_oracle() {
    let (prompt, want) = hf_oracle("nemotron_h_hybrid");
    let st = Model::load(&common::fixture("nemotron_h_hybrid")).unwrap();
    // The Q8_0 file's oracle: the fixture with the same matrices (those 32-multiple wide:
    // ssm_out, attn_output, ffn_down) rounded through ggml's q8_0 blocks, on the CPU.
    let q8_want = {
        use mamba2_wgpu::model::MixerWeights;
        use mamba2_wgpu::model::quant::{pack, unpack};
        use mamba2_wgpu::model::safetensors::Tensor;
        let round = |t: &Tensor| {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let p = pack(WeightFormat::Q8_0, &t.to_f32(), rows, cols);
            Tensor::from_f32(t.name.clone(), t.shape.clone(), &unpack(&p))
        };
        let mut m = st.clone();
        for l in &mut m.weights.layers {
            match &mut l.mixer {
                MixerWeights::Mamba2(w) => w.out_proj = round(&w.out_proj),
                MixerWeights::Attention(w) => w.o = round(&w.o),
                MixerWeights::Mlp(w) => w.down = round(&w.down),
                MixerWeights::Moe(_) => unreachable!(),
            }
        }
        cpu_logits(&m, &prompt)
    };
    // (file, oracle, tolerance): f32 against HF, within float rounding; Q8_0 against the
    // same weights rounded as the file stores them (its blocks differ from HF by 0.36 of a
    // logit range of 20).
    for (file, want, tol) in [
        ("nemotron_h_hybrid.f32.gguf", &want, 1e-4f32),
        ("nemotron_h_hybrid.q8_0.gguf", &q8_want, 1e-4),
    ] {
        let model = Model::load(&dir().join(file)).unwrap();
        let c = &model.config;
        assert_eq!(c.pattern(), st.config.pattern(), "{file}");
        assert_eq!(c.attention, st.config.attention, "{file}");
        assert_eq!(c.mlp, st.config.mlp, "{file}");
        assert_eq!(
            (c.vocab_size, c.n_groups, c.head_dim),
            (101, 2, 12),
            "{file}"
        );
        let got = cpu_logits(&model, &prompt);
        let e = got
            .iter()
            .zip(want.iter())
            .map(|(g, w)| max_abs(g, w))
            .fold(0f32, f32::max);
        assert!(e <= tol, "{file}: CPU max |Δlogit| vs its oracle {e:e}");
        let Some(mut b) = f32_gpu(&model) else {
            return;
        };
        let e = worst(&b.prefill_logits(&prompt).unwrap(), &got);
        assert!(e <= 1e-3, "{file}: GPU vs CPU max |Δlogit| {e:e}");
    }
    // Unknown architectures are refused by name.
    let mut bytes = std::fs::read(dir().join("nemotron_h_hybrid.f32.gguf")).unwrap();
    let at = bytes.windows(10).position(|w| w == b"nemotron_h").unwrap();
    bytes[at..at + 10].copy_from_slice(b"nemotron_x");
    let path = std::env::temp_dir().join(format!("nemotron-x-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let err = Model::load(&path).unwrap_err().to_string();
    assert!(
        err.contains("nemotron_x") || err.contains("general.architecture"),
        "{err}"
    );
}

/// The largest |Δ| between two runs' logits.
fn worst(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| max_abs(g, w))
        .fold(0f32, f32::max)
}

/// A GPU backend running `model` in f32 with f32 KV caches (`None` without a GPU).
fn f32_gpu(model: &Model) -> Option<GpuBackend> {
    let ctx = common::gpu(&Engine::needs(&model.config, WeightFormat::F32))?;
    let opts = EngineOptions {
        format: WeightFormat::F32,
        context: Some(64),
        kv: mamba2_wgpu::gpu::state_store::KvFormat::F32,
        ..Default::default()
    };
    Some(GpuBackend::new(Engine::new(ctx, model, opts).unwrap()).unwrap())
}

/// llama.cpp's `nemotron_h_moe` layout (scripts/make_nemotron_h_gguf.py, from the
/// nemotron_h_moe and nemotron_h_latent fixtures: routing from the `expert_*` keys, the
/// experts stacked per layer, the router's correction bias as `exp_probs_b`, the latent
/// projections as `ffn_latent_{down,up}`) and `granitehybrid` layout
/// (scripts/make_granite_gguf.py, from granite_moe_hybrid: each layer a mixer and an MoE
/// block, gates apart from ups, µP scales from the `*_scale` keys): the config equals the
/// safetensors one, and the logits equal HF transformers' on the CPU reference and, token by
/// token through the decode graph, on the GPU, whose 24 greedy ids are HF's.
#[test]
fn moe_ggufs_match_the_hf_oracle() {
    for (fixture, arch) in [
        ("nemotron_h_moe", "nemotron_h_moe"),
        ("nemotron_h_latent", "nemotron_h_moe"),
        ("granite_moe_hybrid", "granitehybrid"),
    ] {
        let file = format!("{fixture}.f32.gguf");
        let (prompt, want) = hf_oracle(fixture);
        let st = Model::load(&common::fixture(fixture)).unwrap();
        let model = Model::load(&dir().join(&file)).unwrap();
        let c = &model.config;
        assert_eq!(
            c.format.name(),
            format!("GGUF {arch} (llama.cpp)"),
            "{file}"
        );
        assert_eq!(c.blocks, st.config.blocks, "{file}");
        assert_eq!(c.scales, st.config.scales, "{file}");
        assert_eq!(c.tie_embeddings, st.config.tie_embeddings, "{file}");
        // (GGUF holds the attention scale as an f32.)
        let scale_free = |a: &Option<mamba2_wgpu::config::AttentionConfig>| {
            a.clone().map(|a| {
                (
                    a.scale as f32,
                    mamba2_wgpu::config::AttentionConfig { scale: 0.0, ..a },
                )
            })
        };
        assert_eq!(
            scale_free(&c.attention),
            scale_free(&st.config.attention),
            "{file}"
        );
        assert_eq!(c.mlp, st.config.mlp, "{file}");
        assert_eq!(c.moe, st.config.moe, "{file}");
        let e = worst(&cpu_logits(&model, &prompt), &want);
        assert!(e <= 1e-4, "{file}: CPU max |Δlogit| vs HF {e:e}");
        let Some(mut b) = f32_gpu(&model) else {
            continue;
        };
        let e = worst(&b.prefill_logits(&prompt).unwrap(), &want);
        assert!(e <= 1e-4, "{file}: GPU max |Δlogit| vs HF {e:e}");
        let ids = common::session_greedy(Box::new(b), &prompt, 24);
        assert_eq!(
            ids,
            common::oracle_ids(fixture, "greedy_ids"),
            "{file}: greedy ids"
        );
    }
}

/// Where the value of metadata `key` starts in a GGUF file's bytes, checking that its type
/// id (after the name) is `ty` (4 u32, 6 f32, 7 bool).
fn value_at(bytes: &[u8], key: &str, ty: u32) -> usize {
    let at = bytes
        .windows(key.len())
        .position(|w| w == key.as_bytes())
        .unwrap()
        + key.len();
    assert_eq!(&bytes[at..at + 4], &ty.to_le_bytes(), "{key}: type {ty}");
    at + 4
}

/// A `nemotron_h_moe` or `granitehybrid` file with one metadata value or tensor name edited
/// in place: the error names the key or the tensor.
#[test]
fn broken_moe_gguf_files_name_the_key_or_tensor() {
    // A u32 key's value: the 4 bytes after its name and its type.
    let set_u32 = |bytes: &mut Vec<u8>, key: &str, v: u32| {
        let at = value_at(bytes, key, 4);
        bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    };
    let set_bool = |bytes: &mut Vec<u8>, key: &str, v: bool| {
        let at = value_at(bytes, key, 7);
        bytes[at] = u8::from(v);
    };
    let set_f32 = |bytes: &mut Vec<u8>, key: &str, v: f32| {
        let at = value_at(bytes, key, 6);
        bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    };
    let rename = |bytes: &mut Vec<u8>, from: &str, to: &str| {
        assert_eq!(from.len(), to.len());
        let at = bytes
            .windows(from.len())
            .position(|w| w == from.as_bytes())
            .unwrap();
        bytes[at..at + from.len()].copy_from_slice(to.as_bytes());
    };
    type Edit<'a> = Box<dyn Fn(&mut Vec<u8>) + 'a>;
    let moe = "nemotron_h_moe.f32.gguf";
    let granite = "granite_moe_hybrid.f32.gguf";
    let cases: Vec<(&str, &str, Edit<'_>, &str)> = vec![
        (
            granite,
            "a dense Granite file",
            Box::new(|b| set_u32(b, "granitehybrid.expert_count", 0)),
            "without experts",
        ),
        (
            granite,
            "rotary embeddings",
            Box::new(|b| set_bool(b, "granitehybrid.rope.scaling.finetuned", true)),
            "granitehybrid.rope.scaling.finetuned",
        ),
        (
            granite,
            "no rotary switch (llama.cpp: rotary embeddings on)",
            Box::new(|b| {
                rename(
                    b,
                    "granitehybrid.rope.scaling.finetuned",
                    "granitehybrid.rope.scaling.finetunex",
                )
            }),
            "granitehybrid.rope.scaling.finetuned",
        ),
        (
            moe,
            "expert groups without a used-group count",
            Box::new(|b| {
                rename(
                    b,
                    "nemotron_h_moe.expert_group_used_count",
                    "nemotron_h_moe.expert_group_used_counx",
                )
            }),
            "nemotron_h_moe.expert_group_used_count",
        ),
        (
            granite,
            "a missing expert gate",
            Box::new(|b| rename(b, "blk.2.ffn_gate_exps", "blk.2.ffn_gate_expz")),
            "blk.2.ffn_gate_expz",
        ),
        (
            granite,
            "more experts per token than experts",
            Box::new(|b| set_u32(b, "granitehybrid.expert_used_count", 11)),
            "granitehybrid.expert_used_count",
        ),
        (
            moe,
            "more experts per token than experts",
            Box::new(|b| set_u32(b, "nemotron_h_moe.expert_used_count", 17)),
            "nemotron_h_moe.expert_used_count",
        ),
        (
            moe,
            "a group count that does not divide the experts",
            Box::new(|b| set_u32(b, "nemotron_h_moe.expert_group_count", 3)),
            "nemotron_h_moe.expert_group_count",
        ),
        (
            moe,
            "an expert width that the per-layer lengths contradict",
            Box::new(|b| set_u32(b, "nemotron_h_moe.expert_feed_forward_length", 25)),
            "nemotron_h_moe.feed_forward_length",
        ),
        (
            moe,
            "a missing correction bias",
            Box::new(|b| rename(b, "blk.3.exp_probs_b.bias", "blk.3.exp_probs_x.bias")),
            "blk.3.exp_probs_x.bias",
        ),
        // Values the config's checks refuse name the GGUF key, not the transformers field
        // the check is written against.
        (
            granite,
            "attention heads that their key/value heads do not divide",
            Box::new(|b| set_u32(b, "granitehybrid.attention.head_count", 3)),
            "granitehybrid.attention.head_count",
        ),
        (
            granite,
            "a negative attention scale",
            Box::new(|b| set_f32(b, "granitehybrid.attention.scale", -1.0)),
            "granitehybrid.attention.scale",
        ),
        (
            granite,
            "an infinite embedding scale",
            Box::new(|b| set_f32(b, "granitehybrid.embedding_scale", f32::INFINITY)),
            "granitehybrid.embedding_scale",
        ),
        (
            granite,
            "a state size of 0",
            Box::new(|b| set_u32(b, "granitehybrid.ssm.state_size", 0)),
            "granitehybrid.ssm.state_size",
        ),
        (
            moe,
            "a NaN routed-weights scale",
            Box::new(|b| set_f32(b, "nemotron_h_moe.expert_weights_scale", f32::NAN)),
            "nemotron_h_moe.expert_weights_scale",
        ),
        (
            moe,
            "a negative norm epsilon",
            Box::new(|b| set_f32(b, "nemotron_h_moe.attention.layer_norm_rms_epsilon", -1.0)),
            "nemotron_h_moe.attention.layer_norm_rms_epsilon",
        ),
        (
            moe,
            "a missing stack of experts",
            Box::new(|b| rename(b, "blk.1.ffn_down_exps", "blk.1.ffn_down_expz")),
            "blk.1.ffn_down_expz",
        ),
    ];
    for (file, what, edit, names) in cases {
        let mut bytes = std::fs::read(dir().join(file)).unwrap();
        edit(&mut bytes);
        let path = std::env::temp_dir().join(format!("moe-broken-{}.gguf", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let err = Model::load(&path).unwrap_err().to_string();
        assert!(err.contains(names), "{what}: {err}");
        std::fs::remove_file(&path).ok();
    }
}

/// A `granitehybrid` attention scale of 0 means 1/√head_dim, as llama.cpp's graph reads
/// it (its converter writes the key whatever the config holds).
#[test]
fn granite_gguf_attention_scale_of_zero_is_the_default() {
    let key = "granitehybrid.attention.scale";
    let mut bytes = std::fs::read(dir().join("granite_moe_hybrid.f32.gguf")).unwrap();
    let at = value_at(&bytes, key, 6);
    bytes[at..at + 4].copy_from_slice(&0f32.to_le_bytes());
    let path = std::env::temp_dir().join(format!("granite-scale0-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let model = Model::load(&path);
    std::fs::remove_file(&path).ok();
    let a = model.unwrap().config.attention.unwrap();
    assert_eq!(
        a.scale,
        1.0 / (a.head_dim as f64).sqrt(),
        "head_dim {}",
        a.head_dim
    );
}

/// Quantized `nemotron_h_moe` files (scripts/make_nemotron_h_gguf.py's random `moe64`: every
/// matrix but the routers in gguf-py's Q8_0 blocks, the experts stacked; in
/// `moe64.q4_0.gguf`, `.q4_1`, `.q5_0`, `.q5_1` the stacked experts in those blocks) used as
/// stored, the expert banks
/// in the file's own blocks: the GPU's logits equal the CPU reference's on the same file,
/// prefill and decode graph alike, and the Q8_0 file's equal the f32 file's with the same
/// matrices rounded through ggml's q8_0 blocks.
#[test]
fn quantized_nemotron_h_moe_ggufs_run_as_stored() {
    use mamba2_wgpu::gpu::device_weights::DeviceMixer;
    use mamba2_wgpu::gpu::engine::PrefillMode;
    use mamba2_wgpu::model::ggml::GgmlType;
    let f32_model = Model::load(&dir().join("moe64.f32.gguf")).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 101).collect();
    for (file, experts, format) in [
        ("moe64.q8_0.gguf", GgmlType::Q8_0, WeightFormat::Q8_0),
        ("moe64.q4_0.gguf", GgmlType::Q4_0, WeightFormat::Q8_0),
        ("moe64.q5_0.gguf", GgmlType::Q5_0, WeightFormat::Q8_0),
        ("moe64.q4_1.gguf", GgmlType::Q4_1, WeightFormat::Q8_0),
        ("moe64.q5_1.gguf", GgmlType::Q5_1, WeightFormat::Q8_0),
    ] {
        let model = Model::load(&dir().join(file)).unwrap();
        assert_eq!(model.config.pattern(), "ME*E");
        assert_eq!(model.config.moe, f32_model.config.moe);
        let counts = GgufFile::open(&dir().join(file)).unwrap().type_counts();
        let n_of = |t: GgmlType| {
            counts
                .iter()
                .find(|&&(d, _)| d == DType::Quant(t))
                .map_or(0, |&(_, n)| n)
        };
        // The four stacked expert matrices, and the twelve others in Q8_0.
        let others = if experts == GgmlType::Q8_0 {
            0
        } else {
            n_of(experts)
        };
        assert_eq!(n_of(GgmlType::Q8_0) + others, 16, "{counts:?}");
        assert!(n_of(experts) >= 4, "{file}: {counts:?}");
        let want = cpu_logits(&model, &prompt);
        let range = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        if experts == GgmlType::Q8_0 {
            let q8 = |k: usize| {
                if k.is_multiple_of(32) {
                    WeightFormat::Q8_0
                } else {
                    WeightFormat::F32
                }
            };
            let rounded = cpu_logits(&common::rounded(&f32_model, q8), &prompt);
            let e = worst(&rounded, &want);
            assert!(
                e <= 1e-5 * range,
                "CPU: max |Δlogit| {e:e} of range {range}"
            );
        }
        for (prefill, rel, floor) in [
            (PrefillMode::Chunked, 1e-5, 1e-4),
            // The decode graph rounds the activations to 8 bits.
            (PrefillMode::Decode, 2e-2, 0.1),
        ] {
            let Some(ctx) = common::gpu(&Engine::needs(&model.config, format)) else {
                return;
            };
            let opts = EngineOptions {
                format,
                prefill,
                context: Some(64),
                // (An f16 KV cache would move the logits by its own rounding.)
                kv: mamba2_wgpu::gpu::state_store::KvFormat::F32,
                ..Default::default()
            };
            let mut b = GpuBackend::new(Engine::new(ctx, &model, opts).unwrap()).unwrap();
            for l in [1, 3] {
                let DeviceMixer::Moe(m) = &b.engine.weights.layers[l].mixer else {
                    panic!("{file}: layer {l} is an MoE layer");
                };
                // The shared expert's slices (Q8_0 in both files) sit in a bank of
                // their own where the experts' blocks are of another type.
                let routed = model.config.moe.as_ref().unwrap().experts;
                for (first, _, up, down) in m.banks() {
                    let want = if first < routed {
                        experts
                    } else {
                        GgmlType::Q8_0
                    };
                    for bank in [up, down] {
                        assert_eq!(bank.format.ggml(), Some(want), "{file}: {}", bank.name);
                    }
                }
                assert_eq!(m.up.len(), 1 + usize::from(experts != GgmlType::Q8_0));
            }
            let got = b.prefill_logits(&prompt).unwrap();
            let bound = rel * range + floor;
            let per_pos: Vec<f32> = got
                .iter()
                .zip(&want)
                .map(|(g, w)| worst(std::slice::from_ref(g), std::slice::from_ref(w)))
                .collect();
            let e = per_pos.iter().fold(0f32, |m, &v| m.max(v));
            eprintln!("{file} ({prefill:?}): max |Δlogit| {e:e} of range {range:.1}");
            let beyond: Vec<usize> = (0..per_pos.len()).filter(|&p| per_pos[p] > bound).collect();
            if prefill == PrefillMode::Chunked {
                assert!(
                    beyond.is_empty(),
                    "{file} on the GPU ({prefill:?}): max |Δlogit| {e:e} of range {range}"
                );
                continue;
            }
            // The decode graph's 8-bit activations can tip a router's near tie to the other
            // expert at one position (the GPU's decode of moe64.q5_1.gguf spikes at
            // positions 20 and 37, Δ 0.9 and 2.9, its neighbours at the usual 0.04, while
            // its chunked prefill, f32 activations, is within 1e-5 everywhere). The flipped position takes another expert's
            // output; later ones see it only through the state, which moved little. A kernel
            // at fault misses the bound at most positions: here at most two positions may,
            // each alone and within the logits' range.
            assert!(
                beyond.len() <= 2
                    && beyond.iter().all(|&p| {
                        per_pos[p] <= range && per_pos.get(p + 1).is_none_or(|&n| n <= bound)
                    }),
                "{file} on the GPU ({prefill:?}): positions {beyond:?} beyond {bound} \
                 (max |Δlogit| {e:e} of range {range}): {per_pos:?}"
            );
        }
    }
}
