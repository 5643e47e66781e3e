"""The decode-state protocol (model/decode_state.py) on a layer's state (Mamba3Cache) and on the model's
(ModelCache): rows are views that write through, select copies rows in any order (repeats too),
load_ copies in place, snapshot is independent, nbytes counts what is held. And the rule that makes it
a seam: no layer's state field is named outside model/."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from mamba3lite.model import DecodeState, Mamba3Cache, Mamba3Transformer, ModelCache, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


def tiny_model(**kw) -> Mamba3Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, d_model=32, n_layers=2, d_intermediate=40, mlp_multiple_of=8, d_state=16,
               headdim=8, chunk_size=8, eos_id=3)  # fmt: skip
    return Mamba3Transformer(ModelConfig(**{**cfg, **kw})).to(F64)


def tensors(state) -> list[torch.Tensor]:
    """Every tensor of a state (a test's look inside; callers outside model/ never do this)."""
    if isinstance(state, ModelCache):
        return [t for s in state.layers for t in tensors(s)] + [state.last_token_B]
    return [getattr(state, f.name) for f in dataclasses.fields(state)]


def numbered(model: Mamba3Transformer, rows: int) -> ModelCache:
    """A state whose row r holds r + 1 (every tensor of every layer, and the last token)."""
    state = model.allocate_cache(rows, dtype=F64)
    for t in tensors(state):
        for r in range(rows):
            t[r] = r + 1
    return state


def row_values(state) -> list[list[int]]:
    """Per tensor, the value each row holds (all equal within a row, by construction)."""
    out = []
    for t in tensors(state):
        flat = t.reshape(t.shape[0], -1)
        assert bool((flat == flat[:, :1]).all())
        out.append([int(v) for v in flat[:, 0]])
    return out


@pytest.fixture(params=["layer", "model"])
def state_of(request):
    """(build a numbered state of n rows) for a layer's Mamba3Cache, or the model's ModelCache."""
    model = tiny_model()
    if request.param == "model":
        return lambda n: numbered(model, n)
    return lambda n: numbered(model, n).layers[1]


def test_both_states_follow_the_protocol(state_of):
    state = state_of(2)
    assert isinstance(state, DecodeState)
    assert isinstance(state, (Mamba3Cache, ModelCache))


def test_rows_are_views_and_writes_go_through(state_of):
    state = state_of(4)
    part = state.rows(1, 3)
    assert row_values(part) == [[2, 3]] * len(tensors(state))
    for t in tensors(part):
        t.fill_(9)
    assert row_values(state) == [[1, 9, 9, 4]] * len(tensors(state))


def test_select_reorders_and_repeats_into_a_new_state(state_of):
    state = state_of(3)
    picked = state.select(torch.tensor([2, 0, 2, 1]))
    assert row_values(picked) == [[3, 1, 3, 2]] * len(tensors(state))
    for t in tensors(picked):
        t.fill_(7)
    assert row_values(state) == [[1, 2, 3]] * len(tensors(state))  # a copy, not a view


def test_load_copies_in_place_and_snapshot_is_independent(state_of):
    state = state_of(3)
    kept = [t.data_ptr() for t in tensors(state)]
    snap = state.snapshot()
    state.rows(0, 1).load_(state.rows(2, 3))
    assert [t.data_ptr() for t in tensors(state)] == kept  # in place
    assert row_values(state) == [[3, 2, 3]] * len(tensors(state))
    assert row_values(snap) == [[1, 2, 3]] * len(tensors(state))  # the snapshot did not follow
    state.load_(snap)
    assert row_values(state) == [[1, 2, 3]] * len(tensors(state))
    assert row_values(snap) == [[1, 2, 3]] * len(tensors(state))


def test_nbytes_counts_every_tensor_and_rows_scale_it(state_of):
    state = state_of(4)
    assert state.nbytes() == sum(t.numel() * t.element_size() for t in tensors(state)) > 0
    assert state.rows(0, 1).nbytes() * 4 == state.nbytes()
    assert state.select(torch.tensor([0, 0])).nbytes() * 2 == state.nbytes()


def test_a_mamba3_state_does_not_grow_with_max_len():
    model = tiny_model()
    assert model.allocate_cache(2).nbytes() == model.allocate_cache(2, max_len=10_000).nbytes()


def test_decode_from_selected_rows_equals_decode_of_those_sequences():
    """What serve and state reuse rely on: a row moved by select/load_ continues as its own sequence."""
    model = tiny_model()
    x = torch.randint(4, 61, (3, 12), generator=torch.Generator().manual_seed(1))
    alone = model.allocate_cache(3, dtype=F64)
    model.prefill(x[:, :8], alone)
    want = model.extend(x[[2, 0], 8:], alone.select(torch.tensor([2, 0])))
    moved = model.allocate_cache(2, dtype=F64)
    moved.rows(0, 1).load_(alone.select(torch.tensor([2])))
    moved.rows(1, 2).load_(alone.snapshot().rows(0, 1))
    torch.testing.assert_close(model.extend(x[[2, 0], 8:], moved), want, rtol=0, atol=0)


# ---- the seam: layer state fields are named inside model/ only ----
FIELD_NAMES = ("angle_BHS", "ssm_BHPN", "k_BRHN", "v_BHP")


def test_no_layer_state_field_is_named_outside_model():
    pattern = re.compile(r"\b(" + "|".join(FIELD_NAMES) + r")\b")
    offenders = []
    for folder in ("src", "benchmarks"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            if (ROOT / "src" / "mamba3lite" / "model") in f.parents:
                continue
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), start=1):
                if pattern.search(line):
                    offenders.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "decode-state fields named outside model/ (use the protocol):\n" + "\n".join(
        offenders
    )
    # The check can fail: the model itself names them.
    assert pattern.search((ROOT / "src/mamba3lite/model/mamba3.py").read_text(encoding="utf-8"))


def test_selecting_rows_of_a_state_is_written_once():
    """`index_select` on a decode state's rows lives in model/decode_state.py, not in its callers."""
    callers = [
        "serve/batch_state.py", "serve/engine.py", "serve/prefix_cache.py", "downstream/state_reuse.py",
        "interop/hf_remote/modeling_glue.py", "generation.py",
    ]  # fmt: skip
    for rel in callers:
        text = (ROOT / "src/mamba3lite" / rel).read_text(encoding="utf-8")
        assert "last_token_B" not in text and ".layers" not in text, rel


def test_a_layer_state_hands_out_its_parts_and_takes_others_in_their_order():
    """What a serving engine with its own slots does (the vLLM plugin): keep a state's parts unnamed,
    then rebuild a state of the same kind around views of its slots."""
    state = numbered(tiny_model(), 3).layers[1]
    parts = state.tensors()
    assert [t.data_ptr() for t in parts] == [t.data_ptr() for t in tensors(state)]  # themselves, in order
    slots = tuple(torch.zeros(5, *t.shape[1:], dtype=t.dtype) for t in parts)
    view = state.with_tensors(s[1:4] for s in slots)
    assert type(view) is type(state)
    view.load_(state)  # writes through the views into the slots
    assert row_values(state.with_tensors(s[1:4] for s in slots)) == row_values(state)
    assert all(bool((s[0] == 0).all() and (s[4] == 0).all()) for s in slots)
    with pytest.raises(AssertionError, match="more tensors"):
        state.with_tensors([*parts, parts[0]])
