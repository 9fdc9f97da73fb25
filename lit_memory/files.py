"""Every file lit_memory writes goes through here: whole, or not at all, and never through a link.

A recipe can choose the folder a run writes into, and a folder someone sent can hold a symbolic link
named like a file we write (``recipe.yaml -> ~/.bashrc``). So a file is written to a temporary file
in the same folder and renamed over its name (`os.replace`, atomic on POSIX): a reader sees the old
file or the new one, a crash leaves no half-written file, and the rename replaces a link or a hard
link's directory entry instead of writing into what it points at. A destination that is a symbolic
link is refused with one line rather than replaced: someone placed it there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO, Iterator, Union

from lit_memory.errors import UserError

PathLike = Union[str, os.PathLike]


class LinkRefused(UserError):
    """A destination that is a symbolic link."""


def refuse_link(path: PathLike) -> None:
    """One line if ``path`` is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        raise LinkRefused(
            f"refusing to write {path}: it is a symbolic link to {os.readlink(path)} (a shared run folder can plant "
            "one where lit_memory writes); remove it or write the run elsewhere"
        )


@contextlib.contextmanager
def replacing(path: PathLike, mode: str = "w", encoding: str = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on success it replaces ``path``."""
    path = Path(path)
    refuse_link(path)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # O_EXCL|O_NOFOLLOW: a fresh file of ours, never something already at the temporary name. 0o666 less
    # the umask: the permissions a plain open() would give.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding, "newline": ""})) as f:
            yield f
        refuse_link(path)  # again: the rename must not replace a link planted meanwhile either
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def write_text(path: PathLike, text: str) -> None:
    with replacing(path) as f:
        f.write(text)


def write_bytes(path: PathLike, data: bytes) -> None:
    with replacing(path, "wb") as f:
        f.write(data)


def open_log(path: PathLike) -> IO:
    """A log file another process streams into (it cannot be written whole): created or truncated,
    never opened through a symbolic link."""
    refuse_link(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666)
    return os.fdopen(fd, "w", encoding="utf-8")


@contextlib.contextmanager
def replacing_folder(path: PathLike) -> Iterator[Path]:
    """A temporary folder beside ``path`` for a writer that fills a whole folder (``save_pretrained``);
    on success it takes ``path``'s place, an older folder there is removed. Missing parent folders are
    made, as ``save_pretrained`` makes them (a run that saved nothing else has no run folder yet)."""
    path = Path(path)
    refuse_link(path)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary.mkdir()
    try:
        yield temporary
        refuse_link(path)
        if path.exists():
            old = path.with_name(f".{path.name}.{secrets.token_hex(4)}.old")
            os.replace(path, old)
            os.replace(temporary, path)
            shutil.rmtree(old)
        else:
            os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def planted_links(folder: PathLike, depth: int = 1) -> list[Path]:
    """Symbolic links, and regular files with more than one name (hard links), in ``folder`` and its
    subfolders down to ``depth`` levels, without following any link. Empty if it does not exist."""
    found: list[Path] = []
    folder = Path(folder)
    if os.path.islink(folder):
        return [folder]
    if not folder.is_dir():
        return found
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
                found.append(Path(entry.path))
            elif stat.S_ISDIR(info.st_mode) and depth > 0:
                found += planted_links(entry.path, depth - 1)
    return found
