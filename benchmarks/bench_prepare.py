"""Benchmark: the whole `prepare` pipeline vs raw tokenizer throughput, on the same text, same workers.

    python benchmarks/bench_prepare.py [--workers 2] [--max-docs N] [--repeats 3]

Text: the `stdlib` corpus (this interpreter's standard-library .py files, as `prepare` reads them), or its
first --max-docs files. Rows, each the best of --repeats runs (interleaved, so drift hits all alike):

  raw tiktoken        encode_ordinary_batch(texts, num_threads=W) on the already decoded texts (no I/O)
  prepare end-to-end  prepare(["stdlib"], ...): read, clean, dedup, tokenize in W processes, pack,
                      hash, write, re-read/verify, manifest (pool start-up included)
  HF tokenizers       the same GPT-2 BPE via the `tokenizers` library, encode_batch with W rayon threads
                      (only when installed)

  prepare --ray       (with --ray) the same prepare, its units as Ray tasks: `--ray local` starts a
                      one-node cluster on this machine with --workers CPUs (the same CPUs as the pool),
                      `--ray ADDRESS` uses a running one; printed side by side with the ratio

tokens/s counts the tokens of the text (the pipeline's EOS tokens are not counted). Target: the
pipeline reaches >= 0.9 of raw tiktoken throughput, and `--ray` >= 0.8 of the local pool's.

Then the driver's cost, from one more run whose units are all already computed (the work units kept
from a run stopped before its commit; the driver then only verifies them, reads their indexes, mixes,
dedups and writes the shards): seconds per document and per token; each task's throughput (tokens over
the seconds the tasks took, from the pool's run); and the worker count at which the driver saturates
(driver tokens/s over one task's tokens/s): more workers than that wait on the driver.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _load_texts(max_docs: int | None) -> list[str]:
    from mamba3lite.data.sources import Source

    return [
        payload.decode("utf-8", "replace") for _, _, payload in Source("stdlib", max_docs=max_docs).units()
    ]


def _raw_tiktoken(texts: list[str], workers: int) -> tuple[int, float]:
    from mamba3lite.tokenizer import load_tokenizer

    enc = load_tokenizer("gpt2")._enc
    t0 = time.perf_counter()
    ids = enc.encode_ordinary_batch(texts, num_threads=workers)
    return sum(map(len, ids)), time.perf_counter() - t0


_LAST: dict = {}  # the last pipeline run's summary (its per-task throughput)


def _pipeline(max_docs: int | None, workers: int, ray: str | None = None) -> tuple[int, float]:
    from mamba3lite.data.prepare import prepare

    tmp = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        t0 = time.perf_counter()
        s = prepare(
            ["stdlib"],
            tmp / "ds",
            workers=workers,
            max_docs=max_docs,
            shard_tokens=1_000_000,
            val_fraction=0.005,
            ray=ray,
        )
        dt = time.perf_counter() - t0
        _LAST["summary"] = s
        n_docs = sum(x.n_docs for x in s.manifest.shards)
        return s.manifest.n_tokens() - n_docs, dt  # without the EOS tokens
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Stop(BaseException):
    pass


def _driver_cost(max_docs: int | None) -> tuple[int, int, float]:
    """(documents, tokens, seconds) of the driver's own work (reading the units' indexes, mixing, dedup,
    writing the shards) in a run whose work units are all computed already."""
    from mamba3lite.data import prepare as P
    from mamba3lite.data import staging, units

    kw = dict(workers=0, max_docs=max_docs, shard_tokens=1_000_000, val_fraction=0.005)
    tmp = Path(tempfile.mkdtemp(prefix="bench_prepare_driver_"))
    finalize = staging.Stage.finalize
    try:

        def stop(self, manifest):
            raise _Stop

        staging.Stage.finalize = stop  # the units stay staged
        with contextlib.suppress(_Stop):
            P.prepare(["stdlib"], tmp / "ds", **kw)
        staging.Stage.finalize = finalize
        (tmp / "ds" / staging.STAGE_DIRNAME / staging.STATE_NAME).unlink(missing_ok=True)  # afresh
        # Only the driver's loop is timed (not start-up, the plan, the manifest), less the time the
        # executor's part took in this process (workers=0: verifying each unit's record).
        spent = {"run": 0.0, "units": 0.0}
        run, run_unit = P._Run.run, units.run_unit

        def timed(store, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[store] += time.perf_counter() - t0

            return wrapper

        P._Run.run, units.run_unit = timed("run", run), timed("units", run_unit)
        try:
            s = P.prepare(["stdlib"], tmp / "ds", **kw)
        finally:
            P._Run.run, units.run_unit = run, run_unit
        assert s.work is not None and s.work.computed == 0, s.work
        return s.stats["documents_in"], s.manifest.n_tokens(), spent["run"] - spent["units"]
    finally:
        staging.Stage.finalize = finalize
        shutil.rmtree(tmp, ignore_errors=True)


def _start_ray(workers: int):
    """A one-node Ray cluster on this machine with `workers` CPUs (the local pool's), this process its
    driver; returns (address, stop)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": workers, "include_dashboard": False})
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)

    def stop() -> None:
        ray.shutdown()
        cluster.shutdown()

    return cluster.address, stop


def _hf_tokenizer():
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return None
    from mamba3lite.tokenizer import gpt2_vocab_dir

    d = gpt2_vocab_dir()
    tok = Tokenizer(models.BPE.from_file(str(d / "encoder.json"), str(d / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _hf(tok, texts: list[str]) -> tuple[int, float]:
    t0 = time.perf_counter()
    enc = tok.encode_batch(texts, add_special_tokens=False)
    return sum(len(e.ids) for e in enc), time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--max-docs", type=int, default=None, help="first N stdlib files (default: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="also run prepare --ray: 'local' starts a one-node cluster with --workers CPUs, or ADDRESS",
    )
    args = ap.parse_args()
    # rayon (HF tokenizers) reads this when its thread pool starts: the same parallelism for every row.
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)

    texts = _load_texts(args.max_docs)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    hf = _hf_tokenizer()
    ray_address, stop_ray = args.ray, None
    if args.ray == "local":
        ray_address, stop_ray = _start_ray(args.workers)
    best: dict[str, tuple[int, float]] = {}
    task_rates: list[float] = []
    try:
        for _ in range(args.repeats):
            runs = {
                "raw tiktoken": lambda: _raw_tiktoken(texts, args.workers),
                "prepare end-to-end": lambda: _pipeline(args.max_docs, args.workers),
            }
            if ray_address is not None:
                runs["prepare --ray"] = lambda: _pipeline(args.max_docs, args.workers, ray_address)
            if hf is not None:
                runs["HF tokenizers"] = lambda: _hf(hf, texts)
            for name, fn in runs.items():
                n, dt = fn()
                if name == "prepare end-to-end":
                    nodes = _LAST["summary"].work.nodes.values()
                    task_rates.append(sum(v[2] for v in nodes) / max(sum(v[3] for v in nodes), 1e-9))
                if name not in best or dt < best[name][1]:
                    best[name] = (n, dt)
        driver = _driver_cost(args.max_docs)
    finally:
        if stop_ray is not None:
            stop_ray()

    raw_rate = best["raw tiktoken"][0] / best["raw tiktoken"][1]
    print(
        f"corpus: stdlib of Python {sys.version.split()[0]}, {len(texts)} files, {mb:.1f} MB; "
        f"workers/threads: {args.workers}; CPUs: {os.cpu_count()}; best of {args.repeats}"
    )
    print(f"{'method':<22}{'tokens':>12}{'seconds':>10}{'tokens/s':>14}{'vs raw':>9}")
    for name, (n, dt) in best.items():
        print(f"{name:<22}{n:>12,}{dt:>10.2f}{n / dt:>14,.0f}{n / dt / raw_rate:>9.2f}")
    if "HF tokenizers" not in best:
        print("(HF tokenizers not installed: pip install tokenizers)")
    pool_rate = best["prepare end-to-end"][0] / best["prepare end-to-end"][1]
    ratio = pool_rate / raw_rate
    print(f"pipeline / raw tiktoken = {ratio:.2f}  (target >= 0.90: {'met' if ratio >= 0.9 else 'NOT met'})")
    if "prepare --ray" in best:
        ray_ratio = best["prepare --ray"][0] / best["prepare --ray"][1] / pool_rate
        print(
            f"prepare --ray / local pool = {ray_ratio:.2f}  (same {args.workers} CPUs; target >= 0.80: "
            f"{'met' if ray_ratio >= 0.8 else 'NOT met'})"
        )
    n_docs, n_tokens, driver_s = driver
    task_rate = max(task_rates)
    driver_rate = n_tokens / driver_s
    print()
    print(f"{'driver / task':<34}{'value':>16}")
    print(f"{'driver seconds per document':<34}{driver_s / n_docs * 1e6:>13.1f} us")
    print(f"{'driver seconds per token':<34}{driver_s / n_tokens * 1e9:>13.1f} ns")
    print(f"{'driver tokens/s':<34}{driver_rate:>16,.0f}")
    print(f"{'one task tokens/s':<34}{task_rate:>16,.0f}")
    print(
        f"driver saturates at ~{driver_rate / task_rate:,.0f} workers (driver tokens/s / one task's tokens/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
