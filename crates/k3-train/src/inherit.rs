//! Weight inheritance: a student that shares the teacher's tokenizer starts with the teacher's
//! token embedding and LM head, narrowed to the student's width by projecting every row onto the
//! embedding's top principal directions (the width pruning of Minitron, applied to the
//! embedding alone; the body starts fresh). With a 49K vocabulary most of a 15–25M-parameter
//! student is its embedding and head, so this is where most of what it must learn sits.
//!
//! E: [V, D] the teacher's embedding, H: [V, D] its head (E again when tied). With Σ = EᵀE and
//! P: [D, d] its top-d eigenvectors, the student gets E P and H P. Scores then factor through
//! the same subspace: (h P)(H P)ᵀ = h P Pᵀ Hᵀ, the teacher's logits with h restricted to P.
//! The head is then scaled to a fresh head's root-mean-square (`INIT_STD`): at the teacher's
//! scale a random body's first logits were far from flat (a first loss of 22.7 against a fresh
//! model's 10.8 at a 49K vocabulary), and the first steps went to undoing that.

use tch::{Kind, Tensor};

use crate::model::Model;
use crate::nn::{set_param, INIT_STD};
use crate::{Error, Result};

/// What [`inherit_embeddings`] did.
#[derive(Debug)]
pub struct Inherited {
    /// P [D, d] (f64): the teacher-width directions the student's width spans.
    pub projection: Tensor,
    /// Share of the teacher embedding's energy (Σ's trace) the kept directions hold.
    pub energy_kept: f64,
    /// Root-mean-square of the student's new embedding entries.
    pub embed_rms: f64,
    /// Root-mean-square of the projected head entries, before scaling to `INIT_STD`.
    pub head_rms: f64,
}

/// The top-`d` principal directions of `e` ([V, D] f64, uncentred): P [D, d], columns by
/// decreasing eigenvalue, and the share of the trace they hold.
fn principal_directions(e: &Tensor, d: i64) -> (Tensor, f64) {
    let sigma = e.transpose(0, 1).matmul(e); // [D, D]
    let (vals, vecs) = sigma.linalg_eigh("L"); // ascending
    let n = vals.size()[0];
    let top = vecs.narrow(1, n - d, d).flip([1]); // [D, d], largest first
    let kept = vals.narrow(0, n - d, d).sum(Kind::Double).double_value(&[]);
    let total = vals.sum(Kind::Double).double_value(&[]);
    (top, kept / total.max(f64::MIN_POSITIVE))
}

/// Overwrite `model`'s embedding and LM head with the teacher's `embed` and `head` (both [V, D]
/// row-major f32; pass the embedding twice for a tied teacher) projected to the model's width.
pub fn inherit_embeddings(model: &Model, embed: &[f32], head: &[f32], teacher_width: usize) -> Result<Inherited> {
    let v = model.config.vocab_size();
    let d = model.config.hidden_size();
    let big_d = teacher_width;
    for (what, x) in [("embedding", embed), ("LM head", head)] {
        if x.len() != v * big_d {
            return Err(Error::Invalid(format!(
                "the teacher's {what} has {} values; the student needs vocab {v} x the teacher's width {big_d}",
                x.len()
            )));
        }
    }
    if d > big_d {
        return Err(Error::Invalid(format!(
            "the student's hidden size {d} exceeds the teacher's {big_d}: a projection can only narrow; \
             use a student no wider than its teacher"
        )));
    }
    let vars = model.vs.variables();
    let as_f64 = |x: &[f32]| Tensor::from_slice(x).view([v as i64, big_d as i64]).to_kind(Kind::Double);
    let e = as_f64(embed);
    let (p, energy_kept) = principal_directions(&e, d as i64);
    let e_s = e.matmul(&p).to_kind(Kind::Float); // [V, d]
    let h_s = as_f64(head).matmul(&p).to_kind(Kind::Float);
    let rms = |t: &Tensor| t.square().mean(Kind::Double).sqrt().double_value(&[]);
    let (embed_rms, head_rms) = (rms(&e_s), rms(&h_s));
    set_param(&vars["model.embed_tokens.weight"], &e_s);
    // A tied student's head is its embedding, left at the teacher's scale.
    if let Some(lm_head) = vars.get("lm_head.weight") {
        set_param(lm_head, &(h_s * (INIT_STD / head_rms.max(f64::MIN_POSITIVE))));
    }
    Ok(Inherited { projection: p, energy_kept, embed_rms, head_rms })
}

/// One teacher layer's SwiGLU FFN, row-major f32: `gate`, `up` [F, D], `down` [D, F], and the
/// RMSNorm gain applied before it, `norm` [D].
pub struct TeacherFfn {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
    pub norm: Vec<f32>,
}

/// The teacher layer student layer `l` of `ls` inherits from, of `lt`: spread evenly over the
/// teacher's depth, first to first and last to last.
pub fn teacher_layer_for(l: usize, ls: usize, lt: usize) -> usize {
    if ls <= 1 {
        return 0;
    }
    ((l * (lt - 1)) as f64 / (ls - 1) as f64).round() as usize
}

/// Start every dense FFN of `model` from a teacher layer ([`teacher_layer_for`]), narrowed the
/// way Minitron prunes width, with the residual stream in the embedding's subspace P
/// ([`inherit_embeddings`]):
///
/// ```text
/// keep the F_s channels j with the largest ‖(W_g ⊙ g)_j‖ · ‖(W_u ⊙ g)_j‖ · ‖W_d[:, j]‖
/// W_g' = c (W_g[keep] ⊙ g) P,  W_u' = c (W_u[keep] ⊙ g) P,  W_d' = Pᵀ W_d[:, keep]
/// ```
///
/// g (the teacher's pre-FFN norm gain) is folded in, so the student's norm gain stays 1; with
/// the student's state x_s = Pᵀ x holding a share ρ of x's energy, RMSNorm(x_s) = Pᵀ RMSNorm(x) /
/// √(D ρ / d), which c = √(D ρ / d) undoes. At d = D and F_s = F the student's FFN is the
/// teacher's, rotated by P. The mixers (KDA, MLA) start fresh: they are not the teacher's kind.
/// Returns how many layers inherited.
pub fn inherit_ffns(
    model: &Model,
    inherited: &Inherited,
    teacher_layers: usize,
    teacher_ffn: &dyn Fn(usize) -> Result<TeacherFfn>,
) -> Result<usize> {
    let vars = model.vs.variables();
    let p = &inherited.projection; // [D, d]
    let (big_d, d) = (p.size()[0], p.size()[1]);
    let c = (big_d as f64 * inherited.energy_kept / d as f64).sqrt();
    let ls = model.config.num_layers();
    let mut n = 0;
    for l in 0..ls {
        let name = |m: &str| format!("model.layers.{l}.mlp.{m}_proj.weight");
        let (Some(gate_s), Some(up_s), Some(down_s)) =
            (vars.get(&name("gate")), vars.get(&name("up")), vars.get(&name("down")))
        else {
            continue; // a MoE layer: its experts start fresh
        };
        let fs = gate_s.size()[0];
        let t = teacher_ffn(teacher_layer_for(l, ls, teacher_layers))?;
        let f = (t.gate.len() / big_d as usize) as i64;
        if f < fs || t.up.len() != t.gate.len() || t.down.len() != t.gate.len() || t.norm.len() != big_d as usize {
            return Err(Error::Invalid(format!(
                "teacher FFN for student layer {l}: {f} channels of width {big_d} (the student's layer needs at \
                 least {fs}), or its up / down / norm shapes disagree"
            )));
        }
        let mat = |x: &[f32], r: i64, c: i64| Tensor::from_slice(x).view([r, c]).to_kind(Kind::Double);
        let g = mat(&t.norm, 1, big_d);
        let (wg, wu, wd) = (mat(&t.gate, f, big_d) * &g, mat(&t.up, f, big_d) * &g, mat(&t.down, big_d, f));
        let norms = |x: &Tensor, dim: i64| x.square().sum_dim_intlist([dim].as_slice(), false, Kind::Double).sqrt();
        let score = norms(&wg, 1) * norms(&wu, 1) * norms(&wd, 0); // [F]
        let keep = score.topk(fs, 0, true, true).1; // [F_s]
        set_param(gate_s, &(wg.index_select(0, &keep).matmul(p) * c));
        set_param(up_s, &(wu.index_select(0, &keep).matmul(p) * c));
        set_param(down_s, &p.transpose(0, 1).matmul(&wd.index_select(1, &keep)));
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn full_width_projection_keeps_every_score() {
        // With d = D the projection is a rotation: every embedding·head score is unchanged.
        let cfg = k3_config::presets::preset("tiny", Some(64)).expect("preset");
        let model = Model::init(&cfg, 0, Device::Cpu).expect("init");
        let d = cfg.hidden_size();
        let (teacher, head) = crate::with_seed(1, || {
            (
                Tensor::randn([64, d as i64], (Kind::Float, Device::Cpu)),
                Tensor::randn([64, d as i64], (Kind::Float, Device::Cpu)),
            )
        });
        let (e, h) = (
            Vec::<f32>::try_from(&teacher.flatten(0, -1)).expect("f32"),
            Vec::<f32>::try_from(&head.flatten(0, -1)).expect("f32"),
        );
        let r = inherit_embeddings(&model, &e, &h, d).expect("inherit");
        assert!((r.energy_kept - 1.0).abs() < 1e-9);
        let vars = model.vs.variables();
        let got = vars["model.embed_tokens.weight"].matmul(&vars["lm_head.weight"].transpose(0, 1));
        let want = teacher.matmul(&head.transpose(0, 1)) * (INIT_STD / r.head_rms);
        let err = (got - want).abs().max().double_value(&[]);
        assert!(err < 1e-3, "scores changed by {err}");
        let head_rms = vars["lm_head.weight"].square().mean(Kind::Double).sqrt().double_value(&[]);
        assert!((head_rms - INIT_STD).abs() < 1e-6, "head rms {head_rms}");
    }

    #[test]
    fn full_width_ffn_is_the_teachers_rotated() {
        // d = D, F_s = F: every student FFN computes P · teacher_FFN(g ⊙ n) from Pᵀ n.
        let cfg = k3_config::presets::preset("tiny", Some(64)).expect("preset");
        let model = Model::init(&cfg, 0, Device::Cpu).expect("init");
        let (d, ls) = (cfg.hidden_size() as i64, cfg.num_layers());
        let f = model.vs.variables()["model.layers.0.mlp.gate_proj.weight"].size()[0];
        // A fresh seed per draw, so gate, up and the five teacher layers all differ.
        let draws = std::cell::Cell::new(0i64);
        let rand = |r: i64, c: i64| {
            draws.set(draws.get() + 1);
            crate::with_seed(draws.get(), || Tensor::randn([r, c], (Kind::Float, Device::Cpu)))
        };
        let flat = |t: &Tensor| Vec::<f32>::try_from(&t.flatten(0, -1)).expect("f32");
        let e = flat(&rand(64, d));
        let r = inherit_embeddings(&model, &e, &e, d as usize).expect("embeddings");
        let teacher: Vec<(Tensor, Tensor, Tensor, Tensor)> =
            (0..5).map(|_| (rand(f, d), rand(f, d), rand(d, f), rand(1, d).abs() + 0.5)).collect();
        let load = |i: usize| {
            let (g, u, dn, nm) = &teacher[i];
            Ok(TeacherFfn { gate: flat(g), up: flat(u), down: flat(dn), norm: flat(nm) })
        };
        assert_eq!(inherit_ffns(&model, &r, teacher.len(), &load).expect("ffns"), ls);
        let vars = model.vs.variables();
        let p = r.projection.to_kind(Kind::Float);
        let x = rand(7, d); // normalised inputs, teacher coordinates
        let swiglu = |x: &Tensor, g: &Tensor, u: &Tensor, dn: &Tensor| {
            (x.matmul(&g.transpose(0, 1)).silu() * x.matmul(&u.transpose(0, 1))).matmul(&dn.transpose(0, 1))
        };
        for l in 0..ls {
            let (g, u, dn, nm) = &teacher[teacher_layer_for(l, ls, teacher.len())];
            let want = swiglu(&(&x * nm), g, u, dn);
            let w = |m: &str| vars[&format!("model.layers.{l}.mlp.{m}_proj.weight")].shallow_clone();
            let got = swiglu(&x.matmul(&p), &w("gate"), &w("up"), &w("down")).matmul(&p.transpose(0, 1));
            let rel = ((&got - &want).abs().max() / want.abs().max()).double_value(&[]);
            assert!(rel < 1e-4, "layer {l}: FFN output changed by {rel}");
        }
        assert_eq!(
            (teacher_layer_for(0, 8, 30), teacher_layer_for(7, 8, 30), teacher_layer_for(3, 8, 30)),
            (0, 29, 12)
        );
        // A teacher with fewer channels than the student's FFN is refused, naming the layer.
        let narrow = |_: usize| {
            Ok(TeacherFfn {
                gate: vec![0.0; 4 * d as usize],
                up: vec![0.0; 4 * d as usize],
                down: vec![0.0; 4 * d as usize],
                norm: vec![1.0; d as usize],
            })
        };
        let err = inherit_ffns(&model, &r, 5, &narrow).expect_err("too few channels").to_string();
        assert!(err.contains("student layer 0"), "{err}");
    }

    #[test]
    fn narrowing_keeps_the_dominant_directions() {
        // A rank-3 embedding in 2·d dimensions narrows to d losslessly; a wider student is refused.
        let cfg = k3_config::presets::preset("tiny", Some(64)).expect("preset");
        let model = Model::init(&cfg, 0, Device::Cpu).expect("init");
        let d = cfg.hidden_size() as i64;
        let low = crate::with_seed(3, || {
            Tensor::randn([64, 3], (Kind::Float, Device::Cpu))
                .matmul(&Tensor::randn([3, 2 * d], (Kind::Float, Device::Cpu)))
        });
        let e = Vec::<f32>::try_from(&low.flatten(0, -1)).expect("f32");
        let r = inherit_embeddings(&model, &e, &e, 2 * d as usize).expect("inherit");
        assert!(r.energy_kept > 1.0 - 1e-6, "kept {}", r.energy_kept);
        let vars = model.vs.variables();
        let emb = &vars["model.embed_tokens.weight"];
        let got = emb.matmul(&emb.transpose(0, 1));
        let want = low.matmul(&low.transpose(0, 1));
        let rel = ((&got - &want).abs().max() / want.abs().max()).double_value(&[]);
        assert!(rel < 1e-4, "Gram matrix changed by {rel}");
        let narrow = vec![0f32; 64 * (d as usize / 2)];
        let err = inherit_embeddings(&model, &narrow, &narrow, d as usize / 2)
            .expect_err("a wider student is refused")
            .to_string();
        assert!(err.contains("exceeds the teacher's"), "{err}");
    }
}
