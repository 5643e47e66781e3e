"""Scenario 6: bad input. Malformed paths, configs (typos, impossible values, wrong types, non-UTF-8,
binary), data (mismatched vocabulary, windows longer than the corpus, empty corpus, binary files),
unwritable directories, a busy run directory, and a disk that fills up part-way. Each: one clear
`error:` line, a non-zero exit, no traceback, and nothing on disk changed (tree hashes before/after).

The CLI cases call `mamba3lite.cli.main` in-process (the dispatcher is what turns errors into one line;
an exception escaping it would fail the test like a traceback would); a few run as real subprocesses."""

from __future__ import annotations

import dataclasses
import errno
import gzip
import json
import os
import shutil
from pathlib import Path

import chaos_harness as H
import pytest

from mamba3lite.checkpoint import CheckpointManager, RunLock
from mamba3lite.cli import main
from mamba3lite.errors import Mamba3LiteError
from mamba3lite.rundir import checkpoint_files

# ------------------------------------------------------------------------------------------ world


@pytest.fixture(scope="module")
def trained_world(tmp_path_factory, chaos_data) -> Path:
    """data/ (the dataset), run/ (a 2-step run: checkpoint 2), good.yaml, text/ (a small text corpus)."""
    w = tmp_path_factory.mktemp("world")
    shutil.copytree(chaos_data, w / "data")
    H.write_config(w / "good.yaml", "data", "run", max_steps=2, eval_every=0)
    rc = _in(w, main, ["train", "--config", "good.yaml"])
    assert rc == 0 and CheckpointManager(w / "run").status(2).verified
    (w / "text").mkdir()
    for i in range(3):
        line = f"document {i}: the quick brown fox jumps over the lazy dog, again and again. "
        (w / "text" / f"doc{i}.txt").write_text(line * 20, encoding="utf-8")
    return w


@pytest.fixture
def world(tmp_path, trained_world) -> Path:
    return Path(shutil.copytree(trained_world, tmp_path / "w"))


def _in(cwd: Path, fn, *args):
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return fn(*args)
    finally:
        os.chdir(old)


def _hash(w: Path) -> dict[str, str]:
    """Tree hashes, except that .lock holds the pid of its last holder (acquiring it is not damage) and
    metrics.jsonl is an append-only log (a refused run may record an error event): for those the text
    itself is kept, and `_same` checks that the old log is a prefix of the new one."""
    out = {}
    for k, v in H.tree_hash(w).items():
        if k.endswith(".lock"):
            continue
        log = k.endswith("metrics.jsonl") and not (w / k).is_symlink()  # a link to /dev/zero is not read
        out[k] = ("log", (w / k).read_text(encoding="utf-8")) if log else v
    return out


def _same(before: dict, after: dict) -> bool:
    if before.keys() != after.keys():
        return False
    for k, v in before.items():
        w = after[k]
        if isinstance(v, tuple):
            if not w[1].startswith(v[1]):
                return False
        elif v != w:
            return False
    return True


def _write(path: Path, content: str | bytes) -> str:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path.name


def _yaml(w: Path, name: str, **training) -> str:
    return H.write_config(w / name, "data", "run2", max_steps=2, eval_every=0, **training).name


def _config_file(content: str | bytes):
    """A case: `train --config b.yaml` with b.yaml holding `content`."""
    return lambda w: ["train", "--config", _write(w / "b.yaml", content)]


def _train(*extra: str) -> list[str]:
    return ["train", "--config", "good.yaml", *extra]


def _empty_corpus(w: Path) -> list[str]:
    """A valid dataset whose train split holds a single token (no window)."""
    from mamba3lite.data.shards import Manifest, write_shard

    d = w / "tiny_data"
    s = write_shard(d, "train/shard_00000.bin", [H.EOS], split="train", n_docs=1, dtype="<u2")
    Manifest(
        vocab_size=H.VOCAB,
        eos_id=H.EOS,
        dtype="uint16",
        tokenizer={"name": "t", "vocab_hash": "a" * 64},
        shards=[s],
    ).save(d)
    return _train("--data-path", "tiny_data", "--checkpoint-dir", "run2")


def _users_dir(w: Path) -> bool:
    """A directory of the user's own files, one named like the config.yaml a run writes."""
    (w / "mine").mkdir()
    _write(w / "mine" / "config.yaml", "model:\n  d_model: 32  # my own notes\n")
    _write(w / "mine" / "notes.txt", "keep me")
    return True


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return str(path)


def _edit_manifest(w: Path, first_field: str) -> list[str]:
    """train on data/ whose manifest.json starts with `first_field` (the rest as written)."""
    p = w / "data" / "manifest.json"
    text = p.read_text(encoding="utf-8")
    p.write_text("{" + first_field + text.split("{", 1)[1], encoding="utf-8")
    return _train("--checkpoint-dir", "run2")


def _link_manifest(w: Path, target: str) -> list[str]:
    p = w / "data" / "manifest.json"
    p.unlink()
    p.symlink_to(target)
    return _train("--checkpoint-dir", "run2")


def _edit_stats(w: Path) -> None:
    p = w / "data" / "manifest.json"
    d = json.loads(p.read_text(encoding="utf-8"))
    d["extra"]["stats"] = {"kept": "many"}
    p.write_text(json.dumps(d), encoding="utf-8")


def _data_tokenizer(w: Path, name: str) -> list[str]:
    """train on data/ whose manifest records the tokenizer `name` (a fresh run directory)."""
    p = w / "data" / "manifest.json"
    d = json.loads(p.read_text(encoding="utf-8"))
    d["tokenizer"]["name"] = name
    p.write_text(json.dumps(d), encoding="utf-8")
    return _train("--checkpoint-dir", "run2")


def _lock_is(w: Path, lock: str, make) -> None:
    """`lock` (a lock file's path under w) replaced by what `make(path)` creates there."""
    p = w / lock
    if p.exists() or p.is_symlink():
        p.unlink()
    make(p)


def _link_to_good_yaml(p: Path) -> None:
    p.symlink_to("../good.yaml")


def _unwritable(w: Path) -> str:
    """A directory nobody may create: under /sys (read-only even for root) or a 0o500 directory."""
    if os.geteuid() == 0:
        assert Path("/sys").is_dir(), "no /sys: cannot make an unwritable path as root"
        return "/sys/mamba3lite-chaos/run"
    ro = w / "readonly"
    ro.mkdir()
    ro.chmod(0o500)
    return str(ro / "run")


# name: (argv builder(world) -> list[str], substring the one error line must hold)
CASES = {
    # paths and presets
    "config-missing": (lambda w: ["train", "--config", "nope.yaml"], "config not found"),
    "preset-typo": (lambda w: ["train", "--config", "tiyn"], "did you mean `tiny`"),
    "data-path-missing": (
        lambda w: _train("--data-path", "nope", "--checkpoint-dir", "run2"),
        "does not exist",
    ),
    "data-path-empty-dir": (
        lambda w: (w / "emptydir").mkdir() or _train("--data-path", "emptydir", "--checkpoint-dir", "run2"),
        "no manifest.json",
    ),
    "data-path-binary-file": (
        lambda w: _train(
            "--data-path", _write(w / "blob.bin", bytes(range(256)) * 8), "--checkpoint-dir", "run2"
        ),
        "dtype is unknown",
    ),
    "checkpoint-dir-is-a-file": (
        lambda w: _train("--checkpoint-dir", _write(w / "afile", "x")),
        "afile is a file, not a directory",
    ),
    "checkpoint-dir-holds-the-users-files": (
        lambda w: _users_dir(w) and _train("--checkpoint-dir", "mine"),
        "mine is not empty (config.yaml, notes.txt) and is not a run directory",
    ),
    "checkpoint-dir-under-a-file": (
        lambda w: _train("--checkpoint-dir", "good.yaml/run"),
        "good.yaml/run: good.yaml is a file, not a directory",
    ),
    "plot-output-under-a-file": (
        lambda w: ["plot", "run", "-o", "good.yaml/x.png"],
        "good.yaml is a file, not a directory",
    ),
    "checkpoint-dir-unwritable": (lambda w: _train("--checkpoint-dir", _unwritable(w)), "mamba3lite-chaos"),
    # config files
    "yaml-syntax-error": (
        _config_file("model: [1, 2\n"),
        "not valid YAML",
    ),
    "yaml-not-utf8": (
        _config_file(b"model:\n  d_model: 32 \xff\xfe\n"),
        "not a UTF-8 text file",
    ),
    "yaml-binary-file": (_config_file(bytes(range(256))), "UTF-8"),
    "yaml-top-level-list": (_config_file("- a\n- b\n"), "mapping"),
    "yaml-unknown-key": (
        _config_file("training:\n  max_step: 5\n"),
        "max_steps",
    ),
    "yaml-wrong-type": (
        _config_file("training:\n  max_steps: ten\n"),
        "training.max_steps",
    ),
    "yaml-impossible-value": (lambda w: ["train", "--config", _yaml(w, "b.yaml", lr=-1.0)], "training.lr"),
    "yaml-nan": (
        _config_file("training:\n  lr: .nan\n"),
        "training.lr must be a finite number",
    ),
    "yaml-betas-wrong-length": (
        _config_file("training:\n  betas: [0.9]\n"),
        "training.betas",
    ),
    # --set overrides
    "set-typo": (lambda w: _train("--set", "training.lrr=1e-3"), "did you mean `lr`"),
    "set-unknown-section": (lambda w: _train("--set", "optimizer.lr=1e-3"), "optimizer"),
    "set-without-value": (lambda w: _train("--set", "training.lr"), "training.lr"),
    "set-wrong-type": (lambda w: _train("--set", "model.d_model=abc"), "model.d_model"),
    "set-zero-batch": (lambda w: _train("--set", "training.micro_batch_size=0"), "training.micro_batch_size"),
    "set-infinite-clip": (lambda w: _train("--set", "training.grad_clip=inf"), "finite"),
    "set-eos-outside-vocab": (lambda w: _train("--set", "model.eos_id=999"), "model.eos_id"),
    "set-heads-do-not-divide": (lambda w: _train("--set", "model.headdim=24"), "headdim"),
    # flags argparse refuses: the same one line (and a return code, not SystemExit, in-process)
    "flag-huge-int": (lambda w: _train("--max-steps", "9" * 5000), "--max-steps: invalid int value"),
    "flag-unknown": (lambda w: _train("--bogus"), "unrecognized arguments: --bogus"),
    "flag-bad-choice": (
        lambda w: ["eval", "--checkpoint-dir", "run", "--split", "test"],
        "--split: invalid choice: 'test'",
    ),
    # resume
    "resume-garbage": (lambda w: _train("--resume", "latest2"), "--resume"),
    "resume-negative": (lambda w: _train("--resume=-3"), "--resume"),
    "resume-missing-step": (lambda w: _train("--resume", "7"), "step 7"),
    "resume-none-over-checkpoints": (lambda w: _train("--resume", "none"), "already holds checkpoints"),
    "resume-other-model": (lambda w: _train("--set", "model.d_model=64"), "do not fit this model"),
    # data against model
    "vocab-mismatch": (
        lambda w: _train("--set", "model.vocab_size=512", "--checkpoint-dir", "run2"),
        "vocab_size",
    ),
    "seq-longer-than-corpus": (
        lambda w: _train("--set", "training.max_seq_len=8192", "--checkpoint-dir", "run2"),
        "max_seq_len",
    ),
    "batch-larger-than-corpus": (
        lambda w: _train("--set", "training.micro_batch_size=200", "--checkpoint-dir", "run2"),
        "fewer than one global batch",
    ),
    "empty-corpus": (_empty_corpus, "no window"),
    "manifest-not-utf8": (
        lambda w: _write(w / "data" / "manifest.json", b"\xff\xfe{}") and _train("--checkpoint-dir", "run2"),
        "manifest.json",
    ),
    # files that are not what they claim (the border reader, mamba3lite/intake.py)
    "data-path-fifo": (
        lambda w: _train("--data-path", _fifo(w / "pipe"), "--checkpoint-dir", "run2"),
        "named pipe",
    ),
    "data-path-split-dir": (
        lambda w: _train("--data-path", "data/train", "--checkpoint-dir", "run2"),
        "is the train split of the prepared dataset",
    ),
    "manifest-huge-int": (
        lambda w: _edit_manifest(w, '"vocab_size": ' + "9" * 5000 + ","),
        "5,000 digits",
    ),
    "manifest-deeply-nested": (
        lambda w: _edit_manifest(w, '"extra": ' + "[" * 100_000 + ","),
        "nested too deeply",
    ),
    "manifest-nan": (lambda w: _edit_manifest(w, '"eos_id": NaN,'), "NaN"),
    "manifest-is-dev-zero": (lambda w: _link_manifest(w, "/dev/zero"), "character device"),
    "manifest-is-a-fifo": (lambda w: _link_manifest(w, _fifo(w / "mpipe")), "named pipe"),
    "yaml-huge-int": (_config_file("model:\n  d_model: " + "9" * 5000 + "\n"), "integer too long"),
    "yaml-deeply-nested": (_config_file("model: " + "[" * 100_000 + "\n"), "nested too deeply"),
    "yaml-is-a-fifo": (lambda w: ["train", "--config", _fifo(w / "c.yaml")], "named pipe"),
    "set-huge-int": (lambda w: _train("--set", "model.d_model=" + "9" * 5000), "model.d_model"),
    "set-deeply-nested": (lambda w: _train("--set", "training.betas=" + "[" * 100_000), "training.betas"),
    # a dataset whose recorded tokenizer `generate` and `eval` would refuse: refused before training
    "data-tokenizer-file-missing": (
        lambda w: _data_tokenizer(w, str(w / "gone" / "tokenizer.json")),
        "tokenizer.json, which is not there any more",
    ),
    "data-tokenizer-of-another-size": (lambda w: _data_tokenizer(w, "gpt2"), "which has 50257 tokens"),
    "inspect-manifest-stats-wrong-type": (
        lambda w: _edit_stats(w) or ["inspect", "data"],
        "extra.stats.kept must be an integer",
    ),
    # prepare and inspect
    "prepare-binary-only": (
        lambda w: (
            (w / "bins").mkdir()
            or (
                _write(w / "bins" / "x.txt", bytes(range(256)) * 20)
                and ["prepare", "--source", "bins", "--out", "out", "--workers", "0"]
            )
        ),
        "empty corpus",
    ),
    "prepare-empty-dir": (
        lambda w: (
            (w / "nothing").mkdir() or ["prepare", "--source", "nothing", "--out", "out", "--workers", "0"]
        ),
        "holds no files",
    ),
    "prepare-missing-source": (
        lambda w: ["prepare", "--source", "nope", "--out", "out", "--workers", "0"],
        "nope",
    ),
    "prepare-unwritable-out": (
        lambda w: [
            "prepare",
            "--source",
            "text",
            "--out",
            _unwritable(w),
            "--workers",
            "0",
            "--min-chars",
            "1",
        ],
        "mamba3lite-chaos",
    ),
    "prepare-over-existing-dataset": (
        lambda w: ["prepare", "--source", "text", "--out", "data", "--workers", "0", "--min-chars", "1"],
        "data",
    ),
    # a lock file is truncated and written: one that is not a plain file is refused, never written through
    "run-lock-links-to-the-users-file": (
        lambda w: _lock_is(w, "run/.lock", _link_to_good_yaml) or _train("--max-steps", "4"),
        "run/.lock is a symbolic link, but the lock file of run must be a regular file",
    ),
    "run-lock-is-a-fifo": (
        lambda w: _lock_is(w, "run/.lock", _fifo) or _train("--max-steps", "4"),
        "run/.lock is a named pipe (FIFO)",
    ),
    "run-lock-is-a-directory": (
        lambda w: _lock_is(w, "run/.lock", Path.mkdir) or _train("--max-steps", "4"),
        "run/.lock is a directory",
    ),
    "prepare-lock-links-to-the-users-file": (
        lambda w: (
            _lock_is(w, "data/.prepare.lock", _link_to_good_yaml)
            or ["prepare", "--source", "text", "--out", "data", "--overwrite", "--workers", "0"]
        ),
        "data/.prepare.lock is a symbolic link",
    ),
    "inspect-missing": (lambda w: ["inspect", "nope"], "does not exist"),
    "plot-run-is-a-fifo": (lambda w: ["plot", _fifo(w / "pipe")], "named pipe (FIFO), not a run directory"),
    "generate-run-is-a-device": (
        lambda w: ["generate", "--checkpoint-dir", "/dev/null"],
        "/dev/null is a character device, not a checkpoint directory",
    ),
    "inspect-random-dir": (lambda w: (w / "emptydir").mkdir() or ["inspect", "emptydir"], "emptydir"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_clear_line_and_changes_nothing(world, capsys, name):
    build, expected = CASES[name]
    argv = build(world)  # creates the bad input itself, so it is part of "before"
    before = _hash(world)
    rc = _in(world, main, argv)
    captured = capsys.readouterr()
    err_lines = [ln for ln in captured.err.splitlines() if ln.startswith("error:")]
    assert rc != 0, (argv, captured.out[-500:], captured.err[-1500:])
    assert "Traceback" not in captured.err + captured.out
    assert len(err_lines) == 1, captured.err
    assert expected in err_lines[0], err_lines[0]
    assert _same(before, _hash(world)), f"{name} changed files on disk"


def _edit_meta(w: Path, first_field: str) -> list[str]:
    """resume run/ whose meta_step_2.json starts with `first_field` (the rest as written)."""
    p = w / "run" / "meta_step_2.json"
    p.write_text("{" + first_field + p.read_text(encoding="utf-8").split("{", 1)[1], encoding="utf-8")
    return _train("--max-steps", "4")


def _link_meta(w: Path, target: str) -> list[str]:
    p = w / "run" / "meta_step_2.json"
    p.unlink()
    p.symlink_to(target)
    return _train("--max-steps", "4")


def _mixture(w: Path, content: str | None) -> list[str]:
    """prepare --mixture m.yaml (a FIFO when content is None)."""
    m = w / "m.yaml"
    _fifo(m) if content is None else _write(m, content)
    return ["prepare", "--mixture", str(m), "--out", "mixout", "--workers", "0", "--min-chars", "1"]


def _edit_meta_keeping_digest(w: Path, edit) -> list[str]:
    """resume run/ after `edit(meta)` with meta_sha256 recomputed the way the manager computes it: only
    the schema check can tell."""
    from mamba3lite.checkpoint.meta import meta_digest

    p = w / "run" / "meta_step_2.json"
    meta = json.loads(p.read_text(encoding="utf-8"))
    edit(meta)
    meta["meta_sha256"] = meta_digest(meta)
    p.write_text(json.dumps(meta), encoding="utf-8")
    return _train("--max-steps", "4")


def _resume_older_with_metrics(w: Path, bad_line: str) -> list[str]:
    """run/ trained on to step 4, then `--resume 2` (which moves step 4 aside) with a bad metrics row."""
    assert _in(w, main, _train("--max-steps", "4", "--set", "training.save_every=2")) == 0
    with open(w / "run" / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(bad_line + "\n")
    return _train("--max-steps", "4", "--resume", "2")


def _link(w: Path, rel: str, target: str) -> list[str]:
    p = w / rel
    p.unlink(missing_ok=True)
    p.symlink_to(target)
    return _train("--max-steps", "4")


# The sites of the refactored files (checkpoint/, trainer, data/mixture.py and staging): all through
# mamba3lite/intake.py.
PHASE2 = {
    "meta-huge-int": (lambda w: _edit_meta(w, '"tokens_seen": ' + "9" * 5000 + ","), "meta_step_2.json"),
    "meta-deeply-nested": (lambda w: _edit_meta(w, '"x": ' + "[" * 100_000 + ","), "meta_step_2.json"),
    "meta-is-dev-zero": (lambda w: _link_meta(w, "/dev/zero"), "character device"),
    "meta-config-model-a-string": (
        lambda w: _edit_meta_keeping_digest(w, lambda m: m["config"].update(model="tiny")),
        "config.model must be an object",
    ),
    "meta-files-not-a-mapping": (
        lambda w: _edit_meta_keeping_digest(w, lambda m: m.update(files=[1, 2])),
        "files must be an object",
    ),
    "weights-header-length-huge": (
        lambda w: (
            _patch_bytes(w / "run" / "model_step_2.safetensors", b"\xff" * 8) or _train("--resume", "2")
        ),
        "model_step_2.safetensors",
    ),
    "metrics-is-dev-zero": (lambda w: _link(w, "run/metrics.jsonl", "/dev/zero"), "character device"),
    "run-json-is-dev-zero": (lambda w: _link(w, "run/run.json", "/dev/zero"), "character device"),
    "run-json-starts-a-string": (
        lambda w: _write(w / "run" / "run.json", '{"starts": "often"}') and _train("--max-steps", "4"),
        "starts must be a list",
    ),
    "resume-older-metrics-huge-int": (
        lambda w: _resume_older_with_metrics(w, '{"kind": "train", "step": ' + "9" * 5000 + "}"),
        "metrics.jsonl line",
    ),
    "resume-older-metrics-deeply-nested": (
        lambda w: _resume_older_with_metrics(w, '{"kind": "train", "step": 3, "x": ' + "[" * 100_000 + "}"),
        "nested too deeply",
    ),
    "resume-older-metrics-null-loss": (
        lambda w: _resume_older_with_metrics(w, '{"kind": "train", "step": 3, "loss": null}'),
        "loss must be a number",
    ),
    # the other readers of a run: the same meta check, the same one line
    "generate-meta-deeply-nested": (
        lambda w: _edit_meta(w, '"x": ' + "[" * 100_000 + ",") and ["generate", "--checkpoint-dir", "run"],
        "nested too deeply",
    ),
    "eval-meta-huge-int": (
        lambda w: (
            _edit_meta(w, '"tokens_seen": ' + "9" * 5000 + ",")
            and ["eval", "--checkpoint-dir", "run", "--data-path", "data"]
        ),
        "5,000 digits",
    ),
    "eval-meta-config-model-a-string": (
        lambda w: (
            _edit_meta_keeping_digest(w, lambda m: m["config"].update(model="tiny"))
            and ["eval", "--checkpoint-dir", "run", "--step", "2", "--data-path", "data"]
        ),
        "config.model must be an object",
    ),
    "mixture-is-a-fifo": (lambda w: _mixture(w, None), "named pipe"),
    "mixture-is-dev-zero": (
        lambda w: (w / "m.yaml").symlink_to("/dev/zero") or _mixture_args(w),
        "character device",
    ),
    "mixture-huge-int": (
        lambda w: _mixture(w, "sources:\n  - source: text\n    weight: " + "9" * 5000 + "\n"),
        "m.yaml",
    ),
    "mixture-deeply-nested": (lambda w: _mixture(w, "sources: " + "[" * 100_000 + "\n"), "m.yaml"),
    "prepare-out-holds-the-users-files": (
        lambda w: (
            _users_dir(w)
            and ["prepare", "--source", "text", "--out", "mine", "--overwrite", "--workers", "0"]
        ),
        "mine is not empty (config.yaml, notes.txt) and is not a mamba3lite dataset",
    ),
}


def _patch_bytes(path: Path, head: bytes) -> None:
    data = path.read_bytes()
    path.write_bytes(head + data[len(head) :])


def _mixture_args(w: Path) -> list[str]:
    return [
        "prepare",
        "--mixture",
        str(w / "m.yaml"),
        "--out",
        "mixout",
        "--workers",
        "0",
        "--min-chars",
        "1",
    ]


@pytest.mark.parametrize("name", sorted(PHASE2))
def test_phase2_bad_input_is_one_clear_line(world, capsys, name):
    build, expected = PHASE2[name]
    argv = build(world)
    before = _hash(world)
    rc = _in(world, main, argv)
    captured = capsys.readouterr()
    err_lines = [ln for ln in captured.err.splitlines() if ln.startswith("error:")]
    assert rc != 0 and "Traceback" not in captured.err and len(err_lines) == 1, captured.err
    assert expected in err_lines[0], err_lines[0]
    assert _same(before, _hash(world))


def test_inspect_reports_a_meta_that_is_a_device_as_bad_without_reading_it(world, capsys):
    """`inspect RUN` is a report: a damaged step is listed as BAD with the reason (one line per step),
    and /dev/zero behind the meta's name is never read. The run's only step is that one, so nothing
    in it can be used: after the report, one error line and a non-zero exit."""
    _link_meta(world, "/dev/zero")
    assert _in(world, main, ["inspect", "run"]) == 2
    captured = capsys.readouterr()
    out = captured.out
    assert "BAD" in out and "meta_step_2.json is a character device" in out and "0 of 1 steps loadable" in out
    assert captured.err.startswith("error: no step in ") and len(captured.err.strip().splitlines()) == 1


def test_phase2_mixture_accepts_exponent_weights_as_the_flags_do(world):
    argv = _mixture(world, "sources:\n  - source: text\n    weight: 5e-1\ntarget_tokens: 1e6\n")
    assert _in(world, main, argv) == 0


def test_enough_distinct_bad_inputs():
    assert len(CASES) >= 25


# ------------------------------------------------------------------------------------ subprocess


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["yaml-not-utf8", "vocab-mismatch", "checkpoint-dir-unwritable", "resume-other-model"]
)
def test_bad_input_through_a_real_process(world, name):
    """The same contract end to end: the process exits non-zero with one error line, no traceback."""
    import subprocess
    import sys

    build, expected = CASES[name]
    argv = build(world)
    before = _hash(world)
    r = subprocess.run(
        [sys.executable, "-m", "mamba3lite", *argv],
        cwd=world,
        capture_output=True,
        text=True,
        env={**os.environ, **H.BASE_ENV},
        timeout=H.PATIENCE_S,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert expected in r.stderr
    assert _same(before, _hash(world))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["data-path-fifo", "manifest-is-a-fifo", "yaml-is-a-fifo", "mixture-is-a-fifo"]
)
def test_a_pipe_as_input_ends_a_real_process_at_once(world, name):
    """Nobody writes to these pipes: a command that opened one would block (SIGTERM could not end it).
    Each is refused before it is opened: one error line, well within the time of a few imports."""
    import subprocess
    import sys
    import time

    build, expected = (CASES | PHASE2)[name]
    argv = build(world)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "mamba3lite", *argv],
        cwd=world,
        capture_output=True,
        text=True,
        env={**os.environ, **H.BASE_ENV},
        timeout=120,  # a blocked open would sit here; the refusal takes the time of the imports
    )
    err_lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(err_lines) == 1, r.stderr
    assert expected in err_lines[0]
    assert time.monotonic() - t0 < 60


# -------------------------------------------------------------------------------------- library


LIBRARY = {
    "dataset-without-path": lambda w: __import__("mamba3lite.data", fromlist=["x"]).PretrainDataset(
        None, 32, H.VOCAB
    ),
    "dataset-zero-window": lambda w: __import__("mamba3lite.data", fromlist=["x"]).PretrainDataset(
        w / "data", 0, H.VOCAB
    ),
    "dataset-wrong-vocab": lambda w: __import__("mamba3lite.data", fromlist=["x"]).PretrainDataset(
        w / "data", 32, 100
    ),
    "manifest-of-a-binary-file": lambda w: __import__("mamba3lite.data.shards", fromlist=["x"]).Manifest.load(
        Path(_write(w / "manifest.json", bytes(range(256)))).resolve()
    ),
    "checkpoint-missing-step": lambda w: CheckpointManager(w / "run").load(99),
    "config-bad-overrides": lambda w: __import__("mamba3lite.config", fromlist=["x"]).load_config(
        w / "good.yaml", ["training.lr=fast"]
    ),
    "trainer-bad-resume": lambda w: __import__("mamba3lite.train.trainer", fromlist=["x"]).Pretrainer(
        __import__("mamba3lite.config", fromlist=["x"]).load_config(w / "good.yaml"), resume="sometimes"
    ),
    "shard-ids-too-big-for-dtype": lambda w: __import__("mamba3lite.data.shards", fromlist=["x"]).write_shard(
        w / "data2", "train/x.bin", [70000], split="train", n_docs=1, dtype="<u2"
    ),
}


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_bad_input_raises_a_named_error(world, name):
    before = _hash(world)
    with pytest.raises(Mamba3LiteError) as info:
        _in(world, LIBRARY[name], world)
    assert str(info.value).strip()
    after = _hash(world)
    if name == "manifest-of-a-binary-file":  # the bad input itself is the only new file
        after.pop("manifest.json", None)
    assert _same(before, after)


# ------------------------------------------------------------------------------------- full disk


class FullDisk:
    """`os.fdopen` whose write-mode files accept `budget` bytes in total, then raise ENOSPC part-way
    through a write (after writing what fits), as a filling disk does. Every atomic write in the
    package (checkpoints, shards, manifests, run records) goes through os.fdopen."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.failed = 0
        self._fdopen = os.fdopen

    def fdopen(self, fd, mode="r", *args, **kwargs):
        f = self._fdopen(fd, mode, *args, **kwargs)
        return _Limited(f, self) if "w" in mode or "a" in mode else f


class _Limited:
    def __init__(self, f, disk: FullDisk) -> None:
        self._f, self._disk = f, disk

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = min(len(view), self._disk.left)
        self._f.write(view[:n])
        self._disk.left -= n
        if n < len(view):
            self._disk.failed += 1
            self._f.flush()  # the partial bytes really are in the file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def _no_temp_files(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*.tmp")]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 3000, 40_000, 150_000, 300_000])
def test_disk_full_during_training_keeps_the_last_checkpoint(world, capsys, monkeypatch, budget):
    """The disk fills at a different point for each budget (run records, model file, optimizer file,
    meta). The run stops with one error line; checkpoint 2 is byte-identical and verified; nothing
    partial is visible under a final name; with space again, the run resumes and ends at the reference
    of an uninterrupted run."""
    run = world / "run"
    step2 = {k: H.tree_hash(run)[p.name] for k, p in checkpoint_files(run, 2).items()}
    disk = FullDisk(budget)
    monkeypatch.setattr(os, "fdopen", disk.fdopen)
    rc = _in(world, main, _train("--max-steps", "4"))
    monkeypatch.undo()
    captured = capsys.readouterr()
    assert disk.failed, "the disk never filled: the budget is too large for this scenario"
    assert rc != 0 and "Traceback" not in captured.err
    err = [ln for ln in captured.err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "No space left on device" in err[0], captured.err
    assert {k: H.tree_hash(run)[p.name] for k, p in checkpoint_files(run, 2).items()} == step2
    mgr = CheckpointManager(run)
    assert mgr.latest_step() == 2
    assert not _no_temp_files(world)
    assert not checkpoint_files(run, 4)["meta"].exists()
    json.loads((run / "run.json").read_text())  # records are whole (old or new), never torn
    # Space again: resume from 2, finish, equal to a run that never saw a full disk.
    assert _in(world, main, _train("--max-steps", "4")) == 0
    ref = world / "ref"
    shutil.copytree(run, ref, ignore=shutil.ignore_patterns("*_step_4.*", "superseded"))
    assert _in(world, main, _train("--max-steps", "4", "--checkpoint-dir", "ref", "--resume", "2")) == 0
    assert H.weights_identical(H.final_weights(run, 4), H.final_weights(ref, 4))


@pytest.mark.parametrize("budget", [0, 20, 2000])
def test_disk_full_during_prepare_keeps_the_existing_dataset(world, capsys, monkeypatch, budget):
    """`prepare --overwrite` onto an existing dataset with a disk that fills while staging: an error
    line, the old dataset still verifies byte for byte, and no new file appears under a final name."""
    before = {k: v for k, v in H.tree_hash(world / "data").items() if not k.startswith(".")}
    disk = FullDisk(budget)
    monkeypatch.setattr(os, "fdopen", disk.fdopen)
    argv = [
        "prepare",
        "--source",
        "text",
        "--out",
        "data",
        "--overwrite",
        "--workers",
        "0",
        "--min-chars",
        "1",
    ]
    argv += ["--shard-tokens", "200"]
    rc = _in(world, main, argv)
    monkeypatch.undo()
    captured = capsys.readouterr()
    assert disk.failed and rc != 0 and "Traceback" not in captured.err, captured.err
    assert "No space left on device" in captured.err
    after = {k: v for k, v in H.tree_hash(world / "data").items() if not k.startswith(".")}
    assert after == before
    assert _in(world, main, ["inspect", "data", "--verify"]) == 0


def test_run_directory_in_use_is_refused_and_untouched(world, capsys):
    before = _hash(world)
    with RunLock(world / "run"):
        rc = _in(world, main, _train("--max-steps", "4"))
    captured = capsys.readouterr()
    assert rc != 0 and "in use by another trainer" in captured.err and "Traceback" not in captured.err
    assert _same(before, _hash(world))


@pytest.mark.parametrize("name", ["big.txt", "big.jsonl", "big.jsonl.gz"])
def test_prepare_refuses_a_document_too_large_to_hold_without_reading_it(world, capsys, monkeypatch, name):
    """A text file is one document and a JSONL line one document, each read whole into a tokenizer
    worker: a 10 GiB text file, or a JSONL line with no newline in gigabytes (a .gz inflating to one),
    ran prepare out of memory. Past the caps (shrunk here to keep the files small) it is one error line
    naming the file, before anything is written to --out."""
    from mamba3lite import intake

    monkeypatch.setattr(
        intake, "SOURCE_DOCUMENT", dataclasses.replace(intake.SOURCE_DOCUMENT, max_bytes=4096)
    )
    monkeypatch.setattr(intake, "MAX_SOURCE_LINE_BYTES", 4096)
    body = b'{"text": "' + b"a" * 10_000 + b'"}\n' if "jsonl" in name else b"word " * 2000
    (world / name).write_bytes(gzip.compress(body) if name.endswith(".gz") else body)
    before = _hash(world)
    rc = _in(world, main, ["prepare", "--source", name, "--out", "big_out", "--workers", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.count("error:") == 1, err
    # the work unit that read it names itself, then the file
    assert f"error: unit 000-000000 ({name}): {name}" in err, err
    assert "longer than" in err or "more than a text source file" in err, err
    assert _same(before, _hash(world)) and not (world / "big_out").exists()
