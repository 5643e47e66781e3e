"""Scenario 2: torn, corrupted and lying checkpoints. For each of the three files of the newest
checkpoint: truncate, flip bytes, delete; also metas that parse but lie. Every damage is detected, the
run resumes from the newest good checkpoint with a warning naming the bad file, and it then ends
bit-for-bit where an undamaged run ends (so nothing damaged was loaded)."""

from __future__ import annotations

import json
import random
import shutil
import warnings

import chaos_harness as H
import pytest

from mamba3lite.checkpoint import CheckpointManager, _meta_digest
from mamba3lite.config import load_config
from mamba3lite.rundir import checkpoint_files
from mamba3lite.train.trainer import Pretrainer

STEPS = 6  # checkpoints at 2 and 4 (the damaged one), then on to 6


def _train(config_path, until=None, resume="latest"):
    cfg = load_config(
        config_path, [f"training.max_steps={STEPS}", "training.eval_every=0", "training.keep_last_n=0"]
    )
    return Pretrainer(cfg, resume=resume).train(until_step=until)


@pytest.fixture(scope="module")
def damaged_base(tmp_path_factory, chaos_data):
    """A run directory paused at step 4 (checkpoints 2 and 4), and the final weights of continuing it
    undamaged to step 6 (in-process, like the damaged runs, so the comparison is bit-for-bit)."""
    work = tmp_path_factory.mktemp("corrupt")
    base = work / "base"
    H.write_config(work / "base.yaml", chaos_data, base)
    assert _train(work / "base.yaml", until=4).step == 4
    ref = work / "ref"
    shutil.copytree(base, ref)
    H.write_config(work / "ref.yaml", chaos_data, ref)
    assert _train(work / "ref.yaml").step == STEPS
    return base, H.final_weights(ref, STEPS)


def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p, pos=None):
    data = bytearray(p.read_bytes())
    pos = len(data) // 2 if pos is None else pos
    data[pos] ^= 0x10
    p.write_bytes(bytes(data))


def _edit_meta(p, fn, *, reseal: bool):
    """Change the meta's content with `fn(meta)`; with reseal the meta's own checksum is recomputed (a
    consistent but lying meta, as a buggy writer could produce)."""
    meta = json.loads(p.read_text())
    fn(meta)
    if reseal:
        meta["meta_sha256"] = _meta_digest(meta)
    p.write_text(json.dumps(meta, indent=2, sort_keys=True))


def _other_step_files(meta, other):
    meta["files"] = json.loads(other.read_text())["files"]


DAMAGES = {
    "model-truncated": ("model", _truncate),
    "model-flipped": ("model", _flip),
    "model-flipped-header": ("model", lambda p: _flip(p, 20)),
    "model-deleted": ("model", lambda p: p.unlink()),
    "optim-truncated": ("optim", _truncate),
    "optim-flipped": ("optim", _flip),
    "optim-deleted": ("optim", lambda p: p.unlink()),
    "meta-truncated": ("meta", _truncate),
    "meta-flipped": ("meta", _flip),
    "meta-deleted": ("meta", lambda p: p.unlink()),
    # Flips that keep the JSON valid: only the meta's own checksum can see them.
    "meta-digit-changed": (
        "meta",
        lambda p: _edit_meta(p, lambda m: m.update(tokens_seen=m["tokens_seen"] + 1), reseal=False),
    ),
    "meta-sampler-changed": (
        "meta",
        lambda p: _edit_meta(
            p,
            lambda m: m["sampler"].update({k: v + 1 for k, v in m["sampler"].items() if type(v) is int}),
            reseal=False,
        ),
    ),
    # Metas that lie consistently (checksum recomputed): the other layers must still catch them.
    "meta-lies-about-step": ("meta", lambda p: _edit_meta(p, lambda m: m.update(step=2), reseal=True)),
    "meta-lies-about-hashes": (
        "meta",
        lambda p: _edit_meta(p, lambda m: _other_step_files(m, p.with_name("meta_step_2.json")), reseal=True),
    ),
}
NAMED = {"meta-lies-about-hashes": "model"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_damaged_newest_checkpoint_is_detected_and_skipped(tmp_path, damaged_base, chaos_data, name):
    base, final_ref = damaged_base
    kind, damage = DAMAGES[name]
    run = tmp_path / "run"
    shutil.copytree(base, run)
    damage(checkpoint_files(run, 4)[kind])
    # A meta that lies about the hashes is caught by the files it describes: the warning names them.
    bad_file = checkpoint_files(run, 4)[NAMED.get(name, kind)]
    assert not CheckpointManager(run).status(4).loadable, f"{name} went unnoticed"
    config = H.write_config(tmp_path / "c.yaml", chaos_data, run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _train(config)
    messages = [str(w.message) for w in caught if "checkpoint step 4" in str(w.message)]
    assert messages and any(bad_file.name in m for m in messages), [str(w.message) for w in caught]
    resumes = [r for r in H.metrics_rows(run) if r.get("event") == "resume" and not r.get("superseded")]
    assert "resumed from step 2" in resumes[-1]["message"]
    assert result.step == STEPS and result.history[0][0] == 3
    assert H.weights_identical(H.final_weights(run, STEPS), final_ref)


def test_undamaged_checkpoint_verifies_with_its_meta_checksum(tmp_path, chaos_data):
    """The control: without damage step 4 verifies (so the tests above fail for the damage alone)."""
    run = tmp_path / "run"
    H.write_config(tmp_path / "c.yaml", chaos_data, run)
    cfg = load_config(tmp_path / "c.yaml", ["training.max_steps=2", "training.eval_every=0"])
    Pretrainer(cfg).train()
    meta = json.loads(checkpoint_files(run, 2)["meta"].read_text())
    assert meta["meta_sha256"] == _meta_digest(meta)
    assert CheckpointManager(run).status(2).verified


@pytest.mark.parametrize("kind", ["model", "optim", "meta"])
def test_random_single_byte_flips_never_go_unnoticed(tmp_path, damaged_base, kind):
    """20 seeded flips per file, anywhere (headers, tensor data, JSON): each one is detected and the
    newest good step (2) is chosen with a warning naming the file. Detection only: the resume itself is
    exercised above."""
    base, _ = damaged_base
    rng = random.Random(kind)
    for i in range(20):
        run = tmp_path / f"run{i}"
        shutil.copytree(base, run)
        path = checkpoint_files(run, 4)[kind]
        _flip(path, rng.randrange(path.stat().st_size))
        step, warns = H.latest_verified(run)
        assert step == 2, f"flip {i} of {path.name} went unnoticed"
        assert any(path.name in w for w in warns), warns
