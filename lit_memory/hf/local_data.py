"""A local file read through `datasets`, with nothing sent anywhere.

`datasets.load_dataset` reports each load of a builder (``csv``, ``json``) to the Hub's S3 bucket with a HEAD
request (`datasets.load.increase_load_count`), also for a file on this machine. A run that reads the user's own
file needs no network, and an untrusted run's box refuses the lookup with a warning: the report is switched off for
the length of the read (the switch is put back after it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lit_memory.settings import patched


def load_local(builder: str, path: Path, **kwargs: Any) -> Any:
    """``datasets.load_dataset(builder, data_files=path, **kwargs)`` without the download count."""
    import datasets  # deferred: heavy (~0.6 s); importing this module costs nothing until a file is read

    with patched(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", False):
        return datasets.load_dataset(builder, data_files=str(path), **kwargs)
