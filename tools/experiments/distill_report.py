"""Summarise distillation runs as a markdown table (docs/experiments/distillation.md).

    python distill_report.py OUT BASELINE RUN...

For each run (a `k3mini train`/`distill` directory under OUT): the final held-out loss, held-out
KL to the teacher and top-1 agreement, training speed, and the tokens it needed to reach BASELINE's
final held-out loss (linear interpolation between evaluations), as a fraction of BASELINE's budget.
"""
import json
import sys
from pathlib import Path


def load(run):
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    val = [(l["tokens"], l["val_loss"]) for l in lines if "val_loss" in l]
    def last(k):
        return next((l[k] for l in reversed(lines) if l.get(k) is not None), float("nan"))

    # `k3mini eval --signals` on the final checkpoint, when the script ran it.
    final = run / "final-eval.json"
    if final.exists():
        t = json.loads(final.read_text()).get("teacher") or {}
        fixed = {"val_teacher_kl": t.get("kl"), "val_teacher_top1": t.get("top1")}
        inner = last
        last = lambda k: fixed[k] if fixed.get(k) is not None else inner(k)
    return lines, val, last


def tokens_to_reach(val, target):
    """First token count where the held-out loss reaches `target` (interpolated), or None."""
    for (t0, v0), (t1, v1) in zip(val, val[1:]):
        if v1 <= target:
            if v0 <= target:
                return t0
            return t0 + (t1 - t0) * (v0 - target) / (v0 - v1)
    return None


def main():
    out, base, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[2:]
    _, bval, _ = load(out / base)
    target, budget = bval[-1][1], bval[-1][0]
    print(f"Target: `{base}`'s final held-out loss {target:.4f} after {budget / 1e3:.0f}K tokens.\n")
    print("| run | held-out loss | KL to teacher (nats/token) | top-1 agreement | tokens to reach target | fraction of budget | train tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        lines, val, last = load(out / r)
        reach = tokens_to_reach(val, target)
        reach_s = f"{reach / 1e3:.0f}K" if reach is not None else "not reached"
        frac = f"{reach / budget:.2f}" if reach is not None else "-"
        print(
            f"| {r} | {val[-1][1]:.4f} | {last('val_teacher_kl'):.3f} | {last('val_teacher_top1'):.3f} | "
            f"{reach_s} | {frac} | {last('tok_per_s'):.0f} |"
        )


if __name__ == "__main__":
    main()
