"""Summarise the architecture comparison as a markdown table (docs/experiments/arch-comparison.md).

    python arch_report.py OUT RUN...

For each RUN under OUT: the final validation loss and perplexity at the training context, the
loss at 4x the training context (`eval.json` from `k3mini eval --context 256,1024`), the loss by
quarter of the long windows, and the median training tokens/s over the run's logged steps (the
machine is shared: compare the side-by-side `k3mini bench train` figures for speed).
"""
import json
import math
import statistics
import sys
from pathlib import Path


def main():
    out = Path(sys.argv[1])
    print("| model | params | val loss @256 | ppl @256 | val loss @1024 (4x) | ppl @1024 | @1024 by quarter | median tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sys.argv[2:]:
        d = out / r
        ev = {e["context"]: e for e in json.loads((d / "eval.json").read_text())}
        lines = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()]
        tps = statistics.median(l["tok_per_s"] for l in lines if "tok_per_s" in l)
        params = ""
        info = d / "params.txt"
        if info.exists():
            params = info.read_text().strip()
        s, l4 = ev[256], ev[1024]
        q = " / ".join(f"{x:.3f}" for x in l4["by_quarter"])
        print(f"| {r} | {params} | {s['loss']:.4f} | {math.exp(s['loss']):.2f} | {l4['loss']:.4f} | "
              f"{math.exp(l4['loss']):.2f} | {q} | {tps:.0f} |")


if __name__ == "__main__":
    main()
