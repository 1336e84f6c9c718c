//! Our K-quant (and Q5_0, Q5_1, IQ4_NL, IQ4_XS) bytes, dequantized by gguf-py (llama.cpp's Python reader), equal our dequantization:
//! the block layouts are ggml's. Skipped without the project venv (`K3MINI_PYTHON`), a failure
//! under scripts/test (`K3MINI_REQUIRE_PYTHON`).

use std::path::PathBuf;
use std::process::Command;

use k3_kernels::quant::GgmlType;

fn python() -> Option<PathBuf> {
    match std::env::var_os("K3MINI_PYTHON") {
        Some(p) if PathBuf::from(&p).exists() => Some(PathBuf::from(p)),
        _ if std::env::var_os("K3MINI_REQUIRE_PYTHON").is_some() => {
            panic!("K3MINI_PYTHON is not set; run scripts/test")
        }
        _ => None,
    }
}

#[test]
fn gguf_py_reads_our_k_quants_as_we_do() {
    let Some(py) = python() else {
        eprintln!("skipped: K3MINI_PYTHON is not set");
        return;
    };
    let tool = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tools/reference/kquant_dequant.py");
    let tmp = tempfile::Builder::new().prefix("k3-kq-").tempdir().expect("scratch dir");
    let dir = tmp.path();
    let n = 256 * 6;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i as f32 * 0.37).sin() + 0.3 * (i as f32 * 0.011).cos()) * (1.0 + (i / 64 % 4) as f32))
        .collect();
    for ty in [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
    ] {
        let bytes = ty.quantize_row(&x);
        let (inp, out) = (dir.join(format!("{}.bin", ty.name())), dir.join(format!("{}.f32", ty.name())));
        std::fs::write(&inp, &bytes).expect("write");
        let o = Command::new(&py).arg(&tool).arg(ty.name()).arg(&inp).arg(&out).output().expect("spawn");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let theirs: Vec<f32> = std::fs::read(&out)
            .expect("read")
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut ours = vec![0f32; n];
        ty.dequantize_row(&bytes, &mut ours);
        assert_eq!(theirs.len(), n, "{}", ty.name());
        for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{} element {i}: ours {a}, gguf-py {b}", ty.name());
        }
    }
}
