//! The training config: a TOML file whose every field has a default except the dataset, with
//! `--set section.key=value` overrides. Unknown fields are errors that name the field.
//!
//! ```toml
//! [model]
//! preset = "tiny"                 # or checkpoint = "path/to/checkpoint"
//! config = { intermediate_size = 640 }   # HF config.json fields over the preset's
//! [data]
//! dataset = "data/code"           # built by `k3mini data build`
//! seq_len = 256
//! batch_size = 8
//! [train]
//! steps = 2000
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub model: ModelSection,
    pub data: DataSection,
    #[serde(default)]
    pub optim: OptimSection,
    #[serde(default)]
    pub schedule: ScheduleSection,
    #[serde(default)]
    pub train: TrainSection,
    #[serde(default)]
    pub moe: MoeSection,
    /// Knowledge distillation from a teacher (absent: plain next-token training).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distill: Option<DistillSection>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// A preset name (`k3mini presets`); its vocabulary is set to the dataset's.
    pub preset: Option<String>,
    /// Or start from an existing checkpoint directory.
    pub checkpoint: Option<PathBuf>,
    /// HF `config.json` fields laid over the preset's (e.g. `intermediate_size`).
    #[serde(default)]
    pub config: toml::Table,
    /// Seed of the parameter initialisation.
    #[serde(default)]
    pub seed: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// A dataset directory built by `k3mini data build`.
    pub dataset: PathBuf,
    #[serde(default = "d_seq_len")]
    pub seq_len: usize,
    /// Sequences per micro-batch.
    #[serde(default = "d_batch")]
    pub batch_size: usize,
    /// Micro-batches per optimiser step.
    #[serde(default = "one")]
    pub grad_accum: usize,
    /// Seed of the batch order.
    #[serde(default)]
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OptimKind {
    /// Muon for hidden matrices, AdamW for the rest (Moonlight).
    Muon,
    /// AdamW for everything.
    AdamW,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimSection {
    #[serde(default = "d_optim")]
    pub kind: OptimKind,
    /// Peak learning rate (shared by Muon and AdamW, see `optim`).
    #[serde(default = "d_lr")]
    pub lr: f64,
    #[serde(default = "d_wd")]
    pub weight_decay: f64,
    #[serde(default = "d_beta1")]
    pub beta1: f64,
    #[serde(default = "d_beta2")]
    pub beta2: f64,
    #[serde(default = "d_eps")]
    pub eps: f64,
    /// Muon momentum.
    #[serde(default = "d_momentum")]
    pub momentum: f64,
    /// Newton–Schulz iterations.
    #[serde(default = "d_ns")]
    pub ns_steps: usize,
    /// Global gradient-norm clip (0 = off).
    #[serde(default = "d_clip")]
    pub clip: f64,
    /// Learning-rate multiplier for the embedding and the LM head (weight decay follows it).
    /// Below 1 keeps an inherited embedding (`k3mini init --embed-from`) close to where it started.
    #[serde(default = "d_one_f")]
    pub embed_lr_scale: f64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// Warmup, stable, then linear decay over the last `decay_fraction` of steps.
    Wsd,
    /// Warmup, then cosine decay to `min_lr_fraction`.
    Cosine,
    /// Warmup, then constant.
    Constant,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSection {
    #[serde(default = "d_sched")]
    pub kind: ScheduleKind,
    #[serde(default = "d_warmup")]
    pub warmup_steps: u64,
    #[serde(default = "d_decay")]
    pub decay_fraction: f64,
    #[serde(default = "d_min_lr")]
    pub min_lr_fraction: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    #[serde(default = "d_steps")]
    pub steps: u64,
    /// Compute threads (0 = all cores).
    #[serde(default)]
    pub threads: usize,
    #[serde(default = "d_log")]
    pub log_every: u64,
    #[serde(default = "d_eval")]
    pub eval_every: u64,
    /// Validation windows of `seq_len` tokens per evaluation.
    #[serde(default = "d_eval_windows")]
    pub eval_windows: usize,
    #[serde(default = "d_eval")]
    pub checkpoint_every: u64,
    /// Checkpoints kept (the newest).
    #[serde(default = "d_keep")]
    pub keep_checkpoints: usize,
    /// A teacher-signal store over held-out windows (`k3mini capture --split val`): each
    /// evaluation also reports KL to the teacher and top-1 agreement with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_signals: Option<PathBuf>,
}

/// What the student learns from (`distill.mode`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum DistillMode {
    /// The teacher's top-k on corpus windows (a store of windows, or a teacher online).
    #[default]
    Logits,
    /// The teacher's own answers (trajectories in the store, `k3mini capture --prompts`): CE on
    /// the answer tokens, plus KD against the top-k stored with them when `kd_weight` > 0.
    Sequence,
    /// The student's own samples on `prompts`, scored by the teacher online (teacher-forced
    /// top-k); the loss is the divergence (default reverse KL) on the sampled tokens.
    OnPolicy,
}

/// `[distill]`: the loss is `kd_weight · KD + ce_weight · CE`, with KD a divergence against the
/// teacher's top-k (see `crate::distill`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DistillSection {
    #[serde(default)]
    pub mode: DistillMode,
    /// On-policy: the prompts (JSON lines with a "prompt" string, or one per line), encoded with
    /// the dataset's tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompts: Option<PathBuf>,
    /// On-policy: tokens sampled per prompt.
    #[serde(default = "d_max_new")]
    pub max_new: usize,
    /// On-policy: the student's sampling temperature.
    #[serde(default = "one_f")]
    pub sample_temperature: f64,
    /// On-policy: reload the sampler with the student's weights every this many steps.
    #[serde(default = "d_sync_every")]
    pub sync_every: u64,
    /// Offline: a teacher-signal store captured over this dataset's train split (`k3mini capture`).
    pub store: Option<PathBuf>,
    /// Online: a teacher (GGUF or checkpoint) run in process on every batch.
    pub teacher: Option<PathBuf>,
    /// Online: top-k kept per position.
    #[serde(default = "d_top_k")]
    pub top_k: usize,
    /// Default: forward KL; reverse KL on-policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub divergence: Option<crate::distill::Divergence>,
    /// JSD's β.
    #[serde(default = "d_jsd_beta")]
    pub beta: f64,
    #[serde(default = "one_f")]
    pub temperature: f64,
    /// The tail policy; default: the store's recommendation (online: uniform).
    pub tail: Option<k3_data::signals::TailPolicy>,
    #[serde(default = "one_f")]
    pub kd_weight: f64,
    #[serde(default)]
    pub ce_weight: f64,
}

impl DistillSection {
    /// The divergence in use: the configured one, or the mode's default.
    pub fn divergence(&self) -> crate::distill::Divergence {
        self.divergence.unwrap_or(match self.mode {
            DistillMode::OnPolicy => crate::distill::Divergence::ReverseKl,
            _ => crate::distill::Divergence::ForwardKl,
        })
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Balance {
    /// DeepSeek-V3's auxiliary-loss-free bias update: b_e += γ · sign(mean load − load_e).
    AuxFree,
    /// Move each expert's bias so its score quantile at the target load meets the others'.
    Quantile,
    None,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MoeSection {
    #[serde(default = "d_balance")]
    pub balance: Balance,
    /// γ: the bias step per optimiser step.
    #[serde(default = "d_bias_rate")]
    pub bias_rate: f64,
}

fn d_seq_len() -> usize {
    256
}
fn d_batch() -> usize {
    8
}
fn one() -> usize {
    1
}
fn d_optim() -> OptimKind {
    OptimKind::Muon
}
fn d_lr() -> f64 {
    3e-3
}
fn d_wd() -> f64 {
    0.1
}
fn d_beta1() -> f64 {
    0.9
}
fn d_beta2() -> f64 {
    0.95
}
fn d_eps() -> f64 {
    1e-8
}
fn d_momentum() -> f64 {
    0.95
}
fn d_ns() -> usize {
    5
}
fn d_clip() -> f64 {
    1.0
}
fn d_one_f() -> f64 {
    1.0
}
fn d_sched() -> ScheduleKind {
    ScheduleKind::Wsd
}
fn d_warmup() -> u64 {
    50
}
fn d_decay() -> f64 {
    0.2
}
fn d_min_lr() -> f64 {
    0.1
}
fn d_steps() -> u64 {
    1000
}
fn d_log() -> u64 {
    10
}
fn d_eval() -> u64 {
    100
}
fn d_eval_windows() -> usize {
    32
}
fn d_keep() -> usize {
    3
}
fn d_top_k() -> usize {
    32
}
fn d_max_new() -> usize {
    64
}
fn d_sync_every() -> u64 {
    1
}
fn d_jsd_beta() -> f64 {
    0.5
}
fn one_f() -> f64 {
    1.0
}
fn d_balance() -> Balance {
    Balance::AuxFree
}
fn d_bias_rate() -> f64 {
    1e-3
}

impl Default for OptimSection {
    fn default() -> Self {
        empty_section()
    }
}
impl Default for ScheduleSection {
    fn default() -> Self {
        empty_section()
    }
}
impl Default for TrainSection {
    fn default() -> Self {
        empty_section()
    }
}
impl Default for MoeSection {
    fn default() -> Self {
        empty_section()
    }
}

/// A section with every field at its serde default.
fn empty_section<T: serde::de::DeserializeOwned>() -> T {
    toml::Table::new().try_into().expect("every field of this section has a default")
}

/// Parse `value` as a TOML value (number, bool, array, inline table, quoted string), or take it as
/// a bare string.
fn parse_value(value: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {value}")) {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(value.into())),
        Err(_) => toml::Value::String(value.into()),
    }
}

/// Apply `section.key=value` to a parsed TOML table (creating tables on the way).
pub fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<()> {
    let (key, value) = assignment.split_once('=').ok_or_else(|| {
        Error::Invalid(format!("--set `{assignment}`: expected section.key=value, e.g. optim.lr=1e-3"))
    })?;
    let parts: Vec<&str> = key.trim().split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(Error::Invalid(format!("--set `{assignment}`: empty key part")));
    }
    let mut t = table;
    for p in &parts[..parts.len() - 1] {
        let entry = t.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry
            .as_table_mut()
            .ok_or_else(|| Error::Invalid(format!("--set `{assignment}`: `{p}` is not a table")))?;
    }
    t.insert(parts[parts.len() - 1].to_string(), parse_value(value.trim()));
    Ok(())
}

impl TrainConfig {
    /// Parse TOML text plus overrides; `origin` names the source in errors.
    pub fn from_toml(text: &str, overrides: &[String], origin: &str) -> Result<Self> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| Error::Invalid(format!("{origin}: invalid TOML: {e}")))?;
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let mut cfg: TrainConfig = table
            .try_into()
            .map_err(|e: toml::de::Error| Error::Invalid(format!("{origin}: {}", e.to_string().trim_end())))?;
        // The mode's default divergence is written out, so a resumed run compares like with like.
        if let Some(d) = cfg.distill.as_mut() {
            d.divergence = Some(d.divergence());
        }
        cfg.validate(origin)?;
        Ok(cfg)
    }

    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Invalid(format!("{}: {e}; pass a training config with --config", path.display())))?;
        Self::from_toml(&text, overrides, &path.display().to_string())
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a TrainConfig always serialises")
    }

    fn validate(&self, origin: &str) -> Result<()> {
        let bad = |field: &str, why: &str| Err(Error::Invalid(format!("{origin}: `{field}` {why}")));
        match (&self.model.preset, &self.model.checkpoint) {
            (None, None) => return bad("model", "needs `preset` (see `k3mini presets`) or `checkpoint`"),
            (Some(_), Some(_)) => return bad("model", "takes `preset` or `checkpoint`, not both"),
            _ => {}
        }
        if self.model.checkpoint.is_some() && !self.model.config.is_empty() {
            return bad("model.config", "only applies to a preset; a checkpoint keeps its own config.json");
        }
        if self.data.seq_len < 2 {
            return bad("data.seq_len", "must be at least 2");
        }
        if self.data.batch_size == 0 || self.data.grad_accum == 0 {
            return bad("data.batch_size / data.grad_accum", "must be at least 1");
        }
        if !(self.optim.lr > 0.0 && self.optim.lr.is_finite()) {
            return bad("optim.lr", "must be a positive number");
        }
        if !(self.optim.embed_lr_scale >= 0.0 && self.optim.embed_lr_scale.is_finite()) {
            return bad("optim.embed_lr_scale", "must be a number >= 0 (0 freezes the embedding and head)");
        }
        if !(0.0..1.0).contains(&self.optim.beta1) || !(0.0..1.0).contains(&self.optim.beta2) {
            return bad("optim.beta1 / optim.beta2", "must be in [0, 1)");
        }
        if !(0.0..=1.0).contains(&self.schedule.decay_fraction) || !(0.0..=1.0).contains(&self.schedule.min_lr_fraction)
        {
            return bad("schedule.decay_fraction / schedule.min_lr_fraction", "must be in [0, 1]");
        }
        if self.train.steps == 0 {
            return bad("train.steps", "must be at least 1");
        }
        if self.train.log_every == 0 || self.train.eval_every == 0 || self.train.checkpoint_every == 0 {
            return bad("train.log_every / eval_every / checkpoint_every", "must be at least 1");
        }
        if self.train.keep_checkpoints == 0 {
            return bad("train.keep_checkpoints", "must be at least 1");
        }
        if let Some(d) = &self.distill {
            match (&d.store, &d.teacher) {
                (None, None) => {
                    return bad("distill", "needs `store` (offline, from `k3mini capture`) or `teacher` (online)")
                }
                (Some(_), Some(_)) => return bad("distill", "takes `store` or `teacher`, not both"),
                _ => {}
            }
            match d.mode {
                DistillMode::Sequence if d.store.is_none() => {
                    return bad(
                        "distill.mode",
                        "\"sequence\" trains on stored trajectories: set `store` (from `k3mini capture --prompts`)",
                    )
                }
                DistillMode::OnPolicy if d.teacher.is_none() || d.prompts.is_none() => {
                    return bad(
                        "distill.mode",
                        "\"on-policy\" needs `teacher` (it scores the student's samples) and `prompts`",
                    )
                }
                DistillMode::OnPolicy if d.ce_weight > 0.0 => {
                    return bad(
                        "distill.ce_weight",
                        "on-policy trains on the student's own samples, where CE has no target; set it to 0",
                    )
                }
                DistillMode::OnPolicy if d.max_new == 0 || d.sync_every == 0 => {
                    return bad("distill.max_new / distill.sync_every", "must be at least 1")
                }
                DistillMode::Logits if d.prompts.is_some() => {
                    return bad("distill.prompts", "only applies to mode = \"on-policy\"")
                }
                _ => {}
            }
            if !(d.kd_weight >= 0.0 && d.ce_weight >= 0.0 && d.kd_weight + d.ce_weight > 0.0) {
                return bad("distill.kd_weight / distill.ce_weight", "must be >= 0 and not both 0");
            }
            if d.top_k == 0 {
                return bad("distill.top_k", "must be at least 1");
            }
            let l = crate::distill::KdLoss {
                divergence: d.divergence(),
                beta: d.beta,
                temperature: d.temperature,
                tail: k3_data::signals::TailPolicy::Uniform,
            };
            l.validate().map_err(|e| Error::Invalid(format!("{origin}: {e}")))?;
        }
        Ok(())
    }

    /// Tokens per optimiser step.
    pub fn tokens_per_step(&self) -> u64 {
        (self.data.seq_len * self.data.batch_size * self.data.grad_accum) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let text = "[model]\npreset = \"tiny\"\n[data]\ndataset = \"d\"\n";
        let c = TrainConfig::from_toml(text, &["optim.lr=1e-3".into(), "schedule.kind=cosine".into()], "t")
            .expect("valid config");
        assert_eq!(c.optim.lr, 1e-3);
        assert_eq!(c.optim.kind, OptimKind::Muon);
        assert_eq!(c.schedule.kind, ScheduleKind::Cosine);
        assert_eq!(c.data.seq_len, 256);
        let back = TrainConfig::from_toml(&c.to_toml(), &[], "t").expect("valid config");
        assert_eq!(back, c);
    }

    #[test]
    fn errors_name_the_field() {
        let text = "[model]\npreset = \"tiny\"\n[data]\ndataset = \"d\"\n";
        let e = TrainConfig::from_toml(text, &["optim.lrr=1".into()], "cfg.toml").expect_err("must fail").to_string();
        assert!(e.contains("lrr") && e.contains("cfg.toml"), "{e}");
        let e =
            TrainConfig::from_toml(text, &["optim.kind=sgd".into()], "cfg.toml").expect_err("must fail").to_string();
        assert!(e.contains("sgd") && e.contains("muon"), "{e}");
        let e = TrainConfig::from_toml(text, &["optim.lr=-1".into()], "cfg.toml").expect_err("must fail").to_string();
        assert!(e.contains("optim.lr"), "{e}");
        let e =
            TrainConfig::from_toml("[data]\ndataset = \"d\"\n", &[], "cfg.toml").expect_err("must fail").to_string();
        assert!(e.contains("model"), "{e}");
    }
}
