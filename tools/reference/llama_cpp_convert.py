"""Run llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py from the llama-cpp-python
0.3.36 sdist, which scripts/setup-llama-cpp unpacks) on a checkpoint.

    python llama_cpp_convert.py CONVERTER_DIR MODEL_DIR OUT.gguf {f32|f16|q8_0}

Checkpoints without a tokenizer get llama.cpp's own `_set_vocab_none` (no vocabulary); every
tensor and hyper-parameter is written by the converter's code, unmodified.
"""
import os
import sys

conv_dir, model, out, outtype = sys.argv[1:5]
sys.path.insert(0, os.path.join(conv_dir, "gguf-py"))
sys.path.insert(0, conv_dir)
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None
os.environ["HF_HUB_OFFLINE"] = "1"

import conversion.kimi_k3 as k3  # noqa: E402
import conversion.kimi_linear as kl  # noqa: E402

if not os.path.exists(os.path.join(model, "tokenizer.json")):
    kl.KimiLinearModel.set_vocab = lambda self: self._set_vocab_none()
    k3.KimiK3Model.set_vocab = lambda self: self._set_vocab_none()

import convert_hf_to_gguf  # noqa: E402

sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
convert_hf_to_gguf.main()
