//! Mixture of experts: DeepSeek-V3-style sigmoid router (Kimi Linear) and K3's latent MoE
//! (architecture.md §5). References: transformers 5.24 `KimiLinearTopkRouter` / `KimiLinearMoE`;
//! K3 / llama.cpp `kimi-k3` for the latent path.
//! Dims: N tokens (B·T flattened), C hidden, E experts, k top-k, Lt latent width, F_e expert width.

use k3_config::{Activation, MoeConfig};
use tch::Tensor;

use crate::ffn::Mlp;
use crate::nn::{norm_weight, rms_norm, Linear, INIT_STD};

#[derive(Debug)]
pub struct Latent {
    down: Linear, // C → Lt
    up: Linear,   // Lt → C
    norm: Option<Tensor>,
}

#[derive(Debug)]
pub struct Moe {
    router: Tensor, // [E, C], f32
    /// Score-correction bias [E]: used for selection only, never trained by gradient.
    pub correction_bias: Tensor,
    experts: Vec<Mlp>,
    shared: Option<Mlp>,
    latent: Option<Latent>,
    cfg: MoeConfig,
    eps: f64,
}

/// Which experts each token chose and with what weight.
#[derive(Debug)]
pub struct Routing {
    pub idx: Tensor,    // [N, k] int64
    pub weight: Tensor, // [N, k]
    pub scores: Tensor, // [N, E], σ(router logits), unbiased
}

impl Moe {
    pub fn new(p: &tch::nn::Path, hidden: usize, cfg: &MoeConfig, act: Activation, eps: f64) -> Self {
        let e = cfg.num_experts;
        let width = cfg.latent.map_or(hidden, |l| l.dim);
        let gate = p.sub("gate");
        let router =
            gate.var("weight", &[e as i64, hidden as i64], tch::nn::Init::Randn { mean: 0.0, stdev: INIT_STD });
        let correction_bias = gate.zeros_no_train("e_score_correction_bias", &[e as i64]);
        let ep = p.sub("experts");
        let experts = (0..e).map(|i| Mlp::new_expert(&ep.sub(i), width, cfg.intermediate_size, act)).collect();
        let fs = cfg.intermediate_size * cfg.num_shared_experts;
        let shared = (fs > 0).then(|| Mlp::new(&p.sub("shared_experts"), hidden, fs, act));
        let latent = cfg.latent.map(|l| Latent {
            down: Linear::new(p, "routed_expert_down_proj", hidden, l.dim, false),
            up: Linear::new(p, "routed_expert_up_proj", l.dim, hidden, false),
            norm: l.use_norm.then(|| norm_weight(p, "routed_expert_norm", l.dim)),
        });
        Self { router, correction_bias, experts, shared, latent, cfg: cfg.clone(), eps }
    }

    /// Sigmoid router in f32: the biased scores choose, the unbiased scores weigh.
    ///
    /// # Shapes
    /// x: [N, C] → Routing { idx [N,k], weight [N,k], scores [N,E] }
    pub fn route(&self, x: &Tensor) -> Routing {
        let c = &self.cfg;
        let (n, e) = (x.size()[0], c.num_experts as i64);
        let scores = x
            .to_kind(crate::nn::compute_kind(x.kind()))
            .linear(&self.router.to_kind(crate::nn::compute_kind(x.kind())), None::<Tensor>)
            .sigmoid(); // [N,E]
        let mut choice = &scores + &self.correction_bias; // [N,E]
        if c.num_expert_group > 1 {
            // Group-limited routing: a group scores the sum of its top-2 biased scores; only the
            // top `topk_group` groups stay eligible (transformers `KimiLinearTopkRouter`).
            let groups = c.num_expert_group as i64;
            let per = e / groups;
            let group_scores =
                choice.view([n, groups, per]).topk(2, -1, true, false).0.sum_dim_intlist(-1, false, None);
            let keep = group_scores.topk(c.topk_group as i64, -1, true, false).1; // [N, topk_group]
            let mask = Tensor::zeros([n, groups], (scores.kind(), x.device())).scatter_value(1, &keep, 1.0);
            let mask = mask.unsqueeze(-1).expand([n, groups, per], false).reshape([n, e]);
            choice = choice.masked_fill(&mask.eq(0.0), f64::NEG_INFINITY);
        }
        let idx = choice.topk(c.top_k as i64, -1, true, false).1; // [N,k]
        let mut weight = scores.gather(1, &idx, false); // unbiased σ of the chosen
        if c.renormalize {
            weight = &weight / (weight.sum_dim_intlist(-1, true, None) + 1e-20);
        }
        Routing { idx, weight: weight * c.routed_scaling_factor, scores }
    }

    /// # Shapes
    /// x: [B,T,C] → ([B,T,C], Routing over the B·T tokens)
    pub fn forward(&self, x: &Tensor) -> (Tensor, Routing) {
        let sz = x.size();
        let xf = x.reshape([-1, sz[2]]); // [N,C]
        let r = self.route(&xf);
        let z = match &self.latent {
            Some(l) => l.down.forward(&xf), // experts run in the latent space [N,Lt]
            None => xf.shallow_clone(),
        };
        let mut acc = z.zeros_like(); // [N, width]
        let flat_idx = r.idx.view([-1]); // [N·k]
        let k = self.cfg.top_k as i64;
        for (e, expert) in self.experts.iter().enumerate() {
            let hit = flat_idx.eq(e as i64).nonzero().squeeze_dim(-1); // positions in [N·k]
            if hit.numel() == 0 {
                continue;
            }
            let tok = hit.divide_scalar_mode(k, "floor"); // token of each hit
            let w = r.weight.view([-1]).index_select(0, &hit).unsqueeze(-1).to_kind(z.kind());
            let out = expert.forward(&z.index_select(0, &tok)) * w;
            acc = acc.index_add(0, &tok, &out);
        }
        let mut y = match &self.latent {
            Some(l) => {
                let u = match &l.norm {
                    Some(nw) => rms_norm(&acc, nw, self.eps),
                    None => acc,
                };
                l.up.forward(&u)
            }
            None => acc,
        };
        if let Some(s) = &self.shared {
            y = y + s.forward(&xf); // shared experts see the original full-width x
        }
        (y.view(sz.as_slice()), r)
    }
}
