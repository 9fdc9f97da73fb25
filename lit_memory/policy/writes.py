"""Writes: where a sent recipe's run may write. The one list: change what a recipe may write here, and the parse
check, the confined launch (`lit_memory.confine.launch`, `lit_memory.sandbox.rules`), the guard, the trust of a
recipe's files (`lit_memory.config.trusted`) and ``recipes check`` follow.

A run writes below its roots (`ROOT_KEYS`: the run's folder, loggers', checkpoints', predict's output), each a new or
empty folder under the working folder when a recipe chose it (`check_roots`), none holding or inside a folder of the
user's (`owned_folders`); any other setting naming a place to write (`WRITE_PATH`: a callback's
``exclude_batches_path``, a profiler's file) lies below the roots (`check_write_paths`); names that become folders or
files below a root are one path component (`check_components`).
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable

from lit_memory.errors import UserError
from lit_memory.policy.reads import READ_KEYS, under
from lit_memory.policy.refusal import PASS as HINT

# Settings naming a folder a run writes into (its roots), and any other setting that names a place to write.
ROOT_KEYS = ("default_root_dir", "save_dir", "dirpath", "log_dir", "output_dir", "root_dir")
WRITE_PATH = re.compile(r"(_dir|_path|filepath|dirpath|snapshot)$")
IN_RUN = ("memory.snapshot",)  # a relative value is in the run's own folder
# Settings whose value becomes one folder below a logger's save_dir (``save_dir/name/version``, TensorBoard's sub_dir).
COMPONENT_KEYS = ("name", "version", "sub_dir")


def check_roots(chosen: Iterable[tuple[str, str]], work: str, owned: Iterable[str]) -> None:
    """Run folders a recipe chose (``(setting, path)``): each a new or empty folder under the working folder
    ``work``, neither holding nor inside a folder the user owns (``owned``: the caches, the home folder's
    configuration), nor holding another run folder. One error line naming the setting otherwise."""
    chosen = [(key, os.path.realpath(os.path.expanduser(str(path)))) for key, path in chosen]
    owned = [os.path.realpath(os.path.expanduser(p)) for p in owned]
    work = os.path.realpath(work)
    for key, path in chosen:
        where = f"{key}={path}"
        if not under(path, work) or path == work:
            raise UserError(f"refusing {where}: a run folder a recipe chooses must be a new folder under the working "
                            f"folder {work}; {HINT}")
        for folder in owned:
            if under(path, folder) or under(folder, path):
                raise UserError(f"refusing {where}: it {'is inside' if under(path, folder) else 'holds'} {folder}, "
                                f"a folder of yours a run does not write; {HINT}")
        if os.path.lexists(path) and (not os.path.isdir(path) or os.path.islink(path) or os.listdir(path)):
            raise UserError(f"refusing {where}: a run folder a recipe chooses must be new or empty, and it holds "
                            f"files; {HINT}")
    for key, path in chosen:
        for other_key, other in chosen:
            if other != path and under(other, path) and key != other_key and os.path.lexists(other):
                raise UserError(f"refusing {key}={path}: it holds {other_key}'s folder; {HINT}")


def check_write_paths(chosen: dict[str, Any], roots: list[str]) -> None:
    """Places a recipe names for writing that are not a run root (a callback's ``exclude_batches_path``, a
    profiler's file): each must lie below the run's folders, which are all a confined run may write; said before
    the run starts, not when the kernel refuses the write mid-run."""
    real = [os.path.realpath(r) for r in roots]
    for key, value in chosen.items():
        name = key.rsplit(".", 1)[-1]
        if name in ROOT_KEYS or name == "class_path" or key in READ_KEYS or name in READ_KEYS or not WRITE_PATH.search(name):
            continue
        if not isinstance(value, str) or not value or "://" in value:
            continue
        if key in IN_RUN and not os.path.isabs(os.path.expanduser(value)):
            if os.path.normpath(value).split(os.sep)[0] != os.pardir:
                continue
        path = os.path.realpath(os.path.expanduser(value))
        if not any(under(path, r) for r in real):
            raise UserError(f"refusing {key}={value}: it is outside the run's folders ({', '.join(real)}), where a "
                            f"sent recipe's run writes; {HINT}")

def owned_folders() -> list[str]:
    """The user's folders no run folder may hold or sit in: the caches and the home folder's configuration."""
    home = os.path.expanduser("~")
    found = [os.path.join(home, name) for name in (".cache", ".config", ".local", ".ssh", ".bashrc.d", ".gnupg")]
    for variable in ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME",
                     "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        if os.environ.get(variable):
            found.append(os.environ[variable])
    return found


def check_components(chosen: Iterable[tuple[str, Any]]) -> None:
    """Values a recipe chose (``(key, value)``) that become folders or file names below a run root: a logger's
    ``name``/``version``/``sub_dir`` one path component each; a checkpoint's ``filename`` without ``..`` or a leading
    ``/``. One error line naming the key otherwise."""
    for key, value in chosen:
        if not isinstance(value, str) or not key.startswith(("trainer.logger", "trainer.callbacks")):
            continue
        last = key.rsplit(".", 1)[-1]
        if key.startswith("trainer.logger") and last in COMPONENT_KEYS:
            if value in (".", "..") or "/" in value or os.sep in value or "\0" in value:
                raise UserError(f"refusing {key}={value!r}: a logger's {last} becomes one folder below its save_dir, "
                                f"so it is one path component (no '/', not '..'); {HINT}")
        elif last == "filename" and (value.startswith("/") or ".." in value.split("/")):
            raise UserError(f"refusing {key}={value!r}: a checkpoint's file name stays in its folder (no leading '/', "
                            f"no '..'); {HINT}")
