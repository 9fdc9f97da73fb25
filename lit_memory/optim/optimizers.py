"""Optimizers' libraries: what lit_memory does with an optimizer, by the library its class comes from.

`library_of` gives the `Library` of an optimizer, its class or class path; a `Library` says whether its state is
quantised (`prepare`), where its kernels run and what its step runs inside, whether it steps FSDP2's local shards,
whether its step is compiled, the import paths an untrusted recipe may name (`IMPORTABLE`), the settings checks it
needs, and how a copy of it steps other tensors (`copy_for`). What an optimizer's state holds is measured in
`lit_memory.optim.optimizer_state`. Adding an optimizer: docs/memory.md, "Adding an optimizer".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, ContextManager, Iterator, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from lit_memory.optim import eightbit, lowbit
from lit_memory.settings import patched

# -- libraries ---------------------------------------------------------------------------------------


class Library:
    """How lit_memory treats the optimizers of one library. The base class is torch's optimizer protocol as any
    ``torch.optim.Optimizer`` subclass follows it: state in ``optimizer.state`` made by ``step``, kernels on torch's
    current stream, nothing compiled, one parameter at a time unless its group says ``foreach``."""

    name: str = "torch"
    packages: tuple[str, ...] = ()  # the dotted packages its classes live in
    importable: tuple[str, ...] = ()  # import paths an untrusted recipe may name (`lit_memory.config.trust.ALLOWLIST`)
    quantises_state = False  # low-bit state: ``embedding_optimizer_state`` decides the embeddings' (`prepare`)
    launch_stream = "current"  # where its kernels run: torch's current stream, or the device's legacy "default"
    steps_local_shards = False  # under FSDP2 it steps each rank's local shard, not the DTensor parameter
    compiles_step = False  # its step runs torch.compile'd code (a tracker's dispatch mode must step aside)
    positive: tuple[str, ...] = ()  # its own arguments that must be > 0 (`lit_memory.run.checks`; shared ranges there)

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
    """bitsandbytes' optimizers (`lit_memory.optim.eightbit`): 8-bit state with a per-parameter 32-bit override, kernels
    on the legacy default stream with a device sync after each parameter, no DTensor support (local shards under
    FSDP2, checkpointed by `lit_memory.optim.eightbit_shards`)."""

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
    """torchao's low-bit optimizers (`lit_memory.optim.lowbit`): quantised state for tensors of 4096 values or more in
    whole blocks, a per-parameter plain-state override of lit_memory's (`lit_memory.optim.lowbit.keep_plain_state`), a
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
        from torchao.optim import adam, subclass_4bit, subclass_8bit  # torchao: optional and heavy, only when probed

        for maps in (subclass_8bit, subclass_4bit):
            maps.get_qmap_signed(), maps.get_qmap_unsigned()

        def buffers(p, grad, step, exp_avg, *rest) -> None:
            name = type(exp_avg).__name__
            kind = name.removeprefix("OptimState") if name.startswith("OptimState") else None  # plain state: in place
            block = getattr(exp_avg, "block_size", float("inf"))
            held = torch.empty(torchao_kernel_bytes(kind, exp_avg.numel(), block), dtype=torch.uint8, device=p.device)
            del held

        with patched(adam, "single_param_adam", buffers), torch.compiler.set_stance("force_eager"):
            yield

    def notes(self, optimizer: Optimizer, device: str, temps: list[list[int]]) -> list[str]:
        if device != "cuda" or not temps:
            return []
        largest = max(sum(t) for t in temps)
        return [
            f"{type(optimizer).__name__}: its compiled step's buffers are inductor's CPU kernels' "
            f"({largest / 2**20:.0f} "
            "MiB for the largest parameter); CUDA kernels may hold less (to be measured on a GPU)"
        ]

    def simulation_note(self) -> Optional[str]:
        return (
            "torchao's update kernel is compiled, and compiled code cannot run on fake tensors: the simulation creates "
            "its state with torchao's own code and allocates the kernel's buffers as inductor's CPU code does "
            "(lit_memory.optim.optimizers.torchao_kernel_bytes) instead of running it"
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


def prepare(
    optimizer: Optimizer, unquantised: Sequence[torch.Tensor] = (), dtype: Optional[torch.dtype] = torch.float32
) -> None:
    """What the module does with an optimizer it built: ``unquantised`` parameters (the embedding matrices
    ``embedding_optimizer_state`` picks) keep unquantised state in ``dtype`` where the library quantises, and the
    library's own preparation."""
    library = library_of(optimizer)
    if unquantised and library.quantises_state:
        library.keep_unquantised(optimizer, list(unquantised), dtype)
    library.prepare(optimizer)


def compiles_its_step(optimizer: Optimizer) -> bool:
    """Whether the optimizer's step runs compiled code (a tracker's dispatch mode must step aside)."""
    return library_of(optimizer).compiles_step


def check_settings(optimizer: Any, precision: Any, on_gpu: bool) -> None:
    """The library's checks of a parsed ``model.optimizer`` (a class path and its init args, a namespace or a dict)
    against the run's precision and device."""
    library_of(str(_get(optimizer, "class_path") or "")).check_settings(optimizer, precision, on_gpu)


def _get(node: Any, key: str) -> Any:
    return node.get(key) if hasattr(node, "get") else getattr(node, key, None)


# -- a copy of the configured optimizer -----------------------------------------------------------------


def copy_for(
    optimizer: Optimizer, entries: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]]
) -> tuple[Optimizer, list[int]]:
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


def use_fused_kernels(optimizer: Optimizer, device: torch.device, amp_scaling: bool = True) -> list[int]:
    """Give the groups whose config leaves ``fused`` and ``foreach`` unset their library's fused kernel where
    lit_memory defaults to it (`Library.fuses_by_default`: torch's Adam and AdamW on CUDA and the CPU), when every
    parameter of the group is a plain tensor on ``device`` (DTensor shards keep torch's own default). Before the first
    step (the step counters are made then, on the device for a fused group). Returns the groups changed.

    Every group fused, the step takes GradScaler's scale and overflow flag into the kernel, as an optimizer built
    with ``fused=True`` does (torch sets ``_step_supports_amp_scaling`` in ``__init__`` only): the scaler then never
    reads the flag on the host (one ``.item()``, a device sync, per step). Not with ``amp_scaling=False``: gradients
    clipped after backward must be unscaled first, and Lightning refuses to clip for such an optimizer."""
    library = library_of(optimizer)
    changed = []
    for index, group in enumerate(optimizer.param_groups):
        plain = all(type(p) in (torch.Tensor, nn.Parameter) and p.device == device for p in group["params"])
        if plain and group["params"] and library.fuses_by_default(optimizer, group, device.type):
            group["fused"] = True
            changed.append(index)
    if changed:
        mark_amp_scaling(optimizer, amp_scaling)
    return changed


def mark_amp_scaling(optimizer: Optimizer, on: bool) -> bool:
    """Let GradScaler hand its scale and overflow flag to ``optimizer``'s step (torch's mark for an optimizer built
    ``fused=True``) where ``on`` and every group runs the fused kernel now; unmark it otherwise. Called again before
    each step: a group added later, or loaded from a checkpoint, may not be fused, and torch's other kernels refuse
    the scale ("Expected grad_scale and found_inf to be None"). Returns the mark."""
    marked = on and all(g.get("fused") for g in optimizer.param_groups if g["params"])
    if marked or getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer._step_supports_amp_scaling = marked
    return marked


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
