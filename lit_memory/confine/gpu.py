"""A GPU for a confined run: the device files CUDA needs exist before the child starts.

CUDA's first use after boot makes ``/dev/nvidia-uvm`` through the setuid ``nvidia-modprobe``, which ``no_new_privs``
forbids inside the sandbox (`lit_memory.sandbox.landlock`), and the view holds only the device files that exist when
it is built. So the parent, unconfined, makes it first (``nvidia-modprobe -u -c=0``, as the driver's own tools do), or
says in one line why the GPU cannot start. `uvm` takes the ``/dev`` folder and the runner as arguments: a test drives
the decision with a fake folder and no GPU.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Callable, Optional

COMMAND = ("-u", "-c=0")  # load nvidia-uvm and make its device files (nvidia-modprobe(1))


def uvm(dev: Path = Path("/dev"), run: Callable[..., object] = subprocess.run,
        which: Callable[[str], Optional[str]] = shutil.which) -> Optional[str]:
    """Make ``/dev/nvidia-uvm`` where an NVIDIA driver is there (``nvidiactl``) and it is not; None where nothing is
    missing (or no NVIDIA driver), else the one line why a confined run's GPU cannot start."""
    if not (dev / "nvidiactl").exists() or (dev / "nvidia-uvm").exists():
        return None
    why = "nvidia-modprobe is not installed"
    tool = which("nvidia-modprobe")
    if tool is not None:
        try:
            run([tool, *COMMAND], check=False, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as err:
            why = f"{tool} {' '.join(COMMAND)} failed ({err})"
        else:
            if (dev / "nvidia-uvm").exists():
                return None
            why = f"{tool} {' '.join(COMMAND)} did not make it"
    return (f"warning: sandbox: the GPU cannot start confined: {dev / 'nvidia-uvm'} is missing and {why} (inside the "
            "sandbox the setuid helper may not run); run `nvidia-modprobe -u -c=0` or any CUDA program once "
            "unconfined, then start the run again")
