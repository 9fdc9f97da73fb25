"""Launches the sandbox cannot hold as one unit: ranks another program started (torchrun, SLURM's ``srun``, LSF's
``jsrun``, ``mpirun``) or that meet over the network (``--trainer.num_nodes`` > 1).

One confined run is one sandbox with all its processes inside (Lightning's own launcher for ``--trainer.devices N``
starts its ranks in it). A rank that an outside launcher started would confine itself alone: in a network namespace of
its own it cannot reach the launcher's store (torchrun hung until killed), and ranks of one node would not share
memory (NCCL falls back to TCP, silently). So an untrusted command started that way is refused in one line before
anything starts, naming how to trust it; a trusted one runs as Lightning runs it. The launcher is detected from its
variables with Lightning's own cluster environments, in Lightning's order (`lightning.fabric.connector`).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.fabric.plugins.environments import LSFEnvironment, MPIEnvironment, TorchElasticEnvironment
from lightning.fabric.plugins.environments.slurm import _is_srun_used

from lit_memory.config.trusted import COMMAND
from lit_memory.errors import UserError
from lit_memory.sandbox import TRUST_FLAG


def outside_launcher() -> Optional[str]:
    """The launcher that started this process as one of several ranks, named with the variable that says so, or None
    (a single process, however it was started, is confined as one)."""
    if TorchElasticEnvironment.detect():  # first, as Lightning: torchrun is also used inside SLURM allocations
        return (
            f"torchrun (TORCHELASTIC_RUN_ID={os.environ['TORCHELASTIC_RUN_ID']}, "
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE', '?')})"
        )
    if _is_srun_used() and _count(os.environ.get("SLURM_NTASKS")) > 1:
        return (
            f"SLURM's srun (SLURM_NTASKS={os.environ['SLURM_NTASKS']}, "
            f"SLURM_PROCID={os.environ.get('SLURM_PROCID', '?')})"
        )
    if LSFEnvironment.detect() and _count(os.environ.get("JSM_NAMESPACE_SIZE")) > 1:
        return f"LSF's jsrun (JSM_NAMESPACE_SIZE={os.environ['JSM_NAMESPACE_SIZE']})"
    if MPIEnvironment.detect():  # Lightning's own test: mpi4py with more than one process in the world
        return "MPI (mpi4py reports several processes)"
    return None


def _count(value: Optional[str]) -> int:
    try:
        return int(value or 1)
    except ValueError:
        return 1


def check(why_confined: str, num_nodes: Any = None) -> None:
    """Refuse, in one line, a command that would be confined (``why_confined``: the trust verdict's line) but was
    started by an outside launcher or spans several nodes. Only the first rank says it; every rank stops."""
    launcher = outside_launcher()
    nodes = _count(str(num_nodes)) if num_nodes is not None else 1
    if launcher is None and nodes <= 1:
        return
    how = f"it was started by {launcher}" if launcher else f"it spans {nodes} nodes (trainer.num_nodes)"
    reason = why_confined.removeprefix("sandbox: running confined, because ").split("; if you trust")[0]
    message = (f"refusing to run confined: {how}, and a sandbox holds one process tree on one machine, not ranks "
               f"another program starts or that meet over the network; the run would be confined because {reason}. "
               f"If you trust its source, trust it first ({COMMAND} FILE) or pass {TRUST_FLAG}")
    raise LauncherRefused(message, first=_first_rank())


def _first_rank() -> bool:
    """Whether this process is the first of its launch (the one whose line is printed)."""
    for name in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "JSM_NAMESPACE_RANK"):
        if name in os.environ:
            return os.environ[name] == "0"
    return True


class LauncherRefused(UserError):
    """A refusal every rank raises and only the first prints (`lit_memory.__main__`)."""

    def __init__(self, message: str, first: bool) -> None:
        super().__init__(message)
        self.first = first
