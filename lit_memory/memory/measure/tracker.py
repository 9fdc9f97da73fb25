"""Measured memory: torch's MemTracker attributing every live tensor, and the process's own peak.

`Tracker` is torch's `MemTracker` (``torch.distributed._tools.mem_tracker``, which labels each
tensor a parameter, buffer, gradient, optimizer state, activation or temporary from its dispatch
mode and hooks) with per-phase peaks (``enter_phase``) and an optional budget. The same tracker
measures real runs (`lit_memory.run.monitor`) and, on fake tensors, simulates them
(`lit_memory.planning.prediction.simulate`), so predicted and measured numbers share one definition of each
category. Its numbers are *tracked tensors*: what the process holds beyond them (the Python
runtime, libraries, allocator caches) is `ProcessPeak`'s.
"""

from __future__ import annotations

import resource
import sys
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode, _push_mode

from lit_memory.memory.measure.footprint import CATEGORIES, Footprint, format_bytes

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


class MemoryBudgetExceeded(torch.OutOfMemoryError):
    """Raised by a `Tracker` with a budget: the same error (and report path) as CUDA running out."""

    def __init__(self, message: str, categories: dict[str, int]) -> None:
        super().__init__(message)
        self.categories = categories  # what was live when the budget was crossed


class Tracker(MemTracker):
    """torch's MemTracker with per-phase peaks (``enter_phase``) and an optional budget in bytes.

    Only tensors on ``device`` count (on CUDA, torch keeps e.g. Adam's step counters on the CPU).
    Tensors created before the tracker is entered must be registered with ``track_external``.

    MemTracker is private torch API; some of its hooks are replaced here, each for a reason given
    where it is. Everything else (dispatch, storage accounting) is torch's. Its module tracking is
    replaced by `_ForwardCalls`: torch's registers autograd hooks that keep every tracked step's
    autograd graph alive, and that graph holds the model (see `_ForwardCalls`).
    """

    def __init__(
        self,
        device: Union[str, torch.device] = "cpu",
        budget: Optional[int] = None,
        compiled_steps: Optional[Callable[[torch.optim.Optimizer], bool]] = None,
        record: bool = False,
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        # ``record``: every allocation and free on the device, in order (``("+", key, bytes)``, ``("-", key)``,
        # ``("phase", name)``), for the caching allocator's replay (`lit_memory.memory.hardware.allocator.replay`).
        self.events: Optional[list[tuple]] = [] if record else None
        self._recorded: dict[int, int] = {}  # id of a live storage's info -> its key in `events` (ids are reused)
        self.budget = budget
        self.footprint = Footprint()
        self.phase: Optional[str] = None
        # Which optimizers' step runs torch.compile'd kernels (torchao's:
        # `lit_memory.optim.optimizers.compiles_its_step`, given by the caller: this layer knows no optimizer library):
        # dynamo refuses to run compiled code under a Python dispatch mode, so their update runs with this tracker
        # paused. Their kernels' buffers are allocated outside the dispatcher and are not tracked tensors in any case;
        # the state they create is labelled after the step. None: every step tracked (an eager stand-in runs instead of
        # compiled code, or none compiles).
        self.compiled_steps = compiled_steps
        self._paused = False
        self._mod_tracker = _ForwardCalls()
        self._seen_modules: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        # The step point by point, for the picture of a step (`watch_layers`): each layer's forward and backward,
        # the phases' edges, as the analytic model's timeline names them (`lit_memory.memory.model.program`).
        self.timeline: Optional[list[dict]] = None
        self._layer_index: dict[int, int] = {}
        self._layer_of_param: dict[int, int] = {}
        self._waiting: dict[int, int] = {}  # layer -> gradients not arrived in this backward
        self._layer_sizes: dict[int, int] = {}

    def watch_layers(self, layers: list[torch.nn.Module]) -> None:
        """Record the step's points (`timeline`): the tracked tensors per category after each of ``layers``' forward
        and after its last gradient arrives in backward, and at the phases' edges."""
        self.timeline = []
        self._layer_index = {id(m): i for i, m in enumerate(layers)}
        self._layer_of_param = {id(p): i for i, m in enumerate(layers) for p in m.parameters() if p.requires_grad}
        self._layer_sizes = {}
        for i in self._layer_of_param.values():
            self._layer_sizes[i] = self._layer_sizes.get(i, 0) + 1
        self._waiting = dict(self._layer_sizes)

    def point(self, label: str) -> None:
        if self.timeline is not None:
            point = {"label": label, "categories": self.categories()}
            if self.device.type == "cuda":
                point["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            self.timeline.append(point)

    # -- module hooks: only what the categories need ---------------------------------------------

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        # MemTracker's keeps per-module snapshots (unused here: one deep copy per module call) and
        # labels a module's parameters at its first call; only the labelling is kept, and the
        # checkpointed region: a forward that runs inside backward recomputes activations.
        if module not in self._seen_modules:
            self._seen_modules.add(module)
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
        if self._mod_tracker.is_bw and self._ac_mod is None:
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        if self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False
        if id(module) in self._layer_index and not self._mod_tracker.is_bw and self.phase == "forward":
            self.point(f"forward: layer {self._layer_index[id(module)] + 1}")

    def _pre_bw_hook(self, module: Optional[torch.nn.Module], args: Any) -> None:
        pass  # never called: `_ForwardCalls` installs no backward hooks

    _post_bw_hook = _pre_bw_hook

    def _track_module_params_and_buffers(
        self, module: torch.nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        # MemTracker hooks every parameter's gradient: that raises on frozen parameters, and its
        # post-accumulate hook reads `.grad` after the fused step has freed it (a warning per
        # parameter). These hooks label trainable parameters' gradients and skip what is gone.
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._label_gradient),
                        param.register_post_accumulate_grad_hook(self._gradient_arrived),
                    )
        return sizes

    def _gradient_arrived(self, param: torch.Tensor) -> None:
        self._label_gradient(param.grad)
        layer = self._layer_of_param.get(id(param))
        if layer is not None and self.timeline is not None and self.phase == "backward":
            self._waiting[layer] -= 1
            if self._waiting[layer] == 0:  # the layer's backward is done (and under the fused step, its bucket stepped)
                self.point(f"backward: layer {layer + 1}")

    def _label_gradient(self, grad: Optional[torch.Tensor]) -> None:
        if grad is not None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _register_global_optimizer_hook(self) -> None:
        # Lightning runs training_step and backward inside `optimizer.step(closure)`, so MemTracker's
        # step pre-hook would count the whole step as optimizer memory: the phase decides instead
        # (`enter_phase("step")`). After a step, label the state of the parameters that optimizer
        # stepped, not its whole state: the fused step's bucket optimizers share one state dict, and
        # scanning all of it after each bucket is quadratic.
        def label_state(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            state = optimizer.state
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param in state:
                        for value in state[param].values():
                            if isinstance(value, torch.Tensor):
                                self._update_and_maybe_create_winfos(value, _MemRefType.OPT)

        def before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
            if self.compiled_steps is None or not self.compiled_steps(optimizer):
                return None
            # Lightning hands the step a closure that runs training_step and backward: track those, pause after.
            # ``args`` are the step's own: the optimizer first.
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
            if closure is None:
                self._pause()
                return None

            def then_pause() -> Any:
                try:
                    return closure()
                finally:
                    self._pause()

            if "closure" in kwargs:
                return args, {**kwargs, "closure": then_pause}
            return (args[0], then_pause, *args[2:]), kwargs

        def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._resume()
            label_state(optimizer, args, kwargs)

        self._optimizer_hook_handles = (
            register_optimizer_step_pre_hook(before_step),
            register_optimizer_step_post_hook(after_step),
        )

    def _pause(self) -> None:
        if not self._paused and _get_current_dispatch_mode() is self:
            _pop_mode()
            self._paused = True

    def _resume(self) -> None:
        if self._paused:
            _push_mode(self)
            self._paused = False

    def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: Any = None, old_reftype: Any = None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if self.events is None or not self._counts(winfo.device):
            return
        name = getattr(u_type, "name", str(u_type))
        if name in ("DEL", "SIZE") and id(winfo) in self._recorded:
            self.events.append(("-", self._recorded.pop(id(winfo))))
        if name in ("ADD", "SIZE") and winfo.mem_consumed > 0:
            key = self._recorded[id(winfo)] = len(self.events)
            self.events.append(("+", key, winfo.mem_consumed))

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
        if phase == "backward":
            self.point("forward: head and loss")
            self._waiting = dict(self._layer_sizes)
        self._close_phase()
        if phase == "forward":
            self.point("start")
        # Restart the peak from what is live now, exactly as MemTracker.__enter__ initialises it.
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        self.phase = phase
        if self.events is not None:
            self.events.append(("phase", phase))
        self._in_opt = phase == "step"  # tensors created while stepping are the optimizer's

    def _close_phase(self) -> None:
        if self.phase is not None:
            self.footprint.add(self.phase, self.categories("peak"))
            if self.phase == "step":
                self.point("optimizer step")
        self.phase = None

    def __exit__(self, *args: Any) -> None:
        self._resume()  # a step that raised leaves the tracker paused: MemTracker pops its mode on exit
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


class _ForwardCalls(ModTracker):
    """torch's ModTracker reduced to its global module forward hooks, for `Tracker`.

    torch's own also registers `torch.autograd.graph.register_multi_grad_hook` on every module's inputs
    and outputs; each of those hooks keeps, in its closure, the grad_fn nodes it is registered on: a
    reference cycle through C++ (node -> hook dict -> closure -> node) that Python's garbage collector
    cannot see, so the step's whole autograd graph stays alive after backward, and with it every
    parameter its AccumulateGrad nodes point at (torch 2.13: each tracked fit kept its model alive,
    about a model's size per fit; `tests/memory/measure/test_tracker.py`). Backward is told apart by
    autograd's graph task (``is_bw``), which needs no hook.
    """

    def _fw_pre_hook(self, mod: torch.nn.Module, input: Any) -> None:
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)

    def _fw_post_hook(self, mod: torch.nn.Module, input: Any, output: Any) -> None:
        if self._user_post_fw_hook is not None:
            self._user_post_fw_hook(mod, input, output)


def batch_tensors(data: Any) -> list[torch.Tensor]:
    """The tensors in a batch (dicts such as transformers' BatchEncoding, lists, tuples)."""
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (list, tuple)):
        return [t for item in data for t in batch_tensors(item)]
    return []


def live_breakdown(
    module: torch.nn.Module, optimizers: list, allocated: int, device: Optional[torch.device] = None
) -> dict[str, int]:
    """Categories of what is live, from the tensors themselves: weights, gradients and optimizer
    state are summed (weights: the module's parameters and buffers and the parameters its ``optimizers`` step);
    the rest of ``allocated`` is activations and temporaries (reported as activations).

    Each tensor counts by the storages it holds on ``device`` (all devices if None), as torch's MemTracker
    counts them (``get_untyped_storages``): a tensor subclass by its inner tensors, so an FSDP2 shard (a
    DTensor, which has no storage of its own) by its local tensor, torchao's 8-bit state by its codes and
    scales; a storage shared by several tensors once."""
    seen: set[tuple[torch.device, int]] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            for storage in get_untyped_storages(t):
                key = (storage.device, storage.data_ptr())
                if key not in seen and (device is None or _same_device(storage.device, device)):
                    seen.add(key)
                    total += storage.nbytes()
        return total

    # The optimizers' parameters too: under FSDP2 a gathered unit's module holds its unsharded parameters while
    # the shards it was gathered from (what the optimizer steps) stay alive beside them.
    stepped = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    weights = nbytes([*module.parameters(), *module.buffers(), *stepped])
    grads = nbytes(p.grad for p in [*module.parameters(), *stepped] if p.grad is not None)  # a shard's accumulated
    state = nbytes(v for opt in optimizers for s in opt.state.values() for v in s.values())
    return {
        "weights": weights,
        "gradients": grads,
        "optimizer": state,
        "activations": max(allocated - weights - grads - state, 0),
        "other": 0,
    }


def _same_device(found: torch.device, wanted: torch.device) -> bool:
    return found.type == wanted.type and wanted.index in (None, found.index)


class ProcessPeak:
    """The process's resident memory: its size when started and its peak since (max RSS).

    The kernel keeps the peak for the process's whole life and it cannot be reset, so the growth over
    a run is the peak minus the size at its start: what this run added on top of the interpreter,
    libraries and anything allocated before it. On Linux the peak is ``VmHWM`` (of this address space,
    so it starts afresh at exec); ``getrusage``'s ``ru_maxrss`` would carry over the peak of the process
    that forked this one (a 16 GB test runner made a tiny run "grow" 16 GB).
    """

    def __init__(self) -> None:
        self.start = current_rss()

    @property
    def peak(self) -> int:
        # Never below the size at the start: the kernel's RSS counters are cached per CPU and can read a few
        # hundred KiB apart (VmHWM 132 KiB below VmRSS read a moment before, on this project's machine).
        return max(_status_bytes("VmHWM") or _maxrss(), self.start)

    @property
    def growth(self) -> int:
        return max(self.peak - self.start, 0)

    def to_dict(self) -> dict[str, int]:
        return {"rss_at_start_bytes": self.start, "max_rss_bytes": self.peak, "growth_bytes": self.growth}


def _status_bytes(field: str) -> Optional[int]:
    """A ``/proc/self/status`` size (Linux), else None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _maxrss() -> int:
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def current_rss() -> int:
    """Resident set size now (Linux: /proc; elsewhere the peak so far, the best portable bound)."""
    return _status_bytes("VmRSS") or _maxrss()
