"""`mamba3lite plot`: training curves from metrics.jsonl to a PNG (matplotlib, an optional extra)."""

from __future__ import annotations

from pathlib import Path

from mamba3lite.errors import ConfigError, DataError
from mamba3lite.report.metrics import ema
from mamba3lite.rundir import PLOT_NAME
from mamba3lite.train.metrics.console import val_windows_label
from mamba3lite.train.metrics.jsonl import read_metrics

_EVENT_STYLE = {"rollback": ("tab:red", "rollback"), "resume": ("tab:green", "resume")}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("plotting needs matplotlib; fix: pip install 'mamba3lite[plot]'") from e
    return plt


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss (raw, smoothed, validation), learning rate, tokens/s and, when the run scored downstream
    tasks, their accuracy against step; mark resume and rollback events. Returns the PNG's path
    (default: RUN_DIR/metrics.png)."""
    run_dir = Path(run_dir)
    m = read_metrics(run_dir)
    if not m.train and not m.eval:
        raise DataError(f"{run_dir} has no train or eval rows in metrics.jsonl yet: nothing to plot")
    out = _png_path(run_dir, out)
    plt = _pyplot()

    # Downstream benchmark rows (training.eval_tasks: "<task>/acc" keys) get a panel of their own.
    task_acc = sorted({k for r in m.eval if "val_loss" not in r for k in r if k.endswith("/acc")})
    heights = [3, 1, 1] + ([2] if task_acc else [])
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(9, 9 + 2 * bool(task_acc)),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
    )
    ax_loss, ax_lr, ax_tps = axes[:3]
    if task_acc:
        _draw_task_accuracy(axes[3], m, task_acc)
    _draw_loss(ax_loss, m)
    _draw_lr_and_throughput(ax_lr, ax_tps, m)
    axes[-1].set_xlabel("step")
    _mark_events(axes, ax_loss, m)
    _tokens_axis(ax_loss, m)
    ax_loss.legend(loc="upper right")
    fig.suptitle(f"mamba3lite run: {run_dir.name}")
    fig.tight_layout()
    _save(plt, fig, out)
    return out


def _png_path(run_dir: Path, out: str | Path | None) -> Path:
    """Where the PNG goes: `out` (a directory: inside it), default RUN_DIR/metrics.png; ConfigError for
    another suffix."""
    out = Path(out) if out is not None else (run_dir if run_dir.is_dir() else run_dir.parent) / PLOT_NAME
    if out.is_dir():  # `-o DIR`: the PNG goes inside it (renaming a temp file onto a directory fails)
        out = out / PLOT_NAME
    if out.suffix.lower() != ".png":
        raise ConfigError(f"plot output must be a .png file, got {out}")
    return out


def _draw_task_accuracy(ax, m, task_acc: list[str]) -> None:
    for key in task_acc:
        pts = [(r["step"], r[key]) for r in m.eval if isinstance(r.get(key), (int, float))]
        ax.plot(*zip(*pts), "o-", lw=1.5, label=key.split("/")[0])
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")


def _draw_loss(ax, m) -> None:
    steps = [r["step"] for r in m.train if "loss" in r]
    losses = [r["loss"] for r in m.train if "loss" in r]
    if steps:
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=1, label="train loss")
        windows = [r.get("window_steps", 1) for r in m.train if "loss" in r]
        ax.plot(steps, ema(losses, steps=windows), color="tab:blue", lw=2, label="train loss (EMA)")
    val = [r for r in m.eval if "val_loss" in r]
    if val:
        on = f" ({windows})" if (windows := val_windows_label(val[-1])) else ""
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color="tab:orange", lw=2,
                label=f"validation loss{on}")  # fmt: skip
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)


def _draw_lr_and_throughput(ax_lr, ax_tps, m) -> None:
    lr = [(r["step"], r["lr"]) for r in m.train if "lr" in r]
    if lr:
        ax_lr.plot(*zip(*lr), color="tab:purple")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    # The start-up window's throughput includes set-up time: drawn apart, never joined to the rest.
    tps = [
        (r["step"], r["tokens_per_s"]) for r in m.train if "tokens_per_s" in r and not r.get("warmup_window")
    ]
    if tps:
        ax_tps.plot(*zip(*tps), color="tab:green")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.grid(alpha=0.3)


def _mark_events(axes, ax_loss, m) -> None:
    """A dashed line on every panel at each resume and rollback; labelled once, in the loss legend."""
    seen = set()
    for e in m.events:
        style = _EVENT_STYLE.get(e.get("event", ""))
        if style is None:
            continue
        color, name = style
        for ax in axes:
            ax.axvline(
                e["step"],
                color=color,
                ls="--",
                lw=1,
                label=name if ax is ax_loss and name not in seen else None,
            )
        seen.add(name)


def _tokens_axis(ax_loss, m) -> None:
    """Tokens on a secondary axis: the step -> tokens map is monotone within one timeline."""
    pts = sorted({(r["step"], r["tokens"]) for r in m.train + m.eval if r.get("tokens") is not None})
    if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
        import numpy as np

        s_arr, t_arr = (np.array(v, dtype=float) for v in zip(*pts))
        top = ax_loss.secondary_xaxis(
            "top",
            functions=(
                lambda s: np.interp(s, s_arr, t_arr) / 1e6,
                lambda t: np.interp(t, t_arr / 1e6, s_arr),
            ),
        )
        top.set_xlabel("tokens (millions)")


def _save(plt, fig, out: Path) -> None:
    """Write the PNG through a temp file beside it, renamed in; the figure is closed either way."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=100)
        tmp.replace(out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)  # after a failed save or rename: no temp file is left behind
