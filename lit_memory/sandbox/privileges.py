"""No capability left to a confined run, even when the user is root (a container, CI).

Root keeps every capability a process can hold, and paths do not mediate them: a raw socket (``CAP_NET_RAW``), text
pushed into a terminal's input (``TIOCSTI`` on a terminal that is not its own needs ``CAP_SYS_ADMIN``), files of
other users (``CAP_DAC_OVERRIDE``), the kernel's modules. `drop` locks root's special treatment off (securebits),
empties the bounding set (so no program the run starts gains any back, a setuid one included, alongside Landlock's
``no_new_privs``) and the ambient set, then clears the permitted, effective and inheritable sets. The user id stays:
what the run writes is the user's. ctypes over ``prctl`` and ``capset``: Python has no binding, and the libraries that
do (python-prctl) compile against libcap.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Optional

PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
# SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_NO_CAP_AMBIENT_RAISE and the locks of these and of SECBIT_KEEP_CAPS
SECUREBITS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 3) | (1 << 5) | (1 << 6) | (1 << 7)
CAPABILITY_VERSION_3 = 0x20080522


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def held() -> dict[str, int]:
    """This process's capability sets (``CapEff``, ``CapPrm``, ``CapBnd``, ``CapAmb``, ``CapInh``), from the kernel."""
    sets = {}
    with contextlib.suppress(OSError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Cap"):
                    name, value = line.split(":")
                    sets[name] = int(value.strip(), 16)
    return sets


def drop() -> Optional[str]:
    """Drop every capability of this process and of what it starts; why some remain, or None."""
    libc = ctypes.CDLL(None, use_errno=True)
    last = 63
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
            last = int(f.read())
    libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0)  # needs CAP_SETPCAP: a process without it has no root to lock
    for cap in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    data = (_Data * 2)()
    if libc.capset(ctypes.byref(_Header(CAPABILITY_VERSION_3, 0)), data) != 0:
        return f"capset: {ctypes.get_errno()}"
    sets = held()
    if sets.get("CapEff") or sets.get("CapPrm") or sets.get("CapAmb"):
        return "capabilities remain after capset"
    return None
