"""CheckpointManager: atomic triple, verification, fallback, tied weights once, name-keyed optimizer."""

from __future__ import annotations

import json
import os
import random
import re
import struct
import time
import warnings

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mamba3lite.checkpoint import (
    CheckpointManager,
    RunLock,
    RunState,
    capture_rng_state,
    param_names,
    restore_rng_state,
)
from mamba3lite.checkpoint.reader import load_optimizer_file
from mamba3lite.errors import CheckpointError
from mamba3lite.rundir import checkpoint_files


class TinyLM(nn.Module):
    """Stand-in with the real model's traits: tied head, a norm, a `_no_weight_decay` parameter."""

    def __init__(self, vocab: int = 11, d: int = 6, reverse: bool = False) -> None:
        super().__init__()
        if reverse:  # same parameters registered in another order
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.proj = nn.Linear(d, d)
            self.embed = nn.Embedding(vocab, d)
        else:
            self.embed = nn.Embedding(vocab, d)
            self.proj = nn.Linear(d, d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.D = nn.Parameter(torch.ones(d))
        self.D._no_weight_decay = True

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed(x))) * self.D
        logits = self.lm_head(h)
        if y is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _trained(seed: int = 0, steps: int = 3, reverse: bool = False) -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM(reverse=reverse)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 11, (2, 5), generator=g)
        model(x, x.roll(1, 1)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh(reverse: bool = False) -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(123)
    model = TinyLM(reverse=reverse)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_roundtrip_restores_weights_optimizer_and_tie(tmp_path):
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(7, model, opt, RunState(step=7, tokens_seen=70, sampler={"epoch": 0, "consumed": 14}))
    m2, o2 = _fresh()
    meta = mgr.load(7, m2, o2)
    assert meta["step"] == 7 and meta["tokens_seen"] == 70 and meta["sampler"]["consumed"] == 14
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert m2.lm_head.weight is m2.embed.weight
    s1, s2 = opt.state_dict(), o2.state_dict()
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k])


def test_tied_weight_is_stored_once(tmp_path):
    model, opt = _trained()
    CheckpointManager(tmp_path).save(1, model, opt)
    with safe_open(str(checkpoint_files(tmp_path, 1)["model"]), framework="pt") as f:
        keys = set(f.keys())
    assert "embed.weight" in keys and "lm_head.weight" not in keys
    meta = json.loads(checkpoint_files(tmp_path, 1)["meta"].read_text())
    assert meta["tied"] == {"lm_head.weight": "embed.weight"}


def test_optimizer_state_follows_names_not_order(tmp_path):
    model, opt = _trained()
    CheckpointManager(tmp_path).save(3, model, opt)
    m2, o2 = _fresh(reverse=True)  # parameters registered in a different order
    CheckpointManager(tmp_path).load(3, m2, o2)
    names1, names2 = param_names(model), param_names(m2)
    assert names2[id(m2.embed.weight)] == "embed.weight"  # the tied pair is keyed the same either way
    saved = {names1[id(p)]: opt.state[p]["exp_avg"] for p in model.parameters()}
    loaded = {names2[id(p)]: o2.state[p]["exp_avg"] for p in m2.parameters()}
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name


@pytest.mark.parametrize("kind", ["model", "optim", "meta"])
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_torn_checkpoint_falls_back_with_warning(tmp_path, kind, damage):
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model, opt)
    mgr.save(2, model, opt)
    path = checkpoint_files(tmp_path, 2)[kind]
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        data[len(data) // 3] ^= 0x01
        path.write_bytes(bytes(data))
    fresh = CheckpointManager(tmp_path)  # no hash cache from the saves
    with pytest.warns(UserWarning, match=path.name):
        assert fresh.latest_step() == 1
    with pytest.raises(CheckpointError, match=path.name):
        fresh.load(2, *_fresh())
    assert fresh.load(1, *_fresh())["step"] == 1


def test_missing_meta_means_unfinished_save(tmp_path):
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model, opt)
    mgr.save(2, model, opt)
    checkpoint_files(tmp_path, 2)["meta"].unlink()
    with pytest.warns(UserWarning, match="meta_step_2.json"):
        assert mgr.latest_step() == 1
    assert mgr.list_steps() == [1, 2]
    assert not mgr.status(2).verified


def test_crash_during_save_leaves_previous_checkpoint_and_no_meta(tmp_path, monkeypatch):
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model, opt)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        mgr.save(2, model, opt)
    monkeypatch.undo()
    assert not checkpoint_files(tmp_path, 2)["meta"].exists()
    with pytest.warns(UserWarning, match="meta_step_2.json is missing"):
        assert CheckpointManager(tmp_path).latest_step() == 1
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_retention_keeps_last_n_verified_and_never_the_newest_verified(tmp_path):
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path, keep_last_n=2)
    for s in (1, 2, 3, 4, 5):
        mgr.save(s, model, opt)
    assert mgr.list_steps() == [4, 5]
    # The newest file set is torn: it does not count, and the older verified ones must survive.
    p = checkpoint_files(tmp_path, 5)["model"]
    p.write_bytes(p.read_bytes()[:100])
    mgr = CheckpointManager(tmp_path, keep_last_n=1)
    mgr.prune()
    assert mgr.list_steps() == [4, 5]
    with pytest.warns(UserWarning):
        assert mgr.latest_step() == 4


def test_explicit_step_loads_exactly_that_step(tmp_path):
    mgr = CheckpointManager(tmp_path)
    m1, o1 = _trained(steps=1)
    mgr.save(10, m1, o1)
    m2, o2 = _trained(steps=4)
    mgr.save(20, m2, o2)
    m, o = _fresh()
    assert mgr.load(10, m, o)["step"] == 10
    assert torch.equal(m.proj.weight, m1.proj.weight)
    with pytest.raises(CheckpointError, match="step 30"):
        mgr.load(30, m, o)


def _save_seed_format(directory, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The seed: both copies of the tied tensor (the second cloned), index-keyed optimizer, no hashes."""
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(directory / f"model_step_{step}.safetensors"))
    torch.save(opt.state_dict(), directory / f"optim_step_{step}.pt")
    meta = {"step": step, "opt_steps": step, "tag": f"step_{step}"}
    (directory / f"meta_step_{step}.json").write_text(json.dumps(meta))


def test_seed_format_with_both_tied_copies_still_loads(tmp_path):
    model, opt = _trained()
    _save_seed_format(tmp_path, 5, model, opt)
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest_step() == 5 and mgr.status(5).format == "seed"
    m2, o2 = _fresh()
    with pytest.warns(UserWarning, match="seed-format"):
        mgr.load(5, m2, o2)
    assert torch.equal(m2.embed.weight, model.embed.weight) and m2.lm_head.weight is m2.embed.weight


def test_seed_format_optimizer_of_one_group_loads_into_decay_and_no_decay_groups(tmp_path):
    # The seed's AdamW has ONE group over model.parameters(); ours has two (decayed, not decayed), so
    # position i of the seed's state is not position i of ours: it is mapped by the model's order.
    from mamba3lite.train.optim import build_optimizer

    model, opt = _trained()
    assert len(opt.param_groups) == 1
    _save_seed_format(tmp_path, 5, model, opt)
    m2 = _fresh()[0]
    o2 = build_optimizer(m2, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert len(o2.param_groups) == 2 and o2.param_groups[0]["params"][0] is not m2.embed.weight
    with pytest.warns(UserWarning, match="seed-format"):
        CheckpointManager(tmp_path).load(5, m2, o2)
    names = param_names(model)
    want = {names[id(p)]: opt.state[p]["exp_avg"] for p in model.parameters()}
    got = {param_names(m2)[id(p)]: o2.state[p]["exp_avg"] for g in o2.param_groups for p in g["params"]}
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert [g["weight_decay"] for g in o2.param_groups] == [0.1, 0.0]  # this optimizer's settings


@pytest.mark.parametrize("kind", ["optim", "model"])
def test_torn_seed_format_checkpoint_falls_back(tmp_path, kind):
    # The seed's save was not atomic: a crash could leave a complete-looking triple with a truncated file
    # (its Pitfall 1). Without hashes, the archives' structure is what can be checked.
    model, opt = _trained()
    _save_seed_format(tmp_path, 5, model, opt)
    _save_seed_format(tmp_path, 10, model, opt)
    path = checkpoint_files(tmp_path, 10)[kind]
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])  # header intact, tail missing
    mgr = CheckpointManager(tmp_path)
    assert not mgr.status(10).loadable and mgr.status(10).format == "seed"
    with pytest.warns(UserWarning, match=path.name):
        assert mgr.latest_step() == 5
    with pytest.raises(CheckpointError, match=path.name):
        mgr.load(10, *_fresh())
    with pytest.warns(UserWarning, match="seed-format"):
        assert mgr.load(5, *_fresh())["step"] == 5


class _Exploit:
    def __reduce__(self):
        return (print, ("this ran",))


def test_a_seed_format_optimizer_file_that_would_run_code_is_one_line_naming_it(tmp_path):
    """No hashes vouch for a seed-format checkpoint: an optimizer file whose pickle would call a
    function is refused by the weights-only loader, in one line that names the file and does not pass
    on torch's advice to load it with weights_only=False."""
    model, opt = _trained()
    _save_seed_format(tmp_path, 5, model, opt)
    path = checkpoint_files(tmp_path, 5)["optim"]
    torch.save({"state": {}, "param_groups": [], "x": _Exploit()}, path)
    with pytest.raises(CheckpointError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the seed-format notice, if it comes first)
        CheckpointManager(tmp_path).load(5, *_fresh())
    message = str(info.value)
    assert str(path) in message and "without running pickled code" in message, message
    assert "\n" not in message and "weights_only" not in message, message


def _flip_format_bit(meta: dict) -> None:
    meta["format"] = meta["format"][:-1] + chr(ord(meta["format"][-1]) ^ 1)  # "...-v1" -> "...-v0"


@pytest.mark.parametrize(
    "damage",
    [
        _flip_format_bit,
        lambda meta: meta.pop("format"),
        lambda meta: meta.__setitem__("formau", meta.pop("format")),  # a flipped bit in the key
    ],
    ids=["flipped-value", "key-removed", "flipped-key"],
)
def test_damaged_meta_format_is_corrupt_not_seed_format(tmp_path, damage):
    # Only a meta with none of our keys is the seed's (unverified) format: a damaged "format" must not
    # switch off the hash checks, nor drop the tied-alias map on load.
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model, opt)
    mgr.save(2, model, opt)
    path = checkpoint_files(tmp_path, 2)["meta"]
    meta = json.loads(path.read_text())
    damage(meta)
    path.write_text(json.dumps(meta))
    fresh = CheckpointManager(tmp_path)
    st = fresh.status(2)
    assert not st.loadable and st.format != "seed" and path.name in st.problems[0]
    with pytest.warns(UserWarning, match=path.name):
        assert fresh.latest_step() == 1
    with pytest.raises(CheckpointError, match=path.name):
        fresh.load(2, *_fresh())
    m2, o2 = _fresh()
    assert fresh.load(1, m2, o2)["step"] == 1 and m2.lm_head.weight is m2.embed.weight


@pytest.mark.parametrize("field, value", [("tokens_seen", "abc"), ("data", [1]), ("config", None)])
def test_older_meta_without_digest_with_a_badly_typed_field_is_not_loadable(tmp_path, field, value):
    # A v1 meta has no meta_sha256 to catch an edit; every reader relies on these fields' types.
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model, opt, RunState(step=1, tokens_seen=10, config={}, data={}))
    mgr.save(2, model, opt, RunState(step=2, tokens_seen=20, config={}, data={}))
    path = checkpoint_files(tmp_path, 2)["meta"]
    meta = json.loads(path.read_text())
    del meta["meta_sha256"]
    meta[field] = value
    path.write_text(json.dumps(meta))
    st = CheckpointManager(tmp_path).status(2)
    assert not st.loadable and f"not a valid checkpoint meta file: {field} must be" in st.problems[0]
    with pytest.warns(UserWarning, match=path.name):
        assert CheckpointManager(tmp_path).latest_step() == 1


def test_move_aside_keeps_every_abandoned_timeline(tmp_path, monkeypatch):
    # Resuming step 1 twice abandons two different step-2 checkpoints: both must survive.
    import mamba3lite.checkpoint.retention as ckpt_module

    frozen = time.gmtime(1_700_000_000)
    monkeypatch.setattr(ckpt_module.time, "gmtime", lambda *a: frozen)  # both moves in the same second
    mgr = CheckpointManager(tmp_path)
    m1, o1 = _trained(steps=1)
    mgr.save(1, m1, o1)
    mgr.save(2, m1, o1)
    first_bytes = checkpoint_files(tmp_path, 2)["model"].read_bytes()
    first = mgr.move_aside([2])
    m2, o2 = _trained(steps=4)
    mgr.save(2, m2, o2)
    second_bytes = checkpoint_files(tmp_path, 2)["model"].read_bytes()
    second = mgr.move_aside([2])
    assert first_bytes != second_bytes and first != second
    assert first.parent == second.parent == tmp_path / "superseded"
    assert (first / "model_step_2.safetensors").read_bytes() == first_bytes
    assert (second / "model_step_2.safetensors").read_bytes() == second_bytes
    triple = ["meta_step_2.json", "model_step_2.safetensors", "optim_step_2.pt"]
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir()) == triple
    assert mgr.list_steps() == [1]
    mgr.save(2, m2, o2)
    third = mgr.move_aside([2], from_step=1)
    assert third.name == "20231114T221320Z-from-step-1" and third.parent == first.parent
    # A moved-aside triple still verifies where it lies.
    assert CheckpointManager(third).status(2).verified


def test_wrong_model_is_a_clear_error(tmp_path):
    model, opt = _trained()
    CheckpointManager(tmp_path).save(1, model, opt)
    other = TinyLM(vocab=13)
    with pytest.raises(CheckpointError, match=r"model_step_1\.safetensors"):
        CheckpointManager(tmp_path).load(1, other)


def test_run_lock_is_exclusive(tmp_path):
    with RunLock(tmp_path), pytest.raises(CheckpointError, match="in use by another trainer"):
        RunLock(tmp_path).acquire()
    RunLock(tmp_path).acquire().release()  # free again once released


def test_rng_state_roundtrip_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = json.loads(json.dumps(capture_rng_state()))
    a = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    restore_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.mark.parametrize("with_digest", [True, False])
def test_a_meta_whose_files_entry_is_not_a_mapping_is_a_bad_step_not_a_crash(tmp_path, with_digest):
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(4, model, opt)
    mgr.save(6, model, opt)
    path = checkpoint_files(tmp_path, 6)["meta"]
    meta = json.loads(path.read_text())
    meta["files"]["model"] = 5
    if not with_digest:  # an older meta without its own digest: only the field types can tell
        del meta["meta_sha256"]
    path.write_text(json.dumps(meta))
    st = mgr.status(6)
    assert not st.loadable and st.problems
    with pytest.warns(UserWarning, match="step 6 is not usable"):
        assert mgr.latest_step() == 4


def test_forget_hashes_sees_corruption_that_kept_size_and_mtime(tmp_path):
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(4, model, opt)
    path = checkpoint_files(tmp_path, 4)["model"]
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # a flipped bit in the last tensor: same size
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same mtime
    assert mgr.status(4).verified  # the hash of the save, cached
    mgr.forget_hashes()
    assert not mgr.status(4).verified and "sha256 differs" in mgr.status(4).problems[0]


@pytest.mark.parametrize(
    "head, problem",
    [
        (struct.pack("<Q", 1 << 40), "declares a header of 1,099,511,627,776 bytes"),
        (struct.pack("<Q", 8) + b"[[[[[[[[", "not valid JSON"),
        (struct.pack("<Q", 8) + b'"abcdef"', "its header must be an object"),
        (struct.pack("<Q", 16) + b'{"__metadata__":', "not valid JSON"),
    ],
)
def test_a_weights_file_with_a_bad_header_is_refused_before_safetensors_reads_it(tmp_path, head, problem):
    from mamba3lite.checkpoint.weights import load_model_file, read_header

    model, opt = _trained()
    CheckpointManager(tmp_path).save(1, model, opt)
    path = checkpoint_files(tmp_path, 1)["model"]
    data = path.read_bytes()
    path.write_bytes(head + data[len(head) :])
    with pytest.raises(CheckpointError, match=re.escape(problem)):
        read_header(path)
    with pytest.raises(CheckpointError, match=path.name):
        load_model_file(path, _fresh()[0])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a named pipe")
def test_checkpoint_files_that_are_pipes_are_problems_not_hangs(tmp_path):
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, model, opt)
    for kind in ("model", "optim"):
        path = checkpoint_files(tmp_path, 1)[kind]
        path.rename(path.with_suffix(".bak"))
        os.mkfifo(path)
    st = CheckpointManager(tmp_path).status(1)
    assert not st.loadable  # sizes differ from the meta's: never opened
    from mamba3lite.checkpoint.weights import read_header

    with pytest.raises(CheckpointError, match="named pipe"):
        read_header(checkpoint_files(tmp_path, 1)["model"])
    with pytest.raises(CheckpointError, match="named pipe"):
        load_optimizer_file(opt, model, {}, checkpoint_files(tmp_path, 1)["optim"], "cpu")
