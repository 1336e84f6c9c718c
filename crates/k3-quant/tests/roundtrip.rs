//! Checkpoint → GGUF → engine: the exported GGUF reproduces the checkpoint's config and logits
//! (f32 exactly up to the −exp(A_log) round trip; f16 and q8_0 within their precision), refuses
//! what llama.cpp cannot load, and reports block-size fallbacks.

use std::path::{Path, PathBuf};

use k3_format::gguf::GgufFile;
use k3_format::gguf_map::config_from_gguf;
use k3_infer::{Logits, Model};
use k3_quant::{export_gguf, QuantType};

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(name)
}

/// A scratch directory, removed when dropped.
fn scratch(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("k3q-{tag}-")).tempdir().expect("scratch dir")
}

fn logits(path: &Path, ids: &[u32]) -> Vec<f32> {
    let (m, _) = Model::load(path).expect("load");
    let mut st = m.new_state();
    m.forward(ids, &mut st, Logits::All).expect("forward")
}

fn top1_agreement(a: &[f32], b: &[f32], v: usize) -> f64 {
    let argmax = |x: &[f32]| x.iter().enumerate().max_by(|p, q| p.1.total_cmp(q.1)).map(|(i, _)| i);
    let n = a.len() / v;
    (0..n).filter(|&r| argmax(&a[r * v..(r + 1) * v]) == argmax(&b[r * v..(r + 1) * v])).count() as f64 / n as f64
}

/// An all-dense model's MoE fields are never read (GGUF only stores the ones llama.cpp requires).
fn without_unused_moe(c: k3_config::ModelConfig) -> k3_config::ModelConfig {
    match c {
        k3_config::ModelConfig::Kimi(mut k) if !k.has_moe() => {
            k.moe.num_experts = 0;
            k.moe.top_k = 0;
            k3_config::ModelConfig::Kimi(k)
        }
        other => other,
    }
}

fn median_abs(a: &[f32], b: &[f32]) -> f32 {
    let mut d: Vec<f32> = a.iter().zip(b).map(|(x, y)| (x - y).abs()).collect();
    d.sort_by(f32::total_cmp);
    d[d.len() / 2]
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn gguf_export_reproduces_config_and_logits() {
    let ids: Vec<u32> = (0..70u32).map(|i| (i * 37 + 11) % 250 + 3).collect();
    for dir in ["tiny_kimi_linear_dense", "tiny_kimi_linear_moe", "tiny_k3"] {
        let ck = golden(dir);
        let want = logits(&ck, &ids);
        let v = want.len() / ids.len();
        let tmp = scratch(dir);
        let d = tmp.path();
        // These fixtures have O(1) random weights that amplify rounding, and MoE routing flips on
        // a near-tie move single tokens a lot: f32 is checked by max |Δ|, f16 by the median |Δ|
        // and top-1 agreement; quantized storage is checked tensor by tensor below.
        for (qt, tol, agree) in [(QuantType::F32, 1e-4, 1.0), (QuantType::F16, 5e-3, 0.95)] {
            let out = d.join(format!("{qt:?}.gguf"));
            let r = export_gguf(&ck, qt, &out).expect("export");
            let f = GgufFile::open(&out).expect("open");
            let cfg = config_from_gguf(&f).expect("config");
            let src = k3_format::Checkpoint::open(&ck).expect("ck").config;
            assert_eq!(
                without_unused_moe(cfg),
                without_unused_moe(src),
                "{dir}: config must survive the GGUF round trip"
            );
            if qt != QuantType::F32 {
                assert!(r.kept_f32 > 0, "norms and conv kernels stay F32");
            }
            let got = logits(&out, &ids);
            let diff = if qt == QuantType::F32 { max_abs(&got, &want) } else { median_abs(&got, &want) };
            let ag = top1_agreement(&got, &want, v);
            assert!(
                diff <= tol && ag >= agree,
                "{dir} {qt:?}: |Δlogit| {diff:e} (≤ {tol}), top-1 agreement {ag} (≥ {agree})"
            );
        }
    }
}

#[test]
fn export_refuses_what_llama_cpp_cannot_load_and_reports_fallbacks() {
    // attention_bias and a dense layer after an MoE layer have no llama.cpp representation.
    let e = export_gguf(&golden("tiny_kimi_linear_moe_grouped"), QuantType::F16, &scratch("bad").path().join("x.gguf"))
        .expect_err("must refuse")
        .to_string();
    assert!(e.contains("attention_bias") || e.contains("prefix"), "{e}");
    // head dim 16 rows do not fit a 32-block: reported, written as F16
    let r = export_gguf(&golden("tiny_kimi_linear_dense"), QuantType::Q4_0, &scratch("fb").path().join("x.gguf"))
        .expect("export");
    assert!(r.fallbacks.iter().any(|f| f.contains("ssm_f_b.weight") && f.contains("F16")), "{:?}", r.fallbacks);
}

/// Every tensor the engine reads from a quantized GGUF (through the transforms: absorbed MLA,
/// stacked experts, fused AttnRes scores, −exp(A_log), conv reshapes) equals the checkpoint's
/// within the type's quantization error.
#[test]
fn quantized_gguf_tensors_match_the_checkpoint() {
    use k3_config::ModelConfig;
    use k3_infer::source::{ExpertPart, Source};
    for dir in ["tiny_kimi_linear_moe", "tiny_k3"] {
        let ck = golden(dir);
        let (hf, _) = Source::open(&ck).expect("hf");
        let ModelConfig::Kimi(c) = hf.config().clone() else { panic!() };
        for (qt, budget) in [(QuantType::Q8_0, 0.01), (QuantType::Q4_0, 0.2), (QuantType::Q4_1, 0.2)] {
            let tmp = scratch(dir);
            let out = tmp.path().join(format!("t{qt:?}.gguf"));
            export_gguf(&ck, qt, &out).expect("export");
            let (gg, _) = Source::open(&out).expect("gguf");
            let rel = |name: &str, a: &[f32], b: &[f32]| {
                let e: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>();
                let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().max(1e-30);
                let r = (e / n).sqrt();
                assert!(r <= budget, "{dir} {qt:?} {name}: relative RMS error {r:.4} > {budget}");
            };
            let dq = |m: k3_infer::linear::Matrix| {
                let mut v = vec![0f32; m.rows * m.cols];
                for r in 0..m.rows {
                    m.row_into(r, &mut v[r * m.cols..(r + 1) * m.cols]);
                }
                v
            };
            for s in k3_format::tensor_specs(hf.config()) {
                let n = s.name.as_str();
                let layer: usize = n
                    .strip_prefix("model.layers.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(0);
                if n.ends_with("kv_b_proj.weight") {
                    let m = &c.mla;
                    let a = hf
                        .mla_absorbed(layer, m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim)
                        .expect("hf");
                    let b = gg
                        .mla_absorbed(layer, m.num_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim)
                        .expect("gguf");
                    rel("k_b", &dq(b.0), &dq(a.0));
                    rel("v_b", &dq(b.1), &dq(a.1));
                } else if n.contains(".experts.") && n.ends_with("w1.weight") {
                    let e: usize = n
                        .split(".experts.")
                        .nth(1)
                        .and_then(|r| r.split('.').next())
                        .and_then(|x| x.parse().ok())
                        .expect("e");
                    let w = c.moe.latent.map_or(c.hidden_size, |l| l.dim);
                    for part in [ExpertPart::Gate, ExpertPart::Up, ExpertPart::Down] {
                        let a = hf.expert(layer, e, part, c.moe.intermediate_size, w).expect("hf");
                        let b = gg.expert(layer, e, part, c.moe.intermediate_size, w).expect("gguf");
                        rel(n, &dq(b), &dq(a));
                    }
                } else if n.contains(".experts.") {
                } else if n.ends_with("A_log") {
                    rel(
                        n,
                        &gg.kda_decay_rate(layer, c.kda.num_heads).expect("g"),
                        &hf.kda_decay_rate(layer, c.kda.num_heads).expect("h"),
                    );
                } else if let Some(p) = n.strip_suffix("_norm.weight").filter(|p| p.ends_with("_res")) {
                    rel(n, &gg.res_score(p, c.hidden_size).expect("g"), &hf.res_score(p, c.hidden_size).expect("h"));
                } else if n.ends_with("_res_proj.weight") {
                } else if s.shape.len() == 2 && !n.ends_with("conv1d.weight") {
                    let (r, cc) = (s.shape[0], s.shape[1]);
                    rel(n, &dq(gg.matrix(n, r, cc).expect("g")), &dq(hf.matrix(n, r, cc).expect("h")));
                } else {
                    rel(n, &gg.vector(n, s.numel()).expect("g"), &hf.vector(n, s.numel()).expect("h"));
                }
            }
        }
    }
}
