#!/usr/bin/env python3
"""KL divergence and top-1 agreement between logits files (`k3mini logits --out`, or
tools/bench/llama_cpp_run.py's `logits`), per position against a reference:

    logits_kl.py REF.safetensors A.safetensors [B.safetensors ...]

prints, for each file, the median and mean over positions of KL(softmax(ref) || softmax(file))
in nats and the share of positions whose argmax agrees with the reference's.
"""
import sys

import numpy as np
from safetensors.numpy import load_file


def logp(path):
    x = load_file(path)["logits"].astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    ref = logp(sys.argv[1])
    for path in sys.argv[2:]:
        lp = logp(path)
        if lp.shape != ref.shape:
            print(f"{path}: shape {lp.shape} differs from the reference's {ref.shape}", file=sys.stderr)
            sys.exit(1)
        kl = (np.exp(ref) * (ref - lp)).sum(axis=-1)
        top1 = (ref.argmax(-1) == lp.argmax(-1)).mean()
        print(f"{path}: KL median {np.median(kl):.5f} mean {kl.mean():.5f} nats, top-1 agreement {top1:.3f}")


if __name__ == "__main__":
    main()
