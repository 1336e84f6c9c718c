#!/usr/bin/env python3
"""llama.cpp's side of `k3mini bench infer`, through llama-cpp-python (built with AMX off by
scripts/setup-llama-cpp): it loads the GGUF once and then times what the benchmark asks, one
command per line on stdin, so that the benchmark can alternate the two engines measurement by
measurement (each ratio pairs runs from the same moment of a shared, noisy machine).

    llama_cpp_bench.py MODEL.gguf --threads 2 --ids IDS.txt --n-ctx 4200

IDS.txt holds the comma-separated token ids both engines use. Commands, each answered by one JSON
line on stdout:
    prefill N    a fresh sequence, ids[0:N] as one batch (ubatch 512); {"seconds": s}
    feed LO HI   ids[LO:HI] appended to the sequence (a fresh one if LO is 0), untimed; {"ok": true}
    decode LO HI ids[LO:HI] appended one token at a time; {"seconds": s}
    batch_start B CTX TOTAL
                 B fresh sequences (room for TOTAL positions each), each fed its first CTX
                 tokens, untimed; sequence b's token at position p is ids[(p*B + b) % len(ids)];
                 {"ok": true}
    batch B LO N the B sequences decoded together for N steps at positions LO.., one token each
                 a step (one llama_decode of B tokens, seq_id b, logits for all); {"seconds": s}
    quit         {"peak_rss_mib": m, "start_rss_mib": s}, then exit (s: the resident set before
                 the model was loaded, with Python and llama_cpp imported)
The first line out, once the model is loaded, is {"ready": true, "llama_cpp_python": version}.
Exit code 3 means llama_cpp is not importable.

    llama_cpp_bench.py MODEL.gguf --threads 2 --time-loads N

instead loads the model N times (`Llama(...)` with a context of 512, each freed before the next),
timing each, and prints {"load_seconds": [s, ...]}: the load line of `k3mini bench infer`, in a
process of its own so that the loads leave the benchmark's llama.cpp process (and its peak RSS)
as it was.

    llama_cpp_bench.py MODEL.gguf --threads 2 --logits WINDOWS.txt OUT_DIR

instead writes the logits of every window (one comma-separated line of ids each, evaluated as a
fresh sequence) as raw little-endian f32 [T, V] to OUT_DIR/window-I.f32 and prints {"windows": n}:
the quality step of `k3mini bench infer --reference`.
"""
import argparse
import json
import resource
import sys
import time

try:
    import llama_cpp
except Exception as e:  # noqa: BLE001
    print(f"llama_cpp not importable: {e}", file=sys.stderr)
    sys.exit(3)


def say(obj):
    print(json.dumps(obj), flush=True)


def fresh(llm):
    llm.reset()
    if hasattr(llm._ctx, "kv_cache_clear"):
        llm._ctx.kv_cache_clear()


def rss_mib(field="VmHWM"):
    """This process's peak resident set since it started (VmHWM, MiB), or its current one
    (VmRSS). Not ru_maxrss: Linux carries that across execve, so a child forked from the
    benchmark would report the benchmark's own peak whenever its real one is lower."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if field == "VmHWM" else float("nan")


class Batched:
    """Batched decoding in a second context of the same loaded model, with room for B sequences
    (the high-level Llama holds one): its parameters are the Llama's but for n_seq_max, n_ctx and
    a batch of at least B, and it is made again when B or the length grows. Sequence i's token
    at position p is ids[(p*B + i) % len(ids)], as in `k3mini bench infer`."""

    def __init__(self, llm, ids):
        self.llm, self.ids, self.ctx, self.shape = llm, ids, None, None

    def tok(self, b, p, i):
        return self.ids[(p * b + i) % len(self.ids)]

    def decode(self, batch, what):
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} on {what}")

    def start(self, b, ctx, total):
        """B fresh sequences with room for `total` positions each, each fed its first `ctx`
        tokens (in passes of n_batch, one sequence at a time)."""
        per_seq = (total + 256) // 256 * 256
        if self.shape is None or self.shape[0] != b or self.shape[1] < per_seq:
            if self.ctx is not None:
                llama_cpp.llama_free(self.ctx)
            params = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
            params.n_seq_max = b
            params.n_ctx = b * per_seq
            params.n_batch = max(params.n_batch, b)
            params.n_ubatch = max(params.n_ubatch, b)
            self.ctx = llama_cpp.llama_init_from_model(self.llm._model.model, params)
            if not self.ctx:
                raise RuntimeError(f"llama_init_from_model failed for {b} sequences of {per_seq}")
            self.shape = (b, per_seq, params.n_batch)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        nb = self.shape[2]
        batch = llama_cpp.llama_batch_init(nb, 0, 1)
        try:
            for i in range(b):
                for p0 in range(0, ctx, nb):
                    n = min(nb, ctx - p0)
                    batch.n_tokens = n
                    for k in range(n):
                        batch.token[k] = self.tok(b, p0 + k, i)
                        batch.pos[k] = p0 + k
                        batch.n_seq_id[k] = 1
                        batch.seq_id[k][0] = i
                        batch.logits[k] = 1 if p0 + k == ctx - 1 else 0
                    self.decode(batch, f"the prompt of sequence {i} of {b}")
        finally:
            llama_cpp.llama_batch_free(batch)

    def steps(self, b, lo, n):
        """Seconds for n batched steps, one token of each sequence a step, at positions lo.."""
        batch = llama_cpp.llama_batch_init(b, 0, 1)
        try:
            t0 = time.perf_counter()
            for s in range(lo, lo + n):
                batch.n_tokens = b
                for i in range(b):
                    batch.token[i] = self.tok(b, s, i)
                    batch.pos[i] = s
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = i
                    batch.logits[i] = 1
                self.decode(batch, f"step {s} of a batch of {b}")
            return time.perf_counter() - t0
        finally:
            llama_cpp.llama_batch_free(batch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ids")
    ap.add_argument("--n-ctx", type=int)
    ap.add_argument("--logits", nargs=2, metavar=("WINDOWS", "OUT_DIR"))
    ap.add_argument("--time-loads", type=int)
    a = ap.parse_args()
    if a.logits:
        return logits(a)
    if a.time_loads is not None:
        return time_loads(a)
    if a.ids is None or a.n_ctx is None:
        ap.error("--ids and --n-ctx are required (or --logits WINDOWS OUT_DIR)")
    ids = [int(x) for x in open(a.ids).read().split(",") if x.strip()]
    start = rss_mib("VmRSS")
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                          n_batch=512, n_ubatch=512, logits_all=False, verbose=False)
    say({"ready": True, "llama_cpp_python": llama_cpp.__version__})
    batched = Batched(llm, ids)
    for line in sys.stdin:
        cmd, *args = line.split()
        nums = [int(x) for x in args]
        if cmd == "prefill":
            fresh(llm)
            t0 = time.perf_counter()
            llm.eval(ids[:nums[0]])
            say({"seconds": time.perf_counter() - t0})
        elif cmd == "feed":
            lo, hi = nums
            if lo == 0:
                fresh(llm)
            if hi > lo:
                llm.eval(ids[lo:hi])
            say({"ok": True})
        elif cmd == "decode":
            lo, hi = nums
            t0 = time.perf_counter()
            for tok in ids[lo:hi]:
                llm.eval([tok])
            say({"seconds": time.perf_counter() - t0})
        elif cmd == "batch_start":
            batched.start(*nums)
            say({"ok": True})
        elif cmd == "batch":
            say({"seconds": batched.steps(*nums)})
        elif cmd == "quit":
            say({"peak_rss_mib": rss_mib(), "start_rss_mib": start})
            return
        else:
            print(f"unknown command: {line.strip()}", file=sys.stderr)
            sys.exit(2)


def time_loads(a):
    loads = []
    for _ in range(a.time_loads):
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(model_path=a.model, n_ctx=512, n_threads=a.threads, n_threads_batch=a.threads,
                              verbose=False)
        loads.append(time.perf_counter() - t0)
        llm.close()
        del llm
    say({"load_seconds": loads})


def logits(a):
    import os

    import numpy as np

    windows = [[int(x) for x in line.split(",") if x.strip()] for line in open(a.logits[0]) if line.strip()]
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=max(len(w) for w in windows) + 16, n_threads=a.threads,
                          n_threads_batch=a.threads, n_batch=512, n_ubatch=512, logits_all=True, verbose=False)
    for i, w in enumerate(windows):
        fresh(llm)
        llm.eval(w)
        out = os.path.join(a.logits[1], f"window-{i}.f32")
        np.ascontiguousarray(np.array(llm.scores[: len(w)], dtype="<f4")).tofile(out)
    say({"windows": len(windows)})


if __name__ == "__main__":
    main()
