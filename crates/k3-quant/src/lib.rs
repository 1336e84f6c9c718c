//! Offline quantization: a safetensors checkpoint → a GGUF for llama.cpp (`kimi-linear`,
//! `kimi-k3`, `llama`) and for our engine, with tokenizer metadata, llama-quantize's rules for
//! which tensors stay unquantized, and its fallback for rows that do not fit a block.

pub mod export;
pub mod tokenizer_meta;

pub use export::{export_gguf, export_gguf_calibrated, requantize_gguf, ExportReport, QuantType};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Format(#[from] k3_format::Error),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;
