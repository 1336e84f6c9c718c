"""llama.cpp (through llama-cpp-python 0.3.36, built with AMX off) as a reference.

    python llama_cpp_run.py logits  MODEL.gguf IDS OUT.safetensors   # `logits` [T, V] for IDS
    python llama_cpp_run.py greedy  MODEL.gguf IDS N OUT.json        # N greedy ids after IDS, with top-2 margins
    python llama_cpp_run.py quantize IN.gguf OUT.gguf TYPE           # llama.cpp's own quantizer (q8_0, q4_0, q4_1)

Exit code 3 means llama_cpp is not importable (callers skip).
"""
import json
import sys

try:
    import llama_cpp
except Exception as e:  # noqa: BLE001
    print(f"llama_cpp not importable: {e}")
    sys.exit(3)

mode = sys.argv[1]
if mode == "quantize":
    ftypes = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "f16": 1}
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[sys.argv[4]]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(sys.argv[2].encode(), sys.argv[3].encode(), params)
    sys.exit(0 if rc == 0 else 1)

import numpy as np  # noqa: E402

model, ids = sys.argv[2], [int(i) for i in sys.argv[3].split(",")]
llm = llama_cpp.Llama(model_path=model, n_ctx=max(512, len(ids) + 64), n_threads=2, n_batch=512,
                      logits_all=True, verbose=False)
if mode == "logits":
    from safetensors.numpy import save_file
    llm.eval(ids)
    save_file({"logits": np.ascontiguousarray(np.array(llm.scores[: len(ids)], dtype=np.float32))}, sys.argv[4])
elif mode == "greedy":
    n = int(sys.argv[4])
    llm.eval(ids)
    out, margins = [], []
    for _ in range(n):
        s = np.array(llm.scores[llm.n_tokens - 1])
        top = np.argsort(-s)[:2]
        out.append(int(top[0]))
        margins.append(float(s[top[0]] - s[top[1]]))
        llm.eval([int(top[0])])
    json.dump({"tokens": out, "margins": margins}, open(sys.argv[5], "w"))
print(f"llama.cpp {mode}: ok")
