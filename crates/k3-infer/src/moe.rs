//! Mixture of experts (architecture.md §5): sigmoid router in f32 whose correction bias only
//! selects, optional group-limited routing, top-k renormalised and scaled weights, shared experts
//! on the full-width input, and K3's latent path (experts in a down-projected space, RMSNorm, up).
//! Only the selected experts run. Dims: T tokens, C hidden, E experts, k top-k, Lt latent.

use std::sync::Arc;

use k3_config::{Activation, MoeConfig};
use k3_kernels::ops;

use crate::ffn::{glu_inplace, Mlp};
use crate::linear::{Compute, Matrix};
use crate::routing::{Route, RoutingTap};
use crate::source::{ExpertPart, Source};
use crate::Result;

pub struct Expert {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

pub struct Moe {
    router: Matrix, // [E, C], f32
    bias: Vec<f32>, // [E] selection-only correction
    experts: Vec<Expert>,
    shared: Option<Mlp>,
    latent: Option<(Matrix, Matrix, Option<Vec<f32>>)>, // down [Lt, C], up [C, Lt], norm [Lt]
    cfg: MoeConfig,
    act: Activation,
    eps: f32,
    /// This layer's index in the stack (for the routing tap).
    layer: usize,
    /// Receives every routing decision when set (routing statistics); `None` costs nothing.
    tap: Option<Arc<dyn RoutingTap>>,
}

impl Moe {
    pub fn load(src: &Source, i: usize, hidden: usize, cfg: &MoeConfig, act: Activation, eps: f64) -> Result<Self> {
        let p = format!("model.layers.{i}.block_sparse_moe");
        let e = cfg.num_experts;
        let width = cfg.latent.map_or(hidden, |l| l.dim);
        let fe = cfg.intermediate_size;
        let experts = (0..e)
            .map(|x| {
                Ok(Expert {
                    gate: src.expert(i, x, ExpertPart::Gate, fe, width)?,
                    up: src.expert(i, x, ExpertPart::Up, fe, width)?,
                    down: src.expert(i, x, ExpertPart::Down, fe, width)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let fs = fe * cfg.num_shared_experts;
        let shared = if fs > 0 { Some(Mlp::load(src, &format!("{p}.shared_experts"), hidden, fs, act)?) } else { None };
        let latent = match cfg.latent {
            Some(l) => Some((
                src.matrix(&format!("{p}.routed_expert_down_proj.weight"), l.dim, hidden)?,
                src.matrix(&format!("{p}.routed_expert_up_proj.weight"), hidden, l.dim)?,
                if l.use_norm { Some(src.vector(&format!("{p}.routed_expert_norm.weight"), l.dim)?) } else { None },
            )),
            None => None,
        };
        let router = src.matrix(&format!("{p}.gate.weight"), e, hidden)?;
        let router = if router.ty == k3_kernels::quant::GgmlType::F32 {
            router
        } else {
            // The router runs in f32 (llama.cpp never quantizes it either).
            let mut v = vec![0f32; e * hidden];
            for r in 0..e {
                router.row_into(r, &mut v[r * hidden..(r + 1) * hidden]);
            }
            Matrix::from_f32(e, hidden, &v)
        };
        Ok(Self {
            router,
            bias: src.vector(&format!("{p}.gate.e_score_correction_bias"), e)?,
            experts,
            shared,
            latent,
            cfg: cfg.clone(),
            act,
            eps: eps as f32,
            layer: i,
            tap: None,
        })
    }

    pub fn set_tap(&mut self, tap: Option<Arc<dyn RoutingTap>>) {
        self.tap = tap;
    }

    /// The experts chosen for one token and their weights, from the router's sigmoid scores.
    ///
    /// # Shapes
    /// scores: [E] (σ of the router logits) → k (expert, weight) pairs
    pub fn select(&self, scores: &[f32]) -> Vec<(usize, f32)> {
        let c = &self.cfg;
        let e = scores.len();
        let mut choice: Vec<f32> = scores.iter().zip(&self.bias).map(|(s, b)| s + b).collect();
        if c.num_expert_group > 1 {
            let per = e / c.num_expert_group;
            let mut groups: Vec<(f32, usize)> = (0..c.num_expert_group)
                .map(|gi| {
                    let mut v: Vec<f32> = choice[gi * per..(gi + 1) * per].to_vec();
                    v.sort_by(|a, b| b.total_cmp(a));
                    (v[0] + v[1], gi)
                })
                .collect();
            groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            for &(_, gi) in &groups[c.topk_group..] {
                choice[gi * per..(gi + 1) * per].iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            }
        }
        let mut idx: Vec<usize> = (0..e).collect();
        idx.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
        idx.truncate(c.top_k);
        let mut w: Vec<f32> = idx.iter().map(|&x| scores[x]).collect();
        if c.renormalize {
            let s: f32 = w.iter().sum::<f32>() + 1e-20;
            w.iter_mut().for_each(|x| *x /= s);
        }
        idx.into_iter().zip(w).map(|(x, wv)| (x, wv * c.routed_scaling_factor as f32)).collect()
    }

    /// # Shapes
    /// x: [T, C] → [T, C]
    pub fn forward(&self, x: &[f32], t: usize, cx: Compute) -> Vec<f32> {
        let c = x.len() / t;
        let mut logits = self.router.apply(x, t, cx); // [T, E]
        logits.iter_mut().for_each(|v| *v = ops::sigmoid(*v));
        let z = match &self.latent {
            Some((down, _, _)) => down.apply(x, t, cx),
            None => x.to_vec(),
        };
        let width = z.len() / t;
        let e = self.experts.len();
        let mut acc = vec![0f32; t * width];
        let mut routes: Vec<Route> = Vec::new();
        for r in 0..t {
            let zr = &z[r * width..(r + 1) * width];
            for (ex, wv) in self.select(&logits[r * e..(r + 1) * e]) {
                let expert = &self.experts[ex];
                let [mut g, u]: [Vec<f32>; 2] =
                    Matrix::apply_many(&[&expert.gate, &expert.up], zr, 1, cx).try_into().expect("two products");
                glu_inplace(&mut g, &u, self.act);
                let y = expert.down.apply(&g, 1, cx);
                if self.tap.is_some() {
                    let out_norm = ops::dot(&y, &y).sqrt();
                    routes.push(Route { expert: ex as u32, weight: wv, out_norm });
                }
                ops::axpy(&mut acc[r * width..(r + 1) * width], wv, &y);
            }
        }
        if let Some(tap) = &self.tap {
            tap.record(self.layer, t, &logits, &routes);
        }
        let mut y = match &self.latent {
            Some((_, up, norm)) => {
                if let Some(nw) = norm {
                    let src = acc.clone();
                    ops::rmsnorm(&mut acc, &src, nw, self.eps);
                }
                up.apply(&acc, t, cx)
            }
            None => acc,
        };
        if let Some(s) = &self.shared {
            let sh = s.forward(x, t, cx);
            ops::axpy(&mut y, 1.0, &sh);
        }
        debug_assert_eq!(y.len(), t * c);
        y
    }
}
