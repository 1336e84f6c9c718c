"""Summarise the on-policy experiment as a markdown table (docs/experiments/on-policy.md).

    python onpolicy_report.py OUT RUN...

For each RUN directory under OUT: `eval.json` (held-out code loss, KL and top-1 agreement with the
teacher on held-out windows), `score-code.json` and `score-humaneval.json` (`k3mini score`: the
teacher's log-probability per token of the run's greedy continuations, its top-1 agreement with
them, and the run's NLL of the reference bodies).
"""
import json
import sys
from pathlib import Path


def main():
    out = Path(sys.argv[1])
    rows = []
    for r in sys.argv[2:]:
        d = out / r
        ev = json.loads((d / "eval.json").read_text())
        ctx = ev["contexts"][0]
        t = ev["teacher"]
        sc = json.loads((d / "score-code.json").read_text())
        he = json.loads((d / "score-humaneval.json").read_text())
        rows.append((r, ctx["loss"], t["kl"], t["top1"], sc["teacher_logprob_per_token"], sc["teacher_top1_agreement"],
                     sc["reference_nll_per_token"], he["teacher_logprob_per_token"], he["reference_nll_per_token"]))
    print("| run | held-out code loss | KL to teacher | top-1 agreement | code prompts: teacher log-p/token of greedy "
          "continuation | teacher top-1 on it | reference-body NLL | HumanEval: teacher log-p/token | HumanEval reference NLL |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join([r[0]] + [f"{x:.3f}" if isinstance(x, float) else str(x) for x in r[1:]]) + " |")


if __name__ == "__main__":
    main()
