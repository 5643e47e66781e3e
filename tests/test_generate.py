"""`mamba3lite generate` and `generation.generate_text`: determinism, EOS and limit stops, streaming,
tokens/s, and clear errors for every bad checkpoint input."""

from __future__ import annotations

import pytest
import torch

from mamba3lite.cli import main
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.generation import generate_text
from mamba3lite.pretrained import load_pretrained
from mamba3lite.rundir import checkpoint_files
from mamba3lite.tokenizer import load_tokenizer
from userside_helpers import eos_model, save_tiny_checkpoint


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "run", step=5)


@pytest.fixture(scope="module")
def loaded(run_dir):
    return load_pretrained(run_dir)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("gpt2")


def test_same_seed_same_text_other_seed_other_text(loaded, tok):
    a = generate_text(loaded.model, tok, "def ", max_new_tokens=12, seed=3)
    b = generate_text(loaded.model, tok, "def ", max_new_tokens=12, seed=3)
    c = generate_text(loaded.model, tok, "def ", max_new_tokens=12, seed=4)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids  # 12 draws from ~50k tokens: equal only if seeding were ignored


def test_stops_at_the_limit_and_streams_the_same_text(loaded, tok):
    pieces: list[str] = []
    r = generate_text(
        loaded.model, tok, "import", max_new_tokens=9, seed=0, on_text=pieces.append, token_healing=False
    )
    assert r.new_tokens == 9 and len(r.token_ids) == 9 and not r.stopped_at_eos
    assert "".join(pieces) == r.text == tok.decode(r.token_ids)
    assert r.prompt_tokens == 1 + len(tok.encode("import"))  # EOS (document start) + the prompt
    assert r.tokens_per_s > 0


class _Scripted(torch.nn.Module):
    """A stand-in model whose decode puts all probability on a fixed list of token ids, in order (then
    on EOS): the prefill's logits pick the first, each step's the next."""

    def __init__(self, ids: list[int], eos_id: int = 50256) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.cfg = type("Cfg", (), {"vocab_size": 50257})()
        self.ids, self.eos_id = ids, eos_id

    def _logits(self, cache: list) -> torch.Tensor:
        logits = torch.full((1, self.cfg.vocab_size), -1e9)
        logits[0, self.ids[cache[0]] if cache[0] < len(self.ids) else self.eos_id] = 0.0
        cache[0] += 1
        return logits

    def allocate_cache(self, batch_size, max_len=None, device=None):
        return [0]

    def prefill(self, input_ids, cache):
        return self._logits(cache), cache

    def step(self, token, cache):
        return self._logits(cache)


def test_streaming_holds_split_characters_back_and_decodes_each_token_once(tok):
    ids = tok.encode("café 👍🏽 ok 中文") * 12  # emoji and CJK characters split across byte tokens
    decoded = []
    counting = type("Tok", (), {"eos_id": tok.eos_id, "bos_id": tok.bos_id, "encode": tok.encode})()
    counting.decode = lambda xs: decoded.append(len(xs)) or tok.decode(xs)
    pieces: list[str] = []
    r = generate_text(_Scripted(ids), counting, "", max_new_tokens=len(ids), on_text=pieces.append)
    assert "".join(pieces) == r.text == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # a piece never ends (or starts) inside a character
    # linear, not quadratic (~len(ids)²/2, over 15x the bound at these 156 tokens): each step decodes the
    # tokens since the last piece and, as context, the previous piece's tokens
    assert len(ids) > 150 and sum(decoded) < 5 * len(ids)


def test_stops_at_eos(tok):
    model = eos_model()
    r = generate_text(model, tok, "def f():", max_new_tokens=50, temperature=1.0, seed=0, token_healing=False)
    assert r.stopped_at_eos and r.new_tokens == 1 and r.text == "" and r.token_ids == []


def test_greedy_matches_a_full_forward(loaded, tok):
    # temperature 0: each new token is the argmax of the full-sequence forward pass (prefill + step
    # decoding agrees with the parallel forward).
    r = generate_text(loaded.model, tok, "x = ", max_new_tokens=5, temperature=0, token_healing=False)
    ids = [tok.eos_id, *tok.encode("x = ")]
    for t in r.token_ids:
        with torch.no_grad():
            logits = loaded.model(torch.tensor([ids]))[0, -1]
        assert int(logits.argmax()) == t
        ids.append(t)


@pytest.mark.parametrize(
    "kw, flag",
    [
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"temperature": -1}, "--temperature"),
        ({"top_k": 0}, "--top-k"),
        ({"top_p": 1.5}, "--top-p"),
        ({"seed": -1}, "--seed"),
        ({"seed": 2**63}, "--seed"),
    ],
)
def test_bad_sampling_arguments(loaded, tok, kw, flag):
    with pytest.raises(ConfigError, match=flag):
        generate_text(loaded.model, tok, "a", **kw)


def test_cli_streams_reports_tokens_per_s_and_is_deterministic(run_dir, capsys):
    args = [
        "generate",
        "--checkpoint-dir",
        str(run_dir),
        "--prompt",
        "def ",
        "--max-new-tokens",
        "8",
        "--seed",
        "7",
    ]
    assert main(args) == 0
    a = capsys.readouterr()
    assert main(args) == 0
    b = capsys.readouterr()
    assert a.out == b.out and a.out.startswith("def ")
    assert "tokens/s" in a.err and "stopped at the limit of 8 tokens" in a.err and "step 5" in a.err
    assert main([*args, "--no-stream"]) == 0
    assert capsys.readouterr().out == a.out


@pytest.mark.slow
def test_cli_in_a_subprocess(cli, run_dir):
    r = cli("generate", "--checkpoint-dir", str(run_dir), "--prompt", "x", "--max-new-tokens", "3")
    assert r.returncode == 0 and r.stdout.startswith("x") and "tokens/s" in r.stderr, r.stderr


def test_load_pretrained_rebuilds_the_trained_model(run_dir, loaded):
    assert loaded.step == 5 and loaded.tokens_seen == 160 and loaded.config.model.d_model == 16
    assert loaded.load_tokenizer().vocab_size == 50257
    assert not loaded.model.training


def test_newest_step_deleted_by_a_running_trainings_retention_is_chosen_again(tmp_path, monkeypatch):
    from mamba3lite.checkpoint import CheckpointManager

    run = save_tiny_checkpoint(tmp_path / "run", step=3)
    save_tiny_checkpoint(run, step=4)
    status = CheckpointManager.status

    def retention_strikes(self, step, **kw):
        st = status(self, step, **kw)
        if step == 4 and st.loadable:  # chosen and verified, about to be loaded
            self.delete(4)  # as `keep_last_n` does right after the next save
        return st

    monkeypatch.setattr(CheckpointManager, "status", retention_strikes)
    loaded = load_pretrained(run)
    assert loaded.step == 3 and any("step 4 was removed while loading" in n for n in loaded.notes)


def _corrupt(run_dir, step):
    path = checkpoint_files(run_dir, step)["model"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def test_bad_checkpoint_inputs_are_clear_errors(tmp_path, capsys):
    run = save_tiny_checkpoint(tmp_path / "run", step=3)
    save_tiny_checkpoint(run, step=6)
    cases = [
        (["--checkpoint-dir", str(tmp_path / "missing")], "does not exist"),
        (["--checkpoint-dir", str(tmp_path)], "holds no checkpoints"),
        (["--checkpoint-dir", str(run), "--step", "4"], "no checkpoint of step 4"),
        (["--checkpoint-dir", str(run), "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--checkpoint-dir", str(run), "--seed", "99999999999999999999999"], "--seed must be in [0, 2**63)"),
        (["--checkpoint-dir", str(run), "--device", "tpu"], "--device must be"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--checkpoint-dir", str(run), "--device", "cuda"], "CUDA is not available"))
    for args, message in cases:
        assert main(["generate", *args, "--prompt", "x"]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err, (args, err)
    bad = _corrupt(run, 6)
    assert main(["generate", "--checkpoint-dir", str(run), "--step", "6", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert bad.name in err and "sha256" in err
    # Without --step the newest VERIFIED checkpoint is used, and the skipped one is named.
    assert main(["generate", "--checkpoint-dir", str(run), "--prompt", "x", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "step 3" in err and "step 6" in err
    _corrupt(run, 3)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies"):
        load_pretrained(run)


def test_streamed_text_keeps_the_spaces_of_a_sentencepiece_style_tokenizer(tmp_path):
    """A Metaspace decoder drops the ▁-space of the first word of whatever it decodes: pieces decoded on
    their own came out glued ("the quickthethe..."). Each piece is now decoded after its context."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {f"▁{w}": i for i, w in enumerate(["the", "quick", "brown", "fox", "jumps"])} | {"</s>": 5}
    t = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    t.add_special_tokens(["</s>"])
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    path = tmp_path / "tokenizer.json"
    t.save(str(path))
    tok = load_tokenizer(str(path))
    assert tok.decode(tok.encode("the quick")) == "the quick" and tok.decode([0]) == "the"
    pieces: list[str] = []
    scripted = [2, 3, 4, 0, 1]
    r = generate_text(_Scripted(scripted), tok, "the quick", max_new_tokens=5, on_text=pieces.append)
    assert r.text == "".join(pieces) == " brown fox jumps the quick"
    assert pieces == [" brown", " fox", " jumps", " the", " quick"]


def test_a_temperature_too_small_for_the_logits_is_greedy_not_a_crash(loaded, tok):
    greedy = generate_text(loaded.model, tok, "x", max_new_tokens=4, temperature=0)
    tiny = generate_text(loaded.model, tok, "x", max_new_tokens=4, temperature=1e-30, seed=5)  # the smallest
    assert tiny.token_ids == greedy.token_ids


def test_an_edited_meta_is_refused_before_a_model_is_built_from_it(tmp_path, monkeypatch):
    # An explicit --step used to build the model from the meta's config first (verifying afterwards):
    # an edited shape could ask for any amount of memory.
    import json

    import mamba3lite.model as model_pkg

    run = save_tiny_checkpoint(tmp_path / "run", step=3)
    meta_path = checkpoint_files(run, 3)["meta"]
    meta = json.loads(meta_path.read_text())
    meta["config"]["model"]["d_model"] = 65536
    meta_path.write_text(json.dumps(meta))
    built = []
    monkeypatch.setattr(model_pkg, "Mamba3Transformer", lambda cfg: built.append(cfg) or 1 / 0)
    with pytest.raises(CheckpointError, match="content differs from its meta_sha256"):
        load_pretrained(run, step=3)
    assert built == []


def test_weights_without_their_optimizer_file_still_generate(tmp_path, capsys):
    run = save_tiny_checkpoint(tmp_path / "run", step=3)
    checkpoint_files(run, 3)["optim"].unlink()  # deleted to save space: 2x the weights
    assert load_pretrained(run).step == 3 and load_pretrained(run, step=3).step == 3
    assert main(["generate", "--checkpoint-dir", str(run), "--max-new-tokens", "2", "--no-stream"]) == 0


def test_a_run_whose_tokenizer_file_is_gone_says_to_put_it_back(tmp_path):
    run = save_tiny_checkpoint(tmp_path / "run", step=3)
    loaded = load_pretrained(run)
    loaded.tokenizer_name = str(tmp_path / "moved" / "tokenizer.json")
    with pytest.raises(CheckpointError, match="is not there any more; put it back at that path") as e:
        loaded.load_tokenizer()
    assert "--tokenizer" not in str(e.value)


@pytest.mark.parametrize("kw", [{"temperature": 1e-300}, {"temperature": float("inf")}, {"top_p": 1e-300}])
def test_sampling_values_that_are_zero_or_infinite_in_float32_are_refused(loaded, tok, kw):
    with pytest.raises(ConfigError, match=r"--temperature|--top-p"):
        generate_text(loaded.model, tok, "x", max_new_tokens=2, **kw)


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_checkpoint_whose_weights_are_nan_is_one_error_line(tmp_path, capsys, command):
    """A run saved after it diverged verifies (its sha256 is of what was written) but holds NaN: eval
    used to report loss nan with exit 0 and generate a traceback; both now refuse it in one line."""
    from mamba3lite.data.shards import write_dataset
    from mamba3lite.model import Mamba3Transformer
    from userside_helpers import tiny_config

    model = Mamba3Transformer(tiny_config("unused").model)
    with torch.no_grad():
        model.layers[0].mlp.fc2.weight.fill_(float("nan"))
    run = save_tiny_checkpoint(tmp_path / "run", step=3, model=model)
    gpt2 = {"name": "gpt2", "vocab_hash": load_tokenizer("gpt2").vocab_hash}
    write_dataset(
        tmp_path / "data",
        [("val", list(range(1, 200)), 1, 0)],
        vocab_size=50257,
        eos_id=50256,
        tokenizer=gpt2,
    )
    argv = {
        "generate": ["generate", "--checkpoint-dir", str(run), "--prompt", "hi", "--max-new-tokens", "2"],
        "eval": ["eval", "--checkpoint-dir", str(run), "--data-path", str(tmp_path / "data")],
    }[command]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "non-finite weights" in lines[0] and "layers.0.mlp.fc2.weight" in lines[0], err
