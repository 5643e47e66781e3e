"""The quickstart's calibration: what a step, an evaluation and the sample cost on this machine.

A throw-away trainer of the run's own prepared config (`PreparedRun.in_scratch_dir`: the same checks,
not repeated, in a scratch directory) is built by the one training entry and timed; its untrained
model is also what "before" means on a fresh start (a resumed run's "before" is its newest checkpoint).
On CPU it also chooses the thread count (`time_steps`).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from mamba3lite.quickstart.budget import Calibration
from mamba3lite.quickstart.dataset import Evaluator
from mamba3lite.quickstart.options import QuickstartOptions

CALIBRATION_STEPS = 3  # timed steps per setting (after one untimed warm-up step)


def time_steps(trainer, cpu: bool) -> tuple[float, str]:
    """Seconds per optimizer step of `trainer`: the median of CALIBRATION_STEPS timed steps (a busy
    machine gives a few slow outliers; the steps expected from it only set the cadence: the clock ends
    the run). On CPU both torch's default thread count and one thread are timed, each after one
    untimed step, and the faster is kept (`torch.set_num_threads`): a model this small runs many small
    ops, and on a busy machine every op of a multi-threaded run waits for its slowest thread. Returns
    (s/step, a note or "")."""
    import torch  # here, not at the top: building the CLI's parser imports this package

    def timed() -> float:
        trainer.train_step()  # untimed: first step after a change of thread count
        times = []
        for _ in range(CALIBRATION_STEPS):
            t0 = time.monotonic()
            trainer.train_step()
            times.append(time.monotonic() - t0)
        return statistics.median(times)

    default = torch.get_num_threads()
    if not cpu or default == 1:
        return timed(), ""
    results = {default: timed()}
    torch.set_num_threads(1)
    results[1] = timed()
    best = min(results, key=results.get)
    torch.set_num_threads(best)
    note = ", ".join(f"{n} thread{'s' * (n > 1)}: {sec:.2f} s/step" for n, sec in results.items())
    return results[best], f"{best} ({note})"


def calibrate(prepared, start_step: int, evaluate: Evaluator, opts: QuickstartOptions, stop) -> Calibration:
    """Measure a step, an evaluation and the sample with a throw-away trainer of `prepared` (a
    `PreparedRun`), built in a scratch directory: nothing is written to the run directory. "before" is
    the untrained model of a fresh run, the newest checkpoint (step `start_step`) of a resumed one."""
    from mamba3lite.generation import generate_text
    from mamba3lite.pretrained import load_pretrained
    from mamba3lite.tokenizer import load_tokenizer
    from mamba3lite.train.entry import training_session

    run_dir = prepared.cfg.training.checkpoint_dir
    with tempfile.TemporaryDirectory(prefix="mamba3lite-calibrate-") as scratch:
        throwaway = prepared.in_scratch_dir(scratch).with_training(progress=False)
        with training_session(throwaway, stop=stop) as calib:
            t0 = time.monotonic()
            if start_step:
                loaded = load_pretrained(run_dir, start_step, device=calib.device)
                start_eval = evaluate(loaded.model)
                del loaded
            else:
                start_eval = evaluate(calib.raw_model)
            eval_s = time.monotonic() - t0
            step_s, threads = time_steps(calib, cpu=calib.device.type == "cpu")
            tok = load_tokenizer(evaluate.tokenizer_name)
            t0 = time.monotonic()
            generate_text(calib.raw_model, tok, opts.prompt, max_new_tokens=4, seed=opts.seed,
                          token_healing=opts.token_healing)  # fmt: skip
            sample_s = (time.monotonic() - t0) / 4 * opts.sample_tokens
            n_params = sum(p.numel() for p in calib.raw_model.parameters())
            del calib
    return Calibration(step_s, eval_s, sample_s, n_params, threads, start_eval)
