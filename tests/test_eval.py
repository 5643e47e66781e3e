"""`mamba3lite eval` and `evaluate.evaluate_model`: the trainer's validation number, --json, limits,
and refusing data the model cannot read."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mamba3lite.cli import main
from mamba3lite.data.shards import write_dataset
from mamba3lite.errors import DataError
from mamba3lite.evaluate import evaluate_model
from mamba3lite.pretrained import load_pretrained
from mamba3lite.tokenizer import load_tokenizer
from mamba3lite.train.trainer import Pretrainer
from userside_helpers import make_dataset, save_tiny_checkpoint, tiny_config


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("evaldata") / "ds")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data):
    """A real 2-step run with an evaluation at step 2 (metrics.jsonl holds the trainer's val_loss)."""
    run = tmp_path_factory.mktemp("evalrun") / "run"
    cfg = tiny_config(run, data, max_steps=2, eval_every=2, eval_batches=3, save_every=2)
    Pretrainer(cfg).train()
    return run


def test_equals_the_trainers_validation_loss(trained, data):
    rows = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    val = next(r for r in rows if r["kind"] == "eval")
    loaded = load_pretrained(trained)
    r = evaluate_model(loaded.model, data, max_seq_len=16, batch_size=2, max_batches=3, dtype="fp32")
    assert r.split == "val" and r.windows == 6 and r.tokens == 6 * 16
    assert r.loss == pytest.approx(val["val_loss"], rel=1e-5)
    assert r.bits_per_byte == pytest.approx(val["val_bpb"], rel=1e-5)
    assert r.perplexity == pytest.approx(math.exp(r.loss))


def test_cli_json_is_parsable_and_limits_batches(trained, data, capsys):
    assert main(["eval", "--checkpoint-dir", str(trained), "--data-path", str(data), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["step"] == 2 and full["split"] == "val" and math.isfinite(full["loss"])
    assert {"loss", "perplexity", "bits_per_byte", "tokens", "windows"} <= full.keys()
    args = [
        "eval",
        "--checkpoint-dir",
        str(trained),
        "--data-path",
        str(data),
        "--json",
        "--max-batches",
        "1",
    ]
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["windows"] == 2 and one["tokens"] == 32 < full["tokens"]
    assert main([*args[:-1], "2", "--split", "train"]) == 0
    assert json.loads(capsys.readouterr().out)["split"] == "train"


def test_refuses_another_tokenizer_and_vocab(tmp_path, trained, capsys):
    other_hash = make_dataset(tmp_path / "other", repeats=2, vocab_hash="ab" * 32)
    assert main(["eval", "--checkpoint-dir", str(trained), "--data-path", str(other_hash)]) == 2
    err = capsys.readouterr().err
    assert "vocab hash abababababab" in err and "prepare" in err and "Traceback" not in err

    small = tmp_path / "small_vocab"
    parts = [(split, np.arange(200) % 999, 0, 0) for split in ("train", "val")]
    write_dataset(
        small, parts, vocab_size=1000, eos_id=999, tokenizer={"name": "custom", "vocab_hash": "cd" * 32}
    )
    loaded = load_pretrained(trained)
    with pytest.raises(DataError, match="vocab_size is 1000 but the model's vocab_size is 50257"):
        evaluate_model(loaded.model, small, max_seq_len=16, batch_size=2, vocab_hash=loaded.vocab_hash)


def test_bad_inputs_are_one_line_errors(tmp_path, trained, data, capsys):
    run = save_tiny_checkpoint(tmp_path / "run", step=1)
    cases = [
        (["--checkpoint-dir", str(tmp_path / "none"), "--data-path", str(data)], "does not exist"),
        (["--checkpoint-dir", str(run), "--step", "9", "--data-path", str(data)], "no checkpoint of step 9"),
        (["--checkpoint-dir", str(run), "--data-path", str(tmp_path / "nodata")], "does not exist"),
        (["--checkpoint-dir", str(run), "--data-path", str(data), "--max-batches", "0"], "--max-batches"),
        (["--checkpoint-dir", str(run), "--data-path", str(data), "--batch-size", "0"], "--batch-size"),
    ]
    for args, message in cases:
        assert main(["eval", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err, (args, err)


def test_raw_seed_shards_train_and_eval_with_token_dtype(tmp_path, capsys):
    """The seed pipeline's raw uint32 shards (no manifest): data.token_dtype names their dtype for the
    trainer, and eval takes it from the run's config (or --token-dtype)."""
    raw = tmp_path / "seed_shards"
    raw.mkdir()
    rng = np.random.default_rng(0)
    for k in range(2):
        rng.integers(0, 50257, 200).astype("<u4").tofile(raw / f"shard_{k:04d}.bin")
    run = tmp_path / "run"
    cfg = tiny_config(run, raw, max_steps=2, save_every=2, eval_every=0)
    with pytest.raises(DataError, match=r"shard_0000\.bin.*data\.token_dtype"):
        Pretrainer(cfg).train()
    Pretrainer(cfg.replace("data", token_dtype="uint32")).train()
    capsys.readouterr()  # the trainer's log lines
    assert main(["eval", "--checkpoint-dir", str(run), "--data-path", str(raw), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["split"] == "train" and math.isfinite(r["loss"]) and r["windows"] == (400 - 1) // 16
    args = [
        "eval",
        "--checkpoint-dir",
        str(run),
        "--data-path",
        str(raw),
        "--json",
        "--token-dtype",
        "uint16",
    ]
    assert main(args) == 0  # read as uint16: a different (in-vocabulary) token stream
    assert json.loads(capsys.readouterr().out)["windows"] == (800 - 1) // 16


def test_a_val_split_too_short_for_a_window(tmp_path, trained, capsys):
    """A val split shorter than one window (7 tokens, max_seq_len 16): by default eval falls back to the
    train split (as train and quickstart do) and says so; --split val names the split and the fix."""
    tok = load_tokenizer("gpt2")
    rng = np.random.default_rng(0)
    parts = [("train", rng.integers(0, 50000, 200), 4, 800), ("val", rng.integers(0, 50000, 7), 1, 28)]
    short = tmp_path / "short_val"
    write_dataset(
        short,
        parts,
        vocab_size=50257,
        eos_id=tok.eos_id,
        tokenizer={"name": "gpt2", "vocab_hash": tok.vocab_hash},
    )
    base = ["eval", "--checkpoint-dir", str(trained), "--data-path", str(short), "--json"]
    with pytest.warns(UserWarning, match=r"val split \(7 tokens\) is too short"):
        assert main(base) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["split"] == "train" and out["windows"] == (200 - 1) // 16
    assert main([*base, "--split", "val"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "val split has 7 tokens" in err and "--split train" in err


def test_a_dataset_without_a_val_split_is_evaluated_on_train_with_a_warning(tmp_path, trained, data):
    from mamba3lite.data.shards import Manifest

    m = Manifest.load(data)
    train_only = tmp_path / "train_only"
    tok = load_tokenizer("gpt2")
    ids = np.concatenate([np.fromfile(data / s.path, dtype="<u2") for s in m.split_shards("train")])
    write_dataset(train_only, [("train", ids, 10, 4 * len(ids))], vocab_size=tok.vocab_size,
                  eos_id=tok.eos_id, tokenizer=m.tokenizer)  # fmt: skip
    loaded = load_pretrained(trained)
    with pytest.warns(UserWarning, match="it has no val split; evaluating the train split"):
        r = evaluate_model(
            loaded.model, train_only, max_seq_len=16, batch_size=2, max_batches=1, dtype="fp32"
        )
    assert r.split == "train"
