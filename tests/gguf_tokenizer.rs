//! Tokenizers rebuilt from GGUF metadata: `gpt2` metadata written from the embedded model's
//! tokenizer.json against that tokenizer, and SentencePiece (`llama`) metadata
//! (tests/fixtures/gguf/spm*.gguf, made by scripts/make_spm_tokenizer_fixture.py) against
//! SentencePiece's own ids.

mod common;

use std::path::Path;

use common::gguf::dir;
use mamba2_wgpu::model::gguf::{GgufFile, GgufInfo, Value};
use serde_json::Value as Json;

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

/// Metadata a converter would never write is refused naming the key and item, in terms of
/// the GGUF file (it has no tokenizer.json): a merge of pieces that are not tokens, a token
/// type llama.cpp does not define. A string listed twice is not an error (some vocabularies
/// pad with repeats): it keeps its first id.
#[test]
fn malformed_tokenizer_metadata_names_the_key_and_item() {
    let tokens = ["<eos>", "a", "b", "ab", "c"];
    let info = |merges: &[&str], types: &[i32], tokens: &[&str]| GgufInfo {
        path: "bad.gguf".into(),
        version: 3,
        metadata: vec![
            ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::Str("gpt-2".into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(tokens.iter().map(|t| Value::Str(t.to_string())).collect()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(types.iter().map(|&t| Value::I32(t)).collect()),
            ),
            (
                "tokenizer.ggml.merges".into(),
                Value::Array(merges.iter().map(|m| Value::Str(m.to_string())).collect()),
            ),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
        ],
        types: Vec::new(),
        tensors: 0,
        file_len: 0,
    };
    let err = |i: GgufInfo| match mamba2_wgpu::gguf_tokenizer::from_gguf(&i) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    // The control: well-formed metadata builds.
    assert!(
        mamba2_wgpu::gguf_tokenizer::from_gguf(&info(&["a b"], &[3, 1, 1, 1, 1], &tokens))
            .unwrap()
            .is_some()
    );
    for (merges, types, toks, want) in [
        (
            &["a b", "a x"][..],
            &[3, 1, 1, 1, 1][..],
            &tokens[..],
            "bad.gguf: metadata key `tokenizer.ggml.merges`: item 1 `a x`: `x` is not a token",
        ),
        (
            &["a c"],
            &[3, 1, 1, 1, 1],
            &tokens,
            "bad.gguf: metadata key `tokenizer.ggml.merges`: item 0 `a c`: `ac` is not a token",
        ),
        (
            &["a b"],
            &[3, 1, 99, 1, 1],
            &tokens,
            "bad.gguf: metadata key `tokenizer.ggml.token_type`: item 2 is 99, not a llama.cpp token type (0…6)",
        ),
    ] {
        let e = err(info(merges, types, toks));
        assert!(e.contains(want), "{e}\nwanted: {want}");
        assert!(!e.contains("tokenizer.json"), "{e}");
    }
    let repeated = mamba2_wgpu::gguf_tokenizer::from_gguf(&info(
        &["a b"],
        &[3, 1, 1, 1, 1],
        &["<eos>", "a", "b", "ab", "a"],
    ))
    .unwrap()
    .unwrap();
    assert_eq!(repeated.encode("aba").unwrap(), vec![3, 1]);
}

/// A character no token stands for is refused, named, rather than left out (what the
/// `tokenizers` BPE model does without byte tokens or an unknown token): in a `gpt2`
/// vocabulary without the character's byte, and in a `llama` one without byte tokens or
/// `<unk>`, also where a user-defined token follows it (whose span the dropped character
/// would shift). With the byte tokens, or with `<unk>`, the same text is tokenized through
/// them.
#[test]
fn a_character_without_a_token_is_refused_not_dropped() {
    let info = |model: &str, tokens: &[&str], types: &[i32], extra: Vec<(String, Value)>| {
        let mut metadata = vec![
            ("tokenizer.ggml.model".into(), Value::Str(model.into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(tokens.iter().map(|t| Value::Str(t.to_string())).collect()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(types.iter().map(|&t| Value::I32(t)).collect()),
            ),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
        ];
        metadata.extend(extra);
        GgufInfo {
            path: "vocab.gguf".into(),
            version: 3,
            metadata,
            types: Vec::new(),
            tensors: 0,
            file_len: 0,
        }
    };
    let build = |i: GgufInfo| mamba2_wgpu::gguf_tokenizer::from_gguf(&i).unwrap().unwrap();
    // gpt2: byte-level `a`, `b` and `Ġ` (the space) only.
    let gpt2 = build(info(
        "gpt2",
        &["<eos>", "a", "b", "Ġ"],
        &[3, 1, 1, 1],
        vec![
            ("tokenizer.ggml.pre".into(), Value::Str("gpt-2".into())),
            ("tokenizer.ggml.merges".into(), Value::Array(vec![])),
        ],
    ));
    assert_eq!(gpt2.encode("ab a").unwrap(), vec![1, 2, 3, 1]);
    let e = gpt2.encode("ab c").unwrap_err().to_string();
    assert!(e.contains("'c' (U+0063, byte 3)"), "{e}");
    // llama (SentencePiece BPE, no BOS key: none added): `▁`, `a`, `b`; `€` is three bytes.
    let scores = |n: usize| {
        (
            "tokenizer.ggml.scores".to_string(),
            Value::Array((0..n).map(|i| Value::F32(-(i as f32))).collect()),
        )
    };
    let plain = ["<s>", "</s>", "▁", "a", "b"];
    let spm = build(info(
        "llama",
        &plain,
        &[3, 3, 1, 1, 1],
        vec![scores(plain.len())],
    ));
    assert_eq!(spm.encode("a b").unwrap(), vec![2, 3, 2, 4]);
    let e = spm.encode("a€b").unwrap_err().to_string();
    assert!(e.contains("'€' (U+20AC, byte 1)"), "{e}");
    // An added token's text never reaches the model: `<`, `/`, `s`, `>` need no tokens.
    let ids = spm.encode("a</s>b").unwrap();
    assert!(ids.contains(&1) && ids.contains(&4), "{ids:?}");
    // `▁` as a user-defined (added) token after the dropped `€`.
    let spm = build(info(
        "llama",
        &plain,
        &[3, 3, 4, 1, 1],
        vec![scores(plain.len())],
    ));
    let e = spm.encode("a€ b").unwrap_err().to_string();
    assert!(e.contains("'€' (U+20AC, byte 1)"), "{e}");
    // With the byte tokens: `€` as <0xE2> <0x82> <0xAC>.
    let bytes = ["<s>", "</s>", "▁", "a", "b", "<0xE2>", "<0x82>", "<0xAC>"];
    let spm = build(info(
        "llama",
        &bytes,
        &[3, 3, 1, 1, 1, 6, 6, 6],
        vec![scores(bytes.len())],
    ));
    assert_eq!(spm.encode("a€b").unwrap(), vec![2, 3, 5, 6, 7, 4]);
    assert_eq!(spm.decode(&[2, 3, 5, 6, 7, 4]).unwrap(), "a€b");
    // With `<unk>`: `€` as it.
    let unk = ["<s>", "</s>", "▁", "a", "b", "<unk>"];
    let spm = build(info(
        "llama",
        &unk,
        &[3, 3, 1, 1, 1, 2],
        vec![
            scores(unk.len()),
            ("tokenizer.ggml.unknown_token_id".into(), Value::U32(5)),
        ],
    ));
    assert_eq!(spm.encode("a€b").unwrap(), vec![2, 3, 5, 4]);
}

/// A `llama` vocabulary whose normal tokens' splits into merges would take more than any
/// real vocabulary (a chain "a", "aa", …: k²/2 merges of k³/3 bytes; one token of 300 000
/// bytes: seconds of hashing) is refused naming `tokenizer.ggml.tokens`, before the merges
/// are built; a short chain builds.
#[test]
fn a_llama_vocabulary_too_costly_to_split_is_refused() {
    let info = |tokens: Vec<String>| {
        let n = tokens.len();
        GgufInfo {
            path: "costly.gguf".into(),
            version: 3,
            metadata: vec![
                ("tokenizer.ggml.model".into(), Value::Str("llama".into())),
                (
                    "tokenizer.ggml.tokens".into(),
                    Value::Array(tokens.into_iter().map(Value::Str).collect()),
                ),
                (
                    "tokenizer.ggml.scores".into(),
                    Value::Array((0..n).map(|i| Value::F32(-(i as f32))).collect()),
                ),
                (
                    "tokenizer.ggml.token_type".into(),
                    Value::Array(
                        (0..n)
                            .map(|i| Value::I32(if i == 0 { 2 } else { 1 }))
                            .collect(),
                    ),
                ),
                ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
                ("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)),
            ],
            types: Vec::new(),
            tensors: 0,
            file_len: 0,
        }
    };
    let chain = |k: usize| {
        std::iter::once("<unk>".to_string())
            .chain((1..=k).map(|j| "a".repeat(j)))
            .collect::<Vec<_>>()
    };
    let short = mamba2_wgpu::gguf_tokenizer::from_gguf(&info(chain(40)))
        .unwrap()
        .unwrap();
    assert_eq!(short.encode("aaaa").unwrap(), vec![4]);
    for (name, tokens) in [
        ("chain", chain(800)),
        ("long", vec!["<unk>".to_string(), "b".repeat(300_000)]),
    ] {
        let t0 = std::time::Instant::now();
        let e = match mamba2_wgpu::gguf_tokenizer::from_gguf(&info(tokens)) {
            Ok(_) => panic!("{name}: accepted"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("costly.gguf: metadata key `tokenizer.ggml.tokens`")
                && e.contains("past the 134217728"),
            "{name}: {e}"
        );
        assert!(t0.elapsed().as_secs() < 5, "{name}: {:?}", t0.elapsed());
    }
}
