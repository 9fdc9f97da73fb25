"""Optimizers: everything lit_memory knows about one, in one place.

An optimizer is known by two things.

**Its library** (`library_of`): the package its class comes from, or the first of its base classes that does (a
subclass of bitsandbytes' ``Optimizer8bit`` is bitsandbytes'); a class path names it by its package. A `Library`
says what the rest of lit_memory needs: whether its state is quantised (``embedding_optimizer_state`` then applies:
`prepare`), the stream its kernels run on and what its step does around them (`lit_memory.fused`), whether it steps
FSDP2's local shards (`lit_memory.eightbit_shards`), whether its step is compiled (the tracker pauses), the import
paths an untrusted recipe may name (`IMPORTABLE`, for `lit_memory.trust`), the settings checks it needs (its own
arguments' ranges: `Library.positive`; anything else: `Library.check_settings`), and how a
copy of it steps other tensors (`copy_for`: the fused step's buckets, the probes below).

**What it keeps** (`optimizer_tensors`), measured, not assumed by its name: a copy of the optimizer is stepped once
over stand-ins on the ``meta`` device (nothing allocated, any size) for one parameter of each kind (shape, dtype,
group, per-parameter setting such as bitsandbytes' 32-bit override for embeddings), and what its state then holds is
counted, tensor by tensor and by dtype: Adam's two moments, Adagrad's and RMSprop's one, SGD's momentum buffer or
none, Adafactor's factored statistics, bitsandbytes' 8-bit codes with their block-wise absmax and quantile maps,
torchao's 4-bit and 8-bit codes with their scales and lookup tables, step counters (on the host, where torch keeps
them, unless fused or capturable). The same step is watched for its temporaries: each allocation that is not state,
alive together at the step's peak, one parameter at a time, or a whole group at once where the implementation the
target device runs (torch's foreach kernels on CUDA) batches the group.

What such a step cannot show is added here, and only here: kernels that cannot run on meta or fake tensors are
stood in for by what they allocate (torchao's compiled update: `torchao_kernel_bytes`); torch's fused kernels and
bitsandbytes' CUDA kernels update in place (no temporaries); scalar reads (``.item()``, a comparison with a tensor)
are answered with a neutral number, since values never change what is allocated (`answering_scalars`).

Adding an optimizer: a class of a library listed in `LIBRARIES` (or any torch-style ``torch.optim.Optimizer``
subclass) needs nothing: name it in ``model.optimizer``. A new library with its own behaviour is one `Library`
subclass added to `LIBRARIES` (docs/memory.md, "Adding an optimizer").
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Optional, Union
from unittest import mock

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.weak import WeakIdKeyDictionary

from lit_memory import eightbit, lowbit

# -- libraries ---------------------------------------------------------------------------------------


class Library:
    """How lit_memory treats the optimizers of one library. The base class is torch's optimizer protocol as any
    ``torch.optim.Optimizer`` subclass follows it: state in ``optimizer.state`` made by ``step``, kernels on torch's
    current stream, nothing compiled, one parameter at a time unless its group says ``foreach``."""

    name: str = "torch"
    packages: tuple[str, ...] = ()  # the dotted packages its classes live in
    importable: tuple[str, ...] = ()  # import paths an untrusted recipe may name (`lit_memory.trust.ALLOWLIST`)
    quantises_state = False  # low-bit state: ``embedding_optimizer_state`` decides the embeddings' (`prepare`)
    launch_stream = "current"  # where its kernels run: torch's current stream, or the device's legacy "default"
    steps_local_shards = False  # under FSDP2 it steps each rank's local shard, not the DTensor parameter
    compiles_step = False  # its step runs torch.compile'd code (a tracker's dispatch mode must step aside)
    positive: tuple[str, ...] = ()  # its own arguments that must be > 0 (`lit_memory.checks`; shared ranges there)

    def __init__(self, name: Optional[str] = None) -> None:
        if name is not None:
            self.name = name

    def __repr__(self) -> str:
        return f"<optimizer library {self.name}>"

    def owns(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in self.packages)

    # -- what the runtime asks ---------------------------------------------------------------------

    def keep_unquantised(self, optimizer: Optimizer, params: list[torch.Tensor], dtype: Optional[torch.dtype]) -> None:
        """Keep these parameters' state unquantised (in ``dtype``; None: the parameter's). Nothing to do for a
        library whose state is not quantised."""

    def prepare(self, optimizer: Optimizer) -> None:
        """Whatever the optimizer needs once it is built, before it steps."""

    def step_context(self, optimizer: Optimizer, params: list[torch.Tensor]) -> Optional[ContextManager]:
        """What a step runs inside, a fused bucket's or the whole unfused step's (None: nothing)."""
        return None

    def fuses_by_default(self, optimizer: Optimizer, group: Mapping[str, Any], device: str) -> bool:
        """Whether lit_memory gives this group its library's fused kernel on ``device`` (`use_fused_kernels`)."""
        return False

    def carry_settings(
        self,
        copy: Optimizer,
        original: Optimizer,
        positions: list[list[tuple[int, int]]],
        params: list[list[torch.Tensor]],
        stepped: list[list[torch.Tensor]],
    ) -> None:
        """Per-parameter settings the original keeps outside its groups, given to a copy (`copy_for`) that steps
        ``stepped[g][i]`` in place of ``params[g][i]``, which sits at ``positions[g][i]`` (group, index) in the
        original."""

    def check_settings(self, optimizer: Any, precision: Any, on_gpu: bool) -> None:
        """One `lit_memory.errors.UserError` line for settings that cannot do what they say, before anything is
        built. ``optimizer``: the parsed ``model.optimizer`` (a class path and its init args)."""

    def stochastic_rounding(self, init_args: Mapping[str, Any]) -> bool:
        """Whether the optimizer rounds 16-bit weights stochastically (its updates below half a unit survive)."""
        return False

    # -- what the memory model asks ------------------------------------------------------------------

    def batches(self, optimizer: Optimizer, group: Mapping[str, Any], device: str) -> bool:
        """Whether one kernel call covers the whole group (torch's foreach) on ``device``, as the step runs there."""
        return bool(group.get("foreach"))

    def override_key(self, optimizer: Optimizer, group: int, index: int, param: torch.Tensor) -> Any:
        """What, besides its shape, dtype and group, makes this parameter's state another kind (a per-parameter
        override): parameters that differ here are probed apart."""
        return None

    def probe_group(self, group: Mapping[str, Any], device: str, batched: bool) -> dict[str, Any]:
        """Settings a probe copy's group steps with on the meta device (``batched``: as one call)."""
        return {"foreach": True} if batched and "foreach" in group else {}

    def probe_copy(self, copy: Optimizer, original: Optimizer) -> None:
        """Make a probe copy step on the meta device without touching what it shares with the original."""

    def on_device(self, group: Mapping[str, Any], tensor: torch.Tensor) -> bool:
        """Whether a state tensor the meta probe made lives on the parameter's device: what it made there. Tensors
        made without a device (torch's step counters) stay on the host."""
        return tensor.device.type == "meta"

    def stepped_in_place(self, group: Mapping[str, Any]) -> bool:
        """Whether this group's step runs kernels that make no temporaries the probe could see (fused kernels)."""
        return False

    @contextlib.contextmanager
    def eager_step(self, optimizer: Optimizer) -> Iterator[None]:
        """Kernels that cannot run on meta or fake tensors (compiled ones) stood in for by what they allocate."""
        yield

    def notes(self, optimizer: Optimizer, device: str, temps: list[list[int]]) -> list[str]:
        return []

    def simulation_note(self) -> Optional[str]:
        """What the simulation runs instead of the library's own code, if anything."""
        return None


class Torch(Library):
    """``torch.optim``: foreach kernels by default on CUDA, fused or capturable steps keep their step counters on
    the device, fused kernels update in place."""

    name = "torch"
    packages = ("torch",)
    importable = ("torch.optim",)

    # One kernel over a whole group, no per-parameter host work (foreach AdamW reads each step counter with
    # .item(): 786 host reads per BERT-large step on CUDA; the CPU's default is a Python loop over the parameters),
    # what the HF Trainer's default ``adamw_torch_fused`` runs on both.
    FUSED_BY_DEFAULT = ("torch.optim.adam.Adam", "torch.optim.adamw.AdamW")
    FUSED_DEVICES = ("cuda", "cpu")

    def fuses_by_default(self, optimizer: Optimizer, group: Mapping[str, Any], device: str) -> bool:
        kind = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        return (
            device in self.FUSED_DEVICES and kind in self.FUSED_BY_DEFAULT and group.get("fused") is None
            and group.get("foreach") is None and not group.get("differentiable") and not group.get("capturable")
        )

    def batches(self, optimizer: Optimizer, group: Mapping[str, Any], device: str) -> bool:
        foreach = group.get("foreach")
        if foreach is None:  # torch's default (`_default_to_fused_or_foreach`): foreach on CUDA, a loop on CPU
            return (
                device == "cuda"
                and not group.get("fused")
                and not self.fuses_by_default(optimizer, group, device)
                and not group.get("differentiable")
                and type(optimizer).__module__.startswith("torch.optim")
            )
        return bool(foreach)

    def probe_group(self, group: Mapping[str, Any], device: str, batched: bool) -> dict[str, Any]:
        # Fused and capturable steps refuse the meta device; their state is the same, their counters on the device.
        off = {key: False for key in ("fused", "capturable") if group.get(key)}
        return {**super().probe_group(group, device, batched), **off}

    def on_device(self, group: Mapping[str, Any], tensor: torch.Tensor) -> bool:
        return bool(group.get("fused") or group.get("capturable")) or super().on_device(group, tensor)

    @contextlib.contextmanager
    def eager_step(self, optimizer: Optimizer) -> Iterator[None]:
        # Fused Adam/AdamW on fake tensors would run the kernel's functional form, which allocates what the CUDA
        # kernel updates in place: stood in for by nothing (the state is made by torch's own code before it).
        if not any(g.get("fused") for g in optimizer.param_groups):
            yield
            return
        kernels = torch._fused_adam_, torch._fused_adamw_
        torch._fused_adam_ = torch._fused_adamw_ = _updates_in_place
        try:
            yield
        finally:
            torch._fused_adam_, torch._fused_adamw_ = kernels

    def stepped_in_place(self, group: Mapping[str, Any]) -> bool:
        return bool(group.get("fused"))


def _updates_in_place(*tensors: Any, **settings: Any) -> None:
    """torch's fused Adam/AdamW kernel in a simulated step: it updates its tensors in place and allocates nothing."""


class Transformers(Library):
    """transformers' optimizers (Adafactor): torch-style, one parameter at a time."""

    name = "transformers"
    packages = ("transformers",)
    importable = ("transformers.optimization", "transformers.Adafactor")


class BitsAndBytes(Library):
    """bitsandbytes' optimizers (`lit_memory.eightbit`): 8-bit state with a per-parameter 32-bit override, kernels
    on the legacy default stream with a device sync after each parameter, no DTensor support (local shards under
    FSDP2, checkpointed by `lit_memory.eightbit_shards`)."""

    name = "bitsandbytes"
    packages = ("bitsandbytes",)
    importable = ("bitsandbytes.optim",)
    quantises_state = True
    launch_stream = "default"
    steps_local_shards = True

    def keep_unquantised(self, optimizer: Optimizer, params: list[torch.Tensor], dtype: Optional[torch.dtype]) -> None:
        eightbit.keep_32bit(optimizer, params)  # its unquantised state is fp32 whatever ``dtype`` asks

    def step_context(self, optimizer: Optimizer, params: list[torch.Tensor]) -> Optional[ContextManager]:
        return eightbit.one_sync_per_step(optimizer, params)

    def carry_settings(self, copy, original, positions, params, stepped) -> None:
        copy.mng = eightbit.overrides_for_copy(original.mng, positions, params, original.args.min_8bit_size)

    def override_key(self, optimizer: Optimizer, group: int, index: int, param: torch.Tensor) -> Any:
        config = eightbit.config_of(optimizer, group, index)
        return tuple(sorted((k, repr(v)) for k, v in config.items()))

    def probe_copy(self, copy: Optimizer, original: Optimizer) -> None:
        # Paged state lives in CUDA's unified memory (as many bytes); the meta device has none.
        copy.is_paged = False
        copy.name2qmap = dict(original.name2qmap)  # its quantile maps move to the parameters' device at a first step


class TorchAO(Library):
    """torchao's low-bit optimizers (`lit_memory.lowbit`): quantised state for tensors of 4096 values or more in
    whole blocks, a per-parameter plain-state override of lit_memory's (`lit_memory.lowbit.keep_plain_state`), a
    ``torch.compile``'d update per parameter, DTensor-aware state."""

    name = "torchao"
    packages = ("torchao",)
    importable = ("torchao.optim",)
    quantises_state = True
    compiles_step = True
    positive = ("block_size",)  # refused only at the first step, deep in its kernel

    def keep_unquantised(self, optimizer: Optimizer, params: list[torch.Tensor], dtype: Optional[torch.dtype]) -> None:
        lowbit.keep_plain_state(optimizer, params, dtype)

    def prepare(self, optimizer: Optimizer) -> None:
        lowbit.compile_steps_without_the_dtensor_cache_collision(optimizer)

    def carry_settings(self, copy, original, positions, params, stepped) -> None:
        plain = getattr(original, "plain_state", {})
        for group_params, group_stepped in zip(params, stepped):
            for param, tensor in zip(group_params, group_stepped):
                if tensor is not param and id(param) in plain:
                    lowbit.keep_plain_state(copy, [tensor], plain[id(param)])

    def check_settings(self, optimizer: Any, precision: Any, on_gpu: bool) -> None:
        lowbit.check_settings(optimizer, precision, on_gpu)

    def stochastic_rounding(self, init_args: Mapping[str, Any]) -> bool:
        return bool(init_args.get("bf16_stochastic_round"))

    def override_key(self, optimizer: Optimizer, group: int, index: int, param: torch.Tensor) -> Any:
        return repr(getattr(optimizer, "plain_state", {}).get(id(param), "quantised"))

    @contextlib.contextmanager
    def eager_step(self, optimizer: Optimizer) -> Iterator[None]:
        """torchao's Python code as it is (state creation, the step counter), its compiled per-parameter kernel
        (`torchao.optim.adam.single_param_adam`, private) replaced by the buffers that kernel allocates
        (`torchao_kernel_bytes`), run eagerly. Its quantisation maps are built from Python lists (cached) first:
        fake tensors cannot give them."""
        from torchao.optim import adam, subclass_4bit, subclass_8bit

        for maps in (subclass_8bit, subclass_4bit):
            maps.get_qmap_signed(), maps.get_qmap_unsigned()

        def buffers(p, grad, step, exp_avg, *rest) -> None:
            name = type(exp_avg).__name__
            kind = name.removeprefix("OptimState") if name.startswith("OptimState") else None  # plain state: in place
            block = getattr(exp_avg, "block_size", float("inf"))
            held = torch.empty(torchao_kernel_bytes(kind, exp_avg.numel(), block), dtype=torch.uint8, device=p.device)
            del held

        with mock.patch.object(adam, "single_param_adam", buffers), torch.compiler.set_stance("force_eager"):
            yield

    def notes(self, optimizer: Optimizer, device: str, temps: list[list[int]]) -> list[str]:
        if device != "cuda" or not temps:
            return []
        largest = max(sum(t) for t in temps)
        return [
            f"{type(optimizer).__name__}: its compiled step's buffers are inductor's CPU kernels' ({largest / 2**20:.0f} "
            "MiB for the largest parameter); CUDA kernels may hold less (to be measured on a GPU)"
        ]

    def simulation_note(self) -> Optional[str]:
        return (
            "torchao's update kernel is compiled, and compiled code cannot run on fake tensors: the simulation creates "
            "its state with torchao's own code and allocates the kernel's buffers as inductor's CPU code does "
            "(lit_memory.optimizers.torchao_kernel_bytes) instead of running it"
        )


# The libraries lit_memory knows, first match wins; anything else is torch-style (`Library`).
LIBRARIES: tuple[Library, ...] = (BitsAndBytes(), TorchAO(), Transformers(), Torch())
# Import paths of optimizers an untrusted recipe may name.
IMPORTABLE: tuple[str, ...] = tuple(path for library in LIBRARIES for path in library.importable)


def library_of(optimizer: Union[Optimizer, type, str]) -> Library:
    """The library of an optimizer, its class, or its class path: the first of the class and its bases (in method
    resolution order) defined in a package of `LIBRARIES`; a class path by its own package. Anything else is a
    torch-style optimizer of its own package."""
    if isinstance(optimizer, str):
        modules = [optimizer]
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        modules = [c.__module__ for c in cls.__mro__]
    for module in modules:
        for library in LIBRARIES:
            if library.owns(module):
                return library
    return Library(modules[0].split(".", 1)[0])


def prepare(optimizer: Optimizer, unquantised: Sequence[torch.Tensor] = (), dtype: Optional[torch.dtype] = torch.float32) -> None:
    """What the module does with an optimizer it built: ``unquantised`` parameters (the embedding matrices
    ``embedding_optimizer_state`` picks) keep unquantised state in ``dtype`` where the library quantises, and the
    library's own preparation."""
    library = library_of(optimizer)
    if unquantised and library.quantises_state:
        library.keep_unquantised(optimizer, list(unquantised), dtype)
    library.prepare(optimizer)


def compiles_its_step(optimizer: Optimizer) -> bool:
    """For `lit_memory.memory.measure.tracker.Tracker`: whether the optimizer's step runs compiled code."""
    return library_of(optimizer).compiles_step


def check_settings(optimizer: Any, precision: Any, on_gpu: bool) -> None:
    """The library's checks of a parsed ``model.optimizer`` (a class path and its init args, a namespace or a dict)
    against the run's precision and device."""
    library_of(str(_get(optimizer, "class_path") or "")).check_settings(optimizer, precision, on_gpu)


def _get(node: Any, key: str) -> Any:
    return node.get(key) if hasattr(node, "get") else getattr(node, key, None)


# -- a copy of the configured optimizer -----------------------------------------------------------------


def copy_for(optimizer: Optimizer, entries: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]]) -> tuple[Optimizer, list[int]]:
    """A copy of ``optimizer`` that steps, for each entry ``(group, index, parameter, tensor)``, ``tensor`` where the
    original steps ``parameter`` (its ``index``-th of group ``group``): the parameter itself, a local shard, a probe's
    stand-in. One group per original group the entries come from (returned: their indices), with its settings.

    Constructors cannot rebuild an optimizer in general (bitsandbytes keeps settings such as ``min_8bit_size`` in
    ``args``, and AdamW8bit refuses its own ``optim_bits`` back), so the copy keeps every attribute of the original
    and re-initialises only torch's own bookkeeping (hooks, state, groups); the library gives it the per-parameter
    settings kept outside the groups (`Library.carry_settings`)."""
    members: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for group, index, param, tensor in entries:
        members.setdefault(group, []).append((index, param, tensor))
    copy = object.__new__(type(optimizer))
    # An LR scheduler wraps the original's bound `step` on the instance: that one stays behind.
    vars(copy).update((k, v) for k, v in vars(optimizer).items() if k not in ("step", "_opt_called"))
    groups = [{**optimizer.param_groups[g], "params": [t for _, _, t in members[g]]} for g in members]
    Optimizer.__init__(copy, groups, optimizer.defaults)
    library_of(optimizer).carry_settings(
        copy,
        optimizer,
        [[(g, i) for i, _, _ in members[g]] for g in members],
        [[p for _, p, _ in members[g]] for g in members],
        [[t for _, _, t in members[g]] for g in members],
    )
    return copy, list(members)


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
        (g, i, p, p) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"]) if id(p) in wanted
    ]
    copy, _ = copy_for(optimizer, entries)
    library.keep_unquantised(copy, [p for *_, p in entries], dtype)
    quantised, unquantised = profile(optimizer, device).kept, profile(copy, device).kept
    return {pid: sum(b for b, _ in unquantised[pid].on(device)) - sum(b for b, _ in quantised[pid].on(device)) for pid in wanted}


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
        f"{name}: its state could not be measured on meta tensors ({type(err).__name__}: {' '.join(str(err).split())[:200]}); "
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
            key, entry, on_device = _storage_key(t), (t.untyped_storage().nbytes(), _dtype(t)), library.on_device(group, t)
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
        from torch.utils._python_dispatch import transform_subclass

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
    from torch.utils._pytree import tree_leaves

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

    with mock.patch.object(cls, "step", answered):
        yield


class StepNotSimulated(RuntimeError):
    """An optimizer's step computes a shape from the data, which fake tensors cannot give."""


class _AnsweringScalars(TorchDispatchMode):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer = optimizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException:
            if func is torch.ops.aten._local_scalar_dense.default:
                return _neutral(args[0])
            raise StepNotSimulated(f"{self.optimizer}'s step reads a value from the data ({func})") from None
        except DynamicOutputShapeException:
            raise StepNotSimulated(f"{self.optimizer}'s step computes a shape from the data ({func})") from None


def use_fused_kernels(optimizer: Optimizer, device: torch.device) -> list[int]:
    """Give the groups whose config leaves ``fused`` and ``foreach`` unset their library's fused kernel where
    lit_memory defaults to it (`Library.fuses_by_default`: torch's Adam and AdamW on CUDA and the CPU), when every parameter of
    the group is a plain tensor on ``device`` (DTensor shards keep torch's own default). Before the first step
    (the step counters are made then, on the device for a fused group). Returns the groups changed."""
    library = library_of(optimizer)
    changed = []
    for index, group in enumerate(optimizer.param_groups):
        plain = all(type(p) in (torch.Tensor, nn.Parameter) and p.device == device for p in group["params"])
        if plain and group["params"] and library.fuses_by_default(optimizer, group, device.type):
            group["fused"] = True
            changed.append(index)
    return changed


def use_device_defaults(optimizer: Optimizer, device: str) -> None:
    """Make ``optimizer`` run, on the CPU, the implementation ``device`` would: the fused kernel lit_memory gives
    torch's Adam/AdamW on CUDA (no temporaries), torch's foreach kernels elsewhere on CUDA where the config leaves
    ``foreach`` unset (a whole group's temporaries at once)."""
    library = library_of(optimizer)
    for group in optimizer.param_groups:
        if library.fuses_by_default(optimizer, group, device):  # as `use_fused_kernels` gives the run
            group["fused"] = True
        elif group.get("foreach", False) is None and library.batches(optimizer, group, device):
            group["foreach"] = True


def simulated_step(optimizer: Optimizer) -> ContextManager:
    """What an optimizer's steps on fake tensors run inside: the library's stand-ins for kernels that cannot run on
    them, and scalar reads answered."""
    stack = contextlib.ExitStack()
    stack.enter_context(library_of(optimizer).eager_step(optimizer))
    stack.enter_context(answering_scalars(optimizer))
    return stack


# -- torchao's compiled kernel, stood in for ------------------------------------------------------------


def torchao_kernel_bytes(kind: Optional[str], numel: int, block: float) -> int:
    """Buffers torchao's compiled update kernel holds for one parameter with ``kind`` state (``8bit``, ``4bit``,
    ``Fp8``; None: plain), as inductor's CPU code allocates them (torch 2.13, read with ``TORCH_LOGS=output_code``):
    8-bit keeps each moment in fp32 between the block scales' reduction and the quantisation (4 B per value each),
    4-bit also unpacks its codes (1 B) and keeps int64 indices (8 B), FP8 recomputes and keeps only the new scales;
    plain state is updated in place. CUDA's Triton kernels may fuse more: an upper bound there, to be measured on a
    GPU."""
    if kind is None or not math.isfinite(block):
        return 0
    scales = 4 * math.ceil(numel / block)
    per_moment = {"8bit": 4 * numel, "4bit": (1 + 4 + 8) * numel, "Fp8": 0}[kind] + scales
    return 2 * per_moment

