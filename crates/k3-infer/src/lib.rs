//! The pure-Rust K3-Mini inference engine (no libtorch).
//!
//! It loads Kimi-Linear / K3 checkpoints (safetensors, both profiles), Llama checkpoints, and
//! GGUF files (ours and llama.cpp's converter's: `kimi-linear`, `kimi-k3`, `llama`), runs them on
//! token ids with one state per sequence (KDA's fixed state and conv tail, MLA's growing latent
//! cache, Llama's KV cache), and samples. The tokenizer and chat template sit at its edge.
//!
//! One file per component, mirroring k3-train: [`kda`], [`mla`], [`ffn`], [`moe`], [`kimi`]
//! (the stack and AttnRes), [`llama`]; weights live in [`linear::Matrix`] in any ggml type.

pub mod alloc;
pub mod calib;
pub mod engine;
pub mod ffn;
pub mod hugepages;
pub mod kda;
pub mod kimi;
pub mod kv;
pub mod linear;
pub mod llama;
pub mod mla;
pub mod model;
pub mod moe;
pub mod routing;
pub mod sampler;
pub mod source;
pub mod threads;
pub mod tokenizer;

pub use engine::{Engine, SeqId};
pub use model::{Logits, Model, SeqState};
pub use sampler::{Sampler, SamplerConfig};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Format(#[from] k3_format::Error),
    #[error(transparent)]
    Config(#[from] k3_config::Error),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// The unit tests run on the decode allocator too, so every test exercises it.
#[cfg(test)]
#[global_allocator]
static TEST_ALLOC: alloc::ThreadCache = alloc::ThreadCache;

/// The engine allocates its [T, C] activation buffers per layer. glibc serves blocks above its
/// mmap threshold (128 KiB at first) with fresh mappings, so every prefill layer paid page faults
/// and zeroing of new pages (~7% of prefill samples). Up to 32 MiB they now come from the heap and
/// are reused; the heap's top is trimmed back only past 256 MiB of free space. Call it first in
/// `main`, before any thread starts.
pub fn keep_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: std::os::raw::c_int, value: std::os::raw::c_int) -> std::os::raw::c_int;
        }
        const M_TRIM_THRESHOLD: std::os::raw::c_int = -1;
        const M_MMAP_THRESHOLD: std::os::raw::c_int = -3;
        // SAFETY: mallopt only changes allocator parameters; called before any thread starts.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            mallopt(M_TRIM_THRESHOLD, 256 << 20);
        }
    }
}

/// n deterministic pseudo-random token ids (xorshift), away from the first and last 100 of a
/// `vocab`-sized vocabulary where special tokens sit (anywhere in a vocabulary of 200 or fewer):
/// the benchmarks' input, the same for every engine and run.
pub fn bench_ids(n: usize, vocab: usize) -> Vec<u32> {
    let (lo, span) = if vocab > 200 { (100, vocab as u64 - 200) } else { (0, vocab.max(1) as u64) };
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (lo + x % span) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn bench_ids_stay_inside_the_vocabulary_and_repeat() {
        for vocab in [1usize, 50, 200, 201, 32000] {
            let ids = super::bench_ids(1000, vocab);
            assert!(ids.iter().all(|&i| (i as usize) < vocab), "vocab {vocab}");
            if vocab > 200 {
                assert!(ids.iter().all(|&i| (100..vocab as u32 - 100).contains(&i)), "vocab {vocab}");
            }
            assert_eq!(ids, super::bench_ids(1000, vocab));
        }
        assert!(super::bench_ids(1000, 32000).windows(2).any(|w| w[0] != w[1]));
    }
}
