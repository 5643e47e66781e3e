"""The real thing (issue 17): mamba_ssm's `MambaLMHeadModel.from_pretrained` loads an exported directory
without edits and gives our logits. Needs CUDA and `pip install mamba-ssm` (its kernels are GPU-only),
so it is skipped elsewhere; on CPU the same contract is checked against the independent official-layout
LM (tests/test_interop.py). Run on a GPU machine: `pytest -m gpu tests/test_interop_mamba_ssm.py`.
"""

from __future__ import annotations

import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.config import Config
from mamba3lite.interop.export import export_run
from mamba3lite.model import Mamba3Transformer
from userside_helpers import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("mimo", [False, True], ids=["siso", "mimo"])
def test_mamba_ssm_from_pretrained_loads_an_export_and_gives_our_logits(tmp_path, mimo):
    mixer_seq = pytest.importorskip("mamba_ssm.models.mixer_seq_simple", reason="needs mamba-ssm")
    base = tiny_config(tmp_path / "run").model
    # Shapes the official kernels accept (head dim 64, state 64, chunk 64 / R).
    cfg = base.__class__(**{**base.__dict__, "d_model": 128, "n_layers": 2, "d_intermediate": 256,
                            "d_state": 64, "headdim": 64, "chunk_size": 16 if mimo else 64,
                            "is_mimo": mimo, "mimo_rank": 4})  # fmt: skip
    torch.manual_seed(0)
    model = Mamba3Transformer(cfg)
    data = {"tokenizer": "gpt2", "vocab_size": 50257, "eos_id": 50256}
    CheckpointManager(tmp_path / "run").save(
        1, model, None, RunState(step=1, config=Config(model=cfg).to_dict(), data=data)
    )
    export_run(tmp_path / "run", tmp_path / "out")

    official = mixer_seq.MambaLMHeadModel.from_pretrained(
        str(tmp_path / "out"), device="cuda", dtype=torch.float32
    )
    ids = torch.randint(0, 50257, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(ids)
        got = official.eval()(ids.cuda()).logits.float().cpu()
    assert got.shape == want.shape
    # The official kernels run Q, K, V, angles and the gate in bf16 (docs/model.md §1.3): bf16 tolerances.
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)
