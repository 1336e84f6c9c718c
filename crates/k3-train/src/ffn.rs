//! Gated feed-forward blocks: SwiGLU (Kimi Linear) and K3's SiTU-GLU (architecture.md §5(d)).
//! Dims: C input width (hidden, or the MoE latent), F intermediate.

use k3_config::Activation;
use tch::Tensor;

use crate::nn::Linear;

/// `SiTU-GLU(g, u) = [β·tanh(g/β)·σ(g)] · [β_lin·tanh(u/β_lin)]`, in f32. `β_lin ≤ 0` leaves the
/// up branch uncapped (llama.cpp `kimi-k3`). As β, β_lin → ∞ it is SwiGLU.
pub fn situ_glu(g: &Tensor, u: &Tensor, beta: f64, linear_beta: f64) -> Tensor {
    let kind = g.kind();
    let (g, u) = (g.to_kind(crate::nn::compute_kind(kind)), u.to_kind(crate::nn::compute_kind(kind)));
    let gate = (&g / beta).tanh() * beta * g.sigmoid();
    let up = if linear_beta > 0.0 { (&u / linear_beta).tanh() * linear_beta } else { u };
    (gate * up).to_kind(kind)
}

/// `act(g) · u` for the configured activation.
pub fn glu(g: &Tensor, u: &Tensor, act: Activation) -> Tensor {
    match act {
        Activation::Silu => g.silu() * u,
        Activation::Situ { beta, linear_beta } => situ_glu(g, u, beta as f64, linear_beta as f64),
    }
}

/// `down(act(gate(x)) · up(x))` with HF names `{gate,up,down}_proj` (or Moonshot's expert
/// names `w1`/`w3`/`w2`).
#[derive(Debug)]
pub struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    act: Activation,
}

impl Mlp {
    /// HF dense / shared-expert naming: `gate_proj`, `up_proj`, `down_proj`.
    pub fn new(p: &tch::nn::Path, inp: usize, inter: usize, act: Activation) -> Self {
        Self::new_with_bias(p, inp, inter, act, false)
    }

    /// As [`Mlp::new`], with biases on all three projections when `bias` (Llama's `mlp_bias`).
    pub fn new_with_bias(p: &tch::nn::Path, inp: usize, inter: usize, act: Activation, bias: bool) -> Self {
        Self {
            gate: Linear::new(p, "gate_proj", inp, inter, bias),
            up: Linear::new(p, "up_proj", inp, inter, bias),
            down: Linear::new(p, "down_proj", inter, inp, bias),
            act,
        }
    }

    /// Moonshot routed-expert naming: `w1` (gate), `w3` (up), `w2` (down).
    pub fn new_expert(p: &tch::nn::Path, inp: usize, inter: usize, act: Activation) -> Self {
        Self {
            gate: Linear::new(p, "w1", inp, inter, false),
            up: Linear::new(p, "w3", inp, inter, false),
            down: Linear::new(p, "w2", inter, inp, false),
            act,
        }
    }

    /// # Shapes
    /// x: [..., C] → [..., C]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.down.forward(&glu(&self.gate.forward(x), &self.up.forward(x), self.act))
    }
}
