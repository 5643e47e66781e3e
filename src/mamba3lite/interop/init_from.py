"""The weights `train --init-from SRC` starts a new run from: a run directory (its newest verified
checkpoint) or an official mamba_ssm directory (translated as `import` does, in memory).

Only the weights cross over: the new run has its own optimizer, schedule, data order and counters,
starting at step 0. The source's tokenizer identity comes along so that `train` can refuse a dataset
tokenized with another tokenizer, with the same check `eval` uses (`DataIdentity.compatible_with`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.errors import CheckpointError
from mamba3lite.model.config import ModelConfig


@dataclass
class InitSource:
    """What a new run starts from: `config` (the model's), `state` (our names; fp32 or the file's
    dtypes), the tokenizer's `tokenizer_name` and `vocab_hash` (None: not recorded), and a `description`
    for the console."""

    config: ModelConfig
    state: dict[str, Tensor]
    tokenizer_name: str
    vocab_hash: str | None
    description: str

    def build_model(self, cfg: ModelConfig):
        """A fresh `Mamba3Transformer(cfg)` (fp32) holding these weights; CheckpointError when `cfg`
        (the source's config with the run's model overrides) changes a parameter's shape."""
        from mamba3lite.model import Mamba3Transformer

        model = Mamba3Transformer(cfg)
        state = dict(self.state)
        if cfg.tie_embeddings and "lm_head.weight" not in state:
            state["lm_head.weight"] = state["embed.weight"]
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            first = " ".join(str(e).strip().splitlines()[:2])[:300]
            raise CheckpointError(
                f"--init-from {self.description}: the weights do not fit the run's model config ({first}); "
                "do not --set model fields that change the model's shape"
            ) from None
        return model


def load_init_source(src: str) -> InitSource:
    """The weights at `src`: a run directory or an official model directory (or hf:NAME)."""
    p = Path(src)
    if not src.startswith("hf:") and RunDir(p).is_run():
        from mamba3lite.pretrained import load_pretrained

        loaded = load_pretrained(p)
        state = {k: v.detach() for k, v in loaded.model.state_dict().items()}
        return InitSource(
            loaded.config.model,
            state,
            loaded.tokenizer_name,
            loaded.vocab_hash,
            f"{p} (step {loaded.step})",
        )
    if not src.startswith("hf:") and p.is_dir() and not (p / "config.json").exists():
        raise CheckpointError(
            f"--init-from {src}: neither a run directory (no checkpoint, run.json or metrics.jsonl) nor "
            "an official model directory (no config.json)"
        )
    from mamba3lite.interop.import_ import DEFAULT_A_ACTIVATION, tokenizer_identity, translate
    from mamba3lite.interop.source import open_source

    source = open_source(src)
    if source.tokenizer is None:
        raise CheckpointError(
            f"--init-from {src}: the official model has no tokenizer.json; import it first "
            "(`mamba3lite import SRC --out RUN --tokenizer PATH`) and pass --init-from RUN"
        )
    tok = tokenizer_identity(str(source.tokenizer))
    w = translate(source, tok, DEFAULT_A_ACTIVATION)
    return InitSource(w.config, w.state, tok.tokenizer, tok.vocab_hash, f"{src} (official format)")
