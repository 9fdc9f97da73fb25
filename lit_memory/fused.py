"""The fused backward + optimizer step: each parameter is updated, and its gradient freed, as soon
as backward has produced that gradient, so a full set of gradients never exists.

`FusedStep(optimizer)` takes the optimizer the user configured (any torch optimizer, transformers'
Adafactor, bitsandbytes' 8-bit optimizers) and gives each of its trainable parameters a copy of it
for that parameter alone, stepped from the parameter's `Tensor.register_post_accumulate_grad_hook`.
Everyone else (Lightning, Fabric, LR schedulers, checkpoints) keeps talking to the original:

- hyper-parameters: before each step a copy takes its group's current values from the original's
  ``param_groups``, where LR schedulers write them, so weight-decay groups and schedules hold;
- state: every copy keeps its state in the original's ``state``, so ``state_dict()`` and
  ``load_state_dict()`` are the original's own, in its own format;
- ``step(closure)`` is the original's: it runs the closure (forward and backward, during which every
  parameter is stepped) and then finds no gradient left. A gradient that did not come through
  backward (set by hand, or by torch's checkpoint utilities) is still applied there, by the original.

The one thing fusion cannot do is look at gradients after backward: no accumulation over
micro-batches, no gradient clipping, no skipped steps (fp16 gradient scaling). The strategies
in `lit_memory.strategies` refuse those settings with these messages before training starts.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, Optional

import torch
from torch.optim import Optimizer

from lit_memory.eightbit import is_bitsandbytes


# One line each: what cannot work, and what to do instead.
ACCUMULATION = (
    "the fused step updates the parameters in every backward, so it cannot accumulate gradients: set "
    "trainer.accumulate_grad_batches to 1 (fit the batch with model.gradient_checkpointing) "
    "or remove the fused strategy"
)
CLIPPING = (
    "the fused step applies each gradient as soon as backward produces it, so no gradient is left to clip after "
    "backward: remove trainer.gradient_clip_val (a warmup, model.warmup_ratio, also tames early updates) "
    "or remove the fused strategy"
)
SCALER = (
    "the fused step cannot skip a step after an fp16 gradient overflow, which 16-mixed's gradient scaler needs: "
    "use precision bf16-mixed or 32-true, or remove the fused strategy"
)
MANUAL = (
    "the fused step runs the optimizer inside backward, where manual optimization cannot control it: "
    "use automatic optimization or remove the fused strategy"
)
SEVERAL = (
    "the fused step drives exactly one optimizer: put all parameters into one optimizer "
    "(parameter groups for different settings) or remove the fused strategy"
)


class FusedStep:
    """Step ``optimizer`` parameter by parameter inside backward; `remove` restores normal stepping.

    ``optimizer`` stays the one that Lightning, LR schedulers and checkpoints use.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.steps_shards = False  # whether some copy steps a local shard (bitsandbytes under FSDP2)
        self._handles = []
        for group_index, group in enumerate(optimizer.param_groups):
            for param_index, param in enumerate(group["params"]):
                if not param.requires_grad:  # frozen: no gradient, no hook (torch refuses one)
                    continue
                single, shard = _single(optimizer, group_index, param_index)
                self.steps_shards |= shard is not None
                hook = partial(self._step, single, shard, group_index)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def _step(self, single: Optimizer, shard: Optional[torch.Tensor], group_index: int, param: torch.Tensor) -> None:
        state = self.optimizer.state  # re-read: load_state_dict replaces it
        single.state = state if shard is None else _ShardState(state, shard, param)
        group = self.optimizer.param_groups[group_index]
        single.param_groups[0].update((k, v) for k, v in group.items() if k != "params")
        if shard is not None:
            shard.grad = param.grad.to_local()
        single.step()
        param.grad = None
        if shard is not None:
            shard.grad = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _single(optimizer: Optimizer, group_index: int, param_index: int) -> tuple[Optimizer, Optional[torch.Tensor]]:
    """A copy of ``optimizer`` that optimises one of its parameters, exactly as the original would,
    and the local shard it steps instead of the parameter, if it needs one (see `_local_shard`).

    Constructors cannot rebuild an optimizer in general (bitsandbytes keeps settings such as
    ``min_8bit_size`` in ``args``, and AdamW8bit refuses its own ``optim_bits`` back), so the copy
    keeps every attribute of the original and re-initialises only torch's own bookkeeping (hooks,
    state, groups) for the one parameter.
    """
    group = optimizer.param_groups[group_index]
    param = group["params"][param_index]
    shard = _local_shard(optimizer, param)
    single = object.__new__(type(optimizer))
    # An LR scheduler wraps the original's bound `step` on the instance: that one stays behind.
    vars(single).update((k, v) for k, v in vars(optimizer).items() if k not in ("step", "_opt_called"))
    Optimizer.__init__(single, [{**group, "params": [param if shard is None else shard]}], optimizer.defaults)
    if is_bitsandbytes(optimizer):
        single.mng = _bitsandbytes_overrides(optimizer.mng, (group_index, param_index), param)
    return single, shard


def _local_shard(optimizer: Optimizer, param: torch.Tensor) -> Optional[torch.Tensor]:
    """Where the tensor a per-parameter optimizer steps is decided.

    torch optimizers step FSDP2's sharded (DTensor) parameters directly. bitsandbytes' kernels know
    nothing of DTensor, so its copies step this rank's local shard: a plain tensor sharing the
    parameter's storage, so updating it updates the parameter.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and is_bitsandbytes(optimizer):
        return param.to_local().detach()
    return None


class _ShardState:
    """The original optimizer's state (keyed by the sharded parameter, as its ``state_dict`` needs)
    as seen by a copy that steps the local shard: bitsandbytes reads ``state[t]`` and ``t in state``,
    memory trackers iterate ``values()``/``items()`` (this copy's one parameter)."""

    def __init__(self, state: dict, shard: torch.Tensor, param: torch.Tensor) -> None:
        self.state, self.shard, self.param = state, shard, param

    def _key(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.param if tensor is self.shard else tensor

    def __getitem__(self, tensor: torch.Tensor) -> dict:
        return self.state[self._key(tensor)]

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return self._key(tensor) in self.state

    def items(self) -> list[tuple[torch.Tensor, dict]]:
        return [(self.shard, self.state[self.param])] if self.param in self.state else []

    def values(self) -> list[dict]:
        return [state for _, state in self.items()]


def _bitsandbytes_overrides(manager: Any, index: tuple[int, int], param: torch.Tensor) -> Any:
    """bitsandbytes' per-parameter overrides (e.g. 32-bit state for embeddings) for a one-parameter copy.

    The process-wide `GlobalOptimManager` finds overrides by the parameter's (group, index) in the
    optimizer, by parameter id, or by module (`StableEmbedding` registers its weight). A
    one-parameter optimizer is always at (0, 0) and may step a local shard with another id, so it
    gets a view of the manager whose (0, 0) entry is everything its parameter was given.
    """
    config = dict(manager.index2config.get(index, {}))
    for module, name, module_config in manager.module_weight_config_triple:
        if getattr(module, name) is param:
            config.update(module_config)
    config.update(manager.pid2config.get(id(param), {}))
    view = copy.copy(manager)
    view.index2config = {(0, 0): config} if config else {}
    return view
