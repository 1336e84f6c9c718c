//! K3-Mini training model in libtorch (through `tch`): every K3 component, written from
//! differentiable torch ops, with the HF (Moonshot) parameter names of the checkpoint contract.
//!
//! One file per component, mirroring the pure-Rust engine: [`kda_ops`] (the delta-rule core in
//! recurrent, chunked and step form), [`kda`], [`mla`], [`ffn`], [`moe`], [`residual`] (AttnRes),
//! [`kimi`] (the hybrid stack), [`llama`] (the baseline Transformer), [`model`] (construction,
//! checkpoints, forward), [`inherit`] (a student's embedding and head from its teacher's).

// `a = a * b` is not `a *= b` for tch tensors: the latter is an in-place op that would overwrite
// a tensor autograd still needs (e.g. a caller's initial state). Keep the out-of-place form.
#![allow(clippy::assign_op_pattern)]

pub mod distill;
pub mod ffn;
pub mod inherit;
pub mod kda;
pub mod kda_ops;
pub mod kimi;
pub mod llama;
pub mod mla;
pub mod model;
pub mod moe;
pub mod nn;
pub mod residual;
pub mod trainer;

pub use kimi::Output;
pub use model::{Model, Net, NetState};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Format(#[from] k3_format::Error),
    #[error(transparent)]
    Config(#[from] k3_config::Error),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// libtorch draws from one process-wide CPU generator. Every seeded draw (a model's
/// initialisation, a test's inputs) runs inside this lock, so another thread cannot draw between
/// the seeding and the drawing and make a "deterministic" result depend on timing. Tests that
/// draw without caring about the seed take the lock too, for the same reason.
pub fn with_seed<T>(seed: i64, f: impl FnOnce() -> T) -> T {
    static TORCH_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A panic while holding the lock leaves nothing to repair: the generator is reseeded below.
    let _held = TORCH_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    tch::manual_seed(seed);
    f()
}
