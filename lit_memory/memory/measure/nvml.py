"""NVML for this process, initialised once: what ``nvidia-smi`` shows this process holding on a GPU.

Read by the run's card reading at start (`lit_memory.memory.hardware.gpus.read_card`) and by the monitor at every phase
boundary (`lit_memory.run.monitor.device_memory_used`); ``pynvml`` (nvidia-ml-py) is optional.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch


class Nvml:
    """NVML for one process: initialised once (the monitor reads the device at every phase boundary, three times a
    batch), device handles kept, and this process found among the GPU's processes.

    NVML names processes by their PID in the host's PID namespace; in a container (Docker, Kubernetes, most
    SLURM+pyxis setups) ``os.getpid()`` is another number, so matching by PID finds nothing. Then this process is
    the one whose NVML figure can hold what its own CUDA caching allocator has reserved (NVML's figure is the
    allocator's segments plus the CUDA context): the candidates are intersected over readings until one is left,
    and its host PID is kept. While several remain (processes of a similar size on one GPU), there is no answer.

    ``module``: the ``pynvml`` module, or a stand-in with its functions (a test's fake NVML).
    """

    def __init__(self, module: Any) -> None:
        self.nvml = module
        self.pid = os.getpid()
        module.nvmlInit()
        self._handles: dict[int, Any] = {}
        self._host_pid: dict[int, int] = {}  # device index -> this process's PID as NVML names it
        self._candidates: dict[int, set[int]] = {}
        self._own = own_pids()

    def handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self.nvml.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def process_memory(self, device: torch.device) -> Optional[tuple[int, str]]:
        """(bytes, source) of this process on ``device``, or None where NVML cannot tell which process it is."""
        index = torch.cuda._get_nvml_device_index(device)
        processes = [p for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle(index)) if p.usedGpuMemory]
        known = self._host_pid.get(index)
        for process in processes:
            if process.pid in self._own or process.pid == known:
                return int(process.usedGpuMemory), "nvml (this process)"
        reserved = torch.cuda.memory_reserved(device)
        if reserved <= 0:
            return None
        fitting = {p.pid for p in processes if p.usedGpuMemory >= reserved}
        candidates = self._candidates[index] = self._candidates.get(index, fitting) & fitting or fitting
        if len(candidates) != 1:
            return None
        (pid,) = candidates
        self._host_pid[index] = pid
        used = next(int(p.usedGpuMemory) for p in processes if p.pid == pid)
        return used, "nvml (this process, matched by memory: PIDs of another namespace)"


_nvml: Optional[Nvml] = None
_nvml_failed_in: Optional[int] = None  # the PID of a process whose NVML would not start: not tried again


def nvml() -> Optional[Nvml]:
    """This process's `Nvml`, started on first use (again in a forked child: NVML state is per process); None
    where ``pynvml`` or the NVML library is missing or refuses to start."""
    global _nvml, _nvml_failed_in
    pid = os.getpid()
    if _nvml is not None and _nvml.pid == pid:
        return _nvml
    if _nvml_failed_in == pid:
        return None
    try:
        import pynvml  # deferred: optional (nvidia-ml-py), read only where a CUDA run asks

        _nvml = Nvml(pynvml)
    except Exception:  # noqa: BLE001  no nvidia-ml-py, no driver library, no permission
        _nvml, _nvml_failed_in = None, pid
    return _nvml


def own_pids() -> set[int]:
    """This process's PIDs: its own, and its PID in every namespace ``/proc/self/status`` shows (``NSpid``: the
    outer ones are visible where /proc was mounted from an outer namespace)."""
    pids = {os.getpid()}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    pids |= {int(v) for v in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return pids
