"""Buckets: the ``bucket`` setting (`parse_bucket`), which parameters share a bucket (`group_parameters`), and a
`Bucket`, one optimizer call over its parameters, made of the configured optimizer by `copy_bucket`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence

import torch
from torch.optim import Optimizer

from lit_memory.errors import UserError
from lit_memory.fused.shards import ShardState, local_part, local_shard
from lit_memory.optim.optimizers import copy_for, library_of

DEFAULT_BUCKET = "layer"  # the setting as written (strategies' signatures and YAML show it as text)
_MIB = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*MiB\s*")


@dataclass(frozen=True)
class Bucketing:
    """The ``bucket`` setting, parsed (`parse_bucket`): ``layer``, ``param``, or ``size`` (``size_bytes``
    of gradients at most per bucket). ``str()`` gives the setting back as written."""

    kind: Literal["layer", "param", "size"]
    size_bytes: int = 0

    def __str__(self) -> str:
        return f"{self.size_bytes / 2**20:g} MiB" if self.kind == "size" else self.kind


def parse_bucket(setting: Any) -> Bucketing:
    """``layer``, ``param`` or ``"N MiB"`` as a `Bucketing` (one given is returned as it is); anything
    else is one `UserError` line."""
    if isinstance(setting, Bucketing):
        return setting
    if setting in ("layer", "param"):
        return Bucketing(setting)
    match = _MIB.fullmatch(setting) if isinstance(setting, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise UserError(f"bucket must be layer, param or a size such as '25 MiB', got {setting!r}")
    return Bucketing("size", int(float(match.group(1)) * 2**20))


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients one optimizer call applies, once all of them have arrived.

    ``optimizer`` steps exactly these parameters (for each ``params[i]``, ``shards[i]`` where given:
    the local shard it steps instead). With a ``source`` (the optimizer the user configured, of which
    ``optimizer`` is a copy), each of ``optimizer``'s groups takes the hyper-parameters of the
    source's group ``source_groups[i]`` before every step, and the state lives in the source's.
    Without one, ``optimizer`` is used as it is (an optimizer the user made for these parameters).
    """

    optimizer: Optimizer
    params: list[torch.Tensor]
    source: Optional[Optimizer] = None
    source_groups: Sequence[int] = ()
    shards: Optional[list[torch.Tensor]] = None
    arrived: int = field(default=0, init=False)  # gradients accumulated in this backward so far
    streams: set = field(default_factory=set, init=False)  # where they were made (`BucketHooks` with `DeviceStreams`)

    def __post_init__(self) -> None:
        self._shard_state = ShardState(dict(zip(self.shards, self.params))) if self.shards else None
        library = library_of(self.optimizer)
        self.launch = library.launch_stream
        self._step_context = library.step_context  # what a step runs inside (bitsandbytes: one device sync)
        # FSDP2 shards dim 0 as torch.chunk does: with fewer rows than ranks the last ranks hold none. bitsandbytes'
        # CUDA kernels reject a 0-element launch (and exit the process), so no optimizer is handed one.
        self._empty = [p for p in self.params if local_part(p).numel() == 0]

    def step(self, clip: Optional[Callable[[list[torch.Tensor]], None]] = None) -> None:
        """Apply the gradients the bucket's parameters hold, then free them. ``clip`` changes the
        gradients in place first (each a local tensor: a shard's under FSDP)."""
        if clip is not None:
            clip([local_part(p.grad) for p in self.params if p.grad is not None])
        if self.source is not None:
            self._sync()
        for param in self._empty:
            param.grad = None
        if self.shards:
            for shard, param in zip(self.shards, self.params):
                shard.grad = None if param.grad is None else param.grad.to_local()
        context = self._step_context(self.optimizer, self.params)
        if context is not None:
            with context:
                self.optimizer.step()
        else:
            self.optimizer.step()
        for param in self.params:
            param.grad = None
        if self.shards:
            for shard in self.shards:
                shard.grad = None

    def _sync(self) -> None:
        # Re-read every step: LR schedulers write the source's groups, load_state_dict replaces its state.
        state = self.source.state
        if self._shard_state is None:
            self.optimizer.state = state
        else:
            self._shard_state.state = state
            self.optimizer.state = self._shard_state
        groups = self.source.param_groups
        for group, index in zip(self.optimizer.param_groups, self.source_groups):
            group.update((k, v) for k, v in groups[index].items() if k != "params")


# -- which parameters share a bucket ---------------------------------------------------------------


def group_parameters(
    params: list[torch.Tensor], units: Sequence[Sequence[torch.Tensor]], setting: Any
) -> list[list[torch.Tensor]]:
    """``params`` split into buckets by ``setting`` (`parse_bucket`), in the order backward
    produces their gradients: the units' parameter order reversed (parameters in no unit last).
    ``layer``: a bucket per unit; ``param``: per parameter; a size: consecutive parameters up to it."""
    bucketing = parse_bucket(setting)
    wanted = {id(p) for p in params}
    ordered = [[p for p in reversed(unit) if id(p) in wanted] for unit in reversed(units)]
    ordered = [unit for unit in ordered if unit]
    seen = {id(p) for unit in ordered for p in unit}
    ordered += [[p] for p in params if id(p) not in seen]
    if bucketing.kind == "layer":
        return ordered
    order = [p for unit in ordered for p in unit]
    if bucketing.kind == "param":
        return [[p] for p in order]
    sized: list[list[torch.Tensor]] = []
    size = 0
    for p in order:
        nbytes = gradient_bytes(p)
        if sized and size + nbytes <= bucketing.size_bytes:
            sized[-1].append(p)
            size += nbytes
        else:
            sized.append([p])
            size = nbytes
    return sized


def gradient_bytes(param: torch.Tensor) -> int:
    """Bytes of the gradient this process holds for ``param`` (its local shard under FSDP2)."""
    from torch.distributed.tensor import DTensor  # deferred: ~0.6 s to import, and only sharded runs hold DTensors

    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


# -- a bucket of the configured optimizer ----------------------------------------------------------


def copy_bucket(optimizer: Optimizer, params: list[torch.Tensor]) -> Bucket:
    """A bucket stepping ``params`` (some of ``optimizer``'s) with a copy of ``optimizer`` that
    optimises exactly them, as the original would: one group per original group they come from
    (`lit_memory.optim.optimizers.copy_for`).
    """
    wanted = {id(p) for p in params}
    entries = [
        (g, i, p)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) in wanted
    ]
    shards = [local_shard(optimizer, p) for _, _, p in entries]
    bucket_optimizer, source_groups = copy_for(
        optimizer, [(g, i, p, p if s is None else s) for (g, i, p), s in zip(entries, shards)]
    )
    has_shards = any(s is not None for s in shards)
    return Bucket(
        bucket_optimizer,
        [p for _, _, p in entries],
        source=optimizer,
        source_groups=source_groups,
        shards=[p if s is None else s for (_, _, p), s in zip(entries, shards)] if has_shards else None,
    )
