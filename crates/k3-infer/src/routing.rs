//! Routing statistics of a mixture-of-experts model, streamed (architecture.md §5).
//!
//! Each MoE layer can carry a [`RoutingTap`]. The [`RoutingCollector`] tap folds every decision
//! into running sums per (layer, domain) as it happens ([`Accum`]), so memory is
//! O(layers × domains × E²) however many tokens pass; no decision is kept. Dims: T tokens,
//! E experts, k top-k.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// One routing decision: a chosen expert, its final weight (renormalised and scaled, as applied)
/// and the L2 norm of that expert's output for the token (in the latent space for a latent MoE).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Route {
    pub expert: u32,
    pub weight: f32,
    pub out_norm: f32,
}

/// Receives every routing decision of the MoE layers it is attached to.
pub trait RoutingTap: Send + Sync {
    /// One MoE call over `tokens` = T tokens: `scores` [T, E] (σ of the router logits, before
    /// the selection bias), `routes` [T · k] (each token's chosen experts, in selection order).
    fn record(&self, layer: usize, tokens: usize, scores: &[f32], routes: &[Route]);
}

/// Running sums for one (layer, domain).
#[derive(Debug, Clone, PartialEq)]
pub struct Accum {
    pub tokens: u64,
    /// [E] tokens routed to each expert.
    pub count: Vec<u64>,
    /// [2][E] the same, split by window parity: two halves of one domain give the noise floor
    /// that a between-domain difference must clear.
    pub half_count: [Vec<u64>; 2],
    /// [E] Σ routing weight.
    pub gate: Vec<f64>,
    /// [E] Σ weight · ‖expert output‖ (REAP's saliency, summed over the tokens routed there).
    pub reap: Vec<f64>,
    /// [E, E] tokens on which both experts were chosen (upper triangle, e < f).
    pub coact: Vec<u64>,
    /// Σ over tokens of the entropy (nats) of the token's σ scores normalised to sum to one.
    pub entropy: f64,
    /// Σ over tokens of how many of its chosen experts carry 90% of its routing weight.
    pub k90: u64,
}

impl Accum {
    pub fn new(e: usize) -> Self {
        Self {
            tokens: 0,
            count: vec![0; e],
            half_count: [vec![0; e], vec![0; e]],
            gate: vec![0.0; e],
            reap: vec![0.0; e],
            coact: vec![0; e * e],
            entropy: 0.0,
            k90: 0,
        }
    }

    pub fn experts(&self) -> usize {
        self.count.len()
    }

    /// Fold one token in: its scores [E] and its k routes.
    pub fn add(&mut self, scores: &[f32], routes: &[Route], half: usize) {
        let e = self.experts();
        self.tokens += 1;
        for r in routes {
            let x = r.expert as usize;
            self.count[x] += 1;
            self.half_count[half & 1][x] += 1;
            self.gate[x] += r.weight as f64;
            self.reap[x] += (r.weight * r.out_norm) as f64;
        }
        for (i, a) in routes.iter().enumerate() {
            for b in &routes[i + 1..] {
                let (p, q) = (a.expert.min(b.expert) as usize, a.expert.max(b.expert) as usize);
                if p != q {
                    self.coact[p * e + q] += 1;
                }
            }
        }
        let total: f64 = scores.iter().map(|&s| s as f64).sum::<f64>().max(1e-30);
        self.entropy -= scores.iter().map(|&s| s as f64 / total).filter(|&p| p > 0.0).map(|p| p * p.ln()).sum::<f64>();
        let mut w: Vec<f64> = routes.iter().map(|r| r.weight as f64).collect();
        w.sort_by(|a, b| b.total_cmp(a));
        let sum: f64 = w.iter().sum();
        let (mut acc, mut n) = (0.0, 0u64);
        for x in w {
            if acc >= 0.9 * sum {
                break;
            }
            acc += x;
            n += 1;
        }
        self.k90 += n;
    }

    /// Tokens on which experts `a` and `b` (a ≠ b) were both chosen.
    pub fn coactivation(&self, a: usize, b: usize) -> u64 {
        let e = self.experts();
        self.coact[a.min(b) * e + a.max(b)]
    }
}

/// Where the collector files the next decisions: a domain and a window parity.
#[derive(Debug, Clone, Copy, Default)]
struct Context {
    domain: usize,
    half: usize,
}

/// A [`RoutingTap`] that accumulates statistics per (layer, domain).
pub struct RoutingCollector {
    domains: usize,
    inner: Mutex<(Context, BTreeMap<usize, Vec<Accum>>)>,
}

impl RoutingCollector {
    pub fn new(domains: usize) -> Self {
        Self { domains, inner: Mutex::new((Context::default(), BTreeMap::new())) }
    }

    /// File what follows under `domain`, in half `half % 2` of its windows.
    pub fn set_context(&self, domain: usize, half: usize) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = Context { domain, half: half & 1 };
    }

    /// The sums so far: layer → one [`Accum`] per domain.
    pub fn snapshot(&self) -> BTreeMap<usize, Vec<Accum>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).1.clone()
    }
}

impl RoutingTap for RoutingCollector {
    fn record(&self, layer: usize, tokens: usize, scores: &[f32], routes: &[Route]) {
        if tokens == 0 || routes.is_empty() {
            return;
        }
        let (e, k) = (scores.len() / tokens, routes.len() / tokens);
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let ctx = g.0;
        let domains = self.domains;
        let entry = g.1.entry(layer).or_insert_with(|| (0..domains).map(|_| Accum::new(e)).collect());
        let acc = &mut entry[ctx.domain];
        for r in 0..tokens {
            acc.add(&scores[r * e..(r + 1) * e], &routes[r * k..(r + 1) * k], ctx.half);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(expert: u32, weight: f32) -> Route {
        Route { expert, weight, out_norm: 2.0 }
    }

    #[test]
    fn accumulates_counts_gate_reap_coactivation_entropy_and_k90() {
        let c = RoutingCollector::new(2);
        c.set_context(1, 3);
        // Two tokens, E = 4, k = 2; uniform scores have entropy ln 4.
        let scores = [0.5f32; 8];
        let routes = [route(0, 0.95), route(2, 0.05), route(2, 0.5), route(0, 0.5)];
        c.record(7, 2, &scores, &routes);
        let s = c.snapshot();
        let a = &s[&7][1];
        assert_eq!(s[&7][0].tokens, 0);
        assert_eq!(a.tokens, 2);
        assert_eq!(a.count, vec![2, 0, 2, 0]);
        assert_eq!(a.half_count[1], vec![2, 0, 2, 0]);
        assert!((a.gate[0] - 1.45).abs() < 1e-6 && (a.reap[2] - 1.1).abs() < 1e-6);
        assert_eq!((a.coactivation(0, 2), a.coactivation(2, 0), a.coactivation(0, 1)), (2, 2, 0));
        assert!((a.entropy - 2.0 * 4f64.ln()).abs() < 1e-9);
        // Token 1: 0.95 alone covers 90%; token 2: both halves are needed.
        assert_eq!(a.k90, 3);
    }
}
