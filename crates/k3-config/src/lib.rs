//! K3-Mini model configuration.
//!
//! The on-disk contract is HF `config.json`: `model_type: "kimi_linear"` in Moonshot's field names
//! (with K3's own names for the K3 extensions), or `model_type: "llama"` for the baseline
//! Transformer. [`ModelConfig`] is the internal, validated form; [`hf`] converts between the two
//! with exactly transformers 5.24's precedence rules (`shared/docs/interop.md` §1.1).
//!
//! Dimension letters (docs/SHAPES.md): C hidden, L layers, H heads, K key dim, V value dim,
//! R latent rank, E experts, k top-k, F FFN intermediate.

pub mod count;
pub mod hf;
mod kimi;
mod llama;
pub mod presets;

pub use kimi::{
    Activation, FfnKind, KdaConfig, KdaDecay, KdaOutGate, KimiConfig, LatentMoe, LayerKind, Mixer, MlaConfig,
    MoeConfig, Profile,
};
pub use llama::LlamaConfig;

/// Errors of this crate. Messages name the field and say what is allowed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("config field `{field}`: {msg}")]
    Field { field: String, msg: String },
    #[error("config is missing required field `{0}`")]
    Missing(String),
    #[error("config: {0}")]
    Invalid(String),
    #[error("config.json is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Return an [`Error::Field`] naming `field`.
pub(crate) fn field_err<T>(field: impl Into<String>, msg: impl Into<String>) -> Result<T> {
    Err(Error::Field { field: field.into(), msg: msg.into() })
}

/// Any model the project can build: the Kimi/K3 hybrid or the Llama baseline.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    Kimi(KimiConfig),
    Llama(LlamaConfig),
}

impl ModelConfig {
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Kimi(c) => c.vocab_size,
            ModelConfig::Llama(c) => c.vocab_size,
        }
    }
    pub fn hidden_size(&self) -> usize {
        match self {
            ModelConfig::Kimi(c) => c.hidden_size,
            ModelConfig::Llama(c) => c.hidden_size,
        }
    }
    pub fn num_layers(&self) -> usize {
        match self {
            ModelConfig::Kimi(c) => c.layers.len(),
            ModelConfig::Llama(c) => c.num_hidden_layers,
        }
    }
    pub fn validate(&self) -> Result<()> {
        match self {
            ModelConfig::Kimi(c) => c.validate(),
            ModelConfig::Llama(c) => c.validate(),
        }
    }
    /// A one-line description of the architecture, e.g. `kimi_linear (K3 profile)`.
    pub fn arch_name(&self) -> String {
        match self {
            ModelConfig::Kimi(c) => format!("kimi_linear ({} profile)", c.profile().name()),
            ModelConfig::Llama(_) => "llama".to_string(),
        }
    }
}

/// A parsed config plus the warnings the parser raised (unknown fields, defaults that differ
/// between runtimes). Callers print the warnings; they never stop a load.
#[derive(Debug, Clone)]
pub struct Parsed<T> {
    pub config: T,
    pub warnings: Vec<String>,
}
