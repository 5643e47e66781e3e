"""DataConfig: the `data:` section of a run's config (where the tokens come from)."""

from __future__ import annotations

from dataclasses import dataclass

from mamba3lite.errors import ConfigError
from mamba3lite.sections.fields import doc

TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")


@dataclass
class DataConfig:
    """Where the tokens come from. Paths are dataset directories (manifest.json) or seed-format files."""

    train_data_path: str = doc(
        "data/pretrain_data.bin",
        "training tokens: a prepared dataset directory or a seed-format token file, or a prepared "
        "dataset's URL (s3://, gs://, hf://, file://), read through cache_dir",
    )
    val_data_path: str | None = doc(
        None,
        "validation tokens; default: the val split of train_data_path "
        "when its manifest has one, else no evaluation",
    )
    dummy: bool = doc(False, "train on seeded random tokens instead of data (plumbing tests only)")
    token_dtype: str | None = doc(
        None,
        "dtype of raw token files without a manifest (uint32 for the seed pipeline's shards); "
        "a prepared dataset's manifest records its own",
    )
    cache_dir: str = doc(
        "~/.cache/mamba3lite/datasets",
        "local cache of datasets given as URLs (train_data_path / val_data_path: s3://, gs://, hf://, "
        "file://): each rank fetches the shards it reads here, verified against the manifest's sha256, "
        "and maps them from here",
    )
    cache_max_gb: float = doc(
        100.0,
        "size limit of cache_dir in GB (2**30 bytes): datasets no running process holds are evicted, "
        "least recently used first, to make room; the datasets in use must fit",
    )

    def __post_init__(self) -> None:
        if not self.dummy and not self.train_data_path:
            raise ConfigError("data.train_data_path must be set (or data.dummy: true for random tokens)")
        if (
            isinstance(self.cache_max_gb, bool)
            or not isinstance(self.cache_max_gb, (int, float))
            or not (self.cache_max_gb > 0)
        ):
            raise ConfigError(f"data.cache_max_gb must be a positive number of GB, got {self.cache_max_gb!r}")
        if self.token_dtype is not None and self.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(
                f"data.token_dtype must be one of {', '.join(TOKEN_DTYPES)} (or unset), "
                f"got {self.token_dtype!r}"
            )
