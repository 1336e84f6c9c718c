//! HF `config.json` ↔ [`ModelConfig`], with transformers 5.24's precedence rules.
//!
//! A Kimi config comes in two forms, often mixed (interop.md §1.1):
//! - Moonshot's original: `linear_attn_config {head_dim, num_heads, short_conv_kernel_size,
//!   full_attn_layers, kda_layers}` with **1-indexed** layer ids, `first_k_dense_replace`,
//!   `num_experts`, `num_experts_per_token`, …;
//! - what transformers 5.24 writes: `layer_types`, `mlp_layer_types`, `linear_head_dim`, … and the
//!   aliases `num_local_experts`, `num_experts_per_tok`, ….
//!
//! Precedence, checked against `KimiLinearConfig.__post_init__` and its `attribute_map`:
//! - an explicit `layer_types` wins over `linear_attn_config.{kda_layers, full_attn_layers}`, which
//!   are used only when **both** lists are present; with neither, MLA sits at 0-indexed `i > 0, i % 4 == 0`;
//! - `linear_attn_config.{head_dim, num_heads, short_conv_kernel_size}` win over `linear_head_dim`,
//!   `linear_num_heads`, `linear_conv_kernel_dim`;
//! - an explicit `mlp_layer_types` wins over `first_k_dense_replace` (default 1);
//! - a Moonshot name wins over its transformers alias (`num_experts` over `num_local_experts`, …).
//!
//! Fields we know and do not use are accepted silently, unknown fields produce a warning, invalid
//! values an error naming the field and what is allowed.

use std::collections::BTreeSet;

use serde_json::{json, Map, Value};

use crate::{
    field_err, Activation, Error, FfnKind, KdaConfig, KdaDecay, KdaOutGate, KimiConfig, LatentMoe, LayerKind, Mixer,
    MlaConfig, ModelConfig, MoeConfig, Parsed, Result,
};

/// Fields present in real checkpoints that no K3-Mini model reads. Accepted silently.
const KNOWN_IGNORED: &[&str] = &[
    "transformers_version",
    "torch_dtype",
    "dtype",
    "auto_map",
    "use_cache",
    "head_dim",
    "qk_head_dim",
    "initializer_range",
    "pretraining_tp",
    "output_router_logits",
    "attention_dropout",
    "use_grouped_topk",
    "moe_layer_freq",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "num_nextn_predict_layers",
    "architectures",
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
    "model_type",
    "topk_method",
    "tie_word_embeddings",
    "text_config",
    "mla_use_nope",
    "moe_router_activation_func",
    "num_key_value_heads",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "k3mini",
];

/// A reader over a JSON object that remembers which keys were consumed.
pub(crate) struct Reader<'a> {
    map: &'a Map<String, Value>,
    prefix: &'static str,
    used: BTreeSet<String>,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(map: &'a Map<String, Value>, prefix: &'static str) -> Self {
        Self { map, prefix, used: BTreeSet::new() }
    }

    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The value at `key`, treating JSON `null` as absent.
    pub(crate) fn get(&mut self, key: &str) -> Option<&'a Value> {
        self.used.insert(key.to_string());
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn has(&self, key: &str) -> bool {
        self.map.get(key).is_some_and(|v| !v.is_null())
    }

    pub(crate) fn usize_opt(&mut self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n as usize)),
                None => field_err(self.name(key), format!("expected a non-negative integer, got {v}")),
            },
        }
    }

    pub(crate) fn usize_req(&mut self, key: &str) -> Result<usize> {
        self.usize_opt(key)?.ok_or_else(|| Error::Missing(self.name(key)))
    }

    pub(crate) fn usize_or(&mut self, key: &str, default: usize) -> Result<usize> {
        Ok(self.usize_opt(key)?.unwrap_or(default))
    }

    pub(crate) fn f64_opt(&mut self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) => Ok(Some(x)),
                None => field_err(self.name(key), format!("expected a number, got {v}")),
            },
        }
    }

    pub(crate) fn f64_or(&mut self, key: &str, default: f64) -> Result<f64> {
        Ok(self.f64_opt(key)?.unwrap_or(default))
    }

    pub(crate) fn bool_or(&mut self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => field_err(self.name(key), format!("expected true or false, got {v}")),
        }
    }

    pub(crate) fn str_opt(&mut self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(v) => field_err(self.name(key), format!("expected a string, got {v}")),
        }
    }

    /// First of `keys` that is present wins (Moonshot name first, then transformers' alias).
    pub(crate) fn alias_usize(&mut self, keys: &[&str], default: usize) -> Result<usize> {
        let mut out = None;
        for k in keys {
            let v = self.usize_opt(k)?;
            out = out.or(v);
        }
        Ok(out.unwrap_or(default))
    }

    pub(crate) fn token_ids(&mut self, key: &str) -> Result<Vec<u32>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32).ok_or(()))
                .collect::<std::result::Result<Vec<_>, _>>()
                .or_else(|_| field_err(self.name(key), "expected an integer or a list of integers")),
            Some(v) => match v.as_u64() {
                Some(x) => Ok(vec![x as u32]),
                None => field_err(self.name(key), format!("expected an integer, got {v}")),
            },
        }
    }

    /// Keys never consumed and not in `ignored`: these get a warning each.
    pub(crate) fn unknown(&self, ignored: &[&str]) -> Vec<String> {
        self.map
            .keys()
            .filter(|k| !self.used.contains(*k) && !ignored.contains(&k.as_str()))
            .map(|k| self.name(k))
            .collect()
    }
}

/// Parse any supported `config.json` text.
pub fn parse_config(text: &str) -> Result<Parsed<ModelConfig>> {
    let value: Value = serde_json::from_str(text)?;
    let Value::Object(mut map) = value else {
        return Err(Error::Invalid("config.json must hold a JSON object".into()));
    };
    // A full K3 checkpoint nests the language model in `text_config` (as llama.cpp does, the
    // nested fields override the top level).
    if let Some(Value::Object(tc)) = map.get("text_config").cloned() {
        for (k, v) in tc {
            map.insert(k, v);
        }
    }
    let model_type = map.get("model_type").and_then(Value::as_str).unwrap_or("");
    match model_type {
        "kimi_linear" | "kimi_k3" => {
            let p = parse_kimi(&map)?;
            Ok(Parsed { config: ModelConfig::Kimi(p.config), warnings: p.warnings })
        }
        "llama" => {
            let p = crate::llama::parse_llama(&map)?;
            Ok(Parsed { config: ModelConfig::Llama(p.config), warnings: p.warnings })
        }
        "" => Err(Error::Missing("model_type (one of \"kimi_linear\", \"llama\")".into())),
        other => field_err("model_type", format!("unsupported `{other}`; allowed: \"kimi_linear\", \"llama\"")),
    }
}

/// Parse a `kimi_linear` config object.
pub fn parse_kimi(map: &Map<String, Value>) -> Result<Parsed<KimiConfig>> {
    let mut r = Reader::new(map, "");
    let mut warnings = Vec::new();

    let vocab_size = r.usize_req("vocab_size")?;
    let hidden_size = r.usize_req("hidden_size")?;
    let n_layers = r.usize_req("num_hidden_layers")?;
    let num_heads = r.usize_req("num_attention_heads")?;
    if let Some(kv) = r.usize_opt("num_key_value_heads")? {
        if kv != num_heads {
            return field_err(
                "num_key_value_heads",
                format!("must equal num_attention_heads ({num_heads}) for Kimi MLA, got {kv}"),
            );
        }
    }

    // ---- linear_attn_config (Moonshot) with transformers' flat fallbacks ----
    let empty = Map::new();
    let lac_map = match r.get("linear_attn_config") {
        None => &empty,
        Some(Value::Object(m)) => m,
        Some(v) => return field_err("linear_attn_config", format!("expected an object, got {v}")),
    };
    let mut lac = Reader::new(lac_map, "linear_attn_config.");
    let flat_hd = r.usize_opt("linear_head_dim")?;
    let flat_nh = r.usize_opt("linear_num_heads")?;
    let flat_ck = r.usize_opt("linear_conv_kernel_dim")?;
    let kda_head_dim = lac.usize_opt("head_dim")?.or(flat_hd).unwrap_or(128);
    let kda_heads = lac.usize_opt("num_heads")?.or(flat_nh).unwrap_or(32);
    let conv_kernel = lac.usize_opt("short_conv_kernel_size")?.or(flat_ck).unwrap_or(4);
    let decay = match lac.f64_opt("gate_lower_bound")? {
        Some(lb) => KdaDecay::LowerBound(lb as f32),
        None => KdaDecay::Softplus,
    };
    let out_gate = if lac.bool_or("use_full_rank_gate", false)? { KdaOutGate::FullRank } else { KdaOutGate::LowRank };
    let mixers = resolve_mixers(&mut r, &mut lac, n_layers, &mut warnings)?;
    warnings.extend(lac.unknown(&["safe_gate"]).into_iter().map(|k| format!("unknown config field `{k}` ignored")));

    // ---- FFN kinds ----
    let ffns = resolve_ffns(&mut r, n_layers, &mut warnings)?;
    let layers: Vec<LayerKind> = mixers.into_iter().zip(ffns).map(|(mixer, ffn)| LayerKind { mixer, ffn }).collect();

    // ---- MLA ----
    if map.get("mla_use_nope").and_then(Value::as_bool) == Some(false) {
        return field_err("mla_use_nope", "only NoPE MLA (true) is supported, as in every Kimi checkpoint");
    }
    let mla = MlaConfig {
        num_heads,
        q_lora_rank: r.usize_opt("q_lora_rank")?,
        kv_lora_rank: r.usize_or("kv_lora_rank", 512)?,
        qk_nope_head_dim: r.usize_or("qk_nope_head_dim", 128)?,
        qk_rope_head_dim: r.usize_or("qk_rope_head_dim", 64)?,
        v_head_dim: r.usize_or("v_head_dim", 128)?,
        output_gate: r.bool_or("mla_use_output_gate", false)?,
        attention_bias: r.bool_or("attention_bias", false)?,
    };

    // ---- MoE (Moonshot names win over transformers' aliases) ----
    if let Some(f) = map.get("moe_router_activation_func").and_then(Value::as_str) {
        if f != "sigmoid" {
            return field_err("moe_router_activation_func", format!("only \"sigmoid\" is supported, got \"{f}\""));
        }
    }
    let latent = match r.usize_opt("routed_expert_hidden_size")? {
        Some(dim) => Some(LatentMoe { dim, use_norm: r.bool_or("latent_moe_use_norm", true)? }),
        None => {
            r.get("latent_moe_use_norm");
            None
        }
    };
    let renormalize = match r.get("moe_renormalize").or_else(|| map.get("norm_topk_prob").filter(|v| !v.is_null())) {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return field_err("moe_renormalize", format!("expected true or false, got {v}")),
    };
    r.get("norm_topk_prob");
    let moe = MoeConfig {
        num_experts: r.alias_usize(&["num_experts", "num_local_experts"], 256)?,
        top_k: r.alias_usize(&["num_experts_per_token", "num_experts_per_tok"], 8)?,
        num_shared_experts: r.alias_usize(&["num_shared_experts", "n_shared_experts"], 1)?,
        intermediate_size: r.usize_or("moe_intermediate_size", 1024)?,
        routed_scaling_factor: r.f64_or("routed_scaling_factor", 2.446)?,
        renormalize,
        num_expert_group: r.alias_usize(&["num_expert_group", "n_group"], 1)?,
        topk_group: r.usize_or("topk_group", 1)?,
        latent,
    };

    // ---- activation ----
    let activation = match r.str_opt("hidden_act")?.unwrap_or("silu") {
        "silu" | "swish" => Activation::Silu,
        "situ" => Activation::Situ {
            beta: r.f64_or("activation_situ_beta", 4.0)? as f32,
            linear_beta: r.f64_or("activation_situ_linear_beta", 25.0)? as f32,
        },
        other => return field_err("hidden_act", format!("unsupported \"{other}\"; allowed: \"silu\", \"situ\"")),
    };
    if activation == Activation::Silu {
        for k in ["activation_situ_beta", "activation_situ_linear_beta"] {
            if r.get(k).is_some() {
                warnings.push(format!("`{k}` is ignored because hidden_act is \"silu\""));
            }
        }
    }

    let attn_res_block_size = r.usize_opt("attn_res_block_size")?.filter(|&b| b > 0);
    let max_pos = r.alias_usize(&["model_max_length", "max_position_embeddings"], 1_048_576)?;
    let cfg = KimiConfig {
        vocab_size,
        hidden_size,
        intermediate_size: r.usize_or("intermediate_size", 9216)?,
        layers,
        rms_norm_eps: r.f64_or("rms_norm_eps", 1e-5)?,
        kda: KdaConfig { num_heads: kda_heads, head_dim: kda_head_dim, conv_kernel, decay, out_gate },
        mla,
        moe,
        activation,
        attn_res_block_size,
        max_position_embeddings: max_pos,
        bos_token_id: special_id(&mut r, "bos_token_id", 163_584, vocab_size, &mut warnings)?,
        eos_token_id: {
            let ids = r.token_ids("eos_token_id")?;
            if map.contains_key("eos_token_id") {
                ids
            } else {
                special_id(&mut r, "eos_token_id", 163_586, vocab_size, &mut warnings)?.into_iter().collect()
            }
        },
        pad_token_id: special_id(&mut r, "pad_token_id", 163_839, vocab_size, &mut warnings)?,
    };
    if map.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true) {
        warnings.push(
            "tie_word_embeddings is true, but Kimi models never tie (transformers ignores it too): \
             lm_head.weight is read and written as its own tensor"
                .into(),
        );
    }
    if map.contains_key("quantization_config") {
        return field_err("quantization_config", "quantized HF checkpoints are not supported; give an f32/bf16 one");
    }
    warnings.extend(r.unknown(KNOWN_IGNORED).into_iter().map(|k| format!("unknown config field `{k}` ignored")));
    cfg.validate()?;
    Ok(Parsed { config: cfg, warnings })
}

/// transformers' defaults for special ids are Kimi tokenizer ids; warn when they cannot fit.
fn special_id(
    r: &mut Reader,
    key: &str,
    default: u32,
    vocab: usize,
    warnings: &mut Vec<String>,
) -> Result<Option<u32>> {
    if r.has(key) {
        return Ok(r.token_ids(key)?.first().copied());
    }
    if r.map.contains_key(key) {
        return Ok(None); // explicit null
    }
    if default as usize >= vocab {
        warnings.push(format!(
            "`{key}` is missing; transformers would default it to Kimi's {default}, outside vocab_size {vocab}: set it explicitly"
        ));
        return Ok(None);
    }
    Ok(Some(default))
}

fn resolve_mixers(r: &mut Reader, lac: &mut Reader, n: usize, warnings: &mut Vec<String>) -> Result<Vec<Mixer>> {
    let full = lac.get("full_attn_layers");
    let kda = lac.get("kda_layers");
    let from_lists = match (full, kda) {
        (Some(f), Some(k)) => Some(mixers_from_lists(f, k, n)?),
        (None, None) => None,
        _ => {
            warnings.push(
                "linear_attn_config has only one of full_attn_layers / kda_layers: transformers then ignores it \
                 and uses its default pattern (llama.cpp would not); write both lists"
                    .into(),
            );
            None
        }
    };
    if let Some(v) = r.get("layer_types") {
        let list = v.as_array().ok_or(()).or_else(|_| field_err("layer_types", "expected a list of strings"))?;
        if list.len() != n {
            return field_err("layer_types", format!("has {} entries but num_hidden_layers is {n}", list.len()));
        }
        let mixers = list
            .iter()
            .map(|s| match s.as_str() {
                Some("linear_attention") => Ok(Mixer::Kda),
                Some("full_attention") => Ok(Mixer::Mla),
                _ => field_err(
                    "layer_types",
                    format!("entry {s} not allowed; allowed: \"linear_attention\", \"full_attention\""),
                ),
            })
            .collect::<Result<Vec<_>>>()?;
        if from_lists.as_ref().is_some_and(|l| *l != mixers) {
            warnings.push("layer_types and linear_attn_config disagree; layer_types wins (as in transformers)".into());
        }
        return Ok(mixers);
    }
    Ok(from_lists.unwrap_or_else(|| {
        if n > 1 {
            warnings.push(
                "no layer_types or linear_attn_config layer lists: using transformers' default (MLA at 0-indexed \
                 i > 0, i % 4 == 0), which is not Kimi's layout"
                    .into(),
            );
        }
        (0..n).map(|i| if i > 0 && i % 4 == 0 { Mixer::Mla } else { Mixer::Kda }).collect()
    }))
}

fn mixers_from_lists(full: &Value, kda: &Value, n: usize) -> Result<Vec<Mixer>> {
    let ids = |v: &Value, name: &str| -> Result<Vec<usize>> {
        let field = format!("linear_attn_config.{name}");
        let a = v.as_array().ok_or(()).or_else(|_| field_err(&field, "expected a list of 1-indexed layer ids"))?;
        a.iter()
            .map(|x| match x.as_u64() {
                Some(i) if i >= 1 && (i as usize) <= n => Ok(i as usize - 1),
                _ => field_err(&field, format!("entry {x} is not a 1-indexed layer id in 1..={n}")),
            })
            .collect()
    };
    let mut out: Vec<Option<Mixer>> = vec![None; n];
    for (list, kind, name) in [
        (ids(full, "full_attn_layers")?, Mixer::Mla, "full_attn_layers"),
        (ids(kda, "kda_layers")?, Mixer::Kda, "kda_layers"),
    ] {
        for i in list {
            if out[i].is_some_and(|m| m != kind) {
                return field_err(
                    format!("linear_attn_config.{name}"),
                    format!("layer {} is listed in both full_attn_layers and kda_layers", i + 1),
                );
            }
            out[i] = Some(kind);
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, m)| {
            m.ok_or(()).or_else(|_| {
                field_err(
                    "linear_attn_config",
                    format!("layer {} (1-indexed) is in neither full_attn_layers nor kda_layers; every layer must be listed", i + 1),
                )
            })
        })
        .collect()
}

fn resolve_ffns(r: &mut Reader, n: usize, warnings: &mut Vec<String>) -> Result<Vec<FfnKind>> {
    let k = r.usize_opt("first_k_dense_replace")?;
    let from_k = |k: usize| (0..n).map(|i| if i < k { FfnKind::Dense } else { FfnKind::Moe }).collect::<Vec<_>>();
    if let Some(v) = r.get("mlp_layer_types") {
        let list = v.as_array().ok_or(()).or_else(|_| field_err("mlp_layer_types", "expected a list of strings"))?;
        if list.len() != n {
            return field_err("mlp_layer_types", format!("has {} entries but num_hidden_layers is {n}", list.len()));
        }
        let ffns = list
            .iter()
            .map(|s| match s.as_str() {
                Some("dense") => Ok(FfnKind::Dense),
                Some("sparse") => Ok(FfnKind::Moe),
                _ => field_err("mlp_layer_types", format!("entry {s} not allowed; allowed: \"dense\", \"sparse\"")),
            })
            .collect::<Result<Vec<_>>>()?;
        if k.is_some_and(|k| from_k(k) != ffns) {
            warnings.push(
                "mlp_layer_types and first_k_dense_replace disagree; mlp_layer_types wins (as in transformers)".into(),
            );
        }
        return Ok(ffns);
    }
    Ok(from_k(k.unwrap_or(1)))
}

/// Write a Kimi config in Moonshot's field names (plus transformers' lists, which agree with them),
/// so it loads in transformers and in both llama.cpp converters.
pub fn kimi_to_json(c: &KimiConfig) -> Value {
    let one_indexed = |m: Mixer| -> Vec<usize> {
        c.layers.iter().enumerate().filter(|(_, l)| l.mixer == m).map(|(i, _)| i + 1).collect()
    };
    let k3 = c.profile() == crate::Profile::K3;
    let mut lac = json!({
        "head_dim": c.kda.head_dim,
        "num_heads": c.kda.num_heads,
        "short_conv_kernel_size": c.kda.conv_kernel,
        "full_attn_layers": one_indexed(Mixer::Mla),
        "kda_layers": one_indexed(Mixer::Kda),
    });
    if let KdaDecay::LowerBound(lb) = c.kda.decay {
        lac["gate_lower_bound"] = json!(lb);
    }
    if c.kda.out_gate == KdaOutGate::FullRank {
        lac["use_full_rank_gate"] = json!(true);
    }
    let arch = if k3 { "KimiK3ForConditionalGeneration" } else { "KimiLinearForCausalLM" };
    let mut m = Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("architectures", json!([arch]));
    put("model_type", json!("kimi_linear"));
    put("vocab_size", json!(c.vocab_size));
    put("hidden_size", json!(c.hidden_size));
    put("intermediate_size", json!(c.intermediate_size));
    put("num_hidden_layers", json!(c.layers.len()));
    put("num_attention_heads", json!(c.mla.num_heads));
    put("num_key_value_heads", json!(c.mla.num_heads));
    put(
        "hidden_act",
        json!(match c.activation {
            Activation::Silu => "silu",
            Activation::Situ { .. } => "situ",
        }),
    );
    if let Activation::Situ { beta, linear_beta } = c.activation {
        put("activation_situ_beta", json!(beta));
        put("activation_situ_linear_beta", json!(linear_beta));
    }
    put("rms_norm_eps", json!(c.rms_norm_eps));
    put("model_max_length", json!(c.max_position_embeddings));
    put("tie_word_embeddings", json!(false));
    put("q_lora_rank", json!(c.mla.q_lora_rank));
    put("kv_lora_rank", json!(c.mla.kv_lora_rank));
    put("qk_nope_head_dim", json!(c.mla.qk_nope_head_dim));
    put("qk_rope_head_dim", json!(c.mla.qk_rope_head_dim));
    put("v_head_dim", json!(c.mla.v_head_dim));
    put("mla_use_nope", json!(true));
    if c.mla.output_gate {
        put("mla_use_output_gate", json!(true));
    }
    put("attention_bias", json!(c.mla.attention_bias));
    put("num_experts", json!(c.moe.num_experts));
    put("num_experts_per_token", json!(c.moe.top_k));
    put("num_shared_experts", json!(c.moe.num_shared_experts));
    put("moe_intermediate_size", json!(c.moe.intermediate_size));
    put("moe_router_activation_func", json!("sigmoid"));
    put("moe_renormalize", json!(c.moe.renormalize));
    put("routed_scaling_factor", json!(c.moe.routed_scaling_factor));
    put("use_grouped_topk", json!(true));
    put("num_expert_group", json!(c.moe.num_expert_group));
    put("topk_group", json!(c.moe.topk_group));
    if let Some(l) = c.moe.latent {
        put("routed_expert_hidden_size", json!(l.dim));
        put("latent_moe_use_norm", json!(l.use_norm));
    }
    put("first_k_dense_replace", json!(c.first_k_dense()));
    put("moe_layer_freq", json!(1));
    if let Some(b) = c.attn_res_block_size {
        put("attn_res_block_size", json!(b));
    }
    put("linear_attn_config", lac);
    let lt: Vec<&str> =
        c.layers.iter().map(|l| if l.mixer == Mixer::Mla { "full_attention" } else { "linear_attention" }).collect();
    let mt: Vec<&str> = c.layers.iter().map(|l| if l.ffn == FfnKind::Moe { "sparse" } else { "dense" }).collect();
    put("layer_types", json!(lt));
    put("mlp_layer_types", json!(mt));
    put("bos_token_id", json!(c.bos_token_id));
    put("eos_token_id", if c.eos_token_id.len() == 1 { json!(c.eos_token_id[0]) } else { json!(c.eos_token_id) });
    put("pad_token_id", json!(c.pad_token_id));
    put("torch_dtype", json!("float32"));
    Value::Object(m)
}

/// Serialize any config to pretty `config.json` text.
pub fn to_json_string(c: &ModelConfig) -> String {
    let v = match c {
        ModelConfig::Kimi(k) => kimi_to_json(k),
        ModelConfig::Llama(l) => crate::llama::llama_to_json(l),
    };
    // serde_json cannot fail on a Value built from plain data.
    serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
}
