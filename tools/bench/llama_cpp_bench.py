#!/usr/bin/env python3
"""llama.cpp's prefill and decode speed on a GGUF, through llama-cpp-python (built with AMX off by
scripts/setup-llama-cpp), as `k3mini bench infer`'s side-by-side anchor. One JSON object on stdout.

    llama_cpp_bench.py MODEL.gguf --threads 2 --ids IDS.txt --prefill 512,4096 --decode-ctx 0,4096 \
        --decode-tokens 32 --repeat 3

IDS.txt holds the comma-separated token ids both engines use (prompt tokens, then decode tokens).
Exit code 3 means llama_cpp is not importable.
"""
import argparse
import json
import resource
import statistics
import sys
import time

try:
    import llama_cpp
except Exception as e:  # noqa: BLE001
    print(f"llama_cpp not importable: {e}", file=sys.stderr)
    sys.exit(3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--prefill", default="512")
    ap.add_argument("--decode-ctx", default="0")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    ids = [int(x) for x in open(a.ids).read().split(",") if x.strip()]
    prefill = [int(x) for x in a.prefill.split(",") if x]
    ctxs = sorted({int(x) for x in a.decode_ctx.split(",") if x})
    walk = ctxs[-1] + len(ctxs) * a.repeat * a.decode_tokens if ctxs else 0
    n_ctx = max(prefill + [walk]) + 16
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                          n_batch=512, n_ubatch=512, logits_all=False, verbose=False)
    out = {"prefill": {}, "decode": {}}
    for n in prefill:
        times = []
        for _ in range(a.repeat):
            llm.reset()
            llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
            t0 = time.perf_counter()
            llm.eval(ids[:n])
            times.append(time.perf_counter() - t0)
        out["prefill"][str(n)] = n / statistics.median(times)
    # One sequence grows through the contexts in ascending order, as in `k3mini bench infer`: the
    # longest context is prefilled once, then `repeat` blocks of decode tokens are timed at each.
    llm.reset()
    pos = 0
    for c in ctxs:
        if c > pos:
            llm.eval(ids[pos:c])
            pos = c
        rates = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            for tok in ids[pos:pos + a.decode_tokens]:
                llm.eval([tok])
            rates.append(a.decode_tokens / (time.perf_counter() - t0))
            pos += a.decode_tokens
        out["decode"][str(c)] = statistics.median(rates)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["llama_cpp_python"] = llama_cpp.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
