"""Make a random tiny kimi_linear checkpoint with transformers 5.24 and record its logits.

    python random_kimi.py OUTDIR SEED {dense|moe} [--llama-cpp] [--scale S] [--head-scale H] [--bf16]

Dimensions, layer pattern, MoE routing (including group-limited routing), q LoRA and attention
biases are drawn from SEED, so each seed is a model the Rust side has never seen. Writes
OUTDIR/model (config.json + model.safetensors, saved by save_pretrained) and OUTDIR/io.safetensors
(`input_ids` [T], `logits` [T, vocab]).

--llama-cpp draws only what llama.cpp's kimi-linear can load (KDA heads = MLA heads, no attention
biases, dense layers as a prefix, one expert group, head dims multiple of 32); --scale multiplies
the random weights (1.0 = O(1) activations, which amplify every rounding difference); --head-scale
multiplies lm_head, giving the peaked next-token distributions of a trained model instead of the
near-ties of a random one; --bf16 saves the weights in bfloat16 (the logits are those of the
bf16-rounded weights, computed in fp32).
"""
import math
import os
import random
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

out, seed, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llama_cpp = "--llama-cpp" in sys.argv
scale = float(sys.argv[sys.argv.index("--scale") + 1]) if "--scale" in sys.argv else 1.0
head_scale = float(sys.argv[sys.argv.index("--head-scale") + 1]) if "--head-scale" in sys.argv else 1.0
rng = random.Random(seed)
heads = rng.choice([2, 3, 4])
n_layers = rng.randint(2, 6)
layer_types = [rng.choice(["linear_attention", "full_attention"]) for _ in range(n_layers)]
layer_types[rng.randrange(n_layers)] = "linear_attention"
kw = dict(vocab_size=rng.randint(100, 400), hidden_size=rng.choice([32, 48, 64, 96]),
          intermediate_size=rng.choice([64, 96, 160]), num_hidden_layers=n_layers, num_attention_heads=heads,
          num_key_value_heads=heads, kv_lora_rank=rng.choice([16, 24, 32]), qk_nope_head_dim=rng.choice([8, 16]),
          qk_rope_head_dim=rng.choice([4, 8]), v_head_dim=rng.choice([8, 16, 24]),
          q_lora_rank=rng.choice([None, 16, 20]), attention_bias=rng.random() < 0.5,
          linear_head_dim=rng.choice([8, 16, 32]), linear_num_heads=rng.choice([1, 2, 3]), linear_conv_kernel_dim=4,
          layer_types=layer_types, rms_norm_eps=rng.choice([1e-5, 1e-6]), pad_token_id=0, bos_token_id=1,
          eos_token_id=2, tie_word_embeddings=False)
if llama_cpp:
    # llama.cpp aborts on a kimi-linear without any KDA or without any MLA layer (empty cache buffer)
    layer_types[0], layer_types[-1] = "linear_attention", "full_attention"
    kw.update(linear_num_heads=heads, attention_bias=False, linear_head_dim=32, qk_nope_head_dim=32,
              v_head_dim=32, kv_lora_rank=32, hidden_size=rng.choice([64, 96, 128]),
              intermediate_size=rng.choice([64, 128]), q_lora_rank=None)
if kind == "moe":
    groups = rng.choice([1, 2, 4])
    experts = groups * rng.choice([2, 3, 4])
    topk_group = rng.randint(1, groups)
    kw.update(mlp_layer_types=[rng.choice(["dense", "sparse"]) for _ in range(n_layers)],
              num_local_experts=experts, n_group=groups, topk_group=topk_group,
              num_experts_per_tok=rng.randint(1, min(experts, topk_group * (experts // groups))),
              num_shared_experts=rng.choice([0, 1, 2]), moe_intermediate_size=rng.choice([16, 32]),
              routed_scaling_factor=rng.choice([1.0, 2.446]), norm_topk_prob=rng.random() < 0.7)
    kw["mlp_layer_types"][-1] = "sparse"
    if llama_cpp:
        k = rng.randint(0, n_layers - 1)
        kw.update(mlp_layer_types=["dense"] * k + ["sparse"] * (n_layers - k), n_group=1, topk_group=1, norm_topk_prob=True, num_shared_experts=rng.choice([1, 2]),
                  num_experts_per_tok=rng.randint(1, min(3, experts)), moe_intermediate_size=32)
else:
    kw.update(mlp_layer_types=["dense"] * n_layers)
cfg = KimiLinearConfig(**kw)
torch.manual_seed(seed)
model = KimiLinearForCausalLM(cfg).eval()
gen = torch.Generator().manual_seed(seed)
with torch.no_grad():  # O(1) weights so that any mistake shows in the logits
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif "norm" in name and p.dim() == 1:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() >= 2:
            p.copy_(scale * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.lm_head.weight.mul_(head_scale)
    for name, b in model.named_buffers():
        if "e_score_correction_bias" in name:
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
if "--bf16" in sys.argv:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.to(torch.bfloat16).save_pretrained(os.path.join(out, "model"))
    model.float()
else:
    model.save_pretrained(os.path.join(out, "model"))
ids = torch.randint(3, cfg.vocab_size, (1, rng.randint(20, 140)), generator=gen)
with torch.no_grad():
    logits = model(ids, use_cache=False).logits[0]
save_file({"input_ids": ids[0].contiguous(), "logits": logits.contiguous()}, os.path.join(out, "io.safetensors"))
print(f"seed {seed} {kind}: {n_layers} layers {layer_types}, hidden {cfg.hidden_size}, T {ids.shape[1]}")
