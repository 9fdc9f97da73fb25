"""Linux Landlock through its three system calls (ctypes: no compiled module, no dependency).

A process restricts itself: `Ruleset` lists what it may still do (read or write beneath folders, bind or connect
TCP ports), `Ruleset.enforce` sets ``no_new_privs`` and calls ``landlock_restrict_self``; from then on the kernel
refuses everything else to this process and every process it starts, whatever code asks (Python, C++, Rust).
Nothing can lift it. `abi` is the kernel's Landlock version (0: none, or refused by the container).

Access rights and their ABI versions are the kernel's (include/uapi/linux/landlock.h); the rights a kernel does
not know are left out of the ruleset, so an older kernel enforces what it can and `abi` says what that is.
What Landlock does not mediate: connecting to a UNIX socket by its path (a Docker socket), reading a FIFO inside
a readable folder (inputs are staged as regular files: `lit_memory.sandbox.stage`).
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass, field
from typing import Iterable

# x86-64 and aarch64 share these numbers (the generic syscall table since Linux 5.13).
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH, RULE_NET_PORT = 1, 2
PR_SET_NO_NEW_PRIVS = 38

# Filesystem rights: (bit, first ABI that has it).
FS = {
    "execute": (1 << 0, 1), "write_file": (1 << 1, 1), "read_file": (1 << 2, 1), "read_dir": (1 << 3, 1),
    "remove_dir": (1 << 4, 1), "remove_file": (1 << 5, 1), "make_char": (1 << 6, 1), "make_dir": (1 << 7, 1),
    "make_reg": (1 << 8, 1), "make_sock": (1 << 9, 1), "make_fifo": (1 << 10, 1), "make_block": (1 << 11, 1),
    "make_sym": (1 << 12, 1), "refer": (1 << 13, 2), "truncate": (1 << 14, 3), "ioctl_dev": (1 << 15, 5),
}
NET = {"bind_tcp": (1 << 0, 4), "connect_tcp": (1 << 1, 4)}
# ABI 6: no connecting to abstract UNIX sockets, nor signalling processes, outside the confined ones.
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
# What a read-only root grants, and what a writable one adds (no devices made anywhere, FIFOs and sockets only in the
# run's temporary folders: multiprocessing's resource sharer, DataLoader workers' queues, `SOCKETS`).
READ = ("execute", "read_file", "read_dir")
WRITE = ("write_file", "remove_dir", "remove_file", "make_dir", "make_reg", "make_sym", "refer", "truncate")
SOCKETS = ("make_sock", "make_fifo")
FILE_RIGHTS = ("execute", "write_file", "read_file", "truncate", "ioctl_dev")  # what a rule on a file may grant
# A GPU's device files: the driver is driven by ioctl (ABI 5 refuses it on any device no rule grants it on: CUDA
# then fails with "OS call failed", error 304, and NVML does not start).
DEVICE = ("read_file", "write_file", "read_dir", "ioctl_dev")
# Its threads' files in /proc: CUDA names the threads it starts (/proc/<pid>/task/<tid>/comm, opened read-write),
# and cuInit fails with error 304 where it cannot.
THREADS = ("read_file", "write_file", "read_dir")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPort(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (another OS, an old kernel, a container or seccomp
    policy that refuses the call, Landlock disabled at boot)."""
    if platform.system() != "Linux":
        return 0
    try:
        version = _libc().syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(version), 0)


def _mask(names: Iterable[str], table: dict, version: int) -> int:
    return sum(bit for name, (bit, since) in table.items() if name in names and since <= version)


@dataclass
class Ruleset:
    """What a confined process may still do. ``read``/``write``: paths beneath which it may read (and run), or also
    write; ``devices``: device files (or folders of them) it may also drive by ioctl; ``connect``: TCP ports it may
    connect to (ABI 4 and later: none else); ``bind``: ports it may listen on; ``threads``: folders of /proc whose
    files it may read and write (its threads' names); ``sockets``: folders it may write and make UNIX sockets and FIFOs
    in (its temporary folders)."""

    read: list[str] = field(default_factory=list)
    write: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)
    sockets: list[str] = field(default_factory=list)
    connect: list[int] = field(default_factory=list)
    bind: list[int] = field(default_factory=list)

    def enforce(self, version: int = 0) -> int:
        """Restrict this process (and its future children) to the ruleset; returns the ABI it was enforced at.
        Paths that do not exist are skipped. Raises OSError where the kernel refuses."""
        version = version or abi()
        if version < 1:
            raise OSError("Landlock is not available")
        libc = _libc()
        handled_fs = _mask(FS, FS, version)
        handled_net = _mask(NET, NET, version) if version >= 4 else 0
        scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= 6 else 0
        attr = _RulesetAttr(handled_fs, handled_net, scoped)
        size = ctypes.sizeof(_RulesetAttr) if version >= 6 else (16 if version >= 4 else 8)
        fd = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
        if fd < 0:
            raise OSError(ctypes.get_errno(), "landlock_create_ruleset: " + os.strerror(ctypes.get_errno()))
        try:
            reads, writes = _mask(READ, FS, version), _mask(READ + WRITE, FS, version)
            for paths, rights in ((self.read, reads), (self.write, writes), (self.devices, _mask(DEVICE, FS, version)),
                                  (self.threads, _mask(THREADS, FS, version)),
                                  (self.sockets, _mask(READ + WRITE + SOCKETS, FS, version))):
                for path in dict.fromkeys(paths):
                    linked = os.path.lexists(path) and os.path.realpath(path) != os.path.abspath(path)
                    if rights & writes == writes and linked:
                        raise OSError(f"the write root {path} is reached through a link (it was not when it was "
                                      "judged)")
                    self._add_path(libc, fd, path, rights, version)
            if handled_net:
                for ports, right in ((self.connect, "connect_tcp"), (self.bind, "bind_tcp")):
                    for port in dict.fromkeys(ports):
                        rule = _NetPort(NET[right][0], int(port))
                        if libc.syscall(SYS_ADD_RULE, fd, RULE_NET_PORT, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                            raise OSError(ctypes.get_errno(), f"landlock_add_rule (port {port})")
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
            if libc.syscall(SYS_RESTRICT_SELF, fd, ctypes.c_uint32(0)) != 0:
                raise OSError(ctypes.get_errno(), "landlock_restrict_self: " + os.strerror(ctypes.get_errno()))
        finally:
            os.close(fd)
        return version

    @staticmethod
    def _add_path(libc: ctypes.CDLL, ruleset: int, path: str, rights: int, version: int) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return  # absent here (a cache not made yet, a device this machine lacks)
        try:
            if not os.path.isdir(path):  # a rule on a file grants only rights that apply to files
                rights &= _mask(FILE_RIGHTS, FS, version)
            rule = _PathBeneath(rights, fd)
            if libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule ({path}): " + os.strerror(ctypes.get_errno()))
        finally:
            os.close(fd)
