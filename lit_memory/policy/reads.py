"""Reads: what a sent recipe may name for a run to read. Local files only (`is_remote`), and a file a recipe names
lies beneath the recipe's folder or the working folder (`check_input`): the user's own files elsewhere are read only
when they type them.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable

from lit_memory.errors import UserError
from lit_memory.policy.refusal import PASS as HINT

# Settings that name files a run reads (a model or tokenizer, the data, the texts to predict, a checkpoint).
INPUTS = ("model.model_name_or_path", "model.tokenizer_name_or_path", "data.source", "data.predict_path", "ckpt_path")
# Settings whose name looks like a place to write (`lit_memory.policy.writes.WRITE_PATH`) but that a run reads.
READ_KEYS = (*INPUTS, "tokenizer_name_or_path")

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_remote(value: str) -> bool:
    """A URL, an fsspec chain (``simplecache::s3://...``) or Lightning's model registry: not a local path."""
    return bool(_SCHEME.match(value)) or "::" in value or value.startswith("registry:")


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def check_input(key: str, value: str, path: Any, folders: Iterable[str]) -> None:
    """A file a recipe names for the run to read (data, the texts to predict, a model or tokenizer folder, a
    checkpoint): it lies beneath one of ``folders`` (the recipe's own folders and the working folder), judged by where
    it really is. A file of the user's elsewhere (``~/.config/gcloud/...json`` as the texts to predict) is read only
    when the user types it. One error line naming the key otherwise."""
    real = os.path.realpath(os.path.expanduser(str(path)))
    places = list(dict.fromkeys(os.path.realpath(f) for f in folders))
    if not any(under(real, folder) for folder in places):
        raise UserError(
            f"refusing {key}={value}: a file a recipe names is read only from beneath the recipe's folder or the working "
            f"folder ({', '.join(places)}), and it is {real}; type --{key} {value} on the command line if you mean it, "
            f"or {HINT}")
