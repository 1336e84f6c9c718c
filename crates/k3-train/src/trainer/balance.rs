//! Expert load balancing without an auxiliary loss: the router's score-correction bias b (used
//! only to *choose* experts, never to weigh them) is moved after each optimiser step.
//!
//! - aux-free (DeepSeek-V3 §2.1.2): `b_e ← b_e + γ · sign(mean_e' load_e' − load_e)`;
//! - quantile: each expert e should be chosen by a fraction k/E of tokens; its biased score's
//!   (1 − k/E)-quantile τ_e over the step's tokens is the threshold it would need. Experts whose
//!   threshold sits above the mean are over-chosen: `b_e ← b_e − γ · (τ_e − mean τ) / std τ`,
//!   a step proportional to how far off it is (converges faster than sign steps on skewed routers).

use tch::{Kind, Tensor};

use crate::kimi::Ffn;
use crate::model::{Model, Net};
use crate::moe::Routing;
use crate::trainer::config::{Balance, MoeSection};

/// Per-MoE-layer statistics accumulated over the micro-batches of one optimiser step.
#[derive(Default)]
pub struct LoadStats {
    /// (layer, tokens routed to each expert [E] f64, Σ of τ_e over micro-batches [E], micro-batches)
    layers: Vec<(usize, Tensor, Tensor, i64)>,
}

impl LoadStats {
    /// Add one forward's routing (`routing` as returned in `Output`).
    pub fn add(&mut self, model: &Model, routing: &[(usize, Routing)]) {
        tch::no_grad(|| {
            for (li, r) in routing {
                let Some(bias) = correction_bias(model, *li) else { continue };
                let e = bias.size()[0];
                let counts = r.idx.view([-1]).bincount::<Tensor>(None, e).to_kind(Kind::Double);
                let k = r.idx.size()[1] as f64;
                let q = 1.0 - k / e as f64;
                let biased = (&r.scores + &bias).to_kind(Kind::Double); // [N,E]
                let tau = biased.quantile_scalar(q, 0, false, "linear"); // [E]
                match self.layers.iter_mut().find(|(l, ..)| l == li) {
                    Some((_, c, t, n)) => {
                        *c = &*c + counts;
                        *t = &*t + tau;
                        *n += 1;
                    }
                    None => self.layers.push((*li, counts, tau, 1)),
                }
            }
        });
    }

    /// Each MoE layer's load: the fraction of routed slots every expert took, in layer order.
    pub fn loads(&self) -> Vec<(usize, Vec<f64>)> {
        self.layers
            .iter()
            .map(|(l, c, ..)| {
                let total = c.sum(Kind::Double).double_value(&[]).max(1.0);
                let v = Vec::<f64>::try_from(&(c / total)).unwrap_or_default();
                (*l, v)
            })
            .collect()
    }

    /// Move the correction biases (after the optimiser step).
    pub fn update_biases(&self, model: &Model, cfg: &MoeSection) {
        if cfg.balance == Balance::None {
            return;
        }
        tch::no_grad(|| {
            for (li, counts, tau_sum, n) in &self.layers {
                let Some(bias) = correction_bias(model, *li) else { continue };
                let step = match cfg.balance {
                    Balance::AuxFree => (counts.mean(Kind::Double) - counts).sign() * cfg.bias_rate,
                    Balance::Quantile => {
                        let tau = tau_sum / *n as f64;
                        let centred = &tau - tau.mean(Kind::Double);
                        -(centred / (tau.std(false) + 1e-12)) * cfg.bias_rate
                    }
                    Balance::None => unreachable!("returned above"),
                };
                let mut b = bias.shallow_clone();
                let new = &b + step.to_kind(b.kind());
                b.copy_(&new);
            }
        });
    }
}

/// The score-correction bias of MoE layer `layer`, if it is one.
pub fn correction_bias(model: &Model, layer: usize) -> Option<Tensor> {
    match &model.net {
        Net::Kimi(m) => match &m.blocks.get(layer)?.ffn {
            Ffn::Moe(moe) => Some(moe.correction_bias.shallow_clone()),
            Ffn::Dense(_) => None,
        },
        Net::Llama(_) => None,
    }
}
