"""Measure every run: memory (the `memory:` block of every fit) and step times.

`MemoryMonitor` measures and records, nothing else: the first optimizer steps tensor by tensor
(`lit_memory.memory.tracker.Tracker`, per category and phase), on CUDA the three levels (the allocator's
allocated and reserved peaks, and the device total ``nvidia-smi`` shows for the process), the process's
peak, on every rank; it writes ``memory.json`` and prints measured (and, if given, predicted) per category
and level at the end. Predictions and out-of-memory advice reach a run through the monitor's ``predict``
and ``advise`` hooks (`lit_memory.cli` hands it those of `lit_memory.memory.predict`), so the runtime
never imports the memory model.

`StepTimer` is the one step timer: wall time of each optimizer step (bench, plan ``--measure``).
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only

from lit_memory import files
from lit_memory.errors import UserError
from lit_memory.memory import records
from lit_memory.memory.allocator import check_recipe_conf
from lit_memory.memory.device import CardReading, allocator_limit, capacity, process_memory_used, read_card
from lit_memory.memory.footprint import Footprint, breakdown_line, format_bytes
from lit_memory.memory.margin import DEFAULT_MARGIN, check_margin
from lit_memory.memory.report import Levels, table
from lit_memory.memory.tracker import ProcessPeak, Tracker, batch_tensors, live_breakdown
from lit_memory.optimizers import compiles_its_step

log = logging.getLogger(__name__)

# (trainer, module, simulate, shape) -> predicted footprints per method ("analytic", "simulated"), for batches of
# ``shape`` (rows, tokens); None: the configured batch_size x max_length, the worst case.
Predict = Callable[[L.Trainer, L.LightningModule, bool, Optional[tuple[int, int]]], dict[str, Footprint]]
# (trainer, limit in bytes) -> one line: what to run instead
Advise = Callable[[L.Trainer, int], str]


class MemoryMonitor(L.Callback):
    """Measure memory in every run; write ``memory.json``; explain an out-of-memory error.

    Args:
        track_steps: optimizer steps tracked tensor by tensor with torch's MemTracker (per category
            and per phase). Its Python dispatch slows the tracked micro-batches, so only the first
            steps are tracked (the first creates the optimizer state, the second is the steady state),
            and of an accumulation window only the micro-batches that differ: the first, the second
            and the last. 0 turns tensor tracking off; on CUDA the allocator's peaks
            (``torch.cuda.max_memory_allocated``/``max_memory_reserved``) are read every step regardless.
        budget: a memory limit such as ``4GiB``, or a card (``rtx3050-4gb``: its capacity). On CUDA it caps
            this process's device total for the run: the caching allocator
            (``torch.cuda.set_per_process_memory_fraction``) gets the budget less the CUDA context measured at
            the start (`lit_memory.memory.device.allocator_limit`); on CPU the tracker raises CUDA's
            out-of-memory error when the tracked tensors exceed it (every step is then tracked).
        tier: the device memory the run's recipe is made for, a card (``rtx3050-4gb`` for recipes/4gb.yaml)
            or a size: what ``model.gradient_checkpointing: auto`` plans for when no ``budget`` is given (and
            the run's card has that much free). Nothing is enforced.
        margin: the share of a limit every "fits" decision keeps free for the memory model's own error
            (`lit_memory.memory.margin`; default 0.08, from the published measurements' worst under-prediction).
        allocator: the CUDA caching allocator settings the recipe is made for (``expandable_segments:True``),
            in ``PYTORCH_CUDA_ALLOC_CONF``'s form: the command line sets them before CUDA starts unless that
            variable is set already (it wins), and predictions use them. Recorded here, applied by the CLI.
        simulate: also predict by simulation at the start of fit (one training step on fake tensors:
            seconds on the bundled model, about half a minute on BERT-large), when predictions are given.
    """

    def __init__(
        self,
        track_steps: int = 2,
        budget: Optional[str] = None,
        simulate: bool = False,
        tier: Optional[str] = None,
        allocator: Optional[str] = None,
        margin: float = DEFAULT_MARGIN,
    ) -> None:
        if track_steps < 0:
            raise UserError(f"memory.track_steps must be >= 0, got {track_steps}")
        self.track_steps = track_steps
        self.budget = capacity(budget) if budget is not None else None
        self.tier = capacity(tier) if tier is not None else None
        self.margin = check_margin(margin)
        self.allocator = check_recipe_conf(allocator) if allocator is not None else None
        self.simulate = simulate
        self.predict: Optional[Predict] = None
        self.advise: Optional[Advise] = None
        self.tracker: Optional[Tracker] = None
        self.measured = Footprint()
        self.predictions: dict[str, Footprint] = {}  # for the configured shape: the worst case
        # The longest micro-batch (rows, tokens) the tracked steps saw, and all steps; predictions for the former
        # (and, on CUDA, the latter), to compare with what was measured at that shape (dynamic padding).
        self.longest_tracked: Optional[tuple[int, int]] = None
        self.longest: Optional[tuple[int, int]] = None
        self.peak_batch: Optional[tuple[int, int]] = None  # the tracked batch whose step reached the tracked peak
        self._peak_batch_bytes = -1
        self._shape: Optional[tuple[int, int]] = None
        self.shape_predictions: dict[str, dict[str, Footprint]] = {}
        self.process: Optional[ProcessPeak] = None
        self.cuda: Optional[dict[str, Any]] = None
        self.batches = 0
        self.tracked_batches = 0
        self._phase: Optional[str] = None
        self._batch_idx = 0
        self._fraction: Optional[float] = None

    # -- where ---------------------------------------------------------------------------------

    @staticmethod
    def _device(trainer: L.Trainer) -> torch.device:
        return trainer.strategy.root_device

    def _on_cuda(self, trainer: L.Trainer) -> bool:
        return self._device(trainer).type == "cuda"

    def limit(self, trainer: L.Trainer) -> Optional[int]:
        """The memory this run may use: the budget, else the CUDA device's total."""
        if self.budget is not None:
            return self.budget
        if self._on_cuda(trainer):
            return torch.cuda.get_device_properties(self._device(trainer)).total_memory
        return None

    # -- set-up and predictions ----------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Asked on every rank: under a distributed strategy `log_dir` is a collective (a broadcast),
        # and asking it on rank 0 alone, when writing, would pair with another rank's next collective.
        self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)
        if stage == "fit" and self.budget is not None and self._on_cuda(trainer):
            device = self._device(trainer)
            card = self.read_card(device)
            limit, line = allocator_limit(self.budget, card)
            self._fraction = torch.cuda.get_per_process_memory_fraction(device)
            torch.cuda.set_per_process_memory_fraction(min(limit / card.total, 1.0), device)
            print(line, file=sys.stderr)  # every rank caps its own process

    @staticmethod
    def read_card(device: torch.device) -> CardReading:
        """The run's card at the start (`lit_memory.memory.device.read_card`): the seam a test replaces."""
        return read_card(device.index)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._fraction is not None:  # the cap belongs to this run, not to the process
            torch.cuda.set_per_process_memory_fraction(self._fraction, self._device(trainer))
            self._fraction = None
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
            }
        self.longest_tracked = self.longest = self.peak_batch = None
        self._peak_batch_bytes = -1
        self.shape_predictions = {}
        if self.predict is not None:
            self.predictions = self.predict(trainer, pl_module, self.simulate, None)

    # -- measurement ---------------------------------------------------------------------------

    def _tracking(self, trainer: L.Trainer, batch_idx: int) -> bool:
        if self.budget is not None and not self._on_cuda(trainer):
            return True  # the CPU budget is enforced by the tracker
        # Within an accumulation window the micro-batches after the second repeat the second's memory:
        # track the first (gradients zeroed), the second (accumulating) and the one that steps.
        accumulate = trainer.accumulate_grad_batches
        return trainer.global_step < self.track_steps and batch_idx % accumulate in {0, 1, accumulate - 1}

    def _enter_phase(self, trainer: L.Trainer, phase: str) -> None:
        self._read_cuda(trainer)
        self._phase = phase
        if self.tracker is not None:
            self.tracker.enter_phase(phase)

    def _read_cuda(self, trainer: L.Trainer) -> None:
        if self.cuda is None or self._phase is None:
            return
        device = self._device(trainer)
        allocated = torch.cuda.max_memory_allocated(device)
        if allocated > self.cuda["max_allocated_bytes"]:
            self.cuda.update(max_allocated_bytes=allocated, peak_phase=self._phase)
        self.cuda["max_reserved_bytes"] = max(self.cuda["max_reserved_bytes"], torch.cuda.max_memory_reserved(device))
        # The device level has no peak counter: read at every phase boundary. The allocator keeps what it
        # reserved, so the process's footprint only grows, and the readings catch its peak.
        used, source = device_memory_used(device)
        if used is not None and used > self.cuda["max_device_bytes"]:
            self.cuda.update(max_device_bytes=used, device_source=source)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_idx = batch_idx
        shape = self._shape = batch_tokens(batch)
        self.longest = longer(self.longest, shape)
        if self._tracking(trainer, batch_idx):
            self.longest_tracked = longer(self.longest_tracked, shape)
            tracker = Tracker(
                self._device(trainer), None if self._on_cuda(trainer) else self.budget, compiled_steps=compiles_its_step
            )
            tracker.track_external(pl_module, *trainer.optimizers, *batch_tensors(batch))
            self.tracker = tracker.__enter__()
        self._enter_phase(trainer, "forward")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._enter_phase(trainer, "backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._enter_phase(trainer, "step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._read_cuda(trainer)
        self._phase = None
        self.batches += 1
        if self.tracker is not None:
            self._stop_tracker()
            self.tracked_batches += 1
        peak = self.measured_peak()
        if peak:
            pl_module.log("mem_peak_gib", peak / 2**30, prog_bar=True, logger=False)

    def _stop_tracker(self) -> None:
        tracker, self.tracker = self.tracker, None
        tracker.__exit__(None, None, None)
        self.measured.merge(tracker.footprint)
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

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ranks = None
        if trainer.world_size > 1:  # every rank's numbers: each holds its own shard and activations
            gathered = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, self.measurements())
            ranks = [{"rank": rank, **m} for rank, m in enumerate(gathered)]
        if trainer.is_global_zero:
            self._predict_seen_shapes(trainer, pl_module)
        self._write(trainer, ranks=ranks)
        self._print_table(trainer, ranks)

    def _predict_seen_shapes(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Predictions for the longest batch the tracked steps saw (and, on CUDA, all steps: the allocator's peaks
        cover them), where it is not the configured shape (dynamic padding makes batches shorter)."""
        configured = batch_shape(trainer)
        seen = {
            "tracked": self.longest_tracked,
            "all": self.longest if self.cuda else None,
            # a shorter batch can reach the tracked peak (the first step has no optimizer state yet)
            "tracked_peak": self.peak_batch if self.peak_batch != self.longest_tracked else None,
        }
        for key, shape in seen.items():
            if shape is None or self.predict is None:
                continue
            if configured is not None and list(shape) == configured:
                self.shape_predictions[key] = dict(self.predictions)
            elif key != "tracked" and shape == self.longest_tracked:
                self.shape_predictions[key] = self.shape_predictions.get("tracked", {})
            else:  # the simulation, where asked, for the tracked shape only: that is what it is compared with
                self.shape_predictions[key] = self.predict(trainer, pl_module, self.simulate and key == "tracked", shape)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._read_cuda(trainer)
        oom = None
        if isinstance(exception, torch.OutOfMemoryError):
            oom = self._oom(trainer, pl_module, getattr(exception, "categories", None))
        if self.tracker is not None:
            self._stop_tracker()
        if oom is not None or self.batches:  # not for bad input caught before training
            self._write(trainer, oom=oom)
        if oom is not None:
            self._print_oom(trainer, oom)

    def _oom(self, trainer: L.Trainer, pl_module: L.LightningModule, categories: Optional[dict]) -> dict[str, Any]:
        if categories is None and self.tracker is not None:
            categories = self.tracker.categories()
        if categories is None:  # untracked step: the tensors themselves, the rest of the allocator's count
            allocated = torch.cuda.memory_allocated(self._device(trainer)) if self._on_cuda(trainer) else 0
            categories = live_breakdown(pl_module, trainer.optimizers, allocated)
        return {
            "phase": self._phase,
            "batch": self._batch_idx,
            "live_bytes": sum(categories.values()),
            "limit_bytes": self.limit(trainer),
            "categories": categories,
        }

    @rank_zero_only
    def _print_oom(self, trainer: L.Trainer, oom: dict[str, Any]) -> None:
        limit = oom["limit_bytes"]
        print(
            f"out of memory in the {oom['phase']} phase of batch {oom['batch']}: "
            f"{format_bytes(oom['live_bytes'])} live = {breakdown_line(oom['categories'])} "
            f"(limit {format_bytes(limit)})",
            file=sys.stderr,
        )
        if self.advise is not None and limit is not None:
            print(self.advise(trainer, limit), file=sys.stderr)
        else:
            print("run `python -m lit_memory plan --budget <your GPU memory> <your configs>` for a recipe that fits",
                  file=sys.stderr)

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
        )

    @rank_zero_only
    def _write(self, trainer: L.Trainer, ranks: Optional[list] = None, oom: Optional[dict] = None) -> None:
        run_dir = getattr(self, "run_dir", None)  # None: failed before setup
        if run_dir is not None and run_dir.is_dir():  # created by Lightning with the run's config.yaml; never made here
            records.write_memory(run_dir, self.record(trainer, ranks, oom))

    @rank_zero_only
    def _print_table(self, trainer: L.Trainer, ranks: Optional[list]) -> None:
        configured = batch_shape(trainer)
        tracked_shape = self.longest_tracked
        # Predictions beside the measurements are for the shape measured: the longest tracked batch.
        at_tracked = self.shape_predictions.get("tracked", self.predictions) if tracked_shape else self.predictions
        columns: dict[str, Any] = dict(at_tracked)
        if self.measured.phases:
            columns["tracked tensors"] = self.measured
        if self.cuda:
            columns["cuda (measured)"] = Levels(
                self.cuda["max_allocated_bytes"], self.cuda["max_reserved_bytes"], self.cuda["max_device_bytes"] or None,
                self.cuda["peak_phase"],
            )
        if not columns:
            return
        shown = tracked_shape or (tuple(configured) if configured else None)
        what = " (the longest tracked batch)" if tracked_shape and configured and list(tracked_shape) != configured else ""
        shape = f", batch {_shape_text(shown)} tokens{what}" if shown else ""
        per = f" per rank ({trainer.world_size} ranks)" if trainer.world_size > 1 else ""
        title = f"memory on {self._device(trainer).type}{per}{shape}"
        lines = [table(title, columns)]
        lines += self._shape_lines(trainer, configured, tracked_shape)
        if self.process is not None:
            lines.append(
                f"  process: max RSS {format_bytes(self.process.peak)}, grew {format_bytes(self.process.growth)} "
                f"during the run (tensors plus the runtime, libraries and allocator caches)"
            )
        if self.cuda:
            lines.append(
                f"  cuda: max allocated {format_bytes(self.cuda['max_allocated_bytes'])} "
                f"(in {self.cuda['peak_phase']}), max reserved {format_bytes(self.cuda['max_reserved_bytes'])}, "
                f"device {format_bytes(self.cuda['max_device_bytes'] or None)} ({self.cuda['device_source']})"
            )
        for rank in ranks or []:
            tracked = rank["tracked"]["peak_bytes"] if rank["tracked"] else None
            lines.append(f"  rank {rank['rank']}: tracked peak {format_bytes(tracked)}")
        print("\n".join(lines))

    def _shape_lines(self, trainer: L.Trainer, configured: Optional[list[int]], tracked: Optional[tuple[int, int]]) -> list[str]:
        """What made the measured batches shorter than the worst case, and the worst case itself, labelled."""
        lines = []
        if configured and tracked and list(tracked) != configured:
            why = (
                f"dynamic padding (data.padding: {padding(trainer)}) pads each batch to its longest text"
                if padding(trainer) == "longest" else "the data had shorter batches"
            )
            lines.append(
                f"  shorter batches: {why}; the longest tracked batch was {_shape_text(tracked)} tokens, not "
                f"{_shape_text(configured)} (max_length): predictions above are for {_shape_text(tracked)}"
            )
        at_peak = self.shape_predictions.get("tracked_peak", {}).get("analytic")
        if at_peak is not None and self.peak_batch and self.peak_batch != tracked:
            # e.g. the longest batch came first, before the optimizer state existed
            lines.append(
                f"  the tracked peak came in another batch, {_shape_text(self.peak_batch)} tokens: analytic "
                f"{format_bytes(at_peak.peak)} at that shape"
            )
        if self.cuda and self.longest and self.longest != tracked and "all" in self.shape_predictions:
            found = self.shape_predictions["all"].get("analytic")
            if found is not None:
                lines.append(
                    f"  cuda peaks cover every batch, the longest {_shape_text(self.longest)} tokens: analytic "
                    f"{format_bytes(found.peak)} allocated, {format_bytes(found.reserved)} reserved, "
                    f"{format_bytes(found.device)} device at that shape"
                )
        if configured and self.predictions:
            worst = ", ".join(
                f"{method} {format_bytes(level(f))}" for method, f in self.predictions.items()
            )
            limit = self.budget or self.tier
            fits = ""
            if limit is not None and "analytic" in self.predictions:
                name = "memory.budget" if self.budget else "memory.tier"
                verdict = "fits" if level(self.predictions["analytic"]) <= limit else "does not fit"
                fits = f": {verdict} {name} {format_bytes(limit)}"
            where = "device" if next(iter(self.predictions.values())).device is not None else "tensors"
            lines.append(
                f"  fits (worst case: every batch {_shape_text(configured)}, padded to max_length): {worst} {where}{fits}"
            )
        return lines


class StepTimer(L.Callback):
    """Wall time of each optimizer step (its micro-batches together), the first ``warmup`` steps apart.

    Args:
        warmup: optimizer steps timed but kept apart (first steps compile, allocate, fill caches).
        save: write ``step_times.json`` into the run folder at the end of training (bench reads it).
    """

    FILE = "step_times.json"

    def __init__(self, warmup: int = 3, save: bool = False) -> None:
        self.warmup = warmup
        self.save = save
        self.stamps: list[float] = []
        self._step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank asks

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step = trainer.global_step
        self.stamps = [clock(pl_module.device)]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._step:  # an optimizer step happened (not mid accumulation window)
            self._step = trainer.global_step
            self.stamps.append(clock(pl_module.device))

    @property
    def step_times(self) -> list[float]:
        """Seconds of each optimizer step, warm-up included (``warmup_times``, ``timed_times``)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    @property
    def warmup_times(self) -> list[float]:
        return self.step_times[: self.warmup]

    @property
    def timed_times(self) -> list[float]:
        return self.step_times[self.warmup :]

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
            "warmup_step_times_s": self.warmup_times,
            "step_times_s": self.timed_times,
            "samples_per_step": batch_size and batch_size * trainer.accumulate_grad_batches * trainer.world_size,
        }
        files.write_text(self.run_dir / self.FILE, json.dumps(record, indent=2) + "\n")


def device_memory_used(device: torch.device) -> tuple[Optional[int], Optional[str]]:
    """This process's memory on ``device`` as ``nvidia-smi`` shows it: NVML's per-process figure where
    ``pynvml`` (nvidia-ml-py) is installed and this process is found among NVML's (`lit_memory.memory.nvml`), else
    cudaMemGetInfo's used memory (``torch.cuda.mem_get_info``: the whole device's, other processes included).
    (None, None) when neither answers."""
    used, source = process_memory_used(device)
    if used is not None:
        return used, source
    try:  # no pynvml, no NVML driver library, no permission, or this process not found: the device-wide reading
        free, total = torch.cuda.mem_get_info(device)
    except Exception:
        return None, None
    return int(total - free), "cudaMemGetInfo (whole device)"


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


def level(footprint: Footprint) -> int:
    """What decides whether a step fits: the device total where there is one (CUDA), else the tensors' peak."""
    return footprint.device if footprint.device is not None else footprint.peak


def padding(trainer: L.Trainer) -> Optional[str]:
    return getattr(trainer.datamodule, "hparams", {}).get("padding")


def _shape_text(shape: Any) -> str:
    return " x ".join(map(str, shape))


def batch_shape(trainer: L.Trainer) -> Optional[list[int]]:
    """[micro-batch size, sequence length] of a data module that has them in its hyper-parameters."""
    hparams = getattr(trainer.datamodule, "hparams", {})
    if "batch_size" in hparams and "max_length" in hparams:
        return [hparams["batch_size"], hparams["max_length"]]
    return None


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels run asynchronously: wait until the step's work is done
    return time.perf_counter()

