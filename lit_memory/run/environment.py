"""The environment variables a run sets in its own process, put back when the run ends (`restored`).

Lightning sets them for the processes a run starts and leaves them behind in the one that started them: its
launchers (``_SubprocessScriptLauncher`` for DDP/FSDP, the spawn launcher, ``_init_dist_connection``) name the
rendezvous and this process's place in it (``MASTER_ADDR``/``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``), its DDP set-up may set ``OMP_NUM_THREADS``, a deterministic trainer ``CUBLAS_WORKSPACE_CONFIG``, and
``seed_everything`` the seed its dataloader workers and spawned processes read (``PL_GLOBAL_SEED``,
``PL_SEED_WORKERS``). Left behind, they change the next run in the same process: with ``LOCAL_RANK`` set, a
launcher takes the process for one it started and starts no other. The allocator's and the trust decision's own
variables are put back by their own scopes (`lit_memory.memory.hardware.allocator.recipe_settings`,
`lit_memory.sandbox.guard.enforced`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator, Optional

# Where a process stands in a rendezvous (torchrun's, or Lightning's launchers'). Inherited by a process meant as a
# new job, they make it join a rendezvous that never completes: with LOCAL_RANK set, Lightning takes it for a
# process it started itself and starts no other rank (rank 0 then waits for the rest until its timeout), and
# transformers.Trainer joins a process group and wraps the model in DDP.
LAUNCHER_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
)
RUN_VARIABLES = (*LAUNCHER_VARIABLES, "OMP_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@contextlib.contextmanager
def restored(names: Iterable[str] = RUN_VARIABLES, environ: Optional[dict] = None) -> Iterator[None]:
    """For the length of the block, the variables ``names`` may change; at its end each is as it was (unset, if it
    was). The others are left alone: what a run's own code sets for the process is its business."""
    environ = os.environ if environ is None else environ
    saved = {name: environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value


def for_new_job(environ: Optional[dict] = None) -> dict[str, str]:
    """This process's environment (or ``environ``) for a process that is a job of its own (a benchmarked run, a
    test's launch): without a launcher's variables, whatever an earlier run in this process left behind."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k not in LAUNCHER_VARIABLES}


SAFE_PATH = "PYTHONSAFEPATH"  # Python 3.11: no working folder or script folder first on sys.path


@contextlib.contextmanager
def safe_path() -> Iterator[None]:
    """For the length of the block every Python this process starts, or a library it calls starts, puts neither the
    working folder nor a script's folder first on ``sys.path`` (``PYTHONSAFEPATH``): jsonargparse's typeshed_client
    runs ``python -c`` in the working folder while parsing, Lightning's launchers start ``python -m``, multiprocessing's
    spawn and torch's compile workers start Python too, and a folder someone sent holding ``json.py`` would run in
    each of them. ``PATH`` loses its entries that name the working folder (empty or relative ones): a program a library
    starts by name (``gcc`` for ``ctypes.util.find_library``) is never one the folder ships. Put back after the block
    (a command's whole life: `lit_memory.__main__.main`)."""
    with restored((SAFE_PATH, "PATH")):
        os.environ[SAFE_PATH] = "1"
        if "PATH" in os.environ:
            os.environ["PATH"] = without_working_folder(os.environ["PATH"])
        yield


def without_working_folder(path: str) -> str:
    """A ``PATH``-like list without its empty and relative entries (each names the working folder, or one below it)."""
    return os.pathsep.join(p for p in path.split(os.pathsep) if p and os.path.isabs(p))
