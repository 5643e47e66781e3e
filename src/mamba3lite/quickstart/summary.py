"""The quickstart's closing summary: its numbers beside the compressors', where things are, what next."""

from __future__ import annotations

import shlex

from mamba3lite.quickstart.options import (
    DEFAULT_CONFIG,
    DEFAULT_SOURCE,
    DEFAULT_WORKDIR,
    QuickstartResult,
    TrainingShare,
)
from mamba3lite.report.baselines import as_text


def eval_scope(ev: dict) -> str:
    """What a before/after evaluation is a mean over: "the whole val split, 570 windows", or "32 train
    windows" (a few windows of the train split, when val is too small for one)."""
    if ev.get("whole_split"):
        return f"the whole {ev['split']} split, {ev['windows']:,} windows"
    return f"{ev['windows']:,} {ev['split']} windows"


def fmt_eval(ev: dict) -> str:
    bpb = f", {ev['bits_per_byte']:.3f} bits/byte" if ev.get("bits_per_byte") is not None else ""
    return f"{ev['split']} loss {ev['loss']:.3f}{bpb} (on {eval_scope(ev)})"


def training_lines(t: TrainingShare) -> list[str]:
    """The share of the budget that trained, and where the rest went; the schedule's end, or why it was
    not reached."""
    share = t.trained_s / t.minutes_s if t.minutes_s > 0 else 0.0
    lines = [
        f"training      {t.trained_s / 60:.2f} min, {share:.0%} of the {t.minutes_s / 60:g}-minute budget "
        f"(before it {t.before_s / 60:.2f} min of data, recipe and calibration; after it the evaluation, "
        "sample and plot)"
    ]
    if t.progress < 1.0:
        lines.append(f"schedule      {t.progress:.0%} done, ended early: {t.short_why}")
    elif t.short_why:
        lines.append(f"schedule      done, but training was short: {t.short_why}")
    else:
        lines.append("schedule      done at the deadline: warmup and decay followed the clock")
    return lines


def summary_text(r: QuickstartResult) -> str:
    """The closing summary: numbers, where things are, what to try next (commands that name this run's
    --workdir, --config, --set and --max-docs when they are not the defaults, so they act on this run)."""
    s, e, o = r.start_eval, r.end_eval, r.options

    def bpb(ev: dict) -> str:
        return f"{ev['bits_per_byte']:.3f}" if ev.get("bits_per_byte") is not None else "n/a"

    run, data = shlex.quote(str(r.run_dir)), shlex.quote(str(r.data_path))
    config = ["--config", o.config, *(a for item in o.overrides for a in ("--set", item))]
    again = ["mamba3lite", "quickstart", "--minutes", "5"]  # without these options it is another run
    again += ["--workdir", o.workdir] if o.workdir != DEFAULT_WORKDIR else []
    again += ["--source", o.source] if o.source != DEFAULT_SOURCE else []
    again += ["--tokenizer", o.tokenizer] if o.tokenizer != "trained" else []
    again += ["--vocab", str(o.vocab)] if o.vocab is not None else []
    again += config if config != ["--config", DEFAULT_CONFIG] else []
    again += ["--max-docs", str(o.max_docs)] if o.max_docs is not None else []
    model_bpb = e.get("bits_per_byte") if e["split"] == "val" else None
    if e["split"] == "val":
        loss = f"val loss      {s['loss']:.3f} -> {e['loss']:.3f} nats/token   "
        where = f"on {eval_scope(e)}, {e['tokens']:,} tokens"
    else:
        loss = f"train loss    {s['loss']:.3f} -> {e['loss']:.3f} nats/token   "
        where = f"on {eval_scope(e)}, {e['tokens']:,} tokens: no usable val split"
    lines = [
        "",
        "── quickstart summary ─────────────────────────────────────────────────────────",
        f"time          {r.seconds / 60:.1f} min",
        *training_lines(r.training),
        f"steps         {r.start_step} -> {r.end_step}   tokens seen {r.tokens_seen:,}"
        + ("   (stopped by signal)" if r.training.short_why == "stopped by signal" else ""),
        f"{loss}(bits/byte {bpb(s)} -> {bpb(e)}; {where})",
        f"bits/byte     {as_text(model_bpb, r.baselines)}"
        if r.baselines
        else "bits/byte     (the compressors' numbers are not ready: the next run shows them)",
        f"dataset       {data}" + ("  (reused)" if r.data_reused else ""),
        f"run directory {run}   (checkpoints, config.yaml, metrics.jsonl)",
        f"plot          {r.plot}" if r.plot else "plot          (none: pip install 'mamba3lite[plot]')",
        "",
        "next:",
        f"  mamba3lite generate --checkpoint-dir {run} --prompt 'import' --max-new-tokens 200",
        f"  mamba3lite eval --checkpoint-dir {run} --data-path {data}",
        f"  mamba3lite inspect {run}",
        f"  mamba3lite train --config {shlex.quote(str(r.run_dir / 'config.yaml'))} --checkpoint-dir {run} "
        f"--max-steps {r.end_step + 500} --set training.time_budget_minutes=0   (500 steps more, by steps)",
        f"  {shlex.join(again)}   (again: continues this run)",
    ]
    return "\n".join(lines)
