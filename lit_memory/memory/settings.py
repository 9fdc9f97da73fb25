"""The ``memory:`` block of a run's config, one typed value: `MemorySettings` (sizes as `Size`).

jsonargparse reads the block from this dataclass's fields (`lit_memory.cli`); it is built once there and passed down.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

from lit_memory.errors import UserError
from lit_memory.memory.hardware.allocator import AllocatorConfig, check_recipe_conf
from lit_memory.memory.hardware.gpus import capacity, gpu_key, is_gpu_name
from lit_memory.memory.margin import DEFAULT_MARGIN, Limit, check_margin
from lit_memory.memory.measure.footprint import format_bytes


@dataclass(frozen=True)
class Size:
    """A memory size as a setting states it: a size (``4GiB``) or a card (``rtx3050-4gb``: its capacity)."""

    bytes: int
    given: str  # as written, for the decisions' lines

    @classmethod
    def parse(cls, value: Any) -> Optional["Size"]:
        """None stays None; anything else is read by `lit_memory.memory.hardware.gpus.capacity` (one error line)."""
        return None if value is None else cls(capacity(value), str(value))

    @property
    def card(self) -> Optional[str]:
        """The catalogue key of the card it names (``rtx3050-4gb``), or None for a size."""
        return gpu_key(self.given) if is_gpu_name(self.given) else None

    def words(self, key: str) -> str:
        """``memory.tier rtx3050-4gb (3.81 GiB)``, ``memory.budget 4.00 GiB``."""
        size = format_bytes(self.bytes)
        return f"{key} {self.given} ({size})" if is_gpu_name(self.given) else f"{key} {size}"


@dataclass(frozen=True)
class MemorySettings:
    """Memory in every run: measured, predicted, bounded (the ``memory:`` block; docs/memory.md).

    Args:
        track_steps: optimizer steps tracked tensor by tensor, per category and phase (0: off).
        budget: a limit such as ``4GiB`` or a card (``rtx3050-4gb``), enforced: the allocator's cap on CUDA, an OOM on
        CPU. simulate: also predict by simulation at the start of fit (seconds; about half a minute on BERT-large).
        tier: the device memory the recipe is made for (a card or a size), what ``auto`` plans for; not enforced.
        allocator: the CUDA caching allocator settings the recipe is made for, in ``PYTORCH_CUDA_ALLOC_CONF``'s form.
        margin: the share of a limit every "fits" decision keeps free for the memory model's own error.
        snapshot: on CUDA, a file (in the run folder) for torch's memory snapshot of the first ``snapshot_steps``.
        snapshot_steps: the optimizer steps the snapshot records.
        picture: draw ``memory.png`` in the run folder at the end of fit (needs matplotlib).
    """

    track_steps: int = 2
    budget: Union[str, Size, None] = None  # a `Size` once built
    simulate: bool = False
    tier: Union[str, Size, None] = None  # a `Size` once built
    allocator: Optional[str] = None
    margin: float = DEFAULT_MARGIN
    snapshot: Optional[str] = None
    snapshot_steps: int = 2
    picture: bool = True

    def __post_init__(self) -> None:
        if self.track_steps < 0:
            raise UserError(f"memory.track_steps must be >= 0, got {self.track_steps}")
        if self.snapshot_steps < 1:
            raise UserError(f"memory.snapshot_steps must be >= 1, got {self.snapshot_steps}")
        if self.snapshot is not None and not str(self.snapshot).strip():
            raise UserError("memory.snapshot must be a file name, e.g. memory_snapshot.pickle")
        for key in ("budget", "tier"):
            value = getattr(self, key)
            object.__setattr__(self, key, value if isinstance(value, Size) else Size.parse(value))
        margin = DEFAULT_MARGIN if self.margin is None else check_margin(self.margin)
        object.__setattr__(self, "margin", margin)
        object.__setattr__(self, "allocator", check_recipe_conf(self.allocator) if self.allocator else None)

    @classmethod
    def of(cls, settings: Optional[Mapping[str, Any]]) -> "MemorySettings":
        """From a run's settings as plain data (a recipe read by a tool): their ``memory`` block."""
        block = dict((settings.get("memory") if settings is not None else None) or {})
        unknown = sorted(set(block) - {f.name for f in fields(cls)})
        if unknown:
            raise UserError(f"unknown memory setting(s): {', '.join(unknown)}; the memory block takes "
                            f"{', '.join(f.name for f in fields(cls))}")
        return cls(**block)

    @property
    def limit(self) -> Optional[Limit]:
        """What a run plans for: the budget (enforced), else the tier, with the margin; None without either."""
        return self.cap or (Limit(self.tier.bytes, self.tier.words("memory.tier"), self.margin) if self.tier else None)

    @property
    def cap(self) -> Optional[Limit]:
        """The budget alone, what a run is held to (the allocator's cap on CUDA, the tracker on a CPU)."""
        return Limit(self.budget.bytes, self.budget.words("memory.budget"), self.margin) if self.budget else None

    @property
    def allocator_config(self) -> Optional[AllocatorConfig]:
        """The recipe's allocator settings as the allocator model reads them (None: the recipe sets none)."""
        return AllocatorConfig.parse(self.allocator) if self.allocator else None
