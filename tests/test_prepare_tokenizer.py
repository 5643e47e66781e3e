"""`prepare --train-tokenizer` through the CLI: its bad input, and every command on the dataset and the
runs trained on it (train copies the tokenizer into the run; generate, eval, inspect, export, import,
--init-from use it; a tokenizer deleted or changed after the fact is one error line naming the fix)."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import yaml

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.cli import main
from test_tokenizer_train import python_docs
from tiny_shapes import TINY_MODEL_SHAPE

pytest.importorskip("tokenizers")

N_IDS = 300


def _corpus(root, docs) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (root / f"m{i}.py").write_text(d)
    return str(root)


def _prepare(src, out, *extra) -> int:
    return main(["prepare", "--source", src, "--out", str(out), "--workers", "0", "--val-fraction", "0.2",
                 *extra])  # fmt: skip


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "value, message",
    [
        ("0", "--train-tokenizer 0 is too small"),
        ("1", "--train-tokenizer 1 is too small"),
        ("257", "at least 258 ids"),  # 256 bytes + EOS, no merge: not a BPE
        ("100000", r"can form only \d+ ids .*; pass --train-tokenizer \d+ or less"),
    ],
)
def test_bad_sizes_are_one_error_line_and_nothing_is_written(tmp_path, capsys, value, message):
    src = _corpus(tmp_path / "corpus", python_docs(30))
    assert _prepare(src, tmp_path / "ds", "--train-tokenizer", value) != 0
    assert re.search(message, _error_line(capsys))
    assert not (tmp_path / "ds").exists()


def test_without_the_tokenizers_package_the_error_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    src = _corpus(tmp_path / "corpus", python_docs(30))
    assert _prepare(src, tmp_path / "ds", "--train-tokenizer", "300") == 2
    assert "pip install 'mamba3lite[hf]'" in _error_line(capsys)
    assert not (tmp_path / "ds").exists()


def test_a_given_tokenizer_and_a_trained_one_are_refused_together(tmp_path, capsys):
    src = _corpus(tmp_path / "corpus", python_docs(30))
    assert _prepare(src, tmp_path / "ds", "--train-tokenizer", "300", "--tokenizer", "gpt2") == 2
    assert "pass one of the two" in _error_line(capsys)
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize(
    "docs, extra, message",
    [
        (python_docs(3), ["--val-fraction", "0.9999"], "all 3 kept documents fell into the val split"),
        (["x", "y = 1"], [], "no document kept of 2 read"),  # both shorter than --min-chars
    ],
    ids=["all-in-val", "empty-corpus"],
)
def test_an_empty_train_split_is_one_error_line(tmp_path, capsys, docs, extra, message):
    src = _corpus(tmp_path / "corpus", docs)
    assert _prepare(src, tmp_path / "ds", "--train-tokenizer", "300", *extra) != 0
    err = _error_line(capsys)
    assert "train split is empty" in err and message in err
    assert not (tmp_path / "ds").exists()


def _config(path, data) -> str:
    cfg = {
        "model": {"vocab_size": N_IDS, "eos_id": 0, **TINY_MODEL_SHAPE},
        "training": {"max_seq_len": 16, "micro_batch_size": 2, "dtype": "fp32", "device": "cpu",
                     "warmup_steps": 1, "lr": 3e-3, "log_every": 1, "eval_every": 0, "progress": False,
                     "save_every": 2, "keep_last_n": 0},
        "data": {"train_data_path": str(data)},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A dataset with its own 300-id BPE, and a run trained 2 steps on it."""
    root = tmp_path_factory.mktemp("trained")
    assert _prepare(_corpus(root / "corpus", python_docs(120)), root / "ds", "--train-tokenizer", "300") == 0
    config = _config(root / "tiny.yaml", root / "ds")
    assert main(["train", "--config", config, "--checkpoint-dir", str(root / "run"), "--max-steps", "2"]) == 0
    return root


def _copy(trained, tmp_path):
    """A private copy of the fixture's dataset and run (tests break them on purpose)."""
    shutil.copytree(trained / "ds", tmp_path / "ds")
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "ds", tmp_path / "run", _config(tmp_path / "tiny.yaml", tmp_path / "ds")


def test_train_copies_the_tokenizer_into_the_run_and_records_it_by_that_name(trained):
    raw = (trained / "ds" / "tokenizer.json").read_bytes()
    assert (trained / "run" / "tokenizer.json").read_bytes() == raw
    meta = CheckpointManager(trained / "run").read_meta(2)
    assert meta["data"]["tokenizer"] == "tokenizer.json" and meta["data"]["vocab_size"] == N_IDS
    assert json.loads((trained / "run" / "run.json").read_text())["data"]["tokenizer"] == "tokenizer.json"


def test_the_run_generates_evaluates_exports_and_imports_without_its_dataset(trained, tmp_path, capsys):
    ds, run, _ = _copy(trained, tmp_path)
    eval_args = ["eval", "--checkpoint-dir", str(run), "--data-path", str(ds), "--json"]
    assert main(eval_args) == 0
    before = json.loads(capsys.readouterr().out)
    shutil.copytree(ds, tmp_path / "kept")  # for the eval after the dataset is gone
    shutil.rmtree(ds)
    assert main(["generate", "--checkpoint-dir", str(run), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["eval", "--checkpoint-dir", str(run), "--data-path", str(tmp_path / "kept"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bits_per_byte"] == before["bits_per_byte"]
    assert main(["eval", "--checkpoint-dir", str(run), "--tasks", "piqa", "--limit", "2"]) == 0
    assert "piqa" in capsys.readouterr().out
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    exported = (tmp_path / "exported" / "tokenizer.json").read_bytes()
    assert exported == (trained / "ds" / "tokenizer.json").read_bytes()
    assert main(["import", str(tmp_path / "exported"), "--out", str(tmp_path / "imported")]) == 0
    assert (tmp_path / "imported" / "tokenizer.json").read_bytes() == exported
    assert main(["generate", "--checkpoint-dir", str(tmp_path / "imported"), "--max-new-tokens", "3"]) == 0


def test_init_from_the_run_trains_on_its_dataset_and_refuses_gpt2_data(trained, tmp_path, capsys):
    ds, run, config = _copy(trained, tmp_path)
    args = ["train", "--config", config, "--init-from", str(run), "--max-steps", "1"]
    assert main([*args, "--checkpoint-dir", str(tmp_path / "new")]) == 0
    assert (tmp_path / "new" / "tokenizer.json").read_bytes() == (ds / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert _prepare(str(trained / "corpus"), tmp_path / "gpt2") == 0
    capsys.readouterr()
    other = ["--set", f"data.train_data_path={tmp_path / 'gpt2'}", "--checkpoint-dir", str(tmp_path / "n2")]
    assert main([*args, *other]) != 0
    assert "tokeniz" in _error_line(capsys)


def test_a_dataset_of_another_trained_tokenizer_of_the_same_size_is_refused(trained, tmp_path, capsys):
    _, run, config = _copy(trained, tmp_path)
    src = _corpus(tmp_path / "other", [*python_docs(120, tag="g"), "class Other:\n    pass\n" * 20])
    assert _prepare(src, tmp_path / "other_ds", "--train-tokenizer", "300") == 0
    capsys.readouterr()
    other = str(tmp_path / "other_ds")
    assert main(["eval", "--checkpoint-dir", str(run), "--data-path", other]) != 0
    assert "tokenizer" in _error_line(capsys)
    resume = ["train", "--config", config, "--checkpoint-dir", str(run), "--max-steps", "4"]
    assert main([*resume, "--set", f"data.train_data_path={other}"]) != 0
    assert "vocab hash" in _error_line(capsys)


def _break(path, how: str) -> None:
    if how == "deleted":
        path.unlink()
    else:
        d = json.loads(path.read_text())
        vocab = d["model"]["vocab"]
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, another vocabulary
        path.write_text(json.dumps(d))


@pytest.mark.parametrize("how", ["deleted", "edited"])
def test_a_dataset_whose_tokenizer_was_deleted_or_edited_is_refused_by_every_command(
    trained, tmp_path, capsys, how
):
    ds, run, config = _copy(trained, tmp_path)
    _break(ds / "tokenizer.json", how)
    fix = "put the original back, or run `mamba3lite prepare` again"
    what = "is not there any more" if how == "deleted" else "changed since the dataset"
    for args in (
        ["train", "--config", config, "--checkpoint-dir", str(tmp_path / "new"), "--max-steps", "1"],
        ["train", "--config", config, "--checkpoint-dir", str(run), "--max-steps", "4"],  # a resume
        ["eval", "--checkpoint-dir", str(run), "--data-path", str(ds)],
        ["inspect", str(ds)],
    ):
        assert main(args) != 0, args
        err = _error_line(capsys)
        assert what in err and fix in err, (args, err)
    assert not (tmp_path / "new").exists() or not list((tmp_path / "new").glob("model_step_*"))


@pytest.mark.parametrize("how", ["deleted", "edited"])
def test_a_run_whose_tokenizer_copy_was_deleted_or_edited_is_refused(trained, tmp_path, capsys, how):
    _, run, _ = _copy(trained, tmp_path)
    _break(run / "tokenizer.json", how)
    what = "not there any more; put it back" if how == "deleted" else "changed since; put the original back"
    assert main(["generate", "--checkpoint-dir", str(run), "--max-new-tokens", "2"]) != 0
    assert what in _error_line(capsys)
    assert main(["eval", "--checkpoint-dir", str(run), "--tasks", "piqa", "--limit", "1"]) != 0
    assert what in _error_line(capsys)
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) != 0
    assert "put" in _error_line(capsys) and not (tmp_path / "exported").exists()
