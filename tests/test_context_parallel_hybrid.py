"""Context parallelism for hybrids (model/context_parallel_attention.py): C pieces of a window whose
attention layers exchange keys and values, and whose Mamba-3 layers pass the state, == one whole window.

Slow: 4 gloo processes train a tiny hybrid (Mamba-3, attention, Mamba-3) on the pieces of a window, at
C = 4 (one group) and C = 2 (two groups of two, each holding the whole window); the loss and every
parameter gradient equal one process's within 1e-5 relative (fp32). The cases cover each attention
option that reaches across pieces: resets at EOS inside a piece and at a piece boundary (rotary
positions restart there), no resets (positions run on across the window), GQA, both rotary styles, the
conv over qkv (d_conv 4; 10, whose reach at C = 4 spans two earlier pieces of 8 tokens; 1, none), the gated
MLP, and activation checkpointing (the recomputed forward repeats the exchange).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from gloo_processes import spawn
from mamba3lite.model.context_parallel import cut_window
from mamba3lite.model.transformer import Mamba3Transformer
from test_context_parallel import loss_and_grads, tiny_config, window

GQA = {"num_heads": 4, "num_heads_kv": 2, "head_dim": 8}
CASES = {
    "resets-gqa-rope-conv-mlp": dict(
        reset_at_eos=True, attn_cfg={**GQA, "rotary_emb_dim": 4, "d_conv": 4, "mlp_dim": 8}
    ),
    "resets-interleaved-rope-conv1": dict(
        reset_at_eos=True,
        attn_cfg={"num_heads": 2, "rotary_emb_dim": 8, "rotary_emb_interleaved": True, "d_conv": 1},
    ),
    # Without resets the conv's taps reach back 9 tokens across pieces of 8, and positions run on.
    "no-resets-gqa-rope-long-conv-ckpt": dict(attn_cfg={**GQA, "rotary_emb_dim": 8, "d_conv": 10}),
}


def hybrid_config(**kw):
    return tiny_config(n_layers=3, attn_layer_idx=(1,), scan_impl="chunked", **kw)


def _worker(rank: int, world: int, out_file: str) -> None:
    # Every rank makes both pair groups (new_group is collective); C = 2 runs on its own pair.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {4: dist.group.WORLD, 2: pairs[rank // 2]}
    x, y = window()
    results = {}
    for name, kw in CASES.items():
        torch.manual_seed(0)
        model = Mamba3Transformer(hybrid_config(**kw)).train()
        model.grad_checkpointing = "ckpt" in name
        ref = loss_and_grads(model, x, y) if rank == 0 else None
        for C, group in groups.items():
            model.set_context_parallel(group)
            piece = dist.get_rank(group)
            loss, grads = loss_and_grads(model, *cut_window(x, y, piece, C))
            for g in grads.values():
                dist.all_reduce(g, group=group)
                g /= C  # the mean over the pieces, as data-parallel averaging does
            loss = float(model.context_parallel.reduce_loss(torch.tensor(loss)))
            results[name, C] = (ref, (loss, grads))
            model.set_context_parallel(None)
    if rank == 0:
        torch.save(results, out_file)


@pytest.mark.slow
def test_a_hybrids_pieces_give_the_loss_and_every_gradient_of_one_process(tmp_path):
    out = tmp_path / "results.pt"
    spawn(4, _worker, str(out))
    results = torch.load(out)
    assert set(results) == {(name, C) for name in CASES for C in (2, 4)}
    for (name, C), ((ref_loss, ref_grads), (loss, grads)) in results.items():
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), (name, C, loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for p, g_ref in ref_grads.items():
            rel = float((grads[p] - g_ref).norm() / g_ref.norm())
            assert g_ref.norm() > 0 and rel <= 1e-5, (name, C, p, rel)
