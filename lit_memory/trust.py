"""What a recipe may make us run: imports by jsonargparse's allowlist, values by the checks below.

A recipe is a file someone sent. Parsing it may import the classes it names and building the run
may load what its values point at, so two things are checked, once, on the one parsed config
(`lit_memory.cli.resolve`), before any model, data or checkpoint is touched:

- **imports**: jsonargparse's own import-path policy (`enforce_import_policy`) refuses, while it
  parses, any class or callable outside `ALLOWLIST` (and where the object is really defined: a
  re-export such as ``lightning.pytorch.cli.os.system`` is ``os.system``). Values typed ``Any``
  stay plain data: jsonargparse does not instantiate class specs found there.
- **values** (`refused_values`): settings that would run code from elsewhere: any
  ``trust_remote_code`` (transformers imports Python files shipped with the model), ``weights_only``
  other than true (unpickling runs code), a ``ckpt_path`` that is not a local file or folder (a URL
  or another filesystem is fetched; a model registry downloads), and checkpoint folders whose
  pickled metadata names anything but torch's checkpoint metadata types (`check_checkpoint`).

The command line the user types is theirs: a value set there by a dotted override is trusted. Files
(recipes, configs, a checkpoint's hyper-parameters) are not. ``--trust-recipe`` lifts both checks.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lit_memory.errors import UserError

TRUST_FLAG = "--trust-recipe"
# Import paths a recipe may name: optimizers, Lightning's own callbacks/loggers/strategies/plugins,
# this package and peft. An entry allows itself and everything under it.
ALLOWLIST = (
    "torch.optim",
    "transformers.optimization",
    "transformers.Adafactor",
    "bitsandbytes.optim",
    "torchao.optim",
    "lightning",
    "lit_memory",
    "peft",
)
# Entry points inside allowed packages: a class spec naming one could start a nested run that
# parses arguments of its own (including the trust flag). The most specific entry decides.
DENYLIST = (
    "lightning.pytorch.cli",
    "lightning.fabric.cli",
    "lit_memory.cli",
    "lit_memory.__main__",
    "lit_memory.trust",
    "lit_memory.tools",
)
HINT = f"check the file with `python -m lit_memory recipes check FILE`; pass {TRUST_FLAG} only if you trust its source"

_enforced = False


def enforce_import_policy() -> None:
    """Make jsonargparse refuse, from now on in this process, every import path outside `ALLOWLIST`.

    jsonargparse's settings are process-wide and cannot be undone through its API, so the decision
    is made once per process: `--trust-recipe` must be given to the process that parses.
    """
    global _enforced
    import jsonargparse

    if not _enforced:
        jsonargparse.set_parsing_settings(
            import_path_denylist=["*", *DENYLIST],
            import_path_allowlist=list(ALLOWLIST),
            instantiate_subclass_spec_in_any=False,
        )
        _enforced = True


def import_policy_enforced() -> bool:
    return _enforced


_DENIED = re.compile(r"Importing '([\w.]+)' is not allowed")
_KEY = re.compile(r'^(\s*)(?:- )?Parser key "([^"]+)"')


def denied_imports(message: str) -> list[tuple[str, str, str]]:
    """(import path, key, outermost key) of each import jsonargparse refused, read from its nested
    parse error. The key joins the ``Parser key`` lines around the refusal: ``trainer.callbacks.on_fit_start``."""
    found: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    for line in message.splitlines():
        if match := _KEY.match(line):
            indent = len(match[1])
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, match[2])]
        for path in _DENIED.findall(line):
            indent = len(line) - len(line.lstrip())
            keys = [k for i, k in stack if i < indent]
            entry = (path, ".".join(keys), keys[0] if keys else "")
            if entry not in found:
                found.append(entry)
    return found


def import_refusal(path: str, key: str) -> str:
    where = f" ({key})" if key else ""
    return f"refusing to import {path}{where}: outside the recipe allowlist ({', '.join(ALLOWLIST)}); {HINT}"


# -- values ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """A value that would make us run or unpickle code from elsewhere."""

    key: str
    value: Any
    reason: str
    safe: Any = None  # what a shared recipe.yaml writes instead

    def __str__(self) -> str:
        return f"refusing {self.key}={self.value!r}: {self.reason}; {HINT}"


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Lightning's own names for checkpoints it finds itself; resolved with the Trainer (`check_resolved_checkpoint`).
SPECIAL_CKPT = ("last", "best", "hpc")


def refused_values(config: dict, typed: frozenset[str] = frozenset()) -> list[Refusal]:
    """Every value of a parsed config (as a plain dict) that needs ``--trust-recipe``.

    ``typed``: dotted keys the user set on the command line; a value under one of them is theirs.
    A ``ckpt_path`` is checked wherever it comes from: what it points at is not the user's.
    """
    refusals = [r for r in value_refusals(config) if not any(r.key == t or r.key.startswith(t + ".") for t in typed)]
    if config.get("ckpt_path") is not None:
        refusals += checkpoint_refusals(str(config["ckpt_path"]))
    return refusals


def value_refusals(config: dict) -> list[Refusal]:
    """Settings that run or unpickle code whatever they point at."""
    refusals = []
    for key, value in _leaves(config):
        if key.rsplit(".", 1)[-1] == "trust_remote_code" and value:
            refusals.append(Refusal(key, value, "it runs Python files shipped with the model or tokenizer", safe=False))
        elif key == "weights_only" and value is not True:
            refusals.append(Refusal(key, value, "unpickling a checkpoint runs any code it names", safe=True))
    return refusals


def checkpoint_refusals(ckpt_path: str) -> list[Refusal]:
    """Refusals for a ``ckpt_path`` as Lightning resolves it: a path relative to the working folder,
    a URL or fsspec protocol, a model registry name, or one of Lightning's special names."""
    if ckpt_path in SPECIAL_CKPT:
        return []  # resolved later, by Lightning's own rules, and checked then
    if ckpt_path.startswith("registry:"):
        return [Refusal("ckpt_path", ckpt_path, "it downloads a model from Lightning's model registry")]
    if _SCHEME.match(ckpt_path):
        return [Refusal("ckpt_path", ckpt_path, "it is not a local file or folder: download it and pass the local path")]
    path = Path(ckpt_path).expanduser()
    if not path.exists():
        raise UserError(f"checkpoint not found: {ckpt_path} (a relative path is read from {Path.cwd()})")
    reason = check_checkpoint(path)
    return [Refusal("ckpt_path", ckpt_path, reason)] if reason else []


def check_checkpoint(path: Path) -> Optional[str]:
    """Why loading a local checkpoint could run code, or None.

    A file is loaded with ``weights_only=True`` (enforced above): tensors and plain data only. A
    folder is a distributed checkpoint, whose ``.metadata`` torch reads with plain `pickle.load`:
    it is safe only if it names nothing but the checkpoint metadata types, which is checked by
    unpickling it with those alone allowed (Python's documented way to restrict unpickling; torch's
    own weights-only unpickler does not read the protocol torch writes this file with).
    """
    if path.is_file():
        return None
    metadata = path / ".metadata"
    if not metadata.is_file():
        return None  # not a distributed checkpoint: Lightning reports what it cannot load
    try:
        _MetadataUnpickler(io.BytesIO(metadata.read_bytes())).load()
    except Exception as err:  # any failure to read it safely means: do not let pickle read it
        return f"its {metadata.name} names code to run when unpickled ({err})"
    return None


def _metadata_globals() -> set[tuple[str, str]]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed = {
        (metadata.__name__, name)
        for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    }
    allowed |= {(filesystem.__name__, "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout")}
    allowed |= {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}
    allowed |= {("collections", "OrderedDict")}
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _metadata_globals():
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def check_resolved_checkpoint(path: Optional[str]) -> None:
    """Refuse a checkpoint Lightning found itself (``last``, ``hpc``) if loading it could run code."""
    if path is None:
        return
    refusals = checkpoint_refusals(str(path))
    if refusals:
        raise UserError(str(refusals[0]))


def sanitize(config: dict) -> dict:
    """A copy of a parsed config (plain dict) with every refused value replaced by its safe one:
    what a run writes into the recipe.yaml it shares. ``ckpt_path`` is the run's own: blank it."""
    out = copy.deepcopy(config)
    for refusal in value_refusals(out):
        *parents, last = refusal.key.split(".")
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = refusal.safe
    return out


def _leaves(tree: Any, key: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, f"{key}.{k}" if key else str(k))]
    if isinstance(tree, list):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, f"{key}.{i}")]
    return [(key, tree)]
