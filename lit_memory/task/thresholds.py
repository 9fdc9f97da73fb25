"""Decision thresholds: chosen on validation, kept with the model, applied by every evaluation and ``predict``.

A multi-label model predicts a label where its probability reaches the label's threshold; a binary single-label
model, where thresholds are in use, predicts class 1 where class 1's probability reaches its one threshold (else
the most probable class, as always). Where they come from, first found first:

1. ``model.threshold`` set by the user: one value for every label (it wins over any saved thresholds);
2. tuned on the validation split during ``fit`` (``model.tune_threshold``): per label, each label's F1 at its best
   threshold (multi-label's default), or one threshold for all (``global``: micro-F1 for multi-label, or
   ``model.threshold_metric`` for binary: F1 of class 1, MCC, accuracy or macro-F1);
3. saved with the model: a checkpoint's ``thresholds`` entry, ``hf_model/config.json``'s ``thresholds`` key
   (`CONFIG_KEY`: ``{label name: threshold}``);
4. `DEFAULT` (0.5) for multi-label; none (the most probable class) for single-label.

`Sweep` counts, over an evaluation, the true and false positives and negatives of every label at each threshold of
`GRID` (a torchmetrics `Metric`: synchronised over the ranks, constant memory), from which `choose` picks the
thresholds; `replay` turns the counts there into predictions that torchmetrics scores as it scores any evaluation:
the metrics at the tuned thresholds are exact, not re-estimated.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch
from torchmetrics import Metric

from lit_memory.errors import UserError
from lit_memory.task.kind import DEFAULT_THRESHOLD as DEFAULT
from lit_memory.task.kind import ProblemKind

CONFIG_KEY = "thresholds"  # in hf_model/config.json: {label name: threshold}
GRID = torch.arange(1, 100, dtype=torch.float32) / 100  # 0.01 ... 0.99: 0.5 on it
Tune = Literal["auto", "per_label", "global", "off"]
Objective = Literal["f1", "mcc", "acc", "f1_macro"]
TUNE_CHOICES = ("auto", "per_label", "global", "off")
OBJECTIVES = ("f1", "mcc", "acc", "f1_macro")


def uses_thresholds(kind: ProblemKind, num_labels: int) -> bool:
    """Whether a threshold can decide this task: multi-label, or single-label with two classes."""
    return kind.uses_thresholds(num_labels)


def tuning(kind: ProblemKind, num_labels: int, tune: str, threshold: Optional[float], objective: str) -> Optional[str]:
    """What ``fit`` tunes (``per_label``, ``global`` or None), checked against the task: one error line for a
    threshold asked of a task that has none, or two settings that contradict each other."""
    if tune not in TUNE_CHOICES:
        raise UserError(f"model.tune_threshold {tune!r} is not one of: {', '.join(TUNE_CHOICES)}")
    if objective not in OBJECTIVES:
        raise UserError(f"model.threshold_metric {objective!r} is not one of: {', '.join(OBJECTIVES)}")
    if threshold is not None and not 0.0 < threshold < 1.0:
        raise UserError(f"model.threshold must be in (0, 1), got {threshold}")
    asked = threshold is not None or tune in ("per_label", "global")
    if asked and not kind.uses_thresholds(num_labels):
        what = kind.no_threshold(num_labels)
        setting = "model.threshold" if threshold is not None else f"model.tune_threshold {tune}"
        raise UserError(
            f"{setting}: {what}, there is no threshold to set (thresholds decide multi-label and binary tasks)"
        )
    kind.check_tuning(tune)
    if threshold is not None and tune in ("per_label", "global"):
        raise UserError(
            f"model.threshold {threshold} fixes the threshold and model.tune_threshold {tune} tunes it: set one of them"
        )
    if threshold is not None or tune == "off":
        return None
    if tune == "auto":
        return kind.default_tuning()
    return tune


def probabilities(logits: torch.Tensor, kind: ProblemKind) -> torch.Tensor:
    """What a threshold is compared with, one column per label: each label's probability (multi-label), or class 1's
    (binary)."""
    return kind.probabilities(logits)


def decide(logits: torch.Tensor, kind: ProblemKind, thresholds: Optional[torch.Tensor]) -> torch.Tensor:
    """Predictions as the metrics take them: class ids (single-label: class 1 where its probability reaches the
    threshold, else the most probable class), 0/1 per label (multi-label: probability >= its threshold), values."""
    return kind.decide(logits, thresholds)


class Sweep(Metric):
    """True/false positives and negatives of each label at each threshold of `GRID`: ``compute()`` is a
    ``(4, thresholds, labels)`` tensor of tp, fp, fn, tn, summed over the ranks."""

    full_state_update = False

    def __init__(self, num_labels: int) -> None:
        super().__init__()
        self.register_buffer("grid", GRID.clone(), persistent=False)
        self.add_state("counts", torch.zeros(4, len(GRID), num_labels, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, probs: torch.Tensor, targets: torch.Tensor) -> None:
        """``probs`` (rows, labels) against 0/1 ``targets`` of the same shape."""
        positive = targets.bool().unsqueeze(0)  # (1, rows, labels)
        for start in range(0, probs.shape[0], 256):  # (thresholds, rows, labels) booleans, a slice at a time
            predicted = probs[start : start + 256].unsqueeze(0) >= self.grid.view(-1, 1, 1)
            truth = positive[:, start : start + 256]
            self.counts[0] += (predicted & truth).sum(1)
            self.counts[1] += (predicted & ~truth).sum(1)
            self.counts[2] += (~predicted & truth).sum(1)
            self.counts[3] += (~predicted & ~truth).sum(1)

    def compute(self) -> torch.Tensor:
        return self.counts


def _f1(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    tp, fp, fn = tp.double(), fp.double(), fn.double()
    denominator = 2 * tp + fp + fn
    return torch.where(denominator > 0, 2 * tp / denominator.clamp(min=1), torch.zeros_like(tp))


def binary_scores(tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor, tn: torch.Tensor) -> dict[str, torch.Tensor]:
    """A binary task's metrics from its counts (any shape, elementwise), as torchmetrics defines them."""
    tp, fp, fn, tn = (x.double() for x in (tp, fp, fn, tn))
    total = (tp + fp + fn + tn).clamp(min=1)
    f1, f1_negative = _f1(tp, fp, fn), _f1(tn, fn, fp)
    mcc_denominator = ((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)).sqrt()
    mcc = torch.where(mcc_denominator > 0, (tp * tn - fp * fn) / mcc_denominator.clamp(min=1e-12), torch.zeros_like(tp))
    return {"acc": (tp + tn) / total, "f1": f1, "f1_macro": (f1 + f1_negative) / 2, "mcc": mcc}


def choose(counts: torch.Tensor, mode: str, kind: ProblemKind, objective: str = "f1",
           default: float = DEFAULT) -> torch.Tensor:
    """The grid index of each label's threshold (``per_label``: each label's best F1) or of the one for all
    (``global``: micro-F1 for multi-label, ``objective`` for binary). Of equal scores, the threshold nearest
    ``default``; a label with no positive and no prediction at all keeps ``default``."""
    tp, fp, fn, tn = counts.double()
    if mode == "per_label":
        score = _f1(tp, fp, fn)  # (thresholds, labels)
    elif kind.thresholds_per_label:  # several labels: their micro-F1
        score = _f1(tp.sum(-1), fp.sum(-1), fn.sum(-1)).unsqueeze(-1).expand_as(tp)
    else:
        score = binary_scores(tp, fp, fn, tn)[objective]
    distance = (GRID.to(score.device, torch.float64) - default).abs().unsqueeze(-1)
    best = score.max(0, keepdim=True).values
    # Ties: the nearest to the default (a score equal within float error counts as equal).
    candidates = torch.where(score >= best - 1e-12, -distance.expand_as(score), torch.full_like(score, -10.0))
    return candidates.argmax(0)


def at(counts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The counts (4, labels) at each label's own grid index."""
    return counts.gather(1, index.view(1, 1, -1).expand(4, 1, -1)).squeeze(1)


def replay(chosen: torch.Tensor, kind: ProblemKind) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions and targets with exactly the counts (4, labels) at the chosen thresholds, in the form the metrics
    take (multi-label: rows x labels of 0/1; binary: class ids): every metric at the chosen thresholds is then
    torchmetrics' own, as at any other threshold."""
    tp, fp, fn, tn = (c.long().cpu() for c in chosen)
    columns_p, columns_t = [], []
    for i in range(chosen.shape[1]):
        counts = [int(tp[i]), int(fp[i]), int(fn[i]), int(tn[i])]
        columns_p.append(torch.repeat_interleave(torch.tensor([1, 1, 0, 0]), torch.tensor(counts)))
        columns_t.append(torch.repeat_interleave(torch.tensor([1, 0, 1, 0]), torch.tensor(counts)))
    preds, targets = torch.stack(columns_p, -1), torch.stack(columns_t, -1)
    if kind.thresholds_per_label:
        return preds.float(), targets
    return preds[:, 0], targets[:, 0]


def confusion(chosen: torch.Tensor, kind: ProblemKind) -> torch.Tensor:
    """The counts at the chosen thresholds as `lit_memory.task.evaluation.ClassCounts` holds them: (labels, 2, 2) as
    [[tn, fp], [fn, tp]] (multi-label), or the 2 x 2 confusion matrix, rows the true class (binary)."""
    tp, fp, fn, tn = chosen
    if kind.thresholds_per_label:
        return torch.stack([torch.stack([tn, fp], -1), torch.stack([fn, tp], -1)], -2)
    return torch.tensor([[int(tn[0]), int(fp[0])], [int(fn[0]), int(tp[0])]])


@dataclass(frozen=True)
class Thresholds:
    """The thresholds a model decides with (one per label; binary: one, for class 1) and where they came from."""

    values: tuple[float, ...]
    origin: str

    @property
    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.values, dtype=torch.float32)

    def describe(self, names: Sequence[str], kind: ProblemKind) -> str:
        shown = kind.describe_thresholds(self.values, names)
        return f"thresholds ({self.origin}): {shown}"

    def to_config(self, names: Sequence[str], kind: ProblemKind) -> dict[str, float]:
        """`CONFIG_KEY`'s value: each label's threshold by name (binary: class 1's)."""
        keys = kind.threshold_keys(names)
        return {str(k): float(v) for k, v in zip(keys, self.values)}


def from_config(saved: object, names: Sequence[str], kind: ProblemKind, where: str) -> Optional[tuple[float, ...]]:
    """`CONFIG_KEY`'s value read back as one threshold per label (in the model's label order); None where it
    holds none, or thresholds for other labels (a warning: a head resized for another task)."""
    if not saved:
        return None
    keys = kind.threshold_keys(names)
    try:
        values = tuple(float(saved[k]) for k in keys)  # type: ignore[index]
        fits = isinstance(saved, dict) and len(saved) == len(keys) and all(0.0 < v < 1.0 for v in values)
    except (KeyError, TypeError, ValueError):
        fits = False
    if not fits:
        warnings.warn(
            f"{where}: its {CONFIG_KEY!r} ({saved!r}) are not one threshold in (0, 1) for each of the model's "
            f"labels {keys}: not used"
        )
        return None
    return values


def default_for(kind: ProblemKind, num_labels: int, threshold: Optional[float]) -> Optional[Thresholds]:
    """``model.threshold`` where set, else 0.5 for every label (multi-label) or none (the most probable class)."""
    count = kind.threshold_count(num_labels)
    if threshold is not None:
        return Thresholds((float(threshold),) * count, "model.threshold, as set")
    if kind.thresholded_by_default:
        return Thresholds((DEFAULT,) * count, "the default")
    return None


def first(kind: ProblemKind, num_labels: int, threshold: Optional[float], saved: object, names: Sequence[str],
          where: str) -> Optional[Thresholds]:
    """The thresholds a model starts with: those set, else those its config saved (``saved``, read from ``where``:
    an exported folder's), else `default_for`'s."""
    if not uses_thresholds(kind, num_labels):
        return None
    if threshold is None:
        found = from_config(saved, names, kind, where)
        if found is not None:
            return Thresholds(found, f"saved in {where}")
    return default_for(kind, num_labels, threshold)


def differ_from_default(found: Optional[Thresholds]) -> bool:
    """Whether the thresholds in use differ from 0.5 (tuned or saved): the metrics at 0.5 are shown beside."""
    return found is not None and any(v != DEFAULT for v in found.values)
