"""training.optimizer: muon: which parameters Muon takes, its lr and decay, exact resume, checkpoint
state of both optimizers, a resume that switches optimizer, and the config's errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mamba3lite import cli
from mamba3lite.checkpoint import load_optimizer_state_by_name, optimizer_state_by_name
from mamba3lite.config import Config, TrainingConfig
from mamba3lite.errors import ConfigError
from mamba3lite.model import Mamba3Transformer
from mamba3lite.train.optim import MuonWithAdamW, apply_optimizer_settings, build_optimizer, lr_at, set_lr
from mamba3lite.train.trainer import Pretrainer
from test_trainer import metrics, tiny_config, weights
from tiny_shapes import TINY_MODEL_SHAPE

HIDDEN = {"mixer.in_proj.weight", "mixer.out_proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"}


def tiny_model(**model) -> Mamba3Transformer:
    torch.manual_seed(0)
    cfg = Config().replace("model", vocab_size=64, eos_id=0, **{**TINY_MODEL_SHAPE, "n_layers": 2, **model})
    return Mamba3Transformer(cfg.model)


def muon_training(**kw) -> TrainingConfig:
    return TrainingConfig(**{"optimizer": "muon", "lr": 1e-2, "min_lr": 1e-3, **kw})


def names_of(model: nn.Module, groups: list[dict]) -> list[set[str]]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [{by_id[id(p)] for p in g["params"]} for g in groups]


@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tied):
    model = tiny_model(tie_embeddings=tied)
    opt = build_optimizer(model, muon_training(weight_decay=0.1))
    assert isinstance(opt, MuonWithAdamW) and opt.kind == "muon"
    decayed, not_decayed, muon = names_of(model, opt.param_groups)
    assert muon == {f"layers.{i}.{n}" for i in range(2) for n in HIDDEN}
    assert decayed == (set() if tied else {"lm_head.weight"})  # an untied head is AdamW's, decayed
    assert "embed.weight" in not_decayed and "layers.0.mixer.dt_bias" in not_decayed
    assert "layers.1.mixer.D" in not_decayed and "norm_f.weight" in not_decayed
    everything = [n for n, p in model.named_parameters()]
    assert sorted(decayed | not_decayed | muon) == sorted(everything)  # each once (a tied one too)
    assert sum(map(len, (decayed, not_decayed, muon))) == len(everything)
    assert opt.muon.defaults["adjust_lr_fn"] == "match_rms_adamw" and opt.muon.defaults["momentum"] == 0.95
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.1]


def test_muon_takes_a_hybrids_attention_projections_as_hidden_matrices():
    """A hybrid's attention layer (model/attention.py: in_proj, out_proj, a depthwise conv1d, biases)
    gives Muon its two projections, like a Mamba-3 layer's; its conv kernel (3-D) is AdamW's, decayed,
    and its biases AdamW's, undecayed."""
    attn = {"num_heads": 2, "d_conv": 4, "mlp_dim": 16, "rotary_emb_dim": 4}
    model = tiny_model(attn_layer_idx=[1], attn_cfg=attn)
    assert type(model.layers[1].mixer).__name__ == "MHA"
    opt = build_optimizer(model, muon_training(weight_decay=0.1))
    decayed, not_decayed, muon = names_of(model, opt.param_groups)
    assert muon == {f"layers.{i}.{n}" for i in range(2) for n in HIDDEN}
    assert decayed == {"layers.1.mixer.conv1d.weight"}
    biases = {f"layers.1.mixer.{n}.bias" for n in ("in_proj", "out_proj", "conv1d")}
    assert biases <= not_decayed
    assert sum(map(len, (decayed, not_decayed, muon))) == len(list(model.parameters()))


def test_the_split_is_by_role_so_an_attention_lm_gets_the_same_one():
    """The name rule is general: a pre-norm attention LM named as the Mamba-3 LM is (embed, norm, norm_f)
    with attention matrices `attn.qkv`/`attn.out` (the benchmarks' Transformer baseline) has its
    attention and MLP matrices in Muon, its tied embedding and norms in AdamW, undecayed."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.norm2 = nn.RMSNorm(8), nn.RMSNorm(8)
            self.attn = nn.ModuleDict(
                {"qkv": nn.Linear(8, 24, bias=False), "out": nn.Linear(8, 8, bias=False)}
            )
            self.mlp = nn.ModuleDict(
                {"fc1": nn.Linear(8, 32, bias=False), "fc2": nn.Linear(16, 8, bias=False)}
            )

    model = nn.Module()
    model.embed, model.layers, model.norm_f = (
        nn.Embedding(64, 8),
        nn.ModuleList([Layer(), Layer()]),
        nn.RMSNorm(8),
    )
    opt = build_optimizer(model, muon_training(weight_decay=0.1))
    decayed, not_decayed, muon = names_of(model, opt.param_groups)
    matrices = ("attn.qkv.weight", "attn.out.weight", "mlp.fc1.weight", "mlp.fc2.weight")
    assert muon == {f"layers.{i}.{n}" for i in range(2) for n in matrices}
    norms = {f"layers.{i}.{n}.weight" for i in range(2) for n in ("norm", "norm2")}
    assert decayed == set() and not_decayed == {"embed.weight", "norm_f.weight", *norms}


def test_steps_equal_torch_muon_and_adamw_side_by_side_with_the_scheduled_lrs():
    """The composite is torch's Muon + AdamW on the same split: same weights after a few steps, each
    group at the schedule's lr times its scale (Muon's peak is muon_lr). dtype bf16: torch's Newton-Schulz
    dtype (the fp32 one is tested in test_muon_newton_schulz.py)."""
    tc = muon_training(muon_lr=3e-2, weight_decay=0.1, warmup_steps=2, max_steps=5, dtype="bf16")
    a, b = tiny_model(), tiny_model()
    opt = build_optimizer(a, tc)
    hidden = [p for n, p in b.named_parameters() if any(n.endswith(h) for h in HIDDEN)]
    ref_muon = torch.optim.Muon(hidden, lr=3e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    others = [p for p in b.parameters() if all(p is not q for q in hidden)]
    decay = [p for n, p in b.named_parameters() if n == "lm_head.weight"]  # (tied here: none)
    ref_adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        fused=True,
    )
    ids = torch.arange(32).view(2, 16) % 64
    for step in range(5):
        lr = lr_at(step, lr=tc.lr, min_lr=tc.min_lr, warmup_steps=tc.warmup_steps, max_steps=tc.max_steps)
        set_lr(opt, lr)
        assert [g["lr"] for g in opt.param_groups] == [lr, lr, lr * 3.0]
        for g in ref_adamw.param_groups:
            g["lr"] = lr
        ref_muon.param_groups[0]["lr"] = lr * 3.0
        for m in (a, b):
            m(ids).float().logsumexp(-1).mean().backward()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        opt.zero_grad()
        ref_muon.zero_grad()
        ref_adamw.zero_grad()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(a.layers[0].mixer.in_proj.weight, tiny_model().layers[0].mixer.in_proj.weight)


def test_muon_decay_is_decoupled_with_the_groups_lr():
    model = tiny_model()
    opt = build_optimizer(model, muon_training(weight_decay=0.5))
    set_lr(opt, 0.1)
    w = model.layers[0].mlp.fc1.weight
    before = w.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a zero update: only the decay moves the matrix
    opt.step()
    torch.testing.assert_close(w, before * (1 - 0.1 * 0.5), rtol=0, atol=1e-7)


def test_adamw_stays_the_optimizer_of_default_configs():
    model = tiny_model()
    tc = TrainingConfig()
    assert tc.optimizer == "adamw"
    opt = build_optimizer(model, tc)
    legacy = build_optimizer(model, lr=tc.lr, weight_decay=tc.weight_decay, betas=tc.betas, eps=tc.eps)
    assert type(opt) is torch.optim.AdamW and not hasattr(opt, "lr_scales")
    assert opt.state_dict() == legacy.state_dict()  # same groups, same settings


def test_resume_with_muon_is_bit_exact(tmp_path):
    full = Pretrainer(tiny_config(tmp_path / "a", optimizer="muon"))
    r_full = full.train()
    assert isinstance(full.optimizer, MuonWithAdamW) and r_full.step == 6
    first = Pretrainer(tiny_config(tmp_path / "b", optimizer="muon"))
    r1 = first.train(until_step=3)
    second = Pretrainer(tiny_config(tmp_path / "b", optimizer="muon"))
    r2 = second.train()
    assert [loss for _, loss in r1.history + r2.history] == [loss for _, loss in r_full.history]
    w_full, w_resumed = weights(full), weights(second)
    assert all(torch.equal(w_full[k], w_resumed[k]) for k in w_full)
    # Both optimizers' state came back: Muon's momentum and AdamW's moments
    for p_full, p_res in zip(full.params, second.params, strict=True):
        s_full, s_res = full.optimizer.state[p_full], second.optimizer.state[p_res]
        assert s_full.keys() == s_res.keys() and all(torch.equal(s_full[k], s_res[k]) for k in s_full)
    assert "momentum_buffer" in second.optimizer.state[second.raw_model.layers[0].mixer.in_proj.weight]
    adamw_trained = Pretrainer(tiny_config(tmp_path / "c")).train()
    assert [x for _, x in adamw_trained.history] != [x for _, x in r_full.history]  # muon did something


def test_checkpoint_keys_both_optimizers_state_by_name_and_reloads_it():
    model = tiny_model()
    opt = build_optimizer(model, muon_training())
    model(torch.arange(16).view(1, 16)).float().mean().backward()
    opt.step()
    saved = optimizer_state_by_name(opt, model)
    assert saved["optimizer"] == "muon"
    assert set(saved["state"]["layers.0.mixer.in_proj.weight"]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(saved["state"]["embed.weight"])
    fresh = tiny_model()
    opt2 = build_optimizer(fresh, muon_training())
    load_optimizer_state_by_name(opt2, fresh, saved, "test")
    got = optimizer_state_by_name(opt2, fresh)
    for name, s in saved["state"].items():
        assert all(torch.equal(v, got["state"][name][k]) for k, v in s.items()), name


def test_an_adamw_state_saved_before_muon_existed_loads_into_an_adamw_run():
    model = tiny_model()
    opt = build_optimizer(model, TrainingConfig())
    model(torch.arange(16).view(1, 16)).float().mean().backward()
    opt.step()
    old = optimizer_state_by_name(opt, model)
    del old["optimizer"]  # files written before training.optimizer had no such key
    fresh = tiny_model()
    opt2 = build_optimizer(fresh, TrainingConfig())
    load_optimizer_state_by_name(opt2, fresh, old, "old.pt")
    assert torch.equal(opt2.state[fresh.embed.weight]["exp_avg"], opt.state[model.embed.weight]["exp_avg"])
    with pytest.raises(ConfigError, match=r"training\.optimizer=adamw, but this run's config says"):
        load_optimizer_state_by_name(build_optimizer(fresh, muon_training()), fresh, old, "old.pt")


@pytest.mark.parametrize(("before", "after"), [("adamw", "muon"), ("muon", "adamw")])
def test_a_resume_that_switches_optimizer_is_one_error_naming_both(tmp_path, before, after):
    Pretrainer(tiny_config(tmp_path, max_steps=2, optimizer=before)).train()
    with pytest.raises(ConfigError) as e:
        Pretrainer(tiny_config(tmp_path, max_steps=4, optimizer=after)).train()
    message = str(e.value)
    assert f"training.optimizer={before}" in message and f"training.optimizer={after}" in message
    assert f"--set training.optimizer={before}" in message and "\n" not in message


def test_resume_with_changed_muon_momentum_uses_the_configs_and_says_so(tmp_path):
    Pretrainer(tiny_config(tmp_path, max_steps=2, optimizer="muon")).train()
    t = Pretrainer(tiny_config(tmp_path, max_steps=3, optimizer="muon", muon_momentum=0.9))
    t.train()
    assert t.optimizer.muon.param_groups[0]["momentum"] == 0.9
    (event,) = [r for r in metrics(tmp_path) if r.get("event") == "config"]
    assert "muon momentum 0.95 -> 0.9" in event["message"]
    assert apply_optimizer_settings(t.optimizer, t.tc) == []  # now in line with the config


def test_muon_on_a_model_without_hidden_matrices_is_a_config_error_naming_the_fix(tmp_path):
    class EmbeddingOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 8)
            self.norm_f = nn.LayerNorm(8)
            self.lm_head = nn.Linear(8, 64, bias=False)

    with pytest.raises(ConfigError, match=r"no 2-D hidden matrix.*--set training\.optimizer=adamw"):
        build_optimizer(EmbeddingOnly(), muon_training())
    assert type(build_optimizer(EmbeddingOnly(), TrainingConfig())) is torch.optim.AdamW
    with pytest.raises(ConfigError, match="no 2-D hidden matrix"):  # when the trainer is built
        Pretrainer(tiny_config(tmp_path / "run", optimizer="muon"), model=EmbeddingOnly())
    assert not (tmp_path / "run").exists()  # before anything was trained or written
    # A Mamba3Transformer always has some (each layer's mixer): its config refuses zero layers
    with pytest.raises(ConfigError, match="n_layers"):
        Config().replace("model", n_layers=0)


@pytest.mark.parametrize(
    ("value", "hint"),
    [("moun", "did you mean `muon`?"), ("AdamW", "did you mean `adamw`?"), ("sgd", "got 'sgd'")],
)
def test_an_unknown_optimizer_is_refused_with_the_closest_name(value, hint):
    with pytest.raises(ConfigError, match=r"training\.optimizer must be one of adamw, muon") as e:
        Config().replace("training", optimizer=value)
    assert hint in str(e.value)


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("muon_momentum", 1.0, "training.muon_momentum must be in [0, 1)"),
        ("muon_momentum", float("nan"), "training.muon_momentum must be in [0, 1)"),
        ("muon_lr", 0.0, "training.muon_lr must be > 0"),
        ("muon_lr", float("inf"), "training.muon_lr must be a finite number"),
    ],
)
def test_muon_settings_are_validated(key, value, words):
    with pytest.raises(ConfigError) as e:
        Config().replace("training", **{key: value})
    assert words in str(e.value)


def test_the_cli_prints_an_unknown_optimizer_as_one_error_line(capsys, tmp_path):
    code = cli.main(
        ["train", "--config", "tiny", "--dummy", "--checkpoint-dir", str(tmp_path / "r"), "--set",
         "training.optimizer=muom"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "did you mean `muon`?" in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert not (tmp_path / "r").exists()  # refused before anything was written
