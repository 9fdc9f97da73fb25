"""Linux namespaces for a confined run: its own network, IPC, process ids and a view of the file system that holds
only what it may use.

- **network**: a namespace of its own with only the loopback interface, brought up here: no UDP, TCP or any other
  traffic reaches a listener outside, whatever the protocol (a distributed launch's ranks meet on 127.0.0.1 inside);
- **IPC**: System V segments, queues and semaphores and POSIX message queues of its own;
- **process ids**: the run's first process is the namespace's init, and when it ends the kernel kills every process
  in it, one that started a session of its own included (`lit_memory.sandbox.child` forks it);
- **mount**: a view built from the run's roots alone (`build_view`): the Python installation, system libraries, the
  files it reads and the folders it writes, bound at their own paths on an empty root, a fresh ``/proc`` of its
  process namespace, the device files it needs and a private ``/dev/shm`` of bounded size. A UNIX socket by path
  (a container engine's, an agent's), another user's files, the host's ``/dev/shm``: not there to reach.

A process that is not root gets these by first making a user namespace (its own user id mapped to itself); root
makes them directly. Where the kernel or a container refuses one, `enter` says which, and the child names the missing
layer in one line. ctypes over ``unshare``, ``mount`` and ``pivot_root``: Python 3.11 has none of them (``os.unshare``
is 3.12), and no maintained library on the package index offers them without a compiled part.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import socket
import struct
from typing import Iterable, Optional

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
MS_REMOUNT = 32
MNT_DETACH = 2
# What of a fresh /proc stays read only, as container engines leave it: the kernel's settings (sysctls), the
# SysRq trigger (no capability check: uid 0 could reboot the machine), interrupts, buses, file systems, drivers'
# controls (NVIDIA's suspend file among them) and pressure triggers. The run may write its own processes' files
# there (CUDA names its threads in /proc/<pid>/task/<tid>/comm).
READ_ONLY_PROC = ("sys", "sysrq-trigger", "irq", "bus", "fs", "driver", "pressure", "tty", "acpi", "scsi", "asound",
                  "latency_stats", "timer_list", "sched_debug")
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP, IFF_RUNNING = 0x8913, 0x8914, 0x1, 0x40
# The namespaces a run gets, by the name a missing one is reported with.
NAMESPACES = {"network": CLONE_NEWNET, "ipc": CLONE_NEWIPC, "pid": CLONE_NEWPID, "mount": CLONE_NEWNS}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _error(call: str) -> str:
    code = ctypes.get_errno()
    return f"{call}: {os.strerror(code)}"


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)


def enter() -> dict[str, str]:
    """Move this process (single-threaded) into new namespaces: network (loopback only), IPC, mount and process ids
    (for its children), always all four: no setting of a run keeps the host's network. Returns the ones the kernel or
    its container does not offer, each with the reason."""
    libc = _libc()
    wanted = dict(NAMESPACES)
    missing: dict[str, str] = {}
    if os.geteuid() != 0:  # a user namespace first: the capabilities to make the others, over them only
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(CLONE_NEWUSER) != 0:
            why = _error("unshare(CLONE_NEWUSER)")
            return {name: why for name in wanted}
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError as err:
            return {name: f"user namespace id map: {err.strerror}" for name in wanted}
    flags = 0
    for flag in wanted.values():
        flags |= flag
    if libc.unshare(flags) == 0:
        return missing
    for name, flag in wanted.items():  # some refused (a container's policy): find which
        if libc.unshare(flag) != 0:
            missing[name] = _error(f"unshare({name})")
    return missing


def loopback_up() -> Optional[str]:
    """Bring up ``lo`` in this (new) network namespace; why not, or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP | IFF_RUNNING))
    except OSError as err:
        return f"loopback: {err.strerror}"
    return None


def _mount(source: Optional[str], target: str, kind: Optional[str], flags: int, data: Optional[str] = None) -> None:
    libc = _libc()
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(kind), ctypes.c_ulong(flags), enc(data)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {source or kind} on {target}: {os.strerror(code)}")


def _links_on(path: str) -> Iterable[tuple[str, str]]:
    """(link, its target as written) of every symbolic link met resolving ``path`` (absolute), in order."""
    current, parts, seen = "/", [p for p in path.split("/") if p], 0
    while parts and seen < 40:
        part = parts.pop(0)
        nxt = os.path.join(current, part)
        if os.path.islink(nxt):
            seen += 1
            target = os.readlink(nxt)
            yield nxt, target
            resolved = os.path.normpath(os.path.join(current, target))
            parts = [p for p in resolved.split("/") if p] + parts
            current = "/"
        else:
            current = nxt


class View:
    """An empty root (a small tmpfs on ``root``) the run's paths are bound into at their own paths."""

    def __init__(self, root: str, tmp_bytes: int = 0) -> None:
        self.root = root
        self.bound: list[str] = []  # real paths bound so far (folders: what is below them is there already)
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the user's namespace
        _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m")
        self.tmp = bool(tmp_bytes)  # a /tmp of its own (`TMP`), the roots beneath the host's bound into it
        if self.tmp:
            os.makedirs(self._place(TMP))
            size = max(tmp_bytes, 1 << 20)
            _mount("tmpfs", self._place(TMP), "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={size}")

    def _inside(self, real: str) -> bool:
        return any(real == b or real.startswith(b.rstrip("/") + "/") for b in self.bound)

    def _place(self, path: str) -> str:
        return self.root + path

    def bind(self, path: str, recursive: bool = True, read_only: bool = False) -> None:
        """``path`` (and what it resolves through) at the same path in the view; nothing where it does not exist;
        ``read_only``: the bind itself read only (a read root in the run's writable /tmp)."""
        if not os.path.lexists(path):
            return
        for link, target in _links_on(path):
            place = self._place(link)
            if not os.path.lexists(place) and not self._inside(os.path.dirname(link)):  # (its folder is a real path)
                os.makedirs(os.path.dirname(place), exist_ok=True)
                os.symlink(target, place)
        real = os.path.realpath(path)
        if not os.path.exists(real) or self._inside(real):
            return
        place = self._place(real)
        if os.path.isdir(real):
            os.makedirs(place, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(place), exist_ok=True)
            with open(place, "a"):
                pass
        _mount(real, place, None, MS_BIND | (MS_REC if recursive else 0))
        if os.path.isdir(real):
            self.bound.append(real)
        if read_only:
            _read_only(real, place)

    def devices(self, paths: Iterable[str], shm_bytes: int) -> None:
        """``/dev`` with only ``paths`` (device files, bound), the standard links, and a private ``/dev/shm`` of
        ``shm_bytes``."""
        os.makedirs(self._place("/dev"), exist_ok=True)
        for path in paths:
            if path != "/dev/shm" and os.path.exists(path):
                self.bind(path, recursive=False)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2")):
            with contextlib.suppress(FileExistsError):
                os.symlink(target, self._place(f"/dev/{name}"))
        os.makedirs(self._place("/dev/shm"), exist_ok=True)
        size = max(shm_bytes, 1 << 20)
        _mount("tmpfs", self._place("/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={size}")

    def proc(self) -> bool:
        """A ``/proc`` of this process namespace (only the run's processes), the machine's settings in it read only
        (`READ_ONLY_PROC`, as container engines leave them); or the user's where it cannot be mounted (no process
        namespace, or a container that masks parts of its own). Whether it is the run's own."""
        place = self._place("/proc")
        os.makedirs(place, exist_ok=True)
        try:
            _mount("proc", place, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:
            _mount("/proc", place, None, MS_BIND | MS_REC)
            return False
        for name in READ_ONLY_PROC:
            path = os.path.join(place, name)
            if os.path.lexists(path):
                _mount(path, path, None, MS_BIND | MS_REC)
                _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        return True

    def enter(self, cwd: str) -> None:
        """Make the view this process's root (``pivot_root``; the old root detached), and ``cwd`` its folder."""
        for path in (TMP, cwd):
            place = self._place(path)
            if not os.path.lexists(place) and not self._inside(path):
                os.makedirs(place, exist_ok=True)
        old = self._place("/.old")
        os.mkdir(old)
        libc = _libc()
        number = SYS_PIVOT_ROOT.get(platform.machine())
        if number is None:
            raise OSError(errno.ENOSYS, f"pivot_root: no system call number for {platform.machine()}")
        if libc.syscall(number, os.fsencode(self.root), os.fsencode(old)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"pivot_root: {os.strerror(code)}")
        try:
            os.chdir("/")
            if libc.umount2(b"/.old", MNT_DETACH) != 0:
                raise OSError(ctypes.get_errno(), "umount /.old")
            os.rmdir("/.old")
            os.chdir(cwd)
        except OSError as err:
            raise RuntimeError(f"the view is half entered: {err}") from None


PATH_MAX = 4096  # the kernel's longest path, its closing NUL included (include/uapi/linux/limits.h)


def unplaceable(root: str, paths: Iterable[str]) -> Optional[str]:
    """The first of ``paths`` that cannot be bound into a view on ``root`` (its place there, ``root`` + the path as
    named or as resolved, would pass the kernel's PATH_MAX), or None. Asked by the parent before the child starts:
    the child would fail to build its view, and does not run without one."""
    for path in dict.fromkeys(paths):
        for form in (os.path.abspath(path), os.path.realpath(path)):
            if len(os.fsencode(root + form)) >= PATH_MAX:
                return path
    return None


def build_view(root: str, paths: Iterable[str], devices: Iterable[str], shm_bytes: int, cwd: str,
               writes: Iterable[str] = (), tmp_bytes: int = 0) -> bool:
    """Make this process's root a view holding ``paths`` (read and write roots, bound at their own paths, parents
    first), ``devices``, a private ``/dev/shm`` and ``/proc``, and enter it in ``cwd``; whether that ``/proc`` is the
    run's own (`View.proc`). ``tmp_bytes``: a fresh ``/tmp`` of that size, the run's to write (Landlock grants it, and
    grants are inherited below: a read root beneath ``/tmp``, one of ``paths`` not in ``writes``, is bound read only;
    `tmp_allowed` says where that holds). Raises OSError where the kernel refuses a step before the root is switched
    (the process keeps its root; what was mounted stays in its own mount namespace), RuntimeError after (the process
    must not run on)."""
    view = View(root, tmp_bytes)
    writes = {os.path.realpath(w) for w in writes}
    wanted = [p for p in dict.fromkeys(paths) if not p.startswith(("/proc/", "/dev/")) and p not in ("/proc", "/dev")]
    for path in sorted(wanted, key=lambda p: (len(os.path.realpath(p)), p)):
        real = os.path.realpath(path)
        read_only = view.tmp and _beneath(real, TMP) and real not in writes
        # A folder holding the view's own root would copy the view into itself: bound without what is mounted below.
        view.bind(path, recursive=not (root == path or root.startswith(path.rstrip("/") + "/")), read_only=read_only)
    view.devices(devices, shm_bytes)
    own = view.proc()
    view.enter(cwd)
    return own


TMP = "/tmp"
# statvfs's flags and the mount flags a bind's read-only remount keeps (a user namespace may not clear them).
_KEPT = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: 1024,
         os.ST_NODIRATIME: 2048, os.ST_RELATIME: 1 << 21}


def tmp_allowed(reads: Iterable[str], writes: Iterable[str]) -> bool:
    """Whether the run may have a writable ``/tmp`` of its own: no read root beneath the host's ``/tmp`` holds a write
    root (bound read only, it would hold the write root read only too; bound writable, the grant on ``/tmp`` would
    reach the rest of it)."""
    writes = {os.path.realpath(w) for w in writes}
    for path in reads:
        real = os.path.realpath(path)
        if real not in writes and _beneath(real, TMP) and any(_beneath(w, real) for w in writes):
            return False
    return True


def _beneath(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _read_only(real: str, place: str) -> None:
    """Make the bind of ``real`` on ``place`` read only, keeping the flags its mount has."""
    flags = os.statvfs(real).f_flag
    kept = sum(mount for st, mount in _KEPT.items() if flags & st)
    _mount(None, place, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
