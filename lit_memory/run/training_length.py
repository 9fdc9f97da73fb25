"""How long ``fit`` trains, and a floor for a small file of the user's own.

The shipped recipes train one epoch, as the seed did: sized for the bundled demo (4,000 tweets, 125 optimizer steps
that reach val F1-macro 0.85). One epoch of a small file of one's own is a few steps at the recipes' learning rate
(2e-5): a 600-row pair file for regression trained 15 steps and ended at Pearson -0.45. So, unless the user sets
``trainer.max_epochs`` or ``trainer.max_steps`` (on the command line or in a config file of their own, not a shipped
recipe), a fit on data other than the bundled demo trains enough epochs to reach `MIN_STEPS` optimizer steps.

Why 300: Hugging Face's Trainer trains 3 epochs by default and its GLUE examples at batch 32 train the smallest sets
for 234 (RTE, 2,490 rows) to 345 (MRPC, 3,668) steps at learning rates of 2e-5 to 5e-5; this project measured the
floor on 600-row files made in the tests (`examples/decisions.py`). A file with 9,600 rows or more (at batch 32)
reaches it in the recipe's one epoch, and is left alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

MIN_STEPS = 300  # optimizer steps a fit on the user's own data trains at least, unless they set its length


def steps_per_epoch(rows: int, batch_size: int, accumulate: int = 1, world_size: int = 1) -> int:
    """Optimizer steps in one epoch of ``rows`` training rows, as Lightning counts them (the last, short batch
    included; an accumulation window left over at the epoch's end steps too)."""
    batches = math.ceil(math.ceil(rows / max(world_size, 1)) / batch_size)
    return max(math.ceil(batches / max(accumulate, 1)), 1)


@dataclass(frozen=True)
class Length:
    """A fit's length: ``epochs`` of ``per_epoch`` optimizer steps, at most ``max_steps`` (-1: no limit), and the
    epochs it was raised from to reach the floor (None: as set)."""

    epochs: int
    per_epoch: int
    max_steps: int = -1
    raised_from: Optional[int] = None

    @property
    def steps(self) -> float:
        total = self.epochs * self.per_epoch if self.epochs > 0 else math.inf  # max_epochs -1: no epoch limit
        return min(total, self.max_steps) if self.max_steps is not None and self.max_steps > 0 else total

    def describe(self) -> str:
        if self.max_steps is not None and 0 < self.max_steps < (
            self.epochs * self.per_epoch if self.epochs > 0 else math.inf
        ):
            said = f"{self.max_steps:,} optimizer steps (trainer.max_steps; {self.per_epoch:,} per epoch)"
        elif self.epochs > 0:
            said = (
                f"{self.steps:,} optimizer steps ({self.epochs} epoch{'s' if self.epochs != 1 else ''} of "
                f"{self.per_epoch:,})"
            )
        else:
            said = f"{self.per_epoch:,} optimizer steps per epoch, with no limit set"
        if self.raised_from is not None:
            said += (f": trainer.max_epochs raised from {self.raised_from} so that your data trains at least "
                     f"{MIN_STEPS} steps (set trainer.max_epochs or trainer.max_steps to choose)")
        return said


def floor(rows: int, batch_size: int, accumulate: int, world_size: int, max_epochs: Optional[int],
          minimum: int = MIN_STEPS) -> Length:
    """The epochs that reach ``minimum`` optimizer steps (never fewer than ``max_epochs``)."""
    per_epoch = steps_per_epoch(rows, batch_size, accumulate, world_size)
    epochs = max_epochs if max_epochs is not None and max_epochs > 0 else 1
    needed = math.ceil(minimum / per_epoch)
    if needed > epochs:
        return Length(needed, per_epoch, raised_from=epochs)
    return Length(epochs, per_epoch)
