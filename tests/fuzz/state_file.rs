use super::*;
use crate::safetensors::safetensors_file;
use mamba2_wgpu::chat::Chat;
use mamba2_wgpu::prefix_cache::{CacheConfig, PrefixCache};
use mamba2_wgpu::state_file::{self, SavedState, StateDtype, StateKey};
use mamba2_wgpu::{CpuBackend, CpuModel, GenerateOptions, Session, assets};

// ---------------------------------------------------------------------------------------
// Saved states: `mamba2 chat --save/--resume` files and the prefix cache's `--cache-dir`
// ---------------------------------------------------------------------------------------
//
// A saved state comes back from a file a user may have been handed (a conversation to
// resume) or a cache directory restored from elsewhere, so it is read as hostile input.
// The inputs are real states written by `state_file::save` — a chat with the embedded
// model (its conversation in `mamba2.extra`) and a session of the hybrid fixture (KV rows,
// the fed tokens recorded) — in f32 and f16, then damaged. For any input: no panic, hang
// or allocation over budget in `read_header`, `load`, the prefix cache's listing and
// resume, or the chat or session that continues from a file that loaded; every error of
// `load` names the file; a single damage that must be refused is, naming its field or
// tensor; a state that loads fits the model, holds finite values and a position the
// device's 32-bit counters can carry.

const FILE: &str = "state.safetensors";

struct Base {
    name: &'static str,
    model: Model,
    /// With a tokenizer, the file holds a chat and a `Chat` resumes it.
    tokenizer: Option<Tokenizer>,
    key: StateKey,
    /// The metadata and tensors as saved: f32, then f16.
    files: [Parsed; 2],
}

/// A state file taken apart: its metadata and its tensors (name, dtype, shape, bytes).
#[derive(Clone, Debug)]
struct Parsed {
    meta: BTreeMap<String, String>,
    tensors: Vec<(String, String, serde_json::Value, Vec<u8>)>,
}

fn parse(bytes: &[u8]) -> Parsed {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut meta = BTreeMap::new();
    let mut tensors = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            meta = serde_json::from_value(info).unwrap();
            continue;
        }
        let off: Vec<usize> = serde_json::from_value(info["data_offsets"].clone()).unwrap();
        tensors.push((
            name,
            info["dtype"].as_str().unwrap().to_string(),
            info["shape"].clone(),
            data[off[0]..off[1]].to_vec(),
        ));
    }
    Parsed { meta, tensors }
}

fn unparse(p: &Parsed) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::to_value(&p.meta).unwrap(),
    );
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in &p.tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let text = serde_json::to_string(&header).unwrap();
    safetensors_file(text.as_bytes(), None, &data)
}

fn key_of(model: &Model) -> StateKey {
    StateKey {
        model: model.fingerprint(),
        format: "f32".into(),
        blocks: model.config.pattern(),
    }
}

fn cpu_session(model: &Model) -> Session {
    Session::new(Box::new(CpuBackend::new(
        CpuModel::<f32>::new(&model.config, &model.weights).unwrap(),
    )))
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: n,
        ..Default::default()
    }
}

/// Both dtypes of `saved`, written by `state_file::save` and read back as bytes.
fn save_both(model: &Model, key: &StateKey, saved: &SavedState) -> [Parsed; 2] {
    let scratch = Scratch::new();
    let path = scratch.0.join(FILE);
    [StateDtype::F32, StateDtype::F16].map(|dtype| {
        state_file::save(&path, key, saved, dtype, &model.config).unwrap();
        parse(&std::fs::read(&path).unwrap())
    })
}

static BASES: LazyLock<Vec<Base>> = LazyLock::new(|| {
    // A two-turn chat with the embedded model (a template, so the saved conversation has
    // its rendering in `fed`).
    let (model, mut tok) = assets::embedded().unwrap();
    tok.chat_template = Some(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
         {% if add_generation_prompt %}assistant: {% endif %}"
            .into(),
    );
    let mut chat = Chat::new(cpu_session(&model), tok.clone());
    chat.say("Hello there", &greedy(3), |_| true).unwrap();
    chat.say("And then?", &greedy(2), |_| true).unwrap();
    let saved = chat.export().unwrap();
    let key = key_of(&model);
    let chat_files = save_both(&model, &key, &saved);
    let chat_base = Base {
        name: "embedded chat",
        files: chat_files,
        key,
        tokenizer: Some(tok),
        model,
    };
    // The hybrid fixture after a prompt and a reply: KV rows, and the tokens fed.
    let model = Model::load(&manifest("tests/fixtures/nemotron_h_hybrid")).unwrap();
    let mut session = cpu_session(&model);
    let prompt = [3u32, 1, 4, 1, 5];
    let (reply, _) = session.generate(&prompt, &greedy(3), |_| true).unwrap();
    let state = session.backend().state().unwrap();
    let mut tokens = prompt.to_vec();
    tokens.extend_from_slice(&reply[..reply.len() - 1]);
    assert_eq!(tokens.len(), state.len, "the tokens fed");
    let key = key_of(&model);
    let saved = SavedState {
        state,
        tokens,
        extra: None,
    };
    let files = save_both(&model, &key, &saved);
    vec![
        chat_base,
        Base {
            name: "hybrid session",
            files,
            key,
            tokenizer: None,
            model,
        },
    ]
});

/// The header fields (`state_file`'s names) and whether a file must carry them.
const FIELDS: &[(&str, bool)] = &[
    ("mamba2.kind", true),
    ("mamba2.layout", true),
    ("mamba2.engine", true),
    ("mamba2.model", true),
    ("mamba2.format", true),
    ("mamba2.blocks", true),
    ("mamba2.position", true),
    ("mamba2.dtype", true),
    ("mamba2.tokens", true),
    ("mamba2.extra", false),
];

/// Values a field is set to (`$…` are worked out from the file).
const VALUES: &[&str] = &[
    "",
    "0",
    "1",
    "-1",
    " 8",
    "8 ",
    "1e3",
    "0x10",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "f32",
    "f16",
    "bf16",
    "F32",
    "sequence-state",
    "2",
    "0.0.0",
    "q8_0",
    "MMMM",
    "M*M-",
    "1,2,3",
    "1,,2",
    "1,2,",
    "4294967296,1",
    "é",
    "\u{0}",
    "$position+1",
    "$position-1",
    "$tokens+1",
    "$tokens-1",
    "$tokens_huge_id",
    "$long_list",
];

/// Conversations put in `mamba2.extra`.
const EXTRAS: &[&str] = &[
    "",
    "null",
    "{}",
    "[]",
    "{\"x\":1}",
    "{\"messages\":[],\"fed\":\"\",\"last_finish\":null,\"pending\":null}",
    "{\"messages\":[[\"user\",\"hi\"]],\"fed\":\"user: hi\\n\",\"last_finish\":\"Stop\",\"pending\":4294967295}",
    "{\"messages\":[[\"user\",\"hi\"]],\"fed\":\"\",\"last_finish\":\"Length\",\"pending\":0}",
    "{\"messages\":[[\"user\"]],\"fed\":\"\",\"last_finish\":null,\"pending\":null}",
    "{\"messages\":[[\"\\u0000\",\"\\ud800\"]],\"fed\":\"x\",\"last_finish\":\"Nope\",\"pending\":null}",
    "{\"messages\":[[\"user\",\"hi\"]],\"fed\":\"user: hi\\nassistant: \",\"last_finish\":\"ContextFull\",\"pending\":-1}",
    "{\"messages\":[[\"user\",\"hi\"]],\"fed\":7,\"last_finish\":null,\"pending\":null}",
    "$many_messages",
    "$deep",
];

const DTYPES: &[&str] = &["F32", "F16", "BF16", "F64", "I32", "U8", "BOOL", "Q8"];

/// Special values written into a tensor.
const SPECIALS: &[f32] = &[
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    1e30,
    -0.0,
    65504.0,
];

#[derive(Clone, Debug)]
enum StateOp {
    Meta(usize, usize),
    DropMeta(usize),
    Extra(usize),
    Retype(Index, usize),
    /// 0: split the first dimension in two, 1: one more value's worth of shape, 2: a
    /// scalar, 3: empty, 4: huge, 5: a trailing 1.
    Reshape(Index, usize),
    /// 0: another layer's name, 1: a layer past the model, 2: a name the model never has.
    Rename(Index, usize),
    Drop(Index),
    /// Another copy of a tensor under a new name (an unknown tensor).
    Dup(Index),
    Value(Index, Index, usize),
}

fn state_op() -> impl Strategy<Value = StateOp> {
    prop_oneof![
        4 => (0..FIELDS.len(), 0..VALUES.len()).prop_map(|(f, v)| StateOp::Meta(f, v)),
        1 => (0..FIELDS.len()).prop_map(StateOp::DropMeta),
        2 => (0..EXTRAS.len()).prop_map(StateOp::Extra),
        1 => (any::<Index>(), 0..DTYPES.len()).prop_map(|(i, d)| StateOp::Retype(i, d)),
        1 => (any::<Index>(), 0..6usize).prop_map(|(i, s)| StateOp::Reshape(i, s)),
        1 => (any::<Index>(), 0..3usize).prop_map(|(i, r)| StateOp::Rename(i, r)),
        1 => any::<Index>().prop_map(StateOp::Drop),
        1 => any::<Index>().prop_map(StateOp::Dup),
        2 => (any::<Index>(), any::<Index>(), 0..SPECIALS.len())
            .prop_map(|(t, e, s)| StateOp::Value(t, e, s)),
    ]
}

#[derive(Clone, Debug)]
struct StateCase {
    base: usize,
    f16: bool,
    ops: Vec<StateOp>,
    bytes: Vec<ByteOp>,
}

struct Built {
    base: usize,
    file: Vec<u8>,
    /// A single damage a reader must refuse, and a word its error must then hold (the
    /// field or tensor) where one is certain.
    must_fail: Option<(String, Option<String>)>,
    ops: String,
}

fn value_text(v: &str, p: &Parsed) -> String {
    let meta = |f: &str| p.meta.get(f).map_or("", String::as_str);
    let position: usize = meta("mamba2.position").parse().unwrap_or(0);
    let tokens = meta("mamba2.tokens");
    let count = if tokens.is_empty() {
        0
    } else {
        tokens.split(',').count()
    };
    let list = |n: usize| vec!["7"; n].join(",");
    match v {
        "$position+1" => (position + 1).to_string(),
        "$position-1" => position.saturating_sub(1).to_string(),
        "$tokens+1" => list(count + 1),
        "$tokens-1" => list(count.saturating_sub(1)),
        "$tokens_huge_id" => vec!["4294967295"; count.max(1)].join(","),
        "$long_list" => list(200_000),
        _ => v.to_string(),
    }
}

fn extra_text(v: &str) -> String {
    match v {
        "$many_messages" => {
            let m = vec!["[\"user\",\"hi\"]"; 300].join(",");
            format!("{{\"messages\":[{m}],\"fed\":\"\",\"last_finish\":null,\"pending\":null}}")
        }
        "$deep" => format!("{}{}", "[".repeat(5000), "]".repeat(5000)),
        _ => v.to_string(),
    }
}

/// What a reader must do with `p` (the file as saved) damaged by `op` alone: `Some` to
/// refuse it, with the word its error must hold where one is certain.
fn expect(op: &StateOp, p: &Parsed, value: Option<&str>) -> Option<(String, Option<String>)> {
    let n = p.tensors.len();
    let word = |w: &str| Some(w.to_string());
    match op {
        StateOp::Meta(f, _) => {
            let (field, _) = FIELDS[*f];
            let value = value?;
            let old = p.meta.get(field).map(String::as_str);
            if old == Some(value) {
                return None;
            }
            let what = format!("{field} set to {value:?}");
            match field {
                "mamba2.extra" => None,
                "mamba2.position" => {
                    let fits = value.parse::<u64>().is_ok_and(|v| v <= u32::MAX as u64)
                        && !value.starts_with('+')
                        && value.trim() == value;
                    let has_rows = !p.meta["mamba2.tokens"].is_empty()
                        || p.tensors.iter().any(|t| t.0.ends_with(".k"));
                    if !fits {
                        Some((what, word(field)))
                    } else if has_rows {
                        // The KV rows or the tokens recorded no longer match.
                        Some((what, None))
                    } else {
                        None
                    }
                }
                "mamba2.dtype" => Some((
                    what,
                    if ["f32", "f16"].contains(&value) {
                        None
                    } else {
                        word(field)
                    },
                )),
                "mamba2.tokens" => {
                    let ids: Option<Vec<u32>> = if value.is_empty() {
                        Some(vec![])
                    } else {
                        value.split(',').map(|t| t.parse().ok()).collect()
                    };
                    let position: usize = p.meta["mamba2.position"].parse().unwrap();
                    match ids {
                        None => Some((what, word(field))),
                        Some(ids) if !ids.is_empty() && ids.len() != position => {
                            Some((what, word(field)))
                        }
                        Some(_) => None,
                    }
                }
                // The identity fields: compared as they stand.
                _ => Some((what, word(field))),
            }
        }
        StateOp::DropMeta(f) => {
            let (field, required) = FIELDS[*f];
            (required && p.meta.contains_key(field))
                .then(|| (format!("{field} removed"), word(field)))
        }
        StateOp::Retype(i, d) if n > 0 => {
            let t = &p.tensors[i.index(n)];
            (t.1 != DTYPES[*d]).then(|| (format!("{} retyped {}", t.0, DTYPES[*d]), None))
        }
        StateOp::Reshape(i, s) if n > 0 => {
            let t = &p.tensors[i.index(n)];
            let shape: Vec<u64> = serde_json::from_value(t.2.clone()).unwrap();
            let new = reshape(&shape, *s);
            let count = |s: &[u64]| s.iter().try_fold(1u64, |a, &b| a.checked_mul(b));
            (count(&new) != count(&shape)).then(|| (format!("{} reshaped {new:?}", t.0), None))
        }
        StateOp::Rename(i, _) | StateOp::Drop(i) if n > 0 => {
            let t = &p.tensors[i.index(n)];
            Some((format!("{} renamed or removed", t.0), None))
        }
        StateOp::Value(i, e, s) if n > 0 => {
            let t = &p.tensors[i.index(n)];
            let v = SPECIALS[*s];
            let stored = if t.1 == "F16" {
                half::f16::from_f32(v).to_f32()
            } else {
                v
            };
            let _ = e;
            (!stored.is_finite() && !t.3.is_empty())
                .then(|| (format!("{} holds {v}", t.0), word("not finite")))
        }
        _ => None,
    }
}

fn reshape(shape: &[u64], s: usize) -> Vec<u64> {
    let first = shape.first().copied().unwrap_or(1);
    let rest = shape.iter().skip(1).copied();
    match s {
        0 if first % 2 == 0 => std::iter::once(first / 2).chain([2]).chain(rest).collect(),
        0 => shape.to_vec(),
        1 => std::iter::once(first + 1).chain(rest).collect(),
        2 => vec![],
        3 => vec![0],
        4 => vec![1 << 32, 1 << 32],
        _ => shape.iter().copied().chain([1]).collect(),
    }
}

fn build_state(c: &StateCase) -> Built {
    let base = &BASES[c.base];
    let mut p = base.files[c.f16 as usize].clone();
    let mut must_fail = None;
    for op in &c.ops {
        let n = p.tensors.len();
        let mut value = None;
        match op {
            StateOp::Meta(f, v) => {
                let text = value_text(VALUES[*v], &p);
                value = Some(text.clone());
                if c.ops.len() == 1 && c.bytes.is_empty() {
                    must_fail = expect(op, &p, value.as_deref());
                }
                p.meta.insert(FIELDS[*f].0.into(), text);
                continue;
            }
            _ if c.ops.len() == 1 && c.bytes.is_empty() => {
                must_fail = expect(op, &p, value.as_deref());
            }
            _ => {}
        }
        match op {
            StateOp::DropMeta(f) => {
                p.meta.remove(FIELDS[*f].0);
            }
            StateOp::Extra(v) => {
                p.meta.insert("mamba2.extra".into(), extra_text(EXTRAS[*v]));
            }
            StateOp::Retype(i, d) if n > 0 => p.tensors[i.index(n)].1 = DTYPES[*d].into(),
            StateOp::Reshape(i, s) if n > 0 => {
                let t = &mut p.tensors[i.index(n)];
                let shape: Vec<u64> = serde_json::from_value(t.2.clone()).unwrap_or_default();
                t.2 = serde_json::to_value(reshape(&shape, *s)).unwrap();
            }
            StateOp::Rename(i, r) if n > 0 => {
                let at = i.index(n);
                let old = p.tensors[at].0.clone();
                // Onto another tensor's name (the header then keeps one of the two), a
                // layer past the model, a name the model never has.
                p.tensors[at].0 = match r {
                    0 => p.tensors[(at + 1) % n].0.clone(),
                    1 => old.replacen("layers.", "layers.9", 1),
                    _ => format!("{old}.x"),
                };
            }
            StateOp::Drop(i) if n > 0 => {
                p.tensors.remove(i.index(n));
            }
            StateOp::Dup(i) if n > 0 => {
                let mut t = p.tensors[i.index(n)].clone();
                t.0 = format!("{}.copy", t.0);
                p.tensors.push(t);
            }
            StateOp::Value(i, e, s) if n > 0 => {
                let t = &mut p.tensors[i.index(n)];
                let v = SPECIALS[*s];
                let (width, bytes) = if t.1 == "F16" {
                    (2, half::f16::from_f32(v).to_le_bytes().to_vec())
                } else {
                    (4, v.to_le_bytes().to_vec())
                };
                let count = t.3.len() / width;
                if count > 0 {
                    let at = e.index(count) * width;
                    t.3[at..at + width].copy_from_slice(&bytes);
                }
            }
            _ => {}
        }
    }
    let file = apply_bytes(unparse(&p), &c.bytes);
    Built {
        base: c.base,
        file,
        must_fail,
        ops: format!(
            "{} ({}), {:?}, bytes {:?}",
            base.name,
            if c.f16 { "f16" } else { "f32" },
            c.ops,
            c.bytes
        ),
    }
}

fn describe_state(b: &Built) -> String {
    b.ops.clone()
}

fn check_state(b: &Built) -> Check {
    let base = &BASES[b.base];
    let scratch = Scratch::new();
    let path = scratch.0.join(FILE);
    std::fs::write(&path, &b.file).unwrap();
    let config = &base.model.config;
    let _ = state_file::read_header(&path, &base.key);
    let loaded = state_file::load(&path, &base.key, config);
    // The prefix cache lists the directory and resumes from what it lists.
    {
        let cfg = CacheConfig {
            device_bytes: 0,
            host_bytes: 1 << 30,
            dir: Some(scratch.0.clone()),
            disk_bytes: 1 << 30,
            dtype: StateDtype::F32,
            every: 0,
        };
        let mut cache =
            PrefixCache::open(base.key.clone(), config, cfg, &mut |_| {}).map_err(|e| {
                fail(
                    "[cache] open failed",
                    format!("the prefix cache did not open over the directory: {e}"),
                )
            })?;
        if let Ok(h) = state_file::read_header(&path, &base.key)
            && !h.tokens.is_empty()
        {
            let mut backend =
                CpuBackend::new(CpuModel::<f32>::new(config, &base.model.weights).unwrap());
            let _ = cache.resume(&h.tokens, h.tokens.len(), &mut backend, &mut |_| {});
        }
    }
    let saved = match loaded {
        Err(e) => {
            let msg = e.to_string();
            if !msg.contains(FILE) {
                return Err(fail(
                    "[error] does not name the file",
                    format!("the error should name {FILE}: {msg}"),
                ));
            }
            if let Some((what, Some(word))) = &b.must_fail
                && !msg.contains(word.as_str())
            {
                return Err(fail(
                    "[error] does not name the damage",
                    format!("{what}: the error should name {word}: {msg}"),
                ));
            }
            return Ok(());
        }
        Ok(saved) => saved,
    };
    if let Some((what, _)) = &b.must_fail {
        return Err(fail(
            format!(
                "[accepted] {}",
                what.split(' ')
                    .next()
                    .unwrap_or("")
                    .replace(char::is_numeric, "N")
            ),
            format!("state_file::load accepted a file where {what}"),
        ));
    }
    if let Err(e) = saved.state.check(config) {
        return Err(fail(
            "[accepted] a state that does not fit the model",
            e.to_string(),
        ));
    }
    if saved.state.values().iter().any(|v| !v.is_finite()) {
        return Err(fail("[accepted] a non-finite value", String::new()));
    }
    if saved.state.len > u32::MAX as usize {
        return Err(fail(
            "[accepted] a position past 32 bits",
            format!("position {}", saved.state.len),
        ));
    }
    if !saved.tokens.is_empty() && saved.tokens.len() != saved.state.len {
        return Err(fail(
            "[accepted] tokens that do not match the position",
            format!("{} tokens at {}", saved.tokens.len(), saved.state.len),
        ));
    }
    // Continue from it as `chat --resume` or a session would.
    match &base.tokenizer {
        Some(tok) => {
            let mut chat = Chat::new(cpu_session(&base.model), tok.clone());
            if chat.import(&saved, &path).is_ok() {
                let _ = chat.say("Go on", &greedy(2), |_| true);
            }
        }
        None => {
            let mut session = cpu_session(&base.model);
            if session.load_state(&saved.state, None).is_ok() {
                let _ = session.generate(&[2], &greedy(2), |_| true);
            }
        }
    }
    Ok(())
}

pub(crate) fn fuzz_state_file() {
    let strategy = (
        0..BASES.len(),
        any::<bool>(),
        prop::collection::vec(state_op(), 1..3),
        prop_oneof![6 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..3)],
    )
        .prop_map(|(base, f16, ops, bytes)| StateCase {
            base,
            f16,
            ops,
            bytes,
        });
    fuzz(
        "state_file",
        400,
        strategy,
        build_state,
        describe_state,
        check_state,
    );
}
