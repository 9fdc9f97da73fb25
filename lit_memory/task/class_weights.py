"""Class weights for imbalanced labels: ``model.class_weights none|balanced|[w1, w2, ...]``.

- single-label: weighted cross-entropy (torch's ``weight``: the loss is the weighted mean over the rows), one weight
  per class; ``balanced`` is scikit-learn's ``compute_class_weight("balanced")``: rows / (classes x the class's
  rows), so every class weighs as much in the loss as the others in all;
- multi-label: the binary cross-entropy's ``pos_weight``, one per label, multiplying the loss of its positives;
  ``balanced`` is negatives / positives of each label (the value torch's documentation gives for it), so a label's
  positives weigh as much as its negatives;
- regression: none (a value has no class to weigh).

``balanced`` reads the training rows as they are trained on (`count`): windows where long texts are split
(``data.long_texts chunk``). ``none`` (the default) is the plain loss each head computes (Hugging Face's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence, Union

import torch

from lit_memory.errors import UserError
from lit_memory.task.kind import ProblemKind

ClassWeights = Union[Literal["none", "balanced"], list[float]]


@dataclass(frozen=True)
class LabelCounts:
    """The training rows and, per class, its rows (single-label) or, per label, its positive rows (multi-label)."""

    rows: int
    per_label: tuple[int, ...]


def count(labels: torch.Tensor, kind: ProblemKind, num_labels: int) -> LabelCounts:
    """The counts of a split's ``labels`` column (class ids, or one 0/1 per label)."""
    return LabelCounts(int(labels.shape[0]), kind.count(labels, num_labels))


def check(setting: Optional[ClassWeights], kind: ProblemKind, num_labels: int) -> None:
    """One error line for a setting the task cannot take."""
    if setting is None or setting == "none":
        return
    kind.check_weights(setting)
    if isinstance(setting, str):
        if setting != "balanced":
            raise UserError(f"model.class_weights {setting!r} is not one of: none, balanced, or a list of weights")
        return
    if len(setting) != num_labels:
        raise UserError(
            f"model.class_weights has {len(setting)} weight(s) for {num_labels} {kind.label_words}: "
            f"{kind.weights_order}"
        )
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 and w == w and w != float("inf")
               for w in setting) or not any(w > 0 for w in setting):
        raise UserError(f"model.class_weights {list(setting)}: weights are finite numbers >= 0, not all 0")


def resolve(setting: Optional[ClassWeights], counts: Optional[LabelCounts], kind: ProblemKind,
            num_labels: int) -> Optional[torch.Tensor]:
    """The weights the loss takes (None: unweighted), ``balanced`` computed from ``counts``."""
    check(setting, kind, num_labels)
    if setting is None or setting == "none":
        return None
    if setting != "balanced":
        return torch.tensor([float(w) for w in setting], dtype=torch.float32)
    if counts is None:
        raise UserError("model.class_weights balanced needs the training labels' counts: fit with a data module")
    per = torch.tensor(counts.per_label, dtype=torch.float64)
    return kind.balanced(counts.rows, per, num_labels).float()


def loss(logits: torch.Tensor, labels: torch.Tensor, kind: ProblemKind,
         weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The batch's mean loss, weighted where ``weights`` are given: what Hugging Face's heads compute otherwise."""
    if weights is not None:
        weights = weights.to(logits.device)
    return kind.loss(logits, labels, weights)


def describe(setting: Optional[ClassWeights], weights: Optional[torch.Tensor], counts: Optional[LabelCounts],
             names: Sequence[str], kind: ProblemKind) -> Optional[str]:
    """For the ``data:`` line: each class's (label's) weight with the count it comes from."""
    if weights is None:
        return None
    how = "balanced" if setting == "balanced" else "as set"
    parts = [
        f"{name} {w:.3g}" + (f" ({counts.per_label[i]:,})" if counts is not None else "")
        for i, (name, w) in enumerate(zip(names, weights.tolist()))
    ]
    shown = ", ".join(parts[:12]) + (f", ... ({len(parts)} in all)" if len(parts) > 12 else "")
    if counts is None:
        return f"{kind.weight_name} {how}: {shown}"
    return f"{kind.weight_name} {how} (of {counts.rows:,} training rows; their {kind.counted} in brackets): {shown}"
