"""Metrics by problem type (torchmetrics), the per-class report and the confusion matrix.

- single-label: ``acc``, ``f1_macro``, ``mcc`` (Matthews, CoLA's metric), and ``f1`` (of class 1, binary);
- regression: ``mse``, ``pearson``, ``spearman`` (STS-B's);
- multi-label: ``f1_micro``, ``f1_macro`` and ``f1_<label>`` for each label, at the model's thresholds
  (`lit_memory.task.thresholds`: the predictions come decided, one 0/1 per label).

`ClassCounts` keeps the confusion counts of an evaluation (torchmetrics' confusion matrices, synchronised over the
ranks) for `report` (precision, recall, F1 and support per class, and the loss weight where class weights are set),
`draw_confusion` (a PNG; matplotlib is optional: without it, no picture and one line saying so) and `one_sided` (a
validation that predicts one class for every row; multi-label: the same labels for every row, every label or none).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torchmetrics import MetricCollection

from lit_memory import files
from lit_memory.task.kind import ProblemKind


def metric_name(label: str) -> str:
    """A label as part of a logged metric's name (``f1_<label>``): letters, digits and underscores."""
    return re.sub(r"\W+", "_", str(label)).strip("_") or "label"


def task_metrics(kind: ProblemKind, num_labels: int, threshold: float = 0.5, **kwargs: Any) -> MetricCollection:
    """The metrics of a problem type (module docstring; the kind's), the per-label F1 beside them (multi-label).
    ``kwargs`` go to every metric (``sync_on_compute=False``: counts already summed over the ranks)."""
    return kind.metrics(num_labels, threshold, **kwargs)


class ClassCounts(torch.nn.Module):
    """Confusion counts over an evaluation: a class x class matrix (single-label), a 2 x 2 per label (multi-label)."""

    def __init__(self, kind: ProblemKind, num_labels: int, threshold: float = 0.5) -> None:
        super().__init__()
        self.kind = kind
        self.matrix = kind.class_counts(num_labels, threshold)

    def update(self, predicted: torch.Tensor, labels: torch.Tensor) -> None:
        self.matrix.update(predicted, labels)

    def compute(self) -> torch.Tensor:
        return self.matrix.compute().cpu()

    def reset(self) -> None:
        self.matrix.reset()


def report(stage: str, counts: torch.Tensor, names: Sequence[str], kind: ProblemKind, title: str = "", *,
           weights: Optional[Sequence[float]] = None) -> str:
    """Precision, recall, F1 and support per class (or label), the loss weight of each where class weights are set
    (multi-label: its positives' ``pos_weight``), and for single-label the confusion matrix; ``title`` follows the
    stage (`` at step 56, exported to hf_model``)."""
    rows = kind.report_rows(counts, names)
    header = f"{stage} per {kind.label_word}:"
    width = max(len(header) + 1, *(len(shown_name(r[0])) + 4 for r in rows))  # "  name  ", every name whole
    lines = [f"{stage}{title}:"] if title else []
    lines += [header.ljust(width)
              + f"{'precision':>10}{'recall':>10}{'f1':>10}{'support':>10}" + (f"{'weight':>10}" if weights else "")]
    for i, (name, tp, fp, fn) in enumerate(rows):
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        weight = f"{weights[i]:>10.3g}" if weights else ""
        lines.append(
            f"  {shown_name(name)}".ljust(width) + f"{precision:>10.4f}{recall:>10.4f}{f1:>10.4f}{tp + fn:>10}{weight}"
        )
    if kind.draws_confusion:
        lines.append("confusion matrix (rows: true class, columns: predicted):")
        table = counts.tolist()
        cells = [max(8, len(shown_name(n)) + 2, *(len(str(row[j])) + 2 for row in table)) for j, n in enumerate(names)]
        lines.append(" " * width + "".join(f"{shown_name(n):>{c}}" for n, c in zip(names, cells)))
        for name, row in zip(names, table):
            lines.append(f"  {shown_name(name)}".ljust(width) + "".join(f"{v:>{c}}" for v, c in zip(row, cells)))
    return "\n".join(lines)


NAME_WIDTH = 40  # a class name longer than this is cut, its last character an ellipsis


def shown_name(name: Any) -> str:
    """A class name as the report shows it: whole, up to `NAME_WIDTH` characters."""
    text = str(name)
    return text if len(text) <= NAME_WIDTH else text[: NAME_WIDTH - 1] + "\u2026"


def one_sided(counts: torch.Tensor, names: Sequence[str], kind: ProblemKind, weighted: bool = False) -> Optional[str]:
    """One line where an evaluation's predictions are all one class (single-label) or the same labels for every row
    (multi-label: every label, or none), with what to try (``weighted``: class weights are set already); None
    otherwise."""
    found = kind.one_sided(counts, names)
    if found is None:
        return None
    said, more = found
    tries = ["more epochs (--trainer.max_epochs)", "a higher learning rate (--model.optimizer.init_args.lr 5e-5)"]
    if not weighted:
        tries.append(f"--model.class_weights balanced for rare {kind.label_words}")
    tries += more
    return f"warning: {said}: the model has not learned the task yet; try {', '.join(tries[:-1])} or {tries[-1]}"


def draw_confusion(counts: torch.Tensor, names: Sequence[str], path: Path, title: str) -> Optional[Path]:
    """The confusion matrix as a PNG (counts in the cells, each row shaded by its share): None without matplotlib."""
    try:
        from matplotlib.figure import Figure  # deferred: optional, heavy; no pyplot: no GUI backend, no global state
    except ImportError:
        return None
    n = len(names)
    size = min(2 + 0.6 * n, 16)
    fig = Figure(figsize=(size + 1.5, size), layout="constrained")
    ax = fig.subplots()
    totals = counts.sum(1, keepdim=True).clamp(min=1)
    image = ax.imshow((counts / totals).numpy(), cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, label="share of the true class")
    ax.set_xticks(range(n), [str(x) for x in names], rotation=45 if n > 4 else 0, ha="right" if n > 4 else "center")
    ax.set_yticks(range(n), [str(x) for x in names])
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title, fontsize=10)
    if n <= 30:
        for i in range(n):
            for j in range(n):
                share = counts[i, j] / totals[i, 0]
                ax.text(j, i, f"{int(counts[i, j])}", ha="center", va="center", fontsize=8,
                        color="white" if share > 0.5 else "black")
    with files.replacing(path, "wb") as f:
        fig.savefig(f, dpi=110, format="png")
    return path
