"""Sharded tensors in the fused step: this rank's part of a tensor, the tensor a bucket's optimizer steps, and
the configured optimizer's state as a copy that steps local shards sees it."""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim import Optimizer

from lit_memory.optim.optimizers import library_of


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (sharing its storage), else the tensor."""
    from torch.distributed.tensor import DTensor  # deferred: ~0.6 s to import, and only sharded runs hold DTensors

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_shard(optimizer: Optimizer, param: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor a bucket's optimizer steps instead of ``param``, or None for ``param`` itself.

    torch optimizers step FSDP2's sharded (DTensor) parameters directly. bitsandbytes' kernels know
    nothing of DTensor, so its copies step this rank's local shard: a plain tensor sharing the
    parameter's storage, so updating it updates the parameter.
    """
    from torch.distributed.tensor import DTensor  # deferred: ~0.6 s to import, and only sharded runs hold DTensors

    if isinstance(param, DTensor) and library_of(optimizer).steps_local_shards:
        return param.to_local().detach()
    return None


class ShardState:
    """The original optimizer's state (keyed by the sharded parameters, as its ``state_dict`` needs)
    as seen by a copy that steps local shards: bitsandbytes reads ``state[t]`` and ``t in state``,
    memory trackers iterate ``values()``/``items()`` (this bucket's parameters)."""

    def __init__(self, param_of: dict[torch.Tensor, torch.Tensor]) -> None:
        self.param_of = param_of  # local shard -> its sharded parameter
        self.state: dict = {}

    def __getitem__(self, tensor: torch.Tensor) -> dict:
        return self.state[self.param_of.get(tensor, tensor)]

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return self.param_of.get(tensor, tensor) in self.state

    def items(self) -> list[tuple[torch.Tensor, dict]]:
        return [(shard, self.state[param]) for shard, param in self.param_of.items() if param in self.state]

    def values(self) -> list[dict]:
        return [state for _, state in self.items()]
