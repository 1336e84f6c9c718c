//! The baseline "ordinary Transformer": an HF `llama` config (GQA + RoPE + SwiGLU).
//! Also the shape of the SmolLM2 teacher.

use serde_json::{json, Map, Value};

use crate::hf::Reader;
use crate::{field_err, Parsed, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

const LLAMA_IGNORED: &[&str] = &[
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "initializer_range",
    "pretraining_tp",
    "attention_dropout",
    "architectures",
    "model_type",
    "_name_or_path",
    "id2label",
    "label2id",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "problem_type",
    "tokenizer_class",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "k3mini",
    "rope_parameters",
    "rope_scaling",
];

impl LlamaConfig {
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return field_err(name, "must be > 0");
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return field_err(
                "num_key_value_heads",
                format!("must divide num_attention_heads ({})", self.num_attention_heads),
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return field_err("head_dim", "RoPE needs an even head_dim");
        }
        Ok(())
    }
}

pub(crate) fn parse_llama(map: &Map<String, Value>) -> Result<Parsed<LlamaConfig>> {
    let mut r = Reader::new(map, "");
    let mut warnings = Vec::new();
    let hidden_size = r.usize_req("hidden_size")?;
    let heads = r.usize_req("num_attention_heads")?;
    match r.str_opt("hidden_act")?.unwrap_or("silu") {
        "silu" | "swish" => {}
        other => return field_err("hidden_act", format!("unsupported \"{other}\"; allowed: \"silu\"")),
    }
    // transformers 5 writes rope_parameters {rope_theta, rope_type}; older configs write rope_theta.
    let mut rope_theta = r.f64_opt("rope_theta")?;
    if let Some(Value::Object(rp)) = map.get("rope_parameters") {
        if let Some(t) = rp.get("rope_theta").and_then(Value::as_f64) {
            rope_theta = Some(t);
        }
        if let Some(kind) = rp.get("rope_type").and_then(Value::as_str) {
            if kind != "default" {
                return field_err(
                    "rope_parameters.rope_type",
                    format!("only \"default\" RoPE is supported, got \"{kind}\""),
                );
            }
        }
    }
    if map.get("rope_scaling").is_some_and(|v| !v.is_null()) {
        return field_err("rope_scaling", "RoPE scaling is not supported; use a config without it");
    }
    let cfg = LlamaConfig {
        vocab_size: r.usize_req("vocab_size")?,
        hidden_size,
        intermediate_size: r.usize_req("intermediate_size")?,
        num_hidden_layers: r.usize_req("num_hidden_layers")?,
        num_attention_heads: heads,
        num_key_value_heads: r.usize_or("num_key_value_heads", heads)?,
        head_dim: r.usize_or("head_dim", hidden_size / heads.max(1))?,
        rms_norm_eps: r.f64_or("rms_norm_eps", 1e-6)?,
        rope_theta: rope_theta.unwrap_or(10000.0),
        max_position_embeddings: r.usize_or("max_position_embeddings", 2048)?,
        tie_word_embeddings: r.bool_or("tie_word_embeddings", false)?,
        attention_bias: r.bool_or("attention_bias", false)?,
        mlp_bias: r.bool_or("mlp_bias", false)?,
        bos_token_id: r.token_ids("bos_token_id")?.first().copied(),
        eos_token_id: r.token_ids("eos_token_id")?,
        pad_token_id: r.token_ids("pad_token_id")?.first().copied(),
    };
    warnings.extend(r.unknown(LLAMA_IGNORED).into_iter().map(|k| format!("unknown config field `{k}` ignored")));
    cfg.validate()?;
    Ok(Parsed { config: cfg, warnings })
}

pub(crate) fn llama_to_json(c: &LlamaConfig) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": if c.eos_token_id.len() == 1 { json!(c.eos_token_id[0]) } else { json!(c.eos_token_id) },
        "pad_token_id": c.pad_token_id,
        "torch_dtype": "float32",
    })
}
