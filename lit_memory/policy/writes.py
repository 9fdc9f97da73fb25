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
from typing import Any, Iterable, Optional

from lit_memory.policy.reads import READ_KEYS, under
from lit_memory.policy.refusal import PASS, Context, Refusal, refuse_first, register

# Settings naming a folder a run writes into (its roots), and any other setting that names a place to write.
ROOT_KEYS = ("default_root_dir", "save_dir", "dirpath", "log_dir", "output_dir", "root_dir")
DEFAULT_ROOT = "lightning_logs"  # a run's root where trainer.default_root_dir is unset: the working folder's
WRITE_PATH = re.compile(r"(_dir|_path|filepath|dirpath|snapshot)$")
IN_RUN = ("memory.snapshot",)  # a relative value is in the run's own folder
# Settings whose value becomes one folder below a logger's save_dir (``save_dir/name/version``, TensorBoard's sub_dir).
COMPONENT_KEYS = ("name", "version", "sub_dir")


def is_root(key: str) -> bool:
    """Whether a setting names a folder a run writes below (one of its roots)."""
    return key.rsplit(".", 1)[-1] in ROOT_KEYS


def names_a_write(key: str) -> bool:
    """Whether a setting names a place a run writes: a root, or any other path setting that is not one it reads."""
    name = key.rsplit(".", 1)[-1]
    return is_root(key) or (bool(WRITE_PATH.search(name)) and key not in READ_KEYS and name not in READ_KEYS)


def root_refusals(chosen: Iterable[tuple[str, str]], work: str, owned: Iterable[str]) -> list[Refusal]:
    """Run folders a recipe chose (``(setting, path)``): each a new or empty folder under the working folder
    ``work``, neither holding nor inside a folder the user owns (``owned``: the caches, the home folder's
    configuration), nor holding another run folder. One refusal naming the setting otherwise."""
    chosen = [(key, os.path.realpath(os.path.expanduser(str(path)))) for key, path in chosen]
    owned = [os.path.realpath(os.path.expanduser(p)) for p in owned]
    work = os.path.realpath(work)
    found = []
    for key, path in chosen:
        def refuse(reason: str) -> None:
            found.append(Refusal(key, path, reason, hint=PASS, head=f"{key}={path}"))

        if not under(path, work) or path == work:
            refuse(f"a run folder a recipe chooses must be a new folder under the working folder {work}")
            continue
        inside = [f for f in owned if under(path, f) or under(f, path)]
        if inside:
            folder = inside[0]
            refuse(f"it {'is inside' if under(path, folder) else 'holds'} {folder}, a folder of yours a run does not "
                   "write")
            continue
        if os.path.lexists(path) and (not os.path.isdir(path) or os.path.islink(path) or os.listdir(path)):
            refuse("a run folder a recipe chooses must be new or empty, and it holds files")
    if found:
        return found
    for key, path in chosen:
        for other_key, other in chosen:
            if other != path and under(other, path) and key != other_key and os.path.lexists(other):
                found.append(Refusal(key, path, f"it holds {other_key}'s folder", hint=PASS, head=f"{key}={path}"))
    return found


def check_roots(chosen: Iterable[tuple[str, str]], work: str, owned: Iterable[str]) -> None:
    """`root_refusals`, the first as one error line."""
    refuse_first(root_refusals(chosen, work, owned))


def write_path_refusals(chosen: dict[str, Any], roots: list[str]) -> list[Refusal]:
    """Places a recipe names for writing that are not a run root (a callback's ``exclude_batches_path``, a
    profiler's file): each must lie below the run's folders, which are all a confined run may write; said before
    the run starts, not when the kernel refuses the write mid-run."""
    real = [os.path.realpath(r) for r in roots]
    found = []
    for key, value in chosen.items():
        if is_root(key) or key.rsplit(".", 1)[-1] == "class_path" or not names_a_write(key):
            continue
        if not isinstance(value, str) or not value or "://" in value:
            continue
        if key in IN_RUN and not os.path.isabs(os.path.expanduser(value)):
            if os.path.normpath(value).split(os.sep)[0] != os.pardir:
                continue
        path = os.path.realpath(os.path.expanduser(value))
        if not any(under(path, r) for r in real):
            found.append(Refusal(key, value, f"it is outside the run's folders ({', '.join(real)}), where a sent "
                                             "recipe's run writes", hint=PASS, head=f"{key}={value}"))
    return found


def check_write_paths(chosen: dict[str, Any], roots: list[str]) -> None:
    """`write_path_refusals`, the first as one error line."""
    refuse_first(write_path_refusals(chosen, roots))


def owned_folders() -> list[str]:
    """The user's folders no run folder may hold or sit in: the caches and the home folder's configuration."""
    home = os.path.expanduser("~")
    found = [os.path.join(home, name) for name in (".cache", ".config", ".local", ".ssh", ".bashrc.d", ".gnupg")]
    for variable in ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME",
                     "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        if os.environ.get(variable):
            found.append(os.environ[variable])
    return found


def component_refusals(chosen: Iterable[tuple[str, Any]]) -> list[Refusal]:
    """Values a recipe chose (``(key, value)``) that become folders or file names below a run root: a logger's
    ``name``/``version``/``sub_dir`` one path component each; a checkpoint's ``filename`` without ``..`` or a leading
    ``/``. One refusal naming the key otherwise."""
    found = []
    for key, value in chosen:
        if not isinstance(value, str) or not key.startswith(("trainer.logger", "trainer.callbacks")):
            continue
        last = key.rsplit(".", 1)[-1]
        if key.startswith("trainer.logger") and last in COMPONENT_KEYS:
            if value in (".", "..") or "/" in value or os.sep in value or "\0" in value:
                found.append(Refusal(key, value, f"a logger's {last} becomes one folder below its save_dir, so it is "
                                                 "one path component (no '/', not '..')", hint=PASS))
        elif last == "filename" and (value.startswith("/") or ".." in value.split("/")):
            found.append(Refusal(key, value, "a checkpoint's file name stays in its folder (no leading '/', no '..')",
                                 hint=PASS))
    return found


def check_components(chosen: Iterable[tuple[str, Any]]) -> None:
    """`component_refusals`, the first as one error line."""
    refuse_first(component_refusals(chosen))


def chosen_roots(context: Context) -> list[tuple[str, str]]:
    """(setting, folder) of every run folder the recipe chose."""
    return [(k, v) for k, v in context.chosen().items() if is_root(k) and isinstance(v, str) and v]


def default_roots(context: Context) -> list[str]:
    """The run's folders as its settings name them (the working folder's `DEFAULT_ROOT` where no root is set), where
    the launch has not made them yet (``recipes check``)."""
    named = [str(v) for k, v in context.leaves() if is_root(k) and isinstance(v, str) and v]
    if not context.get("trainer.default_root_dir"):
        named.append(DEFAULT_ROOT)
    return [os.path.realpath(os.path.join(context.work or os.getcwd(), os.path.expanduser(p))) for p in named]


@register("launch")
def roots(context: Context) -> list[Refusal]:
    """Run folders the recipe chose: new or empty, under the working folder, none of the user's (`root_refusals`)."""
    return root_refusals(chosen_roots(context), context.work or os.getcwd(), owned_folders())


@register("launch")
def write_paths(context: Context) -> list[Refusal]:
    """Every other place the recipe names for writing lies below the run's folders (`write_path_refusals`)."""
    roots: Optional[list[str]] = list(context.roots) if context.roots is not None else default_roots(context)
    return write_path_refusals(context.chosen(), roots)


@register("launch")
def components(context: Context) -> list[Refusal]:
    """Logger names and versions, checkpoint file names: one path component below their root (`component_refusals`)."""
    return component_refusals(context.chosen().items())


@register("launch")
def no_link_on_the_way(context: Context) -> list[Refusal]:
    """The way from the working folder to each run folder beneath it (the default one too) holds no link, no ``..``
    and no file (``context.walk``: `lit_memory.sandbox.roots.make`, judging without making)."""
    if context.walk is None:
        return []
    from lit_memory.errors import UserError

    work = os.path.realpath(context.work or os.getcwd())
    named = chosen_roots(context)
    if not context.get("trainer.default_root_dir"):
        named.append(("trainer.default_root_dir", DEFAULT_ROOT))
    found = []
    for key, value in named:
        if _beneath(value, work):
            try:
                context.walk(value, key)
            except UserError as err:
                found.append(Refusal.of_error(key, str(err)))
    return found


def _beneath(path: str, work: str) -> bool:
    expanded = os.path.expanduser(str(path))
    return not os.path.isabs(expanded) or under(expanded, work) or under(expanded, os.path.abspath(work))
