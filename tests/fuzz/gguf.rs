use super::*;

// ---------------------------------------------------------------------------------------
// GGUF files (`Model::load_with_tokenizer` on a `.gguf`: the reader, the config from its
// metadata, the tensors, the tokenizer rebuilt from `tokenizer.ggml.*`)
// ---------------------------------------------------------------------------------------

/// The GGUF fixtures: a plain Mamba2 in f32, a hybrid in q8_0, a k-quant Mamba2, a
/// `nemotron_h_moe` in q8_0 (stacked experts) and one with Q5_0 experts (a mixed file), a
/// `granitehybrid` in f32.
const GGUF_FIXTURES: [&str; 6] = [
    "tests/fixtures/gguf/g1.f32.gguf",
    "tests/fixtures/gguf/nemotron_h_hybrid.q8_0.gguf",
    "tests/fixtures/gguf/k256.q4_k.gguf",
    "tests/fixtures/gguf/moe64.q8_0.gguf",
    "tests/fixtures/gguf/moe64.q5_0.gguf",
    "tests/fixtures/gguf/granite_moe_hybrid.f32.gguf",
];

/// A metadata value as the test writes it back: `len` overrides the declared length of a
/// string or the declared count of an array (a file that lies about its sizes).
#[derive(Clone, Debug)]
enum Gv {
    /// Fixed-size value of GGUF type `ty` (not a string or an array), its bytes as stored.
    Fixed {
        ty: u32,
        bytes: Vec<u8>,
    },
    Str {
        bytes: Vec<u8>,
        len: Option<u64>,
    },
    Arr {
        elem: u32,
        items: Vec<Gv>,
        len: Option<u64>,
    },
    /// A type id the format does not have, with no payload.
    Unknown(u32),
}

#[derive(Clone, Debug)]
struct GTensor {
    name: Vec<u8>,
    /// GGUF order (`ne`), its count written as given (`dims_len` may lie).
    ne: Vec<u64>,
    dims_len: Option<u32>,
    ty: u32,
    offset: u64,
}

#[derive(Clone, Debug)]
struct GFile {
    version: u32,
    kv: Vec<(Vec<u8>, Gv)>,
    tensors: Vec<GTensor>,
    /// Overrides of the declared counts.
    kv_count: Option<u64>,
    tensor_count: Option<u64>,
    /// The data section as it followed the header (tensor offsets point into it).
    data: Vec<u8>,
}

fn fixed_size(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        _ => return None,
    })
}

struct GReader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl GReader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    fn string(&mut self) -> Vec<u8> {
        let n = self.u64() as usize;
        self.take(n).to_vec()
    }
    fn value(&mut self, ty: u32) -> Gv {
        match ty {
            8 => Gv::Str {
                bytes: self.string(),
                len: None,
            },
            9 => {
                let elem = self.u32();
                let n = self.u64();
                let items = (0..n).map(|_| self.value(elem)).collect();
                Gv::Arr {
                    elem,
                    items,
                    len: None,
                }
            }
            t => Gv::Fixed {
                ty: t,
                bytes: self
                    .take(fixed_size(t).expect("a fixture's value type"))
                    .to_vec(),
            },
        }
    }
}

/// Parses one of the (well-formed) fixtures.
fn parse_gguf(bytes: &[u8]) -> GFile {
    let mut r = GReader { b: bytes, pos: 0 };
    assert_eq!(r.take(4), b"GGUF");
    let version = r.u32();
    let (nt, nkv) = (r.u64(), r.u64());
    let kv = (0..nkv)
        .map(|_| {
            let k = r.string();
            let ty = r.u32();
            (k, r.value(ty))
        })
        .collect();
    let tensors = (0..nt)
        .map(|_| {
            let name = r.string();
            let n = r.u32();
            let ne = (0..n).map(|_| r.u64()).collect();
            GTensor {
                name,
                ne,
                dims_len: None,
                ty: r.u32(),
                offset: r.u64(),
            }
        })
        .collect();
    let data_offset = r.pos.next_multiple_of(32);
    GFile {
        version,
        kv,
        tensors,
        kv_count: None,
        tensor_count: None,
        data: bytes[data_offset..].to_vec(),
    }
}

fn type_of(v: &Gv) -> u32 {
    match v {
        Gv::Fixed { ty, .. } => *ty,
        Gv::Str { .. } => 8,
        Gv::Arr { .. } => 9,
        Gv::Unknown(t) => *t,
    }
}

fn write_value(out: &mut Vec<u8>, v: &Gv) {
    match v {
        Gv::Fixed { bytes, .. } => out.extend(bytes),
        Gv::Str { bytes, len } => {
            out.extend(len.unwrap_or(bytes.len() as u64).to_le_bytes());
            out.extend(bytes);
        }
        Gv::Arr { elem, items, len } => {
            out.extend(elem.to_le_bytes());
            out.extend(len.unwrap_or(items.len() as u64).to_le_bytes());
            for i in items {
                write_value(out, i);
            }
        }
        Gv::Unknown(_) => {}
    }
}

/// The file's bytes: the header, padding to 32, the data section.
fn write_gguf(f: &GFile) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(f.version.to_le_bytes());
    out.extend(
        f.tensor_count
            .unwrap_or(f.tensors.len() as u64)
            .to_le_bytes(),
    );
    out.extend(f.kv_count.unwrap_or(f.kv.len() as u64).to_le_bytes());
    for (k, v) in &f.kv {
        out.extend((k.len() as u64).to_le_bytes());
        out.extend(k);
        out.extend(type_of(v).to_le_bytes());
        write_value(&mut out, v);
    }
    for t in &f.tensors {
        out.extend((t.name.len() as u64).to_le_bytes());
        out.extend(&t.name);
        out.extend(t.dims_len.unwrap_or(t.ne.len() as u32).to_le_bytes());
        for n in &t.ne {
            out.extend(n.to_le_bytes());
        }
        out.extend(t.ty.to_le_bytes());
        out.extend(t.offset.to_le_bytes());
    }
    out.resize(out.len().next_multiple_of(32), 0);
    out.extend(&f.data);
    out
}

static GGUF_FILES: LazyLock<Vec<GFile>> =
    LazyLock::new(|| GGUF_FIXTURES.iter().map(|p| parse_gguf(&read(p))).collect());

/// Values a number is set to, as u64 bits of the value's own width (truncated to it).
const EXTREMES: [u64; 10] = [
    0,
    1,
    2,
    3,
    u64::MAX,
    1 << 31,
    1 << 32,
    1 << 62,
    0x7fc0_0000,           // f32 NaN (in 4 bytes)
    0x7ff0_0000_0000_0000, // f64 +inf (in 8 bytes)
];

/// Strings a string value (or an item of a string array) is set to.
const STRINGS: [&str; 10] = [
    "",
    "mamba2",
    "nemotron_h",
    "llama",
    "gpt2",
    "{% for i in range(99999999) %}{{ i }}{% endfor %}",
    "{{ messages[0]['content'] * 100000000 }}",
    "\u{0}",
    "Ġ Ġ",
    "<0xZZ>",
];

#[derive(Clone, Debug)]
enum GgufOp {
    /// A fixed-size value set to an extreme (or a numeric type changed, same bytes resized).
    Number(Index, usize, Option<u32>),
    /// A value replaced by a default of another type (13 and 99: types GGUF does not have).
    Retype(Index, u32),
    Remove(Index),
    Duplicate(Index),
    /// A string value (or a string array's item) set to one of `STRINGS`.
    Text(Index, Index, usize),
    /// An array cut to `n` items, grown by repeating its first items, or declaring a count
    /// its items do not have.
    ArrayLen(Index, u8, usize),
    /// A string declaring more bytes than it has.
    StrLen(Index, u64),
    /// A tensor's dimensions: dropped, one added, one set to an extreme, their count lying.
    Dims(Index, u8, usize),
    TensorType(Index, u32),
    /// A tensor's offset moved by ±delta, set to an extreme, or to another tensor's.
    Offset(Index, u8, usize),
    /// A tensor renamed to another's name, an empty name or a long one; or removed.
    Rename(Index, Index, u8),
    /// The declared tensor or metadata count off by one, or huge.
    Count(bool, u8),
    Version(u32),
}

fn gguf_op() -> impl Strategy<Value = GgufOp> {
    prop_oneof![
        (
            any::<Index>(),
            0..EXTREMES.len(),
            prop::option::of(prop::sample::select(vec![
                0u32, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12
            ]))
        )
            .prop_map(|(i, e, t)| GgufOp::Number(i, e, t)),
        (
            any::<Index>(),
            prop::sample::select(vec![0u32, 4, 5, 6, 7, 8, 9, 10, 12, 13, 99])
        )
            .prop_map(|(i, t)| GgufOp::Retype(i, t)),
        any::<Index>().prop_map(GgufOp::Remove),
        any::<Index>().prop_map(GgufOp::Duplicate),
        (any::<Index>(), any::<Index>(), 0..STRINGS.len())
            .prop_map(|(i, j, s)| GgufOp::Text(i, j, s)),
        (any::<Index>(), 0u8..3, 0usize..4).prop_map(|(i, m, n)| GgufOp::ArrayLen(i, m, n)),
        (
            any::<Index>(),
            prop::sample::select(vec![1u64, 1 << 20, 1 << 40, u64::MAX])
        )
            .prop_map(|(i, n)| GgufOp::StrLen(i, n)),
        (any::<Index>(), 0u8..5, 0..EXTREMES.len()).prop_map(|(i, m, e)| GgufOp::Dims(i, m, e)),
        (
            any::<Index>(),
            prop::sample::select(vec![0u32, 1, 2, 3, 6, 8, 10, 12, 13, 14, 16, 30, 39, 1000])
        )
            .prop_map(|(i, t)| GgufOp::TensorType(i, t)),
        (any::<Index>(), 0u8..4, 0..EXTREMES.len()).prop_map(|(i, m, e)| GgufOp::Offset(i, m, e)),
        (any::<Index>(), any::<Index>(), 0u8..4).prop_map(|(i, j, m)| GgufOp::Rename(i, j, m)),
        (any::<bool>(), 0u8..3).prop_map(|(t, m)| GgufOp::Count(t, m)),
        prop::sample::select(vec![1u32, 2, 4, 0x0300_0000]).prop_map(GgufOp::Version),
    ]
}

/// A default value of GGUF type `ty`.
fn default_of(ty: u32) -> Gv {
    match ty {
        8 => Gv::Str {
            bytes: b"x".to_vec(),
            len: None,
        },
        9 => Gv::Arr {
            elem: 4,
            items: vec![Gv::Fixed {
                ty: 4,
                bytes: 7u32.to_le_bytes().to_vec(),
            }],
            len: None,
        },
        t => match fixed_size(t) {
            Some(n) => Gv::Fixed {
                ty: t,
                bytes: vec![1; n],
            },
            None => Gv::Unknown(t),
        },
    }
}

/// The string values of `v` (itself, or a string array's items), for `Text` and `StrLen`.
fn strings_of(v: &mut Gv) -> Vec<&mut Gv> {
    match v {
        Gv::Str { .. } => vec![v],
        Gv::Arr { items, .. } => items
            .iter_mut()
            .filter(|i| matches!(i, Gv::Str { .. }))
            .collect(),
        _ => vec![],
    }
}

/// Why a file must be refused: the kind of damage, what it is, and what the error must
/// name (the key, the tensor, the version).
type Claim = (&'static str, String, String);

/// The case and what the load must do.
struct GgufBuilt {
    fixture: usize,
    ops: String,
    file: Vec<u8>,
    must_fail: Option<Claim>,
}

fn apply_gguf(f: &mut GFile, op: &GgufOp) {
    let nkv = f.kv.len();
    let nt = f.tensors.len();
    match op {
        GgufOp::Number(i, e, t) if nkv > 0 => match &mut f.kv[i.index(nkv)].1 {
            // A number, retyped or not, set to an extreme.
            Gv::Fixed { ty, bytes } => {
                if let Some(t) = t {
                    *ty = *t;
                    bytes.resize(fixed_size(*t).unwrap(), 0);
                }
                let n = bytes.len();
                bytes.copy_from_slice(&EXTREMES[*e].to_le_bytes()[..n]);
            }
            // An array of numbers: its first item (the array keeps its type).
            Gv::Arr { items, .. } => {
                if let Some(Gv::Fixed { bytes, .. }) = items.first_mut() {
                    let n = bytes.len();
                    bytes.copy_from_slice(&EXTREMES[*e].to_le_bytes()[..n]);
                }
            }
            _ => {}
        },
        GgufOp::Retype(i, t) if nkv > 0 => f.kv[i.index(nkv)].1 = default_of(*t),
        GgufOp::Remove(i) if nkv > 0 => {
            f.kv.remove(i.index(nkv));
        }
        GgufOp::Duplicate(i) if nkv > 0 => {
            let e = f.kv[i.index(nkv)].clone();
            f.kv.push(e);
        }
        GgufOp::Text(i, j, s) if nkv > 0 => {
            let mut strs = strings_of(&mut f.kv[i.index(nkv)].1);
            if !strs.is_empty() {
                let at = j.index(strs.len());
                if let Gv::Str { bytes, .. } = &mut *strs[at] {
                    *bytes = STRINGS[*s].as_bytes().to_vec();
                }
            }
        }
        GgufOp::ArrayLen(i, m, n) if nkv > 0 => {
            if let Gv::Arr { items, len, .. } = &mut f.kv[i.index(nkv)].1 {
                match m {
                    0 => items.truncate(*n),
                    1 => {
                        let more: Vec<Gv> = items.iter().take(*n + 1).cloned().collect();
                        items.extend(more);
                    }
                    _ => *len = Some([u64::MAX, 1 << 40, items.len() as u64 + 1, 1 << 28][*n]),
                }
            }
        }
        GgufOp::StrLen(i, n) if nkv > 0 => {
            let mut strs = strings_of(&mut f.kv[i.index(nkv)].1);
            if let Some(Gv::Str { bytes, len }) = strs.last_mut().map(|s| &mut **s) {
                *len = Some((bytes.len() as u64).saturating_add(*n));
            }
        }
        GgufOp::Dims(i, m, e) if nt > 0 => {
            let t = &mut f.tensors[i.index(nt)];
            match m {
                0 => t.ne.clear(),
                1 => t.ne.push(1),
                2 => {
                    if let Some(last) = t.ne.last_mut() {
                        *last = EXTREMES[*e];
                    }
                }
                3 => t.ne.resize(5, 1),
                _ => t.dims_len = Some(EXTREMES[*e] as u32),
            }
        }
        GgufOp::TensorType(i, ty) if nt > 0 => f.tensors[i.index(nt)].ty = *ty,
        GgufOp::Offset(i, m, e) if nt > 0 => {
            let other = f.tensors[(i.index(nt) + 1) % nt].offset;
            let t = &mut f.tensors[i.index(nt)];
            t.offset = match m {
                0 => t.offset.wrapping_add(EXTREMES[*e]),
                1 => EXTREMES[*e],
                2 => other,
                _ => t.offset.wrapping_sub(32),
            };
        }
        GgufOp::Rename(i, j, m) if nt > 0 => {
            let other = f.tensors[j.index(nt)].name.clone();
            let at = i.index(nt);
            match m {
                0 => f.tensors[at].name = other,
                1 => f.tensors[at].name.clear(),
                2 => f.tensors[at].name = vec![b'a'; 70_000],
                _ => {
                    f.tensors.remove(at);
                }
            }
        }
        GgufOp::Count(tensors, m) => {
            let n = if *tensors { nt } else { nkv } as u64;
            let v = [n + 1, n.saturating_sub(1), u64::MAX][*m as usize];
            if *tensors {
                f.tensor_count = Some(v);
            } else {
                f.kv_count = Some(v);
            }
        }
        GgufOp::Version(v) => f.version = *v,
        _ => {}
    }
}

/// Why the reader must refuse the file as the ops left it, judged from the final state (so
/// a later op that undoes an earlier one's damage is accounted for). Nothing is claimed
/// where a count or a dimension count lies: the reader then parses what follows as
/// something else, which may fail anywhere, or, rarely, not.
fn must_fail(f: &GFile) -> Option<Claim> {
    if f.kv_count.is_some()
        || f.tensor_count.is_some()
        || f.tensors.iter().any(|t| t.dims_len.is_some())
    {
        return None;
    }
    if !matches!(f.version, 2 | 3) {
        let v = f.version;
        let name = if matches!(v.swap_bytes(), 2 | 3) {
            "big-endian".to_string()
        } else {
            v.to_string()
        };
        return Some(("unsupported version", format!("version {v}"), name));
    }
    let mut keys = std::collections::HashSet::new();
    for (k, v) in &f.kv {
        let key = String::from_utf8_lossy(k).into_owned();
        if !keys.insert(k) {
            return Some(("duplicate key", format!("key `{key}` appears twice"), key));
        }
        if let Gv::Unknown(t) = v {
            return Some((
                "unknown value type",
                format!("key `{key}` has type {t}"),
                key,
            ));
        }
        let huge = |v: &Gv| match v {
            // (These files are under a MiB: 2^20 bytes or 2^28 items more cannot fit.)
            Gv::Str { bytes, len } => len.is_some_and(|n| n >= bytes.len() as u64 + (1 << 20)),
            Gv::Arr { len, .. } => len.is_some_and(|n| n >= 1 << 28),
            _ => false,
        };
        let inner = match v {
            Gv::Arr { items, .. } => items.iter().any(huge),
            _ => false,
        };
        if huge(v) || inner {
            return Some(("size past the file", format!("a size of `{key}`"), key));
        }
    }
    for t in &f.tensors {
        let name = String::from_utf8_lossy(&t.name).into_owned();
        if t.ne.is_empty() || t.ne.len() > 4 {
            return Some((
                "dimension count",
                format!("tensor `{name}` has {} dimensions", t.ne.len()),
                name,
            ));
        }
        // F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 are read; the rest
        // (4 and 5 gone from ggml, Q8_1, Q2_K, Q3_K, Q8_K, the IQ formats) refused.
        if !matches!(t.ty, 0..=3 | 6..=8 | 12..=14 | 30) {
            return Some((
                "unsupported tensor type",
                format!("tensor `{name}` of type {}", t.ty),
                name,
            ));
        }
    }
    None
}

fn build_gguf((fixture, ops): &(usize, Vec<GgufOp>)) -> GgufBuilt {
    let mut f = GGUF_FILES[*fixture].clone();
    for op in ops {
        apply_gguf(&mut f, op);
    }
    // With more than one op, another damage may come first in the file and be the one
    // reported: the error must then still come, but need not name this one.
    let must_fail = must_fail(&f)
        .map(|(kind, why, name)| (kind, why, if ops.len() == 1 { name } else { String::new() }));
    GgufBuilt {
        fixture: *fixture,
        ops: format!("{ops:?}"),
        file: write_gguf(&f),
        must_fail,
    }
}

fn describe_gguf(b: &GgufBuilt) -> String {
    format!(
        "{} with {} ({} bytes)",
        GGUF_FIXTURES[b.fixture],
        clip(&b.ops, 3000),
        b.file.len()
    )
}

/// Loads the file with its tokenizer: no panic; where the case must fail, an error (naming
/// the damage where the case says); where it loads, `check_loaded`, two tokens on the CPU
/// reference, and the tokenizer encodes, decodes and renders its chat template (or
/// refuses cleanly).
fn check_gguf_file(path: &Path, must_fail: Option<&Claim>) -> Check {
    match Model::load_with_tokenizer(path) {
        Ok((model, tokenizer)) => {
            if let Some((kind, why, _)) = must_fail {
                return Err(fail(
                    format!("[accepted] {kind}"),
                    format!("Model::load accepted a GGUF file where {why}"),
                ));
            }
            crate::safetensors::check_loaded(&model)?;
            let _ = mamba2_wgpu::reference::CpuModel::<f32>::new(&model.config, &model.weights)
                .map(|cpu| {
                    cpu.forward(
                        &mut cpu.new_state(),
                        &[1, 2],
                        mamba2_wgpu::reference::Scan::Sequential,
                        mamba2_wgpu::reference::Logits::Last,
                    )
                });
            if let Some(tok) = tokenizer {
                if let Ok(ids) = tok.encode_with("Hello, world! 12 ünï", true) {
                    let _ = tok.decode(&ids);
                }
                let _ = tok.render_chat(&[("user".into(), "hi".into())], true);
            }
            Ok(())
        }
        Err(e) => match must_fail {
            // (A name the lossy UTF-8 of the test mangled, or one too long to quote, is not
            // held against the error.)
            Some((kind, why, name))
                if !name.is_empty()
                    && name.len() < 200
                    && !name.contains('\u{fffd}')
                    && !e.to_string().contains(name.as_str()) =>
            {
                Err(fail(
                    format!("[error] does not name it: {kind}"),
                    format!("where {why}, the error does not name `{name}`: {e}"),
                ))
            }
            _ => Ok(()),
        },
    }
}

fn check_gguf(b: &GgufBuilt) -> Check {
    let scratch = Scratch::new();
    let path = scratch.0.join("model.gguf");
    std::fs::write(&path, &b.file).unwrap();
    check_gguf_file(&path, b.must_fail.as_ref())
}

pub(crate) fn fuzz_gguf_metadata() {
    let strategy = (
        0..GGUF_FIXTURES.len(),
        prop::collection::vec(gguf_op(), 1..4),
    );
    fuzz(
        "gguf_metadata",
        600,
        strategy,
        build_gguf,
        describe_gguf,
        check_gguf,
    );
}

/// Byte edits of a GGUF file, most of them inside its header (where the sizes and types
/// are): loads or clean errors.
pub(crate) fn fuzz_gguf_bytes() {
    let strategy = (
        0..GGUF_FIXTURES.len(),
        prop::collection::vec(byte_op(), 1..4),
        any::<bool>(),
    );
    let build = |(fixture, ops, whole): &(usize, Vec<ByteOp>, bool)| {
        let f = &GGUF_FILES[*fixture];
        let bytes = write_gguf(f);
        let header = bytes.len() - f.data.len();
        let file = if *whole {
            apply_bytes(bytes, ops)
        } else {
            let mut head = apply_bytes(bytes[..header].to_vec(), ops);
            head.extend(&bytes[header..]);
            head
        };
        GgufBuilt {
            fixture: *fixture,
            ops: format!("{ops:?} ({})", if *whole { "whole file" } else { "header" }),
            file,
            must_fail: None,
        }
    };
    fuzz(
        "gguf_bytes",
        600,
        strategy,
        build,
        describe_gguf,
        check_gguf,
    );
}
