"""What a run does about memory beside measuring it: the ``memory:`` block and the callbacks it composes.

`lit_memory.run.monitor.MemoryMonitor` measures and writes ``memory.json``; beside it, each with one job:

- `BudgetCap`: ``memory.budget`` on CUDA, the caching allocator capped at the budget less the CUDA context;
- `MemoryPredictions`: the run's predictions (worst case at the start, the shapes the run saw at the end), handed
  to the monitor for its record;
- `MemoryTable`: the end-of-fit table, predicted beside measured;
- `MemoryPicture`: ``memory.png``, the step point by point, predicted beside measured
(`lit_memory.memory.measure.picture`);
- `MemorySnapshot`: ``memory.snapshot``, torch's CUDA memory history for the first steps (pytorch.org/memory_viz);
- `OutOfMemoryReport`: on an out-of-memory error, the breakdown at the failure, the predicted step's picture with where
  it crosses the limit, and what to run instead.

`memory_callbacks` composes them for a run's ``memory:`` block (`lit_memory.memory.settings.MemorySettings`).
Predictions and advice come in as hooks (``predict``, ``advise``, ``timeline``), so nothing here imports the memory
model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only

from lit_memory.errors import UserError
from lit_memory.memory.hardware.gpus import CardReading, allocator_limit, read_card
from lit_memory.memory.margin import Limit
from lit_memory.memory.measure import picture
from lit_memory.memory.measure.footprint import Footprint, breakdown_line, format_bytes
from lit_memory.memory.measure.report import Levels, table
from lit_memory.memory.settings import MemorySettings
from lit_memory.run.monitor import MemoryMonitor, batch_shape, padding

# (trainer, module, simulate, shape) -> predicted footprints per method ("analytic", "simulated"), for batches of
# ``shape`` (rows, tokens); None: the configured batch_size x max_length, the worst case.
Predict = Callable[[L.Trainer, L.LightningModule, bool, Optional[tuple[int, int]]], dict[str, Footprint]]
# (trainer, limit in bytes) -> one line: what to run instead
Advise = Callable[[L.Trainer, int], str]
# (trainer, shape) -> the analytic step point by point (`lit_memory.memory.model.program.timeline`), or None
Timeline = Callable[[L.Trainer, Optional[tuple[int, int]]], Optional[list[dict]]]


def memory_callbacks(
    memory: MemorySettings, predict: Optional[Predict] = None, advise: Optional[Advise] = None,
    timeline: Optional[Timeline] = None,
) -> list[L.Callback]:
    """The callbacks a run's ``memory:`` block makes, in the order their hooks must run: the predictions before the
    monitor (it records them when the fit ends), the table, the picture and the report after it (they show what it
    measured)."""
    monitor = MemoryMonitor(memory.track_steps, memory)
    units: list[L.Callback] = [BudgetCap(memory.cap)]
    if memory.snapshot is not None:
        units.append(MemorySnapshot(memory.snapshot, memory.snapshot_steps))
    if predict is not None:
        units.append(MemoryPredictions(monitor, predict, memory.simulate, timeline))
    shown: list[L.Callback] = [MemoryTable(monitor, memory)]
    if memory.picture:
        shown.append(MemoryPicture(monitor, memory))
    return [*units, monitor, *shown, OutOfMemoryReport(monitor, advise, memory if memory.picture else None)]


class BudgetCap(L.Callback):
    """``memory.budget`` as a cap on the device total, on CUDA, for the length of a fit: the caching allocator
    (``torch.cuda.set_per_process_memory_fraction``, which limits the allocator only, pytorch#58466) may reserve
    the budget less this process's CUDA context; the process's own fraction again when the fit ends. On a CPU
    the monitor's tracker holds the budget.

    The context grows after the start, outside the allocator: kernels load lazily on first use (cuBLAS's GEMMs,
    the attention's; 518 MiB at start and about 750 at the peak on an H100 under CUDA 13, docs/gpu/h100.json), and
    NCCL's communicators make their buffers at their first collectives. So the common kernels are loaded and every
    communicator warmed up before the context is measured (`load_kernels`, `warm_communicators`), and the context
    is measured again after each of the first ``recheck`` optimizer steps, the cap lowered by what it grew.
    """

    def __init__(self, cap: Optional[Limit], recheck: int = 3) -> None:
        self.cap = cap
        self.recheck = recheck
        self._fraction: Optional[float] = None
        self._context = 0
        self._checked = -1
        self.limit: Optional[int] = None  # the allocator's cap now, bytes

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if stage != "fit" or self.cap is None or device.type != "cuda":
            return
        self.load_kernels(device, half_dtype(getattr(trainer, "precision", None)))
        self.warm_communicators(trainer.strategy, device)
        card = self.read_card(device)
        self._fraction = self.get_fraction(device)
        self._cap(card, device)
        print(self._line, file=sys.stderr)  # every rank caps its own process

    def _cap(self, card: CardReading, device: torch.device) -> None:
        self.limit, self._line = allocator_limit(self.cap.bytes, card)
        self._context = card.context if card.context is not None else max(card.total - card.free, 0)
        self.set_fraction(min(self.limit / card.total, 1.0), device)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._fraction is None or step == self._checked or step > self.recheck:
            return
        self._checked = step
        device = trainer.strategy.root_device
        card = self.read_card(device)
        if card.context is None or card.context <= self._context:
            return
        grown = card.context - self._context
        self._cap(card, device)
        print(
            f"memory.budget: this process's CUDA context grew by {format_bytes(grown)} by optimizer step {step} "
            f"(kernels loaded on first use), to {format_bytes(card.context)}: the caching allocator's cap is now "
            f"{format_bytes(self.limit)}", file=sys.stderr,
        )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._fraction is not None:  # the cap belongs to this run, not to the process
            self.set_fraction(self._fraction, trainer.strategy.root_device)
            self._fraction = None

    # -- the seams a CPU test replaces ------------------------------------------------------------

    @staticmethod
    def warm_communicators(strategy: Any, device: torch.device) -> None:
        """Start what every NCCL communicator of the run holds before the context is measured: NCCL connects a
        communicator's channels at its first collective of each kind (``NCCL_RUNTIME_CONNECT``, its default), and
        a single-rank one makes its NET buffer then (`lit_memory.memory.hardware.nccl`). A small and a large
        all-reduce (tree and ring), an all-gather and a reduce-scatter (FSDP2's) on each group that runs
        collectives (`collective_groups`), every rank alike."""
        warm_up(collective_groups(strategy), device)

    @staticmethod
    def read_card(device: torch.device) -> CardReading:
        """The run's card now (`lit_memory.memory.hardware.gpus.read_card`)."""
        return read_card(device.index)

    @staticmethod
    def get_fraction(device: torch.device) -> float:
        return torch.cuda.get_per_process_memory_fraction(device)

    @staticmethod
    def set_fraction(fraction: float, device: torch.device) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction, device)

    @staticmethod
    def load_kernels(device: torch.device, half: Optional[torch.dtype]) -> None:
        """Run, once, small versions of what every step runs (GEMMs in each layout, forward and backward, in
        fp32 and the run's half dtype; attention; softmax, layer norm, GELU), so that their kernels (cuBLAS's and
        cuBLASLt's above all) are in the context before it is measured. Larger shapes may pick other kernels:
        the measurements after the first steps (`on_train_batch_end`) catch those."""
        for dtype in (torch.float32, *([half] if half is not None else [])):
            a = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
            b = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
            q = torch.randn(2, 4, 64, 64, device=device, dtype=dtype, requires_grad=True)
            x = torch.nn.functional.layer_norm(a @ b + a.t() @ b.t(), (64,))
            x = torch.nn.functional.gelu(x).softmax(-1)
            y = torch.nn.functional.scaled_dot_product_attention(q, q, q)
            (x.sum() + y.float().sum()).backward()
        torch.cuda.synchronize(device)


def collective_groups(strategy: Any) -> list[Any]:
    """The NCCL process groups of a run that run collectives: the default group (Lightning's barriers and
    broadcasts) and each dimension of the strategy's device mesh of more than one rank (FSDP2's gathers and
    reductions), each once; none where no NCCL process group is up. A mesh dimension of one rank runs none (FSDP2
    over Lightning's (data_parallel, tensor_parallel) mesh leaves the second idle): warming it up would make its
    communicator's buffers for nothing."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return []
    found = {id(dist.group.WORLD): dist.group.WORLD}
    try:
        mesh = strategy.device_mesh  # Lightning's ModelParallelStrategy: its (data_parallel, tensor_parallel) mesh
    except (AttributeError, RuntimeError):  # no mesh, or none made yet
        mesh = None
    for dim in range(mesh.ndim if mesh is not None else 0):
        group = mesh.get_group(dim)
        if dist.get_world_size(group) > 1:
            found.setdefault(id(group), group)
    return [g for g in found.values() if "nccl" in str(dist.get_backend(g))]  # "nccl", or "cpu:gloo,cuda:nccl"


def warm_up(groups: list[Any], device: torch.device) -> None:
    """On each of ``groups``, with tensors on ``device``: a small and a large all-reduce (NCCL's tree and ring), an
    all-gather and a reduce-scatter (FSDP2's collectives); then the device synchronised."""
    dist = torch.distributed
    for group in groups:
        size = dist.get_world_size(group)
        for numel in (1, 2**20):
            dist.all_reduce(torch.zeros(numel, device=device), group=group)
        shard = torch.zeros(2**18, device=device)
        dist.all_gather_into_tensor(torch.empty(size * shard.numel(), device=device), shard, group=group)
        dist.reduce_scatter_tensor(shard, torch.zeros(size * shard.numel(), device=device), group=group)
    if groups and device.type == "cuda":
        torch.cuda.synchronize(device)


def half_dtype(precision: Any) -> Optional[torch.dtype]:
    """The 16-bit dtype a Lightning precision computes in (``bf16-mixed`` -> bfloat16), else None."""
    text = str(precision or "")
    return torch.bfloat16 if "bf16" in text else torch.float16 if text.startswith("16") else None


class MemoryPredictions(L.Callback):
    """The run's predictions, for the monitor to record beside what it measures: at the start of fit for the
    configured shape (the worst case: every batch ``batch_size x max_length``), at the end for the longest batch the
    tracked steps saw (and, on CUDA, all steps: the allocator's peaks cover them) where it is shorter (dynamic
    padding), and for the batch that reached the tracked peak. The simulation, where asked, for the tracked shape
    only: that is what it is compared with. On the global-zero rank only, at the end."""

    def __init__(
        self, monitor: MemoryMonitor, predict: Predict, simulate: bool = False, timeline: Optional[Timeline] = None
    ) -> None:
        self.monitor, self.predict, self.simulate, self.timeline = monitor, predict, simulate, timeline

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.monitor.predictions = self.predict(trainer, pl_module, self.simulate, None)
        self.monitor.shape_predictions = {}
        if self.timeline is not None and trainer.is_global_zero:  # the worst case's: what an out-of-memory report draws
            shape = batch_shape(trainer)
            self.monitor.predicted_timeline = (tuple(shape) if shape else None, self.timeline(trainer, None))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        monitor = self.monitor
        configured = batch_shape(trainer)
        seen = {
            "tracked": monitor.longest_tracked,
            "all": monitor.longest if monitor.cuda else None,
            # a shorter batch can reach the tracked peak (the first step has no optimizer state yet)
            "tracked_peak": monitor.peak_batch if monitor.peak_batch != monitor.longest_tracked else None,
        }
        found = monitor.shape_predictions
        for key, shape in seen.items():
            if shape is None:
                continue
            if configured is not None and list(shape) == configured:
                found[key] = dict(monitor.predictions)
            elif key != "tracked" and shape == monitor.longest_tracked:
                found[key] = found.get("tracked", {})
            else:
                found[key] = self.predict(trainer, pl_module, self.simulate and key == "tracked", shape)
        # the picture's prediction: at the shape measured point by point (the last tracked micro-batch's)
        shape = monitor.timeline_shape
        if (
            self.timeline is not None
            and shape is not None
            and (monitor.predicted_timeline or (None,))[0] != tuple(shape)
        ):
            monitor.predicted_timeline = (tuple(shape), self.timeline(trainer, tuple(shape)))


class MemoryTable(L.Callback):
    """The end-of-fit table on rank zero: what the monitor measured beside the predictions it was given, per category
    and level (`lit_memory.memory.measure.report.table`), with lines for the shapes measured, the process and the ranks,
    and whether the worst case fits ``memory.budget`` (else ``memory.tier``)."""

    def __init__(self, monitor: MemoryMonitor, memory: MemorySettings = MemorySettings()) -> None:
        self.monitor, self.memory = monitor, memory

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        text = self.text(trainer)
        if text:
            print(text)

    def text(self, trainer: L.Trainer) -> str:
        monitor = self.monitor
        configured = batch_shape(trainer)
        tracked_shape = monitor.longest_tracked
        # Predictions beside the measurements are for the shape measured: the longest tracked batch.
        at_tracked = (
            monitor.shape_predictions.get("tracked", monitor.predictions) if tracked_shape else monitor.predictions
        )
        columns: dict[str, Any] = dict(at_tracked)
        if monitor.measured.phases:
            columns["tracked tensors"] = monitor.measured
        cuda = monitor.cuda
        if cuda:
            columns["cuda (measured)"] = Levels(
                cuda["max_allocated_bytes"],
                cuda["max_reserved_bytes"],
                cuda["max_device_bytes"] or None,
                cuda["peak_phase"],
            )
        if not columns:
            return ""
        shown = tracked_shape or (tuple(configured) if configured else None)
        what = (
            " (the longest tracked batch)" if tracked_shape and configured and list(tracked_shape) != configured else ""
        )
        shape = f", batch {shape_text(shown)} tokens{what}" if shown else ""
        per = f" per rank ({trainer.world_size} ranks)" if trainer.world_size > 1 else ""
        title = f"memory on {trainer.strategy.root_device.type}{per}{shape}"
        lines = [table(title, columns)]
        lines += self._shape_lines(trainer, configured, tracked_shape)
        if monitor.process is not None:
            lines.append(
                f"  process: max RSS {format_bytes(monitor.process.peak)}, grew {format_bytes(monitor.process.growth)} "
                f"during the run (tensors plus the runtime, libraries and allocator caches)"
            )
        if cuda:
            lines.append(
                f"  cuda: max allocated {format_bytes(cuda['max_allocated_bytes'])} "
                f"(in {cuda['peak_phase']}), max reserved {format_bytes(cuda['max_reserved_bytes'])}, "
                f"device {format_bytes(cuda['max_device_bytes'] or None)} ({cuda['device_source']})"
            )
        for rank in monitor.ranks or []:
            tracked = rank["tracked"]["peak_bytes"] if rank["tracked"] else None
            lines.append(f"  rank {rank['rank']}: tracked peak {format_bytes(tracked)}")
        return "\n".join(lines)

    def _shape_lines(
        self, trainer: L.Trainer, configured: Optional[list[int]], tracked: Optional[tuple[int, int]]
    ) -> list[str]:
        """What made the measured batches shorter than the worst case, and the worst case itself, labelled."""
        monitor, lines = self.monitor, []
        if configured and tracked and list(tracked) != configured:
            why = (
                f"dynamic padding (data.padding: {padding(trainer)}) pads each batch to its longest text"
                if padding(trainer) == "longest" else "the data had shorter batches"
            )
            lines.append(
                f"  shorter batches: {why}; the longest tracked batch was {shape_text(tracked)} tokens, not "
                f"{shape_text(configured)} (max_length): predictions above are for {shape_text(tracked)}"
            )
        at_peak = monitor.shape_predictions.get("tracked_peak", {}).get("analytic")
        if at_peak is not None and monitor.peak_batch and monitor.peak_batch != tracked:
            # e.g. the longest batch came first, before the optimizer state existed
            lines.append(
                f"  the tracked peak came in another batch, {shape_text(monitor.peak_batch)} tokens: analytic "
                f"{format_bytes(at_peak.peak)} at that shape"
            )
        if monitor.cuda and monitor.longest and monitor.longest != tracked and "all" in monitor.shape_predictions:
            found = monitor.shape_predictions["all"].get("analytic")
            if found is not None:
                lines.append(
                    f"  cuda peaks cover every batch, the longest {shape_text(monitor.longest)} tokens: analytic "
                    f"{format_bytes(found.peak)} allocated, {format_bytes(found.reserved)} reserved, "
                    f"{format_bytes(found.device)} device at that shape"
                )
        predictions = monitor.predictions
        if configured and predictions:
            worst = ", ".join(f"{method} {format_bytes(level(f))}" for method, f in predictions.items())
            limit, fits = self.memory.limit, ""
            if limit is not None and "analytic" in predictions:
                name = "memory.budget" if self.memory.budget else "memory.tier"
                verdict = "fits" if level(predictions["analytic"]) <= limit.bytes else "does not fit"
                fits = f": {verdict} {name} {format_bytes(limit.bytes)}"
            where = "device" if next(iter(predictions.values())).device is not None else "tensors"
            lines.append(
                f"  fits (worst case: every batch {shape_text(configured)}, padded to max_length): {worst} "
                f"{where}{fits}"
            )
        return lines


class MemoryPicture(L.Callback):
    """``memory.png`` in the run folder at the end of fit, on rank zero: the step point by point, predicted beside
    measured, as memory.json records it (`lit_memory.memory.measure.picture`); the log prints its path."""

    def __init__(self, monitor: MemoryMonitor, memory: MemorySettings = MemorySettings()) -> None:
        self.monitor, self.memory = monitor, memory

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        run_dir = getattr(self.monitor, "run_dir", None)
        if run_dir is None or not run_dir.is_dir():
            return
        record = self.monitor.record(trainer, self.monitor.ranks)
        shape = ((record.get("timeline") or {}).get("measured") or {}).get("batch_shape")
        panel = picture.of_record(record, _title(trainer, pl_module, shape), self._budget(), self.memory.margin)
        if panel is None:
            print("memory picture: none (no step was tracked: memory.track_steps is 0)")
            return
        drawn = picture.draw([panel], run_dir / picture.FILE)
        print(f"memory picture: {drawn}" if drawn else
              "memory picture: none (matplotlib is not installed: pip install 'lit-memory[plot]')")

    def _budget(self) -> Optional[int]:
        return self.memory.cap.bytes if self.memory.cap else None


class MemorySnapshot(L.Callback):
    """``memory.snapshot``: torch's record of the CUDA caching allocator's history (each allocation and free, with
    its stack) over the first ``steps`` optimizer steps, dumped to ``path`` for https://pytorch.org/memory_viz
    (`torch.cuda.memory._record_memory_history`, `_dump_snapshot`). CUDA only: on another device it is one error
    before training."""

    ENTRIES = 200_000  # the history kept: a BERT-large step allocates some tens of thousands of blocks

    def __init__(self, path: str, steps: int = 2) -> None:
        self.path, self.steps = path, steps
        self._file: Optional[Any] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        device = trainer.strategy.root_device
        if device.type != "cuda":
            raise UserError(
                f"memory.snapshot records the CUDA caching allocator's history (what pytorch.org/memory_viz draws); "
                f"this run is on {device.type}: drop memory.snapshot, or see memory.png and memory.json for the step"
            )
        path = Path(os.path.expanduser(self.path))
        if not path.is_absolute():  # beside the run's memory.json
            path = Path(trainer.log_dir or trainer.default_root_dir) / path
        if trainer.world_size > 1:  # one file per rank
            path = path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}")
        self._file = path
        self.record_history(True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self._file is not None and trainer.global_step >= self.steps:
            self._dump(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._file is not None:  # fewer steps than asked for
            self._dump(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._file is not None:  # the history up to the failure: what an out-of-memory error needs most
            self._dump(trainer)

    def _dump(self, trainer: L.Trainer) -> None:
        path, self._file = self._file, None
        path.parent.mkdir(parents=True, exist_ok=True)
        self.dump(path)
        self.record_history(False)
        print(
            f"memory snapshot ({min(trainer.global_step, self.steps)} optimizer steps): {path}; view it by dropping "
            "the file on https://pytorch.org/memory_viz, or offline: python -m torch.cuda._memory_viz trace_plot "
            f"{path} -o {path.with_suffix('.html')}", file=sys.stderr,
        )

    # -- the seams a CPU test replaces ------------------------------------------------------------

    def record_history(self, on: bool) -> None:
        torch.cuda.memory._record_memory_history("all" if on else None, max_entries=self.ENTRIES)

    @staticmethod
    def dump(path: Any) -> None:
        torch.cuda.memory._dump_snapshot(str(path))


class OutOfMemoryReport(L.Callback):
    """On an out-of-memory error, on rank zero: the breakdown the monitor recorded at the failure (phase, batch, live
    bytes per category, the limit), the picture of the predicted step with the point where it crosses the limit
    (``memory.png`` in the run folder, where ``memory`` settings are given), and one line saying what to run instead
    (``advise``: the lightest shipped recipe predicted to fit; without it, the command that plans one)."""

    def __init__(
        self, monitor: MemoryMonitor, advise: Optional[Advise] = None, memory: Optional[MemorySettings] = None
    ) -> None:
        self.monitor, self.advise, self.memory = monitor, advise, memory

    @rank_zero_only
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.monitor.oom is None:
            return
        try:  # the report must never replace the error it reports
            self._report(trainer, pl_module)
        except Exception as failed:  # noqa: BLE001
            print(f"out-of-memory report failed: {type(failed).__name__}: {failed}", file=sys.stderr)

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        oom = self.monitor.oom
        limit = oom["limit_bytes"]
        print(
            f"out of memory in the {oom['phase']} phase of batch {oom['batch']}: "
            f"{format_bytes(oom['live_bytes'])} live = {breakdown_line(oom['categories'])} "
            f"(limit {format_bytes(limit)})",
            file=sys.stderr,
        )
        if self.memory is not None:
            line = self._picture(trainer, pl_module, limit)
            if line:
                print(line, file=sys.stderr)
        if self.advise is not None and limit is not None:
            print(self.advise(trainer, limit), file=sys.stderr)
        else:
            print("run `python -m lit_memory plan --budget <your GPU memory> <your configs>` for a recipe that fits",
                  file=sys.stderr)


    def _picture(self, trainer: L.Trainer, pl_module: L.LightningModule, limit: Optional[int]) -> str:
        """The predicted step (the worst case's) drawn against the limit the run crossed, and one line: where. Without
        a limit (a CPU run with no ``memory.budget``: the error came from elsewhere) the step is drawn all the same."""
        shape, points = self.monitor.predicted_timeline or (None, None)
        run_dir = getattr(self.monitor, "run_dir", None)
        if not points or run_dir is None or not run_dir.is_dir():
            return ""
        record = self.monitor.record(trainer, None, self.monitor.oom)
        panel = picture.of_record(record, _title(trainer, pl_module), None, self.memory.margin)
        panel.notes.append(
            f"out of memory in the {self.monitor.oom['phase']} phase of batch {self.monitor.oom['batch']}"
        )
        if limit is None:
            where = "no limit to compare with (memory.budget is not set on this device)"
        else:
            panel.limit = (limit, "the limit crossed")
            crossed = picture.crossing(points, limit)
            where = (f"the predicted step crosses the limit {picture.where(crossed)}" if crossed else
                     "the predicted step stays under the limit: the run needed more than predicted")
        drawn = picture.draw([panel], run_dir / picture.FILE)
        if drawn is None:
            return f"{where} (no picture: matplotlib is not installed)"
        return f"{where}: see the picture of the step, {drawn}"


def _title(trainer: L.Trainer, module: L.LightningModule, shape: Any = None) -> str:
    """The picture's title: the model, the batch (``shape``, else the configured one), the precision, the device."""
    name = (
        getattr(getattr(module, "hparams", {}), "get", lambda *_: None)("model_name_or_path") or type(module).__name__
    )
    shape = shape or batch_shape(trainer)
    batch = f", batch {shape_text(shape)} tokens" if shape else ""
    per = f", per rank of {trainer.world_size}" if trainer.world_size > 1 else ""
    return f"one training step: {name}{batch}, {trainer.precision} on {trainer.strategy.root_device.type}{per}"


def level(footprint: Footprint) -> int:
    """What decides whether a step fits: the device total where there is one (CUDA), else the tensors' peak."""
    return footprint.device if footprint.device is not None else footprint.peak


def shape_text(shape: Any) -> str:
    return " x ".join(map(str, shape))
