use super::*;
use crate::config::Raw;

// ---------------------------------------------------------------------------------------
// The tokenizer wrapper
// ---------------------------------------------------------------------------------------

pub(crate) static BIG_TOKENIZER: LazyLock<String> =
    LazyLock::new(|| bytes_to_text(read("assets/tokenizer.json")));

/// The embedded model's tokenizer, loaded once.
static EMBEDDED: LazyLock<Tokenizer> =
    LazyLock::new(|| Tokenizer::from_bytes(BIG_TOKENIZER.as_bytes(), None).unwrap());

/// A small byte-level BPE cut from the embedded one (fast to load): vocab (JSON object),
/// merges (JSON array), and its tokens.
static TINY: LazyLock<(String, String, Vec<String>)> = LazyLock::new(|| {
    let v: serde_json::Value = serde_json::from_str(&BIG_TOKENIZER).unwrap();
    let vocab = v["model"]["vocab"].as_object().unwrap();
    let keep: BTreeMap<&str, u64> = vocab
        .iter()
        .filter_map(|(t, id)| id.as_u64().filter(|&i| i < 320).map(|i| (t.as_str(), i)))
        .collect();
    let merges: Vec<serde_json::Value> = v["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| {
            let (a, b) = (m[0].as_str().unwrap_or(""), m[1].as_str().unwrap_or(""));
            keep.contains_key(a) && keep.contains_key(b) && keep.contains_key(&*format!("{a}{b}"))
        })
        .cloned()
        .collect();
    (
        serde_json::to_string(&keep).unwrap(),
        serde_json::Value::from(merges).to_string(),
        keep.keys().map(|s| s.to_string()).collect(),
    )
});

/// Models: BPE in its variants, WordPiece, WordLevel, Unigram, broken ones. `VOCAB`,
/// `MERGES` and `PIECES` are replaced by the tiny tokenizer's.
const MODELS: &[&str] = &[
    r###"{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","unk_token":"<unk>","byte_fallback":true,"fuse_unk":true,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","dropout":1.0,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","dropout":1.5,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","dropout":-0.5,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","vocab":VOCAB,"merges":[["zz","qq"],["a"]]}"###,
    r###"{"type":"BPE","vocab":VOCAB,"merges":["a b","a","a b c",""]}"###,
    r###"{"type":"BPE","vocab":{"a":4294967295,"b":4294967294,"ab":0},"merges":[["a","b"]]}"###,
    r###"{"type":"BPE","vocab":{"a":1,"b":1,"ab":1},"merges":[["a","b"]]}"###,
    r###"{"type":"BPE","vocab":{},"merges":[]}"###,
    r###"{"type":"BPE","vocab":{"a":-1},"merges":[]}"###,
    r###"{"type":"BPE","continuing_subword_prefix":"##","end_of_word_suffix":"</w>","vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"BPE","unk_token":"<|endoftext|>","fuse_unk":true,"vocab":{"<|endoftext|>":0,"a":1,"b":2,"ab":3},"merges":[["a","b"]]}"###,
    r###"{"type":"BPE","ignore_merges":true,"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"vocab":VOCAB,"merges":MERGES}"###,
    r###"{"type":"WordPiece","unk_token":"[UNK]","continuing_subword_prefix":"##","max_input_chars_per_word":100,"vocab":{"[UNK]":0,"a":1,"##b":2,"b":3,"##a":4,"the":5}}"###,
    r###"{"type":"WordPiece","unk_token":"[MISSING]","continuing_subword_prefix":"","max_input_chars_per_word":0,"vocab":{"a":0,"b":1}}"###,
    r###"{"type":"WordPiece","unk_token":"[UNK]","continuing_subword_prefix":"##","max_input_chars_per_word":18446744073709551615,"vocab":{"[UNK]":4294967295}}"###,
    r###"{"type":"WordLevel","vocab":VOCAB,"unk_token":"<unk>"}"###,
    r###"{"type":"WordLevel","vocab":{"<unk>":0,"a":1},"unk_token":"<unk>"}"###,
    r###"{"type":"WordLevel","vocab":{},"unk_token":""}"###,
    r###"{"type":"Unigram","unk_id":0,"vocab":PIECES,"byte_fallback":false}"###,
    r###"{"type":"Unigram","unk_id":null,"vocab":PIECES,"byte_fallback":true}"###,
    r###"{"type":"Unigram","unk_id":4294967295,"vocab":PIECES}"###,
    r###"{"type":"Unigram","unk_id":0,"vocab":[]}"###,
    r###"{"type":"Unigram","unk_id":1,"vocab":[["<unk>",0.0],["a",1e308],["a",-1e308],["b",-3.4e38],["",-1.0]]}"###,
    r###"{"type":"Nope"}"###,
    r###"null"###,
];
const NORMALIZERS: &[&str] = &[
    "null",
    r###"{"type":"NFC"}"###,
    r###"{"type":"NFKD"}"###,
    r###"{"type":"Lowercase"}"###,
    r###"{"type":"Strip","strip_left":true,"strip_right":true}"###,
    r###"{"type":"StripAccents"}"###,
    r###"{"type":"Replace","pattern":{"String":""},"content":"x"}"###,
    r###"{"type":"Replace","pattern":{"Regex":"("},"content":"x"}"###,
    r###"{"type":"Replace","pattern":{"Regex":"a*"},"content":"bb"}"###,
    r###"{"type":"Replace","pattern":{"String":" "},"content":"▁"}"###,
    r###"{"type":"Prepend","prepend":""}"###,
    r###"{"type":"Prepend","prepend":"▁"}"###,
    r###"{"type":"Precompiled","precompiled_charsmap":"AAAA"}"###,
    r###"{"type":"Precompiled","precompiled_charsmap":""}"###,
    r###"{"type":"Precompiled","precompiled_charsmap":"////////////////////////AAAA"}"###,
    r###"{"type":"BertNormalizer","clean_text":true,"handle_chinese_chars":true,"strip_accents":null,"lowercase":true}"###,
    r###"{"type":"Sequence","normalizers":[{"type":"NFD"},{"type":"StripAccents"},{"type":"Lowercase"}]}"###,
    r###"{"type":"ByteLevel"}"###,
    r###"{"type":"Nope"}"###,
];
const PRE_TOKENIZERS: &[&str] = &[
    "null",
    r###"{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}"###,
    r###"{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":false,"use_regex":false}"###,
    r###"{"type":"Whitespace"}"###,
    r###"{"type":"WhitespaceSplit"}"###,
    r###"{"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true}"###,
    r###"{"type":"Metaspace","replacement":"","prepend_scheme":"first","split":false}"###,
    r###"{"type":"Split","pattern":{"Regex":"\\s*"},"behavior":"Isolated","invert":false}"###,
    r###"{"type":"Split","pattern":{"Regex":"(?=a)"},"behavior":"MergedWithNext","invert":true}"###,
    r###"{"type":"Split","pattern":{"Regex":"(a+)+$"},"behavior":"Removed","invert":false}"###,
    r###"{"type":"Split","pattern":{"String":""},"behavior":"Contiguous","invert":false}"###,
    r###"{"type":"Split","pattern":{"Regex":"(?<=x"},"behavior":"Isolated","invert":false}"###,
    r###"{"type":"Punctuation","behavior":"Isolated"}"###,
    r###"{"type":"Digits","individual_digits":true}"###,
    r###"{"type":"UnicodeScripts"}"###,
    r###"{"type":"CharDelimiterSplit","delimiter":"a"}"###,
    r###"{"type":"BertPreTokenizer"}"###,
    r###"{"type":"Sequence","pretokenizers":[{"type":"WhitespaceSplit"},{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}]}"###,
    r###"{"type":"Nope"}"###,
];
const POST_PROCESSORS: &[&str] = &[
    "null",
    r###"{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":false,"use_regex":true}"###,
    r###"{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<|endoftext|>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"pair":[{"Sequence":{"id":"A","type_id":0}},{"Sequence":{"id":"B","type_id":1}}],"special_tokens":{"<|endoftext|>":{"id":"<|endoftext|>","ids":[0],"tokens":["<|endoftext|>"]}}}"###,
    r###"{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>","type_id":0}},{"Sequence":{"id":"A","type_id":0}}],"pair":[{"Sequence":{"id":"A","type_id":0}}],"special_tokens":{"<s>":{"id":"<s>","ids":[4294967295,1],"tokens":["<s>"]}}}"###,
    r###"{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<missing>","type_id":0}},{"Sequence":{"id":"A","type_id":4294967295}}],"pair":[{"Sequence":{"id":"A","type_id":0}}],"special_tokens":{}}"###,
    r###"{"type":"TemplateProcessing","single":[],"pair":[],"special_tokens":{}}"###,
    r###"{"type":"BertProcessing","sep":["[SEP]",4294967295],"cls":["[CLS]",0]}"###,
    r###"{"type":"RobertaProcessing","sep":["</s>",2],"cls":["<s>",0],"trim_offsets":true,"add_prefix_space":true}"###,
    r###"{"type":"Sequence","processors":[{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},{"type":"BertProcessing","sep":["[SEP]",1],"cls":["[CLS]",0]}]}"###,
    r###"{"type":"Nope"}"###,
];
const DECODERS: &[&str] = &[
    "null",
    r###"{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true}"###,
    r###"{"type":"WordPiece","prefix":"##","cleanup":true}"###,
    r###"{"type":"WordPiece","prefix":"","cleanup":false}"###,
    r###"{"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true}"###,
    r###"{"type":"BPEDecoder","suffix":""}"###,
    r###"{"type":"ByteFallback"}"###,
    r###"{"type":"Fuse"}"###,
    r###"{"type":"Strip","content":" ","start":1000000,"stop":1000000}"###,
    r###"{"type":"Strip","content":"a","start":18446744073709551615,"stop":0}"###,
    r###"{"type":"Replace","pattern":{"String":""},"content":"x"}"###,
    r###"{"type":"Replace","pattern":{"Regex":"[a-z]*"},"content":"xy"}"###,
    r###"{"type":"CTC","pad_token":"","word_delimiter_token":"","cleanup":true}"###,
    r###"{"type":"Sequence","decoders":[{"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]}"###,
    r###"{"type":"Nope"}"###,
];
const ADDED: &[&str] = &[
    "[]",
    r###"[{"id":0,"content":"<|endoftext|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}]"###,
    r###"[{"id":4294967295,"content":"<big>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}]"###,
    r###"[{"id":5,"content":"","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":false}]"###,
    r###"[{"id":0,"content":"a","single_word":true,"lstrip":true,"rstrip":true,"normalized":true,"special":false},{"id":0,"content":"b","single_word":false,"lstrip":false,"rstrip":false,"normalized":true,"special":true}]"###,
    r###"[{"id":1000000,"content":"aa","single_word":false,"lstrip":true,"rstrip":true,"normalized":true,"special":false},{"id":1000001,"content":"aaa","single_word":true,"lstrip":false,"rstrip":false,"normalized":false,"special":true},{"id":1000002,"content":" ","single_word":false,"lstrip":true,"rstrip":true,"normalized":true,"special":false}]"###,
    r###"[{"id":-1,"content":"x","special":true}]"###,
];
const TRUNCATIONS: &[&str] = &[
    "null",
    r###"{"direction":"Right","max_length":0,"strategy":"LongestFirst","stride":0}"###,
    r###"{"direction":"Left","max_length":2,"strategy":"OnlyFirst","stride":5}"###,
    r###"{"direction":"Right","max_length":1,"strategy":"LongestFirst","stride":1}"###,
    r###"{"direction":"Right","max_length":18446744073709551615,"strategy":"OnlySecond","stride":18446744073709551615}"###,
];
const PADDINGS: &[&str] = &[
    "null",
    r###"{"strategy":"BatchLongest","direction":"Right","pad_to_multiple_of":null,"pad_id":0,"pad_type_id":0,"pad_token":"<pad>"}"###,
    r###"{"strategy":{"Fixed":16},"direction":"Left","pad_to_multiple_of":null,"pad_id":4294967295,"pad_type_id":0,"pad_token":""}"###,
    r###"{"strategy":{"Fixed":0},"direction":"Right","pad_to_multiple_of":0,"pad_id":0,"pad_type_id":0,"pad_token":"<pad>"}"###,
    r###"{"strategy":"BatchLongest","direction":"Right","pad_to_multiple_of":7,"pad_id":0,"pad_type_id":0,"pad_token":"<pad>"}"###,
    r###"{"strategy":{"Fixed":100000000},"direction":"Right","pad_to_multiple_of":null,"pad_id":0,"pad_type_id":0,"pad_token":"<pad>"}"###,
];

#[derive(Clone, Debug)]
struct TokCase {
    /// Indices into MODELS, NORMALIZERS, PRE_TOKENIZERS, POST_PROCESSORS, DECODERS, ADDED,
    /// TRUNCATIONS, PADDINGS.
    parts: [usize; 8],
    bytes: Vec<ByteOp>,
    texts: Vec<String>,
    ids: Vec<u32>,
}

fn tiny_json(parts: &[usize; 8]) -> String {
    let (vocab, merges, tokens) = &*TINY;
    let pieces: Vec<(String, f64)> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), -(i as f64) / 10.0))
        .collect();
    let pieces = serde_json::to_string(&pieces).unwrap();
    let model = MODELS[parts[0]]
        .replace("VOCAB", vocab)
        .replace("MERGES", merges)
        .replace("PIECES", &pieces);
    format!(
        r#"{{"version":"1.0","truncation":{},"padding":{},"added_tokens":{},"normalizer":{},"pre_tokenizer":{},"post_processor":{},"decoder":{},"model":{model}}}"#,
        TRUNCATIONS[parts[6]],
        PADDINGS[parts[7]],
        ADDED[parts[5]],
        NORMALIZERS[parts[1]],
        PRE_TOKENIZERS[parts[2]],
        POST_PROCESSORS[parts[3]],
        DECODERS[parts[4]],
    )
}

/// Text to encode: arbitrary Unicode, the special tokens' pieces, long runs.
fn text() -> impl Strategy<Value = String> {
    const PIECES: &[&str] = &[
        "<|endoftext|>",
        "<|",
        "|>",
        "\u{0}",
        "\u{feff}",
        "\r\n",
        " ",
        "   ",
        "é",
        "e\u{301}",
        "😀",
        "\u{10FFFF}",
        "\u{200d}",
        "Ġ",
        "▁",
        "##",
        "[UNK]",
        "<unk>",
        "a",
        "aa",
        "the",
        "ﬁ",
        "İ",
        "ß",
        "\u{fffd}",
        "<0xFF>",
        "x",
    ];
    prop_oneof![
        3 => any::<String>(),
        3 => prop::collection::vec(prop::sample::select(PIECES), 0..24).prop_map(|v| v.concat()),
        1 => (prop::sample::select(PIECES), 0usize..20_000).prop_map(|(p, n)| p.repeat(n)),
        1 => "[a-z <|>0-9]{0,64}",
    ]
}

fn ids(vocab: u32) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(
        prop_oneof![
            6 => 0..vocab + 20,
            1 => Just(u32::MAX),
            1 => Just(1u32 << 31),
            1 => any::<u32>(),
        ],
        0..48,
    )
}

/// Encode and decode through every entry point of the wrapper: no panic.
fn exercise(tok: &Tokenizer, texts: &[String], ids: &[u32]) -> Check {
    for t in texts {
        if let Ok(enc) = tok.encode(t) {
            let _ = tok.decode(&enc);
            let mut s = tok.stream();
            for &id in enc.iter().take(256) {
                let _ = s.step(tok, id);
            }
        }
        let _ = tok.encode_with(t, false);
    }
    let _ = tok.decode(ids);
    let _ = tok.vocab_size();
    let mut s = tok.stream();
    for &id in ids {
        let _ = s.step(tok, id);
    }
    Ok(())
}

pub(crate) fn fuzz_tokenizer_embedded() {
    let vocab = EMBEDDED.vocab_size() as u32;
    fuzz(
        "tokenizer_embedded",
        600,
        (prop::collection::vec(text(), 1..4), ids(vocab)),
        |c| c.clone(),
        |(texts, ids)| format!("texts {texts:?}\nids {ids:?}"),
        |(texts, ids)| exercise(&EMBEDDED, texts, ids),
    );
}

pub(crate) fn fuzz_tokenizer_json() {
    let parts = (
        0..MODELS.len(),
        0..NORMALIZERS.len(),
        0..PRE_TOKENIZERS.len(),
        0..POST_PROCESSORS.len(),
        0..DECODERS.len(),
        0..ADDED.len(),
        0..TRUNCATIONS.len(),
        0..PADDINGS.len(),
    )
        .prop_map(|(a, b, c, d, e, f, g, h)| [a, b, c, d, e, f, g, h]);
    let strategy = (
        parts,
        prop_oneof![3 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..4)],
        prop::collection::vec(text(), 1..3),
        ids(400),
    )
        .prop_map(|(parts, bytes, texts, ids)| TokCase {
            parts,
            bytes,
            texts,
            ids,
        });
    fuzz(
        "tokenizer_json",
        800,
        strategy,
        |c| {
            (
                apply_bytes(tiny_json(&c.parts).into_bytes(), &c.bytes),
                c.clone(),
            )
        },
        |(_, c)| {
            let p = &c.parts;
            format!(
                "tokenizer.json: model {}\n  normalizer {}\n  pre_tokenizer {}\n  \
                 post_processor {}\n  decoder {}\n  added_tokens {}\n  truncation {}\n  \
                 padding {}\n  then bytes {:?}\ntexts {:?}\nids {:?}",
                MODELS[p[0]],
                NORMALIZERS[p[1]],
                PRE_TOKENIZERS[p[2]],
                POST_PROCESSORS[p[3]],
                DECODERS[p[4]],
                ADDED[p[5]],
                TRUNCATIONS[p[6]],
                PADDINGS[p[7]],
                c.bytes,
                c.texts,
                c.ids
            )
        },
        |(json, c)| match Tokenizer::from_bytes(json, None) {
            Ok(tok) => exercise(&tok, &c.texts, &c.ids),
            Err(_) => Ok(()),
        },
    );
}

/// The embedded tokenizer.json (4096 tokens) with a component swapped, a vocab id or merge
/// broken, or bytes edited: slower to load, so fewer cases.
pub(crate) fn fuzz_tokenizer_big() {
    #[derive(Clone, Debug)]
    enum BigOp {
        Part(usize, usize),
        VocabId(Index, usize),
        DropToken(Index),
        ModelField(usize),
    }
    const IDS: &[&str] = &["4294967295", "4096", "0", "-1", "1.5", "null", "\"7\""];
    const MODEL_FIELDS: &[(&str, &str)] = &[
        ("dropout", "1.0"),
        ("dropout", "2.0"),
        ("byte_fallback", "true"),
        ("unk_token", "\"<unk>\""),
        ("unk_token", "\"<|endoftext|>\""),
        ("ignore_merges", "true"),
        ("type", "\"WordPiece\""),
        ("type", "\"Unigram\""),
        ("merges", "[]"),
        ("vocab", "{}"),
        ("continuing_subword_prefix", "\"Ġ\""),
    ];
    let op = prop_oneof![
        (0..7usize, any::<usize>()).prop_map(|(p, v)| BigOp::Part(p, v)),
        (any::<Index>(), 0..IDS.len()).prop_map(|(i, v)| BigOp::VocabId(i, v)),
        any::<Index>().prop_map(BigOp::DropToken),
        (0..MODEL_FIELDS.len()).prop_map(BigOp::ModelField),
    ];
    let strategy = (
        prop::collection::vec(op, 0..3),
        prop_oneof![2 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..3)],
        prop::collection::vec(text(), 1..3),
        ids(4200),
    );
    static BASE: LazyLock<serde_json::Value> =
        LazyLock::new(|| serde_json::from_str(&BIG_TOKENIZER).unwrap());
    fuzz(
        "tokenizer_big",
        60,
        strategy,
        |(ops, bytes, texts, ids)| {
            let mut v = BASE.clone();
            let mut raw = Raw(Vec::new());
            for op in ops {
                match op {
                    BigOp::Part(p, i) => {
                        let (key, list) = [
                            ("normalizer", NORMALIZERS),
                            ("pre_tokenizer", PRE_TOKENIZERS),
                            ("post_processor", POST_PROCESSORS),
                            ("decoder", DECODERS),
                            ("added_tokens", ADDED),
                            ("truncation", TRUNCATIONS),
                            ("padding", PADDINGS),
                        ][*p];
                        v[key] = raw.put(list[i % list.len()].into());
                    }
                    // (An earlier `ModelField` may have made the vocabulary something else.)
                    BigOp::VocabId(i, id) => {
                        if let Some(vocab) = v["model"]["vocab"].as_object_mut()
                            && !vocab.is_empty()
                        {
                            let key = vocab.keys().nth(i.index(vocab.len())).unwrap().clone();
                            vocab[&key] = raw.put(IDS[*id].into());
                        }
                    }
                    BigOp::DropToken(i) => {
                        if let Some(vocab) = v["model"]["vocab"].as_object_mut()
                            && !vocab.is_empty()
                        {
                            let key = vocab.keys().nth(i.index(vocab.len())).unwrap().clone();
                            vocab.remove(&key);
                        }
                    }
                    BigOp::ModelField(f) => {
                        let (k, val) = MODEL_FIELDS[*f];
                        v["model"][k] = raw.put(val.into());
                    }
                }
            }
            let json = apply_bytes(raw.render(&v).into_bytes(), bytes);
            (
                json,
                format!("{ops:?} {bytes:?}"),
                texts.clone(),
                ids.clone(),
            )
        },
        |(_, ops, texts, ids)| {
            format!("embedded tokenizer.json with {ops}\ntexts {texts:?}\nids {ids:?}")
        },
        |(json, _, texts, ids)| match Tokenizer::from_bytes(json, None) {
            Ok(tok) => exercise(&tok, texts, ids),
            Err(_) => Ok(()),
        },
    );
}

/// `tokenizer_config.json` (end-of-sequence token, chat template) through `from_dir`, and
/// the template rendered over arbitrary messages.
pub(crate) fn fuzz_tokenizer_config() {
    const TOKEN_VALUES: &[&str] = &[
        "\"<|endoftext|>\"",
        "\"</s>\"",
        "\"\"",
        "{\"content\":\"<|endoftext|>\",\"lstrip\":false}",
        "{\"content\":5}",
        "17",
        "[]",
        "null",
        "{}",
    ];
    const TEMPLATES: &[&str] = &[
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content.strip() }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}{% for m in messages %}{{ loop.index }}:{{ m.content|trim }}{% endfor %}",
        "{{ messages[100].content }}{{ messages|length }}{{ messages|tojson }}",
        "{% for i in range(1000000000) %}x{% endfor %}",
        "{{ 'ab' * 1000000000 }}",
        "{{ messages * 100000000 }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}{{ a.content ~ b.content ~ c.content }}{% endfor %}{% endfor %}{% endfor %}",
        "{% set ns = namespace(x='') %}{% for m in messages %}{% set ns.x = ns.x ~ ns.x ~ m.content %}{% endfor %}{{ ns.x|length }}",
        "{% for m in messages %}{{ m.content.split(' ')|join('|') }}{{ m.role.upper() }}{% endfor %}",
        "{% for %}",
        "{{ 1 / 0 }}{{ messages[-1] }}",
        "{{ (messages|first).content[1000000000:] }}",
    ];
    #[derive(Clone, Debug)]
    struct Case {
        eos: Option<usize>,
        bos: Option<usize>,
        template: Option<usize>,
        template_bytes: Vec<ByteOp>,
        config_bytes: Vec<ByteOp>,
        messages: Vec<(String, String)>,
        add_generation_prompt: bool,
    }
    let strategy = (
        prop::option::of(0..TOKEN_VALUES.len()),
        prop::option::of(0..TOKEN_VALUES.len()),
        prop::option::of(0..TEMPLATES.len()),
        prop_oneof![3 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..3)],
        prop_oneof![6 => Just(vec![]), 1 => prop::collection::vec(byte_op(), 1..3)],
        prop::collection::vec(
            (
                prop_oneof![
                    Just("user".to_string()),
                    Just("assistant".to_string()),
                    Just("system".to_string()),
                    any::<String>()
                ],
                text(),
            ),
            0..5,
        ),
        any::<bool>(),
    )
        .prop_map(
            |(
                eos,
                bos,
                template,
                template_bytes,
                config_bytes,
                messages,
                add_generation_prompt,
            )| Case {
                eos,
                bos,
                template,
                template_bytes,
                config_bytes,
                messages,
                add_generation_prompt,
            },
        );
    fuzz(
        "tokenizer_config",
        600,
        strategy,
        |c| {
            let mut fields = Vec::new();
            if let Some(e) = c.eos {
                fields.push(format!("\"eos_token\":{}", TOKEN_VALUES[e]));
            }
            if let Some(b) = c.bos {
                fields.push(format!("\"bos_token\":{}", TOKEN_VALUES[b]));
            }
            if let Some(t) = c.template {
                let t = bytes_to_text(apply_bytes(
                    TEMPLATES[t].as_bytes().to_vec(),
                    &c.template_bytes,
                ));
                fields.push(format!(
                    "\"chat_template\":{}",
                    serde_json::to_string(&t).unwrap()
                ));
            }
            let config = format!("{{{}}}", fields.join(","));
            (apply_bytes(config.into_bytes(), &c.config_bytes), c.clone())
        },
        |(config, c)| {
            format!(
                "tokenizer_config.json: {}\nmessages {:?}, add_generation_prompt {}",
                String::from_utf8_lossy(config),
                c.messages,
                c.add_generation_prompt
            )
        },
        |(config, c)| {
            let scratch = Scratch::new();
            std::fs::write(
                scratch.0.join("tokenizer.json"),
                tiny_json(&[0, 0, 1, 2, 1, 1, 0, 0]),
            )
            .unwrap();
            std::fs::write(scratch.0.join("tokenizer_config.json"), config).unwrap();
            if let Ok(Some(tok)) = Tokenizer::from_dir(&scratch.0) {
                let _ = tok.render_chat(&c.messages, c.add_generation_prompt);
                if let Some(eos) = tok.eos {
                    let _ = tok.decode(&[eos]);
                }
            }
            Ok(())
        },
    );
}
