"""Gradient clipping inside the fused step (`Clipping`), and what the backward that only measures finds:
the total norm (`NormMeter`) and, with loss scaling, which optimizers' gradients overflowed (`Measure`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lit_memory.errors import UserError
from lit_memory.fused.scaling import LossScaling
from lit_memory.fused.shards import local_part


@dataclass(frozen=True)
class Clipping:
    """Gradient clipping inside the fused step, with the results of clipping after an unfused backward.

    ``max_norm``: every gradient is multiplied by ``max_norm / (total_norm + 1e-6)`` where that is below
    1, ``total_norm`` being the ``norm_type``-norm of all the gradients together (of every rank), as
    `torch.nn.utils.clip_grad_norm_` does; the norm comes from a first backward that only measures it
    (`BucketHooks.backward`, LOMO's method). ``value``: each gradient is clamped to ``[-value, value]``
    before its bucket's step, as `torch.nn.utils.clip_grad_value_` does.
    """

    max_norm: Optional[float] = None
    norm_type: float = 2.0
    value: Optional[float] = None

    def __post_init__(self) -> None:
        if self.max_norm is not None and self.value is not None:
            raise UserError("clip gradients either by norm (max_norm) or by value (clip_val), not both")
        for name, setting in (("max_norm", self.max_norm), ("clip_val", self.value), ("norm_type", self.norm_type)):
            if setting is not None and not float(setting) > 0:
                raise UserError(f"{name} must be positive, got {setting!r}")

    @property
    def by_norm(self) -> bool:
        return self.max_norm is not None

    def coefficient(self, total_norm: torch.Tensor) -> torch.Tensor:
        """The factor for every gradient, as `torch.nn.utils.clip_grads_with_norm_` computes it."""
        return torch.clamp(self.max_norm / (total_norm + 1e-6), max=1.0)


class NormMeter:
    """The ``norm_type``-norm of gradients seen one at a time: the norm of their norms, as
    `torch.nn.utils.get_total_norm` takes it, where a sharded gradient's part is reduced over the
    ranks it is sharded over (a DTensor's shard dimensions, or FSDP1's group) as DTensor reduces a
    partial norm."""

    def __init__(self, norm_type: float) -> None:
        self.norm_type = float(norm_type)
        self.norms: dict[tuple, list[torch.Tensor]] = {}  # process groups the gradients are sharded over -> norms
        self.device = torch.device("cpu")

    def add(self, grad: torch.Tensor, group: Any = None) -> None:
        local = local_part(grad)
        # the group takes part in the all-reduce even with nothing here
        norms = self.norms.setdefault(_shard_groups(grad, group), [])
        self.device = local.device
        if local.numel():  # an empty shard adds nothing to a p-norm and has no infinity norm
            norms.append(torch.linalg.vector_norm(local, self.norm_type))

    def total(self) -> torch.Tensor:
        p = self.norm_type
        parts = []
        for groups, norms in self.norms.items():
            part = torch.linalg.vector_norm(torch.stack(norms), p) if norms else torch.zeros((), device=self.device)
            if groups:
                part = part if p == float("inf") else part**p
                for group in groups:
                    dist.all_reduce(part, dist.ReduceOp.MAX if p == float("inf") else dist.ReduceOp.SUM, group=group)
                part = part if p == float("inf") else part ** (1.0 / p)
            parts.append(part)
        if not parts:
            return torch.tensor(0.0)
        return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), p)


def _shard_groups(grad: torch.Tensor, group: Any = None) -> tuple:
    """The process groups a gradient is sharded over: a DTensor's shard dimensions, else ``group`` (FSDP1's)."""
    from torch.distributed.tensor import DTensor  # deferred: ~0.6 s to import, and only sharded runs hold DTensors

    if isinstance(grad, DTensor):  # a dimension of one rank has nothing to reduce (FSDP2 on one GPU)
        mesh = grad.device_mesh
        return tuple(
            mesh.get_group(d) for d, place in enumerate(grad.placements) if place.is_shard() and mesh.size(d) > 1
        )
    return () if group is None else (group,)


class Measure:
    """What a backward that only measures finds, gradient by gradient (each freed after): the norm of all of
    them (clipping by norm) and, with loss scaling, whether any is inf or NaN, per optimizer (``keys``: the
    user's optimizers, in an order every rank shares; GradScaler decides each optimizer's step on its own
    gradients). With loss scaling each gradient is first unscaled in place by GradScaler's own kernel, so
    the norm is that of the unscaled gradients, as clipping after GradScaler's ``unscale_`` sees them."""

    def __init__(self, norm_type: Optional[float], scaling: Optional[LossScaling], keys: Sequence[int] = ()) -> None:
        self.norms = NormMeter(norm_type) if norm_type is not None else None
        self.scaling = scaling
        self.keys = list(keys)
        self.inv_scale: Optional[torch.Tensor] = None  # read at the first gradient: the loss is scaled by then
        self.found: dict[tuple[int, torch.device], torch.Tensor] = {}  # (optimizer, device): GradScaler's found_inf
        self.groups: dict[int, Any] = {}  # the process groups the checked gradients are sharded over

    def add(self, grad: torch.Tensor, group: Any = None, key: int = 0) -> None:
        if self.scaling is not None:
            if self.inv_scale is None:
                self.inv_scale = self.scaling.inv_scale()
            local = local_part(grad)
            found = self.found.get((key, local.device))
            if found is None:
                found = self.found[key, local.device] = torch.zeros((), device=local.device)
            if local.numel():  # an empty shard (FSDP2's last ranks) has nothing to check, but joins the reduction
                torch._amp_foreach_non_finite_check_and_unscale_([local], found, self.inv_scale.to(local.device))
            self.groups.update((id(g), g) for g in _shard_groups(grad, group))
        if self.norms is not None:
            self.norms.add(grad, group)

    def result(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(the total norm, or None; per key, whether a gradient overflowed on any rank, nonzero if so, or None)."""
        total = self.norms.total() if self.norms is not None else None
        if self.scaling is None:
            return total, None
        found = torch.zeros(len(self.keys), device=self.scaling.scale_device)
        for (key, _), part in self.found.items():
            found[self.keys.index(key)] += part.to(found.device)
        if self.groups:  # an overflow on any rank skips the step on every rank: one reduction for all
            for group in self.groups.values():
                dist.all_reduce(found, dist.ReduceOp.MAX, group=group)
        return total, found
