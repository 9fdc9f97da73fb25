"""The folders a confined run writes below (its roots), made and opened beneath the working folder without a link.

A folder someone sent can hold ``lightning_logs -> ~/.bashrc.d``: resolved into a write root, the kernel would then
let the run write where a shell sources its files. So every root that lies beneath the working folder, the default
one (``lightning_logs``) as much as one a recipe or the user names, is walked from the working folder one component at
a time, each opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the one before (made there where missing): a link,
a ``..`` or a file on the way is one `error:` line, and the root's path is then the real path the kernel is given
(`lit_memory.sandbox.landlock`; the child opens it again refusing links). A root outside the working folder is one
the user typed (a recipe's is refused before: `lit_memory.sandbox.rules.check_roots`), and resolved as they named it.

Logger names and versions become folders below a root (``save_dir/name/version``): from a recipe each must be one path
component (`check_components`), and a checkpoint's ``filename`` may not climb out of its folder.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

from lit_memory.errors import UserError
from lit_memory.policy.writes import COMPONENT_KEYS, check_components  # noqa: F401  (the policy's)

HINT = "pass --trust-recipe only if you trust its source"
# The confined child's logger version: the ``version_N`` folder the parent made for it (`new_version`).
VERSION_VARIABLE = "LIT_MEMORY_RUN_VERSION"


@dataclass
class Made:
    """What `make` made: folders, deepest last (removed at the end of a run where left empty)."""

    folders: list[str] = field(default_factory=list)
    version: Optional[int] = None  # the run's logger version, where `new_version` made its folder


def relative_to_work(path: str, work: str) -> Optional[list[str]]:
    """``path``'s components below the working folder ``work`` (a real path), as written (``..`` kept, to be
    refused), or None where it does not lie there."""
    expanded = os.path.expanduser(str(path))
    if not os.path.isabs(expanded):
        parts = expanded.split(os.sep)
    else:
        for base in dict.fromkeys((work, os.path.abspath(work))):
            if expanded == base or expanded.startswith(base.rstrip(os.sep) + os.sep):
                parts = expanded[len(base):].split(os.sep)
                break
        else:
            return None
    return [p for p in parts if p not in ("", ".")]


def make(path: str, work: str, key: str, made: Optional[Made] = None, create: bool = True) -> str:
    """The root ``path`` (beneath the real working folder ``work``), made where missing, no link followed: its real
    path. One error line naming ``key`` if a component is a link, ``..`` or not a folder. ``create=False``: only
    judge the components that exist (nothing is made)."""
    parts = relative_to_work(path, work)
    if parts is None:
        raise ValueError(f"{path} is not beneath {work}")
    if ".." in parts:
        raise UserError(f"refusing {key}={path}: a run folder beneath the working folder is named without '..'; {HINT}")
    fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = work
    try:
        for part in parts:
            here = os.path.join(here, part)
            if not create and not os.path.lexists(here):
                break
            try:
                os.mkdir(part, 0o777, dir_fd=fd)
                if made is not None:
                    made.folders.append(here)
            except FileExistsError:
                pass
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(here):
                    raise UserError(
                        f"refusing {key}={path}: {here} is a link to {os.readlink(here)} (a folder someone sent can "
                        f"plant one where a run writes); remove it or name another run folder, or {HINT}") from None
                if err.errno == errno.ENOTDIR:
                    raise UserError(f"refusing {key}={path}: {here} is not a folder") from None
                raise UserError(f"cannot make the run folder {here} ({key}): {err.strerror}") from None
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)
    return os.path.join(work, *parts)


def next_version(names: Iterable[str]) -> int:
    """The version Lightning's loggers give a new run among folder ``names``: one past the highest ``version_N``."""
    found = [int(name[8:]) for name in names if name.startswith("version_") and name[8:].isdigit()]
    return max(found) + 1 if found else 0


def new_version(logs: str, made: Made) -> str:
    """A new, empty ``version_N`` folder in ``logs`` (a real path, made without following a link), numbered as
    Lightning would (`next_version`): the one folder of the logs a confined run writes, so no earlier run's
    checkpoint or exported model is within its reach, nor ``logs`` itself (no link planted beside the runs). ``mkdir``
    fails where the name exists: a folder another run made meanwhile is never shared. Its path."""
    fd = os.open(logs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        number = next_version(os.listdir(fd))
        while True:
            try:
                os.mkdir(f"version_{number}", 0o777, dir_fd=fd)
                break
            except FileExistsError:
                number += 1
    finally:
        os.close(fd)
    path = os.path.join(logs, f"version_{number}")
    made.folders.append(path)
    made.version = number
    return path


def links_out(folder: str) -> list[str]:
    """Remove the links in ``folder`` (a run's own, after it ended) that lead outside it; the ones removed. A later
    trusted command that writes beside a run's model or reads its checkpoint then never follows a link a confined run
    made to a place of the user's (Lightning's own ``last.ckpt`` link, to a checkpoint beside it, stays)."""
    removed: list[str] = []
    base = os.path.realpath(folder)
    with contextlib.suppress(OSError):
        for path, dirs, names, fd in os.fwalk(folder, follow_symlinks=False):
            for name in [*dirs, *names]:
                with contextlib.suppress(OSError):
                    if not os.path.islink(os.path.join(path, name)):
                        continue
                    target = os.path.normpath(os.path.join(path, os.readlink(name, dir_fd=fd)))
                    where = os.path.realpath(target)
                    if not (where == base or where.startswith(base + os.sep)):
                        os.unlink(name, dir_fd=fd)
                        removed.append(os.path.join(path, name))
    return removed


def make_elsewhere(path: str, made: Optional[Made] = None) -> str:
    """A root outside the working folder that the user typed: made as they named it (their links are theirs); its
    real path."""
    missing, probe = [], os.path.abspath(os.path.expanduser(path))
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    os.makedirs(os.path.expanduser(path), exist_ok=True)
    if made is not None:
        made.folders += reversed(missing)
    return os.path.realpath(os.path.expanduser(path))


def remove_empty(folders: Iterable[str]) -> None:
    """The folders ``make`` made, deepest first, where nothing was written into them (no link followed)."""
    for folder in reversed(list(folders)):
        with contextlib.suppress(OSError):
            if not os.path.islink(folder):
                os.rmdir(folder)

