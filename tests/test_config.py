"""Config: defaults, validation naming the field, YAML, typed --set overrides, did-you-mean, reference."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.checkpoint.meta import meta_digest
from mamba3lite.config import (
    PRESET_DIR,
    RESOLVED_HEADER,
    Config,
    DataConfig,
    TrainingConfig,
    available_presets,
    load_config,
    resolve_preset,
    write_resolved_config,
)
from mamba3lite.errors import ConfigError
from mamba3lite.model import ModelConfig
from mamba3lite.quickstart.recipe import MICRO_BATCH, recipe_overrides
from mamba3lite.report.config_reference import config_reference_markdown
from mamba3lite.train.distributed import pick_device
from mamba3lite.train.trainer import Pretrainer

OLD_RUN = Path(__file__).parent / "data" / "run_v1_step2"  # a 2-step run of global batch 2 (micro 2 x 1)


def test_seed_defaults():
    t = TrainingConfig()
    assert (t.max_seq_len, t.micro_batch_size, t.gradient_accumulation_steps) == (2048, 16, 2)
    assert (t.max_steps, t.log_every, t.save_every, t.nan_guard_max_consecutive) == (256_000, 50, 4000, 5)
    assert DataConfig().train_data_path == "data/pretrain_data.bin"
    # the global batch is the contract: the same tokens per step at any world size
    assert t.tokens_per_step() == 65_536 and t.global_windows == 32
    assert t.accumulation(1) == 2 and t.accumulation(2) == 1


def test_global_batch_is_the_contract_and_accumulation_is_derived():
    t = TrainingConfig(micro_batch_size=2, global_batch_size=16)
    assert t.global_windows == 16 and [t.accumulation(n) for n in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ConfigError, match="does not split into micro batches of 2 over 3"):
        t.accumulation(3)
    with pytest.raises(ConfigError, match=r"not a multiple of training\.micro_batch_size 2"):
        TrainingConfig(micro_batch_size=2, global_batch_size=15)
    with pytest.raises(ConfigError, match="did you mean"):
        TrainingConfig(parallelism="fdsp")
    with pytest.raises(ConfigError, match=r"set training\.parallelism=hsdp"):
        TrainingConfig(parallelism="ddp", dp_replicate=2)


def test_the_resolved_config_states_the_batch_the_run_trains_with(tmp_path):
    """The quickstart's recipe states the global batch over the tiny preset: its config.yaml says that
    batch and no accumulation beside it (the run derives it: 1 micro batch per step), and reads back as it."""
    cfg = load_config("tiny").with_overrides(recipe_overrides())
    t = cfg.training
    assert (t.global_batch_size, t.micro_batch_size, t.accumulation(1)) == (MICRO_BATCH, MICRO_BATCH, 1)
    path = tmp_path / "config.yaml"
    write_resolved_config(cfg, path)
    written = yaml.safe_load(path.read_text())["training"]
    assert written["global_batch_size"] == t.global_windows == MICRO_BATCH
    assert written["gradient_accumulation_steps"] is None  # not a second, ignored statement of the batch
    again = load_config(str(path)).training
    assert (again.global_windows, again.gradient_accumulation_steps, again.accumulation(1)) == (
        MICRO_BATCH,
        None,
        1,
    )
    # a batch derived from the accumulation is stated by it alone, and a global batch set over it replaces it
    derived = load_config("tiny", ["training.global_batch_size=0", "training.gradient_accumulation_steps=3"])
    assert (derived.training.global_windows, derived.training.gradient_accumulation_steps) == (12, 3)
    restated = derived.with_overrides(["training.global_batch_size=8"]).training
    assert (restated.global_windows, restated.gradient_accumulation_steps, restated.accumulation(1)) == (
        8,
        None,
        2,
    )
    assert TrainingConfig(global_batch_size=0).gradient_accumulation_steps == 2  # neither stated: the default


@pytest.mark.parametrize(
    "how", ["--set", "yaml", "python"], ids=["set-over-a-preset", "a-written-file", "constructed"]
)
def test_stating_both_the_global_batch_and_the_accumulation_is_refused(tmp_path, how):
    says = (
        r"training\.gradient_accumulation_steps is 2 but training\.global_batch_size is 4, which decides the "
        r"accumulation .*--set training\.global_batch_size=8 for 2 micro batches per step"
    )
    with pytest.raises(ConfigError, match=says):
        if how == "--set":  # the tiny preset states global_batch_size 4 (micro batch 4)
            load_config("tiny", ["training.gradient_accumulation_steps=2"])
        elif how == "yaml":
            path = tmp_path / "mine.yaml"
            train = {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "global_batch_size": 4}
            path.write_text(yaml.safe_dump({"training": train}))
            load_config(str(path))
        else:
            TrainingConfig(micro_batch_size=4, gradient_accumulation_steps=2, global_batch_size=4)


def test_a_run_recorded_with_an_ignored_accumulation_reads_and_resumes_with_the_batch_it_trained(tmp_path):
    """Runs before this rule recorded every field: the quickstart's config.yaml and metas said accumulation
    2 beside global batch 8, and the run accumulated 1. Such a record loads (config.yaml passed back as
    --config, a meta's config) with the global batch it trained with, and the run resumes with it."""
    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    config = run / "config.yaml"
    text = config.read_text()
    assert text.startswith(RESOLVED_HEADER) and "  gradient_accumulation_steps: 1\n" in text
    config.write_text(text.replace("  gradient_accumulation_steps: 1\n", "  gradient_accumulation_steps: 2\n"
                                   "  global_batch_size: 2\n"))  # fmt: skip
    meta_path = run / "meta_step_2.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["training"].update(gradient_accumulation_steps=2, global_batch_size=2)
    meta["meta_sha256"] = meta_digest(meta)  # as that version wrote it
    meta_path.write_text(json.dumps(meta))
    recorded = Config.from_dict(CheckpointManager(run).read_meta(2)["config"], source="meta").training
    assert (recorded.global_windows, recorded.gradient_accumulation_steps) == (2, None)
    cfg = load_config(str(config))
    assert (cfg.training.global_windows, cfg.training.accumulation(1)) == (2, 1)
    cfg = cfg.replace("training", checkpoint_dir=str(run), max_steps=3, progress=False)
    result = Pretrainer(cfg, resume="latest").train()
    assert result.step == 3 and result.tokens_seen == 96  # 2 windows of 16 tokens more: the recorded batch
    rewritten = yaml.safe_load(config.read_text())["training"]
    assert (rewritten["global_batch_size"], rewritten["gradient_accumulation_steps"]) == (2, None)


def test_every_field_is_documented():
    for cls in (TrainingConfig, DataConfig, ModelConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.lr=-1", "training.lr must be > 0, got -1"),
        ("training.min_lr=1", "training.min_lr"),
        ("training.dtype=fp16", "training.dtype must be one of auto, bf16, fp32"),
        ("training.betas=0.9,1.5", "training.betas"),
        ("training.max_steps=abc", "training.max_steps must be an integer"),
        ("training.compile=maybe", "training.compile must be true or false"),
        ("training.device=tpu", "training.device"),
        ("training.device=cuda:abc", "training.device must be auto, cpu, cuda or cuda:N"),
        ("training.seed=9223372036854775808", "training.seed must be in [0, 2**63)"),
        ("training.seed=-1", "training.seed"),
        ("data.token_dtype=uint8", "data.token_dtype must be one of"),
        ("training.micro_batch_size=0", "training.micro_batch_size must be > 0"),
        ("model.d_model=0", "model.d_model"),
    ],
)
def test_invalid_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        Config().with_overrides([override])
    assert message in str(e.value)


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("training.lrr=1", "`lr`"),
        ("trainng.lr=1", "`training`"),
        ("data.train_data_pth=x", "`train_data_path`"),
        ("model.d_modle=8", "`d_model`"),
    ],
)
def test_unknown_keys_suggest(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}"):
        Config().with_overrides([override])


def test_typed_overrides():
    cfg = Config().with_overrides(
        [
            "training.lr=3e-4",
            "training.max_steps=1_000",
            "training.compile=true",
            "training.betas=[0.8, 0.9]",
            "data.val_data_path=none",
            "data.dummy=yes",
            "model.n_layers=2",
        ]
    )
    t = cfg.training
    assert t.lr == 3e-4 and isinstance(t.lr, float) and t.max_steps == 1000 and t.compile is True
    assert t.betas == (0.8, 0.9) and cfg.data.val_data_path is None and cfg.data.dummy is True
    assert cfg.model.n_layers == 2
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        Config().with_overrides(["training.lr"])


def test_overrides_of_one_section_are_validated_together():
    # eos_id 0 is only valid with the new vocabulary, vocab_size 296 only with the new EOS: in either order
    for order in (["model.vocab_size=296", "model.eos_id=0"], ["model.eos_id=0", "model.vocab_size=296"]):
        m = Config().with_overrides(order).model
        assert (m.vocab_size, m.eos_id) == (296, 0)
    assert Config().with_overrides(["training.lr=1e-3", "training.lr=2e-3"]).training.lr == 2e-3
    with pytest.raises(ConfigError, match=r"model\.eos_id must be a token id"):
        Config().with_overrides(["model.vocab_size=296"])  # the default EOS 50256 is outside it


def test_yaml_roundtrip_and_unknown_section(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "model": {"d_model": 64, "n_layers": 2},
                "training": {"lr": "1e-3"},
                "data": {"train_data_path": "somewhere"},
            }
        )
    )
    cfg = load_config(p, ["training.max_steps=7"])
    assert cfg.model.d_model == 64 and cfg.training.lr == 1e-3 and cfg.training.max_steps == 7
    assert cfg.data.train_data_path == "somewhere"
    out = tmp_path / "run" / "config.yaml"
    write_resolved_config(cfg, out)
    assert load_config(out) == cfg  # every field written, read back identical
    assert Config.from_dict(cfg.to_dict()) == cfg
    p.write_text("trainig:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="did you mean `training`"):
        load_config(p)
    p.write_text("training: [1, 2]\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(p)
    p.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError, match=r"c\.yaml is empty; a config holds model:, training:"):
        load_config(p)
    p.write_text("training: {lr: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    # PyYAML keeps the last of two equal keys: the whole first `training:` block would be lost
    p.write_text(
        "training:\n  lr: 1.0e-2\n  max_steps: 50\nmodel:\n  n_layers: 2\ntraining:\n  log_every: 5\n"
    )
    with pytest.raises(ConfigError, match=r"key 'training' is given twice.*\(line 6, column 1\)") as e:
        load_config(p)
    assert "\n" not in str(e.value)
    p.write_text("training:\n  lr: 1.0e-2\n  lr: 2.0e-2\n")
    with pytest.raises(ConfigError, match="key 'lr' is given twice"):
        load_config(p)


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_device_without_cuda_is_a_config_error(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU-only machine
    with pytest.raises(ConfigError, match=rf"training.device is {device} but .* no CUDA device; use"):
        pick_device(device)
    assert pick_device("auto") == torch.device("cpu") and pick_device("cpu") == torch.device("cpu")


def test_presets_by_name_and_missing(tmp_path):
    with pytest.raises(ConfigError, match="config not found"):
        resolve_preset(tmp_path / "nope.yaml")
    for name in available_presets():
        assert resolve_preset(name) == PRESET_DIR / f"{name}.yaml"
        cfg = load_config(name)  # every packaged preset loads and validates
        assert cfg.training.max_seq_len >= 1


def test_reference_markdown_covers_every_field():
    md = config_reference_markdown()
    for section, cls in (("model", ModelConfig), ("training", TrainingConfig), ("data", DataConfig)):
        assert f"### `{section}:`" in md
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in md
    assert "| `lr` | float | `0.0015` | peak learning rate" in md


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.lr=1" + "0" * 400, "training.lr is too large for a number"),
        ("model.d_model=1e30", "model.d_model is impossibly large"),
    ],
)
def test_absurdly_large_numbers_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config("tiny", [override])
    assert len(str(e.value)) < 200  # the 400-digit value is cut


def test_a_boolean_may_be_given_as_1_or_0():
    assert load_config("tiny", ["training.progress=0"]).training.progress is False
    assert load_config("tiny", ["training.progress=1"]).training.progress is True
    with pytest.raises(ConfigError, match=r"training\.progress must be true or false, got 2"):
        load_config("tiny", ["training.progress=2"])


def test_every_did_you_mean_uses_one_cutoff():
    # Config keys, presets, scan backends and task names all suggest through errors.close_words.
    from mamba3lite.errors import close_words, did_you_mean_hint

    assert did_you_mean_hint("lrr", ["lr", "warmup_steps"]) == "; did you mean `lr`?"
    assert did_you_mean_hint("zzz", ["lr"], otherwise="; known: lr") == "; known: lr"
    assert close_words("hellaswg", ["hellaswag", "hellaswag_mc", "piqa"], n=5) == [
        "hellaswag",
        "hellaswag_mc",
    ]
