"""The console sink: each row as one line, in the seed's format for train rows.

    step=     50 | loss=3.2500 | ppl=25.79 | lr=3.00e-04 | tps=12,346 | gnorm=0.750 | data_wait=0.4% | ...
                 | tokens=1,000
    eval step=     50 | val_loss=3.1000 | val_ppl=22.20 | val_bpb=1.2000 | subset 16 of 570 val windows
    eval step=     50 | piqa acc=0.5400 acc_norm=0.5500            (downstream tasks: "<task>/<metric>")
    [rollback] step=40: ...                                        (events)

`format_console(row)` is the pure formatter (also used by `inspect`'s downstream summary through
`downstream_summary`); `ConsoleSink` prints it through a print function (`tqdm.write` while a progress
bar is shown, so the bar is not torn).
"""

from __future__ import annotations

from collections.abc import Callable


def _fmt_int(x: float) -> str:
    return f"{x:,.0f}"


def format_console(row: dict) -> str:
    """The one-line console form of a metrics row (train rows in the seed's format, plus new fields)."""
    kind = row.get("kind")
    if kind == "train":
        return _format_train(row)
    if kind == "eval" and "val_loss" not in row:  # downstream tasks: "<task>/<metric>" keys
        return f"eval step={row['step']:>7} | " + downstream_summary(row)
    if kind == "eval":
        parts = [
            f"eval step={row['step']:>7}",
            f"val_loss={row['val_loss']:.4f}",
            f"val_ppl={row['val_ppl']:.2f}",
        ]
        if row.get("val_bpb") is not None:
            parts.append(f"val_bpb={row['val_bpb']:.4f}")
        if (windows := val_windows_label(row)) is not None:
            parts.append(windows)
        return " | ".join(parts)
    return f"[{row.get('event', 'event')}] step={row['step']}: {row.get('message', '')}"


def val_windows_label(row: dict) -> str | None:
    """What an evaluation row's numbers are a mean over: "subset 16 of 570 val windows" (the same evenly
    spread windows at every evaluation of the run, training.eval_batches), "whole val split, 570
    windows", "16 val windows" (a row that does not record the split's size); None without a count."""
    scored, whole = row.get("val_windows"), row.get("val_split_windows")
    if not isinstance(scored, int):
        return None
    if not isinstance(whole, int):
        return f"{scored:,} val windows"
    if scored >= whole:
        return f"whole val split, {whole:,} windows"
    return f"subset {scored:,} of {whole:,} val windows"


def _format_train(row: dict) -> str:
    parts = [
        f"step={row['step']:>7}",
        f"loss={row['loss']:.4f}" if row.get("loss") is not None else "loss=   n/a",
        f"ppl={row['ppl']:.2f}" if row.get("ppl") is not None else "ppl=n/a",
        f"lr={row['lr']:.2e}",
        f"tps={_fmt_int(row['tokens_per_s'])}",
    ]
    if row.get("grad_norm") is not None:
        parts.append(f"gnorm={row['grad_norm']:.3f}")
    if row.get("data_wait") is not None:
        parts.append(f"data_wait={100 * row['data_wait']:.1f}%")
    if row.get("skipped"):
        parts.append(f"skipped={row['skipped']}")
    if row.get("mfu") is not None:
        parts.append(f"mfu={100 * row['mfu']:.1f}%")
    if row.get("peak_mem_mb") is not None:
        parts.append(f"mem={_fmt_int(row['peak_mem_mb'])}MB")
    parts.append(f"tokens={_fmt_int(row['tokens'])}")
    if row.get("warmup_window"):
        parts.append("(start-up window)")
    return " | ".join(parts)


def downstream_summary(row: dict) -> str:
    """ "piqa acc=0.5400 acc_norm=0.5500 | lambada acc=0.0100 perplexity=4021" from a row's
    "<task>/<metric>" keys (items, "<task>/n", left out)."""
    tasks: dict[str, list[str]] = {}
    for key, value in row.items():
        task, sep, metric = key.partition("/")
        if sep and metric != "n" and isinstance(value, (int, float)):
            tasks.setdefault(task, []).append(
                f"{metric}={value:.4f}" if abs(value) < 1e4 else f"{metric}={value:.4g}"
            )
    return " | ".join(f"{task} {' '.join(parts)}" for task, parts in tasks.items())


class ConsoleSink:
    """Prints each row as one line (through `print_fn`, e.g. tqdm.write while a bar is shown)."""

    def __init__(self, print_fn: Callable[[str], None] | None = None) -> None:
        self.print_fn = print_fn or (lambda s: print(s, flush=True))

    def write(self, row: dict) -> None:
        self.print_fn(format_console(row))

    def close(self) -> None:
        pass
