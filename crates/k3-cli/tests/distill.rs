//! Capture and distillation end to end on a tiny fixture, without network: a small teacher trained
//! here, `k3mini capture` (with a `kill -9` in the middle, resumed without losing or repeating a
//! window), the store refusing another tokenizer, and `k3mini distill` offline and online.

#![cfg(feature = "train")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use k3_data::signals::SignalStore;

fn dataset(d: &Path, name: &str, tokenizer: &str) -> PathBuf {
    let ds = d.join(name);
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../k3-config/src");
    run(k3mini()
        .args(["data", "build", "--tokenizer", tokenizer, "--val-permille", "200", "--out"])
        .arg(&ds)
        .arg("--source")
        .arg(format!("dir:{}", src.display())));
    ds
}

fn write_config(d: &Path, name: &str, ds: &Path, extra: &str) -> PathBuf {
    let p = d.join(format!("{name}.toml"));
    let text = format!(
        "[model]\npreset = \"tiny\"\n[data]\ndataset = \"{}\"\nseq_len = 32\nbatch_size = 4\n[schedule]\nwarmup_steps = 4\n\
         [train]\nthreads = 1\neval_windows = 8\nlog_every = 5\n{extra}",
        ds.display()
    );
    std::fs::write(&p, text).expect("write config");
    p
}

fn last(run_dir: &Path, key: &str) -> f64 {
    metrics(run_dir).iter().rev().find_map(|v| v[key].as_f64()).unwrap_or_else(|| panic!("no {key}"))
}

fn capture(teacher: &Path, ds: &Path, out: &Path, split: &str, windows: usize) -> Command {
    let mut c = k3mini();
    c.args(["capture", "--threads", "1", "--top-k", "8", "--seq-len", "32", "--split", split, "--windows"])
        .arg(windows.to_string())
        .arg("--teacher")
        .arg(teacher)
        .arg("--data")
        .arg(ds)
        .arg("--out")
        .arg(out);
    c
}

#[test]
fn capture_resumes_after_kill_and_distillation_learns_from_the_store() {
    let d = scratch("distill");
    let ds = dataset(&d, "ds", "bpe:384");
    // The teacher: a tiny model trained here for a little longer than the students.
    let tcfg = write_config(&d, "teacher", &ds, "steps = 60\neval_every = 60\n");
    let tdir = d.join("teacher");
    run(k3mini().arg("train").arg("--config").arg(&tcfg).arg("--out").arg(&tdir));
    let teacher = tdir.join("checkpoints/step-00000060");

    // A reference capture, uninterrupted.
    let n = 120;
    let a = d.join("store-a");
    let text = run(&mut capture(&teacher, &ds, &a, "train", n));
    assert!(text.contains("bytes/token") && text.contains("recon. KL"), "{text}");

    // The same capture killed with SIGKILL in the middle, then run again.
    let b = d.join("store-b");
    let mut child =
        capture(&teacher, &ds, &b, "train", n).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("spawn");
    let t0 = Instant::now();
    let shard = b.join("sig-00000.bin");
    while std::fs::metadata(&shard).map_or(0, |m| m.len()) < 20_000 {
        assert!(t0.elapsed() < Duration::from_secs(120), "the capture wrote nothing in 120 s");
        assert!(child.try_wait().expect("wait").is_none(), "the capture ended before it was killed");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    let partial = SignalStore::open(&b).expect("a killed store still opens").num_windows();
    assert!(partial > 0 && partial < n, "killed mid-way: {partial} windows");
    let text = run(&mut capture(&teacher, &ds, &b, "train", n));
    assert!(text.contains(&format!("({n} windows")), "{text}");
    let (sa, sb) = (SignalStore::open(&a).expect("a"), SignalStore::open(&b).expect("b"));
    assert_eq!(sb.num_windows(), n);
    for i in 0..n {
        let (wa, wb) = (sa.window(i).expect("a"), sb.window(i).expect("b"));
        assert_eq!(wa.index, i as u64);
        assert_eq!(wa, wb, "window {i} equals the uninterrupted capture's (none lost, none repeated)");
    }

    // A store from another tokenizer is refused, naming the problem.
    let other = dataset(&d, "ds-other", "bpe:300");
    let out = capture(&teacher, &other, &d.join("store-x"), "train", 4).output().expect("spawn");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("--tokenizer"), "{e}");
    let bad = write_config(&d, "bad", &other, &format!("steps = 2\n[distill]\nstore = \"{}\"\n", a.display()));
    let out =
        k3mini().arg("distill").arg("--config").arg(&bad).arg("--out").arg(d.join("bad")).output().expect("spawn");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("tokenizer") && e.contains("store-a"), "{e}");

    // Held-out teacher signals for agreement, then scratch vs offline KD at the same budget.
    let val = d.join("store-val");
    run(&mut capture(&teacher, &ds, &val, "val", 8));
    let steps = "steps = 30\neval_every = 30\n";
    let vs = format!("val_signals = \"{}\"\n", val.display());
    let scfg = write_config(&d, "scratch", &ds, &format!("{steps}{vs}"));
    let kcfg = write_config(&d, "kd", &ds, &format!("{steps}{vs}[distill]\nstore = \"{}\"\n", a.display()));
    run(k3mini().arg("train").arg("--config").arg(&scfg).arg("--out").arg(d.join("scratch")));
    run(k3mini().arg("distill").arg("--config").arg(&kcfg).arg("--out").arg(d.join("kd")));
    let m = metrics(&d.join("kd"));
    let kd: Vec<f64> = m.iter().filter_map(|v| v["kd"].as_f64()).collect();
    assert!(kd.len() >= 5 && kd[kd.len() - 1] < kd[0] * 0.7, "the KD loss falls: {kd:?}");
    let top1 = |r: &str| last(&d.join(r), "val_teacher_top1");
    let kl = |r: &str| last(&d.join(r), "val_teacher_kl");
    let first_kl = metrics(&d.join("kd")).iter().find_map(|v| v["val_teacher_kl"].as_f64()).expect("step-0 KL");
    assert!(kl("kd") < first_kl * 0.8, "held-out KL to the teacher falls: {first_kl} -> {}", kl("kd"));
    eprintln!(
        "scratch: val {:.4} top1 {:.3} KL {:.3} | KD: val {:.4} top1 {:.3} KL {:.3}",
        last(&d.join("scratch"), "val_loss"),
        top1("scratch"),
        kl("scratch"),
        last(&d.join("kd"), "val_loss"),
        top1("kd"),
        kl("kd")
    );
    assert!(kl("kd") < kl("scratch"), "distillation brings the student nearer the teacher than scratch does");

    // Online: the teacher in process gives the same signals a store would.
    let ocfg = write_config(
        &d,
        "online",
        &ds,
        &format!("steps = 4\neval_every = 4\n[distill]\nteacher = \"{}\"\ntop_k = 8\n", teacher.display()),
    );
    run(k3mini().arg("distill").arg("--config").arg(&ocfg).arg("--out").arg(d.join("online")));
    assert!(last(&d.join("online"), "kd").is_finite());

    // Sequence mode: the teacher's answers to code prompts (plain continuation), then CE on them.
    let prompts = d.join("prompts.jsonl");
    let lines: Vec<String> =
        ["pub fn ", "impl ", "    /// ", "#[derive(", "use crate::", "    let ", "match ", "fn parse"]
            .iter()
            .map(|p| serde_json::json!({ "prompt": p }).to_string())
            .collect();
    std::fs::write(&prompts, lines.join("\n")).expect("prompts");
    let traj = d.join("store-traj");
    let text = run(k3mini()
        .args(["capture", "--threads", "1", "--top-k", "8", "--max-new", "20", "--raw-prompts", "--teacher"])
        .arg(&teacher)
        .arg("--prompts")
        .arg(&prompts)
        .arg("--out")
        .arg(&traj));
    assert!(text.contains("8 answered"), "{text}");
    let seq = write_config(
        &d,
        "sequence",
        &ds,
        &format!(
            "steps = 12\neval_every = 12\n{vs}[distill]\nmode = \"sequence\"\nstore = \"{}\"\nce_weight = 1.0\nkd_weight = 0.5\n",
            traj.display()
        ),
    );
    run(k3mini().arg("distill").arg("--config").arg(&seq).arg("--out").arg(d.join("sequence")));
    let m = metrics(&d.join("sequence"));
    let ce: Vec<f64> = m.iter().filter_map(|v| v["ce"].as_f64()).collect();
    assert!(ce.len() >= 2 && ce[ce.len() - 1] < ce[0], "CE on the teacher's answers falls: {ce:?}");
    // A store of windows is not trajectories: the error says how to capture them.
    let wrong = write_config(
        &d,
        "seq-wrong",
        &ds,
        &format!("steps = 2\n[distill]\nmode = \"sequence\"\nstore = \"{}\"\n", a.display()),
    );
    let out =
        k3mini().arg("distill").arg("--config").arg(&wrong).arg("--out").arg(d.join("w")).output().expect("spawn");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("--prompts"), "{e}");

    // On-policy from the KD student: it samples with our engine, the teacher scores, reverse KL.
    let kd_ckpt = d.join("kd/checkpoints/step-00000030");
    let onp = d.join("on-policy.toml");
    std::fs::write(
        &onp,
        format!(
            "[model]\ncheckpoint = \"{}\"\n[data]\ndataset = \"{}\"\nseq_len = 32\nbatch_size = 4\n[schedule]\nwarmup_steps = 1\n\
             [optim]\nlr = 1e-3\n[train]\nsteps = 6\nthreads = 1\neval_every = 6\neval_windows = 8\nlog_every = 1\n{vs}\
             [distill]\nmode = \"on-policy\"\nteacher = \"{}\"\nprompts = \"{}\"\ntop_k = 8\nmax_new = 12\nsync_every = 2\n",
            kd_ckpt.display(),
            ds.display(),
            teacher.display(),
            prompts.display()
        ),
    )
    .expect("write");
    run(k3mini()
        .arg("distill")
        .arg("--config")
        .arg(&onp)
        .arg("--out")
        .arg(d.join("on-policy"))
        .args(["--stop-at", "3"]));
    run(k3mini().arg("distill").arg("--resume").arg("--out").arg(d.join("on-policy")));
    let m = metrics(&d.join("on-policy"));
    let kd: Vec<f64> = m.iter().filter_map(|v| v["kd"].as_f64()).collect();
    assert!(kd.len() >= 6 && kd.iter().all(|x| x.is_finite() && *x >= 0.0), "reverse KL on own samples: {kd:?}");
    assert!(d.join("on-policy/policy/model.safetensors").exists(), "the sampler read the student's weights");
    let saved = std::fs::read_to_string(d.join("on-policy/train.toml")).expect("train.toml");
    assert!(saved.contains("reverse-kl"), "on-policy defaults to reverse KL: {saved}");

    // The KD student's greedy continuations, judged by the teacher.
    let text = run(k3mini()
        .args(["score", "--max-new", "8", "--model"])
        .arg(&kd_ckpt)
        .arg("--teacher")
        .arg(&teacher)
        .arg("--prompts")
        .arg(&prompts)
        .arg("--json")
        .arg(d.join("score.json")));
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("score.json")).expect("score.json")).expect("json");
    assert_eq!(s["scored"], 8, "{text}");
    let lp = s["teacher_logprob_per_token"].as_f64().expect("logprob");
    let agree = s["teacher_top1_agreement"].as_f64().expect("top1");
    assert!(lp < 0.0 && lp.is_finite() && (0.0..=1.0).contains(&agree), "{s}");

    // Importance-weighted Q4_0 and IQ4_NL from calibration on the train split: the same bytes as
    // the plain files, and judged by KL to f32 on held-out windows, no worse (on this small
    // model; the measured gains are in docs/quantization.md).
    let size = |p: &Path| std::fs::metadata(p).expect("gguf").len();
    let mut eval = k3mini();
    eval.args(["quant-eval", "--windows", "8", "--context", "32", "--reference"]).arg(&kd_ckpt);
    for ty in ["q4_0", "iq4_nl"] {
        let (plain, calibrated) = (d.join(format!("{ty}.gguf")), d.join(format!("{ty}-calib.gguf")));
        run(k3mini().args(["quantize", "--type", ty, "--model"]).arg(&kd_ckpt).arg("--out").arg(&plain));
        let text = run(k3mini()
            .args(["quantize", "--type", ty, "--calib-windows", "8", "--calib-context", "32", "--model"])
            .arg(&kd_ckpt)
            .arg("--calib")
            .arg(&ds)
            .arg("--out")
            .arg(&calibrated));
        assert!(text.contains("importance-weighted from calibration"), "{ty}: {text}");
        assert_eq!(size(&plain), size(&calibrated), "{ty}: the same file size");
        eval.arg("--model").arg(&plain).arg("--model").arg(&calibrated);
    }
    run(eval.arg("--data").arg(&ds).arg("--json").arg(d.join("quant.json")));
    let q: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("quant.json")).expect("quant.json")).expect("json");
    let kl = |i: usize| q["models"][i]["kl"].as_f64().expect("kl");
    assert!((0..4).all(|i| kl(i) > 0.0), "{q}");
    assert!(kl(1) <= kl(0) * 1.1, "calibrated Q4_0 is no worse than Q4_0: {q}");
    assert!(kl(3) <= kl(2) * 1.1, "calibrated IQ4_NL is no worse than IQ4_NL: {q}");

    // Evaluation-only prompts (HumanEval) never become training data.
    let he = d.join("he.jsonl");
    std::fs::write(&he, "{\"prompt\": \"def f(x):\\n\", \"eval_only\": true}\n").expect("he");
    let out = k3mini()
        .args(["capture", "--raw-prompts", "--teacher"])
        .arg(&teacher)
        .arg("--prompts")
        .arg(&he)
        .arg("--out")
        .arg(d.join("he-store"))
        .output()
        .expect("spawn");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("eval_only"), "{e}");
    let bad =
        std::fs::read_to_string(&onp).expect("toml").replace(&prompts.display().to_string(), &he.display().to_string());
    std::fs::write(d.join("bad-onp.toml"), bad).expect("write");
    let out = k3mini()
        .arg("distill")
        .arg("--config")
        .arg(d.join("bad-onp.toml"))
        .arg("--out")
        .arg(d.join("he-run"))
        .output()
        .expect("spawn");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("eval_only"), "{e}");

    // `distill` without a [distill] section says what is missing.
    let out =
        k3mini().arg("distill").arg("--config").arg(&scfg).arg("--out").arg(d.join("nod")).output().expect("spawn");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("[distill]"), "{e}");
}
