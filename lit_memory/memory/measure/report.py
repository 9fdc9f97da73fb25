"""The one table that shows footprints side by side (estimate, the end of every fit, plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from lit_memory.memory.measure.footprint import CATEGORIES, LABELS, Footprint, format_bytes

WIDTH = 18


@dataclass(frozen=True)
class Levels:
    """A measured column without categories: the CUDA allocator's and the device's peaks."""

    allocated: Optional[int]
    reserved: Optional[int]
    device: Optional[int]
    phase: Optional[str] = None


Column = Union[Footprint, Levels]


def table(title: str, columns: dict[str, Optional[Column]], extra: Optional[dict[str, list[str]]] = None) -> str:
    """Rows: each category at the peak, the tensors' peak and its phase, then the allocator's reserve and the
    device total where a column has them, then ``extra`` rows (one cell per column)."""
    shown = {name: f for name, f in columns.items() if f is not None}
    label = max(len(title), 26) + 2

    def row(name: str, cells: list[str]) -> str:
        return f"  {name:<{label - 2}}" + "".join(f"{c:>{WIDTH}}" for c in cells)

    lines = [f"{title:<{label}}" + "".join(f"{name:>{WIDTH}}" for name in shown)]
    for category in CATEGORIES:
        lines.append(
            row(
                LABELS[category],
                [format_bytes(f.categories[category]) if isinstance(f, Footprint) else "-" for f in shown.values()],
            )
        )
    lines.append(
        row(
            "peak (tensors)",
            [format_bytes(f.peak if isinstance(f, Footprint) else f.allocated) for f in shown.values()],
        )
    )
    lines.append(row("(phase)", [str(f.peak_phase if isinstance(f, Footprint) else f.phase) for f in shown.values()]))
    if any(f.reserved is not None for f in shown.values()):
        # what max_memory_allocated counts: the tensors and the cuBLAS workspaces the allocator holds for cuBLAS
        lines.append(row("allocated (+cuBLAS)", [format_bytes(f.allocated) for f in shown.values()]))
        lines.append(row("reserved (allocator)", [format_bytes(f.reserved) for f in shown.values()]))
        lines.append(row("device (nvidia-smi)", [format_bytes(f.device) for f in shown.values()]))
    for name, cells in (extra or {}).items():
        lines.append(row(name, cells))
    return "\n".join(lines)


def breakdown(footprint: Footprint, where: str) -> str:
    """One line: every category, the peak and its phase (and the reserved and device totals where known)."""
    parts = ", ".join(f"{c} {format_bytes(footprint.categories[c])}" for c in CATEGORIES)
    line = f"{parts}; peak {format_bytes(footprint.peak)} in {footprint.peak_phase} on {where}"
    if footprint.device is not None:
        line += f"; reserved {format_bytes(footprint.reserved)}, device {format_bytes(footprint.device)}"
    return line
