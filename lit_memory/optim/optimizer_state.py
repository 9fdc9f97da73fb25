"""What an optimizer's state holds, measured on meta tensors.

A copy of the optimizer (`lit_memory.optim.optimizers.copy_for`) steps once over ``meta`` stand-ins for one parameter of
each kind; its state is counted tensor by tensor and by dtype, and the step's other allocations alive together at
its peak are its temporaries (`profile`, `optimizer_tensors`). The same answers to scalar reads let the simulation
step an optimizer on fake tensors (`simulated_step`). docs/memory.md, "Optimizers".
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Optional, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass, transform_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from lit_memory.optim.optimizers import copy_for, library_of
from lit_memory.settings import patched

# -- what an optimizer keeps, measured ------------------------------------------------------------------


@dataclass
class OptimizerTensors:
    """What an optimizer allocates on the device: the state each parameter's first step creates, and the
    temporaries of one step, as lists alive together (one list per kernel call: a foreach call covers a
    group, a per-parameter loop one parameter)."""

    state: dict[int, list[int]]  # id(parameter) -> its state tensors on the device (bytes each)
    temps: list[list[int]]
    notes: list[str]
    by_dtype: dict[str, int] = field(default_factory=dict)  # state bytes on the device per dtype, all parameters

    @property
    def state_bytes(self) -> int:
        return sum(sum(s) for s in self.state.values())

    @property
    def temp_bytes(self) -> int:
        return max((sum(call) for call in self.temps), default=0)


@dataclass(frozen=True)
class Kept:
    """One parameter's state and step temporaries, as a probe measured them."""

    device: tuple[tuple[int, str], ...]  # state tensors on the parameter's device: (bytes, dtype)
    host: tuple[tuple[int, str], ...]  # state tensors kept on the host (torch's step counters on CUDA)
    temps: tuple[int, ...]  # allocations of its own step alive together at the step's peak, state excluded

    def on(self, device: str) -> list[tuple[int, str]]:
        """The state that counts for a run on ``device`` (on the CPU, the host's is the device's)."""
        return [*self.device, *self.host] if device == "cpu" else list(self.device)


@dataclass
class Profile:
    """What each trainable parameter of an optimizer keeps (by id), and what its parameters share (counted once)."""

    kept: dict[int, Kept]
    shared: list[tuple[int, str, bool]]  # (bytes, dtype, on the device) of tensors several parameters' state holds
    notes: list[str]


# The probe of each optimizer (a meta build's lives as long as the build) per target device.
_PROFILES: "weakref.WeakKeyDictionary[Optimizer, dict[str, Profile]]" = weakref.WeakKeyDictionary()


def optimizer_tensors(
    optimizer: Optimizer, device: str, stepped: Optional[list[list[torch.Tensor]]] = None
) -> OptimizerTensors:
    """The optimizer's state and step temporaries on ``device`` (``cuda``, ``cpu``), measured by `profile`.
    ``stepped``: the parameters one step updates, as the lists a batched call covers at once (a fused step's
    bucket, split by group); by default all of them, by group."""
    found = profile(optimizer, device)
    groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    params = [p for g in groups for p in g]
    state: dict[int, list[int]] = {}
    by_dtype: dict[str, int] = {}
    shared = [(b, dtype) for b, dtype, on_device in found.shared if on_device or device == "cpu"]
    for p in params:
        tensors = found.kept[id(p)].on(device) + (shared if not state else [])  # shared: with the first parameter
        state[id(p)] = [b for b, _ in tensors]
        for b, dtype in tensors:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + b
    library = library_of(optimizer)
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    temps: list[list[int]] = []
    for call in stepped if stepped is not None else groups:
        if not call:
            continue
        group = optimizer.param_groups[group_of[id(call[0])]]
        if library.stepped_in_place(group) or library.fuses_by_default(optimizer, group, device):
            continue
        if library.batches(optimizer, group, device):
            temps += [batched] if (batched := [t for p in call for t in found.kept[id(p)].temps]) else []
        else:
            temps += [list(found.kept[id(p)].temps) for p in call if found.kept[id(p)].temps]
    notes = [*found.notes, *library.notes(optimizer, device, temps)]
    return OptimizerTensors(state, temps, notes, by_dtype)


def unquantised_extra(
    optimizer: Optimizer, params: Sequence[torch.Tensor], device: str, dtype: Optional[torch.dtype] = torch.float32
) -> dict[int, int]:
    """The state bytes each of ``params`` (by id) would add if kept unquantised in ``dtype`` (`prepare`), measured:
    a copy of ``optimizer`` over them given the override, probed like the original."""
    library = library_of(optimizer)
    if not library.quantises_state or not params:
        return {id(p): 0 for p in params}
    wanted = {id(p) for p in params}
    entries = [
        (g, i, p, p)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) in wanted
    ]
    copy, _ = copy_for(optimizer, entries)
    library.keep_unquantised(copy, [p for *_, p in entries], dtype)
    quantised, unquantised = profile(optimizer, device).kept, profile(copy, device).kept
    return {
        pid: sum(b for b, _ in unquantised[pid].on(device)) - sum(b for b, _ in quantised[pid].on(device))
        for pid in wanted
    }


def profile(optimizer: Optimizer, device: str) -> Profile:
    """What each trainable parameter of ``optimizer`` keeps and allocates when stepped on ``device`` (cached per
    optimizer and device): its copy (`copy_for`) stepped once over two meta stand-ins for one parameter of each
    kind (`Library.override_key`), the group's implementation as ``device`` runs it (`Library.batches`)."""
    cached = _PROFILES.setdefault(optimizer, {})
    if device not in cached:
        collecting = gc.isenabled()
        gc.disable()  # the probe's few thousand objects would start collections over a whole model build's heap
        try:
            cached[device] = _probe(optimizer, device)
        except Exception as err:  # noqa: BLE001  an optimizer the probe cannot step: Adam's count, said so
            cached[device] = _assumed(optimizer, err)
        finally:
            if collecting:
                gc.enable()
    return cached[device]


def _assumed(optimizer: Optimizer, err: Exception) -> Profile:
    name = type(optimizer).__name__
    kept = {
        id(p): Kept(device=((_nbytes(p), _dtype(p)),) * 2, host=(), temps=(_nbytes(p),))
        for g in optimizer.param_groups for p in g["params"] if p.requires_grad
    }
    note = (
        f"{name}: its state could not be measured on meta tensors ({type(err).__name__}: "
        f"{' '.join(str(err).split())[:200]}); "
        "assumed two values per parameter, as Adam's"
    )
    return Profile(kept, [], [note])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _probe(optimizer: Optimizer, device: str) -> Profile:
    library = library_of(optimizer)
    kinds: dict[Any, tuple[int, int, torch.Tensor]] = {}  # kind -> its first parameter (group, index, parameter)
    kind_of: dict[int, Any] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.requires_grad:
                kind = (g, tuple(p.shape), p.dtype, library.override_key(optimizer, g, i, p))
                kinds.setdefault(kind, (g, i, p))
                kind_of[id(p)] = kind
    if not kinds:
        return Profile({}, [], [])
    # Two stand-ins per kind: what the two keep in common (bitsandbytes' quantile maps) is the optimizer's, once.
    stand_ins = {kind: (_stand_in(p), _stand_in(p)) for kind, (_, _, p) in kinds.items()}
    entries = [(g, i, p, s) for kind, (g, i, p) in kinds.items() for s in stand_ins[kind]]
    probe, source_groups = copy_for(optimizer, entries)
    library.probe_copy(probe, optimizer)
    for group, g in zip(probe.param_groups, source_groups):
        group.update(library.probe_group(group, device, library.batches(optimizer, optimizer.param_groups[g], device)))
    for kind, (_, _, p) in kinds.items():  # state a constructor made (Adagrad's), as meta tensors
        if optimizer.state.get(p):
            for s in stand_ins[kind]:
                probe.state[s] = {k: _on_meta(v, p.device) for k, v in optimizer.state[p].items()}
    grads = {id(s): torch.empty_like(s) for pair in stand_ins.values() for s in pair}
    measured: dict[Any, tuple[list[torch.Tensor], tuple[int, ...]]] = {}
    twins: dict[Any, set[int]] = {}  # the second stand-in's state storages
    recorder = _Recorder()
    with library.eager_step(probe), recorder:
        for kind, (first, second) in stand_ins.items():
            for s in (first, second):
                s.grad = grads[id(s)]
                mark = recorder.mark()
                probe.step()
                s.grad = None
                if s is first:
                    measured[kind] = (_state_tensors(probe.state[s]), recorder.peak_since(mark))
                else:
                    twins[kind] = {_storage_key(t) for t in _state_tensors(probe.state[s])}
    # What both stand-ins of a kind hold, or two kinds, is the optimizer's (bitsandbytes' quantile maps): once.
    holders: dict[int, int] = {}
    for tensors, _ in measured.values():
        for t in tensors:
            holders[_storage_key(t)] = holders.get(_storage_key(t), 0) + 1
    kept_by_kind: dict[Any, Kept] = {}
    shared: dict[int, tuple[int, str, bool]] = {}
    for kind, (tensors, temps) in measured.items():
        group = optimizer.param_groups[kinds[kind][0]]
        if library.fuses_by_default(optimizer, group, device):  # as the run steps it: fused, counters on the device
            group = {**group, "fused": True}
        own: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
        for t in tensors:
            key, entry, on_device = (
                _storage_key(t),
                (t.untyped_storage().nbytes(), _dtype(t)),
                library.on_device(group, t),
            )
            if key in twins[kind] or holders[key] > 1:
                shared.setdefault(key, (*entry, on_device))
            else:
                own[on_device].append(entry)
        kept_by_kind[kind] = Kept(tuple(own[True]), tuple(own[False]), temps)
    return Profile({pid: kept_by_kind[kind] for pid, kind in kind_of.items()}, list(shared.values()), [])


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _stand_in(p: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta"), requires_grad=True)


def _on_meta(value: Any, device: torch.device) -> Any:
    """A state value made before any step, for a probe: tensors on the parameter's device as meta tensors of their
    shape and dtype (tensor subclasses by their inner tensors), others (host counters) copied."""
    if not isinstance(value, torch.Tensor):
        return value
    if is_traceable_wrapper_subclass(value):
        return transform_subclass(value, lambda _, inner: _on_meta(inner, device))
    if value.device == device:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value.clone()


def _state_tensors(state: Mapping[str, Any]) -> list[torch.Tensor]:
    """The plain tensors a parameter's state holds (inside tensor subclasses, lists and dicts), each storage once."""
    found: dict[int, torch.Tensor] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if is_traceable_wrapper_subclass(value):
                names, _ = value.__tensor_flatten__()
                for name in names:
                    visit(getattr(value, name))
            else:
                found.setdefault(_storage_key(value), value)
        elif isinstance(value, Mapping):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    visit(state)
    return list(found.values())


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _neutral(t: torch.Tensor) -> Union[bool, int, float]:
    """A value for a scalar read whose value the memory never depends on."""
    if t.dtype == torch.bool:
        return True
    return 1.0 if t.is_floating_point() else 1


class _Recorder(TorchDispatchMode):
    """Every allocation a probe's step makes (a storage first seen as an op's output; one first seen as an input
    existed before), and when it is freed; scalar reads of tensors without values answered (`_neutral`)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int, int]] = []  # ("+", key, bytes) | ("-", key, 0)
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            try:
                return func(*args, **kwargs)
            except Exception:  # noqa: BLE001  meta or fake: no value to read
                return _neutral(args[0])
        for t in _tensors((args, kwargs)):
            self._existed(t)
        out = func(*args, **kwargs)
        for t in _tensors(out):
            self._made(t)
        return out

    def _existed(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage not in self.seen:
            self.seen[storage] = None

    def _made(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self.seen:
            return
        key = len(self.events)
        self.seen[storage] = key
        self.events.append(("+", key, storage.nbytes()))
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._freed(key))

    def _freed(self, key: int) -> None:
        self.events.append(("-", key, 0))
        self._refs.pop(key, None)

    def mark(self) -> int:
        return len(self.events)

    def peak_since(self, mark: int) -> tuple[int, ...]:
        """The allocations since ``mark`` alive together at their peak, leaving out what is still alive (the state
        the step made, or anything else the optimizer keeps: state by another name)."""
        kept = {key for key, ref in self._refs.items() if ref() is not None}
        live: dict[int, int] = {}
        peak: dict[int, int] = {}
        for sign, key, size in self.events[mark:]:
            if key in kept:
                continue
            if sign == "+":
                live[key] = size
                if sum(live.values()) > sum(peak.values()):
                    peak = dict(live)
            else:
                live.pop(key, None)
        return tuple(peak.values())


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


# -- stepping fake tensors (the simulation) ---------------------------------------------------------------


@contextlib.contextmanager
def answering_scalars(optimizer: Optimizer) -> Iterator[None]:
    """Inside the steps of ``optimizer``'s class (its fused copies' too) while this is entered: scalar reads that
    fake tensors cannot answer (Adagrad's step counter made before the fake mode, Adafactor's comparison of a
    tensor's RMS with a number) get a neutral number, and a step that computes a shape from the data raises
    `StepNotSimulated`, not the data-dependence the model's forward may have."""
    cls = type(optimizer)
    step = cls.step

    @functools.wraps(step)
    def answered(self, *args, **kwargs):
        with _AnsweringScalars(cls.__name__):
            return step(self, *args, **kwargs)

    with patched(cls, "step", answered):
        yield


class StepNotSimulated(RuntimeError):
    """An optimizer's step computes a shape from the data, which fake tensors cannot give."""


class _AnsweringScalars(TorchDispatchMode):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer = optimizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException:
            if func is torch.ops.aten._local_scalar_dense.default:
                return _neutral(args[0])
            raise StepNotSimulated(f"{self.optimizer}'s step reads a value from the data ({func})") from None
        except DynamicOutputShapeException:
            raise StepNotSimulated(f"{self.optimizer}'s step computes a shape from the data ({func})") from None


def simulated_step(optimizer: Optimizer) -> ContextManager:
    """What an optimizer's steps on fake tensors run inside: the library's stand-ins for kernels that cannot run on
    them, and scalar reads answered."""
    stack = contextlib.ExitStack()
    stack.enter_context(library_of(optimizer).eager_step(optimizer))
    stack.enter_context(answering_scalars(optimizer))
    return stack
