//! Run checkpoints: `RUN/checkpoints/step-NNNNNNNN/` holds a loadable Kimi checkpoint
//! (`config.json`, `model.safetensors`, the dataset's `tokenizer.json`) plus `optimizer.safetensors`
//! and `trainer.json`.
//!
//! Crash safety: a checkpoint is written into a hidden temporary directory, every file fsynced,
//! `trainer.json` last, then the directory is renamed into place and its parent fsynced. A
//! `step-*` directory therefore either is complete or does not exist; `kill -9` mid-save leaves
//! only a temporary directory, which the next start deletes.

use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::model::Model;
use crate::trainer::optim::Optimizer;
use crate::{Error, Result};

/// What the trainer needs besides weights and optimiser state to continue exactly.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    /// Optimiser steps completed.
    pub step: u64,
    /// Training tokens consumed.
    pub tokens: u64,
    pub tokenizer_hash: String,
    /// The run's config (TOML) when this checkpoint was written.
    pub config_toml: String,
    /// Seconds spent training up to this checkpoint (for tokens/s across resumes).
    pub train_seconds: f64,
    /// Σ and count of step losses since the last metrics line (so `loss_avg` is exact across resumes).
    pub loss_sum: f64,
    pub loss_count: u64,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::Invalid(format!("{}: {e}", path.display()))
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(io(dir))
}

pub fn checkpoints_dir(run: &Path) -> PathBuf {
    run.join("checkpoints")
}

fn step_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Complete checkpoints of a run, oldest first.
pub fn list(run: &Path) -> Vec<(u64, PathBuf)> {
    let dir = checkpoints_dir(run);
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().join("trainer.json").is_file().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// Remove temporary directories left by an interrupted save.
pub fn clean_partial(run: &Path) {
    let dir = checkpoints_dir(run);
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Read `trainer.json` of a checkpoint.
pub fn read_state(ckpt: &Path) -> Result<TrainerState> {
    let p = ckpt.join("trainer.json");
    let text = std::fs::read_to_string(&p).map_err(io(&p))?;
    serde_json::from_str(&text).map_err(|e| Error::Invalid(format!("{}: {e}", p.display())))
}

/// Write a checkpoint atomically and keep only the newest `keep`. Returns its directory.
pub fn save(
    run: &Path,
    model: &Model,
    opt: &Optimizer,
    state: &TrainerState,
    tokenizer_json: &Path,
    keep: usize,
) -> Result<PathBuf> {
    let dir = checkpoints_dir(run);
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let name = step_name(state.step);
    let tmp = dir.join(format!(".tmp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    model.save(&tmp)?;
    crash_point(state.step);
    opt.save(&tmp.join("optimizer.safetensors"))?;
    let tok = std::fs::read(tokenizer_json).map_err(io(tokenizer_json))?;
    k3_format::safetensors_io::write_atomic(&tmp.join("tokenizer.json"), &tok)?;
    let json = serde_json::to_string_pretty(state).map_err(|e| Error::Invalid(e.to_string()))?;
    k3_format::safetensors_io::write_atomic(&tmp.join("trainer.json"), json.as_bytes())?;
    fsync_dir(&tmp)?;
    let fin = dir.join(&name);
    if fin.exists() {
        // Re-reaching a step after resuming from an older checkpoint: replace the old copy.
        let old = dir.join(format!(".tmp-old-{name}-{}", std::process::id()));
        std::fs::rename(&fin, &old).map_err(io(&fin))?;
        let _ = std::fs::remove_dir_all(&old);
    }
    std::fs::rename(&tmp, &fin).map_err(io(&fin))?;
    fsync_dir(&dir)?;
    let all = list(run);
    if all.len() > keep {
        for (_, p) in &all[..all.len() - keep] {
            let _ = std::fs::remove_dir_all(p);
        }
    }
    Ok(fin)
}

/// Test hook: `K3MINI_ABORT_IN_SAVE=N` aborts the process half-way through saving step N, as a
/// `kill -9` mid-save would.
fn crash_point(step: u64) {
    if std::env::var("K3MINI_ABORT_IN_SAVE").ok().and_then(|s| s.parse::<u64>().ok()) == Some(step) {
        eprintln!("K3MINI_ABORT_IN_SAVE: aborting mid-save at step {step}");
        std::process::abort();
    }
}
