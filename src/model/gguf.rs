//! GGUF files (llama.cpp's format, versions 2 and 3, little-endian): the header, the
//! metadata key/values and the tensor directory, read from a memory map without trusting
//! any of it. Every count is bounded by the bytes left to hold it, every size goes through
//! checked arithmetic, and each tensor's offset, alignment and extent are checked against
//! the file before a `Tensor` points into the mapping.
//!
//! Layout: `"GGUF"`, `version: u32`, `tensor_count: u64`, `kv_count: u64`, the key/values
//! (`key: string`, `type: u32`, value), the tensor infos (`name: string`, `n_dims: u32`,
//! `ne[n_dims]: u64` innermost first, `type: u32`, `offset: u64`), then the data section at
//! the next multiple of `general.alignment` (32 when absent); offsets are relative to it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::model::ggml::GgmlType;
use crate::model::safetensors::{DType, Tensor};

/// ggml tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;
/// Arrays inside arrays: real files nest at most once.
const MAX_NESTING: u32 = 8;
/// Metadata array items in one file, all arrays together. Each becomes a 32-byte `Value`,
/// so a file's bytes alone do not bound the memory (a 1 GiB array of u8 would ask for 32
/// GiB): 2^23 items (256 MiB of values) hold the largest vocabularies with their scores,
/// types and merges (262 144 tokens: under 10^6 items) many times over.
const MAX_ARRAY_ITEMS: u64 = 1 << 23;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The GGUF type name, for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F32(_) => "float32",
            Value::F64(_) => "float64",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// A short rendering for `mamba2 info`: arrays as their length and first items.
    pub fn summary(&self) -> String {
        match self {
            Value::Str(s) if s.chars().count() > 60 => {
                let head: String = s.chars().take(57).collect();
                format!("{head:?}… ({} chars)", s.chars().count())
            }
            Value::Str(s) => format!("{s:?}"),
            Value::Array(items) => {
                let head: Vec<String> = items.iter().take(3).map(Value::summary).collect();
                let more = if items.len() > 3 { ", …" } else { "" };
                format!("[{}{more}] ({} items)", head.join(", "), items.len())
            }
            Value::F32(v) => format!("{v}"),
            Value::F64(v) => format!("{v}"),
            Value::Bool(v) => format!("{v}"),
            other => other.as_u64().map_or_else(
                || match other {
                    Value::I8(v) => v.to_string(),
                    Value::I16(v) => v.to_string(),
                    Value::I32(v) => v.to_string(),
                    Value::I64(v) => v.to_string(),
                    _ => String::new(),
                },
                |v| v.to_string(),
            ),
        }
    }
}

/// An opened GGUF file: its metadata in file order and its tensors (row-major shapes:
/// GGUF's `ne` reversed), which point into the mapping.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<Tensor>,
    pub alignment: u64,
    /// Where the data section starts.
    pub data_offset: u64,
    pub file_len: u64,
}

impl GgufFile {
    /// Maps and checks `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = crate::files::open_regular(path)?;
        // SAFETY: read-only mapping; a file rewritten while we run is the user's hazard, as
        // with every mmap-based loader.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(path, Arc::new(mmap))
    }

    fn parse(path: &Path, mmap: Arc<Mmap>) -> Result<Self> {
        let bytes: &[u8] = &mmap;
        let mut r = Reader {
            bytes,
            pos: 0,
            path,
            items: 0,
        };
        let magic = r.take(4, "the magic number")?;
        if magic != b"GGUF" {
            return Err(Error::format(
                path,
                format!(
                    "not a GGUF file (it starts with {:02x?}, not \"GGUF\")",
                    magic
                ),
            ));
        }
        let version = r.u32("the version")?;
        if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            return Err(Error::format(
                path,
                "is a big-endian GGUF file: only little-endian files are read",
            ));
        }
        if !(2..=3).contains(&version) {
            return Err(Error::format(
                path,
                format!("GGUF version {version} is not supported (2 and 3 are)"),
            ));
        }
        let tensor_count = r.u64("the tensor count")?;
        let kv_count = r.u64("the metadata count")?;
        // Each key/value takes at least 8 + 4 + 1 bytes, each tensor info 8 + 4 + 4 + 8.
        r.bound(kv_count, 13, "metadata entries")?;
        let mut metadata: Vec<(String, Value)> = Vec::new();
        let mut keys = std::collections::HashSet::new();
        for i in 0..kv_count {
            let key = r.string(&format!("the key of metadata entry {i}"))?;
            let ty = r.u32(&format!("the type of metadata key `{key}`"))?;
            let value = r.value(ty, &key, 0)?;
            if !keys.insert(key.clone()) {
                return Err(Error::format(
                    path,
                    format!("metadata key `{key}` appears twice"),
                ));
            }
            metadata.push((key, value));
        }
        r.bound(tensor_count, 24, "tensor infos")?;
        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => 32,
            Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
            Some((_, v)) => {
                return Err(Error::format(
                    path,
                    format!(
                        "metadata key `general.alignment`: expected a power of two as uint32, \
                         found {} {}",
                        v.type_name(),
                        v.summary()
                    ),
                ));
            }
        };
        struct Info {
            name: String,
            shape: Vec<usize>,
            ty: GgmlType,
            offset: u64,
            size: u64,
        }
        let mut infos: Vec<Info> = Vec::new();
        let mut names = std::collections::HashSet::new();
        for i in 0..tensor_count {
            let name = r.string(&format!("the name of tensor {i}"))?;
            let bad = |why: String| Error::tensor(&name, format!("{}: {why}", path.display()));
            let n_dims = r.u32(&format!("the dimension count of tensor `{name}`"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(bad(format!(
                    "{n_dims} dimensions (GGUF tensors have 1 to {MAX_DIMS})"
                )));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(r.u64(&format!("the dimensions of tensor `{name}`"))?);
            }
            let type_id = r.u32(&format!("the type of tensor `{name}`"))?;
            let offset = r.u64(&format!("the offset of tensor `{name}`"))?;
            let ty = GgmlType::from_id(type_id).map_err(|name| {
                let what = match name {
                    Some(name) => format!("type {name} (id {type_id}) is not supported"),
                    None => format!(
                        "type id {type_id} is not a ggml type (a type newer than this engine, \
                         or a corrupt file)"
                    ),
                };
                bad(format!(
                    "{what}; F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K \
                     are read"
                ))
            })?;
            if ne.contains(&0) {
                return Err(bad(format!("has an empty dimension ({ne:?})")));
            }
            let count = ne
                .iter()
                .try_fold(1u64, |a, &n| a.checked_mul(n))
                .filter(|&n| n <= usize::MAX as u64 && n <= bytes.len() as u64 * 8)
                .ok_or_else(|| bad(format!("dimensions {ne:?} hold more values than the file")))?;
            let (per, _) = ty.block();
            if !ne[0].is_multiple_of(per as u64) {
                return Err(bad(format!(
                    "rows of {} values are not whole {} blocks of {per}",
                    ne[0],
                    ty.name()
                )));
            }
            let size = ty
                .bytes_of(count)
                .ok_or_else(|| bad("its size overflows".into()))?;
            if !offset.is_multiple_of(alignment) {
                return Err(bad(format!(
                    "offset {offset} is not a multiple of the file's alignment {alignment}"
                )));
            }
            if !names.insert(name.clone()) {
                return Err(bad("appears twice in the tensor directory".into()));
            }
            let shape = ne.iter().rev().map(|&n| n as usize).collect();
            infos.push(Info {
                name,
                shape,
                ty,
                offset,
                size,
            });
        }
        let data_offset = (r.pos as u64).next_multiple_of(alignment);
        let file_len = bytes.len() as u64;
        if infos.is_empty() {
            return Err(Error::format(path, "holds no tensors"));
        }
        // Extents inside the file, and no two tensors sharing bytes.
        let mut order: Vec<usize> = (0..infos.len()).collect();
        order.sort_by_key(|&i| infos[i].offset);
        let mut prev_end = 0u64;
        let mut prev_name = "";
        for &i in &order {
            let t = &infos[i];
            let start = data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(t.size));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(Error::tensor(
                        &t.name,
                        format!(
                            "{}: its {} bytes at offset {} run past the end of the file \
                             ({} bytes of data after the header): truncated or corrupt",
                            path.display(),
                            t.size,
                            t.offset,
                            file_len.saturating_sub(data_offset)
                        ),
                    ));
                }
            }
            if t.offset < prev_end {
                return Err(Error::tensor(
                    &t.name,
                    format!(
                        "{}: its bytes overlap those of `{prev_name}`",
                        path.display()
                    ),
                ));
            }
            prev_end = t.offset + t.size;
            prev_name = &t.name;
        }
        let tensors = infos
            .into_iter()
            .map(|t| {
                let start = (data_offset + t.offset) as usize;
                Tensor::mapped(
                    t.name,
                    DType::from_ggml(t.ty),
                    t.shape,
                    mmap.clone(),
                    start..start + t.size as usize,
                )
            })
            .collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            file_len,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// What a loaded model keeps of the file (its tensors go to `ModelWeights`).
    pub fn info(&self) -> GgufInfo {
        GgufInfo {
            path: self.path.clone(),
            version: self.version,
            metadata: self.metadata.clone(),
            types: self.type_counts(),
            tensors: self.tensors.len(),
            file_len: self.file_len,
        }
    }

    /// The error for metadata key `key`.
    pub fn key_error(&self, key: &str, why: impl std::fmt::Display) -> Error {
        Error::format(&self.path, format!("metadata key `{key}`: {why}"))
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&str> {
        match self.get(key) {
            Some(Value::Str(s)) => Ok(s),
            Some(v) => {
                Err(self.key_error(key, format!("expected a string, found {}", v.type_name())))
            }
            None => Err(self.key_error(key, "missing")),
        }
    }

    /// A required non-negative integer.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.key_error(key, "missing"))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.key_error(
                        key,
                        format!(
                            "expected a non-negative integer, found {} {}",
                            v.type_name(),
                            v.summary()
                        ),
                    )
                }),
        }
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| {
                    self.key_error(
                        key,
                        format!(
                            "expected a finite number, found {} {}",
                            v.type_name(),
                            v.summary()
                        ),
                    )
                }),
        }
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| {
                self.key_error(
                    key,
                    format!("expected a bool, found {} {}", v.type_name(), v.summary()),
                )
            }),
        }
    }

    /// An array key's items (`None` when absent), refusing any other type.
    pub fn array(&self, key: &str) -> Result<Option<&[Value]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(v) => {
                Err(self.key_error(key, format!("expected an array, found {}", v.type_name())))
            }
        }
    }

    /// How many tensors of each stored type, most common first.
    pub fn type_counts(&self) -> Vec<(DType, usize)> {
        let mut counts = crate::model::count_dtypes(&self.tensors);
        counts.sort_by_key(|c| std::cmp::Reverse(c.1));
        counts
    }
}

/// What `mamba2 info` and the tokenizer need of a GGUF file once its tensors are mapped.
#[derive(Clone, Debug)]
pub struct GgufInfo {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    /// Tensors per stored type, most common first.
    pub types: Vec<(DType, usize)>,
    pub tensors: usize,
    pub file_len: u64,
}

impl GgufInfo {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// Whether `path` is named as one of a safetensors model directory's own files (its
/// weights or a JSON config), not a model: such a path asks for its directory.
pub(crate) fn is_directory_file(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("safetensors") || e.eq_ignore_ascii_case("json"))
}

/// The GGUF file `path` names: the file itself, or the one `*.gguf` of a directory that
/// holds no safetensors config (`Ok(None)`: not a GGUF model). Two or more `.gguf` files in
/// a directory are refused, naming them.
pub fn gguf_path(path: &Path) -> Result<Option<PathBuf>> {
    // A regular file is a GGUF file, unless it is named as one of a model directory's
    // files (then `ModelConfig::from_dir` says to pass the directory).
    if path.is_file() && !is_directory_file(path) {
        return Ok(Some(path.to_path_buf()));
    }
    if !path.is_dir() || path.join("config.json").exists() || path.join("params.json").exists() {
        return Ok(None);
    }
    let entries = std::fs::read_dir(path).map_err(|e| Error::io(path, e))?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
        })
        .collect();
    found.sort();
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => {
            let names: Vec<String> = found
                .iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect();
            Err(Error::format(
                path,
                format!(
                    "holds {} GGUF files ({}): name one with --model",
                    names.len(),
                    names.join(", ")
                ),
            ))
        }
    }
}

/// A cursor over the header that names what it was reading when the bytes ran out.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
    /// Metadata array items read so far (`MAX_ARRAY_ITEMS`).
    items: u64,
}

impl<'a> Reader<'a> {
    fn truncated(&self, what: &str) -> Error {
        Error::format(
            self.path,
            format!(
                "truncated GGUF header: the file ends ({} bytes) while reading {what}",
                self.bytes.len()
            ),
        )
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| self.truncated(what))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Refuses a count of items that cannot fit the bytes left (each at least `min` bytes),
    /// before anything is allocated for them.
    fn bound(&self, count: u64, min: u64, what: &str) -> Result<()> {
        let left = (self.bytes.len() - self.pos) as u64;
        if count > left / min {
            return Err(Error::format(
                self.path,
                format!(
                    "the header declares {count} {what}, more than the {left} bytes left can hold: \
                     truncated or corrupt"
                ),
            ));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        self.bound(len, 1, &format!("bytes of {what}"))?;
        let raw = self.take(len as usize, what)?;
        String::from_utf8(raw.to_vec()).map_err(|e| {
            Error::format(
                self.path,
                format!(
                    "{what} is not UTF-8 (invalid byte at {})",
                    e.utf8_error().valid_up_to()
                ),
            )
        })
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value> {
        let what = format!("the value of metadata key `{key}`");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(&what)?[0]),
            1 => Value::I8(self.array::<1>(&what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(self.u32(&what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(Error::format(
                        self.path,
                        format!("metadata key `{key}`: bool byte {b} is neither 0 nor 1"),
                    ));
                }
            },
            8 => Value::Str(self.string(&what)?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(Error::format(
                        self.path,
                        format!("metadata key `{key}`: arrays nested over {MAX_NESTING} deep"),
                    ));
                }
                let item = self.u32(&what)?;
                let count = self.u64(&what)?;
                // Strings and arrays take at least 8 bytes each, scalars at least 1.
                let min = if matches!(item, 8 | 9) { 8 } else { 1 };
                self.bound(count, min, &format!("items of metadata key `{key}`"))?;
                self.items = self.items.saturating_add(count);
                if self.items > MAX_ARRAY_ITEMS {
                    return Err(Error::format(
                        self.path,
                        format!(
                            "metadata key `{key}`: {count} array items bring the file's \
                             metadata arrays past {MAX_ARRAY_ITEMS} items, more than any \
                             model's vocabulary needs"
                        ),
                    ));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(item, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            other => {
                return Err(Error::format(
                    self.path,
                    format!("metadata key `{key}`: unknown value type {other}"),
                ));
            }
        })
    }
}
