"""One optimizer step under torch.profiler, summarised: where a step's time goes.

`StepProfiler` profiles the optimizer step after ``warmup`` steps (its micro-batches together) and writes
``profile.json`` into the run folder (`summarise`): the step's wall time, the device busy and idle within it,
the host's time issuing the step, the synchronisations and the code that asked for them, the top kernels, and
per-parameter launches. ``trace=True`` also keeps the Chrome trace (``profile.trace.json.gz``, for
chrome://tracing or Perfetto). ``python -m lit_memory bench --gpu-proof`` profiles bf16 and 4gb this way.
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


PYTHON_FRAME = re.compile(r"\.py\(\d+\): ")  # with_stack's Python function events: "path/file.py(12): name"


def source_of(event: Any) -> str:
    """Who asked for an event: the innermost Python frame above it (with_stack records frames as parent
    events) that is not torch's or Lightning's machinery, else the innermost frame, else the nearest op."""
    frames, ops = [], []
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        (frames if PYTHON_FRAME.search(parent.name) else ops).append(parent.name)
        parent = getattr(parent, "cpu_parent", None)
    for frame in frames:
        if not any(part in frame for part in MACHINERY):
            return frame.split("site-packages/")[-1]
    return (frames or ops or ["?"])[0].split("site-packages/")[-1]


def summarise(events: Iterable[Any], cuda: bool, top: int = 12) -> dict[str, Any]:
    """A profiled step's events (``torch.profiler.profile().events()``) as numbers, times in milliseconds."""
    events = list(events)
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    # Ranges the host annotated (``Optimizer.step#AdamW.step``) are mirrored on the device's timeline: not kernels.
    device = [e for e in on_device if not getattr(e, "is_user_annotation", False)]
    host = [e for e in events if e.device_type != torch.autograd.DeviceType.CUDA]
    host_spans = [_interval(e) for e in host]
    device_spans = [_interval(e) for e in device]
    spans = host_spans + device_spans
    if not spans:
        return {"events": 0}
    start = min(s for s, _ in spans)
    end = max(e for _, e in spans)
    syncs = [e for e in host if e.name in SYNCS]
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
