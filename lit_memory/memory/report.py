"""The one table that shows footprints side by side (estimate, the end of every fit, plan)."""

from __future__ import annotations

from typing import Optional

from lit_memory.memory.footprint import CATEGORIES, LABELS, Footprint, format_bytes

WIDTH = 18


def table(title: str, columns: dict[str, Optional[Footprint]], extra: Optional[dict[str, list[str]]] = None) -> str:
    """Rows: each category at the peak, the peak, its phase, then ``extra`` rows (one cell per column)."""
    shown = {name: f for name, f in columns.items() if f is not None}
    label = max(len(title), 26) + 2
    lines = [f"{title:<{label}}" + "".join(f"{name:>{WIDTH}}" for name in shown)]
    for category in CATEGORIES:
        cells = [format_bytes(f.categories[category]) for f in shown.values()]
        lines.append(f"  {LABELS[category]:<{label - 2}}" + "".join(f"{c:>{WIDTH}}" for c in cells))
    lines.append(f"  {'peak':<{label - 2}}" + "".join(f"{format_bytes(f.peak):>{WIDTH}}" for f in shown.values()))
    lines.append(f"  {'(phase)':<{label - 2}}" + "".join(f"{str(f.peak_phase):>{WIDTH}}" for f in shown.values()))
    for name, cells in (extra or {}).items():
        lines.append(f"  {name:<{label - 2}}" + "".join(f"{c:>{WIDTH}}" for c in cells))
    return "\n".join(lines)


def breakdown(footprint: Footprint, where: str) -> str:
    """One line: every category, the peak and its phase."""
    parts = ", ".join(f"{c} {format_bytes(footprint.categories[c])}" for c in CATEGORIES)
    return f"{parts}; peak {format_bytes(footprint.peak)} in {footprint.peak_phase} on {where}"
