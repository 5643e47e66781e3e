"""Benchmark: the whole `prepare` pipeline vs raw tokenizer throughput, on the same text, same workers.

    python benchmarks/bench_prepare.py [--source stdlib] [--workers 2] [--max-docs N] [--repeats 3]

Text: each --source corpus (corpora.py; repeat the flag or give a comma list for one table each):
`stdlib` (this interpreter's standard-library .py files, as `prepare` reads them; the default), `numpy`
(the installed numpy's .py files, a glob source), `licences` (the licence and copyright texts installed on
this machine: many short files, many alike) or `jsonl:MB` (about MB megabytes of generated JSON lines of
real text, 1% exact duplicates, in several files), or the first --max-docs documents of each. Rows,
each the best of --repeats runs (interleaved, so drift hits all alike):

  raw tiktoken        encode_ordinary_batch(texts, num_threads=W) on the already decoded texts (no I/O):
                      the texts `prepare` reads (of JSON lines, the `text` fields), in batches of 8 MB
                      (the token lists of 200 MB of text at once would take ~2 GB)
  prepare end-to-end  prepare([SPEC], ...): read, clean, dedup, tokenize in W processes, pack,
                      hash, write, re-read/verify, manifest (pool start-up included)
  HF tokenizers       the same GPT-2 BPE via the `tokenizers` library, encode_batch with W rayon threads
                      on the same batches (only when installed)

  prepare --ray       (with --ray) the same prepare, its units as Ray tasks: `--ray local` starts a
                      one-node cluster on this machine with --workers CPUs (the same CPUs as the pool),
                      `--ray ADDRESS` uses a running one; printed side by side with the ratio. One
                      cluster serves every corpus: with --repeats 1 the first corpus's row includes
                      the start of its worker processes (use --repeats >= 2, or put a small corpus first)

Every row's tokens/s is the same text's tokens (raw tiktoken's count) over that row's seconds: how fast
each gets through the corpus, so the ratios are ratios of time. `written` is what the pipeline kept (EOS
not counted): less than the text by what it drops, the exact duplicates above all (1% of jsonl:MB, about
half of the licences; they are tokenized before they are found). Target (issue 50): the pipeline
reaches >= 0.9 of raw tiktoken throughput on the stdlib and on a second corpus, and `--ray` >= 0.8 of
the local pool's on the stdlib and on a 200 MB JSONL corpus (`--source stdlib,numpy,jsonl:200 --ray
local`); with more than one corpus a last table puts the ratios side by side.

Then the driver's cost, from more runs whose units are all already computed (the work units kept from
a run stopped before its commit), one with the local pool and one with --ray: the CPU seconds of the
driver's process over its loop (reading the units' indexes, mixing, dedup, describing the shards, and the
executor's share: submitting tasks, taking results; verifying the units and writing the shards are tasks
that run elsewhere), per unit, document and token; each task's throughput (tokens over
the seconds the tasks took, from the pool's run); and the worker count at which the driver saturates
(driver tokens/s over one task's tokens/s): more workers than that wait on the driver.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import corpora

BATCH_BYTES = 8_000_000  # of text per raw tokenizer call (the rows' token lists are freed between calls)


def _load_texts(spec: str, max_docs: int | None) -> list[str]:
    """The texts `prepare` reads from `spec`: each unit's text (a file's, decoded as the workers decode
    it; a JSON line's `text` field; a row's string) before cleaning."""
    from mamba3lite.data import sources as S

    texts = []
    for _, kind, payload in S.Source(spec, max_docs=max_docs).units():
        if kind == S.KIND_TEXT_BYTES:
            wide = S.decode_wide_text(payload)
            text = S.replace_surrogates(S.decode_bytes(payload) if wide is None else wide)[0]
        elif kind == S.KIND_JSONL:
            text, problem = S.parse_jsonl_line(payload, "text")
            assert problem is None, problem
        else:
            text = payload or ""
        texts.append(text)
    return texts


def _batches(texts: list[str]) -> list[list[str]]:
    """`texts` in runs of about BATCH_BYTES (made before the clock starts)."""
    out: list[list[str]] = [[]]
    size = 0
    for t in texts:
        if size >= BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += len(t)
    return out


def _raw_tiktoken(batches: list[list[str]], workers: int) -> tuple[int, float]:
    from mamba3lite.tokenizer import load_tokenizer

    enc = load_tokenizer("gpt2")._enc
    t0 = time.perf_counter()
    n = sum(sum(map(len, enc.encode_ordinary_batch(b, num_threads=workers))) for b in batches)
    return n, time.perf_counter() - t0


_LAST: dict = {}  # the last pipeline run's summary (its per-task throughput)


_UNIT_MB: dict = {"unit_mb": None}  # --unit-mb, for every prepare of the run


def _pipeline(spec: str, max_docs: int | None, workers: int, ray: str | None = None) -> tuple[int, float]:
    """(tokens written, EOS not counted; seconds) of one prepare of `spec` into a temporary directory."""
    from mamba3lite.data.prepare import prepare

    tmp = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        t0 = time.perf_counter()
        s = prepare(
            [spec],
            tmp / "ds",
            workers=workers,
            max_docs=max_docs,
            shard_tokens=1_000_000,
            val_fraction=0.005,
            ray=ray,
            **_UNIT_MB,
        )
        dt = time.perf_counter() - t0
        _LAST["summary"] = s
        n_docs = sum(x.n_docs for x in s.manifest.shards)
        return s.manifest.n_tokens() - n_docs, dt  # written, without the EOS tokens
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Stop(BaseException):
    pass


def _driver_cost(spec: str, max_docs: int | None, workers: int, ray: str | None) -> dict[str, tuple]:
    """Per executor (the local pool of `workers`; Ray at `ray` when given): (units, documents, tokens,
    CPU seconds of the driver's process) over the driver's loop in a run whose work units are all
    computed already. The tasks (verifying each unit's record, writing the shards) run elsewhere; the
    CPU time of the driver's process is its own work (reading indexes, mixing, dedup, describing the
    shards) and the executor's share in it (submitting tasks, taking their results)."""
    from mamba3lite.data import prepare as P
    from mamba3lite.data import staging

    # Shards of the default size (a shard is a task too: at 1M tokens a shard, as in the rows above, Ray's
    # ~1 ms of driver CPU a task would be ~1 ns a token).
    kw = dict(max_docs=max_docs, shard_tokens=P.DEFAULT_SHARD_TOKENS, val_fraction=0.005, **_UNIT_MB)
    tmp = Path(tempfile.mkdtemp(prefix="bench_prepare_driver_"))
    finalize, run = staging.Stage.finalize, P._Run.run
    got: dict = {}

    def stop(self, manifest):
        raise _Stop

    def timed(self, *a):
        t0 = time.process_time()
        try:
            return run(self, *a)
        finally:
            got["cpu"], got["run"] = time.process_time() - t0, self

    executors = {f"local pool, {workers} workers": {"workers": workers}}
    if ray is not None:
        executors["Ray"] = {"workers": workers, "ray": ray}
    out = {}
    try:
        staging.Stage.finalize = stop  # the units stay staged for every measurement
        with contextlib.suppress(_Stop):
            P.prepare([spec], tmp / "ds", workers=workers, **kw)
        P._Run.run = timed
        for name, how in executors.items():
            (tmp / "ds" / staging.STAGE_DIRNAME / staging.STATE_NAME).unlink(missing_ok=True)  # afresh
            with contextlib.suppress(_Stop), contextlib.redirect_stderr(io.StringIO()):  # its note says so
                P.prepare([spec], tmp / "ds", **how, **kw)
            r = got["run"]
            assert r.work.computed == 0, r.work
            n_tokens = sum(info.n_tokens for info in r.state.shards)
            out[name] = (r.work.reused, r.state.stats.documents_in, n_tokens, got["cpu"])
        return out
    finally:
        staging.Stage.finalize, P._Run.run = finalize, run
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


def _hf(tok, batches: list[list[str]]) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = sum(sum(len(e.ids) for e in tok.encode_batch(b, add_special_tokens=False)) for b in batches)
    return n, time.perf_counter() - t0


def _bench(corpus: corpora.Corpus, args: argparse.Namespace, hf, ray_address: str | None) -> dict:
    """One corpus's rows (name -> best (tokens it counted, seconds): the raw rows the text's tokens,
    the pipelines' those written), its texts' size, one task's tokens/s and the driver's cost."""
    texts = _load_texts(corpus.spec, args.max_docs)
    batches = _batches(texts)
    best: dict[str, tuple[int, float]] = {}
    task_rates: list[float] = []
    for _ in range(args.repeats):
        runs = {
            "raw tiktoken": lambda: _raw_tiktoken(batches, args.workers),
            "prepare end-to-end": lambda: _pipeline(corpus.spec, args.max_docs, args.workers),
        }
        if ray_address is not None:
            runs["prepare --ray"] = lambda: _pipeline(corpus.spec, args.max_docs, args.workers, ray_address)
        if hf is not None:
            runs["HF tokenizers"] = lambda: _hf(hf, batches)
        for name, fn in runs.items():
            n, dt = fn()
            if name == "prepare end-to-end":
                nodes = _LAST["summary"].work.nodes.values()
                task_rates.append(sum(v[2] for v in nodes) / max(sum(v[3] for v in nodes), 1e-9))
            if name not in best or dt < best[name][1]:
                best[name] = (n, dt)
    return {
        "best": best,
        "n_texts": len(texts),
        "mb": sum(len(t.encode("utf-8")) for t in texts) / 1e6,
        "task_rate": max(task_rates),
        "driver": _driver_cost(corpus.spec, args.max_docs, args.workers, ray_address),
    }


def _ratios(best: dict[str, tuple[int, float]]) -> tuple[float, float | None]:
    """(pipeline / raw tiktoken, prepare --ray / local pool or None), in tokens/s."""
    seconds = {name: dt for name, (_, dt) in best.items()}  # the same text in every row
    ray = seconds["prepare end-to-end"] / seconds["prepare --ray"] if "prepare --ray" in seconds else None
    return seconds["raw tiktoken"] / seconds["prepare end-to-end"], ray


def _met(ratio: float, target: float) -> str:
    return "met" if ratio >= target else "NOT met"


def _print_corpus(corpus: corpora.Corpus, r: dict, args: argparse.Namespace) -> None:
    best = r["best"]
    n_text = best["raw tiktoken"][0]
    print(
        f"corpus: {corpus.name}: {corpus.about}; {r['n_texts']:,} documents, {r['mb']:.1f} MB of text; "
        f"workers/threads: {args.workers}; CPUs: {os.cpu_count()}; best of {args.repeats}"
    )
    print(f"{'method':<22}{'tokens':>12}{'written':>12}{'seconds':>10}{'tokens/s':>14}{'vs raw':>9}")
    for name, (n, dt) in best.items():
        written = f"{n:,}" if name.startswith("prepare") else "-"
        ratio = best["raw tiktoken"][1] / dt
        print(f"{name:<22}{n_text:>12,}{written:>12}{dt:>10.2f}{n_text / dt:>14,.0f}{ratio:>9.2f}")
    if "HF tokenizers" not in best:
        print("(HF tokenizers not installed: pip install tokenizers)")
    ratio, ray_ratio = _ratios(best)
    print(f"pipeline / raw tiktoken = {ratio:.2f}  (target >= 0.90: {_met(ratio, 0.9)})")
    if ray_ratio is not None:
        print(
            f"prepare --ray / local pool = {ray_ratio:.2f}  (same {args.workers} CPUs; target >= 0.80: "
            f"{_met(ray_ratio, 0.8)})"
        )
    task_rate = r["task_rate"]
    print()
    head = f"{'driver (CPU of its process)':<32}{'per unit':>11}{'per doc':>10}{'per token':>11}"
    print(f"{head}{'saturates at':>16}")
    for name, (n_units, n_docs, n_tokens, cpu_s) in r["driver"].items():
        workers = n_tokens / cpu_s / task_rate
        print(
            f"{name:<32}{cpu_s / n_units * 1e3:>8.2f} ms{cpu_s / n_docs * 1e6:>7.2f} us"
            f"{cpu_s / n_tokens * 1e9:>8.2f} ns{workers:>8,.0f} workers"
        )
    print(
        f"one task: {task_rate:,.0f} tokens/s; the driver saturates at (driver tokens/s) / (one task's "
        f"tokens/s) workers (target >= 256)"
    )
    print(flush=True)


def _print_side_by_side(results: list[tuple[corpora.Corpus, dict]]) -> None:
    """The corpora's ratios, one row each: issue 50's targets side by side."""
    print(f"{'corpus':<14}{'pipeline / raw (>= 0.90)':>28}{'--ray / local pool (>= 0.80)':>32}")
    for corpus, r in results:
        ratio, ray_ratio = _ratios(r["best"])
        ray = "not run (no --ray)" if ray_ratio is None else f"{ray_ratio:.2f} {_met(ray_ratio, 0.8)}"
        print(f"{corpus.name:<14}{f'{ratio:.2f} {_met(ratio, 0.9)}':>28}{ray:>32}")


def _sources(text: str) -> list[str]:
    """A --source value: one corpus name or a comma list of them (argparse type)."""
    return [corpora.check_name(name.strip()) for name in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--source",
        type=_sources,
        action="append",
        metavar="CORPUS",
        help="stdlib (default), numpy, licences or jsonl:MB (e.g. jsonl:200); repeat it or give a comma "
        "list for one table per corpus",
    )
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument(
        "--max-docs", type=int, default=None, help="first N documents of each corpus (default: all)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--unit-mb", type=float, default=None, help="prepare's --unit-mb, for every run (default: its 1 MiB)"
    )
    ap.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="also run prepare --ray: 'local' starts a one-node cluster with --workers CPUs, or ADDRESS",
    )
    args = ap.parse_args()
    _UNIT_MB["unit_mb"] = args.unit_mb
    names = list(dict.fromkeys(n for group in args.source or [["stdlib"]] for n in group))
    # rayon (HF tokenizers) reads this when its thread pool starts: the same parallelism for every row.
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)

    hf = _hf_tokenizer()
    ray_address, stop_ray = args.ray, None
    if args.ray == "local":
        ray_address, stop_ray = _start_ray(args.workers)
    results = []
    try:
        for name in names:
            with corpora.open_corpus(name) as corpus:
                results.append((corpus, _bench(corpus, args, hf, ray_address)))
            _print_corpus(*results[-1], args)
    finally:
        if stop_ray is not None:
            stop_ray()
    if len(results) > 1:
        _print_side_by_side(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
