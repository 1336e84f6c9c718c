"""Generate the golden fixtures in tests/golden/ from the pinned PyTorch references (CPU only).

    scripts/golden            # runs this inside the project venv (torch 2.13.0, transformers 5.24.0, fla 0.6.0)

References (all pure PyTorch on CPU, no network: HF_HUB_OFFLINE=1):
  * transformers 5.24.0 `kimi_linear`: chunk/recurrent KDA fallbacks, KimiLinearDeltaAttention,
    KimiLinearAttention (MLA, NoPE), KimiLinearForCausalLM, KimiLinearConfig.
  * flash-linear-attention 0.6.0 naive ops, a second oracle: naive_recurrent_kda, naive_chunk_kda,
    naive_kda_gate, naive_kda_lowerbound_gate.
transformers binds fla's Triton kernels when `fla` is importable, so fla's naive functions are
imported first and the package is then hidden from transformers.

Outputs (all fp32; ids int64; KDA state layout [B,H,K,V]; g is a log-space decay <= 0):
  kda_core.safetensors           B=2,T=128,H=2,K=16,V=32, non-zero initial state: recurrent, chunk-64, fla naive
  kda_core_l2norm_T50.safetensors  T=50 (not a multiple of 64), in-kernel q/k L2 norm
  kda_core_strong_decay.safetensors  lower-bound gate -5 (cumulative log-decay to -320 in a chunk), fla naive in f64
  kda_gate.safetensors           softplus gate (fla naive_kda_gate) and lower-bound gate (naive_kda_lowerbound_gate)
  layer_kda_io / layer_mla_io    one layer's x -> y with its weights (Moonshot names)
  tiny_kimi_linear_{dense,moe,moe_grouped}/ + *_io.safetensors
                                 whole models saved by transformers' save_pretrained; logits, per-layer hidden
                                 states, and logits of a 48-token prefill + 32 single-token decode steps
  config_cases.json              what KimiLinearConfig makes of each config form (or the error it raises)
  meta.json                      generator, its sha256, git commit, package versions, agreement report
"""
import hashlib
import json
import math
import os
import subprocess
import sys

import torch
from safetensors.torch import save_file

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "tests", "golden")
OUT = os.path.abspath(OUT)
os.makedirs(OUT, exist_ok=True)
torch.set_default_dtype(torch.float32)

from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate  # noqa: E402
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda  # noqa: E402

for name in list(sys.modules):
    if name == "fla" or name.startswith("fla."):
        del sys.modules[name]
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None

import transformers  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as mk  # noqa: E402

report = {}


def save(name, tensors, meta=None):
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, os.path.join(OUT, name), metadata={k: str(v) for k, v in (meta or {}).items()})
    print(f"wrote {name}: {len(tensors)} tensors")


def maxdiff(a, b):
    return float((a - b).abs().max())


# ============================================================================================
# 1. KDA core op
# ============================================================================================
g0 = torch.Generator().manual_seed(1234)
B, T, H, K, V = 2, 128, 2, 16, 32
q = torch.randn(B, T, H, K, generator=g0)
k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g0), dim=-1)
v = torch.randn(B, T, H, V, generator=g0)
g = -torch.rand(B, T, H, K, generator=g0) * 0.3
beta = torch.rand(B, T, H, generator=g0)
h0 = torch.randn(B, H, K, V, generator=g0) * 0.1
o_rec, S_rec = mk.recurrent_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=h0.clone(), output_final_state=True)
o_chk, S_chk = mk.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=h0.clone(), output_final_state=True)
o_fr, S_fr = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True)
o_fc, _ = naive_chunk_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True, chunk_size=64)
report["kda_core"] = {"hf_rec_vs_hf_chunk_o": maxdiff(o_rec, o_chk), "fla_rec_vs_hf_rec_o": maxdiff(o_fr, o_rec),
                      "fla_rec_vs_hf_rec_S": maxdiff(S_fr, S_rec), "fla_chunk_vs_fla_rec_o": maxdiff(o_fc, o_fr)}
save("kda_core.safetensors", dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, o_recurrent=o_rec,
                                  final_state_recurrent=S_rec, o_chunk64=o_chk, final_state_chunk64=S_chk,
                                  o_fla_naive_recurrent=o_fr, final_state_fla_naive_recurrent=S_fr),
     {"scale": K ** -0.5, "state_layout": "[B,H,K,V]", "l2norm_qk": False})

T2 = 50
q2 = torch.randn(1, T2, H, K, generator=g0) * 2
k2 = torch.randn(1, T2, H, K, generator=g0) * 2
v2 = torch.randn(1, T2, H, V, generator=g0)
g2 = -torch.rand(1, T2, H, K, generator=g0)
b2 = torch.rand(1, T2, H, generator=g0)
o_r2, S_r2 = mk.recurrent_kimi_delta_attention(q2, k2, v2, g=g2, beta=b2, initial_state=None, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
o_c2, S_c2 = mk.chunk_kimi_delta_attention(q2, k2, v2, g=g2, beta=b2, initial_state=None, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)
report["kda_core_l2norm_T50"] = {"rec_vs_chunk_o": maxdiff(o_r2, o_c2), "rec_vs_chunk_S": maxdiff(S_r2, S_c2)}
save("kda_core_l2norm_T50.safetensors", dict(q=q2, k=k2, v=v2, g=g2, beta=b2, o=o_r2, final_state=S_r2),
     {"l2norm_qk": "x / sqrt(sum(x^2) + 1e-6) over K, before the scale"})

# Strong decay: the K3 lower-bound gate at its floor drives the cumulative log-gate of one 64-chunk
# to about -320, far below exp's f32 range; a correct chunked form must still match the recurrence.
T3 = 130
q3 = torch.nn.functional.normalize(torch.randn(1, T3, H, K, generator=g0), dim=-1)
k3 = torch.nn.functional.normalize(torch.randn(1, T3, H, K, generator=g0), dim=-1)
v3 = torch.randn(1, T3, H, V, generator=g0)
f3 = torch.randn(1, T3, H, K, generator=g0) * 4
g3 = naive_kda_lowerbound_gate(f3, torch.zeros(H), torch.zeros(H * K), lower_bound=-5.0)
b3 = torch.rand(1, T3, H, generator=g0)
h3 = torch.randn(1, H, K, V, generator=g0)
o_r3, S_r3 = naive_recurrent_kda(q3.double(), k3.double(), v3.double(), g3.double(), b3.double(),
                                 initial_state=h3.double(), output_final_state=True)
report["kda_core_strong_decay"] = {"min_cum_g_per_chunk": float(g3[:, :64].sum(1).min())}
save("kda_core_strong_decay.safetensors", dict(q=q3, k=k3, v=v3, g=g3, beta=b3, initial_state=h3,
                                               o=o_r3.float(), final_state=S_r3.float()),
     {"reference": "fla naive_recurrent_kda in float64", "gate": "lower bound -5, A_log 0, dt_bias 0"})

f_raw = torch.randn(1, 7, H, K, generator=g0) * 3
A_log = torch.log(torch.rand(H, generator=g0) * 15 + 1)
dt_bias = torch.randn(H * K, generator=g0)
save("kda_gate.safetensors", dict(f=f_raw, A_log=A_log, dt_bias=dt_bias, g=naive_kda_gate(f_raw, A_log, dt_bias),
                                  g_lower_bound=naive_kda_lowerbound_gate(f_raw, A_log, dt_bias, lower_bound=-5.0)),
     {"g": "-exp(A_log)*softplus(f+dt_bias)", "g_lower_bound": "-5*sigmoid(exp(A_log)*(f+dt_bias))"})


# ============================================================================================
# 2. Tiny Kimi-Linear models (3 KDA : 1 MLA) saved by transformers itself
# ============================================================================================
def tiny_config(variant):
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
              linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"],
              mlp_layer_types=["dense"] * 4, num_local_experts=4, num_experts_per_tok=2, num_shared_experts=1,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rms_norm_eps=1e-5)
    if variant == "moe":
        kw["mlp_layer_types"] = ["dense", "sparse", "sparse", "sparse"]
    if variant == "moe_grouped":
        # Beyond the tiny cases: group-limited routing, q LoRA, attention biases, a non-prefix dense layer.
        kw.update(mlp_layer_types=["dense", "sparse", "dense", "sparse"], num_local_experts=8, num_experts_per_tok=3,
                  n_group=4, topk_group=2, q_lora_rank=24, attention_bias=True, num_shared_experts=2,
                  routed_scaling_factor=1.7, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                          "full_attention"])
    return KimiLinearConfig(**kw)


def reinit(model, seed):
    """O(1)-scale random weights so that errors show (the default init makes outputs tiny)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def run_model(model, ids, prefill=48):
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        o1 = model(ids[:, :prefill], use_cache=True)
        cache, steps = o1.past_key_values, [o1.logits]
        for i in range(prefill, ids.shape[1]):
            o = model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            steps.append(o.logits)
    return out, torch.cat(steps, 1)


for tag in ("dense", "moe", "moe_grouped"):
    cfg = tiny_config(tag)
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(cfg).eval()
    reinit(model, 42)
    mdir = os.path.join(OUT, f"tiny_kimi_linear_{tag}")
    model.save_pretrained(mdir)
    ids = torch.randint(3, 256, (2, 80), generator=torch.Generator().manual_seed(7))
    out, inc = run_model(model, ids)
    io = {"input_ids": ids.to(torch.int64), "logits": out.logits, "logits_incremental": inc}
    for li, hs in enumerate(out.hidden_states):
        io[f"hidden_states.{li}"] = hs
    report[f"model_{tag}"] = {"full_vs_incremental_logits": maxdiff(out.logits, inc),
                              "params": sum(p.numel() for p in model.parameters())}
    save(f"tiny_kimi_linear_{tag}_io.safetensors", io,
         {"note": "hidden_states.0 = embeddings; hidden_states.i (1 <= i < L) = output of layer i-1; "
                  "hidden_states.L = final-norm output (logits = hidden_states.L @ lm_head.T)",
          "incremental": "48-token prefill, then 32 single-token decode steps"})
    if tag == "dense":
        x = torch.randn(2, 80, 64, generator=torch.Generator().manual_seed(11))
        with torch.no_grad():
            kda = model.model.layers[0].self_attn
            y_kda = kda(x)
            mla = model.model.layers[3].self_attn
            causal = torch.full((80, 80), float("-inf")).triu(1)[None, None].expand(2, 1, 80, 80)
            y_mla, _ = mla(x, attention_mask=causal)
        save("layer_kda_io.safetensors", {"x": x, "y": y_kda}, {"layer": "model.layers.0 of tiny_kimi_linear_dense"})
        save("layer_mla_io.safetensors", {"x": x, "y": y_mla}, {"layer": "model.layers.3 of tiny_kimi_linear_dense"})


# ============================================================================================
# 3. Config forms: what transformers makes of each
# ============================================================================================
KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "layer_types", "mlp_layer_types",
        "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "num_local_experts", "num_experts_per_tok",
        "n_shared_experts", "norm_topk_prob", "n_group", "topk_group", "max_position_embeddings",
        "moe_intermediate_size", "intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "routed_scaling_factor", "rms_norm_eps", "attention_bias"]
base = {"model_type": "kimi_linear", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
moonshot = {"linear_attn_config": {"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4,
                                   "full_attn_layers": [4, 6], "kda_layers": [1, 2, 3, 5]},
            "first_k_dense_replace": 2, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
            "moe_renormalize": True, "num_expert_group": 1, "model_max_length": 4096,
            "transformers_version": "4.57.1", "torch_dtype": "bfloat16", "head_dim": 72,
            "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig"}, "use_cache": True}
hf_form = {"layer_types": ["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 2 + ["full_attention"],
           "mlp_layer_types": ["dense", "sparse", "sparse", "dense", "sparse", "sparse"],
           "linear_head_dim": 16, "linear_num_heads": 2, "linear_conv_kernel_dim": 3,
           "num_local_experts": 4, "num_experts_per_tok": 3, "n_shared_experts": 2, "norm_topk_prob": False,
           "n_group": 2, "topk_group": 2, "max_position_embeddings": 2048, "qk_head_dim": 24, "initializer_range": 0.02}
cases = {
    "moonshot": {**base, **moonshot},
    "transformers": {**base, **hf_form},
    "both": {**base, **moonshot, **hf_form},
    "both_lac_dims_win": {**base, **hf_form, "linear_attn_config": moonshot["linear_attn_config"]},
    "only_full_attn_layers": {**base, "linear_attn_config": {"full_attn_layers": [2, 4, 6]}},
    "no_layer_lists": {**base},
    "first_k_dense_0": {**base, **moonshot, "first_k_dense_replace": 0},
    "k3_fields": {**base, **moonshot, "hidden_act": "situ", "activation_situ_beta": 4.0,
                  "activation_situ_linear_beta": 25.0, "attn_res_block_size": 2, "mla_use_output_gate": True,
                  "routed_expert_hidden_size": 48, "latent_moe_use_norm": True,
                  "linear_attn_config": {**moonshot["linear_attn_config"], "gate_lower_bound": -5.0,
                                         "use_full_rank_gate": True}},
    "err_layer_types_len": {**base, "layer_types": ["linear_attention"] * 5},
    "err_bad_mlp_type": {**base, "mlp_layer_types": ["dense", "moe", "dense", "dense", "dense", "dense"]},
    "err_uncovered_layer": {**base, "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3, 5]}},
    "err_layer_out_of_range": {**base, "linear_attn_config": {"full_attn_layers": [4, 7], "kda_layers": [1, 2, 3, 5, 6]}},
    "unknown_field": {**base, **moonshot, "my_custom_field": 3},
}
results = {}
for name, d in cases.items():
    try:
        c = KimiLinearConfig(**{k: v for k, v in d.items() if k != "model_type"})
        results[name] = {"input": d, "resolved": {k: getattr(c, k) for k in KEYS}}
    except Exception as e:  # record what transformers refuses
        results[name] = {"input": d, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
with open(os.path.join(OUT, "config_cases.json"), "w") as f:
    json.dump(results, f, indent=1)
print("wrote config_cases.json:", len(results), "cases")

# ============================================================================================
# meta.json
# ============================================================================================
src = open(__file__, "rb").read()
try:
    commit = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                     text=True).strip()
except Exception:
    commit = "unknown"
from importlib.metadata import version  # noqa: E402
meta = {"generator": "tools/reference/make_golden.py", "sha256": hashlib.sha256(src).hexdigest(),
        "git_commit": commit, "torch": torch.__version__, "transformers": transformers.__version__,
        "fla": version("flash-linear-attention"), "report": report}
with open(os.path.join(OUT, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2)
print(json.dumps(report, indent=2))
