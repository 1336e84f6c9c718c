//! Property tests of the sparse KD losses against the dense reference.

use super::*;
use k3_data::signals::top_k;

const V: i64 = 64;
const N: i64 = 5;
const ALL: [Divergence; 3] = [Divergence::ForwardKl, Divergence::ReverseKl, Divergence::Jsd];
const POLICIES: [TailPolicy; 3] = [TailPolicy::Renormalize, TailPolicy::Ignore, TailPolicy::Uniform];

fn rand(seed: i64, scale: f64) -> Tensor {
    crate::with_seed(seed, || Tensor::randn([N, V], (Kind::Float, tch::Device::Cpu))) * scale
}

/// Dense teacher log-probs [N, V] at temperature `tau`, and its top-k per row.
fn teacher(logits: &Tensor, tau: f64, k: usize) -> (Tensor, Vec<TopK>) {
    let lp = (logits / tau).log_softmax(-1, Kind::Float);
    let rows: Vec<Vec<f32>> = (0..N).map(|i| Vec::<f32>::try_from(&lp.get(i)).expect("row")).collect();
    (lp, rows.iter().map(|r| top_k(r, k)).collect())
}

fn targets(tops: &[TopK], tc: f64, tau: f64) -> SparseTargets {
    let refs: Vec<&TopK> = tops.iter().collect();
    SparseTargets::new(&refs, tc, tau).expect("targets")
}

fn loss(divergence: Divergence, tail: TailPolicy, tau: f64) -> KdLoss {
    KdLoss { divergence, beta: 0.3, temperature: tau, tail }
}

fn val(t: &Tensor) -> f64 {
    t.double_value(&[])
}

#[test]
fn sparse_equals_dense_when_k_is_the_vocabulary() {
    let (s, tl) = (rand(1, 2.0), rand(2, 3.0));
    let (lp, tops) = teacher(&tl, 1.0, V as usize);
    let t = targets(&tops, 1.0, 1.0);
    for d in ALL {
        let dense = val(&dense_divergence(&s, &lp, d, 0.3, 1.0));
        assert!(dense > 0.01, "{d:?}: a real divergence between different distributions: {dense}");
        for p in POLICIES {
            let sparse = val(&sparse_divergence(&s, &t, &loss(d, p, 1.0)));
            assert!((sparse - dense).abs() < 1e-5 * dense.max(1.0), "{d:?} {p:?}: sparse {sparse} vs dense {dense}");
        }
    }
}

#[test]
fn uniform_tail_is_exact_for_the_completed_teacher() {
    // With the tail spread uniformly, the sparse loss is the dense divergence against that
    // completed distribution, for every k.
    let (s, tl) = (rand(3, 2.0), rand(4, 3.0));
    for k in [1usize, 4, 16] {
        let (_, tops) = teacher(&tl, 1.0, k);
        let t = targets(&tops, 1.0, 1.0);
        let mut full = vec![0f32; (N * V) as usize];
        for (i, tk) in tops.iter().enumerate() {
            let tail = (tk.tail_logmass as f64).exp();
            let u = (tail / (V as usize - k) as f64).ln() as f32;
            full[i * V as usize..(i + 1) * V as usize].fill(u);
            for (&id, &l) in tk.ids.iter().zip(&tk.logprobs) {
                full[i * V as usize + id as usize] = l;
            }
        }
        let completed = Tensor::from_slice(&full).view([N, V]);
        for d in ALL {
            let dense = val(&dense_divergence(&s, &completed, d, 0.3, 1.0));
            let sparse = val(&sparse_divergence(&s, &t, &loss(d, TailPolicy::Uniform, 1.0)));
            assert!((sparse - dense).abs() < 1e-5 * dense.max(1.0), "k={k} {d:?}: sparse {sparse} vs dense {dense}");
        }
    }
}

#[test]
fn sparse_kl_tends_to_dense_kl_as_k_grows() {
    let (s, tl) = (rand(5, 2.0), rand(6, 4.0));
    let (lp, _) = teacher(&tl, 1.0, 1);
    for p in [TailPolicy::Renormalize, TailPolicy::Uniform] {
        for d in ALL {
            let dense = val(&dense_divergence(&s, &lp, d, 0.3, 1.0));
            let err: Vec<f64> = [2usize, 8, 32, V as usize]
                .iter()
                .map(|&k| {
                    let (_, tops) = teacher(&tl, 1.0, k);
                    (val(&sparse_divergence(&s, &targets(&tops, 1.0, 1.0), &loss(d, p, 1.0))) - dense).abs()
                })
                .collect();
            assert!(err[3] < 1e-5, "{p:?} {d:?}: k = V is exact: {err:?}");
            assert!(err[2] < err[0], "{p:?} {d:?}: the error shrinks with k: {err:?}");
        }
    }
}

/// d loss / d logits for one position.
fn grad(logits: &Tensor, t: &SparseTargets, l: &KdLoss) -> Vec<f32> {
    let z = logits.detach().set_requires_grad(true);
    sparse_divergence(&z, t, l).backward();
    Vec::<f32>::try_from(&z.grad().reshape([-1])).expect("grad")
}

#[test]
fn forward_kl_gradient_is_student_minus_teacher() {
    let s = rand(7, 2.0).narrow(0, 0, 1);
    let tl = rand(8, 3.0).narrow(0, 0, 1);
    let lp = tl.log_softmax(-1, Kind::Float).reshape([-1]);
    let lp = Vec::<f32>::try_from(&lp).expect("lp");
    let q: Vec<f32> = Vec::try_from(&s.softmax(-1, Kind::Float).reshape([-1])).expect("q");
    let k = 8;
    let tk = top_k(&lp, k);
    let t = targets(std::slice::from_ref(&tk), 1.0, 1.0);
    // Renormalize: on the support q − p̃, elsewhere q.
    let g = grad(&s, &t, &loss(Divergence::ForwardKl, TailPolicy::Renormalize, 1.0));
    let kept: f32 = tk.logprobs.iter().map(|l| l.exp()).sum();
    for i in 0..V as usize {
        let p = tk.ids.iter().position(|&id| id as usize == i).map_or(0.0, |j| tk.logprobs[j].exp() / kept);
        assert!((g[i] - (q[i] - p)).abs() < 1e-5, "token {i}: grad {} vs q − p {}", g[i], q[i] - p);
    }
    // Uniform: q − p for the completed teacher, everywhere.
    let g = grad(&s, &t, &loss(Divergence::ForwardKl, TailPolicy::Uniform, 1.0));
    let u = tk.tail_logmass.exp() / (V as usize - k) as f32;
    for i in 0..V as usize {
        let p = tk.ids.iter().position(|&id| id as usize == i).map_or(u, |j| tk.logprobs[j].exp());
        assert!((g[i] - (q[i] - p)).abs() < 1e-5, "token {i}: grad {} vs q − p {}", g[i], q[i] - p);
    }
}

#[test]
fn temperature_retempers_the_teacher_and_scales_by_tau_squared() {
    let (s, tl) = (rand(9, 2.0), rand(10, 3.0));
    let tau = 2.0;
    // Stored at τ_c = 1; the loss at τ = 2 must match a dense teacher captured at τ = 2.
    let (_, tops) = teacher(&tl, 1.0, V as usize);
    let (lp2, _) = teacher(&tl, tau, 1);
    let t = targets(&tops, 1.0, tau);
    for d in ALL {
        let dense = val(&dense_divergence(&s, &lp2, d, 0.3, tau));
        let sparse = val(&sparse_divergence(&s, &t, &loss(d, TailPolicy::Uniform, tau)));
        assert!((sparse - dense).abs() < 1e-4 * dense.max(1.0), "{d:?}: {sparse} vs {dense}");
    }
    let one = val(&dense_divergence(&s, &lp2, Divergence::ForwardKl, 0.3, 1.0));
    let two = val(&dense_divergence(&s, &lp2, Divergence::ForwardKl, 0.3, tau));
    assert!((one - two).abs() > 1e-3, "the student is tempered too");
}

#[test]
fn the_loss_is_zero_when_the_student_is_the_teacher() {
    let tl = rand(11, 3.0);
    let (_, tops) = teacher(&tl, 1.0, 16);
    let t = targets(&tops, 1.0, 1.0);
    for d in ALL {
        // Renormalize compares on the support; the student equal to the teacher there is zero.
        let l = val(&sparse_divergence(&tl, &t, &loss(d, TailPolicy::Renormalize, 1.0)));
        match d {
            Divergence::ForwardKl => assert!(l > 0.0, "forward KL against a renormalised top-k is positive: {l}"),
            _ => assert!(l.abs() < 1e-5, "{d:?}: {l}"),
        }
    }
    assert!((top1_agreement(&tl, &t) - 1.0).abs() < 1e-12);
}

#[test]
fn bad_settings_are_refused() {
    let mut l = loss(Divergence::Jsd, TailPolicy::Uniform, 1.0);
    l.beta = 1.0;
    assert!(l.validate().expect_err("refused").to_string().contains("beta"));
    l.beta = 0.5;
    l.temperature = 0.0;
    assert!(l.validate().expect_err("refused").to_string().contains("temperature"));
}

#[test]
fn a_zero_tail_gives_finite_losses_and_gradients() {
    // A peaked teacher whose top-k holds all the mass (tail stored as −inf).
    let s = rand(12, 2.0);
    let mut tops: Vec<TopK> = (0..N).map(|_| top_k(&vec![0.0; V as usize], 4)).collect();
    for (i, t) in tops.iter_mut().enumerate() {
        t.logprobs = vec![-0.1, -2.5, -4.0, -6.0];
        t.ids = vec![i as u32, 7, 9, 11];
        t.tail_logmass = f32::NEG_INFINITY;
    }
    let t = targets(&tops, 1.0, 1.0);
    for d in ALL {
        for p in POLICIES {
            let z = s.detach().set_requires_grad(true);
            let l = sparse_divergence(&z, &t, &loss(d, p, 1.0));
            l.backward();
            let g = z.grad().abs().max().double_value(&[]);
            assert!(val(&l).is_finite() && g.is_finite(), "{d:?} {p:?}: loss {} grad {g}", val(&l));
        }
    }
}
