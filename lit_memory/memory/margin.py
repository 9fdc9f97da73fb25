"""The room every "fits" decision keeps for the memory model's own error: ``memory.margin``.

A prediction is fitted against a limit (a card's capacity, ``memory.budget``, ``memory.tier``, what the card
has free at start) less a share of it kept free: a setup fits when its predicted device total is at most
``limit x (1 - margin)``. Every decision that says "fits" goes through `Fit`: ``auto`` checkpointing
(`lit_memory.planning.recompute.resolve`), ``plan``, the out-of-memory advice (`lit_memory.planning.choose`), the
recipe headers and ``estimate``'s verdict, and each says what is left ("fits rtx3050-4gb with 9 % to spare").
A limit travels as one `Limit` (its bytes, its words, its margin): from the ``memory:`` block
(`MemorySettings.limit`, ``.cap``) or ``plan --budget`` through the plan, the cap, the monitor and NCCL's settings.

The default is derived from the published GPU measurements the model is checked against (docs/memory.md,
"Checked against published GPU measurements", `lit_memory.tools.published`): on the rows that are strictly
comparable (the source states its environment, one run's settings), the worst under-prediction is the
Lightning Fabric bf16-mixed row, predicted at 0.93 of what was measured (measured 7.7 % above the
prediction). A plan at ``1 - 0.93`` to spare would have fitted that run with nothing left; 8 % covers it,
and tests/tools/test_published.py fails if a row's error ever outgrows the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lit_memory.errors import UserError
from lit_memory.memory.measure.footprint import format_bytes

DEFAULT_MARGIN = 0.08


def check_margin(value: object) -> float:
    """``memory.margin`` as a share of the limit in [0, 0.5): one error line otherwise."""
    try:
        margin = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        margin = float("nan")
    if not 0 <= margin < 0.5:  # NaN fails too
        raise UserError(
            f"memory.margin must be a share of the limit in [0, 0.5) (e.g. 0.08 keeps 8 % free), got {value!r}"
        )
    return margin


def usable(limit: int, margin: float) -> int:
    """What a setup may be predicted at to fit ``limit`` with ``margin`` kept free."""
    return int(limit * (1 - margin))


@dataclass(frozen=True)
class Limit:
    """A memory limit as one value: its bytes, the words it was given in, and the share every "fits" keeps free."""

    bytes: int
    words: str = ""  # "memory.budget 4.00 GiB", "memory.tier rtx3050-4gb (3.81 GiB)", "rtx3050-4gb"; empty: the size
    margin: float = DEFAULT_MARGIN

    @property
    def usable(self) -> int:
        """What a setup may be predicted at to fit this limit with the margin kept free."""
        return usable(self.bytes, self.margin)

    def fit(self, predicted: int) -> "Fit":
        return Fit(predicted, self.bytes, self.margin, self.words)

    def with_margin(self, margin: float) -> "Limit":
        return self if margin == self.margin else replace(self, margin=margin)

    def __str__(self) -> str:
        return self.words or format_bytes(self.bytes)


@dataclass(frozen=True)
class Fit:
    """One "fits" decision: a predicted device total against a limit, with the margin kept."""

    predicted: int
    limit: int
    margin: float
    where: str = ""  # the limit in words: "rtx3050-4gb (3.81 GiB)", "memory.budget 4.00 GiB"

    @property
    def fits(self) -> bool:
        return self.predicted <= usable(self.limit, self.margin)

    @property
    def spare(self) -> float:
        """The share of the limit left free (negative: over it)."""
        return 1 - self.predicted / self.limit if self.limit else -math.inf

    def percent(self) -> str:
        # rounded down, so that a fit never shows less than its margin and a miss never shows it
        return f"{math.floor(100 * self.spare)} %"

    def line(self) -> str:
        where = self.where or format_bytes(self.limit)
        margin = f"margin {100 * self.margin:g} %"
        if self.fits:
            return f"fits {where} with {self.percent()} to spare (predicted {format_bytes(self.predicted)}; {margin})"
        left = (
            f"{self.percent()} to spare" if self.spare >= 0 else f"over by {format_bytes(self.predicted - self.limit)}"
        )
        return (
            f"does not fit {where} with the {margin}: predicted {format_bytes(self.predicted)}, {left} "
            f"(at most {format_bytes(usable(self.limit, self.margin))})"
        )

    def to_dict(self) -> dict:
        return {
            "limit": self.where or format_bytes(self.limit),
            "limit_bytes": self.limit,
            "predicted_bytes": self.predicted,
            "margin": self.margin,
            "spare": round(self.spare, 4),
            "fits": self.fits,
            "line": self.line(),
        }
