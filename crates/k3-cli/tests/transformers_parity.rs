//! Cross-implementation tests (train tier): the `k3mini` binary against transformers 5.24 running
//! in the project venv.
//! - random tiny `kimi_linear` checkpoints that transformers itself creates and saves, with
//!   dimensions and seeds drawn fresh (dense and MoE): `k3mini logits` within 1e-4;
//! - Kimi-Linear-profile `k3mini init` checkpoints load in transformers with the same logits, and
//!   survive a transformers save_pretrained round trip.
#![cfg(feature = "train")]

use std::path::{Path, PathBuf};
use std::process::Command;

use k3_format::SafetensorsFile;

fn python() -> Option<PathBuf> {
    match std::env::var_os("K3MINI_PYTHON") {
        Some(p) if Path::new(&p).exists() => Some(PathBuf::from(p)),
        _ if std::env::var_os("K3MINI_REQUIRE_PYTHON").is_some() => {
            panic!("K3MINI_PYTHON is not set to the project venv's python; run scripts/test")
        }
        _ => {
            eprintln!(
                "skipped: K3MINI_PYTHON is not set (scripts/test sets it after scripts/setup)"
            );
            None
        }
    }
}

fn tool(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tools/reference")
        .join(name)
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("k3par-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch");
    d
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("spawn");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn k3mini() -> Command {
    Command::new(env!("CARGO_BIN_EXE_k3mini"))
}

fn read(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let f = SafetensorsFile::open(path).expect("open");
    let t = f.tensor(name).expect("tensor");
    let data = match t.dtype {
        safetensors::Dtype::I64 => t
            .to_i64()
            .expect("i64")
            .into_iter()
            .map(|x| x as f32)
            .collect(),
        _ => t.to_f32().expect("f32"),
    };
    (t.shape.to_vec(), data)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn random_transformers_checkpoints_match() {
    let Some(py) = python() else { return };
    // Fresh seeds every run: nothing here was seen when the code was written.
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        % 100_000;
    for (i, kind) in ["dense", "moe", "moe", "dense", "moe"].iter().enumerate() {
        let seed = base * 10 + i as u64;
        let d = scratch(&format!("rand{i}"));
        let msg = run(Command::new(&py)
            .arg(tool("random_kimi.py"))
            .arg(&d)
            .arg(seed.to_string())
            .arg(kind));
        let (_, ids) = read(&d.join("io.safetensors"), "input_ids");
        let ids: Vec<String> = ids.iter().map(|x| (*x as i64).to_string()).collect();
        let out = d.join("ours.safetensors");
        run(k3mini()
            .args(["logits", "--model"])
            .arg(d.join("model"))
            .args(["--ids", &ids.join(",")])
            .arg("--out")
            .arg(&out));
        let (shape, ours) = read(&out, "logits");
        let (tshape, theirs) = read(&d.join("io.safetensors"), "logits");
        assert_eq!(shape, tshape);
        let diff = max_abs(&ours, &theirs);
        assert!(diff < 1e-4, "{msg}: max |k3mini − transformers| = {diff:e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}

#[test]
fn init_checkpoints_run_in_transformers_and_round_trip() {
    let Some(py) = python() else { return };
    let d = scratch("init");
    let ckpt = d.join("tiny");
    run(k3mini()
        .args(["init", "--preset", "tiny", "--seed", "3", "--out"])
        .arg(&ckpt));
    let ids =
        "1,5,9,200,3000,17,17,4095,0,42,7,7,7,1000,2000,3,4,5,6,8,9,10,11,12,13,14,15,16,18,19,20";
    let ours = d.join("ours.safetensors");
    run(k3mini()
        .args(["logits", "--model"])
        .arg(&ckpt)
        .args(["--ids", ids, "--out"])
        .arg(&ours));
    let theirs = d.join("theirs.safetensors");
    let resaved = d.join("resaved");
    run(Command::new(&py)
        .arg(tool("hf_logits.py"))
        .arg(&ckpt)
        .arg(ids)
        .arg(&theirs)
        .arg("--resave")
        .arg(&resaved));
    let (_, a) = read(&ours, "logits");
    let (_, b) = read(&theirs, "logits");
    let diff = max_abs(&a, &b);
    assert!(
        diff < 1e-4,
        "k3mini init checkpoint: max |k3mini − transformers| = {diff:e}"
    );
    // What transformers re-saves (block_sparse_moe.* dense names, layer_types) loads back in k3mini.
    let again = d.join("again.safetensors");
    run(k3mini()
        .args(["logits", "--model"])
        .arg(&resaved)
        .args(["--ids", ids, "--out"])
        .arg(&again));
    let (_, c) = read(&again, "logits");
    assert!(
        max_abs(&a, &c) == 0.0,
        "transformers round trip changed the logits"
    );
    let _ = std::fs::remove_dir_all(&d);
}
