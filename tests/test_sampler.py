"""WindowSampler (data/sampler.py): seeded epoch orders (the Feistel bijection of new runs, the stored
PCG64 permutation of runs started before it), world-size-independent global batches, disjoint and
covering rank splits, exact resume (also on another world size, and of an old state in its old order),
the tail reported once per epoch."""

from __future__ import annotations

import itertools
import json
import logging

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mamba3lite.data import WindowSampler
from mamba3lite.data.sampler import epoch_permutation, window_at, windows_at
from mamba3lite.errors import CheckpointError, ConfigError


def flat(lists) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def take(sampler: WindowSampler, n_batches: int) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), n_batches))


def order_of(n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s whole "feistel-v1" order (the default of a new sampler)."""
    return windows_at(np.arange(n), n, seed, epoch)


def global_batches(n, G, W, n_batches, seed=0, state=None, shuffle=True, order="feistel-v1"):
    """Run W rank samplers side by side; each global batch is the ranks' shares in rank order."""
    samplers = [
        WindowSampler(n, G, rank=r, world_size=W, seed=seed, shuffle=shuffle, order=order) for r in range(W)
    ]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    per_rank = [take(s, n_batches) for s in samplers]
    assert len({json.dumps(s.state_dict()) for s in samplers}) == 1  # every rank holds the same state
    return [flat(per_rank[r][b] for r in range(W)) for b in range(n_batches)], samplers[0].state_dict()


def test_epoch_permutation_is_a_seeded_permutation():
    p = epoch_permutation(100, seed=3, epoch=2)
    assert p.dtype == np.int64 and sorted(p.tolist()) == list(range(100))
    np.testing.assert_array_equal(p, np.random.Generator(np.random.PCG64([3, 2])).permutation(100))
    np.testing.assert_array_equal(p, epoch_permutation(100, 3, 2))
    assert not np.array_equal(p, epoch_permutation(100, 3, 3))
    assert not np.array_equal(p, epoch_permutation(100, 4, 2))
    np.testing.assert_array_equal(epoch_permutation(7, 3, 2, shuffle=False), np.arange(7))


@pytest.mark.parametrize(("order", "order_fn"), [("feistel-v1", order_of), ("pcg64-perm", epoch_permutation)])
def test_order_follows_the_epoch_orders(order, order_fn):
    n, G = 50, 8  # 6 batches per epoch, tail of 2
    batches, state = global_batches(n, G, 1, 18, seed=5, order=order)
    assert state["order"] == order
    for e in range(3):
        perm = order_fn(n, 5, e)
        assert flat(batches[6 * e : 6 * e + 6]) == perm[: 6 * G].tolist()
    s = WindowSampler(n, G, seed=5, order=order)
    assert s.global_batch(1, 2) == batches[8]


def test_no_shuffle_is_index_order_every_epoch():
    batches, _ = global_batches(10, 3, 1, 6, shuffle=False)
    assert batches == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] * 2


@pytest.mark.parametrize("W", [1, 2, 3, 4, 6, 12])
def test_global_batches_do_not_depend_on_world_size(W):
    n, G = 100, 12
    reference, _ = global_batches(n, G, 1, 20, seed=9)
    batches, _ = global_batches(n, G, W, 20, seed=9)
    assert batches == reference


def test_rank_shares_are_disjoint_and_cover_the_global_batch():
    n, G, W = 64, 8, 4
    samplers = [WindowSampler(n, G, rank=r, world_size=W, seed=1) for r in range(W)]
    per_rank = [take(s, 8) for s in samplers]
    for b in range(8):
        shares = [set(per_rank[r][b]) for r in range(W)]
        assert all(len(sh) == G // W for sh in shares)
        assert set.union(*shares) == set(WindowSampler(n, G, seed=1).global_batch(0, b))
        assert sum(len(sh) for sh in shares) == G  # disjoint
    # one epoch covers every window exactly once (n % G == 0 here)
    assert sorted(flat(flat(p) for p in per_rank)) == list(range(n))


def test_state_dict_is_tiny_json():
    s = WindowSampler(30, 4, seed=2)
    take(s, 9)
    state = s.state_dict()
    # 7 batches per epoch: batch 9 is epoch 1's 2nd
    assert state == {"seed": 2, "epoch": 1, "consumed": 8, "order": "feistel-v1"}
    assert json.loads(json.dumps(state)) == state


def test_exact_resume_across_an_epoch_boundary():
    n, G = 50, 8
    uninterrupted, _ = global_batches(n, G, 1, 20, seed=4)
    first, state = global_batches(n, G, 1, 10, seed=4)
    rest, _ = global_batches(n, G, 1, 10, seed=123, state=json.loads(json.dumps(state)))  # state's seed wins
    assert first + rest == uninterrupted


def test_load_into_a_sampler_that_already_ran():
    uninterrupted, _ = global_batches(50, 8, 1, 12, seed=4)
    _, state = global_batches(50, 8, 1, 3, seed=4)
    s = WindowSampler(50, 8, seed=77)
    take(s, 4)  # caches seed 77's order for epoch 0
    s.load_state_dict(state)
    assert take(s, 9) == uninterrupted[3:]


def test_resume_on_a_changed_world_size():
    n, G = 200, 12
    uninterrupted, _ = global_batches(n, G, 1, 40, seed=8)
    first, state = global_batches(n, G, 4, 19, seed=8)
    rest, _ = global_batches(n, G, 3, 21, seed=8, state=state)
    assert first + rest == uninterrupted
    # and with set_world on an existing sampler
    s = WindowSampler(n, G, rank=0, world_size=2, seed=8)
    s.load_state_dict(state)
    s.set_world(1, 6)
    assert take(s, 1)[0] == uninterrupted[19][2:4]


def test_resume_with_a_changed_global_batch_continues_at_the_next_window():
    n = 60
    order = order_of(n, 0, 0).tolist()
    _, state = global_batches(n, 6, 1, 3)  # 18 windows consumed
    s = WindowSampler(n, 4)
    s.load_state_dict(state)
    assert take(s, 2) == [order[18:22], order[22:26]]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 120),
    G_W=st.sampled_from([(1, 1), (2, 2), (4, 2), (6, 3), (8, 4), (12, 6), (5, 5)]),
    stop=st.integers(0, 30),
    W2=st.sampled_from([1, 2, 3, 4, 6]),
    seed=st.integers(0, 2**32 - 1),
)
def test_resume_property(n, G_W, stop, W2, seed):
    G, W = G_W
    assume(n >= G and G % W2 == 0)
    total = 35
    uninterrupted, _ = global_batches(n, G, 1, total, seed=seed)
    first, state = global_batches(n, G, W, stop, seed=seed)
    rest, _ = global_batches(n, G, W2, total - stop, seed=seed, state=state)
    assert first + rest == uninterrupted


def test_tail_is_counted_and_reported_once_per_epoch(caplog):
    s = WindowSampler(50, 8, seed=0)  # tail of 2 windows per epoch
    assert s.batches_per_epoch == 6 and s.tail_per_epoch == 2
    with caplog.at_level(logging.INFO, logger="mamba3lite"):
        take(s, 18)  # exactly 3 epochs
    reports = [r.getMessage() for r in caplog.records if "skips" in r.getMessage()]
    assert len(reports) == 3
    assert "epoch 0 skips 2 of 50 windows" in reports[0] and "epoch 2" in reports[2]
    assert s.windows_dropped == 6
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mamba3lite"):
        take(WindowSampler(48, 8), 12)
    assert not [r for r in caplog.records if "skips" in r.getMessage()]


def test_each_epoch_uses_distinct_windows_and_skips_only_the_tail():
    n, G = 50, 8
    batches, _ = global_batches(n, G, 1, 6, seed=3)
    used = flat(batches)
    assert len(set(used)) == len(used) == 48
    assert set(range(n)) - set(used) == set(order_of(n, 3, 0)[48:].tolist())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_windows": 5, "global_batch_size": 8}, "larger than"),
        ({"n_windows": 0, "global_batch_size": 1}, "n_windows"),
        ({"n_windows": 50, "global_batch_size": 8, "world_size": 3}, "not divisible by world_size 3"),
        ({"n_windows": 50, "global_batch_size": 8, "world_size": 2, "rank": 2}, "rank 2"),
        ({"n_windows": 50, "global_batch_size": 8, "seed": -1}, "seed"),
        ({"n_windows": 50, "global_batch_size": True}, "global_batch_size"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        WindowSampler(**kwargs)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"seed": 0, "epoch": 0}, "exactly the keys"),
        ({"seed": 0, "epoch": 0, "consumed": 0, "x": 1}, "exactly the keys"),
        ({"seed": 0, "epoch": -1, "consumed": 0}, "epoch"),
        ({"seed": 0, "epoch": 0, "consumed": "8"}, "consumed"),
        ({"seed": 0, "epoch": 0, "consumed": 51}, "exceeds"),
        ([0, 0, 0], "exactly the keys"),
        ({"seed": 0, "epoch": 0, "consumed": 0, "order": "feistel-v1", "x": 1}, "exactly the keys"),
        ({"seed": 0, "epoch": 0, "consumed": 0, "order": "mt19937"}, "'mt19937' is not one this version"),
        ({"seed": 0, "epoch": 0, "consumed": 0, "order": 1}, "not one this version knows"),
    ],
)
def test_bad_state(state, message):
    with pytest.raises(CheckpointError, match=message):
        WindowSampler(50, 8).load_state_dict(state)


def test_next_batch_hands_out_what_iteration_yields_across_epochs():
    """The trainer draws with next_batch() (no iterator to keep in sync with load_state_dict)."""
    from itertools import islice

    from mamba3lite.data.sampler import WindowSampler

    drawn = WindowSampler(10, 4, seed=3)
    iterated = WindowSampler(10, 4, seed=3)
    batches = [drawn.next_batch() for _ in range(7)]  # 2 batches per epoch: into epoch 3
    assert batches == list(islice(iter(iterated), 7))
    assert drawn.state_dict() == iterated.state_dict() == {
        "seed": 3, "epoch": 3, "consumed": 4, "order": "feistel-v1"
    }  # fmt: skip
    resumed = WindowSampler(10, 4, seed=3)
    resumed.load_state_dict(drawn.state_dict())
    assert resumed.next_batch() == drawn.next_batch()


# ------------------------------------------------------------------ the O(1)-memory order (feistel-v1)
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 10**6))
def test_windows_at_is_a_permutation(n, seed, epoch):
    perm = windows_at(np.arange(n), n, seed, epoch)
    assert perm.dtype == np.int64 and perm.shape == (n,)
    assert np.array_equal(np.sort(perm), np.arange(n))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 64, 65, 1000, 4095, 4097])
def test_windows_at_is_a_permutation_at_the_edges(n):
    for seed in range(8):
        assert sorted(windows_at(np.arange(n), n, seed, 0).tolist()) == list(range(n))
    assert window_at(0, 1, 5, 9) == 0


def test_windows_at_is_a_pure_function_of_seed_and_epoch():
    n = 1000
    a = order_of(n, 7, 3)
    np.testing.assert_array_equal(a, order_of(n, 7, 3))
    assert not np.array_equal(a, order_of(n, 7, 4)) and not np.array_equal(a, order_of(n, 8, 3))
    assert [window_at(p, n, 7, 3) for p in (0, 499, 999)] == [a[0], a[499], a[999]]
    # any subset of positions, in any shape, gives the same windows as the whole order
    pos_BT = np.array([[5, 900], [17, 0]])
    np.testing.assert_array_equal(windows_at(pos_BT, n, 7, 3), a[pos_BT])


def test_the_order_is_shuffled():
    # not the identity, nor a shift: the windows a batch reads are spread over the data
    n = 10_000
    perm = order_of(n, 0, 0)
    assert np.mean(perm == np.arange(n)) < 0.01
    assert np.abs(np.diff(perm[:100])).mean() > n / 10
    first_batch = perm[:64]
    assert len(np.unique(first_batch // (n // 10))) >= 8  # drawn from most tenths of the data


def test_the_order_needs_no_memory_per_window():
    # 10**12 windows (a 2 * 10**15-token corpus of 2,048-token windows): instant, nothing materialised
    import time
    import tracemalloc

    n, G, W = 10**12, 1024, 8
    tracemalloc.start()
    t0 = time.perf_counter()
    samplers = [WindowSampler(n, G, rank=r, world_size=W, seed=3) for r in range(W)]
    shares = [take(s, 3) for s in samplers]
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 2.0 and peak < 5_000_000
    ref = WindowSampler(n, G, seed=3)
    for b in range(3):
        batch = flat(shares[r][b] for r in range(W))
        assert len(set(batch)) == G and all(0 <= w < n for w in batch)
        assert batch == ref.global_batch(0, b)  # the rank shares cover the global batch, in order
    samplers[0].load_state_dict({"seed": 3, "epoch": 5, "consumed": n - n % G, "order": "feistel-v1"})
    assert samplers[0].next_batch() == windows_at(np.arange(G // W), n, 3, 6).tolist()


def test_a_state_written_before_the_order_had_a_name_resumes_in_its_old_order():
    # The state as the sampler wrote it before "order" existed (tests/data/run_v1_step2's meta holds one):
    # the run goes on in the PCG64 permutation it began with, and says so in its next state.
    n, G = 50, 8
    old = {"seed": 1337, "epoch": 0, "consumed": 16}
    s = WindowSampler(n, G, seed=1337)
    s.load_state_dict(old)
    assert s.order == "pcg64-perm"
    got = take(s, 6)  # the rest of epoch 0 and into epoch 1
    perm0, perm1 = epoch_permutation(n, 1337, 0), epoch_permutation(n, 1337, 1)
    assert flat(got[:4]) == perm0[16:48].tolist() and flat(got[4:]) == perm1[:16].tolist()
    assert s.state_dict() == {**old, "epoch": 1, "consumed": 16, "order": "pcg64-perm"}
    # and a fresh sampler, or a "feistel-v1" state, is in the new order
    t = WindowSampler(n, G, seed=1337)
    assert t.order == "feistel-v1" and flat(take(t, 2)) == order_of(n, 1337, 0)[:16].tolist()
    t.load_state_dict(s.state_dict())
    assert t.order == "pcg64-perm" and take(t, 1) == [perm1[16:24].tolist()]
    t.load_state_dict({**old, "order": "feistel-v1"})
    assert take(t, 1) == [order_of(n, 1337, 0)[16:24].tolist()]


def test_clone_draws_ahead_without_moving_the_original():
    s = WindowSampler(50, 8, seed=2, order="pcg64-perm")
    take(s, 3)
    ahead = s.clone()
    assert ahead.state_dict() == s.state_dict() and repr(ahead) == repr(s)
    drawn = take(ahead, 5)
    assert s.state_dict()["consumed"] == 24
    assert take(s, 5) == drawn


def test_a_bad_order_is_a_config_error():
    with pytest.raises(ConfigError, match="sampler order must be one of"):
        WindowSampler(50, 8, order="random")
