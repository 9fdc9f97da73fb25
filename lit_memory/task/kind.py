"""`ProblemKind`: everything one Hugging Face ``problem_type`` asks of the data, the loss, the metrics and ``predict``,
and the registry that finds a kind by its name (`kind_of`). A kind is one module of this package that defines a
subclass and registers it with `register` (`lit_memory.task.single_label` is the shortest to copy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import torch

from lit_memory.errors import UserError

if TYPE_CHECKING:  # only for annotations: the columns are the package's, the splits datasets'
    import datasets
    from torchmetrics import Metric, MetricCollection

    from lit_memory.task.columns import Columns

IGNORE = -100  # a row without a label the model knows (and padding rows): not in the metrics, torch's ignore_index
DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True)
class Task:
    """A sequence classification task: its problem kind, the number of outputs (1 for regression), the class names
    in id order (labels given as ids are named as the file writes them, ``0``, ``1``; None for regression), where
    the columns are."""

    kind: "ProblemKind"
    num_labels: int
    label_names: Optional[tuple[str, ...]]
    columns: "Columns"

    @property
    def problem_type(self) -> str:
        """Hugging Face's name of the kind (``config.problem_type``, the ``model.problem_type`` setting)."""
        return self.kind.name

    @property
    def main_metric(self) -> str:
        return self.kind.main_metric

    def describe(self) -> str:
        names = f" ({', '.join(self.label_names)})" if self.label_names and len(self.label_names) <= 12 else ""
        return f"{self.problem_type}: {self.kind.outputs_words(self.num_labels)}{names}; {self.columns.describe()}"


class ProblemKind:
    """One problem type: its labels read, encoded and faked, its loss, outputs, metrics, thresholds and predictions."""

    name: ClassVar[str]  # Hugging Face's ``config.problem_type``
    title: ClassVar[str]  # in words, for the model card
    main_metric: ClassVar[str]  # the validation metric the best checkpoint is kept by (higher is better)
    target_dtype: ClassVar[torch.dtype]  # of a batch's ``labels``
    label_word: ClassVar[str] = "class"  # what one output is called: class, label
    label_words: ClassVar[str] = "classes"  # and several
    has_classes: ClassVar[bool] = True  # outputs with names (a regression's one value has none)
    weight_name: ClassVar[str] = "class weights"  # what `model.class_weights` sets for this kind's loss
    window_reduce: ClassVar[str] = "mean"  # how a text's windows' logits make its own (`lit_memory.hf.windows`)
    draws_confusion: ClassVar[bool] = False  # a class x class confusion matrix to print and draw
    thresholds_per_label: ClassVar[bool] = False  # one threshold per label (else one, for class 1)
    thresholded_by_default: ClassVar[bool] = False  # decides at `DEFAULT_THRESHOLD` where nothing else is set

    # -- the labels: read, encoded, faked ---------------------------------------------------------------------

    def claims(self, present: list, several: bool) -> bool:
        """Whether labels that look like ``present`` (every non-empty one; ``several``: from several columns) are
        of this kind where ``problem_type`` is not set: exactly one kind claims any labels."""
        raise NotImplementedError

    def task(self, present: list, columns: "Columns", num_labels: Optional[int],
             label_names: Optional[Sequence[str]], where: str) -> Task:
        """The task of these labels; one error line for a label this kind cannot take."""
        raise NotImplementedError

    def check_num_labels(self, num_labels: Optional[int], setting: str = "model.num_labels") -> None:
        """One error line for an output count this kind cannot have."""

    def fixed_outputs(self) -> Optional[int]:
        """The head's outputs where this kind fixes them (regression: 1), else None."""
        return None

    def fits_head(self, num_labels: int) -> bool:
        """Whether a head of ``num_labels`` outputs can be of this kind (a config's own problem type, kept)."""
        return num_labels != 1

    def outputs_words(self, num_labels: int) -> str:
        raise NotImplementedError

    def encode(self, split: "datasets.Dataset", task: Task) -> tuple["datasets.Dataset", list[str]]:
        """A split's ``labels`` column as the loss takes them, and the labels of the rows dropped (not listed)."""
        raise NotImplementedError

    def stratify_classes(self, task: Task) -> Optional[int]:
        """The classes a split is stratified on (None: plain random split)."""
        return None

    def target(self, raw: Sequence[Any], label_id: Callable[[Any], int], num_labels: int) -> tuple[Any, bool, Any]:
        """A row's given label (``raw``: one value per label column) for ``predict``: (as the loss takes it, whether it
        can be scored, as the file wrote it). ``label_id``: a name or id as the model's class id, else `IGNORE`."""
        raise NotImplementedError

    def unknown(self, num_labels: int) -> Any:
        """The target of a row whose label cannot be scored."""
        raise NotImplementedError

    def named(self, value: Any, names: Sequence[str]) -> Any:
        """An encoded target as the file would have written it."""
        return value

    def fake_labels(self, rows: int, num_labels: int) -> torch.Tensor:
        """Labels of the shape and dtype the loss takes, for the memory simulation's worst-case batch."""
        raise NotImplementedError

    # -- the loss -------------------------------------------------------------------------------------------

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, weights: Optional[torch.Tensor] = None,
             reduction: str = "mean") -> torch.Tensor:
        """Hugging Face's head's loss for this kind, weighted where ``weights`` are given (``none``: per row)."""
        raise NotImplementedError

    def count(self, labels: torch.Tensor, num_labels: int) -> tuple[int, ...]:
        """Per class its rows, or per label its positive rows, of a ``labels`` column (class weights)."""
        return tuple(int(c) for c in torch.bincount(labels.long(), minlength=num_labels).tolist())

    weights_order: ClassVar[str] = "one per class, in id order"  # how `model.class_weights` lists its weights
    counted: ClassVar[str] = "rows"  # what `count` counts per class

    def check_weights(self, setting: Any) -> None:
        """One error line where this kind has no weights to set."""

    def balanced(self, rows: int, per_label: torch.Tensor, num_labels: int) -> torch.Tensor:
        """``model.class_weights balanced`` from the training rows and `count`'s counts (float64)."""
        raise NotImplementedError

    # -- outputs, metrics, reports -------------------------------------------------------------------------

    def outputs(self, logits: torch.Tensor) -> torch.Tensor:
        """What a batch's logits predict: class ids, values, or each label's probability."""
        raise NotImplementedError

    def written(self, logits: torch.Tensor) -> torch.Tensor:
        """What ``predict`` hands the writer per row: each class's probability, the value, each label's."""
        raise NotImplementedError

    def before_evaluation(self) -> None:
        """Where an evaluation first feeds this kind's metrics (a note to say once)."""

    def metric_targets(self, labels: torch.Tensor) -> torch.Tensor:
        """Labels as the metrics take them."""
        return labels

    def metrics(self, num_labels: int, threshold: float = DEFAULT_THRESHOLD, **kwargs: Any) -> "MetricCollection":
        """The torchmetrics this kind logs (``kwargs`` to every metric)."""
        raise NotImplementedError

    def per_label_f1(self, num_labels: int, threshold: float = DEFAULT_THRESHOLD, **kwargs: Any) -> Optional["Metric"]:
        """Each label's F1 (logged as ``f1_<label>``) where the kind has one."""
        return None

    def class_counts(self, num_labels: int, threshold: float = DEFAULT_THRESHOLD) -> Optional["Metric"]:
        """The confusion counts the report is made of, None where there are no classes."""
        return None

    def report_rows(self, counts: torch.Tensor, names: Sequence[str]) -> list[tuple[str, int, int, int]]:
        """(name, true positives, false positives, false negatives) of each class or label."""
        rows = []
        for i, name in enumerate(names):
            tp = counts[i, i].item()
            rows.append((name, tp, counts[:, i].sum().item() - tp, counts[i, :].sum().item() - tp))
        return rows

    def one_sided(self, counts: torch.Tensor, names: Sequence[str]) -> Optional[tuple[str, list[str]]]:
        """Where an evaluation's predictions are degenerate: what they are, and what else to try; None otherwise."""
        return None

    def header(self, names: Sequence[str]) -> list[str]:
        """The prediction file's columns after the key."""
        raise NotImplementedError

    def prediction(self, out: Sequence[float], names: Sequence[str], limits: Optional[Sequence[float]],
                   joined: bool) -> list[Any]:
        """One row of the prediction file after the key (``joined``: several names as one ``a|b`` cell)."""
        raise NotImplementedError

    def usage(self, names: Sequence[str], thresholded: bool) -> list[str]:
        """The model card's lines that read a ``pipeline``'s scores as this kind's predictions."""
        raise NotImplementedError

    # -- thresholds -----------------------------------------------------------------------------------------

    def uses_thresholds(self, num_labels: int) -> bool:
        """Whether a threshold can decide this task."""
        return False

    def no_threshold(self, num_labels: int) -> str:
        """Why a threshold cannot decide this task (the error line's middle)."""
        raise NotImplementedError

    def threshold_count(self, num_labels: int) -> int:
        """How many thresholds decide (one per label, or one)."""
        return 1

    def check_tuning(self, tune: str) -> None:
        """One error line for a ``model.tune_threshold`` this kind cannot take."""

    def default_tuning(self) -> Optional[str]:
        """What ``model.tune_threshold auto`` tunes."""
        return None

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """What thresholds are compared with, one column per threshold."""
        raise NotImplementedError

    def decide(self, logits: torch.Tensor, thresholds: Optional[torch.Tensor]) -> torch.Tensor:
        """Predictions as the metrics take them, at ``thresholds`` where given."""
        return self.outputs(logits)

    def sweep_targets(self, labels: torch.Tensor) -> torch.Tensor:
        """Labels as the threshold sweep takes them: one 0/1 column per threshold."""
        return labels.unsqueeze(-1)

    def tuned_for(self, mode: str, objective: str) -> str:
        """What tuning the thresholds maximised, in words."""
        return objective

    def threshold_keys(self, names: Sequence[str]) -> list[str]:
        """The names thresholds are saved by (``config.json``'s ``thresholds``)."""
        return list(names[1:2])

    def describe_thresholds(self, values: Sequence[float], names: Sequence[str]) -> str:
        return f"{names[1]} where its probability is at least {values[0]:g}"


KINDS: dict[str, ProblemKind] = {}


def register(kind: type[ProblemKind]) -> type[ProblemKind]:
    """Class decorator: ``kind`` found by its ``name`` from now on."""
    KINDS[kind.name] = kind()
    return kind


DEFAULT_PROBLEM_TYPE = "single_label_classification"  # where a module or model config states none


def kind_of(problem_type: Optional[str], setting: str = "model.problem_type") -> ProblemKind:
    """The registered kind of a ``problem_type`` (None: `DEFAULT_PROBLEM_TYPE`); one error line naming the
    ``setting`` for any other value."""
    found = KINDS.get(problem_type or DEFAULT_PROBLEM_TYPE)
    if found is None:
        raise UserError(f"{setting} {problem_type!r} is not one of: {', '.join(KINDS)}")
    return found


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integral(value: Any) -> bool:
    return isinstance(value, bool) or isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def numeric_text(value: Any) -> bool:
    try:
        return isinstance(value, str) and math.isfinite(float(value))
    except ValueError:
        return False


def checked_count(task: Task, num_labels: Optional[int]) -> Task:
    """``task`` with ``num_labels`` outputs where more are set than the labels show; one error line for fewer."""
    if num_labels is not None and task.label_names and len(task.label_names) > num_labels:
        raise UserError(
            f"{len(task.label_names)} label names {list(task.label_names)} but num_labels={num_labels}; set "
            "model.num_labels or data.label_names"
        )
    if num_labels is not None and num_labels > task.num_labels:
        return replace(task, num_labels=num_labels)
    return task
