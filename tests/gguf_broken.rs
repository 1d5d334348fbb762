//! Broken GGUF files against clear errors: `g1.f32.gguf` truncated, with an offset past the
//! end, an unsupported or undefined type, a misaligned tensor, a missing key, a bad magic
//! or tensor count, a `general.alignment` of the wrong type or value, cut at every point of
//! its header and with random header bytes (loads or clean errors, never a panic);
//! `nemotron_h_moe` and `granitehybrid` files with one metadata value or tensor name edited
//! (the error names the key or tensor); and a `granitehybrid` attention scale of 0 (the
//! default, as llama.cpp reads it); a metadata array past the items any vocabulary needs.

mod common;

use std::path::{Path, PathBuf};

use common::gguf::{dir, info_at, with_key};
use mamba2_wgpu::model::Model;
use mamba2_wgpu::model::gguf::GgufFile;
use mamba2_wgpu::reference::{CpuModel, Logits, Scan};

/// A copy of `g1.f32.gguf` with `edit` applied, written to a temporary file.
fn broken(name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(dir().join("g1.f32.gguf")).unwrap();
    edit(&mut bytes);
    let path = std::env::temp_dir().join(format!("mamba2-gguf-{}-{name}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    path
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
    // A metadata array of 2^23 + 1 u8 items, every one of them in the file (8 MiB): each
    // item is a 32-byte value once read, so the file's size alone does not bound the
    // memory (a 1 GiB array asked for 32 GiB and aborted). Refused naming the key.
    let g1 = dir().join("g1.f32.gguf");
    let n = (1u64 << 23) + 1;
    let value = [
        &0u32.to_le_bytes()[..],
        &n.to_le_bytes(),
        &vec![7u8; n as usize],
    ]
    .concat();
    let e = load_error(&broken("big-array", |b| {
        *b = with_key(&g1, "test.big", 9, &value);
    }));
    assert!(
        e.contains("metadata key `test.big`") && e.contains("past 8388608 items"),
        "{e}"
    );
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
    // Item `i` of an array of i32 (type 9, items of type 5) under `key`.
    let set_item = |bytes: &mut Vec<u8>, key: &str, i: usize, v: i32| {
        let at = value_at(bytes, key, 9);
        assert_eq!(&bytes[at..at + 4], &5u32.to_le_bytes(), "{key}: i32 items");
        let item = at + 12 + 4 * i;
        bytes[item..item + 4].copy_from_slice(&v.to_le_bytes());
    };
    type Edit<'a> = Box<dyn Fn(&mut Vec<u8>) + 'a>;
    let moe = "nemotron_h_moe.f32.gguf";
    let hybrid = "nemotron_h_hybrid.f32.gguf";
    let granite = "granite_moe_hybrid.f32.gguf";
    let cases: Vec<(&str, &str, Edit<'_>, &str)> = vec![
        (
            moe,
            "a vocabulary size the embedding contradicts",
            Box::new(|b| set_u32(b, "nemotron_h_moe.vocab_size", 50)),
            "nemotron_h_moe.vocab_size`: 50 tokens, but token_embd.weight has 101 rows",
        ),
        (
            granite,
            "a context of no tokens",
            Box::new(|b| set_u32(b, "granitehybrid.context_length", 0)),
            "granitehybrid.context_length`: must be at least 1",
        ),
        (
            hybrid,
            "a context past what the engine counts (2^24 positions)",
            Box::new(|b| set_u32(b, "nemotron_h.context_length", (1 << 24) + 1)),
            "nemotron_h.context_length",
        ),
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
            hybrid,
            "an attention layer's key/value heads set to 0 (so a Mamba2 layer by the keys)",
            Box::new(|b| set_item(b, "nemotron_h.attention.head_count_kv", 1, 0)),
            "they make layer 1 a block of kind `mamba2` (nemotron_h.feed_forward_length[1] = \
             0, nemotron_h.attention.head_count_kv[1] = 0), but its tensors are of kind \
             `attention` (blk.1.attn_q.weight)",
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
