use super::*;

// ---------------------------------------------------------------------------------------
// The safetensors and shard-index loader
// ---------------------------------------------------------------------------------------

/// The fixture model directories (`config.json` + `model.safetensors`): the first one is a
/// plain Mamba2 that loads; every other fixture in tests/fixtures joins in.
pub(crate) static FIXTURES: LazyLock<Vec<String>> = LazyLock::new(|| {
    let mut dirs: Vec<String> = std::fs::read_dir(manifest("tests/fixtures"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            let p = e.path();
            p.join("config.json").is_file() && p.join("model.safetensors").is_file()
        })
        .map(|e| format!("tests/fixtures/{}", e.file_name().to_string_lossy()))
        .collect();
    dirs.sort_by_key(|d| (!d.ends_with("hf_mamba2_g1"), d.clone()));
    assert!(dirs[0].ends_with("hf_mamba2_g1"), "{dirs:?}");
    dirs
});

/// One tensor of a safetensors file.
#[derive(Clone)]
pub(crate) struct StTensor {
    pub(crate) name: String,
    dtype: String,
    shape: Vec<u64>,
    data: Vec<u8>,
}

pub(crate) struct Fixture {
    pub(crate) config: String,
    /// Whether the config parses (a fixture of a model kind still in the works may not):
    /// only then does a load get as far as the weights.
    pub(crate) config_ok: bool,
    pub(crate) tensors: Vec<StTensor>,
    pub(crate) metadata: Option<String>,
}

pub(crate) static FIXTURE: LazyLock<Vec<Fixture>> = LazyLock::new(|| {
    FIXTURES
        .iter()
        .map(|dir| {
            let bytes = read(&format!("{dir}/model.safetensors"));
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let data = &bytes[8 + n..];
            let mut metadata = None;
            let mut tensors: Vec<(u64, StTensor)> = Vec::new();
            for (name, info) in header {
                if name == "__metadata__" {
                    metadata = Some(info.to_string());
                    continue;
                }
                let off: Vec<u64> = serde_json::from_value(info["data_offsets"].clone()).unwrap();
                tensors.push((
                    off[0],
                    StTensor {
                        name,
                        dtype: info["dtype"].as_str().unwrap().into(),
                        shape: serde_json::from_value(info["shape"].clone()).unwrap(),
                        data: data[off[0] as usize..off[1] as usize].to_vec(),
                    },
                ));
            }
            tensors.sort_by_key(|(o, _)| *o);
            let config = bytes_to_text(read(&format!("{dir}/config.json")));
            Fixture {
                config_ok: ModelConfig::from_json_str(&config, Path::new("config.json")).is_ok(),
                config,
                tensors: tensors.into_iter().map(|(_, t)| t).collect(),
                metadata,
            }
        })
        .collect()
});

/// One header entry: a name and its value, as raw JSON text (so anything can be written).
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    name: String,
    dtype: String,
    shape: String,
    offsets: String,
    /// The whole value, when not an ordinary tensor entry.
    raw: Option<String>,
    /// Extra text inside the entry's object (a duplicate or unknown field).
    extra: String,
}

pub(crate) fn entries(tensors: &[StTensor], metadata: Option<&str>) -> (Vec<Entry>, Vec<u8>) {
    let mut out = Vec::new();
    let mut data = Vec::new();
    if let Some(m) = metadata {
        out.push(Entry {
            name: "__metadata__".into(),
            dtype: String::new(),
            shape: String::new(),
            offsets: String::new(),
            raw: Some(m.into()),
            extra: String::new(),
        });
    }
    for t in tensors {
        let start = data.len();
        data.extend_from_slice(&t.data);
        out.push(Entry {
            name: t.name.clone(),
            dtype: format!("\"{}\"", t.dtype),
            shape: serde_json::to_string(&t.shape).unwrap(),
            offsets: format!("[{start},{}]", data.len()),
            raw: None,
            extra: String::new(),
        });
    }
    (out, data)
}

pub(crate) fn header_text(entries: &[Entry]) -> String {
    let mut s = String::from("{");
    for (i, e) in entries.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&serde_json::to_string(&e.name).unwrap());
        s.push(':');
        match &e.raw {
            Some(raw) => s.push_str(raw),
            None => {
                let _ = write!(
                    s,
                    "{{\"dtype\":{},\"shape\":{},\"data_offsets\":{}{}}}",
                    e.dtype, e.shape, e.offsets, e.extra
                );
            }
        }
    }
    s.push('}');
    s
}

pub(crate) fn safetensors_file(header: &[u8], len: Option<u64>, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + header.len() + data.len());
    out.extend_from_slice(&len.unwrap_or(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

const DTYPES: &[&str] = &[
    "\"F32\"",
    "\"F16\"",
    "\"BF16\"",
    "\"F64\"",
    "\"I8\"",
    "\"U8\"",
    "\"BOOL\"",
    "\"F8_E4M3\"",
    "\"F4\"",
    "\"F6_E2M3\"",
    "\"E8M0\"",
    "\"C64\"",
    "\"Q8_0\"",
    "\"f32\"",
    "\"\"",
    "17",
    "null",
];
const SHAPES: &[&str] = &[
    "[]",
    "[0]",
    "[1]",
    "[0,0]",
    "[4294967296]",
    "[4294967296,4294967296]",
    "[18446744073709551615]",
    "[2305843009213693952]",
    "[4611686018427387904,4]",
    "[-1]",
    "[1.5]",
    "\"x\"",
    "null",
    "[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]",
];
const OFFSETS: &[&str] = &[
    "[0,0]",
    "[0,4]",
    "[1,0]",
    "[0,18446744073709551615]",
    "[18446744073709551615,18446744073709551615]",
    "[0]",
    "[0,1,2]",
    "null",
    "\"0\"",
    "[-1,4]",
    "[4294967296,4294967300]",
];
const METADATA: &[&str] = &[
    "{}",
    "{\"format\":\"pt\"}",
    "{\"format\":1}",
    "[]",
    "\"x\"",
    "null",
    "{\"a\":{\"b\":1}}",
];

#[derive(Clone, Debug)]
enum HdrOp {
    Dtype(Index, usize),
    Shape(Index, usize),
    ShapeReverse(Index),
    ShapeFlat(Index),
    Offsets(Index, usize),
    /// `data_offsets[end?] += delta`
    Nudge(Index, bool, i8),
    /// Entry i takes entry j's name: a duplicate key with other offsets.
    Rename(Index, Index),
    /// Entry i again, verbatim: a duplicate key with the same offsets.
    DupEntry(Index),
    Remove(Index),
    /// Entries i and j swap their offsets.
    SwapOffsets(Index, Index),
    Metadata(usize),
    /// A field twice inside one entry, or an unknown field.
    Field(Index, bool),
    /// The 8-byte header length set to something else (see `header_len`).
    HeaderLen(usize),
    /// Offsets chained up to the top of u64 (see `huge_chain`).
    HugeChain(usize),
}

fn hdr_op() -> impl Strategy<Value = HdrOp> {
    prop_oneof![
        2 => (any::<Index>(), 0..DTYPES.len()).prop_map(|(i, v)| HdrOp::Dtype(i, v)),
        2 => (any::<Index>(), 0..SHAPES.len()).prop_map(|(i, v)| HdrOp::Shape(i, v)),
        1 => any::<Index>().prop_map(HdrOp::ShapeReverse),
        1 => any::<Index>().prop_map(HdrOp::ShapeFlat),
        2 => (any::<Index>(), 0..OFFSETS.len()).prop_map(|(i, v)| HdrOp::Offsets(i, v)),
        2 => (any::<Index>(), any::<bool>(), any::<i8>()).prop_map(|(i, e, d)| HdrOp::Nudge(i, e, d)),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(i, j)| HdrOp::Rename(i, j)),
        2 => any::<Index>().prop_map(HdrOp::DupEntry),
        1 => any::<Index>().prop_map(HdrOp::Remove),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(i, j)| HdrOp::SwapOffsets(i, j)),
        1 => (0..METADATA.len()).prop_map(HdrOp::Metadata),
        1 => (any::<Index>(), any::<bool>()).prop_map(|(i, d)| HdrOp::Field(i, d)),
        2 => (0..13usize).prop_map(HdrOp::HeaderLen),
        1 => (0..3usize).prop_map(HdrOp::HugeChain),
    ]
}

/// Byte edits of the assembled file.
#[derive(Clone, Debug)]
enum FileOp {
    Truncate(Index),
    Append(u16),
    /// A flipped bit in the data (past the header).
    FlipData(Index, u8),
}

fn file_op() -> impl Strategy<Value = FileOp> {
    prop_oneof![
        any::<Index>().prop_map(FileOp::Truncate),
        (0u16..600).prop_map(FileOp::Append),
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| FileOp::FlipData(i, b)),
    ]
}

#[derive(Clone, Debug)]
struct StCase {
    fixture: usize,
    hdr: Vec<HdrOp>,
    hdr_bytes: Vec<ByteOp>,
    file: Vec<FileOp>,
}

/// The file a case writes, and what it requires of the loader.
struct StBuilt {
    fixture: usize,
    header: Vec<u8>,
    file: Vec<u8>,
    /// Set when the file must be refused, saying why.
    /// Set when the file must be refused: (what, in detail).
    must_fail: Option<(String, String)>,
}

fn header_len(choice: usize, n: u64, file_len: u64) -> u64 {
    [
        0,
        1,
        7,
        n.saturating_sub(1),
        n + 1,
        n + 8,
        file_len,
        file_len + 1,
        u64::MAX,
        1 << 63,
        100_000_001,
        100_000_000,
        u32::MAX as u64 + 1,
    ][choice]
}

/// Offsets that sum to the top of u64: `read_metadata` adds 8 + header length to their end.
fn huge_chain(variant: usize, names: &[String]) -> Vec<Entry> {
    let s: u64 = (1 << 61) - 1; // U8 elements: bits = 8·s < 2^64
    let count = match variant {
        0 => 8,
        1 => 7,
        _ => 1,
    };
    (0..count)
        .map(|i| Entry {
            name: names
                .get(i as usize)
                .filter(|_| variant == 1)
                .cloned()
                .unwrap_or_else(|| format!("t{i}")),
            dtype: "\"U8\"".into(),
            shape: format!("[{s}]"),
            offsets: format!("[{},{}]", i * s, (i + 1) * s),
            raw: None,
            extra: String::new(),
        })
        .collect()
}

fn build_st(c: &StCase) -> StBuilt {
    let fx = &FIXTURE[c.fixture];
    let (mut es, data) = entries(&fx.tensors, fx.metadata.as_deref());
    let mut len_choice = None;
    let mut data = data;
    for op in &c.hdr {
        let len = es.len();
        if len == 0 {
            break;
        }
        let at = |i: &Index| i.index(len);
        match op {
            HdrOp::Dtype(i, v) => es[at(i)].dtype = DTYPES[*v].into(),
            HdrOp::Shape(i, v) => es[at(i)].shape = SHAPES[*v].into(),
            HdrOp::ShapeReverse(i) | HdrOp::ShapeFlat(i) => {
                let e = &mut es[at(i)];
                if let Ok(mut shape) = serde_json::from_str::<Vec<u64>>(&e.shape) {
                    if matches!(op, HdrOp::ShapeReverse(_)) {
                        shape.reverse();
                    } else {
                        shape = vec![shape.iter().product()];
                    }
                    e.shape = serde_json::to_string(&shape).unwrap();
                }
            }
            HdrOp::Offsets(i, v) => es[at(i)].offsets = OFFSETS[*v].into(),
            HdrOp::Nudge(i, end, delta) => {
                let e = &mut es[at(i)];
                if let Ok(mut o) = serde_json::from_str::<Vec<i128>>(&e.offsets)
                    && o.len() == 2
                {
                    o[*end as usize] += *delta as i128;
                    e.offsets = format!("[{},{}]", o[0], o[1]);
                }
            }
            HdrOp::Rename(i, j) => {
                let name = es[at(j)].name.clone();
                es[at(i)].name = name;
            }
            HdrOp::DupEntry(i) => {
                let e = es[at(i)].clone();
                es.push(e);
            }
            HdrOp::Remove(i) => {
                es.remove(at(i));
            }
            HdrOp::SwapOffsets(i, j) => {
                let (a, b) = (at(i), at(j));
                let o = es[a].offsets.clone();
                es[a].offsets = es[b].offsets.clone();
                es[b].offsets = o;
            }
            HdrOp::Metadata(v) => match es.iter_mut().find(|e| e.name == "__metadata__") {
                Some(e) => e.raw = Some(METADATA[*v].into()),
                None => es.insert(
                    0,
                    Entry {
                        name: "__metadata__".into(),
                        dtype: String::new(),
                        shape: String::new(),
                        offsets: String::new(),
                        raw: Some(METADATA[*v].into()),
                        extra: String::new(),
                    },
                ),
            },
            HdrOp::Field(i, dup) => {
                es[at(i)].extra = if *dup {
                    ",\"shape\":[1]".into()
                } else {
                    ",\"quantization\":\"q8_0\"".into()
                }
            }
            HdrOp::HeaderLen(v) => len_choice = Some(*v),
            HdrOp::HugeChain(v) => {
                let names: Vec<String> = fx.tensors.iter().map(|t| t.name.clone()).collect();
                es = huge_chain(*v, &names);
                data.clear();
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    let dup = es.iter().find(|e| !seen.insert(e.name.as_str()));
    let must_fail = if c.hdr_bytes.is_empty() {
        dup.map(|e| {
            (
                "a tensor name twice in one safetensors header".to_string(),
                format!(
                    "the tensor name `{}` appears twice in one safetensors header",
                    e.name
                ),
            )
        })
    } else {
        None
    };
    let header = apply_bytes(header_text(&es).into_bytes(), &c.hdr_bytes);
    let n = header.len() as u64;
    let file_len = 8 + n + data.len() as u64;
    let len = len_choice.map(|v| header_len(v, n, file_len));
    let mut file = safetensors_file(&header, len, &data);
    for op in &c.file {
        match op {
            FileOp::Truncate(i) => {
                let l = file.len();
                file.truncate(i.index(l + 1).min(l));
            }
            FileOp::Append(k) => file.extend((0..*k).map(|x| x as u8)),
            FileOp::FlipData(i, b) => {
                let start = (8 + header.len()).min(file.len());
                if file.len() > start {
                    let p = start + i.index(file.len() - start);
                    file[p] ^= 1 << b;
                }
            }
        }
    }
    StBuilt {
        fixture: c.fixture,
        header,
        file,
        must_fail,
    }
}

fn describe_st(b: &StBuilt) -> String {
    format!(
        "fixture {} + model.safetensors of {} bytes, first 8 = {:?}, header:\n{}",
        FIXTURES[b.fixture],
        b.file.len(),
        &b.file[..b.file.len().min(8)],
        clip(&String::from_utf8_lossy(&b.header), 4000),
    )
}

/// Loads `dir`: no panic; when the case says so, an error (naming `must_name` if given);
/// when loaded, every tensor's bytes match its shape.
pub(crate) fn check_load(
    dir: &Path,
    must_fail: Option<(&str, &str)>,
    must_name: Option<&str>,
) -> Check {
    match Model::load(dir) {
        Ok(model) => {
            if let Some((kind, why)) = must_fail {
                return Err(fail(
                    format!("[accepted] {kind}"),
                    format!("Model::load accepted a directory where {why}"),
                ));
            }
            check_loaded(&model)
        }
        Err(e) => {
            let msg = e.to_string();
            if let (Some(_), Some(name)) = (must_fail, must_name)
                && !msg.contains(name)
            {
                return Err(fail(
                    format!("[error] does not name {name}"),
                    format!("the error should name {name}: {msg}"),
                ));
            }
            Ok(())
        }
    }
}

/// A loaded model: every tensor's bytes match its shape and dequantize; its counts compute.
pub(crate) fn check_loaded(model: &Model) -> Check {
    for t in model.weights.all() {
        let numel = t
            .shape
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .map(|n| t.dtype.bytes_of(n));
        if numel != Some(t.bytes().len()) {
            return Err(fail(
                "[loaded] tensor bytes do not match its shape",
                format!("{:?}: {} bytes", t, t.bytes().len()),
            ));
        }
        let _ = t.to_f32();
    }
    let _ = (model.param_count(), model.dtype_counts());
    Ok(())
}

fn check_st(b: &StBuilt) -> Check {
    let scratch = Scratch::new();
    let dir = &scratch.0;
    std::fs::write(dir.join("config.json"), &FIXTURE[b.fixture].config).unwrap();
    std::fs::write(dir.join("model.safetensors"), &b.file).unwrap();
    let must_fail = b.must_fail.as_ref().map(|(k, w)| (k.as_str(), w.as_str()));
    check_load(dir, must_fail, None)
}

pub(crate) fn fuzz_safetensors_header() {
    let strategy =
        (0..FIXTURES.len(), prop::collection::vec(hdr_op(), 1..4)).prop_map(|(fixture, hdr)| {
            StCase {
                fixture,
                hdr,
                hdr_bytes: vec![],
                file: vec![],
            }
        });
    fuzz(
        "safetensors_header",
        1000,
        strategy,
        build_st,
        describe_st,
        check_st,
    );
}

pub(crate) fn fuzz_safetensors_bytes() {
    let strategy = (
        0..FIXTURES.len(),
        prop::collection::vec(hdr_op(), 0..2),
        prop::collection::vec(byte_op(), 0..4),
        prop::collection::vec(file_op(), 0..3),
    )
        .prop_map(|(fixture, hdr, hdr_bytes, file)| StCase {
            fixture,
            hdr,
            hdr_bytes,
            file,
        });
    fuzz(
        "safetensors_bytes",
        800,
        strategy,
        build_st,
        describe_st,
        check_st,
    );
}
