"""What token ids mean: the one record of the tokenizer a dataset was made with, kept wherever its tokens go.

Token ids mean something only under the tokenizer that made them. So a dataset's manifest records it,
a run copies that record into every checkpoint's meta (`RunState.data`), and every place where tokens
meet a model compares the two records (`compatible_with`): train, eval, resume, `--init-from`, import.

    ident = DataIdentity.from_manifest(manifest.tokenizer, manifest.vocab_size, manifest.eos_id, root)
    ident = DataIdentity.from_dict(meta["data"], run_dir)      # a checkpoint's record (None: dummy data)
    ident.verify(error=CheckpointError, what=f"the model in {run_dir} was trained on it")
    data_ident.compatible_with(model_ident)                    # DataError naming what differs

The record's fields:

    tokenizer        "gpt2", or the path of a Hugging Face tokenizer.json, resolved against its root
    vocab_hash       GPT-2: the sha256 of its ranks (`tokenizer.GPT2Tokenizer`); a tokenizer.json: the
                     sha256 of the file's bytes (`vocab_hash_of`), so an edited file is caught by `verify`
    vocab_size, eos_id   of the tokenizer (the model's embedding rows and document separator)
    manifest_sha256  the dataset's manifest.json hash (only a run's record has one; None otherwise)

On disk two forms exist and keep their keys (old datasets and runs load unchanged):

    manifest.json    {"tokenizer": {"name", "vocab_hash"}, "vocab_size", "eos_id", ...}
    meta_step_N.json {"data": {"tokenizer", "vocab_hash", "vocab_size", "eos_id", "manifest_sha256"}}

A tokenizer.json is recorded by a name relative to the directory that holds a copy of it ("tokenizer.json":
a dataset's own from `prepare --train-tokenizer`, a run's copy), so datasets and runs can be moved;
`resolve_name` is the one rule that turns a recorded name back into a path. Older records may hold an
absolute path, which is kept as it is.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from mamba3lite import intake
from mamba3lite.errors import DataError, Mamba3LiteError
from mamba3lite.rundir import TOKENIZER_NAME

__all__ = ["TOKENIZER_NAME", "DataIdentity", "is_tokenizer_file", "resolve_name", "vocab_hash_of"]

GPT2_NAME = "gpt2"
# The meta form's keys and the JSON type of each (or null).
_KINDS = {"tokenizer": str, "vocab_hash": str, "vocab_size": int, "eos_id": int, "manifest_sha256": str}


def is_tokenizer_file(name: str) -> bool:
    """Whether a recorded tokenizer name is a path to a tokenizer.json (else a name like "gpt2")."""
    return name.endswith(".json") or os.sep in name or "/" in name


def vocab_hash_of(raw: bytes) -> str:
    """The vocabulary hash of a tokenizer.json: the sha256 of its bytes (the one definition; GPT-2's hash
    is of its ranks instead, computed where they are built)."""
    return hashlib.sha256(raw).hexdigest()


def resolve_name(recorded: str | None, root: str | Path | None) -> str:
    """What `tokenizer.load_tokenizer` takes for a recorded tokenizer name: "gpt2" (also when nothing is
    recorded) and other names as they are; a relative tokenizer.json path joined to `root`, the directory
    holding the record (a dataset, a run), so it can be moved; an absolute path as it is."""
    name = str(recorded or GPT2_NAME)
    if root is None or not is_tokenizer_file(name) or PurePosixPath(name).is_absolute():
        return name
    if Path(name).is_absolute():
        return name
    return str(Path(root).resolve() / name)


@dataclass(frozen=True)
class DataIdentity:
    """The tokenizer that a dataset's token ids (or a model's training data) were made with (module
    docstring). The on-disk forms are read by `from_manifest` / `from_dict`, which resolve a recorded
    name once; what a model expects is built directly, from its tokenizer and its config's vocab_size and
    eos_id (as `evaluate_model` does)."""

    # "gpt2", or the tokenizer.json's path (a recorded relative name already joined to its root)
    tokenizer: str
    # GPT-2: sha256 of its ranks; a tokenizer.json: sha256 of the file (None: not recorded)
    vocab_hash: str | None
    # ids in the vocabulary (None: not recorded)
    vocab_size: int | None
    # the end-of-document id (None: not recorded)
    eos_id: int | None
    # sha256 of the dataset's manifest.json: a run's record of which data (None for a dataset's own)
    manifest_sha256: str | None = None

    # ------------------------------------------------------------------------------ reading
    @classmethod
    def from_manifest(
        cls, tokenizer: dict, vocab_size: int, eos_id: int, root: str | Path | None = None
    ) -> DataIdentity:
        """The identity a manifest records: its `tokenizer` dict ({"name", "vocab_hash"}, shape checked by
        `Manifest.from_dict`), vocab_size and eos_id; a relative name is resolved against `root`, the
        dataset directory."""
        return cls(
            tokenizer=resolve_name(tokenizer.get("name"), root),
            vocab_hash=tokenizer.get("vocab_hash") or None,
            vocab_size=vocab_size,
            eos_id=eos_id,
        )

    @classmethod
    def from_dict(
        cls, d: dict | None, root: str | Path | None, *, where: str = "the record",
        error: type[Mamba3LiteError] = DataError,
    ) -> DataIdentity | None:  # fmt: skip
        """The identity in a checkpoint meta's `data` (or a RunState's): None when none is recorded (dummy
        data, seed-format and old runs); keys it lacks are None; a relative tokenizer name is resolved
        against `root`, the run directory. `error` naming `where` for a value of the wrong type."""
        if not d:
            return None
        if not isinstance(d, dict):
            raise error(f"{where}: the data record must be an object, got {d!r}")
        for key, kind in _KINDS.items():
            value = d.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise error(f"{where}: data.{key} must be {kind.__name__} or null, got {value!r}")
        return cls(
            tokenizer=resolve_name(d.get("tokenizer"), root),
            vocab_hash=d.get("vocab_hash") or None,
            vocab_size=d.get("vocab_size"),
            eos_id=d.get("eos_id"),
            manifest_sha256=d.get("manifest_sha256"),
        )

    def to_dict(self) -> dict:
        """The checkpoint meta's `data` form. A tokenizer file is recorded as TOKENIZER_NAME, the copy the
        run directory holds beside the record (`run_record.copy_tokenizer`, `import`)."""
        return {
            "tokenizer": TOKENIZER_NAME if self.tokenizer_file is not None else self.tokenizer,
            "vocab_hash": self.vocab_hash,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "manifest_sha256": self.manifest_sha256,
        }

    def with_manifest_sha256(self, sha: str | None) -> DataIdentity:
        """This identity as a run records it: with the hash of the manifest it came from."""
        return replace(self, manifest_sha256=sha)

    @property
    def tokenizer_file(self) -> Path | None:
        """The tokenizer.json this identity names, None for a named tokenizer ("gpt2")."""
        return Path(self.tokenizer) if is_tokenizer_file(self.tokenizer) else None

    # ------------------------------------------------------------------------------ checking
    def verify(
        self, *, what: str, fix: str = "put the original back", error: type[Mamba3LiteError] = DataError
    ) -> bytes | None:
        """The bytes of the tokenizer file, checked to hash to `vocab_hash`; None for a named tokenizer
        (nothing on disk to check: `tokenizer.load_recorded_tokenizer` checks GPT-2's ranks). `error`
        when the file is gone or was edited since `what` (e.g. "the dataset DIR was prepared with it"):
        the token ids mean nothing under another vocabulary. Callers that copy the file copy these bytes,
        the ones that were checked."""
        path = self.tokenizer_file
        if path is None:
            return None
        if not os.path.lexists(path):
            raise error(f"the tokenizer file {path} is not there any more ({what}); {fix}")
        raw = intake.read_bytes_capped(path, intake.TOKENIZER)
        sha = vocab_hash_of(raw)
        if self.vocab_hash and sha != self.vocab_hash:
            raise error(
                f"the tokenizer file {path} changed since {what} (sha256 {sha[:12]}, recorded "
                f"{self.vocab_hash[:12]}): the token ids mean nothing under another vocabulary; {fix}"
            )
        return raw

    def compatible_with(
        self, other: DataIdentity, *, where: str = "the dataset", reference: str = "the model",
        eos_fix: str = "",
    ) -> None:  # fmt: skip
        """DataError unless this identity (a dataset's, named `where`) was tokenized like `other` (the
        model's training data, named `reference`): the same vocabulary hash when both record one, the same
        vocab size and EOS id. `eos_fix`: the advice after an EOS mismatch (e.g. ": set model.eos_id=0"
        where the model is not trained yet). What `other` does not record is not compared."""
        if other.vocab_hash and self.vocab_hash and self.vocab_hash != other.vocab_hash:
            raise DataError(
                f"{where} was tokenized with {self.tokenizer} (vocab hash {self.vocab_hash[:12]}), "
                f"{reference} with {other.tokenizer} ({other.vocab_hash[:12]}); prepare the data with "
                f"{reference}'s tokenizer (`mamba3lite prepare --tokenizer {other.tokenizer}`)"
            )
        if other.vocab_size is not None and self.vocab_size != other.vocab_size:
            raise DataError(
                f"{where} has vocab_size {self.vocab_size}, the model {other.vocab_size}: they do not "
                "share a tokenizer; prepare the data with the model's tokenizer"
            )
        if other.eos_id is not None and self.eos_id != other.eos_id:
            raise DataError(f"{where} uses EOS id {self.eos_id}, the model {other.eos_id}{eos_fix}")

    def describe(self) -> str:
        """One line for the console: the tokenizer and the start of its hash."""
        return f"{self.tokenizer} (vocab hash {str(self.vocab_hash)[:12]}…)"
