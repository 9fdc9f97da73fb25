"""The confined process's side: apply the `Spec` the parent handed over, first thing (`lit_memory/__init__.py`).

The kernel then enforces it on this process and every process it starts (DataLoader workers, a distributed
launch's other ranks). One thing Landlock does not mediate is connecting to a UNIX socket by its path (a container
engine's socket): Python's audit hook refuses that here, for sockets outside the run's own folders.
"""

from __future__ import annotations

import os
import socket
import sys

from lit_memory.sandbox.rules import ENV, Spec, enter

_entered = False


def enter_from_env() -> None:
    """Confine this process as the environment's `Spec` says (once)."""
    global _entered
    if _entered or not os.environ.get(ENV):
        return
    spec = Spec.from_env(os.environ[ENV])
    enter(spec)
    _entered = True
    roots = tuple(os.path.realpath(w) for w in spec.write)

    def hook(event: str, args: tuple) -> None:
        if event != "socket.connect":
            return
        sock, address = args[0], args[1]
        if getattr(sock, "family", None) != socket.AF_UNIX or not isinstance(address, (str, bytes)):
            return
        path = os.fsdecode(address)
        if path.startswith("\0") or not path:
            return  # abstract sockets: Landlock's scope (ABI 6) keeps them to this run's processes
        real = os.path.realpath(path)
        if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
            raise PermissionError(f"refused by the sandbox: connecting to the UNIX socket {path}")

    sys.addaudithook(hook)
