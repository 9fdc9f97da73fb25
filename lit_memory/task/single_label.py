"""Single-label classification: one class per row (cross-entropy), a class name or id per label."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torchmetrics import MetricCollection
from torchmetrics.classification import (
    BinaryF1Score,
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
    MulticlassMatthewsCorrCoef,
)

from lit_memory.errors import UserError
from lit_memory.task.kind import IGNORE, ProblemKind, Task, checked_count, integral, is_number, register


@register
class SingleLabel(ProblemKind):
    """One class per row: the most probable class, or class 1 where a binary task's threshold says."""

    name = "single_label_classification"
    title = "single-label classification"
    main_metric = "f1_macro"
    target_dtype = torch.long
    draws_confusion = True

    def claims(self, present: list, several: bool) -> bool:
        if several or all(isinstance(v, (list, tuple)) for v in present):
            return False
        return not (all(is_number(v) for v in present) and not all(integral(v) for v in present))

    def task(self, present: list, columns: Any, num_labels: Optional[int], label_names: Optional[Sequence[str]],
             where: str) -> Task:
        if len(columns.label) > 1:
            raise UserError(
                f"several label columns {list(columns.label)} are multi-label (one 0/1 column per label): set "
                "model.problem_type multi_label_classification, or name one column"
            )
        column = columns.label[0]
        for value in present:
            if isinstance(value, (list, tuple)):
                raise UserError(
                    f"label {value!r} in column {column!r} of {where} is a list: problem_type "
                    "single_label_classification "
                    "expects one class per row (set model.problem_type multi_label_classification)"
                )
            if isinstance(value, float) and not value.is_integer():
                raise UserError(
                    f"label {value!r} in column {column!r} of {where} is not a class: problem_type "
                    "single_label_classification expects class names or ids (set model.problem_type regression for "
                    "values)"
                )
        if label_names:
            names = tuple(str(n) for n in label_names)
            return checked_count(Task(self, max(len(names), num_labels or 0), names, columns), None)
        if all(integral(v) for v in present):
            ids = [int(v) for v in present]
            if min(ids) < 0:
                raise UserError(
                    f"label {min(ids)} in column {column!r} of {where}: class ids start at 0 (or give data.label_names)"
                )
            count = max(ids) + 1
            if num_labels is not None and count > num_labels:
                raise UserError(
                    f"label {max(ids)} in column {column!r} of {where} is outside num_labels={num_labels} (expected "
                    f"0..{num_labels - 1}); set model.num_labels or data.label_names"
                )
            total = max(num_labels or 2, count)
            return Task(self, total, tuple(str(i) for i in range(total)), columns)  # the ids as the file writes them
        names = tuple(sorted({str(v) for v in present}))  # like datasets' class_encode_column
        return checked_count(Task(self, max(len(names), 2), names, columns), num_labels)

    def outputs_words(self, num_labels: int) -> str:
        return f"{num_labels} classes"

    def encode(self, split: Any, task: Task) -> tuple[Any, list[str]]:
        import datasets  # deferred: only where data is read

        index = {str(n): i for i, n in enumerate(task.label_names or ())}
        column = task.columns.label[0]

        def class_id(value: Any) -> int:
            if isinstance(value, str) and value in index:
                return index[value]
            if isinstance(value, str) and index:
                return -1  # not listed: dropped
            if isinstance(value, str) and value.strip().lstrip("-").isdigit():
                value = int(value)
            return int(value)

        split = split.map(lambda row: {"labels": class_id(row[column])})
        outside = [str(v) for v, i in zip(split[column], split["labels"]) if not 0 <= i < task.num_labels]
        split = split.filter(lambda row: 0 <= row["labels"] < task.num_labels)
        return split.cast_column("labels", datasets.Value("int64")), outside

    def stratify_classes(self, task: Task) -> Optional[int]:
        return task.num_labels

    def target(self, raw: Sequence[Any], label_id: Callable[[Any], int], num_labels: int) -> tuple[Any, bool, Any]:
        index = label_id(raw[0])
        return index, index != IGNORE, raw[0]

    def unknown(self, num_labels: int) -> Any:
        return IGNORE

    def named(self, value: Any, names: Sequence[str]) -> Any:
        return names[value]

    def fake_labels(self, rows: int, num_labels: int) -> torch.Tensor:
        return torch.zeros(rows, dtype=torch.long)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor] = None,
             reduction: str = "mean") -> torch.Tensor:
        logits = logits.float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), weight=weights,
                                                 reduction=reduction)

    def balanced(self, rows: int, per_label: torch.Tensor, num_labels: int) -> torch.Tensor:
        return rows / (num_labels * per_label.clamp(min=1))  # scikit-learn's n / (k * count)

    def outputs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().argmax(-1)

    def written(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().softmax(-1)

    def metrics(self, num_labels: int, threshold: float = 0.5, **kwargs: Any) -> MetricCollection:
        metrics = {
            "acc": MulticlassAccuracy(num_labels, average="micro", **kwargs),
            "f1_macro": MulticlassF1Score(num_labels, average="macro", **kwargs),
            "mcc": MulticlassMatthewsCorrCoef(num_labels, **kwargs),
        }
        if num_labels == 2:
            metrics["f1"] = BinaryF1Score(**kwargs)  # F1 of the positive class: the seed's `f1`
        return MetricCollection(metrics)

    def class_counts(self, num_labels: int, threshold: float = 0.5) -> MulticlassConfusionMatrix:
        return MulticlassConfusionMatrix(num_labels)

    def one_sided(self, counts: torch.Tensor, names: Sequence[str]) -> Optional[tuple[str, list[str]]]:
        predicted = counts.sum(0)
        if int((predicted > 0).sum()) != 1:
            return None
        return f"every validation prediction is {names[int(predicted.argmax())]!r}", []

    def header(self, names: Sequence[str]) -> list[str]:
        return ["label", *(f"prob_{n}" for n in names)]

    def prediction(self, out: Sequence[float], names: Sequence[str], limits: Optional[Sequence[float]],
                   joined: bool) -> list[Any]:
        if limits is not None and len(out) == 2:  # binary with a threshold on class 1's probability
            label = names[1] if out[1] >= limits[0] else names[0]
        else:
            label = names[max(range(len(out)), key=out.__getitem__)]
        return [label, *(round(p, 6) for p in out)]

    def usage(self, names: Sequence[str], thresholded: bool) -> list[str]:
        if thresholded:
            return [f"threshold = classifier.model.config.thresholds[{names[1]!r}]",
                    "for scores in classifier(texts):",
                    '    probability = {s["label"]: s["score"] for s in scores}',
                    f"    print({names[1]!r} if probability[{names[1]!r}] >= threshold else {names[0]!r})"]
        return ["for scores in classifier(texts):  # each class's probability, the most probable first",
                '    print(scores[0]["label"])']

    def uses_thresholds(self, num_labels: int) -> bool:
        return num_labels == 2

    def no_threshold(self, num_labels: int) -> str:
        return f"a single-label task with {num_labels} classes predicts the most probable one"

    def check_tuning(self, tune: str) -> None:
        if tune == "per_label":
            raise UserError("model.tune_threshold per_label: a binary task has one threshold (use global)")

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().softmax(-1)[:, 1:2]

    def decide(self, logits: torch.Tensor, thresholds: Optional[torch.Tensor]) -> torch.Tensor:
        if thresholds is None:
            return logits.float().argmax(-1)
        return (self.probabilities(logits)[:, 0] >= thresholds.to(logits.device)[0]).long()
