"""The run configuration: typed, documented, validated dataclasses, loaded from YAML, overridable.

A config file has three sections, in the seed's layout, and a fourth of its own:

    model:     ModelConfig (mamba3lite.model): the architecture
    training:  TrainingConfig: optimisation, schedule, cadence, checkpoints
    data:      DataConfig: where the token shards are (`train_data_path`, as in the seed)
    logging:   LoggingConfig: where the metrics rows go (train/metrics/: one sink each)

Every field carries `metadata={"help": ...}` (meaning and unit); `mamba3lite.report.config_reference`
renders them for the docs. Values are validated on creation (`__post_init__`) with a `ConfigError` that
names the field ("training.lr must be > 0, got -1"). Unknown keys, in YAML or in `--set section.key=value`
overrides, are errors with a did-you-mean suggestion. A preset is named by path or by bare name
("tiny" -> the packaged `mamba3lite/configs/tiny.yaml`).

The sections are dataclasses of their own (mamba3lite/sections/: one module each, and `build_section`,
which coerces YAML and `--set` values to a field's type); this module is the whole config built from them,
the presets, and where every caller imports them from.

The seed kept `data_path` in its TrainingConfig; here it is `data.train_data_path` (the key its YAML
already used), next to `val_data_path` and `dummy`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mamba3lite.errors import ConfigError, did_you_mean_hint
from mamba3lite.sections.data import TOKEN_DTYPES, DataConfig
from mamba3lite.sections.logging_sinks import LOGGING_SINKS, LoggingConfig
from mamba3lite.sections.training import (
    DEFAULT_ACCUMULATION,
    DTYPES,
    LR_SCHEDULES,
    MAX_BUDGET_MINUTES,
    OPTIMIZERS,
    PARALLELISMS,
    TrainingConfig,
)
from mamba3lite.sections.values import build_section, parse_text, reject_unknown

if TYPE_CHECKING:
    from mamba3lite.model import ModelConfig

__all__ = [
    "DEFAULT_ACCUMULATION",
    "DTYPES",
    "LOGGING_SINKS",
    "LR_SCHEDULES",
    "MAX_BUDGET_MINUTES",
    "OPTIMIZERS",
    "PARALLELISMS",
    "PRESET_DIR",
    "RESOLVED_HEADER",
    "SECTIONS",
    "TOKEN_DTYPES",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "TrainingConfig",
    "available_presets",
    "load_config",
    "resolve_preset",
    "write_resolved_config",
]

PRESET_DIR = Path(__file__).resolve().parent / "configs"
SECTIONS = ("model", "training", "data", "logging")


def _model_config_cls() -> type:
    from mamba3lite.model import ModelConfig

    return ModelConfig


def _default_model() -> ModelConfig:
    return _model_config_cls()()


@dataclass
class Config:
    """A whole run: the four sections. Build with `load_config`, `Config.from_dict` or directly."""

    model: ModelConfig = field(default_factory=_default_model)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @classmethod
    def section_classes(cls) -> dict[str, type]:
        return {
            "model": _model_config_cls(),
            "training": TrainingConfig,
            "data": DataConfig,
            "logging": LoggingConfig,
        }

    @classmethod
    def from_dict(cls, raw: dict | None, *, source: str = "config", record: bool = True) -> Config:
        """Build from a nested mapping (YAML, a checkpoint's meta). Missing keys take defaults.

        record: `raw` is what a run recorded (a checkpoint's meta, a run's config.yaml). Runs recorded
        every field, so records made before the batch had one source of truth state
        gradient_accumulation_steps beside a set global_batch_size, which those runs ignored: it is
        dropped, and the record reads as the run trained. False (a file someone wrote): stating both is
        the ConfigError of `TrainingConfig._resolve_batch`."""
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping with sections {', '.join(SECTIONS)}"
            )
        reject_unknown(raw.keys(), SECTIONS, where=f"{source}: unknown section")
        sections = {}
        for name, section_cls in cls.section_classes().items():
            values = raw.get(name) or {}
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: section `{name}:` must be a mapping of key: value")
            if record and name == "training" and values.get("global_batch_size"):
                values = {k: v for k, v in values.items() if k != "gradient_accumulation_steps"}
            sections[name] = build_section(section_cls, values, name)
        return cls(**sections)

    def to_dict(self) -> dict:
        """Plain nested dict (tuples become lists): JSON and YAML safe."""
        return {name: _plain(dataclasses.asdict(getattr(self, name))) for name in SECTIONS}

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: list[str] | tuple[str, ...]) -> Config:
        """A copy with `section.key=value` overrides applied (values typed by the field). All the overrides
        of a section are applied together and validated once, so `model.vocab_size=296 model.eos_id=0`
        works in either order (one at a time, the first would be checked against the other's old value);
        a key given twice: the last wins. A mapping field takes a whole mapping (`model.attn_cfg={num_heads:
        8}`) or one of its keys (`model.attn_cfg.num_heads=8`, merged into the current mapping)."""
        per_section: dict[str, dict[str, Any]] = {}
        for item in overrides:
            key, sep, text = item.partition("=")
            if not sep:
                raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. training.lr=3e-4")
            section, dot, name = key.strip().partition(".")
            if not dot:
                raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. training.lr=3e-4")
            reject_unknown([section], SECTIONS, where="--set: unknown section")
            values = per_section.setdefault(section, {})
            name, dot, sub = name.partition(".")
            if not dot:
                values[name] = parse_text(text.strip())
                continue
            current = values.get(name, getattr(getattr(self, section), name, None))
            if dataclasses.is_dataclass(current):  # a nested section: one of its keys, or deeper
                current = dataclasses.asdict(current)
            if not isinstance(current, dict):
                reject_unknown(
                    [name],
                    dataclasses.asdict(getattr(self, section)),
                    where=f"--set: unknown key in section `{section}:`",
                )
                raise ConfigError(
                    f"--set {item!r}: {section}.{name} is not a mapping; set it whole: {section}.{name}=value"
                )
            values[name] = {**current, sub: parse_text(text.strip())}
        cfg = self
        for section, values in per_section.items():
            cfg = cfg.replace(section, **values)
        return cfg

    def replace(self, section: str, **values: Any) -> Config:
        """A copy with fields of one section replaced (coerced and validated like YAML values)."""
        section_cls = self.section_classes()[section]
        current = dataclasses.asdict(getattr(self, section))
        reject_unknown(values.keys(), current.keys(), where=f"unknown key in section `{section}:`")
        if (
            section == "training"
            and "global_batch_size" in values
            and "gradient_accumulation_steps" not in values
        ):
            # A global batch set over one derived from the accumulation replaces it: one source of truth.
            current["gradient_accumulation_steps"] = None
        merged = {**current, **values}
        return dataclasses.replace(self, **{section: build_section(section_cls, merged, section)})


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def resolve_preset(name_or_path: str | Path) -> Path:
    """A config file path, or a packaged preset's bare name ("tiny" -> configs/tiny.yaml)."""
    p = Path(name_or_path)
    if p.is_file() or (p.exists() and not p.is_dir()):  # a pipe or device: intake's error names it
        return p
    if p.suffix in ("", ".yaml", ".yml") and len(p.parts) == 1:
        packaged = PRESET_DIR / (p.name if p.suffix else f"{p.name}.yaml")
        if packaged.is_file():
            return packaged
    presets = available_presets()
    hint = did_you_mean_hint(p.stem, presets)
    raise ConfigError(
        f"config not found: {name_or_path} (not a file, not a packaged preset){hint} "
        f"Presets: {', '.join(presets) or '(none)'}"
    )


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a preset/YAML file, then apply `section.key=value` overrides in order."""
    from mamba3lite import intake

    path = resolve_preset(name_or_path)
    raw = intake.read_yaml(path, intake.CONFIG)
    if raw is None:  # an empty file (or only comments) would silently be every default
        raise ConfigError(
            f"{path} is empty; a config holds model:, training: and/or data: sections (or use a preset "
            f"name: {', '.join(available_presets())})"
        )
    header = RESOLVED_HEADER.encode("utf-8")
    record = intake.read_prefix(path, intake.CONFIG, len(header)) == header  # a run's config.yaml
    return Config.from_dict(raw, source=str(path), record=record).with_overrides(list(overrides))


# The first line of a run directory's record of its resolved config (rundir.CONFIG_NAME: written at every
# start of `train`, and by `import`): how outdir tells a run's config.yaml from a hand-written one.
RESOLVED_HEADER = "# Resolved config of this run (every field; written by `mamba3lite train`).\n"


def write_resolved_config(cfg: Config, path: str | Path) -> None:
    """Write the fully resolved config (every field, defaults included) as YAML, atomically."""
    from mamba3lite.atomicfile import atomic_write_bytes

    atomic_write_bytes(Path(path), (RESOLVED_HEADER + cfg.to_yaml()).encode("utf-8"))
