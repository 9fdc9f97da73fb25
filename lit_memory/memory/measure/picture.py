"""The picture of a training step: where the memory goes, predicted beside measured (``memory.png``).

x: the step in order (forward layer by layer, the loss, backward layer by layer, the fused step's buckets, each named
by the layers it holds, or the optimizer step); y: GiB. Stacked areas are the predicted tensors per category (weights,
gradients, optimizer state, activations, other) from the analytic model's step written out event by event
(`lit_memory.memory.model.program.timeline`); the line over them is the measured total at the same points
(torch's MemTracker over the last tracked micro-batch, and on CUDA ``torch.cuda.memory_allocated``): both are
``memory.json``'s ``timeline``. Horizontal lines: the budget, the card less the margin every plan keeps, the
predicted device total (tensors, the allocator's reserve and the CUDA context) on CUDA, and the peaks with the point
they are reached at. Several steps side by side (`draw` with more than one panel) compare settings: what each
switch takes away, and where.

matplotlib is optional (``pip install 'lit-memory[plot]'``): without it `draw` returns None and callers say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from lit_memory import files
from lit_memory.memory.measure.footprint import CATEGORIES

GiB = 2**30
FILE = "memory.png"
COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "other": "#8c8c8c"}
NAMES = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer state", "activations": "activations",
         "other": "other (batch, temporaries)"}


@dataclass
class Panel:
    """One step's picture: its predicted points, the measured ones where there are, the lines to draw (bytes)."""

    title: str
    predicted: Optional[list[dict]]  # {"label", "categories"[, "between"]}: `program.timeline`
    measured: Optional[list[dict]] = None  # {"label", "categories"[, "cuda_allocated_bytes"]}: a run's tracker
    measured_peak: Optional[tuple[int, str]] = None  # (bytes, where): the run's measured peak (memory.json)
    device: Optional[int] = None  # the predicted device total at the peak (CUDA: tensors, reserve, context)
    budget: Optional[int] = None  # memory.budget
    capacity: Optional[int] = None  # the card's
    margin: float = 0.08
    limit: Optional[tuple[int, str]] = None  # (bytes, name): a limit the step crossed (an out-of-memory error)
    notes: list[str] = field(default_factory=list)

    @property
    def points(self) -> list[dict]:
        """The x axis: the predicted points, else (a model the prediction does not cover) the measured ones."""
        return self.predicted or self.measured or []

    def series(self) -> dict[str, Any]:
        """What `draw` plots, in bytes: the totals at each point and each horizontal line."""
        where = {p["label"]: i for i, p in enumerate(self.points)}
        top = peak_point(self.points)
        lines = {
            "predicted peak": total(top) if top and self.predicted else None,
            "measured peak": self.measured_peak[0] if self.measured_peak else None,
            "predicted device total": self.device,
            "budget": self.budget,
            "card less the margin": int(self.capacity * (1 - self.margin)) if self.capacity else None,
            "limit": self.limit[0] if self.limit else None,
        }
        return {
            "labels": [p["label"] for p in self.points],
            "predicted": [total(p) for p in self.predicted or []],
            "measured": [(where[m["label"]], total(m)) for m in self.measured or [] if m["label"] in where],
            "cuda": [(where[m["label"]], int(m["cuda_allocated_bytes"])) for m in self.measured or []
                     if m["label"] in where and m.get("cuda_allocated_bytes")],
            "lines": {name: value for name, value in lines.items() if value},
        }


def total(point: dict) -> int:
    return sum(int(point["categories"].get(c, 0)) for c in CATEGORIES)


def peak_point(points: Sequence[dict]) -> Optional[dict]:
    return max(points, key=total) if points else None


def crossing(points: Sequence[dict], limit: int) -> Optional[dict]:
    """The first point of a step above ``limit`` (where a run out of memory crossed it), or None."""
    return next((p for p in points if total(p) > limit), None)


def where(point: dict) -> str:
    """Where in the step a point is, in words: its mark ("backward: layer 3"), or for the highest point between two
    marks, "just before" the later one."""
    label = point["label"]
    return f"just before {label.removesuffix(' (peak)')}" if point.get("between") else f"at {label}"


def of_record(
    record: dict[str, Any], title: str, budget: Optional[int] = None, margin: float = 0.08
) -> Optional[Panel]:
    """The panel of a run's ``memory.json`` (`lit_memory.memory.measure.records`): its ``timeline``, its measured
    peak, its card; None where the run recorded no timeline."""
    timeline = record.get("timeline") or {}
    predicted, measured_ = timeline.get("predicted") or {}, timeline.get("measured") or {}
    if not predicted.get("points") and not measured_.get("points"):
        return None
    device, measured = record.get("device") or {}, record.get("measured") or {}
    cuda, tracked = measured.get("cuda"), measured.get("tracked")
    peak = None
    if cuda and cuda.get("max_allocated_bytes"):
        peak = (int(cuda["max_allocated_bytes"]), f"{cuda.get('peak_phase')}, torch.cuda.max_memory_allocated")
    elif tracked:
        peak = (int(tracked["peak_bytes"]), f"{tracked.get('peak_phase')}, tracked tensors")
    analytic = (record.get("predicted") or {}).get("analytic") or {}
    notes = []
    if predicted.get("points"):
        notes.append(
            f"predicted: the analytic model's steady-state step (optimizer state made), batch {_shape(predicted)}"
        )
    if measured_.get("points"):
        notes.append(f"measured: {measured_.get('what') or 'the last micro-batch tracked'}, batch {_shape(measured_)}")
    return Panel(
        title=title,
        predicted=predicted.get("points"),
        measured=measured_.get("points"),
        measured_peak=peak,
        device=analytic.get("device_bytes") if device.get("type") == "cuda" else None,
        budget=budget,
        capacity=device.get("total_bytes"),
        margin=margin,
        notes=notes,
    )


def _shape(part: dict) -> str:
    shape = part.get("batch_shape")
    return f"{shape[0]} x {shape[1]} tokens" if shape else "of unknown shape"


def draw(panels: Sequence[Panel], path: Path, title: str = "") -> Optional[Path]:
    """Draw ``panels`` side by side into the PNG ``path`` (written whole: `lit_memory.files`); None without
    matplotlib."""
    try:
        from matplotlib.figure import Figure  # deferred: optional and heavy; no pyplot: no GUI backend, no global state
    except ImportError:
        return None
    fig = Figure(figsize=(8.0 * len(panels) + 0.5, 6.4), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    top = max([_top(p) for p in panels] + [0.1])
    for ax, panel in zip(axes, panels):
        ax.set_ylim(0, top * 1.15)
        _panel(ax, panel)
    axes[0].set_ylabel("memory (GiB)")
    handles: dict[str, Any] = {}  # the areas and totals, once for every panel
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=4, fontsize=7.5, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    with files.replacing(path, "wb") as out:
        fig.savefig(out, dpi=110, format="png")
    return Path(path)


def _top(panel: Panel) -> float:
    series = panel.series()
    values = series["predicted"] + [v for _, v in series["measured"] + series["cuda"]] + list(series["lines"].values())
    return max(values or [0]) / GiB


LINES = {  # name -> colour, style, width
    "measured peak": ("#222222", "-.", 0.9),
    "predicted device total": ("#7b3294", ":", 1.1),
    "budget": ("#d62728", "-", 1.3),
    "card less the margin": ("#ff7f0e", "--", 1.1),
    "limit": ("#d62728", "-", 1.6),
}


def _panel(ax: Any, panel: Panel) -> None:
    points, series = panel.points, panel.series()
    x = list(range(len(points)))
    base = [0.0] * len(points)
    drawn = "predicted" if panel.predicted else "measured"
    for category in CATEGORIES:
        upper = [b + p["categories"].get(category, 0) / GiB for b, p in zip(base, points)]
        ax.fill_between(x, base, upper, color=COLORS[category], alpha=0.75, linewidth=0,
                        label=f"{NAMES[category]} ({drawn})")
        base = upper
    top = peak_point(points)
    if panel.predicted:
        ax.plot(x, [v / GiB for v in series["predicted"]], color="black", linewidth=1.0, linestyle="--",
                label="predicted total (tensors)")
    if series["measured"]:
        ax.plot([i for i, _ in series["measured"]], [v / GiB for _, v in series["measured"]], color="#111111",
                linewidth=1.8, marker="o", markersize=2.5, label="measured total (tracked tensors)")
    if series["cuda"]:
        ax.plot([i for i, _ in series["cuda"]], [v / GiB for _, v in series["cuda"]], color="#7b3294", linewidth=1.2,
                marker=".", label="measured torch.cuda.memory_allocated")
    lines = series["lines"]
    if "predicted peak" in lines and top is not None:
        value = lines["predicted peak"] / GiB
        ax.axhline(value, color="#444444", linewidth=0.8, linestyle=":")
        ax.annotate(f"predicted peak {value:.2f} GiB\n{where(top)}", (points.index(top), value), fontsize=7,
                    textcoords="offset points", xytext=(6, 4), arrowprops={"arrowstyle": "-", "linewidth": 0.5})
    placed: list[float] = []  # the names' heights so far: a name too close to another goes to the other side
    height = ax.get_ylim()[1]
    for name, (color, style, width) in sorted(LINES.items(), key=lambda item: lines.get(item[0], 0)):
        if name not in lines:
            continue
        y = lines[name] / GiB
        crowded = any(abs(y - other) < 0.04 * height for other in placed)
        placed.append(y)
        text = f"{name} {lines[name] / GiB:.2f} GiB"
        if name == "measured peak" and panel.measured_peak:
            text += f" ({panel.measured_peak[1]})"
        if name == "card less the margin":
            text = f"the card less the {panel.margin:.0%} margin {lines[name] / GiB:.2f} GiB"
        if name == "limit" and panel.limit:
            text = f"{panel.limit[1]} {lines[name] / GiB:.2f} GiB"
        ax.axhline(y, color=color, linestyle=style, linewidth=width)
        ax.text(0.995, y, text, transform=ax.get_yaxis_transform(), ha="right", va="top" if crowded else "bottom",
                fontsize=7, color=color)
    if panel.limit:
        crossed = crossing(points, panel.limit[0])
        if crossed is not None:
            i = points.index(crossed)
            ax.axvline(i, color="#d62728", linewidth=0.8, alpha=0.7)
            left = i > len(points) / 2  # the words on the side with room
            ax.annotate(f"crosses the limit here:\n{where(crossed)}", (i, total(crossed) / GiB), color="#d62728",
                        fontsize=8, textcoords="offset points", xytext=(-12 if left else 12, 16),
                        ha="right" if left else "left",
                        arrowprops={"arrowstyle": "->", "color": "#d62728"})
    ax.set_title("\n".join([panel.title, *panel.notes]), fontsize=8.5, loc="left")
    ticks = _ticks(points)
    ax.set_xticks([i for i, _ in ticks], [name for _, name in ticks], rotation=60, ha="right", fontsize=7)
    ax.set_xlabel("the step, in order: forward layer by layer, backward layer by layer, the optimizer step", fontsize=8)
    ax.set_xlim(0, max(len(points) - 1, 1))
    ax.grid(axis="y", linewidth=0.3, alpha=0.6)


def _ticks(points: Sequence[dict], most: int = 22) -> list[tuple[int, str]]:
    """A readable subset of the points' labels: the phases' edges and a few layers."""
    named = [(i, p["label"]) for i, p in enumerate(points) if not p.get("between")]
    if len(named) <= most:
        return named
    keep = {0, len(named) - 1}
    keep |= {
        i for i, (_, name) in enumerate(named) if not name.startswith(("forward: layer", "backward: layer", "step: "))
    }
    stride = max(1, len(named) // max(most - len(keep), 1))
    keep |= set(range(0, len(named), stride))
    return [named[i] for i in sorted(keep)]
