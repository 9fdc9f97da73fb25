"""The system calls a confined run may not make, whatever code asks: a seccomp filter.

Landlock mediates paths, TCP ports and two scopes; the kernel offers more than that to any process. The filter
refuses (``EPERM``, so a library that probes gets an error, not a crash):

- sockets of families the run does not need: ``AF_UNIX`` only (Python's multiprocessing and torch's DataLoader pass
  file descriptors over it), plus ``AF_INET``/``AF_INET6`` and ``AF_NETLINK`` for a distributed launch, whose ranks
  meet on TCP (gloo, NCCL's bootstrap) and look up interfaces; no raw, packet, vsock, bluetooth or kernel-crypto
  socket;
- the kernel's keyrings (``keyctl``, ``add_key``, ``request_key``: the session keyring holds the user's secrets) and
  System V IPC (``shmget``, ``msgget``, ``semget`` and the calls on their objects: segments of other processes);
- ``ioctl(TIOCSTI)`` and ``TIOCLINUX``, which push text into a terminal's input, to run after the run;
- what would undo or get around the other layers: new namespaces (``unshare``, ``setns``, ``clone`` with a
  ``CLONE_NEW*`` flag; ``clone3``, whose flags a filter cannot read, answers ``ENOSYS`` so the C library falls back
  to ``clone``), mounts, ``io_uring`` (its operations open sockets and files without the system calls the filter
  sees), ``ptrace`` and other processes' memory, ``bpf``, ``perf_event_open``, ``userfaultfd``, kernel modules,
  ``kexec``, ``reboot``, swap, accounting, quotas, ``open_by_handle_at``.

Built with libseccomp through pyseccomp (ctypes over ``libseccomp.so.2``, API-compatible with libseccomp's own
bindings): libseccomp resolves the numbers per architecture and refuses the other ABIs a process could switch to
(i386 and x32 on x86-64), which a hand-written BPF program gets wrong easily. Where the library or the kernel's
seccomp is missing (`unavailable`), the child says so in one line; where both are there and `install` fails, the
run does not start.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import Optional

PR_GET_SECCOMP = 21
AF_NETLINK = 16
AF_MAX = 46  # the kernel's count of address families (include/linux/socket.h)
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
CLONE_NEW = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
             "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
             "CLONE_NEWNET": 0x40000000}  # (CLONE_NEWTIME exists for unshare and clone3 only)
DENIED = (
    "keyctl", "add_key", "request_key",
    "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount",
    "fspick", "fsconfig", "mount_setattr",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "ptrace", "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "userfaultfd",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "open_by_handle_at", "syslog",
)
MASK32 = 0xFFFFFFFF  # an int argument: the kernel reads its low 32 bits, whatever the caller put above them


def families(inet: bool) -> set[int]:
    """The socket families a run may open: UNIX; for a distributed launch also IPv4, IPv6 and netlink."""
    allowed = {socket.AF_UNIX}
    if inet:
        allowed |= {socket.AF_INET, socket.AF_INET6, AF_NETLINK}
    return allowed


def unavailable() -> Optional[str]:
    """Why this machine offers no seccomp filter (a kernel built without it, no libseccomp), or None."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_GET_SECCOMP, 0, 0, 0, 0) < 0:
        return f"the kernel has no seccomp (prctl: {os.strerror(ctypes.get_errno())})"
    try:
        import pyseccomp  # noqa: F401  (loads libseccomp)
    except (OSError, ImportError, AttributeError) as err:
        return f"no libseccomp ({err or type(err).__name__})"
    return None


def install(inet: bool) -> None:
    """Load the filter into this process (and everything it starts; every thread it has). Raises where it cannot."""
    import pyseccomp as sc  # deferred: it loads libseccomp when imported, and raises where there is none

    flt = sc.SyscallFilter(sc.ALLOW)
    refuse = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            flt.add_rule(refuse, name)
        except (OSError, ValueError):
            continue  # not a system call on this architecture
    allowed = families(inet)
    for family in range(AF_MAX):
        if family not in allowed:
            for call in ("socket", "socketpair"):
                flt.add_rule(refuse, call, sc.Arg(0, sc.MASKED_EQ, MASK32, family))
    for request in (TIOCSTI, TIOCLINUX):
        flt.add_rule(refuse, "ioctl", sc.Arg(1, sc.MASKED_EQ, MASK32, request))
    for flag in CLONE_NEW.values():
        flt.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    try:
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    except (OSError, ValueError):
        pass
    flt.set_attr(sc.Attr.CTL_TSYNC, 1)
    try:
        flt.set_attr(sc.Attr.CTL_OPTIMIZE, 2)  # a binary tree over the system call numbers (libseccomp 2.5)
    except OSError:
        pass
    flt.load()
