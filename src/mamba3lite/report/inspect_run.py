"""What `mamba3lite inspect` shows for a checkpoint (run) directory and for a single shard file.

Checkpoint directory: every step on disk with its state (verified: meta parses and both other files
match its recorded sizes and sha256; seed format: complete but without checksums; else what is wrong,
naming the file), then, from the newest loadable step: the config summary, the parameter count, tokens
seen, the last logged metrics and evaluation. `--verify` makes any bad step an error (non-zero exit).

Shard file: its dtype (from the dataset's manifest when the file belongs to one; from the torch.save
header for seed-format tensors; else guessed, and said so), token and EOS counts, max id, the manifest's
record of it when there is one, and a decoded preview of its first tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.errors import CheckpointError, ConfigError, DataError, Mamba3LiteError
from mamba3lite.rundir import SUPERSEDED_DIRNAME, sharded_dir
from mamba3lite.train.metrics.console import val_windows_label

PREVIEW_TOKENS = 64


# ---------------------------------------------------------------------------------------------------
# Checkpoint directories
# ---------------------------------------------------------------------------------------------------


def _fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def describe_checkpoint_dir(path: Path) -> tuple[str, list[str], list[int], bool]:
    """(the description, the problems: one line per step that cannot be loaded, the seed-format steps:
    their metas record no sizes or hashes, so they are only checked for whole files, whether any step
    is usable: loadable, or with verified weights)."""
    run = RunDir(path).check()
    ckpt, steps = run.ckpt, run.steps()
    header = f"{'step':>10}  {'state':<12}{'weights':>12}{'optimizer':>12}  notes"
    lines = [f"run directory  {path}", "", header]
    problems: list[str] = []
    statuses = {}
    weights_only = []
    for step in steps:
        st = ckpt.status(step)
        statuses[step] = st
        state = "verified" if st.verified else "seed format" if st.loadable else "BAD"
        note = "; ".join(st.problems)
        if not st.loadable and ckpt.status(step, need_optimizer=False).loadable:
            # e.g. optimizer files deleted to save space: the model is still usable
            weights_only.append(step)
            state = "weights only"
            note += " (the weights verify: generate and eval can use them; training cannot resume here)"
        if st.sharded:  # one shard directory holds both: its size under weights
            note = f"sharded ({sharded_dir(path, step).name}/)" + (f"; {note}" if note else "")
        lines.append(
            f"{step:>10,}  {state:<12}{_fmt_size(st.sizes.get('model') or st.sizes.get('shards')):>12}"
            f"{_fmt_size(st.sizes.get('optim')):>12}  {note}"
        )
        if not st.loadable:
            problems.append(f"step {step}: {note}")
    good = [s for s in steps if statuses[s].loadable]
    lines.append("")
    lines.append(f"{len(good)} of {len(steps)} steps loadable" + (f"; newest: {good[-1]:,}" if good else ""))
    if weights_only:
        lines.append(f"{len(weights_only)} more with verified weights only (generate, eval): {weights_only}")
    if good or weights_only:
        lines += ["", *_describe_meta(ckpt.read_meta(max(good + weights_only)), path)]
    superseded = path / SUPERSEDED_DIRNAME
    if superseded.is_dir():
        lines.append(f"superseded     {superseded} (checkpoints of an abandoned timeline, kept aside)")
    seed = [s for s in steps if statuses[s].format == "seed"]
    return "\n".join(lines), problems, seed, bool(good or weights_only)


def _describe_meta(meta: dict, run_dir: Path) -> list[str]:
    from mamba3lite.checkpoint import RunState

    state = RunState.from_meta(meta)
    lines = [f"newest loadable step {state.step:,}", *_describe_config(state.config)]
    if "tokens_seen" in meta:  # a seed-format step may not say
        lines.append(f"tokens seen    {int(state.tokens_seen):,}")
    imported = state.imported_from
    if isinstance(imported, dict):
        lines.append(
            f"imported from  {imported.get('source')} ({imported.get('format')}; A activation "
            f"{imported.get('a_activation')} chosen at import: the format does not record it)"
        )
    data = state.data_identity(run_dir)
    if data is not None:
        lines.append(f"tokenizer      {data.describe()}")
        lines.append(f"doc start      {_document_start(data.tokenizer)}")
    row = state.metrics
    if isinstance(row, dict):
        parts = [f"step {row.get('step')}"]
        for key, fmt in (("loss", ".4f"), ("lr", ".2e"), ("grad_norm", ".3f"), ("tokens_per_s", ",.0f")):
            if isinstance(row.get(key), (int, float)):
                parts.append(f"{key} {format(row[key], fmt)}")
        lines.append("last metrics   " + ", ".join(parts))
    ev = state.last_eval
    if isinstance(ev, dict) and isinstance(ev.get("val_loss"), (int, float)):
        bpb = f", bits/byte {ev['val_bpb']:.4f}" if isinstance(ev.get("val_bpb"), (int, float)) else ""
        on = f" ({windows})" if (windows := val_windows_label(ev)) else ""
        lines.append(f"last eval      step {ev.get('step')}: val loss {ev['val_loss']:.4f}{bpb}{on}")
    return lines


def _document_start(tokenizer_name: str) -> str:
    """Which id a text prompt is fed after (`generate`, `serve`, `eval --tasks`), and why."""
    from mamba3lite.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(tokenizer_name)
    except Mamba3LiteError as e:
        return f"unknown: the tokenizer does not load ({e})"
    return f"id {tok.bos_id}, {tok.bos_rule}: a text prompt is fed as [{tok.bos_id}] + its ids"


def _describe_config(raw: dict) -> list[str]:
    """The model, training and data lines of a recorded config (a seed-format step has none)."""
    from mamba3lite.config import Config
    from mamba3lite.model import count_parameters

    if not (isinstance(raw, dict) and "model" in raw):
        return ["config         (none recorded: a seed-format checkpoint)"]
    try:
        cfg = Config.from_dict(raw, source="checkpoint meta")
    except ConfigError as e:
        return [f"config         (does not validate: {e})"]
    m, t, d = cfg.model, cfg.training, cfg.data
    kind = f"MIMO rank {m.mimo_rank}" if m.is_mimo else "SISO"
    return [
        f"model          {m.n_layers} layers, d_model {m.d_model}, d_state {m.d_state}, "
        f"headdim {m.headdim}, expand {m.expand}, {kind}, vocab {m.vocab_size:,}, "
        f"A {m.a_activation}",
        f"parameters     {count_parameters(m):,}",
        f"training       max_seq_len {t.max_seq_len}, {t.global_windows} windows/step in all "
        f"(micro {t.micro_batch_size} x accum {t.accumulation()} on one process), lr {t.lr:g}, "
        f"max_steps {t.max_steps:,}, dtype {t.dtype}",
        f"data           {'dummy (random tokens)' if d.dummy else d.train_data_path}",
    ]


def last_metrics_rows(path: Path) -> list[str]:
    """The last train and eval rows of DIR/metrics.jsonl, one line each ([] if there is none)."""
    from mamba3lite.rundir import METRICS_NAME
    from mamba3lite.train.metrics.jsonl import read_metrics

    if not (path / METRICS_NAME).is_file():
        return []
    m = read_metrics(path)
    out = []
    if m.train:
        r = m.train[-1]
        out.append(
            f"metrics.jsonl  last train row: step {r['step']}, loss {r.get('loss', float('nan')):.4f}, "
            f"{r.get('tokens', 0):,} tokens, {r.get('tokens_per_s', 0):,.0f} tokens/s"
        )
    val = [r for r in m.eval if "val_loss" in r]
    if val:
        r = val[-1]
        on = f" ({windows})" if (windows := val_windows_label(r)) else ""
        out.append(f"               last eval row: step {r['step']}, val loss {r['val_loss']:.4f}{on}")
    tasks = [r for r in m.eval if "val_loss" not in r]
    if tasks:  # downstream benchmarks (training.eval_tasks)
        from mamba3lite.train.metrics.console import downstream_summary

        r = tasks[-1]
        out.append(f"               last downstream row: step {r['step']}: {downstream_summary(r)}")
    if m.events:
        r = m.events[-1]
        out.append(f"               last event: {r.get('event')} at step {r['step']}: {r.get('message', '')}")
    return out


def inspect_checkpoint_dir(path: Path, verify: bool) -> int:
    """Print the description; CheckpointError if no step can be used at all, or with `verify` if any step
    is not loadable."""
    text, problems, seed, usable = describe_checkpoint_dir(path)
    print(text)
    for line in last_metrics_rows(path):
        print(line)
    if not usable:  # a report of nothing usable is a failure: scripts that check the exit status see it
        raise CheckpointError(
            f"no step in {path} can be loaded ({problems[0]}); fix: resume or generate from another run, "
            "or restore the files from a copy"
        )
    if problems and verify:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"verification failed: {problems[0]}{more}")
    if verify:
        verified = "verified: every checkpoint's files match the sizes and sha256 recorded in its meta"
        if seed:
            verified = (
                f"{verified}, except the seed-format steps {seed}: their metas record no sizes or hashes, "
                "so their files were only checked to be whole archives"
            )
        print(f"\n{verified}")
    return 0


# ---------------------------------------------------------------------------------------------------
# Single shard files
# ---------------------------------------------------------------------------------------------------


def _owning_manifest(path: Path):
    """(dataset_dir, Manifest, ShardInfo) when `path` is a shard listed by a manifest above it."""
    from mamba3lite.data.shards import MANIFEST_NAME, Manifest

    resolved = path.resolve()
    for root in list(resolved.parents)[:3]:
        if (root / MANIFEST_NAME).is_file():
            try:
                m = Manifest.load(root)
            except DataError:
                return None
            rel = resolved.relative_to(root).as_posix()
            info = next((s for s in m.shards if s.path == rel), None)
            return (root, m, info) if info is not None else None
    return None


def describe_shard_file(path: Path, token_dtype: str | None = None) -> tuple[str, list[str]]:
    """(the description, problems found against the manifest's record). `token_dtype`: the dtype of a
    raw file that no manifest lists (else guessed); a file that records its own is refused with it."""
    size = path.stat().st_size
    owner = _owning_manifest(path)
    record = None
    eos_id, vocab, tokenizer_name = 50256, 50257, "gpt2"
    if owner is not None:
        _, m, record = owner
        eos_id, vocab, tokenizer_name = m.eos_id, m.vocab_size, m.identity.tokenizer
    tokens, dtype_note, kind = _open_shard(path, size, owner, token_dtype, vocab)
    n = int(tokens.shape[0])
    max_id = int(tokens.max()) if n else -1
    n_eos = int(np.count_nonzero(np.asarray(tokens) == eos_id)) if n else 0
    lines = [
        f"file         {path}",
        f"kind         {kind}",
        f"dtype        {dtype_note}",
        f"size         {size:,} bytes",
        f"tokens       {n:,}",
        f"documents    {n_eos:,} EOS tokens (id {eos_id})",
        f"max id       {max_id:,}" + (f"  (>= vocab {vocab:,}!)" if max_id >= vocab else ""),
    ]
    problems: list[str] = []
    if record is not None:
        line, problems = _against_record(path, record, n, max_id)
        lines.append(line)
    if max_id >= vocab:
        problems.append(f"{path}: token id {max_id} >= vocab_size {vocab}")
    lines += ["", f"first {min(n, PREVIEW_TOKENS)} tokens, decoded:"]
    lines.append(_preview(np.asarray(tokens[:PREVIEW_TOKENS]), tokenizer_name, vocab))
    return "\n".join(lines), problems


def _open_shard(path: Path, size: int, owner, token_dtype: str | None, vocab: int):
    """(the tokens, the dtype and where it came from, what kind of file it is) for a shard file: the
    dtype its manifest records, a torch.save'd tensor's own, `token_dtype`, or a checked guess."""
    from mamba3lite.data.shards import MANIFEST_NAME, open_tokens
    from mamba3lite.data.token_stream import is_torch_file, load_torch_tokens

    if owner is not None:
        root, m, record = owner
        if token_dtype and np.dtype(token_dtype) != m.np_dtype:
            raise ConfigError(
                f"{path} is a shard of {root / MANIFEST_NAME}, which records dtype {m.dtype}, not "
                f"{token_dtype}: drop --token-dtype"
            )
        kind = f"shard {record.path} ({record.split} split) of dataset {root}"
        return open_tokens(path, m.np_dtype), f"{m.dtype} (from {root / MANIFEST_NAME})", kind
    if size and is_torch_file(path):
        if token_dtype:
            raise ConfigError(
                f"{path} is a torch.save'd tensor, which records its own dtype: drop --token-dtype"
            )
        t = load_torch_tokens(path)
        dtype_note = f"{str(t.dtype).replace('torch.', '')} (torch.save'd tensor, the seed's format)"
        return t.numpy(), dtype_note, "seed-format token tensor (no manifest)"
    if token_dtype:
        return (
            open_tokens(path, token_dtype),
            f"{token_dtype} (--token-dtype)",
            "raw token file (no manifest)",
        )
    # A raw file without a manifest: the seed's pipeline wrote uint32; a uint16 file read as uint32
    # shows ids far beyond the GPT-2 vocabulary, so the guess is checked.
    guess = np.dtype("<u4") if size % 4 == 0 else np.dtype("<u2")
    tokens = open_tokens(path, guess)
    if guess.itemsize == 4 and tokens.size and int(tokens.max()) >= vocab:
        guess = np.dtype("<u2")
        tokens = open_tokens(path, guess)
    return tokens, f"{guess.name} (guessed: no manifest lists this file)", "raw token file (no manifest)"


def _against_record(path: Path, record, n: int, max_id: int) -> tuple[str, list[str]]:
    """(the line comparing a shard with its manifest record, the differences as problems)."""
    from mamba3lite.atomicfile import sha256_file

    sha = sha256_file(path)
    ok = sha == record.sha256 and n == record.n_tokens and max_id == record.max_token_id
    line = (
        f"manifest     n_tokens {record.n_tokens:,}, n_docs {record.n_docs:,}, max id "
        f"{record.max_token_id:,}: " + ("matches (sha256 too)" if ok else "DOES NOT MATCH")
    )
    problems = []
    if sha != record.sha256:
        problems.append(f"{path}: sha256 {sha[:12]}… != manifest {record.sha256[:12]}…")
    if n != record.n_tokens:
        problems.append(f"{path}: {n} tokens != manifest n_tokens {record.n_tokens}")
    if max_id != record.max_token_id:
        problems.append(f"{path}: max id {max_id} != manifest max_token_id {record.max_token_id}")
    return line, problems


def _preview(ids: np.ndarray, tokenizer_name: str, vocab: int) -> str:
    from mamba3lite.errors import ConfigError
    from mamba3lite.tokenizer import load_tokenizer

    ids_list = [int(i) for i in ids]
    if not ids_list:
        return "  (empty)"
    try:
        tok = load_tokenizer(tokenizer_name)
    except ConfigError as e:
        return f"  (cannot decode: {e}) ids: {ids_list}"
    if max(ids_list) >= tok.vocab_size:
        return f"  (ids beyond the {tokenizer_name} vocabulary: not decoded) ids: {ids_list[:16]}…"
    text = tok.decode(ids_list)
    return "\n".join("  │ " + line for line in text.splitlines() or [""])


def inspect_shard_file(path: Path, verify: bool, token_dtype: str | None = None) -> int:
    """Print the description; with `verify`, DataError when the file disagrees with its manifest."""
    text, problems = describe_shard_file(path, token_dtype)
    print(text)
    listed = _owning_manifest(path) is not None
    # Without a manifest there is nothing to check the file against, and its dtype (hence its ids) may be
    # a guess: say so rather than call it verified, or blame `prepare` for a file it did not write.
    fix = (
        "re-run `mamba3lite prepare`"
        if listed
        else "no manifest lists this file: it may have another dtype than "
        + ("--token-dtype" if token_dtype else "the one guessed (set --token-dtype)")
        + ", hold another vocabulary's tokens, or not be a token file at all"
    )
    if problems and verify:
        raise DataError(f"verification failed: {problems[0]}; {fix}")
    if problems:
        print("\nwarning: " + "; ".join(problems) + ("" if listed else f" ({fix})"))
    elif verify and not listed:
        print(
            "\nnot verified: no manifest lists this file, so there is no size, sha256 or count to check "
            "it against (only that its ids are below the vocabulary size)"
        )
    return 0
