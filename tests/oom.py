"""An out-of-memory error on demand, for tests: ``--trainer.callbacks+=oom.RaiseOutOfMemory
--trainer.callbacks.step K --trainer.callbacks.where W`` raises torch.OutOfMemoryError, on every rank, in
optimizer step K: ``before_backward`` after the forward, ``backward`` inside the backward pass (from a hook on the
loss's gradient, as a CUDA allocation there would), as CUDA's caching allocator raises it.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback

MESSAGE = "CUDA out of memory. Tried to allocate 20.00 MiB (raised by tests/oom.py)"


class RaiseOutOfMemory(Callback):
    def __init__(self, step: int = 0, where: str = "before_backward") -> None:
        if where not in ("before_backward", "backward"):
            raise ValueError(f"where: before_backward or backward, not {where!r}")
        self.step, self.where = step, where

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if trainer.global_step != self.step:
            return
        if self.where == "before_backward":
            raise torch.OutOfMemoryError(MESSAGE)
        loss.register_hook(_raise)


def _raise(grad: torch.Tensor) -> None:
    raise torch.OutOfMemoryError(MESSAGE)
