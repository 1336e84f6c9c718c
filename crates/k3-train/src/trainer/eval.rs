//! Validation loss over fixed windows of the validation split, at any context length.

use k3_data::shards::TokenSet;
use tch::{Kind, Tensor};

use crate::model::Model;
use crate::trainer::batches::{val_batch, val_starts};
use crate::Result;

#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalResult {
    /// Mean next-token cross-entropy (nats) over every position of every window.
    pub loss: f64,
    pub tokens: usize,
    pub windows: usize,
    pub context: usize,
    /// Mean loss over each quarter of the window's positions (the last quarter shows whether a
    /// model uses context beyond what it was trained on).
    pub by_quarter: [f64; 4],
}

impl EvalResult {
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// Token losses [B, T] (nats) of a forward pass.
pub fn token_losses(model: &Model, inputs: &Tensor, targets: &Tensor) -> Tensor {
    let logits = model.forward(inputs, None, false).logits; // [B,T,V]
    let logp = logits.log_softmax(-1, Kind::Float);
    -logp.gather(-1, &targets.unsqueeze(-1), false).squeeze_dim(-1)
}

/// Evaluate `windows` windows of `context` tokens, `batch` at a time.
pub fn evaluate(model: &Model, set: &TokenSet, context: usize, windows: usize, batch: usize) -> Result<EvalResult> {
    let starts = val_starts(set, windows, context)?;
    let mut pos_sum = vec![0f64; context];
    tch::no_grad(|| {
        for chunk in starts.chunks(batch.max(1)) {
            let b = val_batch(set, chunk, context);
            let l = token_losses(model, &b.inputs, &b.targets).to_kind(Kind::Double).sum_dim_intlist(0, false, None);
            let v = Vec::<f64>::try_from(&l).unwrap_or_default();
            for (s, x) in pos_sum.iter_mut().zip(v) {
                *s += x;
            }
        }
    });
    let n = starts.len() as f64;
    let q = context.div_ceil(4);
    let mut by_quarter = [0.0; 4];
    for (i, bq) in by_quarter.iter_mut().enumerate() {
        let part = &pos_sum[(i * q).min(context)..((i + 1) * q).min(context)];
        *bq = if part.is_empty() { f64::NAN } else { part.iter().sum::<f64>() / (part.len() as f64 * n) };
    }
    Ok(EvalResult {
        loss: pos_sum.iter().sum::<f64>() / (context as f64 * n),
        tokens: context * starts.len(),
        windows: starts.len(),
        context,
        by_quarter,
    })
}
