//! The HF ↔ GGUF contract for llama.cpp's `kimi-linear`, `kimi-k3` and `llama` architectures
//! (interop.md §2–§3, §6): tensor names, and model hyper-parameters as GGUF metadata in both
//! directions. The data transforms (kv_b split, expert stacking, AttnRes fusion, −exp(A_log),
//! Llama's Q/K row permutation) are described here and applied by the exporter and the engine.

use k3_config::{
    Activation, FfnKind, KdaConfig, KdaDecay, KdaOutGate, KimiConfig, LatentMoe, LayerKind, LlamaConfig, Mixer,
    MlaConfig, ModelConfig, MoeConfig, Profile,
};

use crate::gguf::{GgufFile, Value};
use crate::{Error, Result};

/// A llama.cpp architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArch {
    KimiLinear,
    KimiK3,
    Llama,
}

impl GgufArch {
    pub fn name(self) -> &'static str {
        match self {
            GgufArch::KimiLinear => "kimi-linear",
            GgufArch::KimiK3 => "kimi-k3",
            GgufArch::Llama => "llama",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "kimi-linear" => GgufArch::KimiLinear,
            "kimi-k3" => GgufArch::KimiK3,
            "llama" => GgufArch::Llama,
            _ => return None,
        })
    }

    /// The architecture a config exports to.
    pub fn for_config(cfg: &ModelConfig) -> Self {
        match cfg {
            ModelConfig::Kimi(c) if c.profile() == Profile::K3 => GgufArch::KimiK3,
            ModelConfig::Kimi(_) => GgufArch::KimiLinear,
            ModelConfig::Llama(_) => GgufArch::Llama,
        }
    }
}

/// Per-layer HF suffix → GGUF suffix for the plain renames (identical bytes).
const LAYER_RENAMES: &[(&str, &str)] = &[
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_conv1d.weight", "ssm_conv1d_q.weight"),
    ("self_attn.k_conv1d.weight", "ssm_conv1d_k.weight"),
    ("self_attn.v_conv1d.weight", "ssm_conv1d_v.weight"),
    ("self_attn.f_a_proj.weight", "ssm_f_a.weight"),
    ("self_attn.f_b_proj.weight", "ssm_f_b.weight"),
    ("self_attn.b_proj.weight", "ssm_beta.weight"),
    ("self_attn.A_log", "ssm_a"),
    ("self_attn.dt_bias", "ssm_dt.bias"),
    ("self_attn.g_a_proj.weight", "ssm_g_a.weight"),
    ("self_attn.g_b_proj.weight", "ssm_g_b.weight"),
    ("self_attn.o_norm.weight", "ssm_norm.weight"),
    ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
    ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
    ("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"),
    ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
    ("block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
    ("block_sparse_moe.gate.e_score_correction_bias", "exp_probs_b.bias"),
    ("block_sparse_moe.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("block_sparse_moe.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
    ("block_sparse_moe.shared_experts.down_proj.weight", "ffn_down_shexp.weight"),
    ("block_sparse_moe.routed_expert_down_proj.weight", "ffn_routed_down.weight"),
    ("block_sparse_moe.routed_expert_up_proj.weight", "ffn_routed_up.weight"),
    ("block_sparse_moe.routed_expert_norm.weight", "ffn_routed_norm.weight"),
];

/// The GGUF name of an HF tensor that maps by a plain rename, or `None` for the tensors that need
/// a transform of several tensors (kv_b, experts, AttnRes, the KDA/MLA `g_proj`).
pub fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    LAYER_RENAMES.iter().find(|(h, _)| *h == suffix).map(|(_, g)| format!("blk.{layer}.{g}"))
}

/// GGUF name of a per-layer tensor.
pub fn blk(layer: usize, suffix: &str) -> String {
    format!("blk.{layer}.{suffix}")
}

fn key(arch: GgufArch, k: &str) -> String {
    format!("{}.{k}", arch.name())
}

/// Hyper-parameter metadata for a config, as llama.cpp's loaders read it.
pub fn config_metadata(cfg: &ModelConfig) -> Result<Vec<(String, Value)>> {
    let arch = GgufArch::for_config(cfg);
    let k = |s: &str| key(arch, s);
    let mut m = vec![("general.architecture".to_string(), Value::Str(arch.name().into()))];
    match cfg {
        ModelConfig::Llama(c) => {
            m.push((k("context_length"), Value::U32(c.max_position_embeddings as u32)));
            m.push((k("embedding_length"), Value::U32(c.hidden_size as u32)));
            m.push((k("block_count"), Value::U32(c.num_hidden_layers as u32)));
            m.push((k("feed_forward_length"), Value::U32(c.intermediate_size as u32)));
            m.push((k("attention.head_count"), Value::U32(c.num_attention_heads as u32)));
            m.push((k("attention.head_count_kv"), Value::U32(c.num_key_value_heads as u32)));
            m.push((k("attention.key_length"), Value::U32(c.head_dim as u32)));
            m.push((k("attention.value_length"), Value::U32(c.head_dim as u32)));
            m.push((k("rope.dimension_count"), Value::U32(c.head_dim as u32)));
            m.push((k("rope.freq_base"), Value::F32(c.rope_theta as f32)));
            m.push((k("attention.layer_norm_rms_epsilon"), Value::F32(c.rms_norm_eps as f32)));
            m.push((k("vocab_size"), Value::U32(c.vocab_size as u32)));
        }
        ModelConfig::Kimi(c) => {
            check_exportable(c, arch)?;
            let mla = &c.mla;
            m.push((k("context_length"), Value::U32(c.max_position_embeddings.min(u32::MAX as usize) as u32)));
            m.push((k("embedding_length"), Value::U32(c.hidden_size as u32)));
            m.push((k("block_count"), Value::U32(c.layers.len() as u32)));
            m.push((k("feed_forward_length"), Value::U32(c.intermediate_size as u32)));
            m.push((k("attention.head_count"), Value::U32(mla.num_heads as u32)));
            let kv: Vec<i32> = c.layers.iter().map(|l| i32::from(l.mixer == Mixer::Mla)).collect();
            m.push((k("attention.head_count_kv"), Value::i32_array(kv)));
            m.push((k("attention.layer_norm_rms_epsilon"), Value::F32(c.rms_norm_eps as f32)));
            m.push((k("attention.key_length"), Value::U32((mla.kv_lora_rank + mla.qk_rope_head_dim) as u32)));
            m.push((k("attention.value_length"), Value::U32(mla.kv_lora_rank as u32)));
            m.push((k("attention.key_length_mla"), Value::U32(mla.qk_head_dim() as u32)));
            m.push((k("attention.value_length_mla"), Value::U32(mla.v_head_dim as u32)));
            m.push((k("attention.kv_lora_rank"), Value::U32(mla.kv_lora_rank as u32)));
            if let Some(rq) = mla.q_lora_rank {
                m.push((k("attention.q_lora_rank"), Value::U32(rq as u32)));
            }
            m.push((k("rope.dimension_count"), Value::U32(mla.qk_rope_head_dim as u32)));
            m.push((k("ssm.conv_kernel"), Value::U32(c.kda.conv_kernel as u32)));
            m.push((k("kda.head_dim"), Value::U32(c.kda.head_dim as u32)));
            m.push((k("vocab_size"), Value::U32(c.vocab_size as u32)));
            let moe = &c.moe;
            if c.has_moe() {
                m.push((k("expert_count"), Value::U32(moe.num_experts as u32)));
                m.push((k("expert_used_count"), Value::U32(moe.top_k as u32)));
                m.push((k("expert_group_count"), Value::U32(moe.num_expert_group as u32)));
                m.push((k("expert_group_used_count"), Value::U32(moe.topk_group as u32)));
            }
            // Required by both loaders even for an all-dense model (interop.md §0).
            m.push((k("expert_feed_forward_length"), Value::U32(moe.intermediate_size as u32)));
            m.push((k("expert_shared_count"), Value::U32(moe.num_shared_experts as u32)));
            m.push((k("expert_gating_func"), Value::U32(2))); // sigmoid
            m.push((k("expert_weights_scale"), Value::F32(moe.routed_scaling_factor as f32)));
            m.push((k("leading_dense_block_count"), Value::U32(c.first_k_dense() as u32)));
            if arch == GgufArch::KimiK3 {
                m.push((k("expert_weights_norm"), Value::Bool(moe.renormalize)));
                if let Some(l) = moe.latent {
                    m.push((k("expert_latent_length"), Value::U32(l.dim as u32)));
                }
                if let KdaDecay::LowerBound(lb) = c.kda.decay {
                    m.push((k("kda.gate_lower_bound"), Value::F32(lb)));
                }
                m.push((k("attn_res.block_size"), Value::U32(c.attn_res_block_size.unwrap_or(0) as u32)));
                let (beta, lin) = match c.activation {
                    Activation::Situ { beta, linear_beta } => (beta, linear_beta),
                    Activation::Silu => (f32::INFINITY, 0.0),
                };
                m.push((k("activation.situ_beta"), Value::F32(beta)));
                m.push((k("activation.situ_linear_beta"), Value::F32(lin)));
            }
        }
    }
    Ok(m)
}

/// Refuse configs that the target llama.cpp loader cannot represent, saying why.
pub fn check_exportable(c: &KimiConfig, arch: GgufArch) -> Result<()> {
    let bad = |why: String| Err(Error::Invalid(format!("cannot export to llama.cpp `{}`: {why}", arch.name())));
    if c.count_mixer(Mixer::Kda) > 0 && c.count_mixer(Mixer::Mla) > 0 && c.kda.num_heads != c.mla.num_heads {
        return bad(format!(
            "KDA heads ({}) must equal MLA heads ({}): one attention.head_count serves both",
            c.kda.num_heads, c.mla.num_heads
        ));
    }
    if c.mla.attention_bias {
        return bad("attention_bias (MLA biases) has no tensors in llama.cpp's Kimi graphs".into());
    }
    if arch == GgufArch::KimiLinear && c.count_mixer(Mixer::Mla) > 0 && c.mla.q_lora_rank.is_some() {
        return bad(
            "q_lora_rank: llama.cpp's kimi-linear loader never reads attention.q_lora_rank (kimi-k3 does)".into()
        );
    }
    if c.has_moe() && c.moe.num_expert_group > 1 && c.moe.topk_group < c.moe.num_expert_group {
        return bad(
            "group-limited routing (num_expert_group > 1): llama.cpp's Kimi loaders do not read expert groups".into()
        );
    }
    if arch == GgufArch::KimiLinear && c.has_moe() && c.moe.num_shared_experts == 0 {
        return bad(
            "num_shared_experts = 0: llama.cpp's kimi-linear always adds a shared expert (it would run a null one)"
                .into(),
        );
    }
    if arch == GgufArch::KimiLinear && c.has_moe() && !c.moe.renormalize {
        return bad("moe_renormalize = false: llama.cpp's kimi-linear always renormalizes the top-k weights".into());
    }
    if !c.dense_is_prefix() {
        return bad("dense FFN layers must be a prefix (leading_dense_block_count)".into());
    }
    if arch == GgufArch::KimiK3 {
        if c.kda.out_gate != KdaOutGate::FullRank && c.count_mixer(Mixer::Kda) > 0 {
            return bad("kimi-k3 needs the full-rank KDA output gate (use_full_rank_gate)".into());
        }
        if !matches!(c.activation, Activation::Situ { .. }) {
            return bad("kimi-k3 always applies SiTU (hidden_act \"situ\")".into());
        }
    }
    Ok(())
}

fn need<'a>(f: &'a GgufFile, key: &str) -> Result<&'a Value> {
    f.get(key).ok_or_else(|| Error::Invalid(format!("{}: missing GGUF metadata `{key}`", f.path.display())))
}

fn need_u(f: &GgufFile, key: &str) -> Result<usize> {
    need(f, key)?
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| Error::Invalid(format!("{}: GGUF metadata `{key}` is not an integer", f.path.display())))
}

fn opt_u(f: &GgufFile, key: &str) -> Option<usize> {
    f.get(key).and_then(Value::as_u64).map(|v| v as usize)
}

/// A float, read back as the decimal it was written from when stored as f32 (1e-5 stays 1e-5,
/// not 9.99999974e-6), so configs round-trip.
fn opt_f(f: &GgufFile, key: &str) -> Option<f64> {
    match f.get(key)? {
        Value::F32(x) => format!("{x}").parse().ok(),
        v => v.as_f64(),
    }
}

/// Number of tokens in the embedded vocabulary, else `{arch}.vocab_size`, else the embedding rows.
fn vocab_size(f: &GgufFile, arch: GgufArch) -> Result<usize> {
    if let Some(v) = opt_u(f, &key(arch, "vocab_size")) {
        return Ok(v);
    }
    if let Some(t) = f.get("tokenizer.ggml.tokens").and_then(Value::as_array) {
        return Ok(t.len());
    }
    let e = f
        .tensor_info("token_embd.weight")
        .ok_or_else(|| Error::Invalid(format!("{}: no token_embd.weight", f.path.display())))?;
    Ok(e.ne.get(1).copied().unwrap_or(0) as usize)
}

/// Rebuild the model config from a GGUF's metadata and tensor inventory.
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    let name =
        f.arch().ok_or_else(|| Error::Invalid(format!("{}: missing `general.architecture`", f.path.display())))?;
    let arch = GgufArch::from_name(name).ok_or_else(|| {
        Error::Invalid(format!(
            "{}: architecture `{name}` is not supported; supported: kimi-linear, kimi-k3, llama",
            f.path.display()
        ))
    })?;
    let k = |s: &str| key(arch, s);
    let eps = opt_f(f, &k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5);
    let bos = f.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64).map(|v| v as u32);
    let eos: Vec<u32> =
        f.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64).map(|v| vec![v as u32]).unwrap_or_default();
    let pad = f.get("tokenizer.ggml.padding_token_id").and_then(Value::as_u64).map(|v| v as u32);
    let vocab = vocab_size(f, arch)?;
    let hidden = need_u(f, &k("embedding_length"))?;
    let n_layer = need_u(f, &k("block_count"))?;
    let heads = need_u(f, &k("attention.head_count"))?;
    let ctx = opt_u(f, &k("context_length")).unwrap_or(4096);
    if arch == GgufArch::Llama {
        let kv_heads = opt_u(f, &k("attention.head_count_kv")).unwrap_or(heads);
        let cfg = LlamaConfig {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: need_u(f, &k("feed_forward_length"))?,
            num_hidden_layers: n_layer,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim: opt_u(f, &k("attention.key_length")).unwrap_or(hidden / heads.max(1)),
            rms_norm_eps: eps,
            rope_theta: opt_f(f, &k("rope.freq_base")).unwrap_or(10000.0),
            max_position_embeddings: ctx,
            tie_word_embeddings: f.tensor_info("output.weight").is_none(),
            attention_bias: false,
            mlp_bias: false,
            bos_token_id: bos,
            eos_token_id: eos,
            pad_token_id: pad,
        };
        cfg.validate().map_err(|source| Error::Config { path: f.path.clone(), source })?;
        return Ok(ModelConfig::Llama(cfg));
    }
    let kv_arr = need(f, &k("attention.head_count_kv"))?;
    let mixers: Vec<Mixer> = match kv_arr.as_array() {
        Some(a) => a.iter().map(|v| if v.as_u64().unwrap_or(0) > 0 { Mixer::Mla } else { Mixer::Kda }).collect(),
        None => {
            return Err(Error::Invalid(format!(
                "{}: `{}` must be a per-layer array",
                f.path.display(),
                k("attention.head_count_kv")
            )))
        }
    };
    if mixers.len() != n_layer {
        return Err(Error::Invalid(format!(
            "{}: head_count_kv has {} entries for {n_layer} layers",
            f.path.display(),
            mixers.len()
        )));
    }
    let dense_lead = opt_u(f, &k("leading_dense_block_count")).unwrap_or(0);
    let layers: Vec<LayerKind> = mixers
        .into_iter()
        .enumerate()
        .map(|(i, mixer)| LayerKind { mixer, ffn: if i < dense_lead { FfnKind::Dense } else { FfnKind::Moe } })
        .collect();
    let has = |n: &str| f.tensor_info(n).is_some();
    let first_kda = layers.iter().position(|l| l.mixer == Mixer::Kda);
    let first_mla = layers.iter().position(|l| l.mixer == Mixer::Mla);
    let first_moe = layers.iter().position(|l| l.ffn == FfnKind::Moe);
    let dr = need_u(f, &k("rope.dimension_count"))?;
    let mla = MlaConfig {
        num_heads: heads,
        q_lora_rank: opt_u(f, &k("attention.q_lora_rank")).filter(|&r| r > 0),
        kv_lora_rank: need_u(f, &k("attention.kv_lora_rank"))?,
        qk_nope_head_dim: need_u(f, &k("attention.key_length_mla"))?.saturating_sub(dr),
        qk_rope_head_dim: dr,
        v_head_dim: need_u(f, &k("attention.value_length_mla"))?,
        output_gate: first_mla.is_some_and(|i| has(&blk(i, "attn_gate.weight"))),
        attention_bias: false,
    };
    let kda_head_dim = need_u(f, &k("kda.head_dim"))?;
    let kda = KdaConfig {
        num_heads: heads,
        head_dim: kda_head_dim,
        conv_kernel: need_u(f, &k("ssm.conv_kernel"))?,
        decay: match opt_f(f, &k("kda.gate_lower_bound")) {
            Some(lb) if arch == GgufArch::KimiK3 => KdaDecay::LowerBound(lb as f32),
            _ => KdaDecay::Softplus,
        },
        out_gate: if first_kda.is_some_and(|i| has(&blk(i, "ssm_g.weight"))) {
            KdaOutGate::FullRank
        } else {
            KdaOutGate::LowRank
        },
    };
    let latent = opt_u(f, &k("expert_latent_length"))
        .filter(|&l| l > 0)
        .map(|dim| LatentMoe { dim, use_norm: first_moe.is_some_and(|i| has(&blk(i, "ffn_routed_norm.weight"))) });
    let moe = MoeConfig {
        num_experts: opt_u(f, &k("expert_count")).unwrap_or(0),
        top_k: opt_u(f, &k("expert_used_count")).unwrap_or(0),
        num_shared_experts: opt_u(f, &k("expert_shared_count")).unwrap_or(0),
        intermediate_size: opt_u(f, &k("expert_feed_forward_length")).unwrap_or(0),
        routed_scaling_factor: opt_f(f, &k("expert_weights_scale")).filter(|&s| s != 0.0).unwrap_or(1.0),
        renormalize: f.get(&k("expert_weights_norm")).and_then(Value::as_bool).unwrap_or(true),
        num_expert_group: opt_u(f, &k("expert_group_count")).unwrap_or(1).max(1),
        topk_group: opt_u(f, &k("expert_group_used_count")).unwrap_or(1).max(1),
        latent,
    };
    let activation = if arch == GgufArch::KimiK3 {
        let beta = opt_f(f, &k("activation.situ_beta")).unwrap_or(4.0) as f32;
        let linear_beta = opt_f(f, &k("activation.situ_linear_beta")).unwrap_or(25.0) as f32;
        Activation::Situ { beta, linear_beta }
    } else {
        Activation::Silu
    };
    let cfg = KimiConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: opt_u(f, &k("feed_forward_length")).unwrap_or(0),
        layers,
        rms_norm_eps: eps,
        kda,
        mla,
        moe,
        activation,
        attn_res_block_size: opt_u(f, &k("attn_res.block_size")).filter(|&b| b > 0),
        max_position_embeddings: ctx,
        bos_token_id: bos,
        eos_token_id: eos,
        pad_token_id: pad,
    };
    cfg.validate().map_err(|source| Error::Config { path: f.path.clone(), source })?;
    Ok(ModelConfig::Kimi(cfg))
}
