"""Reads: what a sent recipe may name for a run to read. Local files only (`is_remote`), and a file a recipe names
lies beneath the recipe's folder or the working folder (`check_input`): the user's own files elsewhere are read only
when they type them.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable

from lit_memory.policy.refusal import NOTHING, PASS, Context, Refusal, refuse_first, register

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


def input_refusals(key: str, value: str, path: Any, folders: Iterable[str]) -> list[Refusal]:
    """A file a recipe names for the run to read (data, the texts to predict, a model or tokenizer folder, a
    checkpoint): it lies beneath one of ``folders`` (the recipe's own folders and the working folder), judged by where
    it really is. A file of the user's elsewhere (``~/.config/gcloud/...json`` as the texts to predict) is read only
    when the user types it. One refusal naming the key otherwise."""
    real = os.path.realpath(os.path.expanduser(str(path)))
    places = list(dict.fromkeys(os.path.realpath(f) for f in folders))
    if any(under(real, folder) for folder in places):
        return []
    return [Refusal(key, value, f"a file a recipe names is read only from beneath the recipe's folder or the working "
                                f"folder ({', '.join(places)}), and it is {real}",
                    hint=f"type --{key} {value} on the command line if you mean it, or {PASS}", head=f"{key}={value}")]


def check_input(key: str, value: str, path: Any, folders: Iterable[str]) -> None:
    """`input_refusals`, as one error line."""
    refuse_first(input_refusals(key, value, path, folders))


def local(value: Any) -> bool:
    """Whether a setting's value names a local file or folder that exists (not a Hub name, not bundled, not one of
    Lightning's own checkpoint names)."""
    if not isinstance(value, str) or not value or value.startswith("bundled:") or value in ("last", "hpc", "best"):
        return False
    return os.path.lexists(os.path.expanduser(value))


@register("launch")
def inputs(context: Context) -> list[Refusal]:
    """Every file the recipe names for the run to read lies beneath its folder or the working folder
    (`input_refusals`); what the user typed is theirs."""
    found = []
    for key in INPUTS:
        value = context.get(key)
        if local(value) and not context.typed(key, value):
            found += input_refusals(key, value, value, context.folders or [context.work or os.getcwd()])
    return found


@register("run")
def model_folders(context: Context) -> list[Refusal]:
    """A local model or tokenizer folder that cannot load without running its code or unpickling more than weights
    (``context.model_folder_problems``: `lit_memory.sandbox.guard.model_folder_problems`). From the settings alone; in
    the running process the guard checks each folder before transformers reads it (`guard.check_model_folder`)."""
    if context.settings is None or context.trainer is not None:
        return []
    found = []
    for key in ("model.model_name_or_path", "model.tokenizer_name_or_path"):
        value = context.get(key)
        if isinstance(value, str) and not value.startswith("bundled:") and os.path.isdir(value):
            found += [Refusal(key, NOTHING, problem) for problem in context.model_folder_problems(value)]
    return found
