"""`lit_memory.model.SequenceClassifier`'s optimisation: the default optimizer, weight-decay groups, the schedule,
and the optimizer step Lightning runs (the closure checked, the gradients freed at once)."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from lit_memory.errors import UserError
from lit_memory.hf.anatomy import Anatomy
from lit_memory.optim import optimizers
from lit_memory.optim.eightbit import unquantised, unquantised_dtype

# transformers schedules that need nothing beyond warmup and total steps.
SCHEDULES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)
CLOSURE_NOT_CALLED = (
    "the optimizer {name} did not call the closure its step is given: Lightning runs the forward and backward inside "
    "it, so a torch-style optimizer's step(closure) must call it (with torch.enable_grad(): loss = closure()) before "
    "it updates the parameters (docs/memory.md, Adding an optimizer)"
)
# The reference post's optimizer (lr 2e-5, weight decay 0.01): the module's default, and the CLI's.
DEFAULT_OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-5, "weight_decay": 0.01}}


def default_optimizer(params) -> torch.optim.Optimizer:
    """`DEFAULT_OPTIMIZER` as a callable, for a module built in Python."""
    return torch.optim.AdamW(params, **DEFAULT_OPTIMIZER["init_args"])


def check_schedule(name: str, warmup_ratio: float) -> None:
    if name not in SCHEDULES:
        raise UserError(f"unknown lr_scheduler_type {name!r}; choose one of: {', '.join(SCHEDULES)}")
    if not 0.0 <= warmup_ratio < 1.0:
        raise UserError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")


def weight_decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Trainable parameters in two groups: matrices with weight decay, biases/norms (1-D) without."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build(model: nn.Module, factory: Callable[..., torch.optim.Optimizer],
          embedding_state: str) -> torch.optim.Optimizer:
    """The configured optimizer over the model's trainable parameters, prepared as its library needs."""
    optimizer = factory(weight_decay_groups(model))
    kept = [e.weight for e in unquantised(embedding_state, Anatomy.of(model).embeddings) if e.weight.requires_grad]
    optimizers.prepare(optimizer, kept, unquantised_dtype(embedding_state))  # (`lit_memory.optim.optimizers`)
    return optimizer


def takes_amp_scale(trainer: Any) -> bool:
    """Whether torch's Adam/AdamW (one kernel per group) take GradScaler's scale (16-mixed), unless Lightning clips
    after backward (it refuses to clip for an optimizer that unscales itself)."""
    clips = bool(trainer.gradient_clip_val) and not getattr(trainer.strategy, "fused_step", False)
    return getattr(trainer.precision_plugin, "scaler", None) is not None and not clips


def schedule(optimizer: torch.optim.Optimizer, name: str, warmup_ratio: float, total: int) -> Any:
    """A transformers schedule over ``total`` optimizer steps, the first ``warmup_ratio`` of them warming up."""
    # deferred: transformers.optimization pulls in peft and bitsandbytes (1.5 s at start-up)
    from transformers import get_scheduler

    return get_scheduler(name, optimizer, num_warmup_steps=math.ceil(warmup_ratio * total), num_training_steps=total)


def step(optimizer: Any, amp_scaling: bool, closure: Optional[Callable[[], Any]],
         run: Callable[[Optional[Callable[[], Any]]], None]) -> None:
    """Lightning's optimizer step (``run``, given the closure) inside what the optimizer's library needs; an error
    line where the optimizer never called the closure; then the gradients freed."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper around the user's optimizer
    optimizers.mark_amp_scaling(inner, amp_scaling)  # its groups may have changed
    # What its library's step runs inside (bitsandbytes: no device sync after every parameter).
    context = optimizers.library_of(inner).step_context(inner, [p for g in inner.param_groups for p in g["params"]])
    ran: list[bool] = []

    def counted() -> Any:
        ran.append(True)
        return closure()

    with context if context is not None else contextlib.nullcontext():
        run(None if closure is None else counted)
    if closure is not None and not ran:  # Lightning's own message is a traceback about its loop
        raise UserError(CLOSURE_NOT_CALLED.format(name=f"{type(inner).__module__}.{type(inner).__qualname__}"))
    # Free the gradients now, as the HF Trainer does: Lightning zeroes them only after the next
    # training_step, so they would sit through the next forward (4 B per trainable parameter).
    optimizer.zero_grad(set_to_none=True)
