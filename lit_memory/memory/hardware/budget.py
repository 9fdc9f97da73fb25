"""A run's memory settings, parsed once: `MemorySettings` (the ``memory:`` block's budget, tier, margin and
allocator settings).

Read from the config at the command line's edge (`lit_memory.cli`) and from a step's settings
(`lit_memory.memory.prediction.step.Step`), and passed down typed to everything that decides with them: the memory monitor
and the budget cap of a run (`lit_memory.monitor`, `lit_memory.run_memory`), ``auto`` checkpointing
(`lit_memory.memory.planning.recompute`), the out-of-memory advice, ``estimate`` and ``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from lit_memory.memory.hardware.allocator import AllocatorConfig, check_recipe_conf
from lit_memory.memory.hardware.gpus import capacity, is_gpu_name
from lit_memory.memory.measure.footprint import format_bytes
from lit_memory.memory.hardware.margin import DEFAULT_MARGIN, check_margin


@dataclass(frozen=True)
class Size:
    """A memory size as a setting states it: a size (``4GiB``) or a card (``rtx3050-4gb``: its capacity)."""

    bytes: int
    given: str  # as written, for the decisions' lines

    @classmethod
    def parse(cls, value: Any) -> Optional["Size"]:
        """None stays None; anything else is read by `lit_memory.memory.hardware.gpus.capacity` (one error line)."""
        return None if value is None else cls(capacity(value), str(value))

    def words(self, key: str) -> str:
        """``memory.tier rtx3050-4gb (3.81 GiB)``, ``memory.budget 4.00 GiB``."""
        size = format_bytes(self.bytes)
        return f"{key} {self.given} ({size})" if is_gpu_name(self.given) else f"{key} {size}"


@dataclass(frozen=True)
class MemorySettings:
    """The memory a run works within (the ``memory:`` block of a config; `lit_memory.run_memory.MemoryOptions`
    documents each key):

    - ``budget``: enforced (the caching allocator is capped on CUDA, the tracked tensors on a CPU);
    - ``tier``: the device memory the recipe is made for: what ``auto`` plans for without a budget;
    - ``margin``: the share of a limit every "fits" decision keeps free (`lit_memory.memory.hardware.margin`);
    - ``allocator``: the CUDA caching allocator settings the recipe is made for, checked key by key."""

    budget: Optional[Size] = None
    tier: Optional[Size] = None
    margin: float = DEFAULT_MARGIN
    allocator: Optional[str] = None

    @classmethod
    def parse(cls, budget: Any = None, tier: Any = None, margin: Any = None, allocator: Any = None) -> "MemorySettings":
        return cls(
            budget=Size.parse(budget),
            tier=Size.parse(tier),
            margin=DEFAULT_MARGIN if margin is None else check_margin(margin),
            allocator=check_recipe_conf(allocator) if allocator else None,
        )

    @classmethod
    def of(cls, settings: Optional[Mapping[str, Any]]) -> "MemorySettings":
        """From a run's settings (plain or a jsonargparse namespace): their ``memory`` block."""
        block = (settings.get("memory") if settings is not None else None) or {}
        return cls.parse(*(block.get(key) for key in ("budget", "tier", "margin", "allocator")))

    @property
    def limit(self) -> Optional[Size]:
        """What a run plans for: the budget (enforced), else the tier; None without either."""
        return self.budget or self.tier

    @property
    def limit_bytes(self) -> Optional[int]:
        return self.limit.bytes if self.limit else None

    @property
    def limit_words(self) -> str:
        """The limit in words, for the decisions' lines (empty without one)."""
        if self.budget is not None:
            return self.budget.words("memory.budget")
        return self.tier.words("memory.tier") if self.tier is not None else ""

    @property
    def allocator_config(self) -> Optional[AllocatorConfig]:
        """The recipe's allocator settings as the allocator model reads them (None: the recipe sets none)."""
        return AllocatorConfig.parse(self.allocator) if self.allocator else None
