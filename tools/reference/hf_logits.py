"""Load a kimi_linear (or llama) checkpoint with transformers 5.24 and write its logits.

    python hf_logits.py CKPT_DIR 1,2,3 OUT.safetensors [--resave DIR]

Writes `logits` [T, vocab] (fp32). With --resave, also round-trips the model through
transformers' save_pretrained into DIR (what a user who loads and re-saves would get).
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
for name in list(sys.modules):
    if name == "fla" or name.startswith("fla."):
        del sys.modules[name]
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

ckpt, ids, out = sys.argv[1], sys.argv[2], sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
x = torch.tensor([[int(i) for i in ids.split(",")]])
with torch.no_grad():
    logits = model(x, use_cache=False).logits[0].float()
save_file({"logits": logits.contiguous()}, out)
if "--resave" in sys.argv:
    model.save_pretrained(sys.argv[sys.argv.index("--resave") + 1])
print(f"transformers {type(model).__name__}: logits {tuple(logits.shape)}")
