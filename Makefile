# `make test` and `make generate` set up .venv themselves (torch first, pinned: see requirements.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where `pdserve model prepare` puts the demo model: $PDSERVE_MODELS_DIR, else models/.
MODELS_DIR := $(or $(PDSERVE_MODELS_DIR),models)
MODEL := $(MODELS_DIR)/SmolLM2-135M-Instruct

# Python writes each module's bytecode (git-ignored __pycache__/), which an environment
# may forbid (PYTHONDONTWRITEBYTECODE=1): then every process of the suite, each pytest
# worker, worker process and benchmark run, compiles every module it imports again, and
# pytest rewrites every test module's asserts in each worker. An empty value is unset.
export PYTHONDONTWRITEBYTECODE :=

# torch is installed first, pinned, before anything can pull another build. PyPI's
# Linux torch is the CUDA build (several GB of CUDA libraries), so with no NVIDIA GPU
# here (no nvidia-smi, no /dev/nvidia0) pip is also given PyTorch's CPU wheel index,
# whose 2.13.0+cpu it prefers. TORCH_INDEX=<url> names another index (e.g. a CUDA
# one); TORCH_INDEX= (empty) leaves the choice to pip's own configuration.
NVIDIA_GPU ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || test -e /dev/nvidia0 && echo yes)
TORCH_INDEX ?= $(if $(NVIDIA_GPU),,https://download.pytorch.org/whl/cpu)
TORCH := torch==2.13.0$(if $(TORCH_INDEX), --extra-index-url $(TORCH_INDEX))

.PHONY: install model lint typecheck test test-fast test-multihost serve serve-moe serve-gemma generate bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(VENV)/bin/pdserve model prepare smollm2 --models-dir $(MODELS_DIR)

# Lint first: a lint or type error fails fast, before the suite's minutes. ruff, then
# mypy ([tool.mypy] in pyproject.toml: the production packages; about 30 s).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# An alias for lint, which now type-checks too.
typecheck: lint

# Most of the suite's time is spent waiting on worker processes, so tests run in
# parallel (pytest-xdist): each module is one unit of work, the longest sent first
# (tests/conftest.py). PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= 4
PYTEST_XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# These run after the rest, one at a time: Ray's own processes would crowd the 2 cores
# the others share, and the chaos and late-write tests time faults against their load.
SERIAL_TESTS := tests/ray tests/disagg/test_chaos.py tests/kv_transfer/test_late_writes.py
# Deployments across hosts (network namespaces; they skip without root), each a Ray
# cluster of its own: `make test-multihost`, which CI runs after `make test`.
MULTIHOST_TESTS := tests/multihost/test_ray_hosts.py tests/multihost/test_faults.py

# Lint and the model's build first, side by side: mypy from a clean clone takes about a
# minute and the build half of one, each on one core.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 lint model
	$(PY) -m pytest -q --durations=20 $(PYTEST_XDIST) tests $(addprefix --ignore=,$(SERIAL_TESTS) $(MULTIHOST_TESTS))
	$(PY) -m pytest -q --durations=10 $(SERIAL_TESTS)

test-multihost: model
	$(PY) -m pytest -q --durations=10 $(MULTIHOST_TESTS)

# The inner loop: the unit tests alone.
test-fast: lint model
	$(PY) -m pytest -q $(PYTEST_XDIST) tests/unit

serve: model
	$(VENV)/bin/pdserve serve configs/local.yaml --model $(MODEL)

# The MoE + MLA demo (generated weights): 1 prefill, 1 decode at TP 2 with expert parallelism.
serve-moe: model
	$(VENV)/bin/pdserve model prepare deepseek-mini --models-dir $(MODELS_DIR)
	$(VENV)/bin/pdserve serve configs/local-moe.yaml --model $(MODELS_DIR)/DeepSeek-V3-mini-dummy

# A sliding-window model: Gemma 3 270M (a real checkpoint, about 240 MB to download), 1P1D.
serve-gemma: $(STAMP)
	$(VENV)/bin/pdserve model prepare gemma3 --models-dir $(MODELS_DIR)
	$(VENV)/bin/pdserve serve configs/local-gemma3.yaml --model $(MODELS_DIR)/gemma-3-270m

generate: model
	$(VENV)/bin/pdserve generate --model $(MODEL) --chat "What is the capital of France?"

bench: model
	$(PY) -m benchmarks.offline offline_throughput --model $(MODEL)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
