//! The weight-name contract: every tensor a config implies, with its HF (Moonshot) name and shape.
//!
//! Names and shapes follow architecture.md §9 and, for the K3 extensions, llama.cpp's `kimi-k3`
//! converter (so GGUF export is a rename). This one table drives the checkpoint loader's checks,
//! the writer, the parameter counts, and (later) the HF → GGUF mapping.

use k3_config::{FfnKind, KdaOutGate, KimiConfig, LlamaConfig, Mixer, ModelConfig, Profile};

/// What a tensor is, for loaders and (later) the quantizer's "leave alone" rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    /// Token embedding table [V, C].
    Embedding,
    /// A 2-D matmul weight [out, in] (including the LM head and per-expert matrices).
    Linear,
    /// An RMSNorm weight (1-D).
    Norm,
    /// A depthwise short-conv kernel [C, 1, K].
    Conv,
    /// The MoE router weight [E, C] (kept in f32).
    Router,
    /// Any other small parameter: biases, A_log, dt_bias, AttnRes projections.
    Param,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: TensorKind,
    /// Another name the same tensor is accepted under when reading (never written).
    pub alt_name: Option<String>,
}

impl TensorSpec {
    fn new(name: String, shape: Vec<usize>, kind: TensorKind) -> Self {
        Self { name, shape, kind, alt_name: None }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Every tensor of a model, in a stable order (embedding, layers, final norm, head).
pub fn tensor_specs(cfg: &ModelConfig) -> Vec<TensorSpec> {
    match cfg {
        ModelConfig::Kimi(c) => kimi_specs(c),
        ModelConfig::Llama(c) => llama_specs(c),
    }
}

/// The HF names of one layer's routed expert `e`: (w1 gate, w3 up, w2 down).
pub fn expert_names(layer: usize, e: usize) -> [String; 3] {
    let p = format!("model.layers.{layer}.block_sparse_moe.experts.{e}");
    [format!("{p}.w1.weight"), format!("{p}.w3.weight"), format!("{p}.w2.weight")]
}

fn kimi_specs(c: &KimiConfig) -> Vec<TensorSpec> {
    use TensorKind::*;
    let d = c.hidden_size;
    let mut v = vec![TensorSpec::new("model.embed_tokens.weight".into(), vec![c.vocab_size, d], Embedding)];
    let k3 = c.profile() == Profile::K3;
    for (i, layer) in c.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let mut add = |suffix: &str, shape: Vec<usize>, kind: TensorKind| {
            v.push(TensorSpec::new(format!("{p}.{suffix}"), shape, kind));
        };
        add("input_layernorm.weight", vec![d], Norm);
        add("post_attention_layernorm.weight", vec![d], Norm);
        if c.attn_res_block_size.is_some() {
            add("self_attention_res_norm.weight", vec![d], Norm);
            add("self_attention_res_proj.weight", vec![1, d], Param);
            add("mlp_res_norm.weight", vec![d], Norm);
            add("mlp_res_proj.weight", vec![1, d], Param);
        }
        match layer.mixer {
            Mixer::Kda => {
                let (h, k, kc) = (c.kda.num_heads, c.kda.head_dim, c.kda.conv_kernel);
                let w = h * k;
                add("self_attn.q_proj.weight", vec![w, d], Linear);
                add("self_attn.k_proj.weight", vec![w, d], Linear);
                add("self_attn.v_proj.weight", vec![w, d], Linear);
                add("self_attn.q_conv1d.weight", vec![w, 1, kc], Conv);
                add("self_attn.k_conv1d.weight", vec![w, 1, kc], Conv);
                add("self_attn.v_conv1d.weight", vec![w, 1, kc], Conv);
                add("self_attn.f_a_proj.weight", vec![k, d], Linear);
                add("self_attn.f_b_proj.weight", vec![w, k], Linear);
                // Kimi Linear saves A_log as [1,1,H,1]; llama.cpp's kimi-k3 converter takes [H].
                add("self_attn.A_log", if k3 { vec![h] } else { vec![1, 1, h, 1] }, Param);
                add("self_attn.dt_bias", vec![w], Param);
                add("self_attn.b_proj.weight", vec![h, d], Linear);
                match c.kda.out_gate {
                    KdaOutGate::LowRank => {
                        add("self_attn.g_a_proj.weight", vec![k, d], Linear);
                        add("self_attn.g_b_proj.weight", vec![w, k], Linear);
                    }
                    KdaOutGate::FullRank => add("self_attn.g_proj.weight", vec![w, d], Linear),
                }
                add("self_attn.o_norm.weight", vec![k], Norm);
                add("self_attn.o_proj.weight", vec![d, w], Linear);
            }
            Mixer::Mla => {
                let m = &c.mla;
                let (h, qk) = (m.num_heads, m.qk_head_dim());
                match m.q_lora_rank {
                    None => add("self_attn.q_proj.weight", vec![h * qk, d], Linear),
                    Some(rq) => {
                        add("self_attn.q_a_proj.weight", vec![rq, d], Linear);
                        if m.attention_bias {
                            add("self_attn.q_a_proj.bias", vec![rq], Param);
                        }
                        add("self_attn.q_a_layernorm.weight", vec![rq], Norm);
                        add("self_attn.q_b_proj.weight", vec![h * qk, rq], Linear);
                    }
                }
                add("self_attn.kv_a_proj_with_mqa.weight", vec![m.kv_lora_rank + m.qk_rope_head_dim, d], Linear);
                if m.attention_bias {
                    add("self_attn.kv_a_proj_with_mqa.bias", vec![m.kv_lora_rank + m.qk_rope_head_dim], Param);
                }
                add("self_attn.kv_a_layernorm.weight", vec![m.kv_lora_rank], Norm);
                add(
                    "self_attn.kv_b_proj.weight",
                    vec![h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
                    Linear,
                );
                add("self_attn.o_proj.weight", vec![d, h * m.v_head_dim], Linear);
                if m.attention_bias {
                    add("self_attn.o_proj.bias", vec![d], Param);
                }
                if m.output_gate {
                    add("self_attn.g_proj.weight", vec![h * m.v_head_dim, d], Linear);
                }
            }
        }
        match layer.ffn {
            FfnKind::Dense => {
                let f = c.intermediate_size;
                for (s, shape) in [("gate_proj", vec![f, d]), ("up_proj", vec![f, d]), ("down_proj", vec![d, f])] {
                    let mut t = TensorSpec::new(format!("{p}.mlp.{s}.weight"), shape, Linear);
                    // transformers 5.24's save_pretrained names dense layers block_sparse_moe.* too.
                    t.alt_name = Some(format!("{p}.block_sparse_moe.{s}.weight"));
                    v.push(t);
                }
            }
            FfnKind::Moe => {
                let moe = &c.moe;
                let (e, fe) = (moe.num_experts, moe.intermediate_size);
                let l = moe.latent.map_or(d, |x| x.dim);
                let b = format!("{p}.block_sparse_moe");
                v.push(TensorSpec::new(format!("{b}.gate.weight"), vec![e, d], Router));
                v.push(TensorSpec::new(format!("{b}.gate.e_score_correction_bias"), vec![e], Param));
                if let Some(lat) = moe.latent {
                    v.push(TensorSpec::new(format!("{b}.routed_expert_down_proj.weight"), vec![l, d], Linear));
                    v.push(TensorSpec::new(format!("{b}.routed_expert_up_proj.weight"), vec![d, l], Linear));
                    if lat.use_norm {
                        v.push(TensorSpec::new(format!("{b}.routed_expert_norm.weight"), vec![l], Norm));
                    }
                }
                for x in 0..e {
                    let [w1, w3, w2] = expert_names(i, x);
                    v.push(TensorSpec::new(w1, vec![fe, l], Linear));
                    v.push(TensorSpec::new(w3, vec![fe, l], Linear));
                    v.push(TensorSpec::new(w2, vec![l, fe], Linear));
                }
                let fs = fe * moe.num_shared_experts;
                if fs > 0 {
                    for (s, shape) in [("gate_proj", vec![fs, d]), ("up_proj", vec![fs, d]), ("down_proj", vec![d, fs])]
                    {
                        v.push(TensorSpec::new(format!("{b}.shared_experts.{s}.weight"), shape, Linear));
                    }
                }
            }
        }
    }
    if c.attn_res_block_size.is_some() {
        v.push(TensorSpec::new("model.output_attn_res_norm.weight".into(), vec![d], Norm));
        v.push(TensorSpec::new("model.output_attn_res_proj.weight".into(), vec![1, d], Param));
    }
    v.push(TensorSpec::new("model.norm.weight".into(), vec![d], Norm));
    v.push(TensorSpec::new("lm_head.weight".into(), vec![c.vocab_size, d], Linear));
    v
}

fn llama_specs(c: &LlamaConfig) -> Vec<TensorSpec> {
    use TensorKind::*;
    let d = c.hidden_size;
    let (hq, hkv) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
    let f = c.intermediate_size;
    let mut v = vec![TensorSpec::new("model.embed_tokens.weight".into(), vec![c.vocab_size, d], Embedding)];
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mut add = |s: &str, shape: Vec<usize>, kind| v.push(TensorSpec::new(format!("{p}.{s}"), shape, kind));
        add("input_layernorm.weight", vec![d], Norm);
        for (s, rows) in [("q_proj", hq), ("k_proj", hkv), ("v_proj", hkv)] {
            add(&format!("self_attn.{s}.weight"), vec![rows, d], Linear);
            if c.attention_bias {
                add(&format!("self_attn.{s}.bias"), vec![rows], Param);
            }
        }
        add("self_attn.o_proj.weight", vec![d, hq], Linear);
        if c.attention_bias {
            add("self_attn.o_proj.bias", vec![d], Param);
        }
        add("post_attention_layernorm.weight", vec![d], Norm);
        for (s, shape, bias) in [("gate_proj", vec![f, d], f), ("up_proj", vec![f, d], f), ("down_proj", vec![d, f], d)]
        {
            add(&format!("mlp.{s}.weight"), shape, Linear);
            if c.mlp_bias {
                add(&format!("mlp.{s}.bias"), vec![bias], Param);
            }
        }
    }
    v.push(TensorSpec::new("model.norm.weight".into(), vec![d], Norm));
    if !c.tie_word_embeddings {
        v.push(TensorSpec::new("lm_head.weight".into(), vec![c.vocab_size, d], Linear));
    }
    v
}

/// Total and per-token-active parameter counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamCounts {
    pub total: usize,
    /// Parameters touched per token: routed experts count only top-k of E.
    pub active: usize,
    /// Embedding table plus LM head.
    pub embedding: usize,
}

pub fn param_counts(cfg: &ModelConfig) -> ParamCounts {
    let specs = tensor_specs(cfg);
    let total: usize = specs.iter().map(TensorSpec::numel).sum();
    let embedding: usize = specs
        .iter()
        .filter(|s| s.name == "model.embed_tokens.weight" || s.name == "lm_head.weight")
        .map(TensorSpec::numel)
        .sum();
    let mut inactive = 0;
    if let ModelConfig::Kimi(c) = cfg {
        let routed: usize = specs.iter().filter(|s| s.name.contains(".experts.")).map(TensorSpec::numel).sum();
        if let Some(active_routed) = (routed * c.moe.top_k).checked_div(c.moe.num_experts) {
            inactive = routed - active_routed;
        }
    }
    ParamCounts { total, active: total - inactive, embedding }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_config::presets;

    /// architecture.md §1(f): d 192, H 3, dk 64 with rank 32 gives 175,171; with rank = head_dim
    /// (64, our tiny) the two gate pairs grow by 2·(192 + 192)·32.
    #[test]
    fn kda_layer_count_matches_spec_formula() {
        let c = presets::tiny();
        let specs = kimi_specs(&c);
        let kda: usize =
            specs.iter().filter(|s| s.name.starts_with("model.layers.0.self_attn.")).map(TensorSpec::numel).sum();
        let (d, h, k, r, kc) = (192, 3, 64, 64, 4);
        let formula =
            3 * d * h * k + kc * 3 * h * k + d * r + r * h * k + d * h + h + h * k + d * r + r * h * k + k + h * k * d;
        assert_eq!(kda, formula);
        assert_eq!(formula - 175_171, 2 * (d + h * k) * 32);
    }

    #[test]
    fn preset_sizes_match_the_spec() {
        let tiny = param_counts(&ModelConfig::Kimi(presets::tiny())).total;
        assert!((5_200_000..5_400_000).contains(&tiny), "tiny {tiny}");
        let b = param_counts(&ModelConfig::Kimi(presets::small())).total;
        // Spec table: 48.5M with a gated MLA; the Kimi-Linear profile has no MLA gate (3 × 262K fewer).
        assert!((47_500_000..47_800_000).contains(&b), "small {b}");
        let c = param_counts(&ModelConfig::Kimi(presets::k3_3b()));
        assert!((3_050_000_000..3_150_000_000).contains(&c.total), "3b {}", c.total);
        assert_eq!(c.embedding, 2 * 163_840 * 2304);
    }

    #[test]
    fn moe_active_counts_top_k_experts() {
        let cfg = ModelConfig::Kimi(presets::tiny_k3());
        let p = param_counts(&cfg);
        // 7 MoE layers, 8 experts of 3·128·96 each, top-2 active.
        assert_eq!(p.total - p.active, 7 * 6 * 3 * 128 * 96);
        // bench-moe: 23 MoE layers of 64 experts of 3·256·1024, top-8 active, on the 370M's rest.
        let moe = param_counts(&ModelConfig::Kimi(presets::bench_moe()));
        assert_eq!(moe.total - moe.active, 23 * 56 * 3 * 256 * 1024);
        assert!((1_350_000_000..1_365_000_000).contains(&moe.total), "bench-moe {}", moe.total);
    }
}
