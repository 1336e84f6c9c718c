//! K3-Mini checkpoint formats, pure Rust.
//!
//! - [`safetensors_io`]: memory-mapped safetensors reading (single file or sharded with an index),
//!   atomic writing;
//! - [`checkpoint`]: a checkpoint directory = `config.json` + safetensors, loaded against the
//!   weight-name contract with errors that name the file and the tensor;
//! - [`weights`]: the contract itself, every tensor name and shape a config implies (HF /
//!   Moonshot layout, architecture.md §9), and parameter counts derived from it;
//! - [`gguf`]: the GGUF container (reader and atomic writer), and [`gguf_map`]: the HF ↔ GGUF
//!   names and metadata for llama.cpp's `kimi-linear`, `kimi-k3` and `llama`.

pub mod checkpoint;
pub mod gguf;
pub mod gguf_map;
pub mod safetensors_io;
pub mod weights;

use std::path::PathBuf;

pub use checkpoint::{save_checkpoint, Checkpoint};
pub use safetensors_io::{write_safetensors, SafetensorsFile, TensorRef};
pub use weights::{param_counts, tensor_specs, ParamCounts, TensorKind, TensorSpec};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a valid safetensors file ({msg}); is it truncated or corrupt? Re-save or re-download it")]
    Safetensors { path: PathBuf, msg: String },
    #[error("missing tensor `{name}` in {path}{hint}")]
    MissingTensor { name: String, path: PathBuf, hint: String },
    #[error("tensor `{name}` in {path} has shape {got:?}, expected {expected:?}{hint}")]
    Shape { name: String, path: PathBuf, expected: Vec<usize>, got: Vec<usize>, hint: String },
    #[error("tensor `{name}` in {path} has dtype {dtype}, which K3-Mini cannot read (supported: F32, F16, BF16, F64, I64, I32)")]
    Dtype { name: String, path: PathBuf, dtype: String },
    #[error("{path}: {source}")]
    Config { path: PathBuf, source: k3_config::Error },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io_err(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}
