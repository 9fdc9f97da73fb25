"""Multi-label classification: any number of labels per row (binary cross-entropy per label), given as a list of
names (or ids) per row, or as one 0/1 column per label."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torchmetrics import MetricCollection
from torchmetrics.classification import MultilabelConfusionMatrix, MultilabelF1Score

from lit_memory.errors import UserError
from lit_memory.task.kind import DEFAULT_THRESHOLD, IGNORE, ProblemKind, Task, checked_count, register


@register
class MultiLabel(ProblemKind):
    """Each label predicted where its probability (sigmoid) reaches its threshold."""

    name = "multi_label_classification"
    title = "multi-label classification"
    main_metric = "f1_micro"
    target_dtype = torch.float32
    label_word, label_words = "label", "labels"
    weight_name = "pos_weight"
    weights_order = "one per label (its positives' pos_weight), in label order"
    counted = "positives"
    window_reduce = "amax"  # a label any window finds is the text's
    thresholds_per_label = thresholded_by_default = True

    def claims(self, present: list, several: bool) -> bool:
        return several or all(isinstance(v, (list, tuple)) for v in present)

    def task(self, present: list, columns: Any, num_labels: Optional[int], label_names: Optional[Sequence[str]],
             where: str) -> Task:
        labels = columns.label
        if len(labels) > 1:  # one 0/1 column per label, named by its column
            for row in present:
                for name, value in zip(labels, row):
                    if value not in (0, 1, True, False, 0.0, 1.0):
                        raise UserError(
                            f"label {value!r} in column {name!r} of {where}: multi-label columns hold 0 or 1 (a label "
                            "present or not)"
                        )
            names = tuple(label_names) if label_names else labels
            if len(names) != len(labels):
                raise UserError(
                    f"data.label_names has {len(names)} names for {len(labels)} label columns {list(labels)}"
                )
            return checked_count(Task(self, len(names), names, columns), num_labels)
        column = labels[0]
        seen: list[Any] = []
        for value in present:
            if not isinstance(value, (list, tuple)):
                raise UserError(
                    f"label {value!r} in column {column!r} of {where} is not a list: problem_type "
                    "multi_label_classification expects a list of label names per row (JSON/JSONL), or several 0/1 "
                    "columns (data.label_column [a, b, c])"
                )
            seen.extend(value)
        if label_names:
            names = tuple(str(n) for n in label_names)
            unknown = sorted({str(v) for v in seen} - set(names), key=str)
            if unknown:
                raise UserError(
                    f"a row of {where} names label {unknown[0]!r} in column {column!r}, which data.label_names "
                    f"{list(names)} does not list"
                )
        elif seen and all(isinstance(v, int) and not isinstance(v, bool) for v in seen):
            if min(seen) < 0:
                raise UserError(f"label id {min(seen)} in column {column!r} of {where}: ids start at 0")
            total = max(num_labels or 0, max(seen) + 1)
            return checked_count(Task(self, total, tuple(str(i) for i in range(total)), columns), None)
        else:
            names = tuple(sorted({str(v) for v in seen}))
        if not names:
            raise UserError(f"column {column!r} of {where} names no label in any row")
        return checked_count(Task(self, len(names), names, columns), num_labels)

    def outputs_words(self, num_labels: int) -> str:
        return f"{num_labels} labels, any number per row"

    def encode(self, split: Any, task: Task) -> tuple[Any, list[str]]:
        import datasets  # deferred: only where data is read

        labels = task.columns.label
        split = split.map(lambda row: {"labels": multi_hot(row, labels, task)})
        return split.cast_column("labels", datasets.Sequence(datasets.Value("float32"))), []

    def target(self, raw: Sequence[Any], label_id: Callable[[Any], int], num_labels: int) -> tuple[Any, bool, Any]:
        if len(raw) > 1:  # one 0/1 column per label
            return [float(v) for v in raw], all(v in (0, 1, True, False, "0", "1") for v in raw), raw
        names = raw[0] if isinstance(raw[0], (list, tuple)) else [raw[0]]
        hot, known = [0.0] * num_labels, True
        for name in names:
            index = label_id(name)
            known = known and index != IGNORE
            if index != IGNORE:
                hot[index] = 1.0
        return hot, known, list(names)

    def unknown(self, num_labels: int) -> Any:
        return [0.0] * num_labels

    def fake_labels(self, rows: int, num_labels: int) -> torch.Tensor:
        return torch.zeros(rows, num_labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor] = None,
             reduction: str = "mean") -> torch.Tensor:
        per = torch.nn.functional.binary_cross_entropy_with_logits(
            logits.float(), labels.float(), pos_weight=weights, reduction=reduction)
        return per.mean(-1) if reduction == "none" else per  # per row: its labels' mean

    def count(self, labels: torch.Tensor, num_labels: int) -> tuple[int, ...]:
        per_label = labels.round().long().sum(0) if len(labels) else torch.zeros(num_labels, dtype=torch.long)
        return tuple(int(c) for c in per_label.tolist())

    def balanced(self, rows: int, per_label: torch.Tensor, num_labels: int) -> torch.Tensor:
        # negatives / positives; a label without positives is left unweighted
        return torch.where(per_label > 0, (rows - per_label) / per_label.clamp(min=1), torch.ones_like(per_label))

    def outputs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().sigmoid()

    def written(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().sigmoid()

    def metric_targets(self, labels: torch.Tensor) -> torch.Tensor:
        return labels.round().long()

    def metrics(self, num_labels: int, threshold: float = DEFAULT_THRESHOLD, **kwargs: Any) -> MetricCollection:
        return MetricCollection({
            "f1_micro": MultilabelF1Score(num_labels, threshold=threshold, average="micro", **kwargs),
            "f1_macro": MultilabelF1Score(num_labels, threshold=threshold, average="macro", **kwargs),
        })

    def per_label_f1(self, num_labels: int, threshold: float = DEFAULT_THRESHOLD, **kwargs: Any) -> MultilabelF1Score:
        return MultilabelF1Score(num_labels, threshold=threshold, average="none", **kwargs)

    def class_counts(self, num_labels: int, threshold: float = DEFAULT_THRESHOLD) -> MultilabelConfusionMatrix:
        return MultilabelConfusionMatrix(num_labels, threshold=threshold)

    def report_rows(self, counts: torch.Tensor, names: Sequence[str]) -> list[tuple[str, int, int, int]]:
        rows = []
        for name, matrix in zip(names, counts.tolist()):  # (labels, 2, 2) as [[tn, fp], [fn, tp]]
            (_, fp), (fn, tp) = matrix
            rows.append((name, tp, fp, fn))
        return rows

    def one_sided(self, counts: torch.Tensor, names: Sequence[str]) -> Optional[tuple[str, list[str]]]:
        # The predictions do not depend on the input: each label predicted for every row or for none.
        predicted = counts[:, :, 1].sum(-1)  # (labels, 2, 2) as [[tn, fp], [fn, tp]]: rows predicted, per label
        everywhere, nowhere = predicted == counts[0].sum(), predicted == 0
        if not bool((everywhere | nowhere).all()):
            return None
        if bool(nowhere.all()):
            said = "the validation predicts no label for any row (every probability below its threshold)"
            return said, ["--model.tune_threshold per_label"]
        if bool(everywhere.all()):
            return "the validation predicts every label for every row (every probability at or above its threshold)", []
        on = [str(n) for n, every in zip(names, everywhere.tolist()) if every]
        return f"the validation predicts the same labels for every row ({', '.join(on)}; no other)", []

    def header(self, names: Sequence[str]) -> list[str]:
        return ["labels", *(f"prob_{n}" for n in names)]

    def prediction(self, out: Sequence[float], names: Sequence[str], limits: Optional[Sequence[float]],
                   joined: bool) -> list[Any]:
        chosen = [n for n, p, t in zip(names, out, limits or [DEFAULT_THRESHOLD] * len(names)) if p >= t]
        return ["|".join(chosen) if joined else chosen, *(round(p, 6) for p in out)]

    def usage(self, names: Sequence[str], thresholded: bool) -> list[str]:
        return ["thresholds = classifier.model.config.thresholds  # {label: threshold}",
                "for scores in classifier(texts):  # each label's probability (sigmoid)",
                '    print([s["label"] for s in scores if s["score"] >= thresholds[s["label"]]])']

    def uses_thresholds(self, num_labels: int) -> bool:
        return True

    def threshold_count(self, num_labels: int) -> int:
        return num_labels

    def default_tuning(self) -> Optional[str]:
        return "per_label"

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().sigmoid()

    def decide(self, logits: torch.Tensor, thresholds: Optional[torch.Tensor]) -> torch.Tensor:
        limits = thresholds if thresholds is not None else torch.full((logits.shape[-1],), DEFAULT_THRESHOLD)
        return (logits.float().sigmoid() >= limits.to(logits.device)).float()

    def sweep_targets(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

    def tuned_for(self, mode: str, objective: str) -> str:
        return "micro-F1"

    def threshold_keys(self, names: Sequence[str]) -> list[str]:
        return list(names)

    def describe_thresholds(self, values: Sequence[float], names: Sequence[str]) -> str:
        if len(set(values)) == 1:
            return f"{values[0]:g} for every label"
        return ", ".join(f"{n} {v:g}" for n, v in zip(names, values))


def multi_hot(row: dict[str, Any], labels: tuple[str, ...], task: Task) -> list[float]:
    """A multi-label row as one 0/1 value per label: several 0/1 columns as they are, or a list of names (or ids)."""
    if len(labels) > 1:
        return [float(row[c]) for c in labels]
    index = {n: i for i, n in enumerate(task.label_names)} if task.label_names else None
    out = [0.0] * task.num_labels
    for value in row[labels[0]]:
        out[index[str(value)] if index is not None else int(value)] = 1.0
    return out
