"""`mamba3lite inspect` of a checkpoint directory and of a single shard file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mamba3lite.cli import main
from mamba3lite.data.shards import Manifest
from mamba3lite.model import count_parameters
from mamba3lite.rundir import checkpoint_files
from mamba3lite.tokenizer import load_tokenizer
from userside_helpers import make_dataset, save_tiny_checkpoint, tiny_config


@pytest.fixture
def run(tmp_path):
    run = save_tiny_checkpoint(tmp_path / "run", step=4)
    save_tiny_checkpoint(run, step=8)
    return run


def test_checkpoint_directory(run, capsys):
    assert main(["inspect", str(run), "--verify"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.split()[:2] == ["4", "verified"] for line in lines)
    assert any(line.split()[:2] == ["8", "verified"] for line in lines)
    assert "2 of 2 steps loadable; newest: 8" in out
    n_params = count_parameters(tiny_config(run).model)
    assert f"parameters     {n_params:,}" in out
    assert "tokens seen    256" in out  # the meta of step 8 (8 x 32)
    assert "last metrics   step 8, loss 7.5000" in out and "val loss 7.7500" in out
    assert "verified: every checkpoint" in out


def test_a_run_where_no_step_loads_is_described_then_fails(run, capsys):
    """Every step's weights damaged: the table still shows each as BAD, then one error line and a
    non-zero exit, with or without --verify (nothing in it can be resumed, generated or evaluated)."""
    for step in (4, 8):
        path = checkpoint_files(run, step)["model"]
        path.write_bytes(path.read_bytes()[:-3])
    assert main(["inspect", str(run)]) == 2
    captured = capsys.readouterr()
    assert "0 of 2 steps loadable" in captured.out
    assert sum(line.split()[1:2] == ["BAD"] for line in captured.out.splitlines()) == 2
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no step in {run} can be loaded (step 4:"), err
    assert main(["inspect", str(run), "--verify"]) == 2


@pytest.mark.parametrize("kind", ["model", "optim"])
def test_damaged_step_is_named_and_verify_fails(run, capsys, kind):
    path = checkpoint_files(run, 8)[kind]
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    assert main(["inspect", str(run)]) == 0  # describing is not failing...
    out = capsys.readouterr().out
    state = ["BAD"] if kind == "model" else ["weights", "only"]  # generate and eval can still use it
    assert any(line.split()[: 1 + len(state)] == ["8", *state] for line in out.splitlines())
    assert path.name in out
    assert "1 of 2 steps loadable; newest: 4" in out
    assert ("1 more with verified weights only (generate, eval): [8]" in out) == (kind == "optim")
    assert main(["inspect", str(run), "--verify"]) == 2  # ...verifying is
    err = capsys.readouterr().err
    assert err.startswith("error: verification failed: step 8") and "Traceback" not in err


def test_shard_file_of_a_dataset(tmp_path, capsys):
    ds = make_dataset(tmp_path / "ds", repeats=3)
    info = Manifest.load(ds).split_shards("train")[0]
    assert main(["inspect", str(ds / info.path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "uint16 (from" in out and f"tokens       {info.n_tokens:,}" in out
    assert f"documents    {info.n_docs:,} EOS tokens" in out and "matches (sha256 too)" in out
    assert "│ " in out and ("def " in out or "import" in out or "class" in out or "for " in out)
    # A flipped byte: described with a warning; --verify fails naming the file.
    data = bytearray((ds / info.path).read_bytes())
    data[0] ^= 1
    (ds / info.path).write_bytes(bytes(data))
    assert main(["inspect", str(ds / info.path)]) == 0
    assert "DOES NOT MATCH" in capsys.readouterr().out
    assert main(["inspect", str(ds / info.path), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "sha256" in err and info.path.split("/")[-1] in err


def test_seed_format_files_without_manifest(tmp_path, capsys):
    tok = load_tokenizer("gpt2")
    ids = [*tok.encode("def seed_format():\n    return 1\n"), tok.eos_id]
    raw = tmp_path / "raw.bin"
    np.asarray(ids, dtype="<u4").tofile(raw)
    assert main(["inspect", str(raw)]) == 0
    out = capsys.readouterr().out
    assert "uint32 (guessed" in out and f"tokens       {len(ids)}" in out and "def seed_format" in out
    pt = tmp_path / "tokens.pt"
    torch.save(torch.tensor(ids, dtype=torch.int32), pt)
    assert main(["inspect", str(pt)]) == 0
    out = capsys.readouterr().out
    assert "int32 (torch.save'd" in out and "def seed_format" in out


def test_files_that_are_not_token_shards_are_refused_with_the_right_advice(run, tmp_path, capsys):
    """A checkpoint file, another file of a run, a text file and a device are each one error line naming
    what the path is and what to run instead; none is described (or --verified) as a raw token file."""
    text = tmp_path / "notes.txt"
    text.write_text("some notes\nthat are text, not tokens\n")
    no_suffix = tmp_path / "README"
    no_suffix.write_text("plain ASCII text without a suffix\n")
    (run / "config.yaml").write_text("training:\n  max_steps: 8\n")
    cases = [
        (
            checkpoint_files(run, 8)["model"],
            f"is a checkpoint file; inspect its run directory: mamba3lite inspect {run}",
        ),
        (checkpoint_files(run, 4)["optim"], "is a checkpoint file"),
        (checkpoint_files(run, 4)["meta"], "is a checkpoint file"),
        (run / "config.yaml", f"is a file of the run directory {run}"),
        (text, "is a text file, not token shards; prepare it first: mamba3lite prepare --source"),
        (no_suffix, "is a text file"),
        ("/dev/null", "/dev/null is a character device"),
    ]
    for path, message in cases:
        assert main(["inspect", str(path), "--verify"]) == 2, path
        captured = capsys.readouterr()
        err = captured.err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (path, err)
        assert "Traceback" not in err and "raw token file" not in captured.out


def test_verify_of_a_file_no_manifest_lists_does_not_claim_it_verified(tmp_path, capsys):
    raw = tmp_path / "raw.bin"
    np.arange(300, 340, dtype="<u4").tofile(raw)
    assert main(["inspect", str(raw), "--verify"]) == 0
    assert "not verified: no manifest lists this file" in capsys.readouterr().out
    np.full(8, 60000, dtype="<u2").tofile(raw)  # ids beyond GPT-2's vocabulary: not this vocabulary's tokens
    assert main(["inspect", str(raw), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "token id 60000 >= vocab_size" in err and "no manifest lists this file" in err
    assert "re-run `mamba3lite prepare`" not in err


def test_token_dtype_reads_a_raw_file_as_told_and_is_refused_where_the_file_records_its_own(tmp_path, capsys):
    # A uint16 file whose every second id is 0 ("!") reads as valid uint32 ids too: the guess (uint32)
    # halves it, --token-dtype uint16 reads what was written.
    ids = load_tokenizer("gpt2").encode("def f(x):\n    return x\n")
    written = np.column_stack([ids, np.zeros(len(ids), dtype=int)]).ravel()
    raw = tmp_path / "raw.bin"
    written.astype("<u2").tofile(raw)
    assert main(["inspect", str(raw)]) == 0
    out = capsys.readouterr().out
    assert "uint32 (guessed" in out and f"tokens       {len(ids)}\n" in out
    assert main(["inspect", str(raw), "--token-dtype", "uint16"]) == 0
    out = capsys.readouterr().out
    assert "uint16 (--token-dtype)" in out and f"tokens       {2 * len(ids)}\n" in out
    # A size that is not a whole number of the given dtype's tokens: one error line naming the file.
    odd = tmp_path / "odd.bin"
    np.arange(7, dtype="<u2").tofile(odd)
    assert main(["inspect", str(odd), "--token-dtype", "uint32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "odd.bin" in err and "not a multiple of 4 (uint32)" in err
    # A shard listed by a manifest, a torch.save'd tensor and a dataset directory record their dtype.
    ds = make_dataset(tmp_path / "ds", repeats=1)
    shard = ds / Manifest.load(ds).split_shards("train")[0].path
    assert main(["inspect", str(shard), "--token-dtype", "uint16"]) == 0  # the manifest's own dtype: fine
    capsys.readouterr()
    pt = tmp_path / "tokens.pt"
    torch.save(torch.tensor(ids, dtype=torch.int32), pt)
    for path, message in [
        (shard, "which records dtype uint16, not uint32: drop --token-dtype"),
        (pt, "is a torch.save'd tensor, which records its own dtype: drop --token-dtype"),
        (ds, "is a dataset directory, which records its own dtype: drop --token-dtype"),
        (save_tiny_checkpoint(tmp_path / "run", step=1), "is a checkpoint directory, which holds no token"),
    ]:
        assert main(["inspect", str(path), "--token-dtype", "uint32"]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (path, err)


def test_verify_of_seed_format_steps_does_not_claim_hashes_were_checked(tmp_path, capsys):
    from test_checkpoint import _save_seed_format, _trained

    model, opt = _trained()
    _save_seed_format(tmp_path, 5, model, opt)
    assert main(["inspect", str(tmp_path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "except the seed-format steps [5]: their metas record no sizes or hashes" in out
