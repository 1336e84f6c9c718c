//! `k3mini bench infer --reference`: the benchmarked GGUF judged against its f32 model after the
//! speed runs (KL, top-1, perplexity), ours only here (no llama.cpp needed).

mod common;

use common::*;

/// The f32 GGUF of the K3 fixture matches its own checkpoint (KL ~0, every argmax the same); its
/// Q4_0 GGUF does not (KL well above rounding); both land in the JSON; a missing reference is
/// refused before any speed run.
#[test]
fn bench_infer_judges_the_gguf_against_its_f32_reference() {
    let d = scratch("bench-quality");
    let reference = golden("tiny_k3");
    let judged = |ty: &str| -> serde_json::Value {
        let g = d.join(format!("{ty}.gguf"));
        run(k3mini().args(["quantize", "--type", ty, "--model"]).arg(&reference).arg("--out").arg(&g));
        let json = d.join(format!("{ty}.json"));
        let text = run(k3mini()
            .args(["bench", "infer", "--no-llama", "--threads", "1", "--prefill", "8", "--decode-ctx", "0"])
            .args(["--decode-tokens", "2", "--repeat", "1", "--quality-windows", "3", "--quality-context", "24"])
            .arg("--model")
            .arg(&g)
            .arg("--reference")
            .arg(&reference)
            .arg("--json")
            .arg(&json));
        assert!(text.contains("KL") && text.contains("pseudo-random ids"), "{ty}: {text}");
        let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("parse");
        j["quality"].clone()
    };
    let (f32q, q4) = (judged("f32"), judged("q4_0"));
    let num = |q: &serde_json::Value, k: &str| q[k].as_f64().unwrap_or_else(|| panic!("no {k} in {q}"));
    assert_eq!((num(&f32q, "windows"), num(&f32q, "context")), (3.0, 24.0), "{f32q}");
    assert!(num(&f32q, "kl").abs() < 1e-6 && num(&f32q, "top1") == 1.0, "f32 GGUF against its checkpoint: {f32q}");
    assert!(num(&q4, "kl") > 1e-3 && num(&q4, "top1") < 1.0, "Q4_0 against f32: {q4}");
    for q in [&f32q, &q4] {
        assert!(num(q, "ppl").is_finite() && num(q, "reference_ppl").is_finite(), "{q}");
    }
    let rel = (num(&f32q, "ppl") / num(&f32q, "reference_ppl") - 1.0).abs();
    assert!(rel < 1e-4, "f32 perplexity off its reference's by {rel}: {f32q}");

    let out = k3mini()
        .args(["bench", "infer", "--no-llama", "--model"])
        .arg(d.join("q4_0.gguf"))
        .args(["--reference", "/nonexistent/k3-reference"])
        .output()
        .expect("spawn");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && text.contains("--reference /nonexistent/k3-reference"), "{text}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("thread(s)"), "refused only after the speed runs");
}
