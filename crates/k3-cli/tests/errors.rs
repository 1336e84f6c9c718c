//! Bad input gets a clear error naming the file, field or tensor, never a panic (pure Rust).

mod common;

use common::*;

fn fails(args: &[&str]) -> String {
    let out = k3mini().args(args).output().expect("spawn");
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(!text.contains("panicked"), "{args:?} panicked:\n{text}");
    text
}

#[test]
fn gguf_and_prompt_errors() {
    let d = scratch("errors");
    let g = d.join("m.gguf");
    run(k3mini()
        .args(["quantize", "--model"])
        .arg(golden("tiny_kimi_linear_dense"))
        .args(["--type", "f16", "--out"])
        .arg(&g));
    let bytes = std::fs::read(&g).expect("read");
    let gs = |name: &str, b: &[u8]| {
        let p = d.join(name);
        std::fs::write(&p, b).expect("write");
        p.to_string_lossy().into_owned()
    };
    let t = gs("trunc.gguf", &bytes[..bytes.len() / 2]);
    let e = fails(&["logits", "--model", &t, "--ids", "1,2", "--out", "/dev/null"]);
    assert!(e.contains("trunc.gguf") && e.contains("truncated"), "{e}");
    let mut bad = bytes.clone();
    bad[..4].copy_from_slice(b"GGJT");
    let m = gs("magic.gguf", &bad);
    let e = fails(&["logits", "--model", &m, "--ids", "1", "--out", "/dev/null"]);
    assert!(e.contains("not a GGUF file"), "{e}");
    let pos = bytes.windows(11).position(|w| w == b"kimi-linear").expect("arch string");
    let mut arch = bytes.clone();
    arch[pos..pos + 11].copy_from_slice(b"mamba-xyzzy");
    let a = gs("arch.gguf", &arch);
    let e = fails(&["logits", "--model", &a, "--ids", "1", "--out", "/dev/null"]);
    assert!(e.contains("mamba-xyzzy") && e.contains("not supported"), "{e}");
    let e = fails(&["logits", "--model", &g.to_string_lossy(), "--ids", "1,x", "--out", "/dev/null"]);
    assert!(e.contains("`x` is not a token id"), "{e}");
    let e = fails(&["logits", "--model", &g.to_string_lossy(), "--ids", "1,4000", "--out", "/dev/null"]);
    assert!(e.contains("4000") && e.contains("vocab"), "{e}");
    let e = fails(&[
        "quantize",
        "--model",
        &golden("tiny_kimi_linear_dense").to_string_lossy(),
        "--type",
        "iq2_xxs",
        "--out",
        "/dev/null",
    ]);
    assert!(e.contains("iq2_xxs") && e.contains("allowed"), "{e}");
    let e = fails(&["generate", "--model", &g.to_string_lossy(), "--prompt", "hi"]);
    assert!(e.contains("no tokenizer"), "{e}");
    let e = fails(&["logits", "--model", "/nonexistent/dir", "--ids", "1", "--out", "/dev/null"]);
    assert!(e.contains("/nonexistent/dir"), "{e}");
}

#[test]
fn info_reads_a_gguf_and_names_a_bad_one() {
    let d = scratch("info");
    let g = d.join("m.gguf");
    let dir = golden("tiny_kimi_linear_dense");
    run(k3mini().args(["quantize", "--model"]).arg(&dir).args(["--type", "q8_0", "--out"]).arg(&g));
    let from_dir = run(k3mini().args(["info", "--model"]).arg(&dir));
    let from_gguf = run(k3mini().args(["info", "--model"]).arg(&g));
    // The same config either way, then what only the file says.
    let params = |s: &str| s.lines().find(|l| l.starts_with("params")).map(str::to_string);
    assert_eq!(params(&from_dir), params(&from_gguf), "{from_dir}\n{from_gguf}");
    assert!(params(&from_gguf).is_some(), "{from_gguf}");
    assert!(from_gguf.contains("architecture `kimi-linear`") && from_gguf.contains("Q8_0 "), "{from_gguf}");
    assert!(from_gguf.contains("of weights read per token"), "{from_gguf}");
    let bytes = std::fs::read(&g).expect("read");
    let t = d.join("trunc.gguf");
    std::fs::write(&t, &bytes[..bytes.len() / 3]).expect("write");
    let e = fails(&["info", "--model", &t.to_string_lossy()]);
    assert!(e.contains("trunc.gguf") && e.contains("truncated"), "{e}");
}
