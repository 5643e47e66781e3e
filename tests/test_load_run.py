"""`RunDir.load` (checkpoint/loaded.py): the one road from a run's step to a model, for load_pretrained
(generate, eval, serve, the quickstart) and export. A step is verified once per load, damaged and missing
checkpoints give the errors they always gave, and the model holds exactly the saved weights."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.cli import main
from mamba3lite.errors import CheckpointError
from mamba3lite.interop.export import export_run
from mamba3lite.interop.hf_export import export_hf
from mamba3lite.model import Mamba3Transformer
from mamba3lite.pretrained import load_pretrained
from mamba3lite.rundir import checkpoint_files
from userside_helpers import save_tiny_checkpoint, tiny_config


@pytest.fixture
def verifications(monkeypatch) -> Counter:
    """step -> how many times the manager's verifier (`status`: sizes, sha256, the meta's digest) ran."""
    counted: Counter = Counter()
    status = CheckpointManager.status

    def counting(self, step, **kw):
        counted[step] += 1
        return status(self, step, **kw)

    monkeypatch.setattr(CheckpointManager, "status", counting)
    return counted


def _corrupt(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _two_steps(tmp_path):
    run = save_tiny_checkpoint(tmp_path / "run", step=3)
    return save_tiny_checkpoint(run, step=6)


@pytest.mark.parametrize(
    "load",
    [
        lambda run, out: RunDir(run).load(),
        lambda run, out: load_pretrained(run),
        lambda run, out: export_run(run, out),
        lambda run, out: export_hf(run, out),
        lambda run, out: main(["generate", "--checkpoint-dir", str(run), "--max-new-tokens", "1"]),
    ],
    ids=["RunDir.load", "load_pretrained", "export", "export_hf", "generate"],
)
def test_each_user_of_a_run_verifies_its_step_once(tmp_path, verifications, load, capsys):
    run = _two_steps(tmp_path)
    load(run, tmp_path / "out")
    assert verifications == {6: 1}, verifications  # the newest step, checked once; step 3 not at all
    verifications.clear()
    _corrupt(checkpoint_files(run, 6)["model"])
    load(run, tmp_path / "out2")
    assert verifications == {6: 1, 3: 1}, verifications  # the damaged newer step, then the one loaded


def test_an_explicit_step_is_verified_once_and_a_damaged_newer_one_is_noted(tmp_path, verifications):
    run = _two_steps(tmp_path)
    assert RunDir(run).load(3).step == 3 and verifications == {3: 1}
    _corrupt(checkpoint_files(run, 6)["model"])
    verifications.clear()
    got = RunDir(run).load()
    assert got.step == 3 and verifications == {6: 1, 3: 1}
    assert any("step 6" in n and "sha256" in n for n in got.notes), got.notes


def test_the_model_holds_the_saved_weights_at_the_asked_or_the_stored_dtype(tmp_path):
    torch.manual_seed(1)
    model = Mamba3Transformer(tiny_config("unused").model).to(torch.bfloat16)
    run = save_tiny_checkpoint(tmp_path / "run", step=2, model=model)
    saved = model.state_dict()
    stored = RunDir(run).load()  # the widest dtype the step stores: bf16, nothing rounded
    assert stored.stored_dtypes["embed.weight"] == torch.bfloat16 and stored.weights == "trained"
    assert not stored.model.training and stored.config.model == tiny_config("unused").model
    wide = RunDir(run).load(None, torch.float32)
    for name, t in saved.items():
        assert stored.model.state_dict()[name].dtype == torch.bfloat16, name
        assert torch.equal(stored.model.state_dict()[name], t), name
        assert torch.equal(wide.model.state_dict()[name], t.float()), name


def test_missing_and_damaged_checkpoints_are_the_same_clear_errors(tmp_path):
    run = _two_steps(tmp_path)
    cases = [
        (tmp_path / "missing", None, "does not exist"),
        (tmp_path, None, "holds no checkpoints"),
        (run, 4, "there is no checkpoint of step 4"),
        (run, -1, "--step must be >= 0"),
    ]
    for path, step, message in cases:
        with pytest.raises(CheckpointError, match=message):
            RunDir(path).load(step)
    _corrupt(checkpoint_files(run, 6)["model"])
    with pytest.raises(CheckpointError, match=r"step 6 .* cannot be loaded: .*model_step_6.*sha256"):
        RunDir(run).load(6)
    checkpoint_files(run, 3)["model"].unlink()
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies: .*model_step_3.* is missing"):
        RunDir(run).load()


def test_a_meta_whose_config_no_longer_validates_is_a_checkpoint_error(tmp_path):
    """The meta's digest vouches for its content, so the config is re-signed here as an older version of
    the code would have written it: verified, yet not a config this version accepts."""
    from mamba3lite.checkpoint.meta import meta_digest

    run = save_tiny_checkpoint(tmp_path / "run", step=3)
    path = checkpoint_files(run, 3)["meta"]
    meta = json.loads(path.read_text())
    meta["config"]["model"]["d_modle"] = 16
    meta["meta_sha256"] = meta_digest(meta)
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"the config saved with step 3 does not validate: .*d_modle"):
        RunDir(run).load()


def test_serve_verifies_and_hashes_the_step_it_serves_once(tmp_path, verifications, monkeypatch, capsys):
    """The walk from `mamba3lite serve` to a served model, run as the command runs (port 0, stopped once
    it has answered one request): each step it looks at is verified once and each of its files hashed
    once, a damaged newer step included, and the step that verified is the one served."""
    pytest.importorskip("fastapi")
    import httpx

    import mamba3lite.checkpoint.verify as verify
    import mamba3lite.serve.server as server_module

    run = _two_steps(tmp_path)
    _corrupt(checkpoint_files(run, 6)["model"])
    hashed: Counter = Counter()
    sha256_file = verify.sha256_file
    monkeypatch.setattr(verify, "sha256_file", lambda path: hashed.update([path.name]) or sha256_file(path))
    servers, answers = [], []
    make_server = server_module.make_server

    def keep(app, sock, grace_s=10.0):
        servers.append(make_server(app, sock, grace_s))
        return servers[-1]

    def ask_then_stop():
        deadline = time.monotonic() + 60
        while not (servers and servers[0].started) and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            port = servers[0].bound_socket.getsockname()[1] if servers else 0
            answers.append(httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=20).json())
        finally:
            if servers:
                servers[0].should_exit = True

    monkeypatch.setattr(server_module, "make_server", keep)
    watcher = threading.Thread(target=ask_then_stop, daemon=True)
    watcher.start()
    argv = [
        "serve",
        "--checkpoint-dir",
        str(run),
        "--port",
        "0",
        "--device",
        "cpu",
        "--shutdown-timeout",
        "1",
    ]
    assert main(argv) == 0
    watcher.join(30)
    assert verifications == {6: 1, 3: 1}, verifications  # the damaged newer step, then the one served
    assert hashed == {"model_step_6.safetensors": 1, "model_step_3.safetensors": 1}, hashed
    assert f"serving {run} step 3 on http://127.0.0.1:" in capsys.readouterr().out
    assert answers and answers[0]["data"][0]["id"] == "run", answers
