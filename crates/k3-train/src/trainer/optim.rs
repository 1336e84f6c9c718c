//! Optimisers: AdamW, and Muon with the Moonlight recipe (Liu et al. 2025, "Muon is Scalable for
//! LLM Training"), with AdamW for the parameters Muon does not take.
//!
//! Muon, per 2-D hidden matrix W [A, B] with gradient G:
//! ```text
//! M ← μ M + G                        (momentum, μ = 0.95)
//! N ← G + μ M                        (Nesterov)
//! O ← NS5(N)                         (Newton–Schulz orthogonalisation, a, b, c = 3.4445, −4.7750, 2.0315)
//! W ← W (1 − η λ) − η · 0.2 √max(A, B) · O
//! ```
//! The 0.2 √max(A, B) factor matches the update RMS to AdamW's, so both share one learning rate η
//! and one weight decay λ. AdamW takes embeddings, the LM head and every non-matrix parameter
//! (norms, biases, `A_log`, `dt_bias`, conv kernels, AttnRes vectors); only matrices decay.
//! The router's score-correction bias has no gradient (see `balance`).

use std::collections::HashMap;
use std::path::Path;

use k3_format::safetensors_io::{write_safetensors, OwnedData, SafetensorsFile};
use k3_format::{tensor_specs, TensorKind};
use tch::{Kind, Tensor};

use crate::model::Model;
use crate::trainer::config::{OptimKind, OptimSection};
use crate::{Error, Result};

/// How one parameter is updated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    Muon,
    AdamW { decay: bool },
}

struct Param {
    name: String,
    tensor: Tensor,
    rule: Rule,
    /// Multiplies the learning rate (`optim.embed_lr_scale` for the embedding and head, else 1).
    lr_scale: f64,
}

pub struct Optimizer {
    params: Vec<Param>,
    cfg: OptimSection,
    /// Optimiser steps taken (AdamW's bias correction counts from 1).
    pub step: i64,
    /// `{name}.exp_avg`, `{name}.exp_avg_sq` (AdamW) and `{name}.momentum` (Muon).
    state: HashMap<String, Tensor>,
}

/// Newton–Schulz iteration towards the nearest semi-orthogonal matrix (Moonlight's quintic
/// coefficients). Works on the wide orientation so `X Xᵀ` is the small Gram matrix.
///
/// # Shapes
/// g: [A, B] → [A, B]
pub fn newton_schulz5(g: &Tensor, steps: usize) -> Tensor {
    let (a, b, c) = (3.4445, -4.7750, 2.0315);
    let tall = g.size()[0] > g.size()[1];
    let mut x = if tall { g.transpose(0, 1) } else { g.shallow_clone() };
    x = &x / (x.norm() + 1e-7);
    for _ in 0..steps {
        let gram = x.matmul(&x.transpose(0, 1)); // [A', A']
        let poly = &gram * b + gram.matmul(&gram) * c;
        x = &x * a + poly.matmul(&x);
    }
    if tall {
        x.transpose(0, 1).contiguous()
    } else {
        x
    }
}

/// The rule for a contract tensor under the chosen optimiser.
pub fn rule_for(name: &str, kind: TensorKind, shape: &[usize], opt: OptimKind) -> Rule {
    let matrix = shape.len() == 2 && shape.iter().all(|&d| d > 1);
    let is_head = name == "lm_head.weight";
    match kind {
        TensorKind::Linear | TensorKind::Router if matrix && !is_head && opt == OptimKind::Muon => Rule::Muon,
        TensorKind::Embedding | TensorKind::Linear | TensorKind::Router => Rule::AdamW { decay: matrix },
        TensorKind::Norm | TensorKind::Conv | TensorKind::Param => Rule::AdamW { decay: false },
    }
}

impl Optimizer {
    pub fn new(model: &Model, cfg: &OptimSection) -> Self {
        let vars = model.vs.variables();
        let params = tensor_specs(&model.config)
            .into_iter()
            .filter_map(|s| {
                let t = vars.get(&s.name)?.shallow_clone();
                let embedding = s.kind == TensorKind::Embedding || s.name == "lm_head.weight";
                t.requires_grad().then(|| Param {
                    rule: rule_for(&s.name, s.kind, &s.shape, cfg.kind),
                    lr_scale: if embedding { cfg.embed_lr_scale } else { 1.0 },
                    name: s.name,
                    tensor: t,
                })
            })
            .collect();
        Self { params, cfg: cfg.clone(), step: 0, state: HashMap::new() }
    }

    /// `(name, rule)` for every trained parameter, in contract order.
    pub fn rules(&self) -> Vec<(String, Rule)> {
        self.params.iter().map(|p| (p.name.clone(), p.rule)).collect()
    }

    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.tensor.zero_grad();
        }
    }

    /// The global gradient norm; scales gradients down to `max_norm` when it is exceeded.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        let sq: f64 = tch::no_grad(|| {
            self.params
                .iter()
                .map(|p| {
                    let g = p.tensor.grad();
                    if g.defined() {
                        g.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[])
                    } else {
                        0.0
                    }
                })
                .sum()
        });
        let norm = sq.sqrt();
        if max_norm > 0.0 && norm > max_norm && norm.is_finite() {
            let scale = max_norm / (norm + 1e-6);
            tch::no_grad(|| {
                for p in &self.params {
                    let mut g = p.tensor.grad();
                    if g.defined() {
                        let scaled = &g * scale;
                        g.copy_(&scaled);
                    }
                }
            });
        }
        norm
    }

    /// One update at learning rate `lr`.
    pub fn step(&mut self, lr: f64) {
        self.step += 1;
        let c = self.cfg.clone();
        let t = self.step as f64;
        let (bc1, bc2) = (1.0 - c.beta1.powf(t), 1.0 - c.beta2.powf(t));
        tch::no_grad(|| {
            for p in &self.params {
                let g = p.tensor.grad();
                if !g.defined() {
                    continue;
                }
                let lr = lr * p.lr_scale;
                if lr == 0.0 {
                    continue;
                }
                let mut w = p.tensor.shallow_clone();
                let decay = match p.rule {
                    Rule::Muon | Rule::AdamW { decay: true } => 1.0 - lr * c.weight_decay,
                    Rule::AdamW { decay: false } => 1.0,
                };
                let update = match p.rule {
                    Rule::Muon => {
                        let key = format!("{}.momentum", p.name);
                        let m = match self.state.get(&key) {
                            Some(m) => m * c.momentum + &g,
                            None => g.copy(),
                        };
                        let nesterov = &g + &m * c.momentum;
                        self.state.insert(key, m);
                        let sz = g.size();
                        let scale = 0.2 * (sz[0].max(sz[1]) as f64).sqrt();
                        newton_schulz5(&nesterov, c.ns_steps) * (lr * scale)
                    }
                    Rule::AdamW { .. } => {
                        let (km, kv) = (format!("{}.exp_avg", p.name), format!("{}.exp_avg_sq", p.name));
                        let m = match self.state.get(&km) {
                            Some(m) => m * c.beta1 + &g * (1.0 - c.beta1),
                            None => &g * (1.0 - c.beta1),
                        };
                        let v = match self.state.get(&kv) {
                            Some(v) => v * c.beta2 + g.square() * (1.0 - c.beta2),
                            None => g.square() * (1.0 - c.beta2),
                        };
                        let u = (&m / bc1) / ((&v / bc2).sqrt() + c.eps) * lr;
                        self.state.insert(km, m);
                        self.state.insert(kv, v);
                        u
                    }
                };
                let new = if decay == 1.0 { &w - update } else { &w * decay - update };
                w.copy_(&new);
            }
        });
    }

    /// Write the optimiser state (f32) atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut names: Vec<&String> = self.state.keys().collect();
        names.sort();
        let mut tensors = Vec::with_capacity(names.len());
        for n in names {
            let t = &self.state[n];
            let shape = t.size().iter().map(|&d| d as usize).collect();
            let data = Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1))?;
            tensors.push((n.clone(), shape, OwnedData::F32(data)));
        }
        let meta = HashMap::from([
            ("step".to_string(), self.step.to_string()),
            ("optimizer".to_string(), format!("{:?}", self.cfg.kind)),
        ]);
        write_safetensors(path, &tensors, Some(meta))?;
        Ok(())
    }

    /// Restore the state written by [`Optimizer::save`], checking every tensor against the model.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let f = SafetensorsFile::open(path)?;
        let meta = f.metadata();
        let kind = format!("{:?}", self.cfg.kind);
        if meta.get("optimizer") != Some(&kind) {
            return Err(Error::Invalid(format!(
                "{}: optimizer state is for {:?}, the run uses {kind}; resume with the run's own optim.kind",
                path.display(),
                meta.get("optimizer")
            )));
        }
        self.step = meta
            .get("step")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Error::Invalid(format!("{}: optimizer state has no `step` metadata", path.display())))?;
        self.state.clear();
        let by_name: HashMap<&str, &Param> = self.params.iter().map(|p| (p.name.as_str(), p)).collect();
        for name in f.names() {
            let (param, _) = name.rsplit_once('.').unwrap_or((name.as_str(), ""));
            let p = by_name.get(param).ok_or_else(|| {
                Error::Invalid(format!("{}: state `{name}` belongs to no trained parameter", path.display()))
            })?;
            let r =
                f.tensor(&name).ok_or_else(|| Error::Invalid(format!("{}: `{name}` unreadable", path.display())))?;
            let data = r.to_f32()?;
            let t = Tensor::from_slice(&data).to_kind(p.tensor.kind());
            if t.numel() != p.tensor.numel() {
                return Err(Error::Invalid(format!(
                    "{}: state `{name}` has {} values, parameter has {}",
                    path.display(),
                    t.numel(),
                    p.tensor.numel()
                )));
            }
            self.state.insert(name.clone(), t.reshape(p.tensor.size()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newton_schulz_output_is_near_orthogonal_in_both_orientations() {
        // Rectangular Gaussians are well conditioned (σ_min/σ_max ≈ 0.27 at 1:3), so five steps
        // reach every direction; a square one's near-zero singular values would need more.
        for (a, b) in [(16, 48), (48, 16)] {
            let g = crate::with_seed(a, || Tensor::randn([a, b], (Kind::Float, tch::Device::Cpu)));
            let o = newton_schulz5(&g, 5);
            assert_eq!(o.size(), vec![a, b]);
            // The quintic overshoots on purpose: singular values land in ~[0.7, 1.2], not at 1.
            let (_, s, _) = o.svd(true, false);
            let (lo, hi) = (s.min().double_value(&[]), s.max().double_value(&[]));
            assert!(lo > 0.5 && hi < 1.3, "[{a},{b}]: singular values in [{lo}, {hi}]");
        }
    }

    #[test]
    fn embed_lr_scale_scales_the_embedding_and_head_steps_only() {
        // One step at scales 0, 0.5 and 1 from the same model and gradients: the embedding and
        // head move by that share of the full step (AdamW's first step is ±lr per entry, so
        // exactly), every other parameter by the full step.
        let cfg = k3_config::presets::preset("tiny", Some(64)).expect("preset");
        let ids = Tensor::from_slice(&[3i64, 9, 27, 1, 40, 63, 5, 8]).view([1, 8]);
        // One model, restored before each step: `Model::init` seeds libtorch's global generator,
        // which tests running beside this one also draw from, so three inits could differ.
        let model = Model::init(&cfg, 0, tch::Device::Cpu).expect("init");
        let vars = model.vs.variables();
        let start: Vec<(String, Tensor)> = vars.iter().map(|(n, t)| (n.clone(), t.detach().copy())).collect();
        let moved = |scale: f64| -> (f64, f64) {
            tch::no_grad(|| {
                for (n, t) in &start {
                    vars[n].shallow_clone().copy_(t);
                }
            });
            let before = |n: &str| start.iter().find(|(m, _)| m == n).map(|(_, t)| t.shallow_clone()).expect("var");
            let section = OptimSection { embed_lr_scale: scale, ..OptimSection::default() };
            let mut opt = Optimizer::new(&model, &section);
            opt.zero_grad();
            model.forward(&ids, None, false).logits.square().mean(Kind::Float).backward();
            opt.step(1e-2);
            let diff = |n: &str| (&vars[n] - before(n)).abs().max().double_value(&[]);
            let emb = diff("model.embed_tokens.weight").max(diff("lm_head.weight"));
            (emb, diff("model.layers.0.mlp.up_proj.weight"))
        };
        let (full, half, frozen) = (moved(1.0), moved(0.5), moved(0.0));
        assert_eq!(frozen.0, 0.0, "a zero scale froze nothing");
        assert!(
            (half.0 / full.0 - 0.5).abs() < 0.02,
            "half scale moved the embedding {} of the full step",
            half.0 / full.0
        );
        // The body's Muon step goes through fifteen f32 matmuls whose summation order may follow
        // libtorch's thread split, so the three runs agree to rounding, not bit for bit; a scaled
        // step would be off by 50% or 100%.
        for (label, body) in [("half", half.1), ("frozen", frozen.1)] {
            assert!(
                full.1 > 0.0 && (body / full.1 - 1.0).abs() < 1e-3,
                "the body's step changed at the {label} scale: {body} vs {}",
                full.1
            );
        }
    }

    #[test]
    fn rules_follow_moonlight() {
        use OptimKind::{AdamW, Muon};
        assert_eq!(rule_for("model.layers.0.mlp.up_proj.weight", TensorKind::Linear, &[64, 32], Muon), Rule::Muon);
        assert_eq!(rule_for("lm_head.weight", TensorKind::Linear, &[100, 32], Muon), Rule::AdamW { decay: true });
        assert_eq!(
            rule_for("model.embed_tokens.weight", TensorKind::Embedding, &[100, 32], Muon),
            Rule::AdamW { decay: true }
        );
        assert_eq!(rule_for("x.A_log", TensorKind::Param, &[1, 1, 4, 1], Muon), Rule::AdamW { decay: false });
        assert_eq!(rule_for("x.q_conv1d.weight", TensorKind::Conv, &[64, 1, 4], Muon), Rule::AdamW { decay: false });
        assert_eq!(rule_for("x.norm.weight", TensorKind::Norm, &[64], Muon), Rule::AdamW { decay: false });
        assert_eq!(rule_for("x.gate.weight", TensorKind::Router, &[8, 64], Muon), Rule::Muon);
        assert_eq!(rule_for("x.up_proj.weight", TensorKind::Linear, &[64, 32], AdamW), Rule::AdamW { decay: true });
    }
}
