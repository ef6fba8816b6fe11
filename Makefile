# `make test` and `make generate` set up .venv themselves (torch first, pinned: see requirements.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL := models/SmolLM2-135M-Instruct

.PHONY: install model test serve generate bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(VENV)/bin/pdserve model prepare smollm2

test: model
	$(PY) -m pytest -q tests

serve: model
	$(VENV)/bin/pdserve serve configs/local.yaml

generate: model
	$(VENV)/bin/pdserve generate --model $(MODEL) --chat "What is the capital of France?"

bench: model
	$(PY) benchmarks/offline_throughput.py --model $(MODEL)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
