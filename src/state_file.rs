//! Saved states: one sequence's `State` in a safetensors file whose header names the model
//! fingerprint, the weight format the engine ran, the block kinds, the position and the
//! tokens fed, so that a file from another model, format or engine version is refused
//! before a byte of it reaches the device. The prefix cache spills to these files and
//! `mamba2 chat --save/--resume` writes and reads them.
//!
//! Tensors: `layers.{i}.conv` `[conv_dim·(K−1)]` and `layers.{i}.ssm` `[H·P·N]` of each
//! Mamba2 layer, `layers.{i}.k`/`.v` `[len][Hkv·hd]` of each attention layer (absent at
//! length 0); all f32, or all f16 when saved so.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::state::{LayerState, State};

/// What every saved state is checked against: the file must say the same.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateKey {
    /// `Model::fingerprint`.
    pub model: String,
    /// The weight format the engine ran (a state from q8_0 weights differs from f16's).
    pub format: String,
    /// `ModelConfig::pattern`: one letter per block.
    pub blocks: String,
}

/// The header fields, in the order they are checked.
const KIND: &str = "mamba2.kind";
const LAYOUT: &str = "mamba2.layout";
const ENGINE: &str = "mamba2.engine";
const MODEL: &str = "mamba2.model";
const FORMAT: &str = "mamba2.format";
const BLOCKS: &str = "mamba2.blocks";
const POSITION: &str = "mamba2.position";
const DTYPE: &str = "mamba2.dtype";
const TOKENS: &str = "mamba2.tokens";
const EXTRA: &str = "mamba2.extra";

/// How the temporary files `save` writes before renaming them into place end (a crash
/// may leave one; the prefix cache removes them when it opens its directory).
pub const PARTIAL: &str = ".partial";

/// The value of `mamba2.kind`.
const KIND_STATE: &str = "sequence-state";
/// Bumped whenever the tensors' layout changes.
const LAYOUT_VERSION: &str = "1";

/// How the values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateDtype {
    F32,
    /// Half the bytes; what it does to the tokens is measured in BENCHMARKS.md.
    F16,
}

impl StateDtype {
    pub fn name(self) -> &'static str {
        match self {
            StateDtype::F32 => "f32",
            StateDtype::F16 => "f16",
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            StateDtype::F32 => 4,
            StateDtype::F16 => 2,
        }
    }
}

impl std::str::FromStr for StateDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(StateDtype::F32),
            "f16" => Ok(StateDtype::F16),
            _ => Err(format!("`{s}`: expected f32 or f16")),
        }
    }
}

/// A saved state with what its header says.
#[derive(Clone, Debug)]
pub struct SavedState {
    pub state: State<f32>,
    /// The tokens fed to reach it (empty when not recorded; else `state.len` of them).
    pub tokens: Vec<u32>,
    /// Free-form JSON a front-end keeps with the state (a chat's messages).
    pub extra: Option<String>,
}

/// Writes `saved` to `path` (through a temporary file renamed into place, so a reader
/// never sees half a file). `path` is a new file, a regular one or a symlink (replaced, not
/// written through), never a device, FIFO or directory (`files::replaceable`; `chat
/// --save` resolves a link to its target first).
pub fn save(
    path: &Path,
    key: &StateKey,
    saved: &SavedState,
    dtype: StateDtype,
    c: &ModelConfig,
) -> Result<()> {
    let path = &crate::files::replaceable(path, false)?;
    saved.state.check(c)?;
    if !saved.tokens.is_empty() && saved.tokens.len() != saved.state.len {
        return Err(Error::InvalidInput(format!(
            "{} tokens recorded for a state of {}",
            saved.tokens.len(),
            saved.state.len
        )));
    }
    let mut meta = HashMap::new();
    meta.insert(KIND.into(), KIND_STATE.into());
    meta.insert(LAYOUT.into(), LAYOUT_VERSION.into());
    meta.insert(ENGINE.into(), env!("CARGO_PKG_VERSION").into());
    meta.insert(MODEL.into(), key.model.clone());
    meta.insert(FORMAT.into(), key.format.clone());
    meta.insert(BLOCKS.into(), key.blocks.clone());
    meta.insert(POSITION.into(), saved.state.len.to_string());
    meta.insert(DTYPE.into(), dtype.name().into());
    let tokens: Vec<String> = saved.tokens.iter().map(u32::to_string).collect();
    meta.insert(TOKENS.into(), tokens.join(","));
    if let Some(extra) = &saved.extra {
        meta.insert(EXTRA.into(), extra.clone());
    }
    let kv_width = c.attention.as_ref().map_or(0, |a| a.kv_width());
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut put = |name: String, shape: Vec<usize>, v: &[f32]| {
        let bytes = match dtype {
            StateDtype::F32 => bytemuck::cast_slice::<f32, u8>(v).to_vec(),
            StateDtype::F16 => v
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
        };
        tensors.push((name, shape, bytes));
    };
    for (i, l) in saved.state.layers.iter().enumerate() {
        match l {
            LayerState::Mamba2 { conv, ssm } => {
                put(format!("layers.{i}.conv"), vec![conv.len()], conv);
                put(format!("layers.{i}.ssm"), vec![ssm.len()], ssm);
            }
            LayerState::Attention { k, v } if saved.state.len > 0 => {
                put(format!("layers.{i}.k"), vec![saved.state.len, kv_width], k);
                put(format!("layers.{i}.v"), vec![saved.state.len, kv_width], v);
            }
            _ => {}
        }
    }
    let st_dtype = match dtype {
        StateDtype::F32 => Dtype::F32,
        StateDtype::F16 => Dtype::F16,
    };
    let views = tensors
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(st_dtype, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::format(path, format!("tensor `{n}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    // A name of this process and write: a reader or a second writer never meets it.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.{n}{PARTIAL}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    safetensors::serialize_to_file(views, Some(meta), &tmp)
        .map_err(|e| Error::format(&tmp, e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// The header of a saved state without its tensors: for listing a cache directory.
pub struct Header {
    pub position: usize,
    pub tokens: Vec<u32>,
    pub dtype: StateDtype,
    pub extra: Option<String>,
}

/// Reads and checks the header of `bytes` (the file at `path`) against `key`.
fn header(path: &Path, bytes: &[u8], key: &StateKey) -> Result<Header> {
    crate::model::safetensors::check_header(path, bytes)?;
    let (_, meta) = SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::format(path, format!("not a safetensors file: {e}")))?;
    let empty = HashMap::new();
    let m = meta.metadata().as_ref().unwrap_or(&empty);
    let field = |name: &str| {
        m.get(name).ok_or_else(|| Error::Config {
            path: path.to_path_buf(),
            field: name.into(),
            message: "missing: this is not a saved mamba2 state".into(),
        })
    };
    let refuse = |name: &str, message: String| Error::Config {
        path: path.to_path_buf(),
        field: name.into(),
        message,
    };
    if field(KIND)? != KIND_STATE {
        return Err(refuse(KIND, format!("`{}` is not {KIND_STATE}", m[KIND])));
    }
    if field(LAYOUT)? != LAYOUT_VERSION {
        return Err(refuse(
            LAYOUT,
            format!(
                "layout {} (written by mamba2 {}); this engine reads layout {LAYOUT_VERSION}",
                m[LAYOUT],
                m.get(ENGINE).map_or("?", |s| s.as_str())
            ),
        ));
    }
    if field(ENGINE)? != env!("CARGO_PKG_VERSION") {
        return Err(refuse(
            ENGINE,
            format!(
                "written by mamba2 {}, this is {}: states are not carried across versions",
                m[ENGINE],
                env!("CARGO_PKG_VERSION")
            ),
        ));
    }
    for (name, want) in [
        (MODEL, &key.model),
        (FORMAT, &key.format),
        (BLOCKS, &key.blocks),
    ] {
        let have = field(name)?;
        if have != want {
            return Err(refuse(
                name,
                format!("the file was saved with `{have}`, the model loaded is `{want}`"),
            ));
        }
    }
    let position: usize = field(POSITION)?
        .parse()
        .map_err(|_| refuse(POSITION, format!("`{}` is not a count", m[POSITION])))?;
    // The device counts positions in 32 bits and keeps them below 2^31 (its sampling
    // seeds and KV lengths; `Session` stops a sequence there).
    if position > crate::session::MAX_POSITION as usize {
        return Err(refuse(
            POSITION,
            format!(
                "{position} tokens: more than the {} a sequence can hold",
                crate::session::MAX_POSITION
            ),
        ));
    }
    let dtype: StateDtype = field(DTYPE)?.parse().map_err(|e| refuse(DTYPE, e))?;
    let list = field(TOKENS)?;
    let tokens = if list.is_empty() {
        Vec::new()
    } else {
        list.split(',')
            .map(|t| t.parse::<u32>())
            .collect::<std::result::Result<Vec<u32>, _>>()
            .map_err(|_| refuse(TOKENS, "not a comma-separated list of token ids".into()))?
    };
    if !tokens.is_empty() && tokens.len() != position {
        return Err(refuse(
            TOKENS,
            format!("{} tokens for position {position}", tokens.len()),
        ));
    }
    Ok(Header {
        position,
        tokens,
        dtype,
        extra: m.get(EXTRA).cloned(),
    })
}

/// The file at `path`, mapped (a header check reads only the pages it touches).
fn map(path: &Path) -> Result<memmap2::Mmap> {
    // Only a regular file: `open` blocks for ever on a FIFO (a cache directory is read at
    // startup, whatever lies in it).
    let f = crate::files::open_regular(path)?;
    let len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    if len < 8 {
        return Err(Error::format(path, "too short for a safetensors file"));
    }
    // SAFETY: state files are written to a temporary name and renamed into place, never
    // modified where they lie.
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))
}

/// Reads the header of the state file at `path`, checked against `key`.
pub fn read_header(path: &Path, key: &StateKey) -> Result<Header> {
    header(path, &map(path)?, key)
}

/// Reads the state file at `path`, refusing one made for another model, format, block
/// layout or engine version, or whose tensors do not fit `c`.
pub fn load(path: &Path, key: &StateKey, c: &ModelConfig) -> Result<SavedState> {
    let bytes = map(path)?;
    let head = header(path, &bytes, key)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::format(path, format!("not a safetensors file: {e}")))?;
    let want_dtype = match head.dtype {
        StateDtype::F32 => Dtype::F32,
        StateDtype::F16 => Dtype::F16,
    };
    let kv_width = c.attention.as_ref().map_or(0, |a| a.kv_width());
    let read = |name: String, len: usize| -> Result<Vec<f32>> {
        let t = st
            .tensor(&name)
            .map_err(|_| Error::format(path, format!("tensor `{name}` is missing")))?;
        if t.dtype() != want_dtype {
            return Err(Error::format(
                path,
                format!(
                    "tensor `{name}` is {:?}, the header says {}",
                    t.dtype(),
                    head.dtype.name()
                ),
            ));
        }
        let n: usize = t
            .shape()
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| {
                Error::format(
                    path,
                    format!("tensor `{name}`: shape {:?} overflows", t.shape()),
                )
            })?;
        if n != len {
            return Err(Error::format(
                path,
                format!(
                    "tensor `{name}` holds {n} values, the model needs {len} (shape {:?})",
                    t.shape()
                ),
            ));
        }
        Ok(match head.dtype {
            StateDtype::F32 => t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            StateDtype::F16 => t
                .data()
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        })
    };
    let kv_len = head
        .position
        .checked_mul(kv_width)
        .ok_or_else(|| Error::format(path, format!("position {} overflows", head.position)))?;
    let mut layers = Vec::with_capacity(c.n_layer);
    for (i, kind) in c.blocks.iter().enumerate() {
        use crate::config::BlockKind;
        layers.push(match kind {
            BlockKind::Mamba2 => LayerState::Mamba2 {
                conv: read(format!("layers.{i}.conv"), c.conv_state_len())?,
                ssm: read(format!("layers.{i}.ssm"), c.ssm_state_len())?,
            },
            BlockKind::Attention if head.position == 0 => LayerState::Attention {
                k: Vec::new(),
                v: Vec::new(),
            },
            BlockKind::Attention => LayerState::Attention {
                k: read(format!("layers.{i}.k"), kv_len)?,
                v: read(format!("layers.{i}.v"), kv_len)?,
            },
            BlockKind::Mlp | BlockKind::Moe => LayerState::Stateless,
        });
    }
    let state = State {
        layers,
        len: head.position,
    };
    if let Some(bad) = state.values().iter().position(|v| !v.is_finite()) {
        return Err(Error::format(
            path,
            format!("value {bad} of the state is not finite"),
        ));
    }
    // Nothing fed leaves the state zero: a position of 0 beside a state that is not is a
    // file whose header does not describe its state.
    if head.position == 0 && state.values().iter().any(|&v| v != 0.0) {
        return Err(Error::format(
            path,
            format!("`{POSITION}` is 0 but the state holds fed tokens"),
        ));
    }
    if let Some(bad) = head.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(Error::format(
            path,
            format!(
                "`{TOKENS}`: token id {bad} is outside the model's vocabulary (size {})",
                c.vocab_size
            ),
        ));
    }
    Ok(SavedState {
        state,
        tokens: head.tokens,
        extra: head.extra,
    })
}
