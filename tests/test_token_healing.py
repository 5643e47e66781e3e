"""Token healing: the pure backing-up rule, the constraint, the cached table, and generation with it
("def " continues with an identifier where, without healing, a whitespace-loving model writes spaces)."""

from __future__ import annotations

import random

import pytest
import torch

from mamba3lite.cli import main
from mamba3lite.generation import generate_text
from mamba3lite.token_healing import HealingConstraint, TokenTable, heal_prompt, token_table
from mamba3lite.tokenizer import HFTokenizer, load_tokenizer
from test_tokenizer_train import python_docs
from userside_helpers import eos_model, save_tiny_checkpoint


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from mamba3lite.tokenizer_train import train_bpe

    path = tmp_path_factory.mktemp("healing") / "tokenizer.json"
    path.write_bytes(train_bpe(python_docs(200), 400))
    return load_tokenizer(str(path))


def test_prefix_queries_agree_with_a_scan(gpt2, trained):
    rng = random.Random(0)
    for tok in (gpt2, trained):
        table = token_table(tok)
        everything = [(i, b) for i, b in enumerate(table.bytes_of) if b]
        for _ in range(40):
            b = rng.choice(everything)[1]
            prefix = b[: rng.randint(1, len(b))]
            assert sorted(table.starting_with(prefix)) == sorted(
                i for i, x in everything if x.startswith(prefix)
            )
            text = b + b"xyz"
            want = sorted({i for i, x in everything if text.startswith(x) and len(x) < len(text)})
            assert sorted(table.proper_prefixes_of(text)) == want


def test_gpt2_prompts_back_up_their_last_token(gpt2):
    table = token_table(gpt2)
    eos = gpt2.eos_id
    for prompt, removed in [("def ", b" "), ("x = fo", b" fo"), ("import os\n", b"\n"), ("a.b", b"b")]:
        ids = [eos, *gpt2.encode(prompt)]
        kept, got = heal_prompt(ids, table)
        assert got == removed and kept == ids[: len(kept)]
        assert gpt2.decode(kept[1:]).encode() + got == prompt.encode()
    assert heal_prompt([eos], table) == ([eos], b"")  # an empty prompt: nothing to heal, EOS stays
    assert heal_prompt([eos, 11], None) == ([eos, 11], b"")  # a tokenizer without byte tokens


def test_more_tokens_are_backed_up_while_they_could_merge():
    # ids: 0 special, 1 "a", 2 "b", 3 "ab", 4 "abc", 5 "c"
    table = TokenTable([None, b"a", b"b", b"ab", b"abc", b"c"])
    assert heal_prompt([0, 1, 2], table) == ([0], b"ab")  # "a"+"b" is the start of "ab", "abc"
    assert heal_prompt([0, 5, 2], table) == ([0, 5], b"b")  # "cb" starts no token: only "b" goes
    c = HealingConstraint(table, b"ab")
    assert c.active and sorted(c.table.allowed(c.remaining)) == [1, 3, 4]  # "a" spells part, "ab" "abc" all
    c.advance(1)
    assert c.remaining == b"b" and c.table.allowed(c.remaining) == [2]
    masked = c.mask(torch.zeros(1, 6))
    assert masked[0].tolist() == [float("-inf")] * 2 + [0.0] + [float("-inf")] * 3
    c.advance(2)
    assert not c.active and torch.equal(c.mask(torch.ones(1, 6)), torch.ones(1, 6))


def test_a_prompt_ending_inside_a_character_backs_up_to_its_start(trained):
    table = token_table(trained)
    ids = [trained.eos_id, *trained.encode("x = café")]
    assert len(trained.encode("é")) == 2  # two byte tokens in this small vocabulary
    kept, removed = heal_prompt(ids, table)
    assert removed.endswith("é".encode()) and removed.decode()  # whole characters only
    assert trained.decode(kept[1:]).encode() + removed == "x = café".encode()


@pytest.mark.parametrize("which", ["gpt2", "trained"])
def test_any_allowed_path_spells_the_prompt_again(which, gpt2, trained):
    tok = gpt2 if which == "gpt2" else trained
    table = token_table(tok)
    rng = random.Random(1)
    for prompt in [
        "def ",
        "x = fo",
        "    ret",
        "print('héllo wö",
        "for i in range(1",
        "a\n\n",
        "class C:\n  ",
    ]:
        kept, removed = heal_prompt([tok.eos_id, *tok.encode(prompt)], table)
        assert removed, prompt
        c, chosen = HealingConstraint(table, removed), []
        while c.active:
            chosen.append(rng.choice(table.allowed(c.remaining)))
            c.advance(chosen[-1])
        assert b"".join(table.bytes_of[i] for i in kept[1:] + chosen).startswith(prompt.encode())


def test_the_table_is_built_once_per_tokenizer(trained):
    tok = HFTokenizer(trained.name)  # a fresh object: nothing cached for it yet
    calls = []
    real = tok.token_bytes
    tok.token_bytes = lambda: calls.append(1) or real()
    model = _bigram(tok)
    for _ in range(3):
        assert generate_text(model, tok, "def ", max_new_tokens=3, temperature=0).healed == " "
    assert calls == [1] and token_table(tok) is token_table(tok)


class _Bigram(torch.nn.Module):
    """A stand-in for an undertrained code model: the next token depends only on the last one, and
    after a lone " " (rare in training: " main" is one token) it is whitespace, as after whitespace;
    after "def" it is mostly a name. Greedy decoding then shows what the prompt's last token does."""

    def __init__(self, tok, table: dict[str, dict[str, float]]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.cfg = type("Cfg", (), {"vocab_size": tok.vocab_size})()
        self.next: dict[int, torch.Tensor] = {}
        for last, dist in table.items():
            logits = torch.full((tok.vocab_size,), -20.0)
            for text, logit in dist.items():
                (i,) = tok.encode(text)
                logits[i] = logit
            (j,) = tok.encode(last)
            self.next[j] = logits

    def allocate_cache(self, batch_size, max_len=None, device=None):
        return {}

    def prefill(self, input_ids_BT, cache):
        return self.step(input_ids_BT[:, -1], cache), cache

    def step(self, token_B, cache):
        return self.next[int(token_B[0])][None]


def _bigram(tok):
    ws = {" ": 4.0, "\n": 3.0}
    return _Bigram(
        tok,
        {
            "def": {"\n": 4.0, " value": 3.5, "(": 2.0, " ": 1.0},  # "\n" most likely, but no name
            " ": ws,
            "\n": ws,
            " value": {"(": 4.0},
            "(": {"\n": 4.0},
        },
    )


@pytest.mark.parametrize("which", ["gpt2", "trained"])
def test_def_space_continues_with_an_identifier_only_with_healing(which, gpt2, trained):
    tok = gpt2 if which == "gpt2" else trained
    assert tok.encode("def ") == [*tok.encode("def"), *tok.encode(" ")]  # ends in a lone " " token
    model = _bigram(tok)
    plain = generate_text(model, tok, "def ", max_new_tokens=8, temperature=0, token_healing=False)
    assert plain.text.strip() == "" and plain.text  # spaces and newlines, nothing else
    pieces: list[str] = []
    healed = generate_text(model, tok, "def ", max_new_tokens=8, temperature=0, on_text=pieces.append)
    assert healed.healed == " " and healed.text.startswith("value(\n")
    assert "".join(pieces) == healed.text  # the removed " " is not shown twice
    assert "def " + healed.text == tok.decode([*tok.encode("def"), *healed.token_ids])
    sampled = generate_text(model, tok, "def ", max_new_tokens=8, temperature=1.0, seed=0)
    assert sampled.text.startswith("value")  # sampled too: "\n" and "(" cannot come first


def test_eos_cannot_end_generation_before_the_removed_text_is_spelled_again(gpt2):
    r = generate_text(eos_model(), gpt2, "def f():", max_new_tokens=5, temperature=1.0, seed=0)
    assert r.healed == "():" and r.stopped_at_eos and len(r.token_ids) >= 1
    assert gpt2.decode(r.token_ids).startswith("():")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("heal") / "run", step=2)


@pytest.mark.parametrize("flag", [[], ["--no-token-healing"]])
def test_the_cli_prints_the_prompt_once_then_the_continuation(run_dir, capsys, gpt2, flag):
    from mamba3lite.pretrained import load_pretrained

    args = ["generate", "--checkpoint-dir", str(run_dir), "--prompt", "x = fo", "--max-new-tokens", "6"]
    assert main([*args, "--seed", "3", *flag]) == 0
    out = capsys.readouterr().out
    loaded = load_pretrained(run_dir)
    want = generate_text(loaded.model, gpt2, "x = fo", max_new_tokens=6, seed=3, token_healing=not flag)
    assert out == "x = fo" + want.text + "\n"
    if not flag:
        assert want.healed == " fo" and gpt2.decode(want.token_ids).startswith(" fo")
