//! The trainer's distillation side: where the teacher's top-k comes from (a store, offline, or a
//! teacher run in process, online), the batches that go with it, and the mixed KD + CE loss.
//!
//! Offline, row r of micro-batch m of step s is store window `hash(seed, s, m, r) mod windows`, so a
//! resumed run reads the same batches; its inputs are the window's first T tokens, its targets the
//! next T and its teacher the first T positions' top-k. Online, the batches are the ordinary
//! training batches and the teacher scores each row when it is drawn.
//!
//! Sequence mode draws stored trajectories (prompt + the teacher's answer) the same way; on-policy
//! mode draws a prompt, lets the student continue it (our engine with the student's weights,
//! reloaded from a checkpoint every `sync_every` steps) and has the teacher score the result. In
//! both, a row keeps up to T/2 prompt tokens before the answer and only answer positions enter
//! the loss.

use std::path::Path;

use k3_data::dataset::Dataset;
use k3_data::signals::{SignalStore, TailPolicy, TopK};
use tch::{Kind, Tensor};

use crate::distill::{sparse_divergence, sparse_divergence_logp, top1_agreement, KdLoss, SparseTargets};
use crate::model::Model;
use crate::trainer::batches::{row_hash, Batch};
use crate::trainer::config::{DistillMode, DistillSection};
use crate::{Error, Result};

/// A teacher run in process: the top-k log-probabilities after every position of each row.
/// (The CLI implements it with the pure-Rust engine; the trainer does not depend on it.)
pub trait Teacher {
    /// For each row of `t` tokens, `t` positions of top-`k` (natural-log, temperature 1).
    fn top_k(&mut self, rows: &[Vec<u32>], k: usize) -> std::result::Result<Vec<Vec<TopK>>, String>;
    /// The teacher's tokenizer hash and vocabulary size.
    fn tokenizer(&self) -> (String, usize);
}

/// The student's own sampler, for on-policy distillation (the CLI implements it with the
/// pure-Rust engine; the trainer only hands it checkpoints).
pub trait Policy {
    /// Load the student's weights from a checkpoint directory the trainer just wrote.
    fn load(&mut self, checkpoint: &Path) -> std::result::Result<(), String>;
    /// A continuation of `prompt`: up to `max_new` tokens sampled at `temperature` from `seed`,
    /// ending early after `stop` (which is kept).
    fn sample(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        temperature: f64,
        seed: u64,
        stop: u32,
    ) -> std::result::Result<Vec<u32>, String>;
}

pub enum Source {
    Store(Box<SignalStore>),
    Online(Box<dyn Teacher>),
    /// Sequence mode: the store's trajectories (indices of the non-empty ones).
    Trajectories(Box<SignalStore>, Vec<usize>),
    OnPolicy(Box<OnPolicy>),
}

pub struct OnPolicy {
    teacher: Box<dyn Teacher>,
    policy: Box<dyn Policy>,
    prompts: Vec<Vec<u32>>,
    /// The step whose weights the policy holds.
    synced: Option<u64>,
}

pub struct Distiller {
    pub source: Source,
    pub loss: KdLoss,
    pub kd_weight: f64,
    pub ce_weight: f64,
    top_k: usize,
    capture_temperature: f64,
    mode: DistillMode,
    max_new: usize,
    sample_temperature: f64,
    sync_every: u64,
    /// The dataset's document separator: where a sampled answer stops.
    separator: u32,
}

/// One micro-batch with its teacher signals.
pub struct KdBatch {
    pub batch: Batch,
    pub targets: SparseTargets,
    /// Sequence / on-policy: the flat [B·T] positions that enter the loss (the answer's), in the
    /// order of `targets`; `None`: every position.
    pub select: Option<Tensor>,
}

/// Rows of `t` inputs from (sequence, prompt length, top-k per answer token). A row keeps up to
/// t/2 prompt tokens before the answer; positions past the sequence are padded and, like the
/// prompt, left out of the loss.
fn answer_batch(seqs: Vec<(Vec<u32>, usize, Vec<TopK>)>, t: usize) -> Result<(Batch, Tensor, Vec<TopK>)> {
    let b = seqs.len();
    let mut rows = vec![0i64; b * (t + 1)];
    let (mut select, mut tops) = (Vec::new(), Vec::new());
    for (r, (seq, p, answer)) in seqs.into_iter().enumerate() {
        let start = seq.len().saturating_sub(t + 1).min(p.saturating_sub(t / 2));
        for (j, &x) in seq[start..].iter().take(t + 1).enumerate() {
            rows[r * (t + 1) + j] = x as i64;
        }
        for j in 0..t {
            let g = start + j + 1; // the target's index in `seq`
            if g >= p && g < seq.len() {
                select.push((r * t + j) as i64);
                tops.push(answer[g - p].clone());
            }
        }
    }
    if select.is_empty() {
        return Err(Error::Invalid("distill: no answer tokens in this batch (empty answers?)".into()));
    }
    let w = Tensor::from_slice(&rows).view([b as i64, (t + 1) as i64]);
    let batch = Batch { inputs: w.narrow(1, 0, t as i64), targets: w.narrow(1, 1, t as i64) };
    Ok((batch, Tensor::from_slice(&select), tops))
}

/// On-policy prompts: JSON lines with a "prompt" string, or one prompt per line.
fn read_prompts(path: &Path, ds: &Dataset) -> Result<Vec<Vec<u32>>> {
    let bad = |m: String| Error::Invalid(format!("distill.prompts {}: {m}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let tok = ds.tokenizer().map_err(|e| bad(e.to_string()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let prompt = match serde_json::from_str::<serde_json::Value>(line) {
            Ok(serde_json::Value::Object(o)) if o.get("eval_only") == Some(&serde_json::Value::Bool(true)) => {
                return Err(bad(format!(
                    "line {} is marked \"eval_only\" (e.g. HumanEval): evaluation prompts never become training data",
                    n + 1
                )))
            }
            Ok(serde_json::Value::Object(o)) => o
                .get("prompt")
                .and_then(|v| v.as_str())
                .ok_or_else(|| bad(format!("line {}: a JSON line needs a \"prompt\" string", n + 1)))?
                .to_string(),
            _ => line.to_string(),
        };
        let ids = tok.encode(&prompt).map_err(|e| bad(format!("line {}: {e}", n + 1)))?;
        if !ids.is_empty() {
            out.push(ids);
        }
    }
    if out.is_empty() {
        return Err(bad("holds no prompts".into()));
    }
    Ok(out)
}

/// The losses of one micro-batch: total (what backward sees), KD and CE parts, and top-1 agreement.
pub struct KdLosses {
    pub total: Tensor,
    pub kd: f64,
    pub ce: f64,
    pub top1: f64,
}

fn open_store(path: &Path, ds: &Dataset, t: usize) -> Result<SignalStore> {
    let what = |e: k3_data::Error| Error::Invalid(format!("distill.store {}: {e}", path.display()));
    let store = SignalStore::open(path).map_err(what)?;
    store.check_tokenizer(&ds.meta.tokenizer_hash, store.header.vocab_size).map_err(what)?;
    if store.num_windows() == 0 {
        return Err(Error::Invalid(format!(
            "distill.store {}: holds no windows yet; run `k3mini capture` first",
            path.display()
        )));
    }
    if store.header.window < t + 1 {
        return Err(Error::Invalid(format!(
            "distill.store {}: windows of {} tokens cannot feed data.seq_len = {t}; set data.seq_len <= {}",
            path.display(),
            store.header.window,
            store.header.window - 1
        )));
    }
    // The windows must be the dataset's own tokens (same data, same tokenizer).
    let w = store.window(0).map_err(what)?;
    let mut buf = Vec::new();
    if (w.start as usize) + w.tokens.len() <= ds.train.len {
        ds.train.read(w.start as usize, w.tokens.len(), &mut buf);
    }
    if buf != w.tokens {
        return Err(Error::Invalid(format!(
            "distill.store {}: its windows are not the tokens of {}'s train split (captured from {}); capture it \
             from this dataset",
            path.display(),
            ds.dir.display(),
            store.header.dataset.as_deref().unwrap_or("an unknown dataset")
        )));
    }
    Ok(store)
}

impl Distiller {
    pub fn new(
        d: &DistillSection,
        ds: &Dataset,
        t: usize,
        teacher: Option<Box<dyn Teacher>>,
        policy: Option<Box<dyn Policy>>,
    ) -> Result<Self> {
        let (source, default_tail, capture_temperature) = match (&d.store, teacher) {
            (Some(p), _) if d.mode == DistillMode::Sequence => {
                let what = |e: k3_data::Error| Error::Invalid(format!("distill.store {}: {e}", p.display()));
                let store = SignalStore::open(p).map_err(what)?;
                store.check_tokenizer(&ds.meta.tokenizer_hash, store.header.vocab_size).map_err(what)?;
                let mut keep = Vec::new();
                for i in 0..store.trajectories {
                    if !store.trajectory(i).map_err(what)?.generated.is_empty() {
                        keep.push(i);
                    }
                }
                if keep.is_empty() {
                    return Err(Error::Invalid(format!(
                        "distill.store {}: holds no trajectories with an answer; capture them with `k3mini capture \
                         --prompts FILE`",
                        p.display()
                    )));
                }
                let (tail, temp) = (store.header.tail, store.header.temperature as f64);
                (Source::Trajectories(Box::new(store), keep), tail, temp)
            }
            (Some(p), _) => {
                let store = open_store(p, ds, t)?;
                let (tail, temp) = (store.header.tail, store.header.temperature as f64);
                (Source::Store(Box::new(store)), tail, temp)
            }
            (None, Some(teacher)) => {
                let (hash, _) = teacher.tokenizer();
                if hash != ds.meta.tokenizer_hash {
                    return Err(Error::Invalid(format!(
                        "distill.teacher: its tokenizer differs from data.dataset {}'s; build the dataset with \
                         `k3mini data build --tokenizer TEACHER`",
                        ds.dir.display()
                    )));
                }
                match (d.mode, policy, &d.prompts) {
                    (DistillMode::OnPolicy, Some(policy), Some(pp)) => {
                        let prompts = read_prompts(pp, ds)?;
                        let s = OnPolicy { teacher, policy, prompts, synced: None };
                        (Source::OnPolicy(Box::new(s)), TailPolicy::Uniform, 1.0)
                    }
                    (DistillMode::OnPolicy, None, _) => {
                        return Err(Error::Invalid(
                            "distill.mode = \"on-policy\" needs the student's sampler (use `k3mini distill`)".into(),
                        ))
                    }
                    _ => (Source::Online(teacher), TailPolicy::Uniform, 1.0),
                }
            }
            (None, None) => {
                return Err(Error::Invalid(
                    "distill.teacher is set but no teacher was loaded (use `k3mini distill`)".into(),
                ))
            }
        };
        let loss = KdLoss {
            divergence: d.divergence(),
            beta: d.beta,
            temperature: d.temperature,
            tail: d.tail.unwrap_or(default_tail),
        };
        loss.validate()?;
        Ok(Self {
            source,
            loss,
            kd_weight: d.kd_weight,
            ce_weight: d.ce_weight,
            top_k: d.top_k,
            capture_temperature,
            mode: d.mode,
            max_new: d.max_new,
            sample_temperature: d.sample_temperature,
            sync_every: d.sync_every,
            separator: ds.meta.separator,
        })
    }

    /// Before step `step`: on-policy, hand the sampler the student's current weights when they
    /// are `sync_every` steps old (written to `run/policy`, the checkpoint being where the
    /// trainer and the engine meet). Returns the seconds spent.
    pub fn prepare(&mut self, model: &Model, run: &Path, step: u64) -> Result<f64> {
        let Source::OnPolicy(op) = &mut self.source else { return Ok(0.0) };
        if op.synced.is_some_and(|s| step < s + self.sync_every) {
            return Ok(0.0);
        }
        let t0 = std::time::Instant::now();
        let dir = run.join("policy");
        model.save(&dir)?;
        op.policy.load(&dir).map_err(|e| Error::Invalid(format!("distill: loading the student's sampler: {e}")))?;
        op.synced = Some(step);
        Ok(t0.elapsed().as_secs_f64())
    }

    pub fn mode(&self) -> DistillMode {
        self.mode
    }

    /// Micro-batch `micro` of step `step`: `b` rows of `t` tokens with the teacher's top-k.
    pub fn batch(&mut self, ds: &Dataset, seed: u64, step: u64, micro: u64, b: usize, t: usize) -> Result<KdBatch> {
        let (batch, positions) = match &mut self.source {
            Source::Store(store) => {
                let n = store.num_windows() as u64;
                let mut rows = Vec::with_capacity(b * (t + 1));
                let mut positions = Vec::with_capacity(b * t);
                for r in 0..b as u64 {
                    let h = row_hash(seed, step, micro, r);
                    let w = store
                        .window((h % n) as usize)
                        .map_err(|e| Error::Invalid(format!("distill.store {}: {e}", store.dir.display())))?;
                    rows.extend(w.tokens[..t + 1].iter().map(|&x| x as i64));
                    positions.extend(w.positions.into_iter().take(t));
                }
                let w = Tensor::from_slice(&rows).view([b as i64, (t + 1) as i64]);
                (Batch { inputs: w.narrow(1, 0, t as i64), targets: w.narrow(1, 1, t as i64) }, positions)
            }
            Source::Online(teacher) => {
                let batch = crate::trainer::batches::train_batch(&ds.train, seed, step, micro, b, t)?;
                let rows: Vec<Vec<u32>> = (0..b as i64)
                    .map(|r| {
                        Vec::<i64>::try_from(&batch.inputs.get(r))
                            .unwrap_or_default()
                            .iter()
                            .map(|&x| x as u32)
                            .collect()
                    })
                    .collect();
                let tops =
                    teacher.top_k(&rows, self.top_k).map_err(|e| Error::Invalid(format!("distill.teacher: {e}")))?;
                (batch, tops.into_iter().flatten().collect())
            }
            Source::Trajectories(store, keep) => {
                let mut seqs = Vec::with_capacity(b);
                for r in 0..b as u64 {
                    let i = keep[(row_hash(seed, step, micro, r) % keep.len() as u64) as usize];
                    let tr = store
                        .trajectory(i)
                        .map_err(|e| Error::Invalid(format!("distill.store {}: {e}", store.dir.display())))?;
                    let p = tr.prompt.len();
                    seqs.push(([tr.prompt, tr.generated].concat(), p, tr.positions));
                }
                let (batch, sel, tops) = answer_batch(seqs, t)?;
                return self.finish(batch, tops, Some(sel));
            }
            Source::OnPolicy(op) => {
                let mut seqs = Vec::with_capacity(b);
                for r in 0..b as u64 {
                    let h = row_hash(seed, step, micro, r);
                    let prompt = &op.prompts[(h % op.prompts.len() as u64) as usize];
                    // Keep room for the answer inside the row.
                    let prompt = &prompt[prompt.len().saturating_sub(t / 2)..];
                    let max_new = self.max_new.min(t + 1 - prompt.len());
                    let sample = op
                        .policy
                        .sample(prompt, max_new, self.sample_temperature, h, self.separator)
                        .map_err(|e| Error::Invalid(format!("distill: the student's sampler: {e}")))?;
                    if sample.is_empty() {
                        return Err(Error::Invalid("distill: the student's sampler returned no tokens".into()));
                    }
                    let seq = [prompt, &sample[..]].concat();
                    let mut tops = op
                        .teacher
                        .top_k(&[seq[..seq.len() - 1].to_vec()], self.top_k)
                        .map_err(|e| Error::Invalid(format!("distill.teacher: {e}")))?
                        .pop()
                        .unwrap_or_default();
                    let answer = tops.split_off(prompt.len() - 1);
                    seqs.push((seq, prompt.len(), answer));
                }
                let (batch, sel, tops) = answer_batch(seqs, t)?;
                return self.finish(batch, tops, Some(sel));
            }
        };
        self.finish(batch, positions, None)
    }

    fn finish(&self, batch: Batch, positions: Vec<TopK>, select: Option<Tensor>) -> Result<KdBatch> {
        let refs: Vec<&TopK> = positions.iter().collect();
        let targets = SparseTargets::new(&refs, self.capture_temperature, self.loss.temperature)?;
        Ok(KdBatch { batch, targets, select })
    }

    /// `kd_weight · KD + ce_weight · CE` for logits [B, T, V].
    pub fn losses(&self, logits: &Tensor, kb: &KdBatch) -> KdLosses {
        let v = logits.size()[2];
        let mut flat = logits.view([-1, v]);
        let mut targets = kb.batch.targets.reshape([-1]);
        if let Some(sel) = &kb.select {
            flat = flat.index_select(0, sel);
            targets = targets.index_select(0, sel);
        }
        let tau = self.loss.temperature;
        // One log-softmax over the vocabulary serves KD and, at τ = 1, CE (the [N, V] pass is the
        // expensive part of the loss at a 49K vocabulary).
        let lq = (flat.to_kind(Kind::Float) / tau).log_softmax(-1, Kind::Float);
        let kd = sparse_divergence_logp(&lq, &kb.targets, &self.loss);
        let ce = if tau == 1.0 {
            -lq.gather(1, &targets.unsqueeze(1), false).mean(Kind::Float)
        } else {
            flat.cross_entropy_for_logits(&targets)
        };
        let top1 = tch::no_grad(|| top1_agreement(&flat, &kb.targets));
        let (kdv, cev) = (kd.double_value(&[]), ce.double_value(&[]));
        let total = if self.ce_weight == 0.0 {
            kd * self.kd_weight
        } else if self.kd_weight == 0.0 {
            ce * self.ce_weight
        } else {
            kd * self.kd_weight + ce * self.ce_weight
        };
        KdLosses { total, kd: kdv, ce: cev, top1 }
    }
}

/// Agreement with the teacher on held-out windows: mean forward KL(teacher ‖ student) per token
/// (uniform tail, τ = 1) and the fraction of positions whose argmax is the teacher's top-1.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct TeacherEval {
    pub kl: f64,
    pub top1: f64,
    pub positions: usize,
}

pub fn evaluate_teacher(model: &Model, store: &SignalStore, windows: usize, batch: usize) -> Result<TeacherEval> {
    let n = windows.max(1).min(store.num_windows());
    if n == 0 {
        return Err(Error::Invalid(format!("train.val_signals {}: holds no windows", store.dir.display())));
    }
    let t = store.header.window - 1;
    let loss = KdLoss {
        divergence: crate::distill::Divergence::ForwardKl,
        beta: 0.5,
        temperature: 1.0,
        tail: TailPolicy::Uniform,
    };
    let (mut kl, mut top1, mut count) = (0.0, 0.0, 0usize);
    let idx: Vec<usize> = (0..n).collect();
    tch::no_grad(|| -> Result<()> {
        for chunk in idx.chunks(batch.max(1)) {
            let mut rows = Vec::new();
            let mut positions = Vec::new();
            for &i in chunk {
                let w = store.window(i).map_err(|e| Error::Invalid(format!("{}: {e}", store.dir.display())))?;
                rows.extend(w.tokens[..t].iter().map(|&x| x as i64));
                positions.extend(w.positions);
            }
            let inputs = Tensor::from_slice(&rows).view([chunk.len() as i64, t as i64]);
            let logits = model.forward(&inputs, None, false).logits;
            let v = logits.size()[2];
            let refs: Vec<&TopK> = positions.iter().collect();
            let targets = SparseTargets::new(&refs, store.header.temperature as f64, 1.0)?;
            let flat = logits.view([-1, v]).to_kind(Kind::Float);
            let m = refs.len();
            kl += sparse_divergence(&flat, &targets, &loss).double_value(&[]) * m as f64;
            top1 += top1_agreement(&flat, &targets) * m as f64;
            count += m;
        }
        Ok(())
    })?;
    Ok(TeacherEval { kl: kl / count.max(1) as f64, top1: top1 / count.max(1) as f64, positions: count })
}
