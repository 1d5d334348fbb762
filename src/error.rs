//! The crate's one error type. Every variant names what was wrong and where (file, field,
//! tensor) so a user can fix their input without reading the source.

use std::path::PathBuf;

/// Everything that can go wrong while loading a model, running it or talking to the GPU.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // The OS error is said once, in this message: as a `source` too it would be printed a
    // second time by the front-ends' error chains.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("tensor `{name}`: {message}")]
    Tensor { name: String, message: String },
    #[error("not supported yet: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error("GPU: {0}")]
    Gpu(String),
    /// The numbers went wrong while running (a NaN or ±Inf in the logits or state), with the
    /// layer at fault.
    #[error("numerical fault: {0}")]
    NonFinite(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error: source,
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            message: message.into(),
        }
    }

    pub(crate) fn tensor(name: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Tensor {
            name: name.into(),
            message: message.into(),
        }
    }
}
