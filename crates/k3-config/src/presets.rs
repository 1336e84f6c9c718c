//! Named presets. Each is marked with the export profile it targets (interop.md §0).

use crate::{
    Activation, FfnKind, KdaConfig, KdaDecay, KdaOutGate, KimiConfig, LatentMoe, LayerKind, LlamaConfig, Mixer,
    MlaConfig, ModelConfig, MoeConfig, Profile, Result,
};

/// `(name, target profile, one-line description)` for every preset.
pub const PRESETS: &[(&str, &str, &str)] = &[
    ("tiny", "Kimi-Linear", "d 192, 8 layers (6 KDA + 2 MLA), dense SwiGLU 512, vocab 4096: ~5.3M params"),
    (
        "tiny-k3",
        "K3",
        "tiny with K3's whole stack: lower-bound gate, full-rank gate, gated MLA, AttnRes 2, SiTU, latent MoE",
    ),
    ("tiny-kda", "Kimi-Linear", "tiny with every layer KDA (the all-KDA ablation)"),
    ("tiny-llama", "llama", "the ordinary Transformer (GQA + RoPE + SwiGLU) at tiny's size"),
    (
        "small",
        "Kimi-Linear",
        "architecture.md §8 config B: d 512, 12 layers (9 KDA + 3 MLA), ~47.7M params at vocab 8192",
    ),
    (
        "bench-370m",
        "Kimi-Linear",
        "the speed benchmark's model: d 1024, 24 layers (18 KDA + 6 MLA), 8 heads of 128, kv_lora 256, FFN 2816, vocab 32000",
    ),
    (
        "bench-moe",
        "Kimi-Linear",
        "bench-370m with Kimi-Linear's MoE after its first layer: 64 experts of 256, top 8 + 1 shared: ~1.36B params, ~345M active",
    ),
    (
        "3b",
        "K3",
        "architecture.md §8 config C: d 2304, 32 layers (24 KDA + 8 MLA), dense SiTU-GLU, 128K context (config only)",
    ),
];

/// Build a preset by name; `vocab` overrides the preset's vocabulary size (e.g. a tokenizer's).
pub fn preset(name: &str, vocab: Option<usize>) -> Result<ModelConfig> {
    let mut cfg = match name {
        "tiny" => ModelConfig::Kimi(tiny()),
        "tiny-k3" => ModelConfig::Kimi(tiny_k3()),
        "tiny-kda" => ModelConfig::Kimi(tiny_all_kda()),
        "tiny-llama" => ModelConfig::Llama(tiny_llama()),
        "small" => ModelConfig::Kimi(small()),
        "bench-370m" => ModelConfig::Kimi(bench_370m()),
        "bench-moe" => ModelConfig::Kimi(bench_moe()),
        "3b" => ModelConfig::Kimi(k3_3b()),
        other => {
            let names: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
            return crate::field_err("preset", format!("unknown preset `{other}`; allowed: {}", names.join(", ")));
        }
    };
    if let Some(v) = vocab {
        match &mut cfg {
            ModelConfig::Kimi(c) => c.vocab_size = v,
            ModelConfig::Llama(c) => c.vocab_size = v,
        }
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Dense layers everywhere.
fn all_dense(_: usize) -> FfnKind {
    FfnKind::Dense
}

/// MoE fields for an all-dense model: never read by the model, but llama.cpp's converters and
/// loaders require the keys.
fn unused_moe() -> MoeConfig {
    MoeConfig {
        num_experts: 0,
        top_k: 0,
        num_shared_experts: 0,
        intermediate_size: 0,
        routed_scaling_factor: 1.0,
        renormalize: true,
        num_expert_group: 1,
        topk_group: 1,
        latent: None,
    }
}

/// Config A in its Kimi-Linear-profile form (runs in transformers and llama.cpp `kimi-linear`).
pub fn tiny() -> KimiConfig {
    KimiConfig {
        vocab_size: 4096,
        hidden_size: 192,
        intermediate_size: 512,
        layers: KimiConfig::hybrid_layout(8, all_dense),
        rms_norm_eps: 1e-5,
        kda: KdaConfig {
            num_heads: 3,
            head_dim: 64,
            conv_kernel: 4,
            decay: KdaDecay::Softplus,
            out_gate: KdaOutGate::LowRank,
        },
        mla: MlaConfig {
            num_heads: 3,
            q_lora_rank: None,
            kv_lora_rank: 64,
            qk_nope_head_dim: 32,
            qk_rope_head_dim: 16,
            v_head_dim: 32,
            output_gate: false,
            attention_bias: false,
        },
        moe: unused_moe(),
        activation: Activation::Silu,
        attn_res_block_size: None,
        max_position_embeddings: 8192,
        bos_token_id: Some(1),
        eos_token_id: vec![2],
        pad_token_id: Some(0),
    }
}

/// tiny with K3's whole stack (K3 profile: llama.cpp `kimi-k3` only).
pub fn tiny_k3() -> KimiConfig {
    let mut c = tiny();
    c.kda.decay = KdaDecay::LowerBound(-5.0);
    c.kda.out_gate = KdaOutGate::FullRank;
    c.mla.output_gate = true;
    c.attn_res_block_size = Some(2);
    c.activation = Activation::Situ { beta: 4.0, linear_beta: 25.0 };
    c.layers = KimiConfig::hybrid_layout(8, |i| if i == 0 { FfnKind::Dense } else { FfnKind::Moe });
    c.moe = MoeConfig {
        num_experts: 8,
        top_k: 2,
        num_shared_experts: 1,
        intermediate_size: 128,
        routed_scaling_factor: 1.0,
        renormalize: true,
        num_expert_group: 1,
        topk_group: 1,
        latent: Some(LatentMoe { dim: 96, use_norm: true }),
    };
    c
}

/// The all-KDA ablation at tiny's size (no MLA layer at all).
pub fn tiny_all_kda() -> KimiConfig {
    let mut c = tiny();
    c.layers = vec![LayerKind { mixer: Mixer::Kda, ffn: FfnKind::Dense }; 8];
    c
}

/// The ordinary Transformer at tiny's width and depth: GQA 3 query / 1 KV head of 64, RoPE, SwiGLU.
pub fn tiny_llama() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 4096,
        hidden_size: 192,
        intermediate_size: 512,
        num_hidden_layers: 8,
        num_attention_heads: 3,
        num_key_value_heads: 1,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        max_position_embeddings: 8192,
        tie_word_embeddings: false,
        attention_bias: false,
        mlp_bias: false,
        bos_token_id: Some(1),
        eos_token_id: vec![2],
        pad_token_id: Some(0),
    }
}

/// architecture.md §8 config B, Kimi-Linear profile, gate rank = head_dim.
pub fn small() -> KimiConfig {
    KimiConfig {
        vocab_size: 8192,
        hidden_size: 512,
        intermediate_size: 1408,
        layers: KimiConfig::hybrid_layout(12, all_dense),
        rms_norm_eps: 1e-5,
        kda: KdaConfig {
            num_heads: 8,
            head_dim: 64,
            conv_kernel: 4,
            decay: KdaDecay::Softplus,
            out_gate: KdaOutGate::LowRank,
        },
        mla: MlaConfig {
            num_heads: 8,
            q_lora_rank: None,
            kv_lora_rank: 128,
            qk_nope_head_dim: 64,
            qk_rope_head_dim: 32,
            v_head_dim: 64,
            output_gate: false,
            attention_bias: false,
        },
        moe: unused_moe(),
        activation: Activation::Silu,
        attn_res_block_size: None,
        max_position_embeddings: 8192,
        bos_token_id: Some(1),
        eos_token_id: vec![2],
        pad_token_id: Some(0),
    }
}

/// The inference benchmark's model (the shape llama.cpp was measured on, interop.md's last
/// section): Kimi-Linear profile, random weights are enough for speed.
pub fn bench_370m() -> KimiConfig {
    let mut c = small();
    c.vocab_size = 32_000;
    c.hidden_size = 1024;
    c.intermediate_size = 2816;
    c.layers = KimiConfig::hybrid_layout(24, all_dense);
    c.kda.num_heads = 8;
    c.kda.head_dim = 128;
    c.mla.num_heads = 8;
    c.mla.kv_lora_rank = 256;
    c.mla.qk_nope_head_dim = 128;
    c.mla.qk_rope_head_dim = 64;
    c.mla.v_head_dim = 128;
    c.max_position_embeddings = 65_536;
    c
}

/// The benchmark's mixture-of-experts model: [`bench_370m`] with Kimi-Linear-48B-A3B's kind of
/// MoE (many narrow experts, sigmoid router, one shared expert, a dense first layer) after its
/// first layer, scaled to the 370M's width. Random weights route about evenly, so each token
/// reads its 8 experts' rows from memory, as a trained model mostly does.
pub fn bench_moe() -> KimiConfig {
    let mut c = bench_370m();
    c.layers = KimiConfig::hybrid_layout(24, |i| if i == 0 { FfnKind::Dense } else { FfnKind::Moe });
    c.moe = MoeConfig {
        num_experts: 64,
        top_k: 8,
        num_shared_experts: 1,
        intermediate_size: 256,
        routed_scaling_factor: 2.446,
        renormalize: true,
        num_expert_group: 1,
        topk_group: 1,
        latent: None,
    };
    c
}

/// architecture.md §8 config C: dense K3-profile 3B with a 128K context.
pub fn k3_3b() -> KimiConfig {
    KimiConfig {
        vocab_size: 163_840,
        hidden_size: 2304,
        intermediate_size: 6912,
        layers: KimiConfig::hybrid_layout(32, all_dense),
        rms_norm_eps: 1e-5,
        kda: KdaConfig {
            num_heads: 18,
            head_dim: 128,
            conv_kernel: 4,
            decay: KdaDecay::LowerBound(-5.0),
            out_gate: KdaOutGate::FullRank,
        },
        mla: MlaConfig {
            num_heads: 18,
            q_lora_rank: Some(1024),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            output_gate: true,
            attention_bias: false,
        },
        moe: unused_moe(),
        activation: Activation::Situ { beta: 4.0, linear_beta: 25.0 },
        attn_res_block_size: Some(4),
        max_position_embeddings: 131_072,
        bos_token_id: Some(163_584),
        eos_token_id: vec![163_586],
        pad_token_id: Some(163_839),
    }
}

/// The profile a preset targets, for `k3mini init` to report.
pub fn preset_profile(cfg: &ModelConfig) -> Option<Profile> {
    match cfg {
        ModelConfig::Kimi(c) => Some(c.profile()),
        ModelConfig::Llama(_) => None,
    }
}
