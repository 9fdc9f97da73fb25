"""What memory is counted in: five categories, three phases of a training step, three levels, bytes.

The levels: **tensors** (the categories summed: ``max_memory_allocated``, or MemTracker's tracked tensors),
**reserved** (the CUDA caching allocator's segments: ``max_memory_reserved``) and **device** (reserved plus the
CUDA context and loaded kernels, and a distributed run's NCCL communicators: what ``nvidia-smi`` shows for the
process). A footprint always has the first; predictions for CUDA have all three.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lit_memory.errors import UserError

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "other")
PHASES = ("forward", "backward", "step")
LABELS = {  # as tables show them
    "weights": "weights",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "other": "other/temporary",
}

# Units, case-insensitive: decimal K/KB, M/MB, G/GB, T/TB; binary KiB, MiB, GiB, TiB; bare numbers are bytes.
_UNITS = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgt", start=1):
    _UNITS[_prefix] = _UNITS[_prefix + "b"] = 1000**_power
    _UNITS[_prefix + "ib"] = 1024**_power


def parse_bytes(value: Union[int, float, str]) -> int:
    """``4GiB`` -> 4294967296; ``4GB`` / ``4G`` are powers of ten, a bare number is bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise UserError(f"cannot read {value!r} as a memory size: use e.g. 4GiB, 3.5GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def breakdown_line(categories: dict[str, int]) -> str:
    return " + ".join(f"{name} {format_bytes(categories.get(name, 0))}" for name in CATEGORIES)


@dataclass
class Footprint:
    """Bytes per category at the peak of each training phase; the peak is the largest of them. Optionally
    the allocator's reserved bytes at the peak (the phase in which they last grew) and the CUDA context:
    the caching allocator keeps what it reserved, so in a steady-state step every phase holds the peak."""

    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    reserved: Optional[int] = None
    reserved_phase: Optional[str] = None
    context: Optional[int] = None  # CUDA context and loaded kernels (device = reserved + context + communicators)
    workspaces: Optional[int] = None  # cuBLAS workspaces: allocated through the allocator, not tensors of the step
    communicators: Optional[int] = None  # NCCL's communicators, outside the allocator (distributed CUDA runs)
    # under a cap (memory.budget on CUDA): what the allocator's check counts beyond its reserve, for it never to release
    # its cache and retry (`lit_memory.memory.hardware.allocator.Replay.room`); not memory the device holds
    room: Optional[int] = None

    @property
    def allocated(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` counts at the peak: the tensors and the library workspaces."""
        return self.peak + (self.workspaces or 0)

    @property
    def device(self) -> Optional[int]:
        if self.reserved is None or self.context is None:
            return None
        return self.reserved + self.context + (self.communicators or 0)

    @property
    def capped(self) -> Optional[int]:
        """What a cap on the device (``memory.budget``) must allow: the device level and the allocator's room beyond
        its reserve, so that it never releases its cache and retries. Every "fits" of a budget compares this."""
        device = self.device
        return None if device is None else device + (self.room or 0)

    def add(self, phase: str, categories: dict[str, int]) -> None:
        """Keep, per phase, the composition with the largest total (the peak over steps)."""
        if phase not in self.phases or sum(categories.values()) > sum(self.phases[phase].values()):
            self.phases[phase] = {c: int(categories.get(c, 0)) for c in CATEGORIES}

    def merge(self, other: "Footprint") -> None:
        for phase, categories in other.phases.items():
            self.add(phase, categories)

    @property
    def peak_phase(self) -> Optional[str]:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()), default=None)

    @property
    def categories(self) -> dict[str, int]:
        return dict(self.phases[self.peak_phase]) if self.phases else dict.fromkeys(CATEGORIES, 0)

    @property
    def peak(self) -> int:
        return sum(self.categories.values())

    def to_dict(self) -> dict[str, Any]:
        levels = {"reserved_bytes": self.reserved, "device_bytes": self.device}
        out: dict[str, Any] = {"peak_bytes": self.peak}
        if self.reserved is not None:
            out.update(levels, reserved_phase=self.reserved_phase, context_bytes=self.context,
                       workspace_bytes=self.workspaces, allocated_bytes=self.allocated)
            if self.room:
                out["room_bytes"] = self.room
            if self.communicators:
                out["communicator_bytes"] = self.communicators
        out.update(peak_phase=self.peak_phase, categories=self.categories)
        out["phases"] = {
            p: {"peak_bytes": sum(c.values()), **(levels if self.reserved is not None else {}), "categories": c}
            for p, c in self.phases.items()
        }
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Footprint":
        return cls(
            {phase: dict(entry["categories"]) for phase, entry in data["phases"].items()},
            reserved=data.get("reserved_bytes"),
            reserved_phase=data.get("reserved_phase"),
            context=data.get("context_bytes"),
            workspaces=data.get("workspace_bytes"),
            communicators=data.get("communicator_bytes"),
            room=data.get("room_bytes"),
        )
