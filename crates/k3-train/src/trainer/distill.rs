//! The trainer's distillation side: where the teacher's top-k comes from (a store, offline, or a
//! teacher run in process, online), the batches that go with it, and the mixed KD + CE loss.
//!
//! Offline, row r of micro-batch m of step s is store window `hash(seed, s, m, r) mod windows`, so a
//! resumed run reads the same batches; its inputs are the window's first T tokens, its targets the
//! next T and its teacher the first T positions' top-k. Online, the batches are the ordinary
//! training batches and the teacher scores each row when it is drawn.

use std::path::Path;

use k3_data::dataset::Dataset;
use k3_data::signals::{SignalStore, TailPolicy, TopK};
use tch::{Kind, Tensor};

use crate::distill::{sparse_divergence, sparse_divergence_logp, top1_agreement, KdLoss, SparseTargets};
use crate::model::Model;
use crate::trainer::batches::{row_hash, Batch};
use crate::trainer::config::DistillSection;
use crate::{Error, Result};

/// A teacher run in process: the top-k log-probabilities after every position of each row.
/// (The CLI implements it with the pure-Rust engine; the trainer does not depend on it.)
pub trait Teacher {
    /// For each row of `t` tokens, `t` positions of top-`k` (natural-log, temperature 1).
    fn top_k(&mut self, rows: &[Vec<u32>], k: usize) -> std::result::Result<Vec<Vec<TopK>>, String>;
    /// The teacher's tokenizer hash and vocabulary size.
    fn tokenizer(&self) -> (String, usize);
}

pub enum Source {
    Store(Box<SignalStore>),
    Online(Box<dyn Teacher>),
}

pub struct Distiller {
    pub source: Source,
    pub loss: KdLoss,
    pub kd_weight: f64,
    pub ce_weight: f64,
    top_k: usize,
    capture_temperature: f64,
}

/// One micro-batch with its teacher signals.
pub struct KdBatch {
    pub batch: Batch,
    pub targets: SparseTargets,
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
    pub fn new(d: &DistillSection, ds: &Dataset, t: usize, teacher: Option<Box<dyn Teacher>>) -> Result<Self> {
        let (source, default_tail, capture_temperature) = match (&d.store, teacher) {
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
                (Source::Online(teacher), TailPolicy::Uniform, 1.0)
            }
            (None, None) => {
                return Err(Error::Invalid(
                    "distill.teacher is set but no teacher was loaded (use `k3mini distill`)".into(),
                ))
            }
        };
        let loss = KdLoss {
            divergence: d.divergence,
            beta: d.beta,
            temperature: d.temperature,
            tail: d.tail.unwrap_or(default_tail),
        };
        loss.validate()?;
        Ok(Self { source, loss, kd_weight: d.kd_weight, ce_weight: d.ce_weight, top_k: d.top_k, capture_temperature })
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
        };
        let refs: Vec<&TopK> = positions.iter().collect();
        let targets = SparseTargets::new(&refs, self.capture_temperature, self.loss.temperature)?;
        Ok(KdBatch { batch, targets })
    }

    /// `kd_weight · KD + ce_weight · CE` for logits [B, T, V].
    pub fn losses(&self, logits: &Tensor, kb: &KdBatch) -> KdLosses {
        let v = logits.size()[2];
        let flat = logits.view([-1, v]);
        let tau = self.loss.temperature;
        // One log-softmax over the vocabulary serves KD and, at τ = 1, CE (the [N, V] pass is the
        // expensive part of the loss at a 49K vocabulary).
        let lq = (flat.to_kind(Kind::Float) / tau).log_softmax(-1, Kind::Float);
        let kd = sparse_divergence_logp(&lq, &kb.targets, &self.loss);
        let targets = kb.batch.targets.reshape([-1]);
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
