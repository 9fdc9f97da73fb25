"""One optimizer step under torch.profiler, summarised: where a step's time goes; and the host's operators per step.

`StepProfiler` profiles the optimizer step after ``warmup`` steps (its micro-batches together) and writes
``profile.json`` into the run folder (`summarise`): the step's wall time, the device busy and idle within it
(device kernels, copies and sets only: not the host's annotated ranges the profiler mirrors on the device's
timeline), the host's time issuing the step, the synchronisations and the Python line that asked for each, the top
kernels. ``trace=True`` also keeps the Chrome trace (``profile.trace.json.gz``, for chrome://tracing or Perfetto).
``python -m lit_memory bench --gpu-proof`` profiles bf16 and 4gb this way.

`HostOps` counts the operators a step sends through torch's dispatcher below autograd (each, on a GPU, one kernel
launch or more for the host to issue), and `HostOpCounter` counts one optimizer step of a fit with it
(``host_ops.json``); the HF Trainer peer counts its step with the same `HostOps` (`lit_memory.tools.peer`).
"""

from __future__ import annotations

import gzip
import json
import re
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils._python_dispatch import TorchDispatchMode

from lit_memory import files

# Runtime calls that block the host until the device has caught up. A device-to-host copy of a scalar
# (``.item()``) shows as aten::_local_scalar_dense around a synchronous cudaMemcpyAsync + cudaStreamSynchronize.
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SCALAR_READ = "aten::_local_scalar_dense"
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
            "cudaMemsetAsync")
# Frames of these packages are the machinery between the code that asked and the runtime: skipped when naming
# where a synchronisation came from.
MACHINERY = ("torch/", "lightning/", "lightning_fabric/", "<built-in", "contextlib.py", "functools.py")
# What runs on a device's timeline (the profiler's activity types): kernels, copies, sets. The host's annotated ranges
# (``Optimizer.step#AdamW.step``, ``ProfilerStep#3``) are mirrored there as ``gpu_user_annotation``: not device work.
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


class StepProfiler(L.Callback):
    """Profile one optimizer step after ``warmup`` steps; write ``profile.json`` (and the trace, if asked).

    Args:
        warmup: optimizer steps before the profiled one (compile, allocations and caches settle first).
        trace: also write the Chrome trace, gzipped, beside ``profile.json``.
    """

    FILE = "profile.json"
    TRACE = "profile.trace.json.gz"

    def __init__(self, warmup: int = 3, trace: bool = False) -> None:
        self.warmup, self.trace = warmup, trace
        self._profiler: Optional[torch.profiler.profile] = None
        self._step = -1
        self.summary: Optional[dict[str, Any]] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank asks

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        if self._profiler is None and self.summary is None and trainer.global_step == self.warmup:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if pl_module.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize(pl_module.device)  # the step starts on an idle device: its own time only
            self._step = trainer.global_step
            self._profiler = torch.profiler.profile(activities=activities, with_stack=True)
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self._profiler is None or trainer.global_step == self._step:
            return  # not profiling, or mid accumulation window
        profiler, self._profiler = self._profiler, None
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # the step's kernels inside the window
        profiler.__exit__(None, None, None)
        try:
            self.summary = summarise(profiler.events(), pl_module.device.type == "cuda")
        except Exception as err:  # noqa: BLE001  a profile is evidence, not the run: keep training
            self.summary = {"error": f"{type(err).__name__}: {err}"}
        self._write(profiler)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._profiler is not None:  # training ended inside the profiled step
            self._profiler.__exit__(None, None, None)
            self._profiler = None

    @rank_zero_only
    def _write(self, profiler: torch.profiler.profile) -> None:
        files.write_text(self.run_dir / self.FILE, json.dumps(self.summary, indent=2) + "\n")
        if self.trace:  # torch writes the trace to a file of its own: a temporary one, kept gzipped
            with tempfile.TemporaryDirectory() as folder:
                raw = Path(folder) / "trace.json"
                profiler.export_chrome_trace(str(raw))
                files.write_bytes(self.run_dir / self.TRACE, gzip.compress(raw.read_bytes()))


def _interval(event: Any) -> tuple[float, float]:
    return float(event.time_range.start), float(event.time_range.end)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals (kernels on several streams)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


OWN = "lit_memory/run/step_profile.py"  # this module's frames: the profiler's own synchronisations
PYTHON_FRAME = re.compile(r"\.py\(\d+\): ")  # with_stack's Python function events: "path/file.py(12): name"


def device_work(on_device: list[Any], host: list[Any]) -> list[Any]:
    """The events on a device's timeline that are device work (`DEVICE_WORK`), not host ranges mirrored there. By the
    profiler's activity type where it names one (torch 2.13), else by what a mirror is: flagged as a user
    annotation, or named as a range the host recorded (a kernel's name is never a host event's)."""
    ranges = {e.name for e in host if getattr(e, "is_user_annotation", False) or "#" in e.name}
    found = []
    for event in on_device:
        kind = getattr(event, "activity_type", None)
        if kind:
            if str(kind).lower() in DEVICE_WORK:
                found.append(event)
        elif not getattr(event, "is_user_annotation", False) and event.name not in ranges:
            found.append(event)
    return found


def source_of(event: Any) -> str:
    """Who asked for an event: the innermost Python frame (``file.py(line): function``) that is not torch's or
    Lightning's machinery, else the innermost frame, else the nearest op, else "?". The frames are the ``stack`` of
    the event or of the nearest op around it (torch 2.11 records them there), or its Python-function parents (torch
    2.13 records them as events that enclose the op)."""
    frames, ops = [], []
    node = event
    while node is not None:
        if not frames and getattr(node, "stack", None):
            frames = [str(f) for f in node.stack]  # innermost first
        parent = getattr(node, "cpu_parent", None)
        if parent is not None:
            if getattr(parent, "is_python_function", False) or PYTHON_FRAME.search(parent.name):
                frames.append(parent.name)
            else:
                ops.append(parent.name)
        node = parent
    for frame in frames:
        if PYTHON_FRAME.search(frame) and not any(part in frame for part in MACHINERY):
            return frame.split("site-packages/")[-1]
    named = [f for f in frames if PYTHON_FRAME.search(f)]
    return (named or ops or ["?"])[0].split("site-packages/")[-1]


def summarise(events: Iterable[Any], cuda: bool, top: int = 12) -> dict[str, Any]:
    """A profiled step's events (``torch.profiler.profile().events()``) as numbers, times in milliseconds."""
    events = list(events)
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e for e in events if e.device_type != torch.autograd.DeviceType.CUDA]
    device = device_work(on_device, host)
    host_spans = [_interval(e) for e in host]
    device_spans = [_interval(e) for e in device]
    spans = host_spans + device_spans
    if not spans:
        return {"events": 0}
    start = min(s for s, _ in spans)
    end = max(e for _, e in spans)
    # The profiler's own synchronisations (`StepProfiler` brackets the step with two) are not the step's.
    syncs = [e for e in host if e.name in SYNCS and OWN not in source_of(e)]
    blocked = union_length(_interval(e) for e in syncs)
    launches = [e for e in host if e.name in LAUNCHES]
    issued_until = max((e for _, e in (_interval(x) for x in launches)), default=end)
    sources: Counter = Counter()
    for e in syncs + [e for e in host if e.name == SCALAR_READ]:
        sources[f"{e.name} <- {source_of(e)}"] += 1
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in device:
        kernels[e.name].append(float(e.time_range.end - e.time_range.start))
    busy = union_length(device_spans)
    ms = 1e-3  # the profiler's times are microseconds
    summary = {
        "wall_ms": (end - start) * ms,
        "device": "cuda" if cuda else "cpu",
        "host_issue_ms": (issued_until - start - blocked) * ms if launches else None,
        "host_blocked_in_syncs_ms": blocked * ms,
        "syncs": len(syncs),
        "scalar_reads": sum(e.name == SCALAR_READ for e in host),
        "sync_sources": dict(sources.most_common(top)),
        "launches": len(launches),
        "top_kernels": [
            {"name": name[:120], "calls": len(times), "total_ms": sum(times) * ms}
            for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
        ],
    }
    if cuda:
        summary.update(
            device_busy_ms=busy * ms,
            device_idle_ms=(end - start - busy) * ms,
            device_busy_share=round(busy / (end - start), 4) if end > start else None,
            kernels=len(device),
        )
    ops = Counter(e.name for e in host if e.name.startswith("aten::"))
    summary["top_host_ops"] = dict(ops.most_common(top))
    return summary


# -- host operators per step -------------------------------------------------------------------------------------


class HostOps(TorchDispatchMode):
    """Count the operators that reach torch's dispatcher below autograd, by name: what the host issues, forward,
    backward (autograd's engine carries the mode to its threads) and optimizer alike, each at least one kernel launch
    on a GPU. Composite operators are counted as what they decompose into (``linear``: ``t`` and ``addmm``), and a
    custom operator (bitsandbytes' 8-bit update) as one, whatever its kernel does inside: the same rule for every
    run, ours and the HF Trainer's. A compiled region is not traced under the mode (torch.compile sees no mode, as
    ``ignore_compile_internals`` asks): its own generated kernels are not dispatcher operators and are not counted,
    the operators it calls through the dispatcher are.

    A dispatch mode slows every operator (a Python call each): count a step that is not timed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.name().split(".")[0]] += 1  # aten::add.Tensor -> aten::add
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def record(self, top: int = 40) -> dict[str, Any]:
        """The count as ``host_ops.json`` and the peer's record keep it."""
        return {"host_ops": self.total, "top_host_ops": dict(self.ops.most_common(top))}


class HostOpCounter(L.Callback):
    """Count the dispatcher operators (`HostOps`) of optimizer step ``step`` (0-based), from the end of the step before
    it to its own end: its micro-batches' loading, forward, backward, optimizer step, logging; writes
    ``host_ops.json`` into the run folder with ``save``. Count a step after the memory monitor's tracked ones (their
    tracker is a dispatch mode too) and outside the timed ones.

    Args:
        step: the optimizer step to count.
        save: write ``host_ops.json`` at the end of training.
    """

    FILE = "host_ops.json"

    def __init__(self, step: int = 3, save: bool = True) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.step, self.save = step, save
        self._mode: Optional[HostOps] = None
        self.counted: Optional[dict[str, Any]] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank asks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self.step:
            self._start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self._mode is not None and trainer.global_step > self.step:
            self._stop(trainer)
        elif self._mode is None and self.counted is None and trainer.global_step == self.step:
            self._start()

    def _start(self) -> None:
        self._mode = HostOps().__enter__()

    def _stop(self, trainer: L.Trainer) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.counted = {"step": self.step, "micro_batches": trainer.accumulate_grad_batches, **mode.record()}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._mode is not None:  # training ended inside the counted step: not a whole step
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self.save and self.counted is not None and trainer.is_global_zero:
            files.write_text(self.run_dir / self.FILE, json.dumps(self.counted, indent=2) + "\n")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
