"""TrainingLogger: one call per optimizer step, true window averages, many sinks.

The trainer calls `logger.log_step(step, ...)` after EVERY optimizer step; the logger accumulates and,
when `step % log_every == 0` (or on `flush()`), emits one "train" row:

    loss          mean of the window's step losses (steps whose every micro-step was skipped excluded)
    ppl           exp(window mean loss): exp after averaging (Jensen: <= the mean of per-step ppls)
    lr            the learning rate of the window's last step
    grad_norm     mean pre-clip global gradient norm over the window (grad_norm_max: its max)
    skipped       non-finite micro-steps skipped in the window (NaN guard)
    tokens_per_s  tokens actually processed in the window (micro-batch × seq × accumulation × world,
                  per step, skipped micro-steps included: they ran) / the window's wall time
    mfu           model FLOPs/token × tokens_per_s / peak FLOP/s (when the peak is known)
    peak_mem_mb   peak accelerator memory (CUDA) or peak process RSS (CPU)
    warmup_window true for the first window after start/resume/rollback: it includes start-up costs
                  (compile, data open, checkpoint load) and is excluded from `steady_tokens_per_s()`

Differences from the seed's logger: a window averages every loss in it (the seed's held one), tokens/s
counts the tokens processed (the seed assumed a count), the first window after a start is marked, and
a W&B failure of any kind is a warning (the seed crashed on any but ImportError).

Sinks (STYLE rule 11: "off" is a sink that does nothing, not an `if` in the loop):
- ConsoleSink: the seed's line `step= … | loss= … | ppl= … | lr= … | tps= …` plus the new fields;
- JsonlSink: DIR/metrics.jsonl, append-only, flushed per row; rows: kind "train" | "eval" | "event",
  with step, time (unix s), tokens (cumulative tokens seen). `supersede_after(S)` marks rows of an
  abandoned timeline (step > S) with "superseded": true, rewriting the file atomically;
- TensorBoardSink when `tensorboard` is installed (DIR/tb);
- WandbSink when WANDB_PROJECT is set: any failure (package missing, auth, network) is a warning, the
  run id is exposed (`wandb_run_id`) for the checkpoint, so a resumed run continues the same W&B run.
A tqdm progress bar (steps, ETA, loss) is shown only when stderr is a TTY.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mamba3lite.report.metrics import METRICS_NAME


class Sink(Protocol):
    def write(self, row: dict) -> None: ...
    def close(self) -> None: ...


class NullSink:
    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _fmt_int(x: float) -> str:
    return f"{x:,.0f}"


def format_console(row: dict) -> str:
    """The one-line console form of a metrics row (train rows in the seed's format, plus new fields)."""
    kind = row.get("kind")
    if kind == "train":
        parts = [
            f"step={row['step']:>7}",
            f"loss={row['loss']:.4f}" if row.get("loss") is not None else "loss=   n/a",
            f"ppl={row['ppl']:.2f}" if row.get("ppl") is not None else "ppl=n/a",
            f"lr={row['lr']:.2e}",
            f"tps={_fmt_int(row['tokens_per_s'])}",
        ]
        if row.get("grad_norm") is not None:
            parts.append(f"gnorm={row['grad_norm']:.3f}")
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
        return " | ".join(parts)
    return f"[{row.get('event', 'event')}] step={row['step']}: {row.get('message', '')}"


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


class JsonlSink:
    """DIR/metrics.jsonl: one JSON object per line, appended and flushed per row (the source of truth
    for `plot` and `inspect`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run)

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row, allow_nan=False, default=_json_default) + "\n")
        self._f.flush()

    def supersede_after(self, step: int) -> int:
        """Mark every row with step > `step` as superseded (an abandoned timeline after a resume or
        rollback to `step`); the file is rewritten atomically. Returns how many rows were marked."""
        from mamba3lite import intake
        from mamba3lite.data.shards import atomic_write_bytes

        self._f.close()
        # Through the border reader: a line of damaged bytes, a 5,000-digit number or deep nesting is a
        # bad line (dropped, like a torn last line from a crash), never a ValueError or RecursionError.
        lines = list(intake.iter_jsonl(self.path, intake.METRICS)) if self.path.exists() else []
        out, marked = [], 0
        for line in lines:
            row = line.value
            if line.problem is not None or not isinstance(row, dict) or not isinstance(row.get("step"), int):
                continue
            if row["step"] > step and not row.get("superseded"):
                row["superseded"] = True
                marked += 1
            out.append(json.dumps(row, default=_json_default))
        atomic_write_bytes(self.path, ("\n".join(out) + "\n" if out else "").encode("utf-8"))
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        return marked

    def close(self) -> None:
        self._f.close()


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that a crash left without its newline, so the next row is not glued onto it
    (which would make both unreadable). Complete rows are never touched."""
    if not path.exists():
        return
    from mamba3lite import intake

    size = intake.regular_file_size(path, intake.METRICS)  # a link to /dev/zero is never read
    with open(path, "rb+") as f:
        # Only the tail is read (a log of a long run is large): back from the end to the last newline.
        end, chunk = size, 1 << 16
        while end > 0:
            f.seek(max(end - chunk, 0))
            block = f.read(end - max(end - chunk, 0))
            if end == size and block.endswith(b"\n"):
                return  # the last line is whole
            if (i := block.rfind(b"\n")) >= 0:
                end = max(end - chunk, 0) + i + 1
                break
            end = max(end - chunk, 0)
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


class TensorBoardSink:
    """Scalars to DIR/tb when `tensorboard` is installed (else a warning and nothing).

    The event file is opened at the first train or eval row, not when the sink is built: a `train` that
    is refused after its logger exists (a checkpoint that does not fit the model, say) leaves no
    `tb/events...` file in the run directory."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._w = None
        self._failed = False
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._writer_cls = SummaryWriter
        except Exception as e:  # ImportError (no tensorboard) or a broken install: never fatal
            self._failed = True
            warnings.warn(f"TensorBoard disabled ({e}); `pip install tensorboard` to enable", stacklevel=2)

    def _writer(self):
        if self._w is None and not self._failed:
            try:
                self._w = self._writer_cls(log_dir=str(self.log_dir))
            except Exception as e:  # an unwritable tb/: the run goes on without TensorBoard
                self._failed = True
                warnings.warn(f"TensorBoard disabled ({type(e).__name__}: {e})", stacklevel=3)
        return self._w

    def write(self, row: dict) -> None:
        if row.get("kind") == "event" or (w := self._writer()) is None:
            return
        prefix = "train" if row["kind"] == "train" else "eval"
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time"):
                w.add_scalar(f"{prefix}/{k}", v, row["step"])
        w.flush()  # a row is on disk when it is written, as in metrics.jsonl

    def close(self) -> None:
        if self._w is not None:
            self._w.close()


class WandbSink:
    """Weights & Biases when WANDB_PROJECT is set. Any failure (package missing, auth, network, a
    failing log call) is a warning and disables the sink; training never crashes because of W&B.
    `run_id` is stored in checkpoints so a resumed run continues the same W&B run."""

    def __init__(
        self, project: str, *, run_id: str | None = None, config: dict | None = None, name: str | None = None
    ) -> None:
        self.run_id: str | None = None
        self._wandb = None
        self._run = None
        try:
            import wandb

            self._run = wandb.init(
                project=project, id=run_id, resume="allow" if run_id else None, name=name, config=config
            )
            self._wandb = wandb
            self.run_id = getattr(self._run, "id", None) or run_id
        except Exception as e:
            warnings.warn(f"W&B disabled: {type(e).__name__}: {e}", stacklevel=2)

    def write(self, row: dict) -> None:
        if self._wandb is None:
            return
        try:
            if row["kind"] == "event":
                return
            prefix = "train" if row["kind"] == "train" else "eval"
            data = {
                f"{prefix}/{k}": v
                for k, v in row.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")
            }
            self._wandb.log(data, step=row["step"])
        except Exception as e:
            warnings.warn(f"W&B logging failed, disabling it: {type(e).__name__}: {e}", stacklevel=2)
            self._wandb = None

    def close(self) -> None:
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as e:
                warnings.warn(f"W&B finish failed: {e}", stacklevel=2)


class ProgressBar:
    """tqdm bar (steps, ETA, last loss) when `enabled` and stderr is a TTY; otherwise nothing."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True)

    @property
    def print_fn(self) -> Callable[[str], None] | None:
        if self._bar is None:
            return None
        from tqdm import tqdm

        return lambda s: tqdm.write(s)

    def restart(self, step: int) -> None:
        """Count from `step` anew (after a resume or rollback): the rate and ETA are of the steps run
        from now, not of the resumed ones counted as done in no time."""
        if self._bar is not None:
            self._bar.reset(total=self._bar.total)
            self._bar.initial = self._bar.n = step
            self._bar.refresh()

    def update(self, step: int, loss: float | None) -> None:
        if self._bar is not None:
            self._bar.n = step
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def peak_memory_mb(device: Any = None) -> float:
    """Peak CUDA memory allocated on `device` in MB, or the process's peak RSS on CPU."""
    import torch

    if device is not None and getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    except Exception:
        return float("nan")


# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, for MFU.
_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
}


def peak_flops(device: Any, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s for MFU: the override if > 0, else a lookup of the CUDA device name; None on CPU."""
    if override_tflops > 0:
        return override_tflops * 1e12
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16.items() if k in name), None)


@dataclass
class _Window:
    """The steps since the last train row: what the row averages."""

    t0: float  # when the window started (clock seconds; moved forward by excluded time)
    warmup: bool  # the first window after a start, resume or rollback: start-up costs inside
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens: int = 0  # processed in the window
    skipped: int = 0  # micro-steps skipped in the window
    steps: int = 0
    lr: float = float("nan")  # of the last step
    last_step: int | None = None
    tokens_total: int = 0  # cumulative, at the last step


class TrainingLogger:
    """Window accumulator + sinks. Call `log_step` after every optimizer step, `log_eval` after each
    evaluation and `event` for resume/rollback/NaN skips/stop. Rank 0 only: other ranks use
    `TrainingLogger.disabled()`."""

    def __init__(
        self,
        *,
        log_every: int,
        sinks: list[Sink] | None = None,
        jsonl: JsonlSink | None = None,
        flops_per_token: float | None = None,
        peak_flops_per_s: float | None = None,
        device: Any = None,
        progress: ProgressBar | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert log_every >= 1
        self.log_every = log_every
        self.jsonl = jsonl
        self.sinks: list[Sink] = list(sinks or []) + ([jsonl] if jsonl is not None else [])
        self.flops_per_token = flops_per_token
        self.peak_flops_per_s = peak_flops_per_s
        self.device = device
        self.progress = progress
        self.clock = clock
        self.last_row: dict | None = None
        self.wandb_run_id: str | None = next((s.run_id for s in self.sinks if isinstance(s, WandbSink)), None)
        self._steady_tokens = 0
        self._steady_seconds = 0.0
        self.restart_window()

    @classmethod
    def disabled(cls) -> TrainingLogger:
        return cls(log_every=1, sinks=[NullSink()])

    # ------------------------------------------------------------------ window state
    def restart_window(self, step: int | None = None) -> None:
        """Start a fresh window, marked as start-up (call at start, after resume and after rollback, with
        the step training continues from: the progress bar counts from there)."""
        if step is not None and self.progress is not None:
            self.progress.restart(step)
        self._window = _Window(t0=self.clock(), warmup=True)

    def log_step(
        self,
        step: int,
        *,
        loss: float | None,
        lr: float,
        grad_norm: float | None,
        tokens_processed: int,
        tokens_total: int,
        skipped: int = 0,
    ) -> dict | None:
        """Record one optimizer step (`step` = steps completed). loss None: every micro-step of the step
        was skipped. Emits and returns the train row when the window closes, else None."""
        w = self._window
        if loss is not None:
            assert math.isfinite(loss), "non-finite losses are skipped before they reach the logger"
            w.losses.append(float(loss))
        if grad_norm is not None and math.isfinite(grad_norm):
            w.grad_norms.append(float(grad_norm))
        w.tokens += int(tokens_processed)
        w.skipped += int(skipped)
        w.steps += 1
        w.lr = float(lr)
        w.last_step = step
        w.tokens_total = int(tokens_total)
        if self.progress is not None:
            self.progress.update(step, loss)
        if step % self.log_every == 0:
            return self.flush()
        return None

    def flush(self) -> dict | None:
        """Close the current window now (also used for a final partial window). None if it is empty."""
        w = self._window
        if w.steps == 0:
            return None
        now = self.clock()
        elapsed = max(now - w.t0, 1e-9)
        tps = w.tokens / elapsed
        avg = sum(w.losses) / len(w.losses) if w.losses else None
        row: dict[str, Any] = {
            "kind": "train",
            "step": w.last_step,
            "time": now,
            "tokens": w.tokens_total,
            "loss": avg,
            "ppl": math.exp(min(avg, 700.0)) if avg is not None else None,
            "lr": w.lr,
            "grad_norm": sum(w.grad_norms) / len(w.grad_norms) if w.grad_norms else None,
            "grad_norm_max": max(w.grad_norms) if w.grad_norms else None,
            "tokens_per_s": tps,
            "window_steps": w.steps,
            "window_seconds": elapsed,
            "skipped": w.skipped,
            "mfu": (self.flops_per_token * tps / self.peak_flops_per_s)
            if self.flops_per_token and self.peak_flops_per_s
            else None,
            "peak_mem_mb": peak_memory_mb(self.device),
        }
        if w.warmup:
            row["warmup_window"] = True
        else:
            self._steady_tokens += w.tokens
            self._steady_seconds += elapsed
        row = {k: v for k, v in row.items() if v is not None}
        self._write(row)
        self.last_row = row
        # next window
        self._window = _Window(t0=now, warmup=False)
        return row

    def exclude_time(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation, a checkpoint save) out of the current window's wall time, so
        tokens/s measures training only."""
        self._window.t0 += max(0.0, seconds)

    def steady_tokens_per_s(self) -> float | None:
        """Tokens/s over all closed windows except start-up ones (None if there were none)."""
        return self._steady_tokens / self._steady_seconds if self._steady_seconds > 0 else None

    # ------------------------------------------------------------------ other rows
    def log_eval(self, step: int, tokens_total: int, values: dict) -> dict:
        row = {"kind": "eval", "step": step, "time": self.clock(), "tokens": tokens_total, **values}
        self._write(row)
        return row

    def event(
        self, step: int, event: str, message: str, tokens_total: int | None = None, **extra: Any
    ) -> dict:
        row = {
            "kind": "event",
            "step": step,
            "time": self.clock(),
            "event": event,
            "message": message,
            **({"tokens": tokens_total} if tokens_total is not None else {}),
            **extra,
        }
        self._write(row)
        return row

    def supersede_after(self, step: int) -> int:
        """Mark metrics rows past `step` as superseded (resume/rollback to `step`)."""
        return self.jsonl.supersede_after(step) if self.jsonl is not None else 0

    def _write(self, row: dict) -> None:
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        for sink in self.sinks:
            sink.close()


def build_logger(
    run_dir: str | Path,
    *,
    log_every: int,
    flops_per_token: float | None,
    peak_flops_per_s: float | None,
    device: Any,
    max_steps: int,
    start_step: int,
    progress: bool,
    wandb_run_id: str | None = None,
    config: dict | None = None,
) -> TrainingLogger:
    """The standard sink set: console (+bar on a TTY), metrics.jsonl, TensorBoard if installed, W&B if
    WANDB_PROJECT is set."""
    run_dir = Path(run_dir)
    bar = ProgressBar(total=max_steps, initial=start_step, enabled=progress)
    sinks: list[Sink] = [ConsoleSink(bar.print_fn)]
    try:
        import tensorboard  # noqa: F401

        sinks.append(TensorBoardSink(run_dir / "tb"))
    except ImportError:
        pass  # optional: nothing to say unless asked for
    project = os.environ.get("WANDB_PROJECT")
    if project:
        sinks.append(
            WandbSink(project, run_id=wandb_run_id, config=config, name=os.environ.get("WANDB_RUN_NAME"))
        )
    return TrainingLogger(
        log_every=log_every,
        sinks=sinks,
        jsonl=JsonlSink(run_dir / METRICS_NAME),
        flops_per_token=flops_per_token,
        peak_flops_per_s=peak_flops_per_s,
        device=device,
        progress=bar,
    )
