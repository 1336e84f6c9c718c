//! The OpenAI-compatible teacher against a real local server: llama-cpp-python's
//! `python -m llama_cpp.server` serving the SmolLM2 GGUF (scripts/setup-llama-cpp installs it).
//! The probe must find what that server really does (echo + logprobs, top-k keyed by string,
//! prompt log-probs shifted by one), and a capture through it must agree with our in-process
//! capture of the same windows. Skips with a message when the server is not installed.

mod common;

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use k3_data::signals::SignalStore;
use serde_json::Value;

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn server(py: &Path, gguf: &Path, port: u16) -> Option<Server> {
    let ok = Command::new(py).args(["-c", "import llama_cpp.server.app"]).output().is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("skipped: llama-cpp-python's server is not installed; run scripts/setup-llama-cpp");
        return None;
    }
    let child = Command::new(py)
        .args([
            "-m",
            "llama_cpp.server",
            "--logits_all",
            "true",
            "--n_threads",
            "1",
            "--port",
            &port.to_string(),
            "--model",
        ])
        .arg(gguf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the server");
    let s = Server(child);
    wait_for(port, 120);
    Some(s)
}

/// Block until something listens on `port`, failing after `secs`.
fn wait_for(port: u16, secs: u64) {
    let t0 = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed() < Duration::from_secs(secs), "nothing listened on port {port} within {secs} s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn probe_and_capture_through_llama_cpp_python_server() {
    let (Some(py), Some(gguf)) = (python(), teacher()) else { return };
    let port = 18000 + (std::process::id() % 1000) as u16;
    let Some(_srv) = server(&py, &gguf, port) else { return };
    let url = format!("http://127.0.0.1:{port}/v1");
    let d = scratch("endpoint");

    let out = run(k3mini().args(["probe", "--endpoint", &url, "--json"]).arg(d.join("probe.json")));
    let p: Value = serde_json::from_str(&std::fs::read_to_string(d.join("probe.json")).expect("json")).expect("json");
    assert_eq!(p["echo_logprobs"], true, "{out}");
    assert_eq!(p["top_logprobs_keys"], "string", "{out}");
    assert_eq!(p["alignment"], "shifted_by_one", "llama-cpp-python 0.3.36 shifts echoed log-probs: {out}");
    assert_eq!(p["chat_logprobs"], true, "{out}");
    eprintln!("{out}");

    // A dataset in the teacher's tokenizer, from a directory of this repository's sources.
    let ds = d.join("ds");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../k3-config/src");
    run(k3mini()
        .args(["data", "build", "--val-permille", "200", "--tokenizer"])
        .arg(&gguf)
        .arg("--out")
        .arg(&ds)
        .arg("--source")
        .arg(format!("dir:{}", src.display())));
    let cap = |teacher: &str, out: &PathBuf| {
        let mut c = k3mini();
        c.args(["capture", "--split", "train", "--windows", "3", "--seq-len", "48", "--top-k", "8", "--threads", "1"])
            .args(["--teacher", teacher, "--tokenizer"])
            .arg(&gguf)
            .arg("--data")
            .arg(&ds)
            .arg("--out")
            .arg(out);
        run(&mut c)
    };
    let (e, l) = (d.join("endpoint"), d.join("local"));
    let text = cap(&url, &e);
    eprintln!("{text}");
    cap(gguf.to_str().expect("utf-8 path"), &l);
    let (se, sl) = (SignalStore::open(&e).expect("endpoint store"), SignalStore::open(&l).expect("local store"));
    assert!(se.num_windows() >= 2, "windows 1 and 2 at least (window 0 may be retokenized): {text}");
    let (mut same_top1, mut n, mut dlp) = (0, 0, 0.0f64);
    for i in 0..se.num_windows() {
        let we = se.window(i).expect("window");
        let wl = (0..sl.num_windows())
            .map(|j| sl.window(j).expect("window"))
            .find(|w| w.index == we.index)
            .expect("same window");
        assert_eq!(we.tokens, wl.tokens);
        for (pe, pl) in we.positions.iter().zip(&wl.positions) {
            n += 1;
            if pe.ids[0] == pl.ids[0] {
                same_top1 += 1;
                dlp += (pe.logprobs[0] - pl.logprobs[0]).abs() as f64;
            }
        }
    }
    let agree = same_top1 as f64 / n as f64;
    eprintln!(
        "endpoint vs in-process: top-1 agreement {agree:.3} over {n} positions, mean |Δ top-1 logprob| {:.4}",
        dlp / same_top1.max(1) as f64
    );
    assert!(agree > 0.9, "the shifted entries were re-aligned: top-1 agreement {agree}");
    assert!(dlp / (same_top1.max(1) as f64) < 0.15, "and their log-probabilities match");

    // Trajectories: the teacher's greedy answers with per-token top-k, in process and via chat.
    let prompts = d.join("prompts.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"Write a Python function that adds two numbers.\"}\n").expect("prompts");
    let traj = |teacher: &str, out: &PathBuf, raw: bool| {
        let mut c = k3mini();
        c.args(["capture", "--max-new", "12", "--top-k", "8", "--threads", "1", "--teacher", teacher, "--tokenizer"])
            .arg(&gguf)
            .arg("--prompts")
            .arg(&prompts)
            .arg("--out")
            .arg(out);
        if raw {
            c.arg("--raw-prompts");
        }
        run(&mut c)
    };
    let (te, tl) = (d.join("traj-endpoint"), d.join("traj-local"));
    traj(&url, &te, false);
    traj(gguf.to_str().expect("utf-8 path"), &tl, false);
    let again = traj(&url, &te, false);
    assert!(again.contains("0 answered"), "a finished capture does not repeat prompts: {again}");
    // Raw prompts (no chat template): /v1/completions through the endpoint, our engine in process.
    let (re, rl) = (d.join("raw-endpoint"), d.join("raw-local"));
    traj(&url, &re, true);
    traj(gguf.to_str().expect("utf-8 path"), &rl, true);
    let first = |p: &PathBuf| SignalStore::open(p).expect("store").trajectory(0).expect("trajectory").generated;
    let (ge, gl) = (first(&re), first(&rl));
    assert_eq!(ge.first(), gl.first(), "both engines continue the raw prompt with the same greedy token");
    for store in [&te, &tl, &re, &rl] {
        let s = SignalStore::open(store).expect("store");
        assert_eq!(s.trajectories, 1);
        let t = s.trajectory(0).expect("trajectory");
        assert!(!t.generated.is_empty() && t.positions.len() == t.generated.len(), "{store:?}");
        // Greedy: each generated token is its position's top-1.
        let top1 = t.generated.iter().zip(&t.positions).filter(|(g, p)| p.ids[0] == **g).count();
        assert!(
            top1 * 10 >= t.generated.len() * 9,
            "{store:?}: {top1}/{} generated tokens are the top-1",
            t.generated.len()
        );
    }
}

/// vLLM's path: the prompt as token ids, `prompt_logprobs` keyed by id. A stand-in server
/// (tools/reference/mock_vllm.py, stdlib only) answers like vLLM and logs what it returned; every
/// stored position must be the top-k of the entry after its token, ids exact.
#[test]
fn capture_by_ids_through_vllm_prompt_logprobs() {
    let Some(py) = python() else { return };
    let d = scratch("vllm");
    let ds = d.join("ds");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../k3-config/src");
    run(k3mini()
        .args(["data", "build", "--tokenizer", "bpe:300", "--val-permille", "200", "--out"])
        .arg(&ds)
        .arg("--source")
        .arg(format!("dir:{}", src.display())));
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(ds.join("meta.json")).expect("meta")).expect("json");
    let vocab = meta["vocab_size"].as_u64().expect("vocab");
    // Not the llama.cpp test's port: the two tests run at the same time.
    let port = 19_000 + (std::process::id() % 1000) as u16;
    let log = d.join("answers.jsonl");
    let child = Command::new(&py)
        .arg(tool("mock_vllm.py"))
        .args([port.to_string(), vocab.to_string()])
        .arg(&log)
        .arg(ds.join("tokenizer.json"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the mock");
    let _server = Server(child);
    wait_for(port, 30);
    let url = format!("http://127.0.0.1:{port}/v1");
    let probe = run(k3mini().args(["probe", "--endpoint", &url]));
    let p: Value = serde_json::from_str(probe.trim()).expect("probe json");
    assert_eq!(p["prompt_logprobs"], true, "{probe}");
    let store = d.join("store");
    let text = run(k3mini()
        .args(["capture", "--top-k", "4", "--seq-len", "16", "--windows", "3", "--teacher", &url, "--tokenizer"])
        .arg(ds.join("tokenizer.json"))
        .arg("--data")
        .arg(&ds)
        .arg("--out")
        .arg(&store));
    assert!(text.contains("prompt_logprobs by token id"), "{text}");
    let answers: Vec<Value> =
        std::fs::read_to_string(&log).expect("log").lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    let s = SignalStore::open(&store).expect("store");
    assert_eq!(s.num_windows(), 3);
    for i in 0..3 {
        let w = s.window(i).expect("window");
        let ids: Vec<u64> = w.tokens.iter().map(|&t| t as u64).collect();
        let a = answers
            .iter()
            .filter_map(|a| Some((a, a["ids"].as_array()?)))
            .find(|(_, got)| got.iter().map(|x| x.as_u64()).eq(ids.iter().map(|&x| Some(x))))
            .map(|(a, _)| a)
            .expect("the server saw this window's ids");
        assert_eq!(w.positions.len(), 16);
        for (t, pos) in w.positions.iter().enumerate() {
            // The distribution after token t is entry t + 1.
            let mut want: Vec<(u32, f64)> = a["prompt_logprobs"][t + 1]
                .as_object()
                .expect("entry")
                .iter()
                .map(|(k, v)| (k.parse().expect("id"), v["logprob"].as_f64().expect("lp")))
                .collect();
            want.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
            want.truncate(4);
            let got: Vec<u32> = pos.ids.clone();
            assert_eq!(got, want.iter().map(|x| x.0).collect::<Vec<_>>(), "window {i} position {t}");
            for (l, (_, wl)) in pos.logprobs.iter().zip(&want) {
                assert!((*l as f64 - wl).abs() < 0.07, "window {i} position {t}: {l} vs {wl}");
            }
        }
    }

    // Trajectories from a reasoning model: the separate reasoning text is kept with the answer.
    let prompts = d.join("prompts.txt");
    std::fs::write(&prompts, "Write a function.\nExplain a loop.\n").expect("prompts");
    let traj = d.join("traj");
    let text = run(k3mini()
        .args(["capture", "--top-k", "3", "--max-new", "6", "--teacher", &url, "--tokenizer"])
        .arg(ds.join("tokenizer.json"))
        .arg("--prompts")
        .arg(&prompts)
        .arg("--out")
        .arg(&traj));
    assert!(text.contains("2 answered"), "{text}");
    let chats: Vec<Vec<u32>> = std::fs::read_to_string(&log)
        .expect("log")
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok()?.get("chat_ids").cloned())
        .map(|v| v.as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect())
        .collect();
    let s = SignalStore::open(&traj).expect("store");
    for i in 0..2 {
        let t = s.trajectory(i).expect("trajectory");
        assert_eq!(t.generated, chats[chats.len() - 2 + i], "trajectory {i}: the answer's ids");
        assert_eq!(t.reasoning.as_deref(), Some("The user wants 6 tokens; think, then answer."));
    }

    // Raw prompts need /v1/completions logprobs, which this server does not return for a plain
    // completion: the capture stops at the first answer with a message saying so.
    let out = k3mini()
        .args(["capture", "--raw-prompts", "--top-k", "3", "--max-new", "6", "--teacher", &url, "--tokenizer"])
        .arg(ds.join("tokenizer.json"))
        .arg("--prompts")
        .arg(&prompts)
        .arg("--out")
        .arg(d.join("raw"))
        .output()
        .expect("spawn");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("/v1/completions returned no logprobs"), "{e}");
}
