"""Golden fixture for the K3 profile, from an independent naive implementation of the equations.

    scripts/golden        # runs this after make_golden.py

transformers 5.24 has no K3 features (lower-bound gate, full-rank KDA gate, gated MLA, AttnRes,
SiTU, latent MoE), so this file writes them out again from shared/docs/architecture.md §1-§5,
token by token and expert by expert, in float64, with no code shared with the Rust side (fla's naive
KDA functions are not used here because they upcast to float32; kda_gate.safetensors checks the
Rust gates against them instead).

Writes tests/golden/tiny_k3/ (config.json in Moonshot/K3 field names + model.safetensors, names
as llama.cpp's kimi-k3 converter expects, A_log as [H]) and tiny_k3_io.safetensors
(`input_ids` [2,40], `logits` [2,40,V], `stream.{i}` = the residual-stream value entering layer i).
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "tests", "golden")
torch.set_default_dtype(torch.float64)  # the reference runs in f64; fixtures are stored in f32

D, V, L, H, HD = 64, 256, 4, 2, 16          # hidden, vocab, layers, heads, KDA head dim (= gate rank)
DN, DR, DV, C, RQ = 16, 8, 16, 32, 24       # MLA nope/rope/value dims, kv_lora, q_lora
E, TOPK, FE, LAT, NSH = 4, 2, 32, 48, 1     # experts, top-k, expert width, latent, shared experts
F_DENSE, EPS, LB, BLOCK = 96, 1e-5, -5.0, 2
BETA, BETA_LIN = 1.5, 3.0                   # small caps so that the tanh soft-caps actually bind
MLA_LAYERS = [4]                            # 1-indexed
config = {
    "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_linear",
    "vocab_size": V, "hidden_size": D, "intermediate_size": F_DENSE, "num_hidden_layers": L,
    "num_attention_heads": H, "num_key_value_heads": H, "hidden_act": "situ",
    "activation_situ_beta": BETA, "activation_situ_linear_beta": BETA_LIN, "rms_norm_eps": EPS,
    "q_lora_rank": RQ, "kv_lora_rank": C, "qk_nope_head_dim": DN, "qk_rope_head_dim": DR, "v_head_dim": DV,
    "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": E, "num_experts_per_token": TOPK,
    "num_shared_experts": NSH, "moe_intermediate_size": FE, "routed_expert_hidden_size": LAT,
    "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
    "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "attn_res_block_size": BLOCK, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "linear_attn_config": {"num_heads": H, "head_dim": HD, "short_conv_kernel_size": 4,
                                              "gate_lower_bound": LB, "use_full_rank_gate": True,
                                              "full_attn_layers": MLA_LAYERS,
                                              "kda_layers": [i for i in range(1, L + 1) if i not in MLA_LAYERS]},
}

gen = torch.Generator().manual_seed(2026)
W = {}


def param(name, *shape, kind="matrix"):
    if kind == "matrix":
        t = torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])
    elif kind == "norm":
        t = 1.0 + 0.1 * torch.randn(*shape, generator=gen)
    else:
        t = 0.3 * torch.randn(*shape, generator=gen)
    W[name] = t.float().double()  # the fixture stores f32: compute with exactly those values
    return W[name]


param("model.embed_tokens.weight", V, D)
for i in range(L):
    p = f"model.layers.{i}."
    param(p + "input_layernorm.weight", D, kind="norm")
    param(p + "post_attention_layernorm.weight", D, kind="norm")
    for pt in ("self_attention_res", "mlp_res"):
        param(p + f"{pt}_norm.weight", D, kind="norm")
        param(p + f"{pt}_proj.weight", 1, D, kind="vec")  # non-zero queries so the mixes are not uniform
    a = p + "self_attn."
    if (i + 1) in MLA_LAYERS:
        param(a + "q_a_proj.weight", RQ, D)
        param(a + "q_a_layernorm.weight", RQ, kind="norm")
        param(a + "q_b_proj.weight", H * (DN + DR), RQ)
        param(a + "kv_a_proj_with_mqa.weight", C + DR, D)
        param(a + "kv_a_layernorm.weight", C, kind="norm")
        param(a + "kv_b_proj.weight", H * (DN + DV), C)
        param(a + "o_proj.weight", D, H * DV)
        param(a + "g_proj.weight", H * DV, D)
    else:
        for n in ("q", "k", "v"):
            param(a + f"{n}_proj.weight", H * HD, D)
            param(a + f"{n}_conv1d.weight", H * HD, 1, 4, kind="matrix")
        param(a + "f_a_proj.weight", HD, D)
        param(a + "f_b_proj.weight", H * HD, HD)
        W[a + "A_log"] = (0.3 * torch.randn(H, generator=gen)).float().double()
        W[a + "dt_bias"] = (0.5 * torch.randn(H * HD, generator=gen)).float().double()
        param(a + "b_proj.weight", H, D)
        param(a + "g_proj.weight", H * HD, D)
        param(a + "o_norm.weight", HD, kind="norm")
        param(a + "o_proj.weight", D, H * HD)
    if i == 0:
        for n, shape in (("gate_proj", (F_DENSE, D)), ("up_proj", (F_DENSE, D)), ("down_proj", (D, F_DENSE))):
            param(p + f"mlp.{n}.weight", *shape)
    else:
        m = p + "block_sparse_moe."
        param(m + "gate.weight", E, D)
        W[m + "gate.e_score_correction_bias"] = (0.1 * torch.randn(E, generator=gen)).float().double()
        param(m + "routed_expert_down_proj.weight", LAT, D)
        param(m + "routed_expert_up_proj.weight", D, LAT)
        param(m + "routed_expert_norm.weight", LAT, kind="norm")
        for e in range(E):
            param(m + f"experts.{e}.w1.weight", FE, LAT)
            param(m + f"experts.{e}.w3.weight", FE, LAT)
            param(m + f"experts.{e}.w2.weight", LAT, FE)
        for n, shape in (("gate_proj", (FE * NSH, D)), ("up_proj", (FE * NSH, D)), ("down_proj", (D, FE * NSH))):
            param(m + f"shared_experts.{n}.weight", *shape)
param("model.output_attn_res_norm.weight", D, kind="norm")
param("model.output_attn_res_proj.weight", 1, D, kind="vec")
param("model.norm.weight", D, kind="norm")
param("lm_head.weight", V, D)


def rms(x, w, eps=EPS):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def situ_glu(g, u):
    return (BETA * torch.tanh(g / BETA) * torch.sigmoid(g)) * (BETA_LIN * torch.tanh(u / BETA_LIN))


def kda(x, a):  # x [T, D], one sequence
    T = x.shape[0]
    outs = []
    for n in ("q", "k", "v"):
        y = x @ W[a + f"{n}_proj.weight"].T                    # [T, W]
        ker = W[a + f"{n}_conv1d.weight"][:, 0, :]              # [W, 4]
        yp = torch.cat([torch.zeros(3, y.shape[1]), y], 0)
        conv = torch.stack([(yp[t:t + 4] * ker.T).sum(0) for t in range(T)])   # causal depthwise
        outs.append(F.silu(conv).view(T, H, HD))
    q, k, v = outs
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    f = (x @ W[a + "f_a_proj.weight"].T @ W[a + "f_b_proj.weight"].T).view(T, H, HD)
    g = LB * torch.sigmoid(W[a + "A_log"].exp()[:, None] * (f + W[a + "dt_bias"].view(H, HD)))  # lower-bound gate
    beta = torch.sigmoid(x @ W[a + "b_proj.weight"].T)          # [T, H]
    S = torch.zeros(H, HD, HD)                                 # per head [K, V]
    o = torch.zeros(T, H, HD)
    for t in range(T):                                         # the delta rule, architecture.md §1(a)
        S = S * g[t].exp()[:, :, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        o[t] = torch.einsum("hkv,hk->hv", S, q[t] * HD ** -0.5)
    gate = (x @ W[a + "g_proj.weight"].T).view(T, H, HD)        # full-rank output gate
    o = rms(o, W[a + "o_norm.weight"]) * torch.sigmoid(gate)
    return o.reshape(T, H * HD) @ W[a + "o_proj.weight"].T


def mla(x, a):
    T = x.shape[0]
    q = rms(x @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"], 1e-6) @ W[a + "q_b_proj.weight"].T
    q = q.view(T, H, DN + DR)
    ckv = x @ W[a + "kv_a_proj_with_mqa.weight"].T
    c_kv, k_r = rms(ckv[:, :C], W[a + "kv_a_layernorm.weight"], 1e-6), ckv[:, C:]
    kv = (c_kv @ W[a + "kv_b_proj.weight"].T).view(T, H, DN + DV)
    out = torch.zeros(T, H, DV)
    for h in range(H):
        for t in range(T):
            kk = torch.cat([kv[: t + 1, h, :DN], k_r[: t + 1]], -1)          # NoPE keys of positions <= t
            s = (kk @ q[t, h]) / math.sqrt(DN + DR)
            out[t, h] = torch.softmax(s, 0) @ kv[: t + 1, h, DN:]
    o = out.reshape(T, H * DV) * torch.sigmoid(x @ W[a + "g_proj.weight"].T)  # gate from the mixer input
    return o @ W[a + "o_proj.weight"].T


def moe(x, m):
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = torch.sigmoid(W[m + "gate.weight"] @ x[t])
        chosen = torch.topk(s + W[m + "gate.e_score_correction_bias"], TOPK).indices
        w = s[chosen] / s[chosen].sum()
        z = W[m + "routed_expert_down_proj.weight"] @ x[t]
        u = sum(w[j] * (W[m + f"experts.{e}.w2.weight"] @ situ_glu(W[m + f"experts.{e}.w1.weight"] @ z,
                                                                    W[m + f"experts.{e}.w3.weight"] @ z))
                for j, e in enumerate(chosen.tolist()))
        routed = W[m + "routed_expert_up_proj.weight"] @ rms(u, W[m + "routed_expert_norm.weight"])
        sh = W[m + "shared_experts.down_proj.weight"] @ situ_glu(W[m + "shared_experts.gate_proj.weight"] @ x[t],
                                                                 W[m + "shared_experts.up_proj.weight"] @ x[t])
        y[t] = routed + sh
    return y


def attn_res(prefix, bank, norm, proj):  # softmax over depth sources of raw values, RMSNorm'd keys
    srcs = bank + [prefix]
    scores = torch.stack([(rms(s, norm) * proj[0]).sum(-1) for s in srcs], -1)  # [T, N+1]
    p = torch.softmax(scores, -1)
    return sum(p[:, n:n + 1] * s for n, s in enumerate(srcs))


def forward(ids):
    prefix = W["model.embed_tokens.weight"][ids]
    bank, stream = [], []
    for i in range(L):
        p = f"model.layers.{i}."
        stream.append(prefix)
        x = prefix if not bank else attn_res(prefix, bank, W[p + "self_attention_res_norm.weight"],
                                             W[p + "self_attention_res_proj.weight"])
        if i % BLOCK == 0:
            bank.append(prefix)
            prefix = None
        h = rms(x, W[p + "input_layernorm.weight"])
        a = mla(h, p + "self_attn.") if (i + 1) in MLA_LAYERS else kda(h, p + "self_attn.")
        prefix = a if prefix is None else prefix + a
        z = attn_res(prefix, bank, W[p + "mlp_res_norm.weight"], W[p + "mlp_res_proj.weight"])
        h = rms(z, W[p + "post_attention_layernorm.weight"])
        if i == 0:
            m = W[p + "mlp.down_proj.weight"] @ situ_glu(W[p + "mlp.gate_proj.weight"] @ h.T,
                                                          W[p + "mlp.up_proj.weight"] @ h.T)
            m = m.T
        else:
            m = moe(h, p + "block_sparse_moe.")
        prefix = prefix + m
    h = attn_res(prefix, bank, W["model.output_attn_res_norm.weight"], W["model.output_attn_res_proj.weight"])
    return rms(h, W["model.norm.weight"]) @ W["lm_head.weight"].T, stream


ids = torch.randint(3, V, (2, 40), generator=gen)
with torch.no_grad():
    res = [forward(ids[b]) for b in range(2)]
logits = torch.stack([r[0] for r in res]).float()
io = {"input_ids": ids, "logits": logits}
for i in range(L):
    io[f"stream.{i}"] = torch.stack([r[1][i] for r in res]).float()
mdir = os.path.join(OUT, "tiny_k3")
os.makedirs(mdir, exist_ok=True)
save_file({k: v.float().contiguous() for k, v in W.items()}, os.path.join(mdir, "model.safetensors"),
          metadata={"format": "pt"})
with open(os.path.join(mdir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
save_file({k: v.contiguous() for k, v in io.items()}, os.path.join(OUT, "tiny_k3_io.safetensors"),
          metadata={"reference": "tools/reference/make_golden_k3.py, naive f64 from architecture.md §1-§5"})
print("wrote tiny_k3/ and tiny_k3_io.safetensors; logits std", float(logits.std()))

import hashlib  # noqa: E402
meta_path = os.path.join(OUT, "meta.json")
meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
meta["k3_generator"] = {"script": "tools/reference/make_golden_k3.py",
                        "sha256": hashlib.sha256(open(__file__, "rb").read()).hexdigest(),
                        "torch": torch.__version__, "precision": "float64 from the stored float32 weights"}
with open(meta_path, "w") as f:
    json.dump(meta, f, indent=2)
