//! llama.cpp's side of `k3mini bench infer`: `tools/bench/llama_cpp_bench.py` (llama-cpp-python)
//! kept running with the GGUF loaded and asked for one measurement at a time, so that the
//! benchmark can alternate the two engines measurement by measurement.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Output, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// A running `llama_cpp_bench.py` with the model loaded.
pub struct Llama {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    /// The script's stderr, read back when it fails.
    err_file: PathBuf,
    pub version: String,
}

/// The project venv's python (`K3MINI_PYTHON`, else `python3`) and the llama.cpp side's script.
fn python_and_script() -> (String, PathBuf) {
    let py = std::env::var("K3MINI_PYTHON").unwrap_or_else(|_| "python3".into());
    (py, Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/bench/llama_cpp_bench.py"))
}

/// Run the llama.cpp side's script once on `model` with `threads` threads and `args` (a mode of
/// its own, e.g. `--logits`), to its end: its output on success, `None` (with a message saying
/// what is `skipped`) when llama_cpp is not installed, an error naming the mode otherwise.
fn run_script(model: &Path, threads: usize, args: &[&std::ffi::OsStr], skipped: &str) -> Result<Option<Output>> {
    let (py, script) = python_and_script();
    let out = Command::new(&py)
        .arg(&script)
        .arg(model)
        .args(["--threads", &threads.to_string()])
        .args(args)
        .output()
        .with_context(|| format!("running {py} {}", script.display()))?;
    match out.status.code() {
        Some(0) => Ok(Some(out)),
        Some(3) => {
            eprintln!("llama.cpp is not installed in {py}; run scripts/setup-llama-cpp ({skipped})");
            Ok(None)
        }
        code => Err(anyhow::anyhow!(
            "{} {} exited ({code:?}) on {}:\n{}",
            script.display(),
            args.first().map_or(std::borrow::Cow::Borrowed(""), |a| a.to_string_lossy()),
            model.display(),
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// Seconds of each of `n` loads of `model` in llama.cpp (`Llama(...)` with a context of 512, each
/// freed before the next), in a process of its own (`llama_cpp_bench.py --time-loads`); `None`
/// (with a message) when llama_cpp is not installed.
pub fn load_times(model: &Path, threads: usize, n: usize) -> Result<Option<Vec<f64>>> {
    let n_arg = n.to_string();
    let args = ["--time-loads".as_ref(), n_arg.as_ref()];
    let Some(out) = run_script(model, threads, &args, "our load time only")? else { return Ok(None) };
    let line = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(line.trim()).with_context(|| format!("bad answer to --time-loads: {line}"))?;
    let secs: Vec<f64> = v["load_seconds"].as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
    if secs.len() != n {
        bail!("llama_cpp_bench.py timed {} loads of {} where {n} were asked", secs.len(), model.display());
    }
    Ok(Some(secs))
}

/// llama.cpp's logits for each window of ids (a fresh sequence each), [T, V] per window, through
/// `llama_cpp_bench.py --logits`; `None` (with a message) when llama_cpp is not installed.
pub fn window_logits(model: &Path, windows: &[Vec<u32>], threads: usize, v: usize) -> Result<Option<Vec<Vec<f32>>>> {
    let dir = std::env::temp_dir().join(format!("k3mini-quality-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let list = dir.join("windows.txt");
    let text: Vec<String> =
        windows.iter().map(|w| w.iter().map(u32::to_string).collect::<Vec<_>>().join(",")).collect();
    std::fs::write(&list, text.join("\n")).with_context(|| format!("writing {}", list.display()))?;
    let args = ["--logits".as_ref(), list.as_os_str(), dir.as_os_str()];
    let result = match run_script(model, threads, &args, "its quality is skipped") {
        Ok(Some(_)) => windows
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let f = dir.join(format!("window-{i}.f32"));
                let bytes = std::fs::read(&f).with_context(|| format!("reading {}", f.display()))?;
                if bytes.len() != 4 * w.len() * v {
                    bail!("{}: {} bytes, not {} tokens x {v} f32 logits", f.display(), bytes.len(), w.len());
                }
                Ok(Some(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
            })
            .collect::<Result<Option<Vec<_>>>>(),
        other => other.map(|_| None),
    };
    let _ = std::fs::remove_dir_all(&dir);
    result
}

impl Llama {
    /// Start the script on `model` with `threads` threads and a context of `n_ctx`, over the
    /// comma-separated ids in `ids_file`. `None` (with a message) when llama_cpp is not installed.
    pub fn start(model: &Path, ids_file: &Path, threads: usize, n_ctx: usize) -> Result<Option<Self>> {
        let (py, script) = python_and_script();
        let err_file = ids_file.with_extension(format!("llama-{threads}.err"));
        let err = std::fs::File::create(&err_file).with_context(|| format!("creating {}", err_file.display()))?;
        let mut child = Command::new(&py)
            .arg(&script)
            .arg(model)
            .args(["--threads", &threads.to_string(), "--n-ctx", &n_ctx.to_string(), "--ids"])
            .arg(ids_file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .with_context(|| format!("running {py} {}", script.display()))?;
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        let (Some(stdin), Some(stdout)) = (stdin, stdout) else {
            bail!("{}: no pipes to the script", script.display())
        };
        let mut me = Self { child, stdin, out: BufReader::new(stdout), err_file, version: String::new() };
        let mut line = String::new();
        me.out.read_line(&mut line)?;
        if line.trim().is_empty() {
            let code = me.child.wait()?.code();
            if code == Some(3) {
                eprintln!("llama.cpp is not installed in {py}; run scripts/setup-llama-cpp (ours only)");
                let _ = std::fs::remove_file(&me.err_file);
                return Ok(None);
            }
            bail!("{} exited ({code:?}) before loading {}:\n{}", script.display(), model.display(), me.stderr());
        }
        let ready: Value =
            serde_json::from_str(line.trim()).with_context(|| format!("bad first line from the script: {line}"))?;
        me.version = ready["llama_cpp_python"].as_str().unwrap_or("?").to_string();
        Ok(Some(me))
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err_file).unwrap_or_default()
    }

    /// Send one command and read its JSON answer.
    fn ask(&mut self, cmd: &str) -> Result<Value> {
        let sent = writeln!(self.stdin, "{cmd}").and_then(|_| self.stdin.flush());
        let mut line = String::new();
        let got = sent.is_ok() && self.out.read_line(&mut line).is_ok_and(|n| n > 0);
        if !got {
            bail!("llama_cpp_bench.py stopped on `{cmd}`:\n{}", self.stderr());
        }
        serde_json::from_str(line.trim()).with_context(|| format!("bad answer to `{cmd}` from the script: {line}"))
    }

    fn seconds(&mut self, cmd: &str) -> Result<f64> {
        let v = self.ask(cmd)?;
        v["seconds"].as_f64().with_context(|| format!("no seconds in the answer to `{cmd}`: {v}"))
    }

    /// Tokens/s of a fresh sequence's prefill of the first `n` ids.
    pub fn prefill(&mut self, n: usize) -> Result<f64> {
        Ok(n as f64 / self.seconds(&format!("prefill {n}"))?)
    }

    /// Append ids lo..hi to the sequence untimed (a fresh sequence when lo is 0).
    pub fn feed(&mut self, lo: usize, hi: usize) -> Result<()> {
        self.ask(&format!("feed {lo} {hi}")).map(drop)
    }

    /// Tokens/s of ids lo..hi decoded one at a time.
    pub fn decode(&mut self, lo: usize, hi: usize) -> Result<f64> {
        Ok((hi - lo) as f64 / self.seconds(&format!("decode {lo} {hi}"))?)
    }

    /// `b` fresh sequences with room for `total` positions each, each fed its first `ctx` ids
    /// (sequence i's id at position p: ids[(p·b + i) mod len]), untimed.
    pub fn batch_start(&mut self, b: usize, ctx: usize, total: usize) -> Result<()> {
        self.ask(&format!("batch_start {b} {ctx} {total}")).map(drop)
    }

    /// Aggregate tokens/s of the `b` sequences decoded together for `steps` steps at positions
    /// `lo..` (one `llama_decode` of b tokens a step).
    pub fn batch(&mut self, b: usize, lo: usize, steps: usize) -> Result<f64> {
        Ok((b * steps) as f64 / self.seconds(&format!("batch {b} {lo} {steps}"))?)
    }

    /// Stop the script; its peak RSS and its resident set before the model loaded (MiB).
    pub fn quit(mut self) -> Result<(f64, f64)> {
        let v = self.ask("quit")?;
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.err_file);
        let mib = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        Ok((mib("peak_rss_mib"), mib("start_rss_mib")))
    }
}

impl Drop for Llama {
    fn drop(&mut self) {
        // After `quit` the child has exited and this is a no-op; on an error path, stop it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
