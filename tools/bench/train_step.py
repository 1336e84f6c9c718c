#!/usr/bin/env python3
"""Time training steps (forward + backward + AdamW) of transformers models on CPU.

Used by `k3mini bench train` as the side-by-side anchor: transformers' KimiLinearForCausalLM on
the same config.json as ours, through its pure-PyTorch path (fla's Triton kernels are blocked,
as on any CPU), and a same-size LlamaForCausalLM. Prints one JSON object per model to stdout.

    train_step.py --config DIR/config.json --batch 8 --seq 256 --threads 2 --steps 5
"""
import argparse
import json
import statistics
import sys
import time

# transformers prefers fla's (GPU) kernels when fla imports; make it take the PyTorch path.
for name in list(sys.modules):
    if name == "fla" or name.startswith("fla."):
        del sys.modules[name]
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None

import torch  # noqa: E402
import transformers  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", action="append", required=True, help="a config.json (repeatable)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    for path in a.config:
        cfg = transformers.AutoConfig.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1))
        times = []
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            out = model(input_ids=ids[:, :-1], labels=None)
            loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            if i >= a.warmup:
                times.append(dt)
        print(
            json.dumps(
                {
                    "config": path,
                    "model_type": cfg.model_type,
                    "params": sum(p.numel() for p in model.parameters()),
                    "step_seconds": times,
                    "median_s": statistics.median(times),
                    "tokens_per_s": a.batch * a.seq / statistics.median(times),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
