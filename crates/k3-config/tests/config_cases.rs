//! Config parsing against what transformers 5.24's `KimiLinearConfig` makes of the same JSON
//! (tests/golden/config_cases.json, written by tools/reference/make_golden.py).

use k3_config::{hf, Activation, FfnKind, KdaDecay, KdaOutGate, Mixer, ModelConfig, Profile};
use serde_json::Value;

fn cases() -> serde_json::Map<String, Value> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/golden/config_cases.json");
    let text = std::fs::read_to_string(path).expect("tests/golden/config_cases.json (run scripts/golden)");
    match serde_json::from_str(&text).expect("json") {
        Value::Object(m) => m,
        _ => panic!("config_cases.json must be an object"),
    }
}

fn as_usize(v: &Value) -> usize {
    v.as_u64().expect("integer") as usize
}

#[test]
fn every_case_matches_transformers() {
    let cases = cases();
    assert!(cases.len() >= 10);
    for (name, case) in &cases {
        let input = serde_json::to_string(&case["input"]).expect("json");
        let ours = hf::parse_config(&input);
        if let Some(err) = case.get("error") {
            let e = ours.err().unwrap_or_else(|| panic!("{name}: transformers raised `{err}`, we accepted it"));
            let msg = e.to_string();
            assert!(msg.contains("layer_types") || msg.contains("linear_attn_config"), "{name}: {msg}");
            continue;
        }
        let parsed = ours.unwrap_or_else(|e| panic!("{name}: transformers accepted it, we refused: {e}"));
        let ModelConfig::Kimi(c) = parsed.config else { panic!("{name}: not a Kimi config") };
        let r = &case["resolved"];
        let lt: Vec<Mixer> = r["layer_types"]
            .as_array()
            .expect("list")
            .iter()
            .map(|s| if s == "full_attention" { Mixer::Mla } else { Mixer::Kda })
            .collect();
        let mt: Vec<FfnKind> = r["mlp_layer_types"]
            .as_array()
            .expect("list")
            .iter()
            .map(|s| if s == "sparse" { FfnKind::Moe } else { FfnKind::Dense })
            .collect();
        assert_eq!(c.layers.iter().map(|l| l.mixer).collect::<Vec<_>>(), lt, "{name}: layer_types");
        assert_eq!(c.layers.iter().map(|l| l.ffn).collect::<Vec<_>>(), mt, "{name}: mlp_layer_types");
        let checks = [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("num_attention_heads", c.mla.num_heads),
            ("linear_head_dim", c.kda.head_dim),
            ("linear_num_heads", c.kda.num_heads),
            ("linear_conv_kernel_dim", c.kda.conv_kernel),
            ("num_local_experts", c.moe.num_experts),
            ("num_experts_per_tok", c.moe.top_k),
            ("n_shared_experts", c.moe.num_shared_experts),
            ("n_group", c.moe.num_expert_group),
            ("topk_group", c.moe.topk_group),
            ("max_position_embeddings", c.max_position_embeddings),
            ("moe_intermediate_size", c.moe.intermediate_size),
            ("intermediate_size", c.intermediate_size),
            ("kv_lora_rank", c.mla.kv_lora_rank),
            ("qk_nope_head_dim", c.mla.qk_nope_head_dim),
            ("qk_rope_head_dim", c.mla.qk_rope_head_dim),
            ("v_head_dim", c.mla.v_head_dim),
        ];
        for (k, ours) in checks {
            assert_eq!(ours, as_usize(&r[k]), "{name}: {k}");
        }
        assert_eq!(c.moe.renormalize, r["norm_topk_prob"].as_bool().expect("bool"), "{name}: norm_topk_prob");
        assert_eq!(c.mla.attention_bias, r["attention_bias"].as_bool().expect("bool"), "{name}: attention_bias");
        assert_eq!(c.mla.q_lora_rank, r["q_lora_rank"].as_u64().map(|x| x as usize), "{name}: q_lora_rank");
        assert!((c.moe.routed_scaling_factor - r["routed_scaling_factor"].as_f64().expect("f64")).abs() < 1e-12);
        assert!((c.rms_norm_eps - r["rms_norm_eps"].as_f64().expect("f64")).abs() < 1e-15);

        // What transformers does not model, we check by name.
        match name.as_str() {
            "k3_fields" => {
                assert_eq!(c.profile(), Profile::K3);
                assert_eq!(c.kda.decay, KdaDecay::LowerBound(-5.0));
                assert_eq!(c.kda.out_gate, KdaOutGate::FullRank);
                assert!(c.mla.output_gate);
                assert_eq!(c.attn_res_block_size, Some(2));
                assert_eq!(c.activation, Activation::Situ { beta: 4.0, linear_beta: 25.0 });
                assert_eq!(c.moe.latent.map(|l| l.dim), Some(48));
            }
            "unknown_field" => {
                assert!(parsed.warnings.iter().any(|w| w.contains("my_custom_field")), "{:?}", parsed.warnings);
            }
            "moonshot" | "transformers" | "both" => {
                // Known-but-unused fields (head_dim, auto_map, torch_dtype, qk_head_dim, …) are silent.
                assert!(parsed.warnings.iter().all(|w| !w.contains("unknown")), "{name}: {:?}", parsed.warnings);
                assert_eq!(c.profile(), Profile::KimiLinear);
            }
            "only_full_attn_layers" | "no_layer_lists" => {
                assert!(!parsed.warnings.is_empty(), "{name}: the default-pattern fallback must warn");
            }
            _ => {}
        }
    }
}

#[test]
fn write_then_read_is_identity_and_transformers_compatible() {
    for name in ["tiny", "tiny-k3", "tiny-kda", "small", "bench-370m", "bench-moe", "3b", "tiny-llama"] {
        let cfg = k3_config::presets::preset(name, None).expect("preset");
        let text = hf::to_json_string(&cfg);
        let back = hf::parse_config(&text).expect("re-parse");
        assert_eq!(back.config, cfg, "{name}");
        assert!(back.warnings.is_empty(), "{name}: {:?}", back.warnings);
        // Moonshot fields are always written (llama.cpp's converters need them).
        if let ModelConfig::Kimi(_) = cfg {
            let v: Value = serde_json::from_str(&text).expect("json");
            for k in ["linear_attn_config", "first_k_dense_replace", "moe_intermediate_size", "num_shared_experts"] {
                assert!(v.get(k).is_some(), "{name}: {k} missing");
            }
        }
    }
}

#[test]
fn invalid_values_name_the_field_and_the_allowed_values() {
    let base = r#""model_type":"kimi_linear","vocab_size":64,"hidden_size":32,"num_hidden_layers":2,"num_attention_heads":2,"layer_types":["linear_attention","full_attention"]"#;
    let cases = [
        (r#""hidden_act":"gelu""#, "hidden_act", "\"silu\", \"situ\""),
        (r#""layer_types":["linear_attention","sliding_attention"]"#, "layer_types", "\"full_attention\""),
        (r#""num_key_value_heads":1"#, "num_key_value_heads", "must equal"),
        (
            r#""mlp_layer_types":["dense","sparse"],"num_experts":4,"num_experts_per_token":9"#,
            "num_experts_per_token",
            "1..=4",
        ),
        (
            r#""mlp_layer_types":["dense","sparse"],"num_experts":6,"num_experts_per_token":2,"num_expert_group":4"#,
            "num_expert_group",
            "divide",
        ),
        (r#""vocab_size":"big""#, "vocab_size", "integer"),
        (r#""linear_attn_config":{"gate_lower_bound":1.0}"#, "gate_lower_bound", "< 0"),
    ];
    for (extra, field, allowed) in cases {
        let text = format!("{{{base},{extra}}}")
            .replace(r#""vocab_size":64,"#, if extra.contains("vocab_size") { "" } else { r#""vocab_size":64,"# });
        let err = hf::parse_config(&text).err().unwrap_or_else(|| panic!("{extra}: accepted")).to_string();
        assert!(err.contains(field) && err.contains(allowed), "{extra}: {err}");
    }
    let missing = r#"{"model_type":"kimi_linear","hidden_size":32,"num_hidden_layers":2,"num_attention_heads":2}"#;
    let err = hf::parse_config(missing).expect_err("missing vocab").to_string();
    assert!(err.contains("vocab_size"), "{err}");
    let err = hf::parse_config(r#"{"model_type":"gpt2"}"#).expect_err("bad type").to_string();
    assert!(err.contains("model_type") && err.contains("kimi_linear"), "{err}");
}
