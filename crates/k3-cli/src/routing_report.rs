//! Figures from streamed routing sums, each beside its uniform baseline; the student-design
//! recommendation drawn from them; and the comparison of a trained student's routing with it.
//!
//! Baselines (what a router that ignores its input would show, E experts, top-k):
//! frequency k/E; gate and REAP share 1/E; load and router entropy ln E; experts covering 90% of
//! the gate mass ⌈0.9·E⌉; co-activation lift 1 (against independence of the two experts' own
//! frequencies); per-token experts carrying 90% of the weight ⌈0.9·k⌉ (equal weights); and for a
//! difference between domains, the difference between two halves of one domain (noise floor).

use k3_infer::routing::Accum;
use serde::{Deserialize, Serialize};

/// A figure and what a uniform (input-blind) router would give.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Figure {
    pub value: f64,
    pub uniform: f64,
}

fn fig(value: f64, uniform: f64) -> Figure {
    Figure { value, uniform }
}

/// One co-activated pair.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Pair {
    pub experts: (usize, usize),
    /// Fraction of tokens routed to both.
    pub rate: f64,
    /// rate / (frequency_a · frequency_b): 1 when the two are chosen independently.
    pub lift: f64,
}

/// Every figure of one (layer, domain).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayerFigures {
    pub layer: usize,
    pub domain: String,
    pub tokens: u64,
    pub experts: usize,
    pub top_k: f64,
    /// [E] fraction of tokens routed to each expert; uniform k/E.
    pub frequency: Vec<f64>,
    pub frequency_uniform: f64,
    /// Entropy (nats) of the load over experts.
    pub load_entropy: Figure,
    /// The busiest expert's frequency over k/E.
    pub max_load_ratio: Figure,
    /// Experts chosen for fewer than a tenth of their uniform share of tokens.
    pub dead_experts: Figure,
    /// [E] share of the total routing weight; uniform 1/E.
    pub gate_share: Vec<f64>,
    /// [E] REAP saliency: mean over the tokens routed to the expert of weight · ‖output‖.
    pub reap: Vec<f64>,
    /// [E] share of Σ weight · ‖output‖; uniform 1/E.
    pub reap_share: Vec<f64>,
    pub share_uniform: f64,
    /// Mean per-token entropy (nats) of the router's σ scores normalised over experts.
    pub router_entropy: Figure,
    /// The fewest experts that together carry 90% of the gate mass.
    pub experts_for_90pct_gate: Figure,
    /// Mean number of a token's chosen experts that carry 90% of its routing weight.
    pub per_token_k90: Figure,
    /// The largest co-activation lift among pairs expected on at least 5 tokens.
    pub max_coactivation_lift: Figure,
    /// The five pairs with the largest lift.
    pub top_pairs: Vec<Pair>,
}

fn entropy(p: &[f64]) -> f64 {
    let s: f64 = p.iter().sum();
    if s <= 0.0 {
        return 0.0;
    }
    -p.iter().map(|x| x / s).filter(|&x| x > 0.0).map(|x| x * x.ln()).sum::<f64>()
}

/// The fewest entries (largest first) whose sum reaches `frac` of the total.
pub fn cover(shares: &[f64], frac: f64) -> usize {
    let total: f64 = shares.iter().sum();
    let mut v = shares.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    let (mut acc, mut n) = (0.0, 0);
    for x in v {
        if acc >= frac * total - 1e-12 {
            break;
        }
        acc += x;
        n += 1;
    }
    n
}

pub fn figures(layer: usize, domain: &str, a: &Accum) -> LayerFigures {
    let e = a.experts();
    let n = a.tokens.max(1) as f64;
    let k = a.count.iter().sum::<u64>() as f64 / n;
    let freq: Vec<f64> = a.count.iter().map(|&c| c as f64 / n).collect();
    let fu = k / e as f64;
    let gsum: f64 = a.gate.iter().sum::<f64>().max(1e-30);
    let rsum: f64 = a.reap.iter().sum::<f64>().max(1e-30);
    let mut pairs = Vec::new();
    // With one expert per token nothing co-activates: the figure is undefined (NaN), not 0.
    for x in (0..e).filter(|_| k >= 1.5) {
        for y in x + 1..e {
            let expected = freq[x] * freq[y] * n;
            if expected >= 5.0 {
                let rate = a.coactivation(x, y) as f64 / n;
                pairs.push(Pair { experts: (x, y), rate, lift: rate / (freq[x] * freq[y]) });
            }
        }
    }
    pairs.sort_by(|p, q| q.lift.total_cmp(&p.lift));
    let max_lift = pairs.first().map_or(f64::NAN, |p| p.lift);
    pairs.truncate(5);
    LayerFigures {
        layer,
        domain: domain.to_string(),
        tokens: a.tokens,
        experts: e,
        top_k: k,
        load_entropy: fig(entropy(&freq), (e as f64).ln()),
        max_load_ratio: fig(freq.iter().cloned().fold(0.0, f64::max) / fu.max(1e-30), 1.0),
        dead_experts: fig(freq.iter().filter(|&&f| f < 0.1 * fu).count() as f64, 0.0),
        frequency: freq,
        frequency_uniform: fu,
        gate_share: a.gate.iter().map(|g| g / gsum).collect(),
        reap: a.reap.iter().zip(&a.count).map(|(r, &c)| if c > 0 { r / c as f64 } else { 0.0 }).collect(),
        reap_share: a.reap.iter().map(|r| r / rsum).collect(),
        share_uniform: 1.0 / e as f64,
        router_entropy: fig(a.entropy / n, (e as f64).ln()),
        experts_for_90pct_gate: fig(cover(&a.gate, 0.9) as f64, (0.9 * e as f64).ceil()),
        per_token_k90: fig(a.k90 as f64 / n, (0.9 * k).ceil()),
        max_coactivation_lift: fig(max_lift, 1.0),
        top_pairs: pairs,
    }
}

/// Jensen–Shannon divergence (nats) between two count vectors, normalised.
pub fn jsd(a: &[u64], b: &[u64]) -> f64 {
    let (sa, sb) = (a.iter().sum::<u64>().max(1) as f64, b.iter().sum::<u64>().max(1) as f64);
    let mut d = 0.0;
    for (&x, &y) in a.iter().zip(b) {
        let (p, q) = (x as f64 / sa, y as f64 / sb);
        let m = 0.5 * (p + q);
        if p > 0.0 {
            d += 0.5 * p * (p / m).ln();
        }
        if q > 0.0 {
            d += 0.5 * q * (q / m).ln();
        }
    }
    d
}

/// How differently two domains load one layer's experts, against the noise floor.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Specialisation {
    pub layer: usize,
    pub domains: (String, String),
    /// JSD between the two domains' expert loads.
    pub between: f64,
    /// The larger JSD between the two halves (even / odd windows) of one domain: what sampling
    /// noise alone produces. Halves hold half the tokens, so this floor is, if anything, high.
    pub noise_floor: f64,
    /// between / noise_floor; above 2 we call the layer domain-specialised.
    pub ratio: f64,
}

pub fn specialisation(layer: usize, names: (&str, &str), a: &Accum, b: &Accum) -> Specialisation {
    let between = jsd(&a.count, &b.count);
    let floor = jsd(&a.half_count[0], &a.half_count[1]).max(jsd(&b.half_count[0], &b.half_count[1]));
    Specialisation {
        layer,
        domains: (names.0.to_string(), names.1.to_string()),
        between,
        noise_floor: floor,
        ratio: between / floor.max(1e-12),
    }
}

/// A student MoE layout for one domain.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Recommendation {
    pub target: String,
    pub teacher_experts: usize,
    pub teacher_top_k: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub num_shared_experts: usize,
    /// Of the target's gate mass, the share carried by always-on experts (chosen for ≥ 90% of
    /// the tokens), averaged over MoE layers.
    pub always_on_share: f64,
    /// The teacher's layers, in order: true where the student should have a dense FFN.
    pub dense: Vec<bool>,
    /// HF config.json fields for the student (`[model.config]` of a training config).
    pub config: serde_json::Value,
    pub reasoning: Vec<String>,
}

/// One MoE layer of the teacher, seen from the target domain.
pub struct LayerView<'a> {
    pub target: &'a LayerFigures,
    /// Largest between-domain specialisation ratio of the layer (NaN with one domain).
    pub spec_ratio: f64,
}

/// Recommend a student layout from the teacher's routing on `target`. `layers` is the teacher's
/// layer count; `moe` are its MoE layers (the others are dense already).
pub fn recommend(target: &str, layers: usize, moe: &[LayerView], teacher_shared: usize) -> Recommendation {
    let mut why = Vec::new();
    let e = moe.first().map_or(0, |l| l.target.experts);
    let k = moe.first().map_or(0.0, |l| l.target.top_k).round() as usize;
    let mut dense = vec![true; layers];
    let mut kept = Vec::new();
    for l in moe {
        let f = l.target;
        let even = f.experts_for_90pct_gate.value >= 0.9 * f.experts_for_90pct_gate.uniform
            && f.load_entropy.value >= 0.98 * f.load_entropy.uniform;
        let no_domain = l.spec_ratio.is_nan() || l.spec_ratio < 2.0;
        if even && no_domain {
            why.push(format!(
                "layer {}: dense. {target} needs {} of {e} experts for 90% of its gate mass (uniform: {}), load \
                 entropy {:.3} of ln E = {:.3}, domain difference {:.2}x the noise floor: the router spreads \
                 {target} as an input-blind router would, so routing buys nothing here",
                f.layer,
                f.experts_for_90pct_gate.value,
                f.experts_for_90pct_gate.uniform,
                f.load_entropy.value,
                f.load_entropy.uniform,
                l.spec_ratio
            ));
        } else {
            dense[f.layer] = false;
            kept.push(f);
        }
    }
    let mut n90: Vec<f64> = kept.iter().map(|f| f.experts_for_90pct_gate.value).collect();
    n90.sort_by(f64::total_cmp);
    let median = n90.get(n90.len() / 2).copied().unwrap_or(0.0);
    let k90 = if kept.is_empty() {
        k as f64
    } else {
        kept.iter().map(|f| f.per_token_k90.value).sum::<f64>() / kept.len() as f64
    };
    let top_k = (k90.round() as usize).clamp(1, k.max(1));
    let mut num_experts = (median.ceil() as usize).max(2 * top_k);
    num_experts += num_experts % 2;
    let num_experts = num_experts.min(e.max(1));
    if !kept.is_empty() {
        why.push(format!(
            "experts: {num_experts}. Across the {} routed layers kept, {target} puts 90% of its gate mass on a median of \
             {median} of the teacher's {e} experts (per layer: {:?}); the rest serve other domains",
            kept.len(),
            kept.iter().map(|f| f.experts_for_90pct_gate.value as usize).collect::<Vec<_>>()
        ));
        why.push(format!(
            "top-k: {top_k}. A {target} token's weight is 90% carried by {k90:.2} of its {k} chosen experts on average \
             (equal weights would need {})",
            (0.9 * k as f64).ceil()
        ));
    }
    let always: Vec<f64> = kept
        .iter()
        .map(|f| f.frequency.iter().zip(&f.gate_share).filter(|(&fr, _)| fr >= 0.9).map(|(_, g)| g).sum::<f64>())
        .collect();
    let always_on = if always.is_empty() { 0.0 } else { always.iter().sum::<f64>() / always.len() as f64 + 0.0 };
    let shared = if teacher_shared > 0 || always_on >= 0.1 { 1 } else { 0 };
    why.push(format!(
        "shared experts: {shared}. The teacher has {teacher_shared}; experts chosen for at least 90% of the {target} tokens \
         carry {:.1}% of the routed gate mass{}",
        100.0 * always_on,
        if always_on >= 0.1 { ", which a shared expert serves without routing" } else { "" }
    ));
    let types: Vec<&str> = dense.iter().map(|&d| if d { "dense" } else { "sparse" }).collect();
    let config = serde_json::json!({
        "num_experts": num_experts,
        "num_experts_per_token": top_k,
        "num_shared_experts": shared,
        "mlp_layer_types": types,
    });
    Recommendation {
        target: target.to_string(),
        teacher_experts: e,
        teacher_top_k: k,
        num_experts,
        top_k,
        num_shared_experts: shared,
        always_on_share: always_on,
        dense,
        config,
        reasoning: why,
    }
}

/// A trained student's routing next to the recommendation it was built from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Comparison {
    pub layer: usize,
    pub recommended_dense: bool,
    pub student_dense: bool,
    pub experts: usize,
    /// Of the student's experts, how many carry 90% of its gate mass on the target.
    pub experts_for_90pct_gate: Figure,
    pub dead_experts: f64,
    pub router_entropy: Figure,
    pub verdict: String,
}

pub fn compare(rec: &Recommendation, student_layers: usize, moe: &[&LayerFigures]) -> Vec<Comparison> {
    (0..student_layers)
        .map(|layer| {
            let f = moe.iter().find(|f| f.layer == layer);
            let recommended_dense = rec.dense.get(layer).copied().unwrap_or(false);
            match f {
                None => Comparison {
                    layer,
                    recommended_dense,
                    student_dense: true,
                    experts: 0,
                    experts_for_90pct_gate: fig(f64::NAN, f64::NAN),
                    dead_experts: 0.0,
                    router_entropy: fig(f64::NAN, f64::NAN),
                    verdict: if recommended_dense {
                        "dense, as recommended"
                    } else {
                        "dense, but routing was recommended"
                    }
                    .into(),
                },
                Some(f) => {
                    let used = f.experts_for_90pct_gate.value / f.experts as f64;
                    let verdict = if recommended_dense {
                        "routed, but a dense layer was recommended".to_string()
                    } else if f.dead_experts.value > 0.0 {
                        format!("{} experts dead: fewer would do", f.dead_experts.value)
                    } else if used >= 0.7 {
                        format!("uses its experts ({:.0}% needed for 90% of the gate mass)", 100.0 * used)
                    } else {
                        format!("over-provisioned: {:.0}% of the experts carry 90% of the gate mass", 100.0 * used)
                    };
                    Comparison {
                        layer,
                        recommended_dense,
                        student_dense: false,
                        experts: f.experts,
                        experts_for_90pct_gate: f.experts_for_90pct_gate,
                        dead_experts: f.dead_experts.value,
                        router_entropy: f.router_entropy,
                        verdict,
                    }
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_infer::routing::Route;

    fn accum(e: usize, picks: &[(u32, u32)], half_split: bool) -> Accum {
        let mut a = Accum::new(e);
        for (i, &(x, y)) in picks.iter().enumerate() {
            let r = [Route { expert: x, weight: 0.5, out_norm: 1.0 }, Route { expert: y, weight: 0.5, out_norm: 1.0 }];
            a.add(&vec![0.5; e], &r, if half_split { i % 2 } else { 0 });
        }
        a
    }

    #[test]
    fn a_uniform_router_meets_every_baseline() {
        // Every pair of 4 experts equally often: the figures equal their uniform baselines.
        let pairs: Vec<(u32, u32)> =
            (0..600).map(|i| [(0, 1), (2, 3), (0, 2), (1, 3), (0, 3), (1, 2)][i % 6]).collect();
        let f = figures(3, "x", &accum(4, &pairs, true));
        assert!((f.frequency_uniform - 0.5).abs() < 1e-12);
        assert!(f.frequency.iter().all(|&x| (x - 0.5).abs() < 1e-12));
        assert!((f.load_entropy.value - f.load_entropy.uniform).abs() < 1e-9);
        assert!((f.router_entropy.value - f.router_entropy.uniform).abs() < 1e-9);
        assert_eq!(f.experts_for_90pct_gate.value, f.experts_for_90pct_gate.uniform);
        assert!((f.max_coactivation_lift.value - (1.0 / 6.0) / 0.25).abs() < 1e-9);
        assert_eq!(f.per_token_k90.value, 2.0);
    }

    #[test]
    fn specialisation_is_measured_against_the_within_domain_noise_floor() {
        let code: Vec<(u32, u32)> = (0..400).map(|_| (0, 1)).collect();
        let text: Vec<(u32, u32)> = (0..400).map(|_| (2, 3)).collect();
        let (a, b) = (accum(4, &code, true), accum(4, &text, true));
        let s = specialisation(1, ("code", "text"), &a, &b);
        assert!((s.between - 2f64.ln()).abs() < 1e-9, "disjoint loads: JSD = ln 2");
        assert!(s.noise_floor < 1e-12 && s.ratio > 2.0);
        // The same domain twice: nothing between beyond the floor.
        assert!(specialisation(1, ("code", "code"), &a, &a).between < 1e-12);
    }

    #[test]
    fn recommendation_narrows_to_the_used_experts_and_densifies_blind_layers() {
        // Layer 1: code uses experts 0..4 of 8 only. Layer 2: uniform over all 8, no domain signal.
        let narrow: Vec<(u32, u32)> = (0..800).map(|i| [(0, 1), (2, 3)][i % 2]).collect();
        let wide: Vec<(u32, u32)> = (0..800).map(|i| [(0, 1), (2, 3), (4, 5), (6, 7)][i % 4]).collect();
        let (f1, f2) = (figures(1, "code", &accum(8, &narrow, true)), figures(2, "code", &accum(8, &wide, true)));
        let views = [LayerView { target: &f1, spec_ratio: 10.0 }, LayerView { target: &f2, spec_ratio: 1.0 }];
        let r = recommend("code", 3, &views, 0);
        assert_eq!(r.dense, vec![true, false, true]);
        assert_eq!((r.num_experts, r.top_k), (4, 2));
        assert_eq!(r.config["mlp_layer_types"][1], "sparse");
        assert!(r.reasoning.iter().any(|w| w.starts_with("layer 2: dense")));
        let cmp = compare(&r, 3, &[&f1]);
        assert_eq!(cmp[0].verdict, "dense, as recommended");
        assert_eq!(cmp[1].verdict, "4 experts dead: fewer would do");
        assert_eq!(r.num_shared_experts, 0, "no expert is chosen for 90% of the tokens");
    }
}
