//! Helpers shared by the cross-implementation tests: the project venv's python, scratch dirs,
//! running `k3mini`, reading safetensors outputs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use k3_format::SafetensorsFile;

/// The project venv's python, or `None` (skip) when this run has no venv. Under scripts/test
/// (`K3MINI_REQUIRE_PYTHON`), a missing venv is a failure, not a skip.
pub fn python() -> Option<PathBuf> {
    match std::env::var_os("K3MINI_PYTHON") {
        Some(p) if Path::new(&p).exists() => Some(PathBuf::from(p)),
        _ if std::env::var_os("K3MINI_REQUIRE_PYTHON").is_some() => {
            panic!("K3MINI_PYTHON is not set to the project venv's python; run scripts/test")
        }
        _ => {
            eprintln!("skipped: K3MINI_PYTHON is not set (scripts/test sets it after scripts/setup)");
            None
        }
    }
}

/// The SmolLM2 teacher GGUF that scripts/setup fetches.
pub fn teacher() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os("K3MINI_TEACHER")?);
    if p.exists() {
        Some(p)
    } else if std::env::var_os("K3MINI_REQUIRE_PYTHON").is_some() {
        panic!("{}: the teacher GGUF is missing; run scripts/setup", p.display())
    } else {
        None
    }
}

pub fn tool(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/reference").join(name)
}

pub fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(name)
}

/// A test's scratch directory under the system temp dir, removed with everything in it when
/// dropped; a failing test keeps it (its path is printed) for a look at what it left.
pub struct Scratch(Option<tempfile::TempDir>);

pub fn scratch(tag: &str) -> Scratch {
    let dir = tempfile::Builder::new().prefix(&format!("k3t-{tag}-")).tempdir().expect("scratch dir");
    Scratch(Some(dir))
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.as_ref().expect("scratch dir").path()
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        self
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(dir) = self.0.take() {
                eprintln!("kept for the failed test: {}", dir.keep().display());
            }
        }
    }
}

pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("spawn");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

pub fn k3mini() -> Command {
    Command::new(env!("CARGO_BIN_EXE_k3mini"))
}

/// A tensor from a safetensors file as f32 (integers converted), with its shape.
pub fn read(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let f = SafetensorsFile::open(path).expect("open");
    let t = f.tensor(name).unwrap_or_else(|| panic!("{}: no tensor {name}", path.display()));
    let data = match t.dtype {
        safetensors::Dtype::I64 => t.to_i64().expect("i64").into_iter().map(|x| x as f32).collect(),
        _ => t.to_f32().expect("f32"),
    };
    (t.shape.to_vec(), data)
}

pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn top1_agreement(a: &[f32], b: &[f32], v: usize) -> f64 {
    let argmax = |x: &[f32]| x.iter().enumerate().max_by(|p, q| p.1.total_cmp(q.1)).map(|(i, _)| i);
    let n = a.len() / v;
    (0..n).filter(|&r| argmax(&a[r * v..(r + 1) * v]) == argmax(&b[r * v..(r + 1) * v])).count() as f64 / n as f64
}

/// Every line of a run's `metrics.jsonl`.
pub fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}
