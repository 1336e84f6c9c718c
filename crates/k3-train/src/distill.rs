//! Knowledge-distillation losses against a sparse (top-k) teacher.
//!
//! The teacher gives, per position, its top-k token ids with log-probabilities and the log of the
//! mass outside them (`k3_data::signals::TopK`). The student gives logits z [N, V]. At temperature τ
//! the student distribution is q = softmax(z / τ); the teacher's stored log-probabilities (captured
//! at τ_c) are re-tempered by τ_c / τ, the tail treated as one more outcome, and renormalised.
//!
//! The teacher's distribution p over the vocabulary is completed by a tail policy:
//! - `Renormalize`: p is the top-k renormalised to 1 and 0 elsewhere; divergences that need p > 0
//!   everywhere (reverse KL, JSD) compare it with the student renormalised on the same support;
//! - `Ignore`: the top-k probabilities as they are; only support terms enter the loss;
//! - `Uniform`: the tail mass spread evenly over the other V − k tokens; every divergence is then
//!   exact on the whole vocabulary.
//!
//! Divergences (mean over positions, times τ² so gradients keep their scale across τ):
//! - forward KL(p ‖ q) = Σ p (log p − log q): mode-covering, the classic KD loss;
//! - reverse KL(q ‖ p) = Σ q (log q − log p): mode-seeking;
//! - generalised JSD(β) = β KL(p ‖ m) + (1 − β) KL(q ‖ m), m = β p + (1 − β) q (GKD, Agarwal et al.).
//!
//! [`dense_divergence`] is the reference: the same divergences on full [N, V] distributions.

use k3_data::signals::{TailPolicy, TopK};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::{Error, Result};

/// The smallest tail log-mass a loss sees.
pub const TAIL_FLOOR: f64 = -20.0;

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Divergence {
    ForwardKl,
    ReverseKl,
    Jsd,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KdLoss {
    pub divergence: Divergence,
    /// JSD's β in (0, 1).
    pub beta: f64,
    /// Distillation temperature τ.
    pub temperature: f64,
    pub tail: TailPolicy,
}

impl KdLoss {
    pub fn validate(&self) -> Result<()> {
        if self.divergence == Divergence::Jsd && (self.beta.is_nan() || self.beta <= 0.0 || self.beta >= 1.0) {
            return Err(Error::Invalid(format!("distill.beta = {}: JSD needs 0 < beta < 1", self.beta)));
        }
        if self.temperature.is_nan() || self.temperature <= 0.0 {
            return Err(Error::Invalid(format!("distill.temperature = {}: must be > 0", self.temperature)));
        }
        Ok(())
    }
}

/// The teacher's top-k for N positions, as tensors.
pub struct SparseTargets {
    /// [N, k] int64.
    pub ids: Tensor,
    /// [N, k] f32: log p on the support at the loss temperature (after re-tempering; not renormalised
    /// to the support).
    pub logp: Tensor,
    /// [N] f32: log of the tail mass at the loss temperature (−inf when k = V).
    pub tail_logmass: Tensor,
    /// The teacher's top-1 id per position, [N] int64.
    pub top1: Tensor,
}

impl SparseTargets {
    /// Stack positions (each with the same k), re-tempering from `capture_temperature` to
    /// `temperature`.
    pub fn new(positions: &[&TopK], capture_temperature: f64, temperature: f64) -> Result<Self> {
        let k = positions.first().map_or(0, |p| p.ids.len());
        if k == 0 || positions.iter().any(|p| p.ids.len() != k || p.logprobs.len() != k) {
            return Err(Error::Invalid("teacher signals: positions with differing or zero top-k".into()));
        }
        let n = positions.len() as i64;
        let mut ids = Vec::with_capacity(positions.len() * k);
        let mut lp: Vec<f32> = Vec::with_capacity(positions.len() * k);
        let mut tail = Vec::with_capacity(positions.len());
        for p in positions {
            ids.extend(p.ids.iter().map(|&i| i as i64));
            lp.extend(&p.logprobs);
            tail.push(p.tail_logmass);
        }
        let ids = Tensor::from_slice(&ids).view([n, k as i64]);
        let lp = Tensor::from_slice(&lp).view([n, k as i64]);
        // A tail of exactly 0 (a top-k holding all the mass, up to rounding) would make the
        // uniform-tail and reverse terms 0·(−∞); floor it at e^-20 (2e-9), far below anything a
        // loss can feel.
        let tail = Tensor::from_slice(&tail).view([n, 1]).clamp_min(TAIL_FLOOR);
        // Re-temper (s = τ_c / τ) and renormalise support + tail together; this also removes the
        // drift of the store's quantisation.
        let s = capture_temperature / temperature;
        let all = Tensor::cat(&[&lp * s, &tail * s], 1);
        let lz = all.logsumexp([1i64].as_slice(), true);
        let logp = &lp * s - &lz;
        let tail_logmass = (&tail * s - &lz).squeeze_dim(1);
        let top1 = ids.select(1, 0);
        Ok(Self { ids, logp, tail_logmass, top1 })
    }

    pub fn k(&self) -> i64 {
        self.ids.size()[1]
    }
}

/// x·log(x/y) from log-values, with 0·log 0 = 0 (log-values are floored at −10⁴, where exp is
/// exactly 0, so no −∞ · 0 reaches autograd).
fn xlogx_over_y(lx: &Tensor, ly: &Tensor) -> Tensor {
    let lx = lx.clamp_min(-1e4);
    &lx.exp() * (&lx - ly.clamp_min(-1e4))
}

/// The sparse KD loss of student `logits` [N, V] against `t`, averaged over positions (× τ²).
pub fn sparse_divergence(logits: &Tensor, t: &SparseTargets, loss: &KdLoss) -> Tensor {
    let lq_all = (logits.to_kind(Kind::Float) / loss.temperature).log_softmax(-1, Kind::Float);
    sparse_divergence_logp(&lq_all, t, loss)
}

/// [`sparse_divergence`] from the student's log-probabilities at the loss temperature,
/// log_softmax(z / τ) [N, V], for callers that reuse them (e.g. for cross-entropy).
pub fn sparse_divergence_logp(lq_all: &Tensor, t: &SparseTargets, loss: &KdLoss) -> Tensor {
    let v = lq_all.size()[1];
    let k = t.k();
    let tau = loss.temperature;
    let lq = lq_all.gather(1, &t.ids, false); // [N, k]
    let rest = (v - k) as f64;
    // The teacher on the support, per policy.
    let (lp, lq_s) = match loss.tail {
        TailPolicy::Renormalize => {
            let lp = &t.logp - t.logp.logsumexp([1i64].as_slice(), true);
            // The student renormalised on the support (for reverse KL and JSD).
            let lq_s = &lq - lq.logsumexp([1i64].as_slice(), true);
            (lp, lq_s)
        }
        TailPolicy::Ignore | TailPolicy::Uniform => (t.logp.shallow_clone(), lq.shallow_clone()),
    };
    // log of each off-support token's teacher probability (uniform tail), [N, 1].
    let lu = (&t.tail_logmass - rest.max(1.0).ln()).unsqueeze(1);
    let uniform_tail = loss.tail == TailPolicy::Uniform && rest > 0.0;
    let per_pos = match loss.divergence {
        Divergence::ForwardKl => {
            // Σ_S p (log p − log q): the full student log q keeps pushing off-support mass down.
            let mut d = (xlogx_over_y(&lp, &lq)).sum_dim_intlist(1, false, Kind::Float);
            if uniform_tail {
                // Σ_{i∉S} u (log u − log q_i) = u·(rest·log u − (Σ_V log q − Σ_S log q)).
                let u = lu.exp().squeeze_dim(1);
                let sum_off = lq_all.sum_dim_intlist(1, false, Kind::Float) - lq.sum_dim_intlist(1, false, Kind::Float);
                d = d + &u * (lu.squeeze_dim(1) * rest - sum_off);
            }
            d
        }
        Divergence::ReverseKl => {
            // Σ q (log q − log p) on the support (renormalised student under Renormalize).
            let mut d = xlogx_over_y(&lq_s, &lp).sum_dim_intlist(1, false, Kind::Float);
            if uniform_tail {
                // Σ_{i∉S} q_i (log q_i − log u) = Σ_V q log q − Σ_S q log q − log u·(1 − Σ_S q).
                let neg_h = (lq_all.exp() * lq_all).sum_dim_intlist(1, false, Kind::Float);
                let on_s = (lq.exp() * &lq).sum_dim_intlist(1, false, Kind::Float);
                let mass_off = 1.0 - lq.exp().sum_dim_intlist(1, false, Kind::Float);
                d = d + neg_h - on_s - lu.squeeze_dim(1) * mass_off;
            }
            d
        }
        Divergence::Jsd => {
            let b = loss.beta;
            let jsd_terms = |lp: &Tensor, lq: &Tensor| {
                // log m = log(β p + (1 − β) q), elementwise.
                let lm = Tensor::stack(&[lp + b.ln(), lq + (1.0 - b).ln()], 0).logsumexp([0i64].as_slice(), false);
                xlogx_over_y(lp, &lm) * b + xlogx_over_y(lq, &lm) * (1.0 - b)
            };
            let mut d = jsd_terms(&lp, &lq_s).sum_dim_intlist(1, false, Kind::Float);
            if uniform_tail {
                // Off the support the teacher is u everywhere: evaluate over V and mask the support.
                let off = Tensor::ones_like(lq_all).scatter_value(1, &t.ids, 0.0);
                let lp_full = lu.expand_as(lq_all);
                d = d + (jsd_terms(&lp_full, lq_all) * off).sum_dim_intlist(1, false, Kind::Float);
            }
            d
        }
    };
    per_pos.mean(Kind::Float) * (tau * tau)
}

/// The reference: a divergence between student logits [N, V] and dense teacher log-probabilities
/// [N, V] (already at the loss temperature), averaged over positions (× τ²).
pub fn dense_divergence(logits: &Tensor, teacher_logp: &Tensor, divergence: Divergence, beta: f64, tau: f64) -> Tensor {
    let lq = (logits.to_kind(Kind::Float) / tau).log_softmax(-1, Kind::Float);
    let lp = teacher_logp.to_kind(Kind::Float);
    let d = match divergence {
        Divergence::ForwardKl => xlogx_over_y(&lp, &lq),
        Divergence::ReverseKl => xlogx_over_y(&lq, &lp),
        Divergence::Jsd => {
            let m = (lp.exp() * beta + lq.exp() * (1.0 - beta)).log();
            xlogx_over_y(&lp, &m) * beta + xlogx_over_y(&lq, &m) * (1.0 - beta)
        }
    };
    d.sum_dim_intlist(1, false, Kind::Float).mean(Kind::Float) * (tau * tau)
}

/// Fraction of positions where the student's argmax is the teacher's top-1.
pub fn top1_agreement(logits: &Tensor, t: &SparseTargets) -> f64 {
    logits.argmax(-1, false).eq_tensor(&t.top1).to_kind(Kind::Double).mean(Kind::Double).double_value(&[])
}

#[cfg(test)]
mod tests;
