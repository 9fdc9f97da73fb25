"""The training loops a step's memory is predicted for (`LOOPS`): where the loop around the step changes memory
(autocast's cache of 16-bit weight copies, when gradients are released, the optimizer's kernels). Plain data, read
by the memory model (`lit_memory.planning.prediction.step`) and named by ``estimate --loop``."""

from __future__ import annotations

from dataclasses import dataclass

from lit_memory.errors import UserError


@dataclass(frozen=True)
class Loop:
    """The training loop around the step, where it changes memory: whether autocast caches its 16-bit
    weight copies for the whole forward pass, and when the previous step's gradients are released.

    lit_memory's fit (Lightning's Trainer) runs autocast without its cache and frees the gradients right
    after each optimizer step (`SequenceClassifier.optimizer_step`). Other loops differ: Lightning Fabric and
    the HF Trainer (through accelerate) keep torch's default cache; torch 1.x's ``zero_grad()`` zeroed the
    gradients in place (they stay allocated through the next forward); a loop that calls ``zero_grad()``
    after the forward pass keeps them through it."""

    name: str = "lightning"
    autocast_cache: bool = False
    gradients: str = "after_step"  # "after_step" | "before_backward" | "zeroed"
    # lit_memory's fit gives torch's Adam/AdamW their fused CUDA kernel where the config leaves it unset
    # (`lit_memory.optim.optimizers.use_fused_kernels`); other loops keep torch's default (foreach on CUDA).
    fused_kernels: bool = True

    def __post_init__(self) -> None:
        if self.gradients not in ("after_step", "before_backward", "zeroed"):
            raise UserError(f"unknown gradient release {self.gradients!r}")


LOOPS = {
    "lightning": Loop(),
    "fabric": Loop("fabric", autocast_cache=True, fused_kernels=False),
    "hf-trainer": Loop("hf-trainer", autocast_cache=True, fused_kernels=False),
    # transformers' Trainer with torch 1.x: model.zero_grad() zeroed in place (set_to_none=False then).
    "hf-trainer-torch1": Loop("hf-trainer-torch1", autocast_cache=True, gradients="zeroed", fused_kernels=False),
}


def loop(name: str) -> Loop:
    if name not in LOOPS:
        raise UserError(f"unknown training loop {name!r}; choose one of: {', '.join(LOOPS)}")
    return LOOPS[name]
