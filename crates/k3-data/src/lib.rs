//! Training data for K3-Mini, pure Rust:
//! - [`corpus`]: documents from offline sources (the CPython standard library on the machine,
//!   sources of pip packages, any directory, the English mix), deduplicated by content hash and
//!   split into train / validation by document, deterministically;
//! - [`tok`]: byte-level BPE training (the `tokenizers` crate), or an existing `tokenizer.json` or
//!   the vocabulary embedded in a GGUF, with a stable identity hash;
//! - [`shards`]: memory-mapped token shards with a small header, random-access windows for
//!   packed training batches and fixed validation windows;
//! - [`signals`]: the teacher-signal store (top-k log-probabilities, trajectories, router
//!   statistics), append-only, crash-safe and memory-mapped;
//! - [`topk`]: a teacher's dense row reduced to its stored top-k, and the KL of the store's
//!   reconstruction to it.

pub mod corpus;
pub mod dataset;
pub mod prompts;
pub mod shards;
pub mod signals;
pub mod tok;
pub mod topk;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: std::path::PathBuf, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn io_err(path: impl Into<std::path::PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { path, source }
}

/// Hex SHA-256 of bytes.
pub fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(b);
    d.iter().map(|x| format!("{x:02x}")).collect()
}
