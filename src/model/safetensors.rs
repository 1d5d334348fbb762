//! Memory-mapped safetensors: one file or a sharded set (`model.safetensors.index.json`).
//! Tensors stay in the mapping until someone converts or uploads them.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::model::ggml::GgmlType;

/// Element types the loader understands: safetensors' floats, and the block-quantized
/// types of GGUF files (`Quant`; see `model::ggml`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    Quant(GgmlType),
}

impl DType {
    /// The dtype of a GGUF tensor type (its floats are the plain variants).
    pub fn from_ggml(t: GgmlType) -> Self {
        match t {
            GgmlType::F32 => DType::F32,
            GgmlType::F16 => DType::F16,
            GgmlType::BF16 => DType::BF16,
            q => DType::Quant(q),
        }
    }

    pub fn ggml(self) -> GgmlType {
        match self {
            DType::F32 => GgmlType::F32,
            DType::F16 => GgmlType::F16,
            DType::BF16 => GgmlType::BF16,
            DType::Quant(q) => q,
        }
    }

    /// Values per block (1 for the float types).
    pub fn block(self) -> usize {
        self.ggml().block().0
    }

    /// Bytes of `n` values (whole blocks for the quantized types; callers check that rows
    /// are whole blocks when the tensor is made).
    pub fn bytes_of(self, n: usize) -> usize {
        let (per, bytes) = self.ggml().block();
        n / per * bytes
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Quant(q) => q.name(),
        }
    }
}

/// Where a tensor's bytes live: a file mapping or an owned buffer (synthetic weights).
#[derive(Clone)]
pub enum Bytes {
    Mapped(Arc<Mmap>),
    Owned(Arc<Vec<u8>>),
    /// Compiled into the binary (the embedded model).
    Static(&'static [u8]),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
            Bytes::Static(s) => s,
        }
    }
}

/// One tensor: its name in the checkpoint, dtype, shape and bytes (little-endian, C order).
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    bytes: Bytes,
    range: Range<usize>,
    /// For a view (`rows`): the whole checkpoint tensor it is part of.
    view_of: Option<Arc<Tensor>>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor({} {} {:?})",
            self.name,
            self.dtype.name(),
            self.shape
        )
    }
}

impl Tensor {
    /// A tensor over owned f32 values (synthetic weights, tests).
    pub fn from_f32(name: impl Into<String>, shape: Vec<usize>, values: &[f32]) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            values.len(),
            "shape and data disagree"
        );
        let bytes: Vec<u8> = bytemuck::cast_slice(values).to_vec();
        let len = bytes.len();
        Tensor {
            name: name.into(),
            dtype: DType::F32,
            shape,
            bytes: Bytes::Owned(Arc::new(bytes)),
            range: 0..len,
            view_of: None,
        }
    }

    /// A tensor over owned f16 values.
    pub fn from_f16(name: impl Into<String>, shape: Vec<usize>, values: &[half::f16]) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            values.len(),
            "shape and data disagree"
        );
        let bytes: Vec<u8> = bytemuck::cast_slice(values).to_vec();
        let len = bytes.len();
        Tensor {
            name: name.into(),
            dtype: DType::F16,
            shape,
            bytes: Bytes::Owned(Arc::new(bytes)),
            range: 0..len,
            view_of: None,
        }
    }

    /// A tensor of ggml blocks of `ty` over owned bytes (what a GGUF file holds: tests build
    /// quantized tensors with it); the rows must be whole blocks and the bytes exactly the
    /// shape's.
    pub fn from_ggml_blocks(
        name: impl Into<String>,
        ty: GgmlType,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    ) -> Result<Self> {
        let name = name.into();
        let cols = shape.last().copied().unwrap_or(0);
        let numel = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64));
        let want = numel.and_then(|n| ty.bytes_of(n));
        if cols == 0 || !cols.is_multiple_of(ty.block().0) || want != Some(bytes.len() as u64) {
            return Err(Error::InvalidInput(format!(
                "{name}: {} bytes for {:?} values in {} blocks of {} values",
                bytes.len(),
                shape,
                ty.name(),
                ty.block().0
            )));
        }
        let len = bytes.len();
        Ok(Tensor {
            name,
            dtype: DType::Quant(ty),
            shape,
            bytes: Bytes::Owned(Arc::new(bytes)),
            range: 0..len,
            view_of: None,
        })
    }

    /// A tensor over `range` of a file mapping (a GGUF tensor; its extent already checked).
    pub(crate) fn mapped(
        name: String,
        dtype: DType,
        shape: Vec<usize>,
        mmap: Arc<Mmap>,
        range: Range<usize>,
    ) -> Self {
        debug_assert!(range.end <= mmap.len());
        Tensor {
            name,
            dtype,
            shape,
            bytes: Bytes::Mapped(mmap),
            range,
            view_of: None,
        }
    }

    /// The checkpoint tensor this one is a view of, or itself.
    pub fn origin(&self) -> &Tensor {
        self.view_of.as_deref().unwrap_or(self)
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// A view of the slices `first.start..first.end` along the first dimension, reshaped to
    /// `shape` (same bytes, no copy): expert `e` of a stacked `[E, rows, cols]` tensor, or
    /// the gate half of a `[2I, d]` one. The view keeps this tensor's name with `what`
    /// appended, so errors still point into the checkpoint.
    pub fn rows(&self, first: Range<usize>, shape: Vec<usize>, what: &str) -> Tensor {
        let per: usize = self
            .dtype
            .bytes_of(self.shape[1..].iter().product::<usize>());
        assert!(
            first.start <= first.end && first.end <= self.shape[0],
            "{first:?} of {}",
            self.name
        );
        assert_eq!(
            self.dtype.bytes_of(shape.iter().product::<usize>()),
            (first.end - first.start) * per,
            "reshape of {}",
            self.name
        );
        let start = self.range.start + first.start * per;
        Tensor {
            name: format!("{}{what}", self.name),
            dtype: self.dtype,
            shape,
            bytes: self.bytes.clone(),
            range: start..start + (first.end - first.start) * per,
            view_of: Some(
                self.view_of
                    .clone()
                    .unwrap_or_else(|| Arc::new(self.clone())),
            ),
        }
    }

    /// Columns `cols` of a 2-D tensor, copied in this tensor's own type (no conversion: a
    /// quantized tensor's blocks are copied whole), named with `what` appended; `None`
    /// where the range would cut a quantized block.
    pub fn cols(&self, cols: Range<usize>, what: &str) -> Option<Tensor> {
        let (rows, full) = (self.shape[0], self.shape[1]);
        assert!(
            self.shape.len() == 2 && cols.start <= cols.end && cols.end <= full,
            "{cols:?} of {}",
            self.name
        );
        let block = self.dtype.block();
        if !cols.start.is_multiple_of(block) || !cols.end.is_multiple_of(block) {
            return None;
        }
        let (a, b) = (
            self.dtype.bytes_of(cols.start),
            self.dtype.bytes_of(cols.end),
        );
        let row = self.dtype.bytes_of(full);
        let src = self.bytes();
        let mut bytes = Vec::with_capacity(rows * (b - a));
        for r in 0..rows {
            bytes.extend_from_slice(&src[r * row + a..r * row + b]);
        }
        let len = bytes.len();
        Some(Tensor {
            name: format!("{}{what}", self.name),
            dtype: self.dtype,
            shape: vec![rows, cols.end - cols.start],
            bytes: Bytes::Owned(Arc::new(bytes)),
            range: 0..len,
            view_of: None,
        })
    }

    /// The raw little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes.as_slice()[self.range.clone()]
    }

    /// Converts to f32 (exact for f16 and bf16).
    pub fn to_f32(&self) -> Vec<f32> {
        self.to_f32_checked().0
    }

    /// Converts to f32 and says whether every value is finite: the check rides along the
    /// conversion (one `or` per value in a register; it vectorizes as the plain loop does).
    /// Quantized GGUF blocks are dequantized as ggml does.
    pub fn to_f32_checked(&self) -> (Vec<f32>, bool) {
        let b = self.bytes();
        match self.dtype {
            DType::F32 => convert(b, |c: &[u8; 4]| f32::from_le_bytes(*c)),
            DType::F16 => convert(b, |c: &[u8; 2]| half::f16::from_le_bytes(*c).to_f32()),
            DType::BF16 => convert(b, |c: &[u8; 2]| half::bf16::from_le_bytes(*c).to_f32()),
            DType::Quant(q) => {
                let mut out = Vec::new();
                let finite = q.dequantize(b, &mut out);
                (out, finite)
            }
        }
    }

    /// Converts to f16 (rounding to nearest; f16 data is copied as is).
    pub fn to_f16(&self) -> Vec<half::f16> {
        match self.dtype {
            DType::F16 => self
                .bytes()
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                .collect(),
            _ => self.to_f32().into_iter().map(half::f16::from_f32).collect(),
        }
    }
}

/// `N`-byte values of `bytes` converted by `conv`, and whether all are finite.
fn convert<const N: usize>(bytes: &[u8], conv: impl Fn(&[u8; N]) -> f32) -> (Vec<f32>, bool) {
    let mut finite = true;
    let out = bytes
        .as_chunks::<N>()
        .0
        .iter()
        .map(|c| {
            let v = conv(c);
            finite &= v.is_finite();
            v
        })
        .collect();
    (out, finite)
}

/// All tensors of a model directory, by checkpoint name.
pub struct TensorStore {
    tensors: BTreeMap<String, Tensor>,
    /// Files the tensors came from, for messages.
    pub files: Vec<PathBuf>,
}

impl TensorStore {
    /// Opens the shards named by `model.safetensors.index.json`, else `model.safetensors`
    /// or `consolidated.safetensors`, else every `*.safetensors` file of the directory.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = ["model.safetensors", "consolidated.safetensors"]
            .into_iter()
            .map(|f| dir.join(f))
            .find(|p| p.exists());
        let files: Vec<PathBuf> = if index.exists() {
            shard_files(&index)?
        } else if let Some(file) = single {
            vec![file]
        } else {
            let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            files
        };
        if files.is_empty() {
            return Err(Error::format(
                dir,
                "no *.safetensors weights in this model directory",
            ));
        }
        let mut store = TensorStore {
            tensors: BTreeMap::new(),
            files: Vec::new(),
        };
        for file in files {
            store.add_file(&file)?;
        }
        Ok(store)
    }

    /// A store over one safetensors file compiled into the binary; `name` is for messages.
    pub fn from_static(name: &str, bytes: &'static [u8]) -> Result<Self> {
        let mut store = TensorStore {
            tensors: BTreeMap::new(),
            files: Vec::new(),
        };
        store.add_bytes(Path::new(name), Bytes::Static(bytes))?;
        Ok(store)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file: File = crate::files::open_regular(path)?;
        // SAFETY: the mapping is read-only; a checkpoint rewritten while we run is the
        // user's hazard, as with every mmap-based loader (candle, llama.cpp).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        self.add_bytes(path, Bytes::Mapped(Arc::new(mmap)))
    }

    fn add_bytes(&mut self, path: &Path, bytes: Bytes) -> Result<()> {
        check_header(path, bytes.as_slice())?;
        let (header_len, metadata) = SafeTensors::read_metadata(bytes.as_slice()).map_err(|e| {
            Error::format(
                path,
                format!("not a valid safetensors file (truncated or corrupt?): {e}"),
            )
        })?;
        let data_start = 8 + header_len;
        let infos: HashMap<String, &safetensors::tensor::TensorInfo> = metadata.tensors();
        for (name, info) in infos {
            let dtype = match info.dtype {
                Dtype::F32 => DType::F32,
                Dtype::F16 => DType::F16,
                Dtype::BF16 => DType::BF16,
                other => {
                    return Err(Error::tensor(
                        &name,
                        format!(
                            "{}: dtype {other:?} is not supported (f32, f16, bf16)",
                            path.display()
                        ),
                    ));
                }
            };
            if self.tensors.contains_key(&name) {
                return Err(Error::tensor(
                    &name,
                    format!("appears twice (again in {})", path.display()),
                ));
            }
            let (start, end) = info.data_offsets;
            let tensor = Tensor {
                name: name.clone(),
                dtype,
                shape: info.shape.clone(),
                bytes: bytes.clone(),
                range: data_start + start..data_start + end,
                view_of: None,
            };
            self.tensors.insert(name, tensor);
        }
        self.files.push(path.to_path_buf());
        Ok(())
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn into_tensors(self) -> impl Iterator<Item = Tensor> {
        self.tensors.into_values()
    }
}

/// The distinct shard files named by an index's `weight_map`, in order.
fn shard_files(index: &Path) -> Result<Vec<PathBuf>> {
    let text = crate::files::read_text(index, crate::files::MAX_JSON_BYTES)?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::format(index, format!("not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Config {
            path: index.to_path_buf(),
            field: "weight_map".into(),
            message: "missing or not an object".into(),
        })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| Error::Config {
            path: index.to_path_buf(),
            field: format!("weight_map.{name}"),
            message: "expected a file name".into(),
        })?;
        let path = crate::files::confined(dir, file).map_err(|why| Error::Config {
            path: index.to_path_buf(),
            field: format!("weight_map.{name}"),
            message: format!("the shard {why}"),
        })?;
        if !files.contains(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Looks at a safetensors file's header before the crate does, for every reader of such
/// files (models, saved states, prefix-cache entries): the crate reads it into a map, which
/// merges a repeated name silently (and then blames the survivor's offsets), some of its
/// errors do not name the tensor, and it adds offsets without checking (an end near 2^64
/// overflows there, a panic with overflow checks on). A header it cannot read at all is
/// left to the crate's own error.
pub(crate) fn check_header(path: &Path, buffer: &[u8]) -> Result<()> {
    let Some(header) = header_text(buffer) else {
        return Ok(());
    };
    if let Some(name) = first_duplicate_key(header) {
        return Err(Error::tensor(
            name,
            format!("appears twice in the header of {}", path.display()),
        ));
    }
    if let Some((name, why)) = first_bad_tensor(header, buffer.len()) {
        return Err(Error::tensor(name, format!("{}: {why}", path.display())));
    }
    Ok(())
}

/// The header JSON of a safetensors buffer, if its length prefix and UTF-8 are sound.
fn header_text(buffer: &[u8]) -> Option<&str> {
    // The crate refuses headers over 100 MB; do not parse more than it would.
    const MAX_HEADER: u64 = 100_000_000;
    let len = u64::from_le_bytes(buffer.get(..8)?.try_into().ok()?);
    if len > MAX_HEADER {
        return None;
    }
    let end = usize::try_from(len).ok()?.checked_add(8)?;
    std::str::from_utf8(buffer.get(8..end)?).ok()
}

/// The first key that appears twice at the top level of a JSON object.
fn first_duplicate_key(json: &str) -> Option<String> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut first = None;
            // Read to the end even after a hit: serde_json checks that the map was consumed.
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                if first.is_none() && !seen.insert(key.clone()) {
                    first = Some(key);
                }
            }
            Ok(first)
        }
    }
    serde_json::Deserializer::from_str(json)
        .deserialize_map(Keys)
        .ok()
        .flatten()
}

/// Which tensor makes a header invalid, and why, for the errors of the safetensors crate
/// that do not name it: a dtype, shape or offset pair that does not add up.
fn first_bad_tensor(json: &str, file_len: usize) -> Option<(String, String)> {
    let serde_json::Value::Object(map) = serde_json::from_str(json).ok()? else {
        return None;
    };
    let data_len = file_len.checked_sub(8 + json.len())?;
    for (name, info) in map.iter().filter(|(k, _)| *k != "__metadata__") {
        let bad = |why: String| Some((name.clone(), why));
        let Some(dtype) = info.get("dtype").and_then(|d| d.as_str()) else {
            return bad("has no dtype".into());
        };
        let bits: usize = match dtype {
            "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
            "I16" | "U16" | "F16" | "BF16" => 16,
            "I32" | "U32" | "F32" => 32,
            "I64" | "U64" | "F64" => 64,
            _ => continue,
        };
        let shape: Option<Vec<usize>> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|v| v.as_u64()?.try_into().ok()).collect());
        let Some(shape) = shape else {
            return bad("has no valid shape".into());
        };
        let offsets: Option<Vec<usize>> = info
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|v| v.as_u64()?.try_into().ok()).collect());
        let Some([start, end]) = offsets
            .as_deref()
            .and_then(|o| <[usize; 2]>::try_from(o).ok())
        else {
            return bad("has no valid data_offsets".into());
        };
        let bytes = shape
            .iter()
            .try_fold(bits, |a, &n| a.checked_mul(n))
            .map(|b| b / 8);
        let Some(bytes) = bytes else {
            return bad(format!("shape {shape:?} is too large to address"));
        };
        if end < start {
            return bad(format!(
                "data_offsets [{start}, {end}] end before they start"
            ));
        }
        if end > data_len {
            return bad(format!(
                "data_offsets [{start}, {end}] fall outside the {data_len} data bytes"
            ));
        }
        if end - start != bytes {
            return bad(format!(
                "shape {shape:?} of {dtype} needs {bytes} bytes, but data_offsets [{start}, {end}] \
                 hold {}",
                end - start
            ));
        }
    }
    // Together the tensors must tile the data exactly: the later of two that overlap, or
    // the first after a gap, is named (in offset order, so the same one every run).
    let mut spans: Vec<(usize, usize, &String)> = map
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .filter_map(|(name, info)| {
            let o = info.get("data_offsets")?.as_array()?;
            let start = usize::try_from(o.first()?.as_u64()?).ok()?;
            let end = usize::try_from(o.get(1)?.as_u64()?).ok()?;
            Some((start, end, name))
        })
        .collect();
    // (The longer of two spans that start together comes first: one nested in another is
    // the one named.)
    spans.sort_by_key(|&(start, end, name)| (start, std::cmp::Reverse(end), name));
    let mut covered: Option<(usize, &String)> = None;
    for &(start, end, name) in &spans {
        let (upto, before) = match covered {
            Some((upto, before)) => (upto, Some(before)),
            None => (0, None),
        };
        let why = match before {
            Some(b) if start < upto => Some(format!(
                "its data_offsets [{start}, {end}] overlap `{b}`'s, which end at byte {upto}"
            )),
            Some(b) if start > upto => Some(format!(
                "its data starts at byte {start}, but `{b}` before it ends at {upto}: bytes \
                 {upto}..{start} belong to no tensor"
            )),
            None if start > 0 => Some(format!(
                "its data starts at byte {start}: bytes 0..{start} belong to no tensor"
            )),
            _ => None,
        };
        if let Some(why) = why {
            return Some((name.clone(), why));
        }
        covered = Some((end, name));
    }
    if let Some((upto, last)) = covered
        && upto != data_len
    {
        return Some((
            last.clone(),
            format!("the last tensor ends at byte {upto}, but the data holds {data_len} bytes"),
        ));
    }
    None
}

/// Writes tensors to one safetensors file (f32/f16/bf16 kept as they are).
pub fn write_safetensors(path: &Path, tensors: &[&Tensor]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|t| {
            let dtype = match t.dtype {
                DType::F32 => Dtype::F32,
                DType::F16 => Dtype::F16,
                DType::BF16 => Dtype::BF16,
                DType::Quant(q) => {
                    return Err(Error::tensor(
                        &t.name,
                        format!(
                            "is {} (from a GGUF file): safetensors holds no such type",
                            q.name()
                        ),
                    ));
                }
            };
            let view = safetensors::tensor::TensorView::new(dtype, t.shape.clone(), t.bytes())
                .map_err(|e| Error::tensor(&t.name, e.to_string()))?;
            Ok((t.name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| Error::format(path, e.to_string()))
}
