//! Mixture of experts (architecture.md §5): sigmoid router in f32 whose correction bias only
//! selects, optional group-limited routing, top-k renormalised and scaled weights, shared experts
//! on the full-width input, and K3's latent path (experts in a down-projected space, RMSNorm, up).
//! Only the selected experts run. Dims: T tokens, C hidden, E experts, k top-k, Lt latent.

use std::sync::Arc;

use k3_config::{Activation, MoeConfig};
use k3_kernels::ops;

use crate::ffn::{glu_inplace, Mlp};
use k3_kernels::qgemm::{Packed, QActs};

use crate::linear::{packed_products_each, Compute, Matrix};
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

    /// Each expert runs once over all the tokens that chose it (prefill: one product of T_e
    /// rows instead of T_e one-row products). On the integer kernels the products of every
    /// selected expert go to the pool together: all gates and ups (and the shared experts', on
    /// x) in one job per row count T_e, then all downs; a decoded token is two jobs, not two
    /// per expert. Each token sums its experts' outputs in its selection order.
    ///
    /// # Shapes
    /// x: [T, C] → [T, C]
    pub fn forward(&self, x: &[f32], t: usize, cx: Compute) -> Vec<f32> {
        let c = x.len() / t;
        let (logits, z) = self.route_inputs(x, t, cx);
        let width = z.len() / t;
        let e = self.experts.len();
        let picks: Vec<Vec<(usize, f32)>> = (0..t).map(|r| self.select(&logits[r * e..(r + 1) * e])).collect();
        // Each expert's tokens, in token order, and each pick's row among its expert's.
        let mut tokens: Vec<Vec<usize>> = vec![Vec::new(); e];
        let rows: Vec<Vec<usize>> = picks
            .iter()
            .enumerate()
            .map(|(r, pr)| {
                pr.iter()
                    .map(|&(ex, _)| {
                        tokens[ex].push(r);
                        tokens[ex].len() - 1
                    })
                    .collect()
            })
            .collect();
        let out = match self.experts_packed(&z, t, &tokens, x, cx) {
            Some(out) => out,
            None => self.experts_each(&z, t, &tokens, cx),
        };
        let mut acc = vec![0f32; t * width];
        let mut routes: Vec<Route> = Vec::new();
        for (r, (pr, rr)) in picks.iter().zip(&rows).enumerate() {
            for (&(ex, wv), &i) in pr.iter().zip(rr) {
                let at = (out.start[ex] + i) * width;
                let y = &out.y[at..at + width];
                if self.tap.is_some() {
                    routes.push(Route { expert: ex as u32, weight: wv, out_norm: ops::dot(y, y).sqrt() });
                }
                ops::axpy(&mut acc[r * width..(r + 1) * width], wv, y);
            }
        }
        if let Some(tap) = &self.tap {
            tap.record(self.layer, t, &logits, &routes);
        }
        let mut y = self.latent_out(acc, t, cx);
        let shared = match (out.shared, &self.shared) {
            (Some(sh), _) => Some(sh),
            (None, Some(s)) => Some(s.forward(x, t, cx)),
            (None, None) => None,
        };
        if let Some(sh) = shared {
            ops::axpy(&mut y, 1.0, &sh);
        }
        debug_assert_eq!(y.len(), t * c);
        y
    }

    /// The router's sigmoid scores [T, E] and the routed experts' input z: x, or its latent
    /// down-projection [T, Lt].
    fn route_inputs(&self, x: &[f32], t: usize, cx: Compute) -> (Vec<f32>, Vec<f32>) {
        let mut logits = self.router.apply(x, t, cx); // [T, E]
        logits.iter_mut().for_each(|v| *v = ops::sigmoid(*v));
        let z = match &self.latent {
            Some((down, _, _)) => down.apply(x, t, cx),
            None => x.to_vec(),
        };
        (logits, z)
    }

    /// The weighted sum of the routed experts' outputs [T, width] back at width C: through the
    /// latent's norm and up-projection, or as it is.
    fn latent_out(&self, mut acc: Vec<f32>, t: usize, cx: Compute) -> Vec<f32> {
        match &self.latent {
            Some((_, up, norm)) => {
                if let Some(nw) = norm {
                    let src = acc.clone();
                    ops::rmsnorm(&mut acc, &src, nw, self.eps);
                }
                up.apply(&acc, t, cx)
            }
            None => acc,
        }
    }

    /// The selected experts one after another, each over its tokens' rows of z (any matrix
    /// type, the exact mode): [`ExpertsOut`] without the shared experts.
    fn experts_each(&self, z: &[f32], t: usize, tokens: &[Vec<usize>], cx: Compute) -> ExpertsOut {
        let width = z.len() / t;
        let start = starts(tokens);
        let mut y = vec![0f32; start[tokens.len()] * width];
        for (ex, rows) in tokens.iter().enumerate().filter(|(_, rows)| !rows.is_empty()) {
            let xe = gather(z, width, rows, t);
            let expert = &self.experts[ex];
            let [mut g, u]: [Vec<f32>; 2] =
                Matrix::apply_many(&[&expert.gate, &expert.up], &xe, rows.len(), cx).try_into().expect("two products");
            let f = expert.gate.rows;
            crate::threads::par_rows(&mut g, f, cx.threads, |r0, blk| {
                glu_inplace(blk, &u[r0 * f..r0 * f + blk.len()], self.act)
            });
            let ye = expert.down.apply(&g, rows.len(), cx);
            y[start[ex] * width..start[ex] * width + ye.len()].copy_from_slice(&ye);
        }
        ExpertsOut { y, start, shared: None }
    }

    /// [`Self::experts_each`] on the integer kernels, every expert's products in the same pool
    /// jobs: z quantized once and each expert handed its tokens' rows ([`QActs::select_rows`]);
    /// all gates and ups ([`packed_products_each`]: one job per row count), the GLU over all
    /// of their rows, one quantization of the result, all downs. The shared experts ride along
    /// in both jobs on x (z itself without a latent). `None` when a matrix is not packed, in the
    /// exact mode, or while calibration records inputs.
    fn experts_packed(&self, z: &[f32], t: usize, tokens: &[Vec<usize>], x: &[f32], cx: Compute) -> Option<ExpertsOut> {
        fn packed(m: &Matrix, exact: bool) -> Option<&Packed> {
            if exact {
                None
            } else {
                m.packed.as_deref()
            }
        }
        let active: Vec<usize> = (0..tokens.len()).filter(|&ex| !tokens[ex].is_empty()).collect();
        let ws: Vec<[&Packed; 3]> = active
            .iter()
            .map(|&ex| {
                let x = &self.experts[ex];
                Some([packed(&x.gate, cx.exact)?, packed(&x.up, cx.exact)?, packed(&x.down, cx.exact)?])
            })
            .collect::<Option<_>>()?;
        let shared = match &self.shared {
            Some(s) => Some([packed(&s.gate, cx.exact)?, packed(&s.up, cx.exact)?, packed(&s.down, cx.exact)?]),
            None => None,
        };
        if crate::calib::recording() {
            return None;
        }
        // Every expert is F_e wide (Moe::load checks each matrix's shape).
        let (width, threads, f) = (z.len() / t, cx.threads, self.cfg.intermediate_size);
        let start = starts(tokens);
        let p = start[tokens.len()];
        let az = QActs::quantize_threads(z, t, width, threads);
        // An expert chosen by every token (always so for one token) takes z's activations as
        // they are.
        let sel: Vec<Option<QActs>> =
            active.iter().map(|&ex| (tokens[ex].len() < t).then(|| az.select_rows(&tokens[ex]))).collect();
        // The shared experts' input: x, which is z without a latent.
        let ax =
            (shared.is_some() && self.latent.is_some()).then(|| QActs::quantize_threads(x, t, x.len() / t, threads));
        let ax = ax.as_ref().unwrap_or(&az);
        let fs = shared.map_or(0, |s| s[0].rows);
        let (mut g, mut u, mut gs, mut us) =
            (vec![0f32; p * f], vec![0f32; p * f], vec![0f32; t * fs], vec![0f32; t * fs]);
        {
            let mut jobs: Vec<(&Packed, &QActs, &mut [f32])> = Vec::with_capacity(2 * active.len() + 2);
            let (mut gr, mut ur) = (g.as_mut_slice(), u.as_mut_slice());
            for ((&ex, w), a) in active.iter().zip(&ws).zip(&sel) {
                let n = tokens[ex].len() * f;
                let (ge, rest) = std::mem::take(&mut gr).split_at_mut(n);
                gr = rest;
                let (ue, rest) = std::mem::take(&mut ur).split_at_mut(n);
                ur = rest;
                let a = a.as_ref().unwrap_or(&az);
                jobs.push((w[0], a, ge));
                jobs.push((w[1], a, ue));
            }
            if let Some(s) = shared {
                jobs.push((s[0], ax, gs.as_mut_slice()));
                jobs.push((s[1], ax, us.as_mut_slice()));
            }
            packed_products_each(&mut jobs, threads);
        }
        let glu = |g: &mut [f32], u: &[f32], f: usize| {
            crate::threads::par_rows(g, f, threads, |r0, blk| {
                glu_inplace(blk, &u[r0 * f..r0 * f + blk.len()], self.act)
            })
        };
        glu(&mut g, &u, f);
        let ah = QActs::quantize_threads(&g, p, f, threads);
        let hsel: Vec<QActs> = active
            .iter()
            .map(|&ex| ah.select_rows(&(start[ex]..start[ex] + tokens[ex].len()).collect::<Vec<_>>()))
            .collect();
        let ahs = shared.map(|_| {
            glu(&mut gs, &us, fs);
            QActs::quantize_threads(&gs, t, fs, threads)
        });
        let c = shared.map_or(0, |s| s[2].rows);
        let (mut y, mut ysh) = (vec![0f32; p * width], vec![0f32; t * c]);
        {
            let mut jobs: Vec<(&Packed, &QActs, &mut [f32])> = Vec::with_capacity(active.len() + 1);
            let mut yr = y.as_mut_slice();
            for ((&ex, w), a) in active.iter().zip(&ws).zip(&hsel) {
                let (ye, rest) = std::mem::take(&mut yr).split_at_mut(tokens[ex].len() * width);
                yr = rest;
                jobs.push((w[2], a, ye));
            }
            if let (Some(s), Some(a)) = (shared, &ahs) {
                jobs.push((s[2], a, ysh.as_mut_slice()));
            }
            packed_products_each(&mut jobs, threads);
        }
        Some(ExpertsOut { y, start, shared: shared.map(|_| ysh) })
    }
}

/// The selected experts' outputs: expert e's rows (one per token that chose it, in token
/// order) from row `start[e]` of `y` [P, width] (P all the picks); `shared` the shared experts'
/// output [T, C] when they ran in the same jobs.
struct ExpertsOut {
    y: Vec<f32>,
    start: Vec<usize>,
    shared: Option<Vec<f32>>,
}

/// Each expert's first row among all the picks, experts in id order; entry E is the total.
fn starts(tokens: &[Vec<usize>]) -> Vec<usize> {
    let mut start = Vec::with_capacity(tokens.len() + 1);
    start.push(0);
    for rows in tokens {
        start.push(start.last().copied().unwrap_or(0) + rows.len());
    }
    start
}

/// The rows `rows` of x [T, width], as [rows.len(), width] (all of x when they are all rows).
fn gather<'a>(x: &'a [f32], width: usize, rows: &[usize], t: usize) -> std::borrow::Cow<'a, [f32]> {
    if rows.len() == t {
        return std::borrow::Cow::Borrowed(x); // every token, in order
    }
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        out.extend_from_slice(&x[r * width..(r + 1) * width]);
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_config::LatentMoe;
    use k3_kernels::quant::GgmlType;
    use k3_kernels::testing::Rng;

    /// The reference: one token at a time, each selected expert its own products, the shared
    /// experts on their own (the form `forward` had before experts were grouped).
    fn forward_per_token(m: &Moe, x: &[f32], t: usize, cx: Compute) -> Vec<f32> {
        let (logits, z) = m.route_inputs(x, t, cx);
        let (width, e) = (z.len() / t, m.experts.len());
        let mut acc = vec![0f32; t * width];
        for r in 0..t {
            let zr = &z[r * width..(r + 1) * width];
            for (ex, wv) in m.select(&logits[r * e..(r + 1) * e]) {
                let expert = &m.experts[ex];
                let [mut g, u]: [Vec<f32>; 2] =
                    Matrix::apply_many(&[&expert.gate, &expert.up], zr, 1, cx).try_into().expect("two");
                glu_inplace(&mut g, &u, m.act);
                ops::axpy(&mut acc[r * width..(r + 1) * width], wv, &expert.down.apply(&g, 1, cx));
            }
        }
        let mut y = m.latent_out(acc, t, cx);
        if let Some(s) = &m.shared {
            ops::axpy(&mut y, 1.0, &s.forward(x, t, cx));
        }
        y
    }

    fn moe(rng: &mut Rng, ty: GgmlType, latent: Option<usize>, shared: bool) -> Moe {
        let (c, fe, e) = (128, 64, 8);
        let width = latent.unwrap_or(c);
        let mut mat = |rows: usize, cols: usize, ty: GgmlType| {
            let w = rng.normals(rows * cols, 0.3);
            Matrix::new(rows, cols, ty, w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect())
        };
        let experts = (0..e)
            .map(|_| Expert { gate: mat(fe, width, ty), up: mat(fe, width, ty), down: mat(width, fe, ty) })
            .collect();
        let act = Activation::Silu;
        let shared = shared.then(|| Mlp { gate: mat(fe, c, ty), up: mat(fe, c, ty), down: mat(c, fe, ty), act });
        let latent = latent.map(|l| (mat(l, c, ty), mat(c, l, ty), Some(vec![1.0; l])));
        let router = mat(e, c, GgmlType::F32);
        let bias = rng.normals(e, 0.1);
        let cfg = MoeConfig {
            num_experts: e,
            top_k: 3,
            num_shared_experts: usize::from(shared.is_some()),
            intermediate_size: fe,
            routed_scaling_factor: 2.0,
            renormalize: true,
            num_expert_group: 1,
            topk_group: 1,
            latent: latent.as_ref().map(|l| LatentMoe { dim: l.0.rows, use_norm: true }),
        };
        Moe { router, bias, experts, shared, latent, cfg, act, eps: 1e-5, layer: 0, tap: None }
    }

    /// Experts grouped over the tokens that chose them, with the shared experts in the same
    /// jobs, give the one-token-at-a-time products: for one token (decode) and many (prefill),
    /// packed and f32 experts, with and without a latent or shared experts, at 1 and 2 threads.
    #[test]
    fn grouped_experts_match_one_token_at_a_time() {
        let mut rng = Rng::new(21);
        for (ty, latent, shared) in [
            (GgmlType::Q4_0, None, true),
            (GgmlType::Q8_0, Some(96), true),
            (GgmlType::Q4_1, None, false),
            (GgmlType::F32, Some(96), true),
        ] {
            let m = moe(&mut rng, ty, latent, shared);
            for t in [1, 5, 40] {
                let x = rng.normals(t * 128, 1.0);
                for threads in [1, 2] {
                    let cx = Compute { threads, exact: false };
                    let (got, want) = (m.forward(&x, t, cx), forward_per_token(&m, &x, t, cx));
                    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let worst = got.iter().zip(&want).fold(0f32, |a, (g, w)| a.max((g - w).abs()));
                    // Multi-row products may sum in another order than one-row ones (AMX).
                    assert!(worst <= 1e-5 * scale, "{ty:?} latent {latent:?} T={t} x{threads}: {worst:e} of {scale}");
                }
            }
        }
    }
}
