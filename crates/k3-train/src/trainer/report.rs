//! What a run shows while it trains: `metrics.jsonl` (one JSON object per logged step or
//! evaluation), a progress line (loss, tokens/s, ETA) and `loss.png`.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use crate::{Error, Result};

pub struct Metrics {
    path: PathBuf,
    file: std::fs::File,
    /// (tokens, mean training loss since the previous log line)
    pub train: Vec<(f64, f64)>,
    /// (tokens, validation loss)
    pub val: Vec<(f64, f64)>,
}

impl Metrics {
    /// Open `run/metrics.jsonl`, keeping only entries up to `keep_through_step` (the checkpoint a
    /// resumed run continues from; `None` starts afresh), so the file reads as one uninterrupted run.
    pub fn open(run: &Path, keep_through_step: Option<u64>) -> Result<Self> {
        let path = run.join("metrics.jsonl");
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        let mut kept = String::new();
        let (mut train, mut val) = (Vec::new(), Vec::new());
        for line in old.lines() {
            let Ok(v) = serde_json::from_str::<Value>(line) else { continue }; // a torn last line
            if v["step"].as_u64().zip(keep_through_step).is_none_or(|(s, keep)| s > keep) {
                continue;
            }
            let tok = v["tokens"].as_f64().unwrap_or(0.0);
            if let Some(l) = v["loss_avg"].as_f64() {
                train.push((tok, l));
            }
            if let Some(l) = v["val_loss"].as_f64() {
                val.push((tok, l));
            }
            kept.push_str(line);
            kept.push('\n');
        }
        k3_format::safetensors_io::write_atomic(&path, kept.as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
        Ok(Self { path, file, train, val })
    }

    pub fn write(&mut self, v: &Value) -> Result<()> {
        if let (Some(t), Some(l)) = (v["tokens"].as_f64(), v["loss_avg"].as_f64()) {
            self.train.push((t, l));
        }
        if let (Some(t), Some(l)) = (v["tokens"].as_f64(), v["val_loss"].as_f64()) {
            self.val.push((t, l));
        }
        writeln!(self.file, "{v}").map_err(|e| Error::Invalid(format!("{}: {e}", self.path.display())))
    }

    /// Redraw `loss.png` (training and validation loss against tokens).
    pub fn plot(&self, run: &Path, title: &str) {
        let chart = k3_plot::Chart {
            title: title.to_string(),
            x_label: "tokens (M)".into(),
            y_label: "loss (nats/token)".into(),
            series: vec![
                k3_plot::Series {
                    name: "train".into(),
                    points: self.train.iter().map(|&(t, l)| (t / 1e6, l)).collect(),
                    color: k3_plot::COLORS[0],
                },
                k3_plot::Series {
                    name: "validation".into(),
                    points: self.val.iter().map(|&(t, l)| (t / 1e6, l)).collect(),
                    color: k3_plot::COLORS[1],
                },
            ],
            ..Default::default()
        };
        if let Err(e) = k3_plot::write_png(&run.join("loss.png"), &chart, 800, 500) {
            eprintln!("warning: could not write {}: {e}", run.join("loss.png").display());
        }
    }
}

/// A one-line progress bar on stderr: redrawn in place on a terminal, a line per update otherwise.
pub struct Progress {
    start: Instant,
    first_step: u64,
    total: u64,
    tty: bool,
}

fn hms(s: f64) -> String {
    let s = s.max(0.0) as u64;
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

impl Progress {
    pub fn new(first_step: u64, total: u64) -> Self {
        Self { start: Instant::now(), first_step, total, tty: std::io::stderr().is_terminal() }
    }

    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Tokens/s over this session.
    pub fn rate(&self, step: u64, tokens_per_step: u64) -> f64 {
        (step - self.first_step) as f64 * tokens_per_step as f64 / self.elapsed().max(1e-9)
    }

    pub fn update(&self, step: u64, loss: f64, lr: f64, tokens_per_step: u64) {
        let done = step - self.first_step;
        let per_step = self.elapsed() / done.max(1) as f64;
        let eta = per_step * (self.total - step) as f64;
        let frac = step as f64 / self.total as f64;
        let width = 24;
        let filled = (frac * width as f64).round() as usize;
        let bar: String = "#".repeat(filled) + &"-".repeat(width - filled.min(width));
        let line = format!(
            "step {step}/{} [{bar}] {:>3.0}% loss {loss:.4} lr {lr:.2e} {:.0} tok/s eta {}",
            self.total,
            frac * 100.0,
            self.rate(step, tokens_per_step),
            hms(eta)
        );
        if self.tty {
            eprint!("\r{line}\x1b[K");
        } else {
            eprintln!("{line}");
        }
    }

    /// A message on its own line (finishing the in-place bar first).
    pub fn say(&self, msg: &str) {
        if self.tty {
            eprint!("\r\x1b[K");
        }
        eprintln!("{msg}");
    }
}

/// A JSON number that keeps an f32 loss exactly (f32 → f64 is exact; serde writes the shortest
/// round-tripping form).
pub fn num(x: f64) -> Value {
    serde_json::Number::from_f64(x).map(Value::Number).unwrap_or(Value::Null)
}

pub fn log_line(fields: Vec<(&str, Value)>) -> Value {
    let mut m = serde_json::Map::new();
    for (k, v) in fields {
        m.insert(k.to_string(), v);
    }
    json!(m)
}
