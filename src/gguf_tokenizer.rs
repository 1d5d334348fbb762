//! A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) rebuilt as a `tokenizers`
//! tokenizer, by writing the `tokenizer.json` it stands for and loading that through the
//! same checked path as a real one:
//! - `gpt2`: byte-level BPE from `tokens` and `merges`, with the pre-tokenizer regex
//!   `tokenizer.ggml.pre` names (the GPT-2 split for the GPT-2/NeoX family, the Llama-3
//!   split for its family; another name is refused rather than tokenized wrongly);
//! - `llama`: SentencePiece BPE, merges ranked by the `scores` of the merged pieces (how
//!   llama.cpp's SPM tokenizer picks them), `▁` for spaces, one `▁` in front of the text
//!   unless `tokenizer.ggml.add_space_prefix` is false, and byte fallback `<0xNN>`.
//!
//! Token types (llama.cpp's `token_type`): 3 control and 4 user-defined tokens become added
//! tokens (control ones special). The chat template is `tokenizer.chat_template`. A text
//! with a character that no token stands for (a vocabulary without the byte tokens or an
//! unknown token) is refused, naming the character, rather than tokenized without it.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use serde_json::{Value as Json, json};

use crate::error::{Error, Result};
use crate::model::gguf::{GgufInfo, Value};
use crate::tokenizer::{Covers, Tokenizer};

/// The keys without which a GGUF file has no tokenizer of its own.
const REQUIRED: [&str; 2] = ["tokenizer.ggml.model", "tokenizer.ggml.tokens"];

/// `tokenizer.ggml.pre` names whose pre-tokenizer is GPT-2's regex (`ByteLevel`'s own).
const GPT2_SPLIT: [&str; 8] = [
    "default",
    "gpt-2",
    "gpt2",
    "mpt",
    "olmo",
    "starcoder",
    "refact",
    "codeshell",
];
/// Names whose pre-tokenizer is Llama 3's regex.
const LLAMA3_SPLIT: [&str; 4] = ["llama3", "llama-v3", "llama-bpe", "smaug-bpe"];
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer of the GGUF model `path` names (the file, or the directory holding it): a
/// `tokenizer.json` beside the file wins over the metadata (a model's own tokenizer.json
/// is the exact one; the metadata is a rebuild of it). `None`: neither.
pub fn for_gguf_model(path: &Path, info: &GgufInfo) -> Result<Option<Tokenizer>> {
    let beside = if path.is_dir() {
        Some(path)
    } else {
        path.parent()
    };
    match beside.filter(|d| d.join("tokenizer.json").is_file()) {
        Some(dir) => Tokenizer::from_dir(dir),
        None => from_gguf(info),
    }
}

/// Why a GGUF model has no tokenizer (`for_gguf_model` gave `None`), for the commands that
/// need text: the file, the `tokenizer.ggml.*` keys it lacks, and where a tokenizer.json
/// would be read.
pub fn missing(info: &GgufInfo) -> String {
    let lacks: Vec<String> = REQUIRED
        .iter()
        .filter(|k| info.get(k).is_none())
        .map(|k| format!("`{k}`"))
        .collect();
    format!(
        "{} has no tokenizer: its metadata lacks {} and no tokenizer.json lies beside it",
        info.path.display(),
        lacks.join(" and ")
    )
}

/// The tokenizer of a GGUF file, or `None` when it has no `tokenizer.ggml.model`.
pub fn from_gguf(info: &GgufInfo) -> Result<Option<Tokenizer>> {
    let path = info.path.display();
    let err =
        |key: &str, why: String| Error::Tokenizer(format!("{path}: metadata key `{key}`: {why}"));
    let Some(model) = info.get("tokenizer.ggml.model") else {
        return Ok(None);
    };
    let model = model
        .as_str()
        .ok_or_else(|| err("tokenizer.ggml.model", "expected a string".into()))?;
    let strings = |key: &str| -> Result<Vec<String>> {
        match info.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        err(
                            key,
                            format!("item {i} is a {}, not a string", v.type_name()),
                        )
                    })
                })
                .collect(),
            Some(v) => Err(err(
                key,
                format!("expected an array of strings, found {}", v.type_name()),
            )),
            None => Err(err(key, "missing".into())),
        }
    };
    let numbers = |key: &str, n: usize| -> Result<Option<Vec<f64>>> {
        match info.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) if items.len() == n => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_f64()
                        .ok_or_else(|| err(key, format!("item {i} is not a number")))
                })
                .collect::<Result<Vec<f64>>>()
                .map(Some),
            Some(Value::Array(items)) => {
                Err(err(key, format!("{} items for {n} tokens", items.len())))
            }
            Some(v) => Err(err(
                key,
                format!("expected an array, found {}", v.type_name()),
            )),
        }
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let n = tokens.len();
    let types = numbers("tokenizer.ggml.token_type", n)?.unwrap_or_else(|| vec![1.0; n]);
    // llama.cpp's types: 0 undefined, 1 normal, 2 unknown, 3 control, 4 user-defined,
    // 5 unused, 6 byte. Another value is a file no converter wrote: its tokens would be
    // taken as normal ones without a word.
    if let Some((i, t)) = types
        .iter()
        .enumerate()
        .find(|(_, t)| !(t.fract() == 0.0 && (0.0..=6.0).contains(*t)))
    {
        return Err(err(
            "tokenizer.ggml.token_type",
            format!("item {i} is {t}, not a llama.cpp token type (0…6)"),
        ));
    }
    let id = |key: &str| -> Result<Option<u32>> {
        match info.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(i) if (i as usize) < n => Ok(Some(i as u32)),
                _ => Err(err(
                    key,
                    format!("{} is not a token id below {n}", v.summary()),
                )),
            },
        }
    };
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let unk = id("tokenizer.ggml.unknown_token_id")?;
    // A flag of another type is refused: read as its default it would tokenize wrongly
    // without a word.
    let opt_flag = |key: &str, default: bool| -> Result<bool> {
        match info.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(err(
                key,
                format!("expected a bool, found {} {}", v.type_name(), v.summary()),
            )),
        }
    };

    let mut vocab = serde_json::Map::new();
    for (i, t) in tokens.iter().enumerate() {
        // A repeated string keeps its first id (the BPE model maps strings to one id).
        vocab.entry(t.clone()).or_insert(json!(i));
    }
    let added: Vec<Json> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, ty))| **ty == 3.0 || **ty == 4.0)
        .map(|(i, (t, ty))| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": *ty == 3.0})
        })
        .collect();
    let (tok_json, add_bos_default) = match model {
        "gpt2" => {
            let merges: Vec<Json> = strings("tokenizer.ggml.merges")?
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let bad =
                        |why: String| err("tokenizer.ggml.merges", format!("item {i} `{m}`{why}"));
                    let (a, b) = m
                        .split_once(' ')
                        .ok_or_else(|| bad(" is not two pieces".into()))?;
                    // Both pieces and their join must be tokens (the BPE model maps merges
                    // to ids): said here, in the file's terms.
                    match [a, b, &format!("{a}{b}")]
                        .into_iter()
                        .find(|t| !vocab.contains_key(*t))
                    {
                        Some(t) => Err(bad(format!(": `{t}` is not a token"))),
                        None => Ok(json!([a, b])),
                    }
                })
                .collect::<Result<_>>()?;
            let pre = info
                .get("tokenizer.ggml.pre")
                .and_then(Value::as_str)
                .unwrap_or("default");
            let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                                    "trim_offsets": true, "use_regex": true});
            let pre_tokenizer = if GPT2_SPLIT.contains(&pre) {
                byte_level
            } else if LLAMA3_SPLIT.contains(&pre) {
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX},
                     "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                     "use_regex": false}]})
            } else {
                return Err(err(
                    "tokenizer.ggml.pre",
                    format!(
                        "pre-tokenizer `{pre}` is not known to this engine (known: {}, {}): put \
                         the model's tokenizer.json beside the .gguf file",
                        GPT2_SPLIT.join(", "),
                        LLAMA3_SPLIT.join(", ")
                    ),
                ));
            };
            let model = json!({"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges});
            (
                json!({"version": "1.0", "truncation": null, "padding": null,
                    "added_tokens": added, "normalizer": null, "pre_tokenizer": pre_tokenizer,
                    "post_processor": null,
                    "decoder": {"type": "ByteLevel", "add_prefix_space": true,
                                "trim_offsets": true, "use_regex": true},
                    "model": model}),
                false,
            )
        }
        "llama" => {
            let scores = numbers("tokenizer.ggml.scores", n)?.ok_or_else(|| {
                err(
                    "tokenizer.ggml.scores",
                    "missing (a `llama` vocabulary ranks its merges by them)".into(),
                )
            })?;
            let merges = spm_merges(&tokens, &scores, &types)
                .map_err(|why| err("tokenizer.ggml.tokens", why))?;
            let unk_token = unk.map(|u| tokens[u as usize].clone());
            // llama.cpp (src/llama-vocab.cpp, `llama_vocab::impl::load`) sets
            // `add_space_prefix = true` for SPM vocabularies and then reads
            // `tokenizer.ggml.add_space_prefix` as an optional override; its detokenizer
            // removes the leading space only when the prefix was added. Both follow it here.
            let space_prefix = opt_flag("tokenizer.ggml.add_space_prefix", true)?;
            let mut normalizers =
                vec![json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})];
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if space_prefix {
                normalizers.insert(0, json!({"type": "Prepend", "prepend": "▁"}));
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            let model = json!({"type": "BPE", "dropout": null, "unk_token": unk_token,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": merges});
            (
                json!({"version": "1.0", "truncation": null, "padding": null,
                    "added_tokens": added,
                    "normalizer": {"type": "Sequence", "normalizers": normalizers},
                    "pre_tokenizer": null, "post_processor": null,
                    "decoder": {"type": "Sequence", "decoders": decoders},
                    "model": model}),
                true,
            )
        }
        other => {
            return Err(err(
                "tokenizer.ggml.model",
                format!("tokenizer type `{other}` is not supported (gpt2 and llama are)"),
            ));
        }
    };
    let mut tok_json = tok_json;
    let add_bos = opt_flag("tokenizer.ggml.add_bos_token", add_bos_default)?;
    if let Some(b) = bos.filter(|_| add_bos) {
        let text = &tokens[b as usize];
        tok_json["post_processor"] = json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": text, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": text, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {text.clone(): {"id": text, "ids": [b], "tokens": [text]}}});
    }
    let template = match info.get("tokenizer.chat_template") {
        None => None,
        Some(v) => Some(v.as_str().ok_or_else(|| {
            err(
                "tokenizer.chat_template",
                format!("{} is not a string", v.summary()),
            )
        })?),
    };
    let config = json!({
        "eos_token": eos.map(|e| tokens[e as usize].clone()),
        "bos_token": bos.map(|b| tokens[b as usize].clone()),
        "chat_template": template,
    });
    let bytes = serde_json::to_vec(&tok_json).expect("JSON of plain values");
    let tok = Tokenizer::from_bytes(&bytes, Some(&config)).map_err(|e| {
        Error::Tokenizer(format!("{path}: the tokenizer its metadata describes: {e}"))
    })?;
    // (A vocabulary without byte tokens or an unknown token leaves out what it has no token
    // for: refused instead.)
    Ok(Some(match coverage(model, &tokens, unk.is_some()) {
        Some(covers) => tok.refusing_uncovered(covers),
        None => tok,
    }))
}

/// Which characters of a text the `model` (`gpt2` or `llama`) over `tokens` can tokenize,
/// where it cannot tokenize them all (None where it can: every byte has a token, or there
/// is an unknown token). The BPE model starts from one symbol per character and leaves out
/// a character that is no token, whose bytes are not all byte tokens, when the vocabulary
/// has no unknown token: `gpt2` sees each byte of the text as its byte-level character,
/// `llama` sees spaces as `▁` and falls back to the `<0xNN>` tokens.
fn coverage(model: &str, tokens: &[String], has_unk: bool) -> Option<Covers> {
    let vocab: HashSet<&str> = tokens.iter().map(String::as_str).collect();
    match model {
        "gpt2" => {
            // (Bytes no UTF-8 text holds, C0, C1 and F5…FF, need no token.)
            let has: Vec<bool> = (0..=255u8)
                .map(|b| {
                    matches!(b, 0xC0 | 0xC1 | 0xF5..=0xFF)
                        || vocab.contains(byte_level_char(b).to_string().as_str())
                })
                .collect();
            has.contains(&false)
                .then(|| -> Covers { Arc::new(move |c| bytes_in(c, &has)) })
        }
        _ if has_unk => None,
        _ => {
            let byte_tokens: Vec<bool> = (0..=255u8)
                .map(|b| vocab.contains(format!("<0x{b:02X}>").as_str()))
                .collect();
            if !byte_tokens.contains(&false) {
                return None;
            }
            let chars: HashSet<char> = tokens
                .iter()
                .filter_map(|t| {
                    let mut it = t.chars();
                    match (it.next(), it.next()) {
                        (Some(c), None) => Some(c),
                        _ => None,
                    }
                })
                .collect();
            Some(Arc::new(move |c| {
                let c = if c == ' ' { '▁' } else { c };
                chars.contains(&c) || bytes_in(c, &byte_tokens)
            }))
        }
    }
}

/// Whether every UTF-8 byte of `c` is marked in `has` (256 entries, one per byte value).
fn bytes_in(c: char, has: &[bool]) -> bool {
    let mut buf = [0u8; 4];
    c.encode_utf8(&mut buf).bytes().all(|b| has[b as usize])
}

/// GPT-2's byte-level alphabet: the printable Latin-1 bytes stand for themselves, the
/// others for 256 + their rank among them (`Ġ` for the space).
fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 33..=126 | 161..=172 | 174..=255);
    if printable(b) {
        return b as char;
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("below 0x200")
}

/// What `spm_merges` may cost: the sum over normal tokens of their length in bytes squared,
/// which bounds both the hashing of their splits' pieces and the bytes of the merges that
/// hold them (a chain of tokens "a", "aa", … of k tokens makes k²/2 merges of k³/3 bytes in
/// all). Real vocabularies stay far below: 262 144 tokens of mostly under 16 bytes sum to
/// tens of millions.
const SPM_SPLIT_BYTES: u64 = 1 << 27;

/// SentencePiece-BPE merges: every split of a normal token into two tokens, ranked by the
/// merged token's score (best first), then by the pieces' ids. A vocabulary whose splits
/// would cost more than `SPM_SPLIT_BYTES` is refused (the error says why).
fn spm_merges(
    tokens: &[String],
    scores: &[f64],
    types: &[f64],
) -> std::result::Result<Vec<Json>, String> {
    let normal = || tokens.iter().zip(types).filter(|(_, t)| **t == 1.0);
    let cost = normal().fold(0u64, |a, (t, _)| {
        a.saturating_add((t.len() as u64).saturating_mul(t.len() as u64))
    });
    if cost > SPM_SPLIT_BYTES {
        let longest = normal().map(|(t, _)| t.len()).max().unwrap_or(0);
        return Err(format!(
            "the normal tokens' splits into merges would take {cost} bytes (Σ length², the \
             longest token {longest} bytes), past the {SPM_SPLIT_BYTES} any real \
             SentencePiece vocabulary needs"
        ));
    }
    let ids: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .rev()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut merges: Vec<(f64, usize, usize)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if types[i] != 1.0 {
            continue;
        }
        for (at, _) in t.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (ids.get(&t[..at]), ids.get(&t[at..])) {
                merges.push((scores[i], l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    Ok(merges
        .into_iter()
        .map(|(_, l, r)| json!([tokens[l], tokens[r]]))
        .collect())
}
