"""The optional sinks, run for real: TensorBoard's event file and W&B's offline run file are read back
and hold the scalars and steps of metrics.jsonl."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from test_logging import quiet_logger


def _train_three_steps(run_dir: Path) -> list[dict]:
    log = quiet_logger(run_dir)
    log.event(0, "start", "fresh run")
    for step, loss in ((1, 3.0), (2, 2.5), (3, 2.25)):
        log.log_step(
            step, loss=loss, lr=0.01 * step, grad_norm=1.0, tokens_processed=64, tokens_total=64 * step
        )
    log.log_eval(3, 192, {"val_loss": 2.4, "val_ppl": 11.0})
    log.close()
    text = (run_dir / "metrics.jsonl").read_text(encoding="utf-8")
    return [r for r in map(json.loads, text.splitlines()) if r["kind"] != "event"]


def _expected(rows: list[dict], keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k in keys:
            if k in r:
                out.setdefault(f"{r['kind']}/{k}", []).append((r["step"], float(r[k])))
    return out


def test_tensorboard_event_file_holds_the_rows_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = _train_three_steps(tmp_path)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    keys = ("loss", "lr", "tokens", "val_loss", "val_ppl")
    got = {
        tag: [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars(tag)]
        for tag in _expected(rows, keys)
    }
    assert got == _expected(rows, keys) and len(got["train/loss"]) == 3


def test_tensorboard_creates_nothing_before_the_first_row(tmp_path):
    pytest.importorskip("tensorboard")
    log = quiet_logger(tmp_path)
    log.event(0, "error", "refused: the checkpoint does not fit this model")  # what a refused start logs
    log.close()
    assert not (tmp_path / "tb").exists()


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B `.wandb` run file: a 7-byte header, then 32 KiB blocks of records, each a
    7-byte header (crc32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0 or pos + 7 + length > len(data):  # the end, or a record still being written
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            out.append(pending)
    return out


@pytest.mark.slow
def test_wandb_offline_run_file_holds_the_rows_of_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "mamba3lite-test")
    (tmp_path / "wb").mkdir()
    rows = _train_three_steps(tmp_path / "run")
    (run_file,) = (tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb")
    records: list = []
    deadline = time.monotonic() + 60
    # W&B's service process writes the file after `finish` returns: read it once its exit record is in.
    while "exit" not in [r.WhichOneof("record_type") for r in records] and time.monotonic() < deadline:
        time.sleep(0.2)
        records = [pb.Record.FromString(raw) for raw in _wandb_records(run_file)]
    got: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
        }
        for key, value in items.items():
            if key.startswith(("train/", "eval/")):
                got.setdefault(key, []).append((items["_step"], pytest.approx(value, rel=1e-6)))
    keys = ("loss", "lr", "tokens", "val_loss", "val_ppl")
    assert {k: v for k, v in got.items() if k.split("/")[1] in keys} == _expected(rows, keys)
