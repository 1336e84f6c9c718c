//! `k3mini train` end to end, as a user runs it: a dataset built from a corpus the model has never
//! seen (this repository's config crate), loss going down, `kill -9` and an abort mid-save followed
//! by `--resume` reproducing the uninterrupted run bit for bit, and clear errors on bad input.

#![cfg(feature = "train")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A small real dataset: the sources of k3-config, byte-level BPE of 384 tokens.
fn dataset(d: &Path) -> PathBuf {
    let ds = d.join("ds");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../k3-config/src");
    let out = run(k3mini()
        .args(["data", "build", "--tokenizer", "bpe:384", "--val-permille", "200", "--out"])
        .arg(&ds)
        .arg("--source")
        .arg(format!("dir:{}", src.display())));
    assert!(out.contains("bytes/tok"), "{out}");
    ds
}

/// A config for `preset` on `ds`; `train` adds lines to the [train] table.
fn config(d: &Path, ds: &Path, preset: &str, train: &str) -> PathBuf {
    let ds_name = ds.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let p = d.join(format!("{preset}-{ds_name}.toml"));
    let text = format!(
        "[model]\npreset = \"{preset}\"\n[data]\ndataset = \"{}\"\nseq_len = 32\nbatch_size = 4\n\
         [schedule]\nwarmup_steps = 4\n[train]\nthreads = 1\neval_windows = 8\n{train}",
        ds.display()
    );
    std::fs::write(&p, text).expect("write config");
    p
}

/// (step, loss) of every logged training step.
fn losses(run_dir: &Path) -> Vec<(u64, f64)> {
    metrics(run_dir).iter().filter_map(|v| Some((v["step"].as_u64()?, v["loss"].as_f64()?))).collect()
}

fn train(cfg: &Path, out: &Path, args: &[&str]) -> Command {
    let mut c = k3mini();
    c.arg("train").arg("--config").arg(cfg).arg("--out").arg(out).args(args);
    c
}

#[test]
fn training_lowers_validation_loss_on_an_unseen_corpus() {
    let d = scratch("train-loss");
    let ds = dataset(&d);
    let cfg = config(&d, &ds, "tiny", "");
    let out = d.join("run");
    let text = run(&mut train(&cfg, &out, &["--set", "train.steps=40", "--set", "train.eval_every=20"]));
    let vals: Vec<f64> = metrics(&out).iter().filter_map(|v| v["val_loss"].as_f64()).collect();
    assert_eq!(vals.len(), 3, "validation at steps 0, 20, 40: {vals:?}");
    assert!(vals[0] > 5.5, "an untrained model is near ln(384) = 5.95: {vals:?}");
    assert!(vals[2] < vals[0] - 0.6, "40 steps lower the validation loss: {vals:?}\n{text}");
    assert!(out.join("loss.png").is_file());
    // The checkpoint is a Kimi checkpoint the pure-Rust engine loads.
    let ck = out.join("checkpoints/step-00000040");
    let logits = d.join("logits.safetensors");
    run(k3mini().args(["logits", "--exact", "--ids", "5,6,7", "--model"]).arg(&ck).arg("--out").arg(&logits));
}

#[test]
fn resume_after_kill_and_abort_mid_save_is_exact() {
    let d = scratch("train-resume");
    let ds = dataset(&d);
    let cfg = config(
        &d,
        &ds,
        "tiny",
        "steps = 24\nlog_every = 1\neval_every = 12\ncheckpoint_every = 6\nkeep_checkpoints = 2\n",
    );

    let a = d.join("a");
    run(&mut train(&cfg, &a, &[]));

    // B: kill -9 once the step-6 checkpoint exists (somewhere in steps 7..12, or mid-save of 12).
    let b = d.join("b");
    let mut child = train(&cfg, &b, &[]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("spawn");
    let t0 = Instant::now();
    while !b.join("checkpoints/step-00000006/trainer.json").exists() {
        assert!(t0.elapsed() < Duration::from_secs(300), "no checkpoint after 300 s");
        assert!(child.try_wait().expect("wait").is_none(), "run B ended before it was killed");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");

    // Resume, and abort half-way through writing the step-18 checkpoint.
    let out = train(&cfg, &b, &["--resume"]).env("K3MINI_ABORT_IN_SAVE", "18").output().expect("spawn");
    assert!(!out.status.success(), "the abort hook fires");
    assert!(!b.join("checkpoints/step-00000018").exists(), "a half-written checkpoint never appears");
    assert!(b.join("checkpoints/step-00000012/trainer.json").exists());

    // Resume again to the end.
    let text = run(&mut train(&cfg, &b, &["--resume"]));
    assert!(text.contains("resuming"), "{text}");
    assert_eq!(losses(&a), losses(&b), "every step's loss equals the uninterrupted run's");
    assert_eq!(losses(&a).len(), 24);
    let w = |r: &Path| std::fs::read(r.join("checkpoints/step-00000024/model.safetensors")).expect("model");
    assert!(w(&a) == w(&b), "the final weights are bit-identical");
    let left: Vec<_> =
        std::fs::read_dir(b.join("checkpoints")).expect("dir").flatten().map(|e| e.file_name()).collect();
    assert_eq!(left.len(), 2, "keep_checkpoints = 2 and no temporary directories left: {left:?}");

    // A finished run refuses a fresh start in the same directory.
    let out = train(&cfg, &b, &[]).output().expect("spawn");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--resume"), "{err}");
}

#[test]
fn moe_run_logs_expert_load_and_moves_router_biases() {
    let d = scratch("train-moe");
    let ds = dataset(&d);
    let cfg = config(&d, &ds, "tiny-k3", "");
    let out = d.join("run");
    run(&mut train(&cfg, &out, &["--set", "train.steps=6", "--set", "train.log_every=3"]));
    let m = metrics(&out);
    let line = m.iter().find(|v| v["expert_load"].is_object()).expect("a line with expert_load");
    let loads = line["expert_load"].as_object().expect("object");
    assert_eq!(loads.len(), 7, "layers 1..7 are MoE in tiny-k3: {loads:?}");
    for (layer, l) in loads {
        let v: Vec<f64> = l.as_array().expect("array").iter().map(|x| x.as_f64().expect("f64")).collect();
        assert_eq!(v.len(), 8, "layer {layer}");
        assert!((v.iter().sum::<f64>() - 1.0).abs() < 1e-9, "layer {layer}: loads sum to 1: {v:?}");
    }
    // The aux-free update moved every correction bias by ±γ per step (6 steps → 6e-3 at most).
    let ck = out.join("checkpoints/step-00000006/model.safetensors");
    let (_, bias) = read(&ck, "model.layers.1.block_sparse_moe.gate.e_score_correction_bias");
    assert!(bias.iter().any(|&b| b != 0.0), "{bias:?}");
    assert!(bias.iter().all(|&b| b.abs() <= 6e-3 + 1e-7), "{bias:?}");
}

#[test]
fn bad_inputs_get_clear_errors() {
    let d = scratch("train-errors");
    let ds = dataset(&d);
    let fail = |c: &mut Command| {
        let out = c.output().expect("spawn");
        assert!(!out.status.success(), "{c:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // A misspelt field, a bad value, an unknown preset.
    let cfg = config(&d, &ds, "tiny", "");
    let e = fail(&mut train(&cfg, &d.join("r1"), &["--set", "optim.lrr=1e-3"]));
    assert!(e.contains("lrr") && e.contains("tiny-ds.toml"), "{e}");
    let e = fail(&mut train(&cfg, &d.join("r1"), &["--set", "schedule.kind=linear"]));
    assert!(e.contains("linear") && e.contains("wsd"), "{e}");
    let bad = config(&d, &ds, "huge", "");
    let e = fail(&mut train(&bad, &d.join("r1"), &[]));
    assert!(e.contains("huge") && e.contains("tiny"), "{e}");
    // A truncated shard.
    let ds2 = d.join("ds-cut");
    std::fs::create_dir_all(&ds2).expect("dir");
    for f in std::fs::read_dir(&ds).expect("ds").flatten() {
        std::fs::copy(f.path(), ds2.join(f.file_name())).expect("copy");
    }
    let shard = ds2.join("train-00000.bin");
    let bytes = std::fs::read(&shard).expect("shard");
    std::fs::write(&shard, &bytes[..bytes.len() - 3]).expect("truncate");
    let cfg2 = config(&d, &ds2, "tiny", "");
    let e = fail(&mut train(&cfg2, &d.join("r2"), &[]));
    assert!(e.contains("train-00000.bin") && e.contains("truncated"), "{e}");
    // A diverging run stops with the NaN message and names what to do.
    let e = fail(&mut train(
        &cfg,
        &d.join("r3"),
        &["--set", "optim.kind=adamw", "--set", "optim.lr=1e8", "--set", "optim.clip=0", "--set", "train.steps=30"],
    ));
    assert!(e.contains("not finite") && e.contains("--resume"), "{e}");
}
