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
import sys
from functools import partial
from typing import Any

import torch
from torch.optim import Optimizer

from lit_memory.errors import UserError

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
        self._handles = []
        for group_index, group in enumerate(optimizer.param_groups):
            for param_index, param in enumerate(group["params"]):
                if not param.requires_grad:  # frozen: no gradient, no hook (torch refuses one)
                    continue
                hook = partial(self._step, _single(optimizer, group_index, param_index), group_index)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def _step(self, single: Optimizer, group_index: int, param: torch.Tensor) -> None:
        single.state = self.optimizer.state  # re-read: load_state_dict replaces it
        group = self.optimizer.param_groups[group_index]
        single.param_groups[0].update((k, v) for k, v in group.items() if k != "params")
        single.step()
        param.grad = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _single(optimizer: Optimizer, group_index: int, param_index: int) -> Optimizer:
    """A copy of ``optimizer`` that optimises one of its parameters, exactly as the original would.

    Constructors cannot rebuild an optimizer in general (bitsandbytes keeps settings such as
    ``min_8bit_size`` in ``args``, and AdamW8bit refuses its own ``optim_bits`` back), so the copy
    keeps every attribute of the original and re-initialises only torch's own bookkeeping (hooks,
    state, groups) for the one parameter.
    """
    group = optimizer.param_groups[group_index]
    param = group["params"][param_index]
    _check_shard(optimizer, param)
    single = object.__new__(type(optimizer))
    # An LR scheduler wraps the original's bound `step` on the instance: that one stays behind.
    vars(single).update((k, v) for k, v in vars(optimizer).items() if k not in ("step", "_opt_called"))
    Optimizer.__init__(single, [{**group, "params": [param]}], optimizer.defaults)
    if _is_bitsandbytes(optimizer):
        single.mng = _bitsandbytes_overrides(optimizer.mng, (group_index, param_index))
    return single


def _check_shard(optimizer: Optimizer, param: torch.Tensor) -> None:
    """Where the tensor a per-parameter optimizer steps is decided: today always the parameter itself.

    torch optimizers step FSDP2's sharded (DTensor) parameters directly. bitsandbytes' kernels know
    nothing of DTensor: they would need each rank's local shard, with its state saved as a DTensor.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and _is_bitsandbytes(optimizer):
        raise UserError(
            f"{type(optimizer).__name__} cannot step FSDP-sharded parameters yet: "
            "use a torch optimizer (e.g. torch.optim.AdamW) with FSDP, or train on one device"
        )


def _is_bitsandbytes(optimizer: Optimizer) -> bool:
    module = sys.modules.get("bitsandbytes.optim.optimizer")  # loaded if the optimizer is one
    return module is not None and isinstance(optimizer, module.Optimizer8bit)


def _bitsandbytes_overrides(manager: Any, index: tuple[int, int]) -> Any:
    """bitsandbytes' per-parameter overrides (e.g. 32-bit state for embeddings) for a one-parameter copy.

    The process-wide `GlobalOptimManager` finds overrides by parameter id or by the parameter's
    (group, index) in the optimizer; a one-parameter optimizer is always at (0, 0), so it gets a view
    of the manager whose (0, 0) entry is its parameter's original one. Writes by id stay shared.
    """
    view = copy.copy(manager)
    view.index2config = {(0, 0): manager.index2config[index]} if index in manager.index2config else {}
    return view
