"""A control group for one confined run: its memory and processes bounded by the kernel, all of them killed at the end.

The watchdog sees a process's resident memory; the kernel's memory controller also counts what is not resident in
any process (files in ``/dev/shm`` and other tmpfs, ``memfd`` pages, the page cache it can reclaim), and kills inside
the group when the bound is passed. The pids controller bounds how many processes and threads the run has, and the
group names every process the run started, in whatever session, so `Group.kill` leaves none behind.

The parent makes the group (`make`) below its own, with the run's bounds; the child writes itself into it first
thing (`join`), before it starts anything, so everything it starts is in it. cgroup v1 (a memory and a pids
hierarchy, as on this project's machines) or v2 (one hierarchy, where the memory controller is delegated to the
user's group); where neither can be made (no permission, no controller) `make` says why in one line and the run
keeps the watchdog's bounds only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Optional

PREFIX = "lit_memory-run-"


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, options) of every cgroup hierarchy."""
    found = []
    with contextlib.suppress(OSError):
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if len(fields) > 4 and tail and tail[0] in ("cgroup", "cgroup2"):
                    found.append((fields[4], tail[0], set(tail[-1].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """This process's group in each hierarchy: ``{controller or "": path}`` ("" for v2)."""
    own = {}
    with contextlib.suppress(OSError):
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for name in controllers.split(",") if controllers else [""]:
                    own[name] = path
    return own


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read(65536)


@dataclass
class Group:
    """One run's group: its folder in each hierarchy (v1: memory and pids; v2: one)."""

    folders: list[str]
    version: int
    memory: int = 0  # bytes (0: no memory controller)
    pids: int = 0  # processes and threads (0: no pids controller)
    killed: bool = field(default=False, repr=False)

    def procs(self) -> list[str]:
        """The files a process writes its pid into to join the group (`join`)."""
        return [os.path.join(folder, "cgroup.procs") for folder in self.folders]

    def members(self) -> set[int]:
        found: set[int] = set()
        for path in self.procs():
            with contextlib.suppress(OSError, ValueError):
                found |= {int(p) for p in _read(path).split()}
        return found

    def kill(self) -> None:
        """SIGKILL every process in the group (v2: ``cgroup.kill``; v1: until none is left: none can leave it)."""
        self.killed = True
        if self.version == 2:
            with contextlib.suppress(OSError):
                _write(os.path.join(self.folders[0], "cgroup.kill"), "1")
        for _ in range(200):
            left = self.members()
            if not left:
                return
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def oom_kills(self) -> int:
        """How many processes the kernel killed for passing the memory bound (v1's ``memory.oom_control``, v2's
        ``memory.events``: ``oom_kill N``)."""
        for folder in self.folders:
            name = "memory.events" if self.version == 2 else "memory.oom_control"
            with contextlib.suppress(OSError, ValueError):
                for line in _read(os.path.join(folder, name)).splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0

    def peak(self) -> int:
        """The most memory the group held (bytes), as the kernel counts it."""
        for folder in self.folders:
            for name in ("memory.max_usage_in_bytes", "memory.peak"):
                with contextlib.suppress(OSError, ValueError):
                    return int(_read(os.path.join(folder, name)))
        return 0

    def remove(self) -> None:
        if not self.killed:
            self.kill()
        for folder in self.folders:
            for _ in range(50):  # the last processes may take a moment to leave after SIGKILL
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def make(memory: int, pids: int) -> tuple[Optional[Group], str]:
    """A new group below this process's own with ``memory`` bytes and ``pids`` processes at most; or None and the
    reason it cannot be made here (one phrase)."""
    mounts, own = _mounts(), _own_paths()
    v1 = {c: m for m, kind, options in mounts if kind == "cgroup" for c in ("memory", "pids") if c in options}
    name = f"{PREFIX}{os.getpid()}-{time.monotonic_ns() % 10**9}"
    why = "no cgroup hierarchy is mounted"
    if "memory" in v1:
        folders = []
        try:
            for controller, mount in v1.items():
                folder = os.path.join(mount, own.get(controller, "/").lstrip("/"), name)
                _clear_stale(os.path.dirname(folder))
                os.mkdir(folder)
                folders.append(folder)
                if controller == "memory":
                    _write(os.path.join(folder, "memory.limit_in_bytes"), str(memory))
                    with contextlib.suppress(OSError):  # swap counted too where the kernel accounts it
                        _write(os.path.join(folder, "memory.memsw.limit_in_bytes"), str(memory))
                else:
                    _write(os.path.join(folder, "pids.max"), str(pids))
        except OSError as err:
            for folder in folders:
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            return None, f"cannot make a cgroup ({err.strerror}: {err.filename})"
        return Group(folders, 1, memory, pids if "pids" in v1 else 0), ""
    unified = next((m for m, kind, _ in mounts if kind == "cgroup2"), None)
    if unified is not None:
        folder = os.path.join(unified, own.get("", "/").lstrip("/"), name)
        try:
            _clear_stale(os.path.dirname(folder))
            os.mkdir(folder)
        except OSError as err:
            return None, f"cannot make a cgroup ({err.strerror}: {err.filename})"
        controllers = set()
        with contextlib.suppress(OSError):
            controllers = set(_read(os.path.join(folder, "cgroup.controllers")).split())
        if "memory" not in controllers:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
            return None, "the cgroup's memory controller is not delegated to this user's group"
        try:
            _write(os.path.join(folder, "memory.max"), str(memory))
            with contextlib.suppress(OSError):
                _write(os.path.join(folder, "memory.swap.max"), "0")
            if "pids" in controllers:
                _write(os.path.join(folder, "pids.max"), str(pids))
        except OSError as err:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
            return None, f"cannot set the cgroup's bounds ({err.strerror})"
        return Group([folder], 2, memory, pids if "pids" in controllers else 0), ""
    return None, why


def _clear_stale(parent: str) -> None:
    """Empty groups an earlier run left (its parent killed before it could remove them)."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(parent):
            if entry.startswith(PREFIX):
                pid = entry[len(PREFIX):].split("-", 1)[0]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(parent, entry))


def join(procs: list[str]) -> Optional[str]:
    """Write this process into the group (its ``cgroup.procs`` files); why it could not, or None."""
    for path in procs:
        try:
            _write(path, str(os.getpid()))
        except OSError as err:
            return f"cannot join the run's cgroup ({err.strerror}: {path})"
    return None
