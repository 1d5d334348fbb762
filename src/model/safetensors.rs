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

/// Element types the loader understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
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
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The raw little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes.as_slice()[self.range.clone()]
    }

    /// Converts to f32 (exact for f16 and bf16).
    pub fn to_f32(&self) -> Vec<f32> {
        let b = self.bytes();
        match self.dtype {
            DType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
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
            .find(|p| p.is_file());
        let files: Vec<PathBuf> = if index.is_file() {
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
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only; a checkpoint rewritten while we run is the
        // user's hazard, as with every mmap-based loader (candle, llama.cpp).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        self.add_bytes(path, Bytes::Mapped(Arc::new(mmap)))
    }

    fn add_bytes(&mut self, path: &Path, bytes: Bytes) -> Result<()> {
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
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
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
        let path = dir.join(file);
        if !files.contains(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
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
            };
            let view = safetensors::tensor::TensorView::new(dtype, t.shape.clone(), t.bytes())
                .map_err(|e| Error::tensor(&t.name, e.to_string()))?;
            Ok((t.name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| Error::format(path, e.to_string()))
}
