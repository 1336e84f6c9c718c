"""The SmolLM2 teacher through transformers' GGUF loader (dequantized to fp32): logits for given ids
and token ids for given texts, for checking our GGUF loader, Q4_1/Q8_0 dequantization, Llama
forward and tokenizer.

    python smollm2_reference.py TEACHER.gguf IDS OUT.safetensors [TEXT ...]

Writes `logits` [T, V] for IDS (comma-separated) and, for each TEXT, `text.{i}` (its ids).
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

gguf, ids, out = sys.argv[1], sys.argv[2], sys.argv[3]
d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
x = torch.tensor([[int(i) for i in ids.split(",")]])
with torch.no_grad():
    logits = model(x).logits[0].float().contiguous()
tensors = {"logits": logits}
for i, text in enumerate(sys.argv[4:]):
    tensors[f"text.{i}"] = torch.tensor(tok(text, add_special_tokens=False).input_ids, dtype=torch.int64)
save_file(tensors, out)
print(f"transformers {type(model).__name__}: logits {tuple(logits.shape)}, {len(sys.argv) - 4} texts")
