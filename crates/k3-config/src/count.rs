//! Inference-state memory per sequence (architecture.md §8(a)).
//!
//! KDA state and conv tail count in f32 (that is what the engine holds); MLA and GQA caches in bf16.

use crate::{KimiConfig, LlamaConfig, Mixer, ModelConfig};

const F32: u64 = 4;
const BF16: u64 = 2;

/// Fixed per-sequence bytes of one KDA layer: the H·K·V state plus the (K_conv − 1) pre-conv tail of q, k, v.
pub fn kda_layer_state_bytes(c: &KimiConfig) -> u64 {
    let (h, d, k) = (c.kda.num_heads as u64, c.kda.head_dim as u64, c.kda.conv_kernel as u64);
    h * d * d * F32 + k.saturating_sub(1) * 3 * h * d * F32
}

/// Bytes of one MLA layer's absorbed latent cache per token: (kv_lora_rank + qk_rope_head_dim) in bf16.
pub fn mla_bytes_per_token(c: &KimiConfig) -> u64 {
    (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) as u64 * BF16
}

/// The hybrid's inference state at context `t`.
pub fn kimi_state_bytes(c: &KimiConfig, t: u64) -> u64 {
    let n_kda = c.count_mixer(Mixer::Kda) as u64;
    let n_mla = c.count_mixer(Mixer::Mla) as u64;
    n_kda * kda_layer_state_bytes(c) + n_mla * t * mla_bytes_per_token(c)
}

/// A pure-MLA model of the same depth: every layer holds the latent cache.
pub fn pure_mla_state_bytes(c: &KimiConfig, t: u64) -> u64 {
    c.layers.len() as u64 * t * mla_bytes_per_token(c)
}

/// The same-size GQA Transformer used for comparison: same d and L, head dim 128,
/// heads = max(1, d/128), n_kv = max(1, heads/4), K and V in bf16.
pub fn gqa_baseline_bytes(hidden: usize, layers: usize, t: u64) -> u64 {
    let heads = (hidden / 128).max(1);
    let n_kv = (heads / 4).max(1) as u64;
    layers as u64 * t * 2 * n_kv * 128 * BF16
}

/// A Llama model's own KV cache at context `t`.
pub fn llama_state_bytes(c: &LlamaConfig, t: u64) -> u64 {
    c.num_hidden_layers as u64 * t * 2 * (c.num_key_value_heads * c.head_dim) as u64 * BF16
}

/// The model's own per-sequence state at context `t`.
pub fn state_bytes(c: &ModelConfig, t: u64) -> u64 {
    match c {
        ModelConfig::Kimi(k) => kimi_state_bytes(k, t),
        ModelConfig::Llama(l) => llama_state_bytes(l, t),
    }
}

/// Human-readable bytes (KiB/MiB/GiB, three significant digits).
pub fn human_bytes(b: u64) -> String {
    let b = b as f64;
    let (v, u) = if b >= 1024f64.powi(3) {
        (b / 1024f64.powi(3), "GiB")
    } else if b >= 1024f64.powi(2) {
        (b / 1024f64.powi(2), "MiB")
    } else if b >= 1024.0 {
        (b / 1024.0, "KiB")
    } else {
        (b, "B")
    };
    if v >= 100.0 || u == "B" {
        format!("{v:.0} {u}")
    } else if v >= 10.0 {
        format!("{v:.1} {u}")
    } else {
        format!("{v:.2} {u}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;

    /// architecture.md §8(a), config C: fixed KDA state 27.9 MiB... computed there with a bf16 conv
    /// tail; with the f32 tail we count, hybrid at 4K = 24 KDA layers + 8·4096·576·2 B.
    #[test]
    fn config_c_memory_matches_spec_formula() {
        let c = presets::k3_3b();
        let kda = kda_layer_state_bytes(&c);
        assert_eq!(kda, 18 * 128 * 128 * 4 + 3 * 3 * 18 * 128 * 4);
        let t = 128 * 1024;
        // pure MLA at 128K: 32 layers · 131072 · 576 · 2 B = 4.5 GiB (spec table)
        assert_eq!(pure_mla_state_bytes(&c, t), 32 * t * 576 * 2);
        assert_eq!(human_bytes(pure_mla_state_bytes(&c, t)), "4.50 GiB");
        // GQA (18 heads → n_kv = 4 under the info rule) at 32K: 32 · 32768 · 2 · 4 · 128 · 2 B = 2 GiB
        assert_eq!(gqa_baseline_bytes(2304, 32, 32768), 32 * 32768 * 2 * 4 * 128 * 2);
        // hybrid is ~1/4 of pure MLA at long context
        let ratio = kimi_state_bytes(&c, 1 << 20) as f64 / pure_mla_state_bytes(&c, 1 << 20) as f64;
        assert!((ratio - 0.25).abs() < 0.01, "{ratio}");
    }
}
