"""Dequantize raw ggml blocks with gguf-py (the llama.cpp project's Python reader): the golden
reference for our K-quant (and other block) byte layouts.

    python kquant_dequant.py TYPE IN.bin OUT.f32      (TYPE: Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | Q5_0 | Q5_1 | IQ4_NL | IQ4_XS)
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

ty = GGMLQuantizationType[sys.argv[1]]
raw = np.fromfile(sys.argv[2], dtype=np.uint8)
if ty == GGMLQuantizationType.Q8_K:
    # gguf-py has no Q8_K reader: f32 d, 256 int8, 16 int16 sums per block.
    blocks = raw.reshape(-1, 292)
    d = blocks[:, :4].copy().view(np.float32)
    q = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
    out = (d * q).reshape(-1)
else:
    out = dequantize(raw, ty).reshape(-1)
out.astype(np.float32).tofile(sys.argv[3])
