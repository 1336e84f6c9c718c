//! `k3mini routing-stats` on a MoE checkpoint this code has never seen: a random kimi_linear
//! model made by transformers (fresh seed each run), with a character-level tokenizer.json beside
//! it, as a new user would bring their own checkpoint and text.

mod common;

use std::process::Command;

use common::*;

/// A WordLevel tokenizer over printable ASCII, newline and tab (98 ids), in HF tokenizer.json form.
fn char_tokenizer() -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    for c in (32u8..127).map(|b| b as char).chain(['\n', '\t']) {
        let id = vocab.len();
        vocab.insert(c.to_string(), id.into());
    }
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": false},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
}

#[test]
fn routing_stats_on_an_unseen_transformers_moe_checkpoint() {
    let Some(py) = python() else { return };
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs() % 100_000;
    let d = scratch("routing");
    run(Command::new(&py).arg(tool("random_kimi.py")).arg(&d).arg(seed.to_string()).arg("moe"));
    let model = d.join("model");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).expect("config")).expect("json");
    // random_kimi.py draws vocabularies of 100..400, above the character tokenizer's 98 ids.
    assert!(cfg["vocab_size"].as_u64().expect("vocab") >= 98, "seed {seed}");
    std::fs::write(model.join("tokenizer.json"), char_tokenizer().to_string()).expect("tokenizer");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = d.join("stats");
    let text = run(k3mini()
        .args(["routing-stats", "--model"])
        .arg(&model)
        .args([
            "--data",
            &format!("code={}", root.join("crates/k3-infer/src").display()),
            "--data",
            &format!("english={}", root.join("docs").display()),
            "--windows",
            "6",
            "--context",
            "64",
            "--target",
            "code",
            "--out",
        ])
        .arg(&out));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("routing.json")).expect("routing.json")).expect("json");
    let layers = cfg["num_hidden_layers"].as_u64().expect("layers") as usize;
    let types = cfg["mlp_layer_types"].as_array().expect("mlp_layer_types");
    let sparse: Vec<usize> = (0..layers).filter(|&i| types[i] == "sparse").collect();
    assert_eq!(report["moe_layers"], sparse.len(), "{text}");
    let figs = report["figures"].as_array().expect("figures");
    assert_eq!(figs.len(), 2 * sparse.len(), "one entry per MoE layer and domain");
    let e = cfg["num_local_experts"].as_u64().or(cfg["num_experts"].as_u64()).expect("experts") as f64;
    let k = cfg["num_experts_per_tok"].as_u64().or(cfg["num_experts_per_token"].as_u64()).expect("top-k") as f64;
    for f in figs {
        assert_eq!(f["tokens"], 6 * 64);
        // Every token chooses k experts: the frequencies sum to k, the uniform baseline is k/E.
        let freq: f64 = f["frequency"].as_array().expect("freq").iter().map(|x| x.as_f64().expect("f")).sum();
        assert!((freq - k).abs() < 1e-9, "{f}");
        assert!((f["frequency_uniform"].as_f64().expect("u") - k / e).abs() < 1e-12);
        // Every figure stands beside its baseline.
        for key in ["load_entropy", "router_entropy", "experts_for_90pct_gate", "max_load_ratio", "per_token_k90"] {
            assert!(f[key]["uniform"].is_number(), "{key} has no baseline: {f}");
        }
        assert!((f["router_entropy"]["uniform"].as_f64().expect("h") - e.ln()).abs() < 1e-12);
        let h = f["router_entropy"]["value"].as_f64().expect("h");
        assert!(h > 0.0 && h <= e.ln() + 1e-9, "a router entropy is within [0, ln E]: {h}");
    }
    assert_eq!(report["specialisation"].as_array().expect("spec").len(), sparse.len());
    let rec = &report["recommendation"];
    assert_eq!(rec["dense"].as_array().expect("dense").len(), layers);
    for i in 0..layers {
        if types[i] == "dense" {
            assert_eq!(rec["dense"][i], true, "a dense teacher layer stays dense");
        }
    }
    for p in report["plots"].as_array().expect("plots") {
        let bytes = std::fs::read(out.join(p.as_str().expect("name"))).expect("plot");
        assert_eq!(&bytes[1..4], b"PNG");
    }
    assert!(out.join("recommendation.json").exists());
    // The recommendation read back as a student's plan: the same model compared against it.
    let text = run(k3mini()
        .args(["routing-stats", "--model"])
        .arg(&model)
        .args([
            "--data",
            &format!("code={}", root.join("crates/k3-infer/src").display()),
            "--windows",
            "2",
            "--context",
            "32",
            "--target",
            "code",
            "--compare",
        ])
        .arg(out.join("recommendation.json"))
        .arg("--out")
        .arg(d.join("cmp")));
    assert!(text.contains("student vs recommendation"), "{text}");
    // Bad input: a domain path that does not exist is named.
    let bad = k3mini()
        .args(["routing-stats", "--model"])
        .arg(&model)
        .args(["--data", "code=/nonexistent", "--out"])
        .arg(d.join("x"))
        .output()
        .expect("spawn");
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no such file"), "{}", String::from_utf8_lossy(&bad.stderr));
}
