"""Measure every run: memory (`MemoryMonitor`) and step times (`StepTimer`).

`MemoryMonitor` measures and records, nothing else: the first optimizer steps tensor by tensor
(`lit_memory.memory.measure.tracker.Tracker`, per category and phase), on CUDA the three levels (the allocator's
allocated and reserved peaks, and the device total ``nvidia-smi`` shows for the process), the process's
peak, on every rank; it writes ``memory.json``, with the predictions it is given. Beside it, each with one job
and composed by the command line (`lit_memory.run.memory_callbacks`): the budget's cap on CUDA, the predictions, the
end-of-fit table and the out-of-memory report with its advice.

`StepTimer` is the one step timer: wall time of each optimizer step (bench, plan ``--measure``).
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only

from lit_memory import files
from lit_memory.console import logging_step
from lit_memory.errors import UserError
from lit_memory.hf.anatomy import find_layers
from lit_memory.memory.hardware.gpus import process_memory_used
from lit_memory.memory.measure import records
from lit_memory.memory.measure.footprint import Footprint
from lit_memory.memory.measure.tracker import ProcessPeak, Tracker, batch_tensors, live_breakdown
from lit_memory.memory.settings import MemorySettings
from lit_memory.optim.optimizers import compiles_its_step

log = logging.getLogger(__name__)


class MemoryMonitor(L.Callback):
    """Measure memory in every run and write ``memory.json`` (what it measures: docs/memory.md).

    Args:
        track_steps: as ``memory.track_steps``: optimizer steps tracked tensor by tensor (0: off).
        memory: the run's memory settings; on a CPU the tracker holds the tracked tensors to its budget.
    """

    def __init__(self, track_steps: int = 2, memory: MemorySettings = MemorySettings()) -> None:
        if track_steps < 0:
            raise UserError(f"memory.track_steps must be >= 0, got {track_steps}")
        self.track_steps = track_steps
        self.memory = memory
        self.cap = memory.cap  # memory.budget: on a CPU the tracker holds the tracked tensors to it
        self.tracker: Optional[Tracker] = None
        self.measured = Footprint()
        self.predictions: dict[str, Footprint] = {}  # given: for the configured shape, the worst case
        self.shape_predictions: dict[str, dict[str, Footprint]] = {}  # given: for the shapes below
        # The longest micro-batch (rows, tokens) the tracked steps saw, and all steps: what predictions at the
        # shapes the run saw are for (dynamic padding makes batches shorter than the configured worst case).
        self.longest_tracked: Optional[tuple[int, int]] = None
        self.longest: Optional[tuple[int, int]] = None
        self.peak_batch: Optional[tuple[int, int]] = None  # the tracked batch whose step reached the tracked peak
        self._peak_batch_bytes = -1
        self._shape: Optional[tuple[int, int]] = None
        self.process: Optional[ProcessPeak] = None
        self.cuda: Optional[dict[str, Any]] = None
        self.batches = 0
        self.tracked_batches = 0
        self.ranks: Optional[list[dict[str, Any]]] = None  # every rank's measurements, after a distributed fit
        self.oom: Optional[dict[str, Any]] = None  # the out-of-memory error's breakdown, when the run raised one
        self.timeline: Optional[list[dict]] = None  # the last tracked micro-batch, point by point
        self.timeline_shape: Optional[tuple[int, int]] = None  # its (rows, tokens)
        self.timeline_what = "the last micro-batch tracked"
        # (shape, points): the analytic step point by point at that shape, handed in
        # (`memory_callbacks.MemoryPredictions`)
        self.predicted_timeline: Optional[tuple[Optional[tuple[int, int]], Optional[list[dict]]]] = None
        self._phase: Optional[str] = None
        self._batch_idx = 0
        self._stepped = 0  # the optimizer steps taken when the last batch ended
        self._counts: Optional[dict[str, int]] = None  # the allocator's counts at the last reading (CUDA)

    # -- where ---------------------------------------------------------------------------------

    @staticmethod
    def _device(trainer: L.Trainer) -> torch.device:
        return trainer.strategy.root_device

    def _on_cuda(self, trainer: L.Trainer) -> bool:
        return self._device(trainer).type == "cuda"

    def limit(self, trainer: L.Trainer) -> Optional[int]:
        """The memory this run may use: the budget, else the CUDA device's total."""
        if self.cap is not None:
            return self.cap.bytes
        if self._on_cuda(trainer):
            return torch.cuda.get_device_properties(self._device(trainer)).total_memory
        return None

    # -- set-up ----------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Asked on every rank: under a distributed strategy `log_dir` is a collective (a broadcast),
        # and asking it on rank 0 alone, when writing, would pair with another rank's next collective.
        self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.tracker is not None:
            self._stop_tracker()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.process = ProcessPeak()
        if self._on_cuda(trainer):
            # The allocator's peaks are never reset here (a user's own readings stay theirs): the
            # run's peak is the highest reading, and its phase the one in which it last rose.
            self.cuda = {
                "max_allocated_bytes": 0, "max_reserved_bytes": 0, "max_device_bytes": 0, "device_source": None,
                "peak_phase": None,
                "device_bytes_by_step": [],  # the highest device reading in each optimizer step; null: never read
                # the allocator's counts in each optimizer step: cudaMalloc retries (a full flush of its cache and
                # another try, near a cap), cudaMalloc/cuMemMap and cudaFree/cuMemUnmap calls
                **{key: [] for key in ALLOCATOR_COUNTS.values()},
            }
            self._counts = allocator_counts(torch.cuda.memory_stats(self._device(trainer)))
        self._stepped = trainer.global_step
        self.longest_tracked = self.longest = self.peak_batch = None
        self._peak_batch_bytes = -1
        self.ranks = self.oom = None

    # -- measurement ---------------------------------------------------------------------------

    def _tracking(self, trainer: L.Trainer, batch_idx: int) -> bool:
        if self.cap is not None and not self._on_cuda(trainer):
            return True  # the CPU budget is enforced by the tracker
        # Within an accumulation window the micro-batches after the second repeat the second's memory:
        # track the first (gradients zeroed), the second (accumulating) and the one that steps.
        accumulate = trainer.accumulate_grad_batches
        return trainer.global_step < self.track_steps and batch_idx % accumulate in {0, 1, accumulate - 1}

    def _enter_phase(self, trainer: L.Trainer, phase: str) -> None:
        if trainer.global_step < self.PHASE_READ_STEPS:
            self._read_cuda(trainer)
        self._phase = phase
        if self.tracker is not None:
            self.tracker.enter_phase(phase)

    # In the first steps the allocator and the device are read at every phase boundary (which phase peaks; kernels
    # load on first use and the context grows); after them once at each optimizer step's end, off the step's hot
    # path: one statistics call and one device query (NVML: about half a millisecond of host time) per step.
    PHASE_READ_STEPS = 3

    def _read_cuda(self, trainer: L.Trainer, step: Optional[int] = None) -> None:
        """Read the allocator's peaks and the device level into optimizer step ``step`` (default: the one running)."""
        if self.cuda is None or (self._phase is None and step is None):
            return
        device = self._device(trainer)
        stats = torch.cuda.memory_stats(device)  # one call for both peaks (each reader calls it whole)
        allocated = stats.get("allocated_bytes.all.peak", 0)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        if allocated > self.cuda["max_allocated_bytes"]:
            # its phase where phases are read; a peak found at a later step's end keeps the phase last seen
            self.cuda.update(max_allocated_bytes=allocated, peak_phase=self._phase or self.cuda["peak_phase"])
        self.cuda["max_reserved_bytes"] = max(self.cuda["max_reserved_bytes"], reserved)
        step = trainer.global_step if step is None else step
        self._read_device(device, step)
        if self._counts is not None:
            counts = allocator_counts(stats)
            for key, name in ALLOCATOR_COUNTS.items():
                _at(self.cuda.setdefault(name, []), step, counts[key] - self._counts[key], add=True)
            self._counts = counts

    def _read_device(self, device: torch.device, step: Optional[int]) -> None:
        # The device level has no peak counter: read at phase boundaries and step ends. The allocator keeps what it
        # reserved, so the process's footprint only grows, and the readings catch its peak.
        used, source = device_memory_used(device)
        if used is not None and used > self.cuda["max_device_bytes"]:
            self.cuda.update(max_device_bytes=used, device_source=source)
        if step is not None:  # a step with no reading stays null
            _at(self.cuda.setdefault("device_bytes_by_step", []), step, used)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_idx = batch_idx
        shape = self._shape = batch_tokens(batch)
        self.longest = longer(self.longest, shape)
        if self._tracking(trainer, batch_idx):
            self.longest_tracked = longer(self.longest_tracked, shape)
            tracker = Tracker(
                self._device(trainer), self.cap.bytes if self.cap and not self._on_cuda(trainer) else None,
                compiled_steps=compiles_its_step,
            )
            tracker.track_external(pl_module, *trainer.optimizers, *batch_tensors(batch))
            tracker.watch_layers(_layers(pl_module))  # the step point by point, for its picture (memory.png)
            self.tracker = tracker.__enter__()
        self._enter_phase(trainer, "forward")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._enter_phase(trainer, "backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._enter_phase(trainer, "step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stepped = trainer.global_step != self._stepped  # an optimizer step ended (not mid accumulation window)
        if stepped:
            self._read_cuda(trainer, step=trainer.global_step - 1)  # every step's end, read into the step that ended
            self._stepped = trainer.global_step
        self._phase = None
        self.batches += 1
        if self.tracker is not None:
            self._stop_tracker()
            self.tracked_batches += 1
        peak = self.measured_peak()
        if peak and stepped and logging_step(trainer):
            # A host tensor on the steps the loggers write: the progress bar reads it each batch without the device.
            pl_module.log("mem_peak_gib", torch.tensor(peak / 2**30), prog_bar=True, logger=False)

    def _stop_tracker(self) -> None:
        tracker, self.tracker = self.tracker, None
        tracker.__exit__(None, None, None)
        self.measured.merge(tracker.footprint)
        if tracker.timeline:
            self.timeline, self.timeline_shape = tracker.timeline, self._shape  # the last tracked: the steady state
        if tracker.footprint.peak > self._peak_batch_bytes:
            self.peak_batch, self._peak_batch_bytes = self._shape, tracker.footprint.peak

    def measured_peak(self) -> Optional[int]:
        """The peak so far: the CUDA allocator's when on CUDA, else the tracked tensors'."""
        if self.cuda:
            return self.cuda["max_allocated_bytes"] or None
        return self.measured.peak or None

    def measurements(self) -> dict[str, Any]:
        """This rank's measurements, as ``memory.json`` keeps them."""
        return {
            "tracked": self.measured.to_dict() if self.measured.phases else None,
            "process": self.process.to_dict() if self.process else None,
            "cuda": dict(self.cuda) if self.cuda else None,
            "longest_batch": {
                "tracked": list(self.longest_tracked) if self.longest_tracked else None,
                "all": list(self.longest) if self.longest else None,
                "tracked_peak": list(self.peak_batch) if self.peak_batch else None,
            },
        }

    # -- reporting -----------------------------------------------------------------------------

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.cuda is not None:  # after the last step (a validation after it): the run's peak, before teardown
            self._read_device(self._device(trainer), None)
            cap = allocator_cap(self._device(trainer))  # before `BudgetCap.teardown` gives the process its own back
            if cap is not None:
                self.cuda["allocator_cap_bytes"] = cap

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ranks = None
        if trainer.world_size > 1:  # every rank's numbers: each holds its own shard and activations
            gathered = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, self.measurements())
            ranks = [{"rank": rank, **m} for rank, m in enumerate(gathered)]
        self.ranks = ranks
        self._write(trainer, ranks=ranks)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._read_cuda(trainer)  # into the step that failed (nothing outside a batch)
        oom = None
        if isinstance(exception, torch.OutOfMemoryError):
            try:  # the report must never replace the error it reports
                oom = self._oom(trainer, pl_module, getattr(exception, "categories", None))
            except Exception as failed:  # noqa: BLE001
                print(f"out-of-memory report failed: {type(failed).__name__}: {failed}", file=sys.stderr)
        if self.tracker is not None:
            self._stop_tracker()
            if oom is not None:  # the measured points are the failing micro-batch's, to the failure
                self.timeline_what = "the micro-batch that ran out of memory, to the failure"
        self.oom = oom
        if oom is not None or self.batches:  # not for bad input caught before training
            self._write(trainer, oom=oom)

    def _oom(self, trainer: L.Trainer, pl_module: L.LightningModule, categories: Optional[dict]) -> dict[str, Any]:
        if categories is None and self.tracker is not None:
            categories = self.tracker.categories()
        if categories is None:  # untracked step: the tensors themselves, the rest of the allocator's count
            allocated = torch.cuda.memory_allocated(self._device(trainer)) if self._on_cuda(trainer) else 0
            categories = live_breakdown(pl_module, trainer.optimizers, allocated, self._device(trainer))
        return {
            "phase": self._phase,
            "batch": self._batch_idx,
            "live_bytes": sum(categories.values()),
            "limit_bytes": self.limit(trainer),
            "categories": categories,
        }

    def record(self, trainer: L.Trainer, ranks: Optional[list] = None, oom: Optional[dict] = None) -> dict[str, Any]:
        """The content of memory.json (schema: docs/memory.md)."""
        device = self._device(trainer)
        on_cuda = device.type == "cuda"
        shape = batch_shape(trainer)
        return records.memory_record(
            device={
                "type": device.type,
                "name": torch.cuda.get_device_name(device) if on_cuda else "cpu",
                "total_bytes": torch.cuda.get_device_properties(device).total_memory if on_cuda else None,
                "limit_bytes": self.limit(trainer),
            },
            world_size=trainer.world_size,
            batch_shape=shape,
            padding=padding(trainer),
            longest_batch=self.measurements()["longest_batch"],
            predicted_at_longest={
                key: {m: found.get(m) for m in records.METHODS} for key, found in self.shape_predictions.items()
            },
            batches=self.batches,
            tracked_batches=self.tracked_batches,
            optimizer_steps=trainer.global_step,
            predicted={m: self.predictions.get(m) for m in records.METHODS},
            measured=self.measurements(),
            ranks=ranks,
            oom=oom,
            timeline=self.timeline_record(),
        )

    def timeline_record(self) -> Optional[dict[str, Any]]:
        """The step point by point, as memory.json keeps it for its picture: the analytic model's (at the shape the
        tracker measured, else the worst case's) and the last tracked micro-batch's, each with its batch shape."""
        shape, predicted = self.predicted_timeline or (None, None)
        if not self.timeline and not predicted:
            return None
        measured = self.timeline or None
        return {
            "predicted": {"batch_shape": list(shape) if shape else None, "points": predicted} if predicted else None,
            "measured": {
                "batch_shape": list(self.timeline_shape) if self.timeline_shape else None,
                "what": self.timeline_what,
                "points": measured,
            } if measured else None,
        }

    @rank_zero_only
    def _write(self, trainer: L.Trainer, ranks: Optional[list] = None, oom: Optional[dict] = None) -> None:
        run_dir = getattr(self, "run_dir", None)  # None: failed before setup
        if run_dir is not None and run_dir.is_dir():  # created by Lightning with the run's config.yaml; never made here
            records.write_memory(run_dir, self.record(trainer, ranks, oom))


class StepTimer(L.Callback):
    """Time of each optimizer step (its micro-batches together), the first ``warmup`` steps apart.

    On CUDA the step boundaries are CUDA events recorded on the current stream, read once at the end of
    training: no device synchronisation per step, and the time is the GPU's timeline, idle gaps (a GPU
    waiting on the host) included. On a CPU they are ``time.perf_counter`` readings.

    Args:
        warmup: optimizer steps timed but kept apart (first steps compile, allocate, fill caches).
        steps: the timed steps after warm-up (None: all; later steps, a profiled one say, are left out).
        save: write ``step_times.json`` into the run folder at the end of training (bench reads it).
    """

    FILE = "step_times.json"

    def __init__(self, warmup: int = 3, steps: Optional[int] = None, save: bool = False) -> None:
        self.warmup = warmup
        self.steps = steps
        self.save = save
        self.stamps = Stamps(torch.device("cpu"))
        self._step = -1
        self._compiling = 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank asks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step
        self.stamps = Stamps(pl_module.device)
        self._compiling = compile_seconds()
        self.stamps.mark()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._step:  # an optimizer step happened (not mid accumulation window)
            self._step = trainer.global_step
            self.stamps.mark()

    @property
    def step_times(self) -> list[float]:
        """Seconds of each optimizer step, warm-up included (``warmup_times``, ``timed_times``)."""
        return self.stamps.intervals()

    @property
    def warmup_times(self) -> list[float]:
        return self.step_times[: self.warmup]

    @property
    def timed_times(self) -> list[float]:
        return self.step_times[self.warmup :][: self.steps]

    @property
    def seconds_per_step(self) -> float:
        """Median of the timed steps (robust to one step slowed by something else on the machine)."""
        return statistics.median(self.timed_times) if self.timed_times else float("inf")

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.save:
            return
        batch_size = (batch_shape(trainer) or [None])[0]
        record = {
            "warmup": self.warmup,
            "clock": self.stamps.kind,
            "warmup_step_times_s": self.warmup_times,
            "step_times_s": self.timed_times,
            "samples_per_step": batch_size and batch_size * trainer.accumulate_grad_batches * trainer.world_size,
            # torch.compile's own time during training (in the warm-up steps' times, apart from the timed ones)
            "compile_s": round(compile_seconds() - self._compiling, 3),
        }
        files.write_text(self.run_dir / self.FILE, json.dumps(record, indent=2) + "\n")


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (tracing and compiling forwards and backwards:
    dynamo's own count); 0 where nothing imported torch's compiler."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    return float(utils.calculate_time_spent().get("total_wall_time", 0.0))


class Stamps:
    """Points in time on one device: CUDA events on a GPU (read after one synchronisation, when asked),
    ``time.perf_counter`` on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.kind = "cuda events" if self.cuda else "perf_counter"
        self._marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        if not self.cuda:
            return [b - a for a, b in zip(self._marks, self._marks[1:])]
        if self._marks:
            self._marks[-1].synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in zip(self._marks, self._marks[1:])]


# torch.cuda.memory_stats' counters a step records (its key -> the record's per-step list).
ALLOCATOR_COUNTS = {
    "num_alloc_retries": "alloc_retries_by_step", "num_device_alloc": "device_allocs_by_step",
    "num_device_free": "device_frees_by_step",
}


def allocator_cap(device: torch.device) -> Optional[int]:
    """The caching allocator's cap now (``set_per_process_memory_fraction``: `lit_memory.run.memory_callbacks.BudgetCap`
    sets it from memory.budget), bytes; None where none is set. Its cap less ``max_reserved_bytes`` is the room the
    allocator never used: a request is refused, the cache released and the request retried, only where the reserve
    plus the request's segment passes it (`lit_memory.memory.hardware.allocator`)."""
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction >= 1:
        return None
    return int(fraction * torch.cuda.get_device_properties(device).total_memory)


def allocator_counts(stats: Mapping[str, Any]) -> dict[str, int]:
    """The allocator's cumulative counts `ALLOCATOR_COUNTS` names, from ``torch.cuda.memory_stats`` (0 where absent)."""
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTS}


def _at(by_step: list, step: int, value: Optional[int], add: bool = False) -> None:
    """``by_step[step]`` raised to ``value`` (or increased by it; None: no reading), steps never read left null."""
    by_step.extend([None] * (step + 1 - len(by_step)))
    old = by_step[step]
    if value is not None:
        by_step[step] = value if old is None else (old + value if add else max(old, value))


def device_memory_used(device: torch.device) -> tuple[Optional[int], Optional[str]]:
    """This process's memory on ``device`` as ``nvidia-smi`` shows it: NVML's per-process figure where
    ``pynvml`` (nvidia-ml-py) is installed and this process is found among NVML's (`lit_memory.memory.measure.nvml`),
    else cudaMemGetInfo's used memory (``torch.cuda.mem_get_info``: the whole device's, other processes included).
    (None, None) when neither answers."""
    used, source = process_memory_used(device)
    if used is not None:
        return used, source
    try:  # no pynvml, no NVML driver library, no permission, or this process not found: the device-wide reading
        free, total = torch.cuda.mem_get_info(device)
    except Exception:
        return None, None
    return int(total - free), "cudaMemGetInfo (whole device)"


def _layers(module: L.LightningModule) -> list:
    """The transformer layers of the module's model (`lit_memory.hf.anatomy.find_layers`), or none."""
    try:
        return list(find_layers(getattr(module, "model", module)))
    except Exception:  # noqa: BLE001  a model whose layers cannot be found: phases only
        return []


def batch_tokens(batch: Any) -> Optional[tuple[int, int]]:
    """(rows, tokens) of a batch of token ids: its ``input_ids``, else its first 2-D tensor."""
    tensors = batch if isinstance(batch, Mapping) else {}
    found = tensors.get("input_ids")
    if not isinstance(found, torch.Tensor) or found.ndim != 2:
        found = next((t for t in tensors.values() if isinstance(t, torch.Tensor) and t.ndim == 2), None)
    return (int(found.shape[0]), int(found.shape[1])) if found is not None else None


def longer(a: Optional[tuple[int, int]], b: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
    """The batch with more tokens (then the longer one): what needs more activation memory."""
    if a is None or b is None:
        return a or b
    return max(a, b, key=lambda shape: (shape[0] * shape[1], shape[1]))


def padding(trainer: L.Trainer) -> Optional[str]:
    return getattr(trainer.datamodule, "hparams", {}).get("padding")


def batch_shape(trainer: L.Trainer) -> Optional[list[int]]:
    """[micro-batch size, sequence length] of a data module that has them in its hyper-parameters."""
    hparams = getattr(trainer.datamodule, "hparams", {})
    if "batch_size" in hparams and "max_length" in hparams:
        return [hparams["batch_size"], hparams["max_length"]]
    return None
