"""Regression: one value per row (mean squared error), STS-B's metrics (Pearson, Spearman)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torchmetrics import MeanSquaredError, MetricCollection, PearsonCorrCoef, SpearmanCorrCoef

from lit_memory.console import say
from lit_memory.errors import UserError
from lit_memory.task.kind import ProblemKind, Task, integral, is_number, numeric_text, register

# torchmetrics' caution at every SpearmanCorrCoef made (each module built, the memory model's meta builds too): said
# once instead, where an evaluation feeds it (`before_evaluation`), never for a predict without labels.
SPEARMAN_BUFFER = r".*SpearmanCorrcoef` will save all targets and predictions in the buffer"


@register
class Regression(ProblemKind):
    """One value per row, no classes: no class weights, no thresholds."""

    name = "regression"
    title = "regression"
    main_metric = "pearson"
    target_dtype = torch.float32
    has_classes = False
    _buffer_said = False

    def claims(self, present: list, several: bool) -> bool:
        if several or all(isinstance(v, (list, tuple)) for v in present):
            return False
        return all(is_number(v) for v in present) and not all(integral(v) for v in present)

    def task(self, present: list, columns: Any, num_labels: Optional[int], label_names: Optional[Sequence[str]],
             where: str) -> Task:
        labels = columns.label
        if len(labels) > 1:
            raise UserError(f"model.problem_type regression takes one label column, not {list(labels)}")
        for value in present:
            if not is_number(value) and not numeric_text(value):
                raise UserError(
                    f"label {value!r} in column {labels[0]!r} of {where} is not a number: problem_type regression "
                    "expects numbers (set model.problem_type single_label_classification for classes)"
                )
        self.check_num_labels(num_labels)
        return Task(self, 1, None, columns)

    def check_num_labels(self, num_labels: Optional[int], setting: str = "model.num_labels") -> None:
        if num_labels not in (None, 1):
            raise UserError(f"{setting} {num_labels} with problem_type regression: it predicts one value (1)")

    def fixed_outputs(self) -> Optional[int]:
        return 1

    def fits_head(self, num_labels: int) -> bool:
        return num_labels == 1

    def outputs_words(self, num_labels: int) -> str:
        return "one value"

    def encode(self, split: Any, task: Task) -> tuple[Any, list[str]]:
        import datasets  # deferred: only where data is read

        column = task.columns.label[0]
        split = split.map(lambda row: {"labels": float(row[column])})
        return split.cast_column("labels", datasets.Value("float32")), []

    def target(self, raw: Sequence[Any], label_id: Callable[[Any], int], num_labels: int) -> tuple[Any, bool, Any]:
        try:
            return float(raw[0]), True, raw[0]
        except (TypeError, ValueError):
            return self.unknown(num_labels), False, raw[0]

    def unknown(self, num_labels: int) -> Any:
        return 0.0

    def fake_labels(self, rows: int, num_labels: int) -> torch.Tensor:
        return torch.zeros(rows)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor] = None,
             reduction: str = "mean") -> torch.Tensor:
        return torch.nn.functional.mse_loss(logits.float().squeeze(-1), labels.float(), reduction=reduction)

    def check_weights(self, setting: Any) -> None:
        raise UserError("model.class_weights: a regression predicts a value, there are no classes to weigh (use none)")

    def outputs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float().squeeze(-1)

    def written(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.float()  # (rows, 1): the value

    def metrics(self, num_labels: int, threshold: float = 0.5, **kwargs: Any) -> MetricCollection:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SPEARMAN_BUFFER)
            spearman = SpearmanCorrCoef(**kwargs)
        return MetricCollection(
            {"mse": MeanSquaredError(**kwargs), "pearson": PearsonCorrCoef(**kwargs), "spearman": spearman}
        )

    def before_evaluation(self) -> None:
        """Once per process: Spearman's correlation keeps every prediction and label of the evaluation."""
        if not Regression._buffer_said:
            Regression._buffer_said = True
            say("note: spearman keeps every prediction and label of an evaluation in memory until its end "
                "(torchmetrics' SpearmanCorrCoef: 8 bytes a row)")

    def header(self, names: Sequence[str]) -> list[str]:
        return ["value"]

    def prediction(self, out: Sequence[float], names: Sequence[str], limits: Optional[Sequence[float]],
                   joined: bool) -> list[Any]:
        return [round(out[0], 6)]

    def usage(self, names: Sequence[str], thresholded: bool) -> list[str]:
        return ['for scores in classifier(texts, function_to_apply="none"):',
                '    print(scores[0]["score"])  # the predicted value']

    def no_threshold(self, num_labels: int) -> str:
        return "a regression predicts a value"
