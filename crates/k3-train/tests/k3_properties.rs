//! Self-consistency properties of the K3 extensions (architecture.md §10(b)), which have no
//! transformers reference.

use k3_config::{presets, Activation, ModelConfig};
use k3_train::ffn::{glu, situ_glu};
use k3_train::kimi::Ffn;
use k3_train::residual::AttnResPoint;
use k3_train::{Model, Net};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn attn_res_with_zero_queries_is_the_uniform_mean_and_one_source_is_identity() {
    let vs = VarStore::new(Device::Cpu);
    let point = AttnResPoint::new(&vs.root(), "mlp_res", 32); // pseudo-query initialised to zero
    tch::manual_seed(1);
    let srcs: Vec<Tensor> =
        (0..4).map(|i| Tensor::randn([2, 5, 32], (Kind::Float, Device::Cpu)) * (i + 1) as f64).collect();
    let mixed = point.mix(&srcs[3], &srcs[..3], 1e-5);
    let mean = Tensor::stack(&srcs, 0).mean_dim(0, false, None);
    assert!(max_abs(&mixed, &mean) < 1e-6, "zero queries must give the uniform mean");
    let alone = point.mix(&srcs[0], &[], 1e-5);
    assert!(max_abs(&alone, &srcs[0]) < 1e-7, "one source is the identity");
    // With a non-zero query the mix is a convex combination: inside the sources' per-element hull.
    k3_train::nn::set_param(&point.proj, &Tensor::randn([1, 32], (Kind::Float, Device::Cpu)));
    let m = point.mix(&srcs[3], &srcs[..3], 1e-5);
    let st = Tensor::stack(&srcs, 0);
    assert!(bool::try_from(m.le_tensor(&(st.amax(0, false) + 1e-5)).all()).expect("bool"));
    assert!(bool::try_from(m.ge_tensor(&(st.amin(0, false) - 1e-5)).all()).expect("bool"));
}

#[test]
fn situ_with_huge_beta_is_swiglu_and_caps_bind_otherwise() {
    tch::manual_seed(2);
    let g = Tensor::randn([64, 16], (Kind::Double, Device::Cpu)) * 5.0;
    let u = Tensor::randn([64, 16], (Kind::Double, Device::Cpu)) * 5.0;
    let swiglu = glu(&g, &u, Activation::Silu);
    assert!(max_abs(&situ_glu(&g, &u, 1e9, 1e9), &swiglu) < 1e-9);
    // β_lin ≤ 0 leaves the up branch uncapped (llama.cpp kimi-k3 semantics).
    let gate_only = situ_glu(&g, &u, 1e9, 0.0);
    assert!(max_abs(&gate_only, &swiglu) < 1e-9);
    // With K3's caps the output is bounded by β·β_lin = 100.
    let capped = situ_glu(&(&g * 100.0), &(&u * 100.0), 4.0, 25.0);
    assert!(capped.abs().max().double_value(&[]) <= 100.0);
}

fn tiny_k3_model() -> Model {
    Model::init(&ModelConfig::Kimi(presets::tiny_k3()), 5, Device::Cpu).expect("init")
}

#[test]
fn router_bias_changes_selection_but_not_the_weights_of_a_selection() {
    let m = tiny_k3_model();
    let Net::Kimi(net) = &m.net else { panic!() };
    let Ffn::Moe(moe) = &net.blocks[1].ffn else { panic!("layer 1 is MoE in tiny-k3") };
    tch::manual_seed(3);
    k3_train::nn::set_param(&net.embed, &Tensor::randn([4096, 192], (Kind::Float, Device::Cpu)));
    let x = Tensor::randn([300, 192], (Kind::Float, Device::Cpu));
    let r0 = moe.route(&x);
    // Renormalised weights sum to routed_scaling_factor (1.0 for K3).
    let sums = r0.weight.sum_dim_intlist(-1, false, None);
    assert!(max_abs(&sums, &sums.ones_like()) < 1e-6);
    // A large bias on expert 5 pulls it into every selection...
    let bias = Tensor::zeros([8], (Kind::Float, Device::Cpu)).index_fill(0, &Tensor::from_slice(&[5i64]), 10.0);
    k3_train::nn::set_param(&moe.correction_bias, &bias);
    let r1 = moe.route(&x);
    assert!(bool::try_from(r1.idx.eq(5).any_dim(-1, false).all()).expect("bool"), "bias must change selection");
    // ...but the weights of the chosen experts are still the unbiased σ scores, renormalised.
    let s = r1.scores.gather(1, &r1.idx, false);
    let expect = &s / s.sum_dim_intlist(-1, true, None);
    assert!(max_abs(&r1.weight, &expect) < 1e-6);
    k3_train::nn::set_param(&moe.correction_bias, &bias.zeros_like());
}

#[test]
fn every_preset_runs_and_decode_matches_full_forward() {
    for name in ["tiny", "tiny-k3", "tiny-kda", "tiny-llama"] {
        let cfg = presets::preset(name, Some(512)).expect("preset");
        let m = Model::init(&cfg, 9, Device::Cpu).expect("init");
        tch::manual_seed(4);
        let ids = Tensor::randint(512, [2, 70], (Kind::Int64, Device::Cpu));
        let full = tch::no_grad(|| m.forward(&ids, None, false)).logits;
        let mut st = m.new_state(2);
        let mut parts = vec![tch::no_grad(|| m.forward(&ids.narrow(1, 0, 66), Some(&mut st), false)).logits];
        for i in 66..70 {
            parts.push(tch::no_grad(|| m.forward(&ids.narrow(1, i, 1), Some(&mut st), false)).logits);
        }
        let d = max_abs(&Tensor::cat(&parts, 1), &full);
        assert!(d < 1e-4, "{name}: prefill+decode differs from the full forward by {d:e}");
    }
}
