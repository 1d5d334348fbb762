//! GGUF's reader and block formats against external oracles (tests/fixtures/gguf, made by
//! scripts/make_gguf_fixtures.py and scripts/make_nemotron_h_gguf.py): gguf-py's numpy
//! dequantization of every tensor (bit for bit), the k256 files' blocks reaching the
//! device's layout as stored, and the quantizers byte for byte against llama-quantize's
//! blocks (Q8_0, the k-quants) and gguf-py's (the 32-value types). The other GGUF tests:
//! gguf_mamba2.rs and gguf_hybrid.rs (models and logits), gguf_tokenizer.rs (tokenizers
//! from metadata), gguf_broken.rs (broken files) and gguf_cli.rs (the binary on GGUF files);
//! their shared helpers are in common/gguf.rs.

mod common;

use common::gguf::{dir, files, oracle};
use mamba2_wgpu::model::DType;
use mamba2_wgpu::model::gguf::GgufFile;
use serde_json::Value as Json;

fn fnv64(values: &[f32]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for v in values {
        for b in v.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    format!("{h:016x}")
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
