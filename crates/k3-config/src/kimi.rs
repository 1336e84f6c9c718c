//! The internal form of a Kimi-Linear / K3 hybrid config (`shared/docs/architecture.md` §1–§7).

use crate::{field_err, Result};

/// The token mixer of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mixer {
    /// Kimi Delta Attention (linear attention, fixed-size state).
    Kda,
    /// Multi-head latent attention (NoPE), the "full attention" layers.
    Mla,
}

/// The feed-forward block of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FfnKind {
    Dense,
    Moe,
}

/// Resolved per-layer structure; the config holds one per layer (never a tiled pattern).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerKind {
    pub mixer: Mixer,
    pub ffn: FfnKind,
}

/// KDA forget-gate activation (architecture.md §1(b)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KdaDecay {
    /// Kimi Linear: `g = −exp(A_log)·softplus(f + dt_bias)`.
    Softplus,
    /// K3: `g = lb·sigmoid(exp(A_log)·(f + dt_bias))`, in (lb, 0).
    LowerBound(f32),
}

/// KDA output gate (architecture.md §1(c)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdaOutGate {
    /// `g_b_proj(g_a_proj(x))`, rank = KDA head_dim (Kimi Linear).
    LowRank,
    /// `g_proj(x)` (K3, `use_full_rank_gate`).
    FullRank,
}

#[derive(Debug, Clone, PartialEq)]
pub struct KdaConfig {
    pub num_heads: usize,
    /// dk = dv (Kimi never expands v); also the gate rank.
    pub head_dim: usize,
    pub conv_kernel: usize,
    pub decay: KdaDecay,
    pub out_gate: KdaOutGate,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    pub num_heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// K3 sigmoid output gate `g_proj` (`mla_use_output_gate`).
    pub output_gate: bool,
    /// Biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` (transformers' `attention_bias`).
    pub attention_bias: bool,
}

impl MlaConfig {
    /// dn + dr: the per-head query/key width and the softmax scale's denominator.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// K3's latent MoE: routed experts run in a down-projected space of width `dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentMoe {
    pub dim: usize,
    pub use_norm: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub num_shared_experts: usize,
    /// F_e, the width of one routed expert (shared experts use F_e · num_shared).
    pub intermediate_size: usize,
    pub routed_scaling_factor: f64,
    pub renormalize: bool,
    pub num_expert_group: usize,
    pub topk_group: usize,
    pub latent: Option<LatentMoe>,
}

/// FFN activation: SwiGLU, or K3's soft-capped SiTU-GLU (architecture.md §5(d)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    Silu,
    Situ { beta: f32, linear_beta: f32 },
}

/// Which runtimes can load a config (interop.md §0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// transformers `kimi_linear` and llama.cpp `kimi-linear`.
    KimiLinear,
    /// llama.cpp `kimi-k3` only.
    K3,
}

impl Profile {
    pub fn name(self) -> &'static str {
        match self {
            Profile::KimiLinear => "Kimi-Linear",
            Profile::K3 => "K3",
        }
    }
}

/// A validated Kimi-Linear / K3 hybrid config.
#[derive(Debug, Clone, PartialEq)]
pub struct KimiConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Width of the dense FFN layers.
    pub intermediate_size: usize,
    pub layers: Vec<LayerKind>,
    pub rms_norm_eps: f64,
    pub kda: KdaConfig,
    pub mla: MlaConfig,
    pub moe: MoeConfig,
    pub activation: Activation,
    /// AttnRes block size; `None` is the plain residual stream.
    pub attn_res_block_size: Option<usize>,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

impl KimiConfig {
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// K3 if any K3-only feature is on, else Kimi-Linear.
    pub fn profile(&self) -> Profile {
        let k3 = matches!(self.kda.decay, KdaDecay::LowerBound(_))
            || self.kda.out_gate == KdaOutGate::FullRank
            || self.mla.output_gate
            || self.attn_res_block_size.is_some()
            || matches!(self.activation, Activation::Situ { .. })
            || (self.has_moe() && self.moe.latent.is_some());
        if k3 {
            Profile::K3
        } else {
            Profile::KimiLinear
        }
    }

    pub fn has_moe(&self) -> bool {
        self.layers.iter().any(|l| l.ffn == FfnKind::Moe)
    }

    pub fn count_mixer(&self, m: Mixer) -> usize {
        self.layers.iter().filter(|l| l.mixer == m).count()
    }

    /// Number of leading dense layers (`first_k_dense_replace`).
    pub fn first_k_dense(&self) -> usize {
        self.layers.iter().take_while(|l| l.ffn == FfnKind::Dense).count()
    }

    /// True when the dense layers are exactly a prefix, so `first_k_dense_replace` describes them.
    pub fn dense_is_prefix(&self) -> bool {
        let k = self.first_k_dense();
        self.layers[k..].iter().all(|l| l.ffn == FfnKind::Moe)
    }

    /// The standard K3 Mini layer layout: MLA at 1-indexed 4, 8, …, the last layer forced to MLA.
    pub fn hybrid_layout(n_layers: usize, ffn: impl Fn(usize) -> FfnKind) -> Vec<LayerKind> {
        (0..n_layers)
            .map(|i| {
                let mla = (i + 1) % 4 == 0 || i + 1 == n_layers;
                LayerKind { mixer: if mla { Mixer::Mla } else { Mixer::Kda }, ffn: ffn(i) }
            })
            .collect()
    }

    /// Check every invariant the model code relies on. Called once by every loader.
    pub fn validate(&self) -> Result<()> {
        let pos = |name: &str, v: usize| {
            if v == 0 {
                field_err(name, "must be > 0")
            } else {
                Ok(())
            }
        };
        pos("vocab_size", self.vocab_size)?;
        pos("hidden_size", self.hidden_size)?;
        if self.layers.is_empty() {
            return field_err("num_hidden_layers", "must be > 0");
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return field_err("rms_norm_eps", format!("must be > 0, got {}", self.rms_norm_eps));
        }
        if self.count_mixer(Mixer::Kda) > 0 {
            pos("linear_attn_config.num_heads", self.kda.num_heads)?;
            pos("linear_attn_config.head_dim", self.kda.head_dim)?;
            pos("linear_attn_config.short_conv_kernel_size", self.kda.conv_kernel)?;
            if let KdaDecay::LowerBound(lb) = self.kda.decay {
                if !(lb < 0.0 && lb.is_finite()) {
                    return field_err(
                        "linear_attn_config.gate_lower_bound",
                        format!("must be a finite number < 0, got {lb}"),
                    );
                }
            }
        }
        if self.count_mixer(Mixer::Mla) > 0 {
            pos("num_attention_heads", self.mla.num_heads)?;
            pos("kv_lora_rank", self.mla.kv_lora_rank)?;
            pos("v_head_dim", self.mla.v_head_dim)?;
            if self.mla.qk_head_dim() == 0 {
                return field_err("qk_nope_head_dim", "qk_nope_head_dim + qk_rope_head_dim must be > 0");
            }
            if self.mla.q_lora_rank == Some(0) {
                return field_err("q_lora_rank", "must be > 0 or null");
            }
        }
        if self.layers.iter().any(|l| l.ffn == FfnKind::Dense) {
            pos("intermediate_size", self.intermediate_size)?;
        }
        if self.has_moe() {
            let m = &self.moe;
            pos("num_experts", m.num_experts)?;
            pos("moe_intermediate_size", m.intermediate_size)?;
            if m.top_k == 0 || m.top_k > m.num_experts {
                return field_err(
                    "num_experts_per_token",
                    format!("must be in 1..={} (num_experts), got {}", m.num_experts, m.top_k),
                );
            }
            if m.num_expert_group == 0 || !m.num_experts.is_multiple_of(m.num_expert_group) {
                return field_err(
                    "num_expert_group",
                    format!("must divide num_experts ({}), got {}", m.num_experts, m.num_expert_group),
                );
            }
            let group = m.num_experts / m.num_expert_group;
            if m.num_expert_group > 1 && group < 2 {
                return field_err("num_expert_group", "group-limited routing needs at least 2 experts per group");
            }
            // With a single group, topk_group is meaningless (plain top-k routing).
            if m.num_expert_group > 1 && (m.topk_group == 0 || m.topk_group > m.num_expert_group) {
                return field_err(
                    "topk_group",
                    format!("must be in 1..={} (num_expert_group), got {}", m.num_expert_group, m.topk_group),
                );
            }
            if m.num_expert_group > 1 && m.top_k > m.topk_group * group {
                return field_err(
                    "num_experts_per_token",
                    format!("{} experts cannot be chosen from {} groups of {}", m.top_k, m.topk_group, group),
                );
            }
            if let Some(l) = m.latent {
                pos("routed_expert_hidden_size", l.dim)?;
            }
        }
        if let Activation::Situ { beta, .. } = self.activation {
            if beta.is_nan() || beta <= 0.0 {
                return field_err("activation_situ_beta", format!("must be > 0, got {beta}"));
            }
        }
        if self.attn_res_block_size == Some(0) {
            return field_err("attn_res_block_size", "must be >= 1 (omit the field, or use null, for no AttnRes)");
        }
        Ok(())
    }
}
