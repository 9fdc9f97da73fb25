"""The files a sent recipe names, checked before the confined run may read them: regular files beneath their folder.

A model folder, a data file, a checkpoint: each file is opened with ``openat2`` beneath its folder, refusing any
link on the way (``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS``), and must be a regular file (a
FIFO blocks its reader forever, a device never ends), and so must every file an index inside the folder names
(a sharded model's ``*.index.json``). The confined run then reads only these paths (`lit_memory.sandbox.rules`);
the kernel refuses a link out of them anyway, and nothing here is copied.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
from pathlib import Path
from typing import Iterator, Optional

from lit_memory.errors import UserError

SYS_OPENAT2 = 437  # x86-64 and aarch64 (Linux 5.6)
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x02, 0x04, 0x08
MAX_FILES = 20_000  # a model folder has tens; a checkpoint folder one per rank and a few more
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "adapter_model.safetensors.index.json")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_beneath(folder_fd: int, name: str) -> int:
    """A file descriptor for ``name`` beneath the folder open as ``folder_fd``, no link followed anywhere on the
    way (``openat2``); where the kernel has no openat2, each component is opened with ``O_NOFOLLOW`` instead."""
    libc = ctypes.CDLL(None, use_errno=True)
    how = _OpenHow(os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, 0,
                   RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    fd = libc.syscall(SYS_OPENAT2, folder_fd, os.fsencode(name), ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return fd
    code = ctypes.get_errno()
    if code not in (errno.ENOSYS, errno.EPERM):
        raise OSError(code, os.strerror(code), name)
    return _open_each(folder_fd, name)  # no openat2 (seccomp or an old kernel): component by component


def _open_each(folder_fd: int, name: str) -> int:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise OSError(errno.EXDEV, "escapes its folder", name)
    fd = os.dup(folder_fd)
    try:
        for i, part in enumerate(parts):
            flags = (
                os.O_RDONLY
                | os.O_NOFOLLOW
                | os.O_NONBLOCK
                | os.O_CLOEXEC
                | (0 if i == len(parts) - 1 else os.O_DIRECTORY)
            )
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _regular(folder_fd: int, name: str, where: str, what: str) -> None:
    try:
        fd = open_beneath(folder_fd, name)
    except OSError as err:
        reason = {errno.ELOOP: "a link", errno.EXDEV: "outside its folder", errno.ENOENT: "missing"}.get(
            err.errno, err.strerror
        )
        raise UserError(
            f"refusing {what}: {where}/{name} is {reason} (only regular files beneath it are read)"
        ) from None
    try:
        mode = os.fstat(fd).st_mode
    finally:
        os.close(fd)
    if not stat.S_ISREG(mode):
        raise UserError(f"refusing {what}: {where}/{name} is not a regular file (a FIFO, socket or device)")


def _walk(root: Path, what: str) -> Iterator[str]:
    """Every entry beneath ``root`` (relative names), links and non-regular files refused."""
    count = 0
    stack = [""]
    while stack:
        relative = stack.pop()
        with os.scandir(root / relative if relative else root) as entries:
            for entry in entries:
                name = f"{relative}/{entry.name}" if relative else entry.name
                count += 1
                if count > MAX_FILES:
                    raise UserError(f"refusing {what}: {root} holds more than {MAX_FILES} files")
                if entry.is_symlink():
                    raise UserError(
                        f"refusing {what}: {root}/{name} is a link (only regular files beneath it are read)"
                    )
                if entry.is_dir(follow_symlinks=False):
                    stack.append(name)
                elif entry.is_file(follow_symlinks=False):
                    yield name
                else:
                    raise UserError(f"refusing {what}: {root}/{name} is not a regular file (a FIFO, socket or device)")


def check(path: Path, what: str) -> Path:
    """``path`` (a file, or a folder and everything in it) as a confined run may read it; returns it, resolved.
    One error line naming the file otherwise."""
    path = Path(os.path.abspath(path))
    if path.is_symlink():
        raise UserError(f"refusing {what}: {path} is a link (name the file itself)")
    if not path.exists():
        raise UserError(f"refusing {what}: {path} does not exist")
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not path.is_dir():
            _regular(parent, path.name, str(path.parent), what)
            return path
    finally:
        os.close(parent)
    folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        names = list(_walk(path, what))
        for name in names:
            _regular(folder, name, str(path), what)
        for name in names:
            if Path(name).name in INDEXES:
                for shard in _index_files(path, name, what):
                    _regular(folder, shard, str(path), what)
    finally:
        os.close(folder)
    return path


def _index_files(root: Path, index: str, what: str) -> list[str]:
    """The files a sharded checkpoint's index names (its ``weight_map`` values), relative to ``root``."""
    try:
        weight_map = json.loads((root / index).read_text(encoding="utf-8")).get("weight_map") or {}
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"refusing {what}: cannot read {root / index}: {err}") from None
    base = os.path.dirname(index)
    return [os.path.join(base, str(v)) if base else str(v) for v in dict.fromkeys(weight_map.values())]


def local_path(value: Optional[str]) -> Optional[Path]:
    """A setting's value as a local path, where it names one that exists (else a hub name, or nothing)."""
    if not value or not isinstance(value, str) or value.startswith("bundled:"):
        return None
    path = Path(value).expanduser()
    return path if path.exists() or path.is_symlink() else None
