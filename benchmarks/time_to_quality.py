"""What five minutes buy: `mamba3lite quickstart` run end to end per recipe, side by side in one run.

    python benchmarks/time_to_quality.py [--minutes 5] [--source stdlib] [--seeds 0]
                                         [--recipes today,tokenizer,muon,shape,all] [--out DIR] [--plot]
                                         [--no-transformer] [--transformer-after all]
    python benchmarks/time_to_quality.py --report OUT/results.json [printed-output.txt ...]

Each recipe is a fresh `mamba3lite quickstart` in its own work directory (so each pays for its data
preparation, as a new user does), one after the other, never two at once (they would share the cores),
in an order that turns by one recipe from seed to seed (a shared machine's speed drifts over an hour):

    today      --config tiny --tokenizer gpt2, AdamW: the quickstart before issue 25
    tokenizer  the tiny shape and AdamW, with a 4,096-id BPE fit to the train split
    muon       the tiny shape and GPT-2's vocabulary, with Muon
    shape      the recipe's shape chosen by measurement and batch, GPT-2's vocabulary, AdamW
    all        the recipe: its BPE, Muon, the measured shape (what `make quickstart` runs)

and the levers, each the `all` recipe plus --set items (or a quickstart option):

    eos_reset  model.reset_at_eos: each document's scan starts from a zero state
    window256  windows of 256 tokens, 4 per step (the recipe's 8 x 128: the same tokens per step)
    wsd        the warmup-stable-decay schedule, ending at lr / 100 instead of the cosine's lr / 10
    average    the final evaluation on an exponential moving average of the weights (decay 0.99)
    vocab8k    a BPE of 8,192 ids instead of the recipe's 4,096

and the shape rule's sweep: `pin128x2`, `pin192x3`, ... the `all` recipe with its shape pinned to one of
the quickstart's shapes (recipe.SHAPES) instead of the rule's choice. Compare them with `--base`, one of
them as the base (the shape rule's constant, tokens per parameter, is fit from which shape wins at what
tokens per parameter on this machine).

After each run of a recipe in --transformer-after (`all` by default), a `transformer` row: the baseline
Transformer (baseline_transformer.py: a pre-norm GPT of the run's width, depth and SwiGLU width, heads of
64) trained by ttq_transformer.py with that run's recipe (its data, windows, batch, optimizer split,
schedule, dtype and thread count) for that run's training time, by the clock as the quickstart trains,
and evaluated by the same evaluation on the whole val split. The summary then prints, per seed
and as the mean over seeds, Mamba-3's tokens/s over the Transformer's (the CPU step target: >= 0.9x),
how much lower Mamba-3's bits/byte is than the Transformer's (target: >= 3%) and Mamba-3 / xz given the
train text.

The table: the final bits per byte on the whole val split, its ratio to xz given the training text (the
number to beat, report/baselines.py, on the same val text), zlib's and xz's, training tokens/s, the
steps and the shape, per recipe and seed (mean over seeds in the last rows). `--plot` draws bits per
byte against wall time (the periodic evaluations of each run, from its metrics.jsonl, and the final one)
into OUT/time_to_quality.png. Then each lever against the `all` run of the same seed: the mean change in
bits/byte, the seeds it won and its tokens/s over the recipe's (a lever is kept only where it wins on
both corpora). `--report` prints the tables again from a results.json, or from the JSON lines a run
printed as each quickstart ended (all there is of a run stopped early; one path per corpus). The machine
is shared: quote ratios, and say what else ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mamba3lite.quickstart.recipe import SHAPES

RECIPES = {
    "today": ["--config", "tiny", "--tokenizer", "gpt2"],
    "tokenizer": ["--config", "tiny"],
    "muon": ["--config", "tiny", "--tokenizer", "gpt2", "--set", "training.optimizer=muon"],
    "shape": ["--tokenizer", "gpt2", "--set", "training.optimizer=adamw"],
    "all": [],
    "eos_reset": ["--set", "model.reset_at_eos=true"],
    # the recipe's global_batch_size is its micro batch: set with it, or a step would be 2 micro batches
    "window256": [
        "--set",
        "training.max_seq_len=256",
        "--set",
        "training.micro_batch_size=4",
        "--set",
        "training.global_batch_size=4",
    ],
    # ends at the recipe's lr 4e-3 / 100
    "wsd": ["--set", "training.lr_schedule=wsd", "--set", "training.min_lr=4e-5"],
    "average": ["--set", "training.ema_decay=0.99"],
    "vocab8k": ["--vocab", "8192"],
    **{f"pin{s}": [a for item in s.overrides() for a in ("--set", item)] for s in SHAPES},
}


def run_one(name: str, extra: list[str], minutes: float, source: str, seed: int, out: Path) -> dict:
    """One quickstart; its numbers (parsed from the summary and the run directory)."""
    work = out / f"{name}-seed{seed}"
    seed_set = f"training.seed={1337 + seed}"
    cmd = [sys.executable, "-m", "mamba3lite", "quickstart", "--minutes", str(minutes),
           "--workdir", str(work), "--source", source, "--set", seed_set, *extra]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.time() - t0
    (out / f"{name}-seed{seed}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"recipe": name, "seed": seed, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    text = proc.stdout
    run = Path(re.search(r"run directory (\S+)", text).group(1))
    bpb = float(re.search(r"after     step \d+: val loss [\d.]+, ([\d.]+) bits/byte", text).group(1))
    base_file = next((work / "baselines").glob("*.json"), None)
    base = json.loads(base_file.read_text()) if base_file else {}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train" and not r.get("warmup_window")]
    curve = [(r["time"] - t0, r["val_bpb"]) for r in rows if r.get("kind") == "eval" and "val_bpb" in r]
    recipe = re.search(r"recipe    vocab ([\d,]+), (\d+x\d+) .*?, (\w+) lr", text)
    return {
        "recipe": name, "seed": seed, "bpb": bpb, "wall_s": wall, "curve": [*curve, (wall, bpb)],
        "xz_given_train": base.get("xz_given_train"), "xz": base.get("xz"), "zlib": base.get("zlib"),
        "tokens_per_s": statistics.median([r["tokens_per_s"] for r in train]) if train else None,
        "steps": int(re.search(r"steps         \d+ -> (\d+)", text).group(1)),
        "vocab": recipe.group(1) if recipe else "?", "shape": recipe.group(2) if recipe else "?",
        "optimizer": recipe.group(3) if recipe else "?", "run": str(run),
        "threads": int(m.group(1)) if (m := re.search(r"^threads\s+(\d+)", text, re.M)) else None,
    }  # fmt: skip


def run_transformer(pair: dict, out: Path) -> dict:
    """The Transformer row after the Mamba-3 run `pair` (ttq_transformer.py on its run directory)."""
    name = "transformer" if pair["recipe"] == "all" else f"transformer-{pair['recipe']}"
    cmd = [sys.executable, str(Path(__file__).with_name("ttq_transformer.py")), pair["run"]]
    cmd += ["--threads", str(pair["threads"])] if pair.get("threads") else []
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (out / f"{name}-seed{pair['seed']}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"recipe": name, "seed": pair["seed"], "error": why}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    keep = ("bpb", "tokens_per_s", "steps", "vocab", "shape", "optimizer", "train_s",
            "budget_s", "threads")  # fmt: skip
    return {
        "recipe": name, "seed": pair["seed"], "pairs_with": pair["recipe"], "wall_s": time.time() - t0,
        "curve": [], **{k: r[k] for k in keep}, **{k: pair.get(k) for k in ("xz_given_train", "xz", "zlib")},
    }  # fmt: skip


def table(results: list[dict]) -> str:
    head = ("| recipe | seed | vocab | shape | optimizer | steps | tokens/s | bits/byte | / xz given train | "
            "xz given train | xz -9e | zlib -9 |")  # fmt: skip
    lines = [head, "|" + "---|" * 12]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['seed']} | error: {r['error']} |" + " |" * 9)
            continue
        ratio = r["bpb"] / r["xz_given_train"] if r.get("xz_given_train") else float("nan")
        cells = [r["recipe"], r["seed"], r["vocab"], r["shape"], r["optimizer"], f"{r['steps']:,}",
                 f"{r['tokens_per_s'] or 0:,.0f}", f"{r['bpb']:.3f}", f"{ratio:.3f}x",
                 *(f"{r.get(k) or 0:.3f}" for k in ("xz_given_train", "xz", "zlib"))]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    by = {}
    for r in results:
        if "error" not in r:
            by.setdefault(r["recipe"], []).append(r)
    for name, rs in by.items():
        if len(rs) > 1:
            m = statistics.mean(x["bpb"] for x in rs)
            sd = statistics.stdev(x["bpb"] for x in rs)
            goal = next((x["xz_given_train"] for x in rs if x.get("xz_given_train")), float("nan"))
            lines.append(f"| {name} (mean of {len(rs)}) | | | | | | | {m:.3f} ± {sd:.3f} | "
                         f"{_cell(m / goal, '.3f', 'x')} | | | |")  # fmt: skip
    return "\n".join(lines)


def levers(results: list[dict], base: str = "all") -> list[dict]:
    """Each lever recipe against `base` run with the same seed: the mean over those seeds of the change
    in bits/byte (negative: the lever is better), the seeds it won, and its tokens/s over the base's."""
    rows = {(r["recipe"], r["seed"]): r for r in results if "error" not in r}
    names = dict.fromkeys(r for r, _ in rows if r != base and "pairs_with" not in rows[(r, _)])
    out = []
    for name in names:
        pairs = [(rows[(name, s)], rows[(base, s)]) for (n, s) in rows if n == name and (base, s) in rows]
        if not pairs:
            continue
        diffs = [lever["bpb"] - b["bpb"] for lever, b in pairs]
        speeds = [(lever["tokens_per_s"] or math.nan) / (b["tokens_per_s"] or math.nan) for lever, b in pairs]
        out.append({
            "recipe": name, "seeds": len(pairs), "won": sum(d < 0 for d in diffs),
            "mean_change": statistics.mean(diffs), "relative": statistics.mean(
                d / b["bpb"] for d, (_, b) in zip(diffs, pairs, strict=True)),
            "sd_change": statistics.stdev(diffs) if len(diffs) > 1 else math.nan,
            "tokens_per_s": statistics.mean(speeds),
        })  # fmt: skip
    return out


def lever_table(results: list[dict], base: str = "all") -> str:
    """`levers` as a table: a lever is kept only where it wins on every corpus (the caller compares)."""
    head = f"| lever | seeds | bits/byte vs {base} (mean ± sd) | relative | seeds won | tokens/s vs {base} |"
    lines = [head, "|" + "---|" * 6]
    for x in levers(results, base):
        cells = [x["recipe"], x["seeds"], f"{x['mean_change']:+.3f} ± {_cell(x['sd_change'], '.3f', '')}",
                 f"{100 * x['relative']:+.1f}%", f"{x['won']} of {x['seeds']}",
                 _cell(x["tokens_per_s"], ".2f", "x")]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def read_results(path: Path) -> list[dict]:
    """The runs of an earlier invocation: its results.json, or its printed output (one JSON object a
    line, as each run ends: what is there if it was stopped early)."""
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def report(results: list[dict], transformer: bool, base: str = "all") -> None:
    print(table(results))
    if transformer:
        print("\nMamba-3 against the Transformer trained after it (same data, recipe, time and evaluation)\n")
        print(summary(results))
    if len({r["recipe"] for r in results if "pairs_with" not in r and "error" not in r}) > 1:
        print(f"\nEach lever against {base} run with the same seed\n")
        print(lever_table(results, base))


def summary(results: list[dict]) -> str:
    """Mamba-3 against the Transformer trained after it: per seed, and the mean over seeds."""
    rows = {(r["recipe"], r["seed"]): r for r in results if "error" not in r}
    pairs = [(rows[(t["pairs_with"], t["seed"])], t) for t in rows.values() if "pairs_with" in t]
    if not pairs:
        return "(no Transformer row to compare with)"
    head = ("| Mamba-3 recipe | seed | Mamba-3 / Transformer tokens/s | Mamba-3 bits/byte below the "
            "Transformer's | Mamba-3 / xz given train | Transformer / xz given train |")  # fmt: skip
    lines, by = [head, "|" + "---|" * 6], {}
    for m, t in pairs:
        goal = m.get("xz_given_train") or float("nan")
        speed = (m["tokens_per_s"] or float("nan")) / t["tokens_per_s"]  # None: no window past start-up
        ratios = (speed, 1 - m["bpb"] / t["bpb"], m["bpb"] / goal,
                  t["bpb"] / goal)  # fmt: skip
        by.setdefault(m["recipe"], []).append(ratios)
        lines.append(_summary_row(m["recipe"], m["seed"], ratios))
    targets = []
    for name, xs in by.items():
        mean = tuple(statistics.mean(c) for c in zip(*xs, strict=True))
        lines.append(_summary_row(f"{name} (mean of {len(xs)})", "", mean))
        speed, lower = mean[:2]
        targets.append(
            f"{name}: Mamba-3 >= 0.9x the Transformer's tokens/s: {_cell(speed, '.2f', 'x')} -> "
            f"{'met' if speed >= 0.9 else 'NOT met'}; bits/byte >= 3% below the Transformer's: "
            f"{_cell(100 * lower, '.1f', '%')} -> {'met' if lower >= 0.03 else 'NOT met'}"
        )
    return "\n".join([*lines, "", *targets])


def _summary_row(name: str, seed: object, ratios: tuple[float, ...]) -> str:
    speed, lower, vs_xz, t_xz = ratios
    cells = [_cell(speed, ".2f", "x"), _cell(100 * lower, ".1f", "%"), _cell(vs_xz, ".3f", "x"),
             _cell(t_xz, ".3f", "x")]  # fmt: skip
    return f"| {name} | {seed} | " + " | ".join(cells) + " |"


def _cell(x: float, spec: str, unit: str) -> str:
    """`x` formatted, or "n/a" for nan (a number the run did not produce)."""
    return "n/a" if math.isnan(x) else f"{x:{spec}}{unit}"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if "error" not in r and r["curve"]:  # the Transformer rows have their final point only: none
            xs, ys = zip(*r["curve"])
            ax.plot([x / 60 for x in xs], ys, marker="o", label=f"{r['recipe']} (seed {r['seed']})")
    goal = next((r["xz_given_train"] for r in results if r.get("xz_given_train")), None)
    if goal:
        ax.axhline(goal, color="k", linestyle="--", label=f"xz given the train text ({goal:.3f})")
    ax.set_xlabel("wall time of the quickstart (min)")
    ax.set_ylabel("validation bits per byte")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--source", default="stdlib")
    p.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1,2")
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated of {', '.join(RECIPES)}")
    p.add_argument("--extra", action="append", default=[], help="one more quickstart argument, to all")
    p.add_argument("--out", default="ttq-runs")
    p.add_argument("--plot", action="store_true")
    p.add_argument("--transformer", action=argparse.BooleanOptionalAction, default=True,
                   help="a Transformer row after each run of a recipe in --transformer-after")  # fmt: skip
    p.add_argument("--transformer-after", default="all", help="comma-separated recipes it pairs with")
    p.add_argument("--base", default="all", help="the recipe each lever is compared with")
    p.add_argument("--report", nargs="+", type=Path, default=None, metavar="PATH",
                   help="print the tables of earlier runs instead (results.json, or the printed output "
                   "of a run stopped early), one corpus per path")  # fmt: skip
    args = p.parse_args()
    if args.report:
        for path in args.report:
            print(f"\n## {path}\n")
            report(read_results(path), transformer=True, base=args.base)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    names = args.recipes.split(",")
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        # The order turns by one recipe per seed: a machine that slows (or speeds up) over a block of runs
        # then shifts no recipe's mean more than another's.
        for name in names[i % len(names) :] + names[: i % len(names)]:
            results.append(run_one(name, RECIPES[name] + args.extra, args.minutes, args.source, seed, out))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "curve"}), flush=True)
            if args.transformer and name in args.transformer_after.split(",") and "error" not in results[-1]:
                results.append(run_transformer(results[-1], out))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "curve"}), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n{platform.node()}, {os.cpu_count()} CPUs, {args.minutes:g} min each, source {args.source}\n")
    report(results, args.transformer, args.base)
    if args.plot:
        plot(results, out / "time_to_quality.png")
        print(f"\nplot: {out / 'time_to_quality.png'}")


if __name__ == "__main__":
    main()
