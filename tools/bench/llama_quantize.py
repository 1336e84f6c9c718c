#!/usr/bin/env python3
"""Quantize a GGUF with llama.cpp's own quantizer (`llama_model_quantize`, what `llama-quantize`
runs), through llama-cpp-python as scripts/setup-llama-cpp installs it: the way to get the files
users actually download (Q4_K_M and friends) for a model only we can make, such as the random
370M bench model, so that both engines can be measured on them.

    llama_quantize.py IN.gguf OUT.gguf Q4_K_M [--threads N] [--allow-requantize]

IN should be F32 or F16; an already quantized IN needs --allow-requantize (quality suffers). TYPE is
the part of llama.cpp's `LLAMA_FTYPE_MOSTLY_*` name after `MOSTLY_` (Q4_K_M, Q4_K_S, Q6_K, Q8_0,
Q4_0, ...). Writes OUT through a temporary name, renamed once complete.
Exit codes: 2 bad arguments, 3 llama_cpp not importable, 4 the quantizer failed.
"""
import argparse
import ctypes
import os
import sys

try:
    import llama_cpp
except Exception as e:  # noqa: BLE001
    print(f"llama_cpp not importable: {e} (run scripts/setup-llama-cpp)", file=sys.stderr)
    sys.exit(3)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("type")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--allow-requantize", action="store_true")
    a = ap.parse_args()
    name = "LLAMA_FTYPE_MOSTLY_" + a.type.upper()
    ftype = getattr(llama_cpp, name, None)
    if ftype is None:
        known = sorted(n[len("LLAMA_FTYPE_MOSTLY_"):] for n in dir(llama_cpp) if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        print(f"llama_quantize: unknown type {a.type!r}; llama.cpp knows {', '.join(known)}", file=sys.stderr)
        sys.exit(2)
    if not os.path.isfile(a.src):
        print(f"llama_quantize: {a.src}: no such file", file=sys.stderr)
        sys.exit(2)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = a.threads
    params.allow_requantize = a.allow_requantize
    tmp = a.dst + ".partial"
    rc = llama_cpp.llama_model_quantize(a.src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        if os.path.exists(tmp):
            os.remove(tmp)
        print(f"llama_quantize: llama_model_quantize({a.src} -> {a.type}) returned {rc}", file=sys.stderr)
        sys.exit(4)
    os.replace(tmp, a.dst)
    print(f"wrote {a.dst} ({a.type}, {os.path.getsize(a.dst) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
