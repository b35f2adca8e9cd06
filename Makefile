# dpserve developer entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# CPU-only machines: a pinned CPU build (this project's machines carry its wheel).
# CUDA machines: `make demo TORCH_SPEC=torch` takes the regular CUDA build.
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8000
# `make demo DP=2 API=4`: data-parallel ranks and API servers (API unset: one per rank).
DP ?= 1
API ?=
PYTEST_ARGS ?=

# --engine vllm: vLLM's CPU build and dpserve in a venv of their own (vLLM pins
# its own torch, transformers and llguidance); the vLLM engine tests use it.
VLLM_VENV ?= .venv-vllm

.PHONY: setup setup-vllm demo test test-fast lint clean

$(VENV)/.installed: pyproject.toml daemons/api/_prefix_keys.c
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e '.[test,fast]'
	touch $@

setup: $(VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml benchmarks/setup_vllm.sh
	PYTHON=$(PYTHON) bash benchmarks/setup_vllm.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -e .
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

demo: setup
	$(VENV)/bin/dpserve serve --port $(PORT) --data-parallel-size $(DP) $(if $(API),--api-server-count $(API))

# -rfE --tb=short COLUMNS=200: a failure's message survives whole at the end of a CI log
test: setup
	COLUMNS=200 $(VENV)/bin/python -m pytest -q -rfEs --tb=short --durations=40 $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not slow and not system" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/pip install -q ruff
	$(VENV)/bin/ruff check engine daemons tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
