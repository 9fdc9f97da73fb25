"""Measure training memory in every run, and explain it when it runs out.

torch's `MemTracker` (``torch.distributed._tools.mem_tracker``) attributes every live tensor to a
category (parameter, gradient, optimizer state, activation, temporary) from its dispatch mode; the
`Tracker` below adds per-phase peaks (forward, backward, optimizer step) and an optional budget.
The same tracker measures real runs (`MemoryMonitor`) and, on fake tensors, simulates them
(`lit_memory.estimate`), so predicted and measured numbers share one definition of each category.

`MemoryMonitor` is the callback the CLI adds to every run. It writes ``memory.json`` next to the
run's ``config.yaml`` (schema in docs/memory.md), prints predicted vs measured per category at the
end of fit, and on an out-of-memory error prints the breakdown at the failure and the lightest
shipped recipe predicted to fit.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.optim.optimizer import register_optimizer_step_post_hook

from lit_memory.errors import UserError

log = logging.getLogger(__name__)

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "other")
PHASES = ("forward", "backward", "step")
# MemTracker's reference types -> our categories. Temporaries of the backward pass and tensors
# tracked from outside (the batch) are "other"; tensors created inside `optimizer.step`
# (its state and its temporaries) are "optimizer", as MemTracker attributes them.
CATEGORY_OF = {
    "Parameter": "weights",
    "Buffer": "weights",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "other",
    "Other": "other",
}
SCHEMA_VERSION = 1

# Units, case-insensitive: decimal K/KB, M/MB, G/GB, T/TB; binary KiB, MiB, GiB, TiB; bare numbers are bytes.
_UNITS = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgt", start=1):
    _UNITS[_prefix] = _UNITS[_prefix + "b"] = 1000**_power
    _UNITS[_prefix + "ib"] = 1024**_power


def parse_bytes(value: Union[int, float, str]) -> int:
    """``4GiB`` -> 4294967296; ``4GB`` / ``4G`` are powers of ten, a bare number is bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise UserError(f"cannot read {value!r} as a memory size: use e.g. 4GiB, 3.5GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass
class Footprint:
    """Bytes per category at the peak of each training phase; the peak is the largest of them."""

    phases: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, phase: str, categories: dict[str, int]) -> None:
        """Keep, per phase, the composition with the largest total (the peak over steps)."""
        if phase not in self.phases or sum(categories.values()) > sum(self.phases[phase].values()):
            self.phases[phase] = {c: int(categories.get(c, 0)) for c in CATEGORIES}

    def merge(self, other: "Footprint") -> None:
        for phase, categories in other.phases.items():
            self.add(phase, categories)

    @property
    def peak_phase(self) -> Optional[str]:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()), default=None)

    @property
    def categories(self) -> dict[str, int]:
        return dict(self.phases[self.peak_phase]) if self.phases else dict.fromkeys(CATEGORIES, 0)

    @property
    def peak(self) -> int:
        return sum(self.categories.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak,
            "peak_phase": self.peak_phase,
            "categories": self.categories,
            "phases": {p: {"peak_bytes": sum(c.values()), "categories": c} for p, c in self.phases.items()},
        }


class MemoryBudgetExceeded(torch.OutOfMemoryError):
    """Raised by a `Tracker` with a budget: the same error (and report path) as CUDA running out."""

    def __init__(self, message: str, categories: dict[str, int]) -> None:
        super().__init__(message)
        self.categories = categories  # what was live when the budget was crossed


class _NoHook:
    def remove(self) -> None:
        pass


class Tracker(MemTracker):
    """torch's MemTracker with per-phase peaks (``enter_phase``) and an optional budget in bytes.

    Only tensors on ``device`` count (on CUDA, torch keeps e.g. Adam's step counters on the CPU).
    Tensors created before the tracker is entered must be registered with ``track_external``.
    """

    def __init__(self, device: Union[str, torch.device] = "cpu", budget: Optional[int] = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.budget = budget
        self.footprint = Footprint()
        self.phase: Optional[str] = None

    def _track_module_params_and_buffers(
        self, module: torch.nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        # MemTracker hooks every parameter's gradient, which raises on frozen ones: mark those as
        # already hooked (with handles that remove nothing) so it skips them.
        if install_grad_hooks:
            for param in module.parameters():
                if not param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _register_global_optimizer_hook(self) -> None:
        # Lightning runs training_step and backward inside `optimizer.step(closure)`, so MemTracker's
        # step pre-hook would count the whole step as optimizer memory: the phase decides instead
        # (`enter_phase("step")`). The post-hook still labels the optimizer's state.
        def label_state(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._track_optimizer_states(_MemRefType.OPT, optimizer)

        self._optimizer_hook_handles = (register_optimizer_step_post_hook(label_state),)

    # MemTracker warns when a module was freed before its backward hook runs; nothing to track then.
    def _pre_bw_hook(self, module: Optional[torch.nn.Module], args: Any) -> None:
        if module is not None:
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module: Optional[torch.nn.Module], args: Any) -> None:
        if module is not None:
            super()._post_bw_hook(module, args)

    def _update_peak_stats(self, peak_state: Any) -> None:
        # Only the global peak is used here. MemTracker also updates a peak per module, walking every
        # tracked module after every op: most of its cost on a 24-layer model.
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)

    def categories(self, which: str = "current") -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for device, snapshot in self.get_tracker_snapshot(which).items():
            if self._counts(device):
                for kind, size in snapshot.items():
                    name = getattr(kind, "value", kind)  # MemTracker's reference-type enum, or "Total"
                    if name in CATEGORY_OF:
                        out[CATEGORY_OF[name]] += size
        return out

    def _counts(self, device: torch.device) -> bool:
        return device.type == self.device.type and self.device.index in (None, device.index)

    def live_bytes(self) -> int:
        # Read in place: get_tracker_snapshot() deep-copies, too slow to run after every op.
        return sum(snap["Total"] for dev, snap in self._curr_mem_snap.items() if self._counts(dev))

    def enter_phase(self, phase: str) -> None:
        self._close_phase()
        # Restart the peak from what is live now, exactly as MemTracker.__enter__ initialises it.
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        self.phase = phase
        self._in_opt = phase == "step"  # tensors created while stepping are the optimizer's

    def _close_phase(self) -> None:
        if self.phase is not None:
            self.footprint.add(self.phase, self.categories("peak"))
        self.phase = None

    def __exit__(self, *args: Any) -> None:
        if self._depth == 1:
            self._close_phase()
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.budget is not None:
            live = self.live_bytes()
            if live > self.budget:
                raise MemoryBudgetExceeded(
                    f"tracked tensors need {format_bytes(live)}, over the budget of {format_bytes(self.budget)}",
                    self.categories(),
                )
        return out


def _tensors(data: Any) -> list[torch.Tensor]:
    """The tensors in a batch (dicts such as transformers' BatchEncoding, lists, tuples)."""
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        return [t for item in data for t in _tensors(item)]
    return []


def live_breakdown(module: torch.nn.Module, optimizers: list, allocated: int) -> dict[str, int]:
    """Categories of what is live, from the tensors themselves: weights, gradients and optimizer
    state are summed; the rest of ``allocated`` is activations and temporaries (reported as activations)."""
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    weights = nbytes(list(module.parameters()) + list(module.buffers()))
    grads = nbytes(p.grad for p in module.parameters() if p.grad is not None)
    state = nbytes(v for opt in optimizers for s in opt.state.values() for v in s.values())
    return {
        "weights": weights,
        "gradients": grads,
        "optimizer": state,
        "activations": max(allocated - weights - grads - state, 0),
        "other": 0,
    }


def breakdown_line(categories: dict[str, int]) -> str:
    return " + ".join(f"{name} {format_bytes(categories.get(name, 0))}" for name in CATEGORIES)


class MemoryMonitor(L.Callback):
    """Measure memory in every run; write ``memory.json``; explain an out-of-memory error.

    Args:
        track_steps: optimizer steps tracked tensor by tensor with torch's MemTracker (per category
            and per phase). Its Python dispatch slows the tracked micro-batches, so only the first
            steps are tracked (the first creates the optimizer state, the second is the steady state),
            and of an accumulation window only the micro-batches that differ: the first, the second
            and the last. 0 turns tensor tracking off; on CUDA the allocator's peaks
            (``torch.cuda.max_memory_allocated``/``max_memory_reserved``) are read every step regardless.
        budget: a memory limit such as ``4GiB``. On CUDA it caps this process with
            ``torch.cuda.set_per_process_memory_fraction``; on CPU the tracker raises CUDA's
            out-of-memory error when the tracked tensors exceed it (every step is then tracked).
        simulate: also run the simulated prediction at the start of fit (one training step on
            fake tensors: seconds on the bundled model, about half a minute on BERT-large).
    """

    def __init__(self, track_steps: int = 2, budget: Optional[str] = None, simulate: bool = False) -> None:
        if track_steps < 0:
            raise UserError(f"memory.track_steps must be >= 0, got {track_steps}")
        self.track_steps = track_steps
        self.budget = parse_bytes(budget) if budget is not None else None
        self.simulate = simulate
        self.tracker: Optional[Tracker] = None
        self.measured = Footprint()
        self.cuda_phases: dict[str, dict[str, int]] = {}
        self.predictions: dict[str, Any] = {}
        self.setup_: Any = None
        self.batches = 0
        self.tracked_batches = 0
        self._phase: Optional[str] = None
        self._batch_idx = 0

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

    # -- predictions ---------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Asked on every rank: under a distributed strategy `log_dir` is a collective (a broadcast),
        # and asking it on rank 0 alone, when writing, would pair with another rank's next collective.
        self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)
        if stage == "fit" and self.budget is not None and self._on_cuda(trainer):
            device = self._device(trainer)
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(self.budget / total, 1.0), device)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lit_memory import estimate

        try:
            self.setup_ = estimate.Setup.from_run(trainer, pl_module)
        except AttributeError:  # not a SequenceClassifier with our data module: measure only
            return
        methods = {"analytic": estimate.analytic, **({"simulated": estimate.simulate} if self.simulate else {})}
        for name, predict in methods.items():
            try:
                self.predictions[name] = predict(self.setup_)
            except Exception as err:  # a model the predictions do not cover must still train (and be measured)
                log.warning(f"no {name} memory prediction: {type(err).__name__}: {err}")

    # -- measurement ---------------------------------------------------------------------------

    def _tracking(self, trainer: L.Trainer, batch_idx: int) -> bool:
        if self.budget is not None and not self._on_cuda(trainer):
            return True  # the CPU budget is enforced by the tracker
        # Within an accumulation window the micro-batches after the second repeat the second's memory:
        # track the first (gradients zeroed), the second (accumulating) and the one that steps.
        accumulate = trainer.accumulate_grad_batches
        return trainer.global_step < self.track_steps and batch_idx % accumulate in {0, 1, accumulate - 1}

    def _enter_phase(self, trainer: L.Trainer, phase: str) -> None:
        self._close_cuda_phase(trainer)
        self._phase = phase
        if self.tracker is not None:
            self.tracker.enter_phase(phase)
        if self._on_cuda(trainer):
            torch.cuda.reset_peak_memory_stats(self._device(trainer))

    def _close_cuda_phase(self, trainer: L.Trainer) -> None:
        if self._phase is None or not self._on_cuda(trainer):
            return
        device = self._device(trainer)
        stats = self.cuda_phases.setdefault(self._phase, {"max_allocated_bytes": 0, "max_reserved_bytes": 0})
        stats["max_allocated_bytes"] = max(stats["max_allocated_bytes"], torch.cuda.max_memory_allocated(device))
        stats["max_reserved_bytes"] = max(stats["max_reserved_bytes"], torch.cuda.max_memory_reserved(device))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_idx = batch_idx
        if self._tracking(trainer, batch_idx):
            tracker = Tracker(self._device(trainer), None if self._on_cuda(trainer) else self.budget)
            tracker.track_external(pl_module, *trainer.optimizers, *_tensors(batch))
            self.tracker = tracker.__enter__()
        self._enter_phase(trainer, "forward")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._enter_phase(trainer, "backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._enter_phase(trainer, "step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._close_cuda_phase(trainer)
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

    def measured_peak(self) -> Optional[int]:
        """The peak so far: the CUDA allocator's when on CUDA, else the tracked tensors'."""
        if self.cuda_phases:
            return max(s["max_allocated_bytes"] for s in self.cuda_phases.values())
        return self.measured.peak or None

    # -- reporting -----------------------------------------------------------------------------

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer)
        self._print_table(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close_cuda_phase(trainer)
        oom = None
        if isinstance(exception, torch.OutOfMemoryError):
            oom = self._oom(trainer, pl_module, getattr(exception, "categories", None))
        if self.tracker is not None:
            self._stop_tracker()
        if oom is not None or self.batches:  # not for bad input caught before training
            self._write(trainer, oom)
        if oom is not None:
            self._print_oom(trainer, oom)

    def _oom(
        self, trainer: L.Trainer, pl_module: L.LightningModule, categories: Optional[dict] = None
    ) -> dict[str, Any]:
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
        print(self._suggestion(limit), file=sys.stderr)

    def _suggestion(self, limit: Optional[int]) -> str:
        if self.setup_ is None or limit is None:
            return "run `python -m lit_memory plan --budget <your GPU memory> <your configs>` for a recipe that fits"
        from lit_memory import plan

        found = plan.lightest_fitting_recipe(self.setup_, limit)
        size = format_bytes(limit)
        if found is None:
            budget = size.replace(" ", "")
            return f"no shipped recipe is predicted to fit {size}: try `python -m lit_memory plan --budget {budget}`"
        path, peak = found
        return f"lightest shipped recipe predicted to fit {size}: --config {path} (predicted peak {format_bytes(peak)})"

    def report(self, trainer: L.Trainer, oom: Optional[dict] = None) -> dict[str, Any]:
        """The content of memory.json (schema: docs/memory.md)."""
        device = self._device(trainer)
        on_cuda = device.type == "cuda"
        predicted = {name: p.footprint for name, p in self.predictions.items()}
        sources = {
            "analytic": predicted.get("analytic"),
            "simulated": predicted.get("simulated"),
            "measured": self.measured if self.measured.phases else None,
        }
        cuda = None
        if on_cuda:
            cuda = {
                "max_allocated_bytes": max((s["max_allocated_bytes"] for s in self.cuda_phases.values()), default=0),
                "max_reserved_bytes": max((s["max_reserved_bytes"] for s in self.cuda_phases.values()), default=0),
                "phases": self.cuda_phases,
            }
        return {
            "schema": SCHEMA_VERSION,
            "device": {
                "type": device.type,
                "name": torch.cuda.get_device_name(device) if on_cuda else "cpu",
                "total_bytes": torch.cuda.get_device_properties(device).total_memory if on_cuda else None,
                "limit_bytes": self.limit(trainer),
            },
            "config": "config.yaml",
            "batch_shape": [self.setup_.batch_size, self.setup_.max_length] if self.setup_ else None,
            "batches": self.batches,
            "tracked_batches": self.tracked_batches,
            "optimizer_steps": trainer.global_step,
            "peak_bytes": {k: (v.peak if v else None) for k, v in sources.items()},
            "peak_phase": {k: (v.peak_phase if v else None) for k, v in sources.items()},
            "categories": {k: (v.categories if v else None) for k, v in sources.items()},
            "phases": {k: (v.to_dict()["phases"] if v else None) for k, v in sources.items()},
            "cuda": cuda,
            "oom": oom,
        }

    @rank_zero_only
    def _write(self, trainer: L.Trainer, oom: Optional[dict] = None) -> None:
        run_dir = getattr(self, "run_dir", None)  # None: failed before setup
        if run_dir is not None and run_dir.is_dir():  # created by Lightning with the run's config.yaml; never made here
            (run_dir / "memory.json").write_text(json.dumps(self.report(trainer, oom), indent=2) + "\n")

    @rank_zero_only
    def _print_table(self, trainer: L.Trainer) -> None:
        columns = {name: p.footprint for name, p in self.predictions.items()}
        if self.measured.phases:
            columns["measured"] = self.measured
        if not columns:
            return
        shape = f" for batch {self.setup_.batch_size} x {self.setup_.max_length} tokens" if self.setup_ else ""
        lines = [f"memory on {self._device(trainer).type}{shape} (measured: {self.tracked_batches} tracked batches):"]
        lines.append(f"  {'':<12}" + "".join(f"{name:>14}" for name in columns))
        for category in CATEGORIES:
            lines.append(
                f"  {category:<12}" + "".join(f"{format_bytes(f.categories[category]):>14}" for f in columns.values())
            )
        lines.append(f"  {'peak':<12}" + "".join(f"{format_bytes(f.peak):>14}" for f in columns.values()))
        lines.append(f"  {'(phase)':<12}" + "".join(f"{str(f.peak_phase):>14}" for f in columns.values()))
        if self.cuda_phases:
            report = self.report(trainer)["cuda"]
            lines.append(
                f"  cuda allocator: max allocated {format_bytes(report['max_allocated_bytes'])}, "
                f"max reserved {format_bytes(report['max_reserved_bytes'])}"
            )
        print("\n".join(lines))
