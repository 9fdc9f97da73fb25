"""What a dataset asks of a sequence classifier: its columns, its problem type and its labels.

One rule finds the columns, for training and for ``predict`` alike (`find_columns`): the text (one column, or two
for a pair: ``sentence1``/``sentence2``, ``premise``/``hypothesis``, ...), the label (one column, or several 0/1
columns for multi-label), an id. `infer` reads the labels of the training rows into a `Task`: Hugging Face's three
``problem_type``s (single-label, multi-label, regression), the number of outputs and the class names; a value that
contradicts a ``problem_type`` the user set is one error line naming the column and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional, Union, get_args

from lit_memory.errors import UserError

ProblemType = Literal["single_label_classification", "multi_label_classification", "regression"]
PROBLEM_TYPES: tuple[str, ...] = get_args(ProblemType)
SINGLE, MULTI, REGRESSION = PROBLEM_TYPES

# Looked for in this order where data.text_column / label_column / id_column are not set.
TEXT_COLUMNS = ("text", "sentence", "review", "content", "document", "comment_text", "comment", "tweet", "question")
PAIR_COLUMNS = (
    ("sentence1", "sentence2"), ("question1", "question2"), ("premise", "hypothesis"), ("question", "sentence"),
    ("text1", "text2"), ("text_a", "text_b"), ("query", "passage"), ("query", "document"), ("question", "passage"),
    ("question", "answer"), ("sentence_a", "sentence_b"),
)
LABEL_COLUMNS = ("label", "labels", "score", "target", "class", "sentiment", "rating")
ID_COLUMNS = ("id", "idx")

# The metric each problem type keeps its best checkpoint by (higher is better for all three).
MAIN_METRIC = {SINGLE: "f1_macro", MULTI: "f1_micro", REGRESSION: "pearson"}

Names = Union[str, Sequence[str], None]


def as_names(value: Names) -> tuple[str, ...]:
    """A column setting as a tuple of names: ``text``, ``[premise, hypothesis]``; None: ()."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class Columns:
    """The columns a run reads: one or two text columns (a pair), one or more label columns (none: unlabelled)."""

    text: tuple[str, ...]
    label: tuple[str, ...] = ()

    @property
    def pair(self) -> bool:
        return len(self.text) == 2

    def describe(self) -> str:
        texts = " + ".join(self.text) + (" (a pair)" if self.pair else "")
        return f"text {texts}, label {', '.join(self.label) if self.label else 'none'}"


def find_columns(
    columns: Sequence[str], text: Names = None, label: Names = None, where: str = "the data",
    require_label: bool = True, usual_text: Sequence[str] = (), usual_label: Sequence[str] = (),
) -> Columns:
    """The text and label columns of data with ``columns``: those set (each must exist), else the first pair of
    `PAIR_COLUMNS` present, else the first single text column (``usual_text`` first: the training data's), and
    the first label column (``usual_label`` first)."""
    columns = list(columns)
    texts, labels = as_names(text), as_names(label)
    if labels and not require_label and not any(c in columns for c in labels):
        labels = ()  # texts to predict without their labels: nothing to score
    if len(texts) > 2:
        raise UserError(f"data.text_column names {len(texts)} columns {list(texts)}: one, or two for a pair")
    for name, kind in [(t, "text_column") for t in texts] + [(lab, "label_column") for lab in labels]:
        if name not in columns:
            raise UserError(f"column {name!r} not found in {where}; its columns are {columns} (set data.{kind})")
    if not texts:
        usual = [tuple(as_names(u)) for u in usual_text]
        pair = next((p for p in [*[u for u in usual if len(u) == 2], *PAIR_COLUMNS] if all(c in columns for c in p)), None)
        single = next((c for c in [*[u[0] for u in usual if len(u) == 1], *TEXT_COLUMNS] if c in columns), None)
        texts = pair or ((single,) if single else ())
        if not texts:
            raise UserError(
                f"no text column in {where}: its columns are {columns}; looked for {', '.join(TEXT_COLUMNS)} and the "
                "pairs " + ", ".join("/".join(p) for p in PAIR_COLUMNS) + " (set data.text_column, a name or [first, second])"
            )
    if not labels:
        found = next((c for c in [*usual_label, *LABEL_COLUMNS] if c in columns and c not in texts), None)
        labels = (found,) if found else ()
        if not labels and require_label:
            raise UserError(
                f"no label column in {where}: its columns are {columns}; looked for {', '.join(LABEL_COLUMNS)} "
                "(set data.label_column, a name or a list of 0/1 columns for multi-label)"
            )
    return Columns(texts, labels)


def id_column(columns: Sequence[str], given: Optional[str], where: str) -> Optional[str]:
    if given is not None:
        if given not in columns:
            raise UserError(f"{where} has no column {given!r}; its columns are {list(columns)} (set data.id_column)")
        return given
    return next((c for c in ID_COLUMNS if c in columns), None)


@dataclass(frozen=True)
class Task:
    """A sequence classification task: Hugging Face's ``problem_type``, the number of outputs (1 for regression),
    the class names in id order (labels given as ids are named as the file writes them, ``0``, ``1``; None for
    regression), where the columns are."""

    problem_type: ProblemType
    num_labels: int
    label_names: Optional[tuple[str, ...]]
    columns: Columns

    @property
    def main_metric(self) -> str:
        return MAIN_METRIC[self.problem_type]

    def describe(self) -> str:
        kind = {SINGLE: f"{self.num_labels} classes", MULTI: f"{self.num_labels} labels, any number per row",
                REGRESSION: "one value"}[self.problem_type]
        names = f" ({', '.join(self.label_names)})" if self.label_names and len(self.label_names) <= 12 else ""
        return f"{self.problem_type}: {kind}{names}; {self.columns.describe()}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integral(value: Any) -> bool:
    return isinstance(value, bool) or isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def infer(
    rows: Iterable[Mapping[str, Any]], columns: Columns, problem_type: Optional[str] = None,
    num_labels: Optional[int] = None, label_names: Optional[Sequence[str]] = None, where: str = "the data",
) -> Task:
    """The task of labelled ``rows`` (every split's: a class seen only in validation is a class): the
    ``problem_type`` set or the one its labels show (a list of names per row, or several label columns:
    multi-label; a number with a fraction: regression; else single-label), ``num_labels`` and the class names
    set or read from the labels. A label the problem type cannot take is one error line."""
    if problem_type is not None and problem_type not in PROBLEM_TYPES:
        raise UserError(f"model.problem_type {problem_type!r} is not one of: {', '.join(PROBLEM_TYPES)}")
    labels = columns.label
    if not labels:
        raise UserError(f"{where} has no label column to learn from (set data.label_column)")
    values: list[Any] = []
    for row in rows:
        if len(labels) == 1:
            values.append(row.get(labels[0]))
        else:
            values.append([row.get(c) for c in labels])
    present = [v for v in values if v is not None and v != ""]
    if not present:
        raise UserError(f"column {labels[0]!r} of {where} holds no label")
    several = len(labels) > 1
    lists = several or all(isinstance(v, (list, tuple)) for v in present)
    if problem_type is None:
        if lists:
            problem_type = MULTI
        elif all(_is_number(v) for v in present) and not all(_integral(v) for v in present):
            problem_type = REGRESSION
        else:
            problem_type = SINGLE
    if problem_type == REGRESSION:
        return _regression(present, labels, num_labels, where, columns)
    if problem_type == MULTI:
        return _multi_label(present, labels, several, num_labels, label_names, where, columns)
    return _single_label(present, labels[0] if not several else labels, num_labels, label_names, where, columns)


def _regression(present: list, labels: tuple, num_labels: Optional[int], where: str, columns: Columns) -> Task:
    if len(labels) > 1:
        raise UserError(f"model.problem_type regression takes one label column, not {list(labels)}")
    for value in present:
        if not _is_number(value) and not _numeric_text(value):
            raise UserError(
                f"label {value!r} in column {labels[0]!r} of {where} is not a number: problem_type regression expects "
                "numbers (set model.problem_type single_label_classification for classes)"
            )
    if num_labels not in (None, 1):
        raise UserError(f"model.num_labels {num_labels} with problem_type regression: it predicts one value (1)")
    return Task(REGRESSION, 1, None, columns)


def _numeric_text(value: Any) -> bool:
    try:
        return isinstance(value, str) and math.isfinite(float(value))
    except ValueError:
        return False


def _multi_label(
    present: list, labels: tuple, several: bool, num_labels: Optional[int], label_names: Optional[Sequence[str]],
    where: str, columns: Columns,
) -> Task:
    if several:  # one 0/1 column per label, named by its column
        for row in present:
            for name, value in zip(labels, row):
                if value not in (0, 1, True, False, 0.0, 1.0):
                    raise UserError(
                        f"label {value!r} in column {name!r} of {where}: multi-label columns hold 0 or 1 (a label present "
                        "or not)"
                    )
        names = tuple(label_names) if label_names else labels
        if len(names) != len(labels):
            raise UserError(f"data.label_names has {len(names)} names for {len(labels)} label columns {list(labels)}")
        return _checked_count(Task(MULTI, len(names), names, columns), num_labels)
    column = labels[0]
    seen: list[Any] = []
    for value in present:
        if not isinstance(value, (list, tuple)):
            raise UserError(
                f"label {value!r} in column {column!r} of {where} is not a list: problem_type "
                "multi_label_classification expects a list of label names per row (JSON/JSONL), or several 0/1 columns "
                "(data.label_column [a, b, c])"
            )
        seen.extend(value)
    if label_names:
        names = tuple(str(n) for n in label_names)
        unknown = sorted({str(v) for v in seen} - set(names), key=str)
        if unknown:
            raise UserError(
                f"a row of {where} names label {unknown[0]!r} in column {column!r}, which data.label_names {list(names)} "
                "does not list"
            )
    elif seen and all(isinstance(v, int) and not isinstance(v, bool) for v in seen):
        if min(seen) < 0:
            raise UserError(f"label id {min(seen)} in column {column!r} of {where}: ids start at 0")
        total = max(num_labels or 0, max(seen) + 1)
        return _checked_count(Task(MULTI, total, tuple(str(i) for i in range(total)), columns), None)
    else:
        names = tuple(sorted({str(v) for v in seen}))
    if not names:
        raise UserError(f"column {column!r} of {where} names no label in any row")
    return _checked_count(Task(MULTI, len(names), names, columns), num_labels)


def _single_label(
    present: list, column: Any, num_labels: Optional[int], label_names: Optional[Sequence[str]], where: str,
    columns: Columns,
) -> Task:
    if not isinstance(column, str):
        raise UserError(
            f"several label columns {list(column)} are multi-label (one 0/1 column per label): set model.problem_type "
            "multi_label_classification, or name one column"
        )
    for value in present:
        if isinstance(value, (list, tuple)):
            raise UserError(
                f"label {value!r} in column {column!r} of {where} is a list: problem_type single_label_classification "
                "expects one class per row (set model.problem_type multi_label_classification)"
            )
        if isinstance(value, float) and not value.is_integer():
            raise UserError(
                f"label {value!r} in column {column!r} of {where} is not a class: problem_type "
                "single_label_classification expects class names or ids (set model.problem_type regression for values)"
            )
    if label_names:
        names = tuple(str(n) for n in label_names)
        return _checked_count(Task(SINGLE, max(len(names), num_labels or 0), names, columns), None)
    if all(_integral(v) for v in present):
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
        return Task(SINGLE, total, tuple(str(i) for i in range(total)), columns)  # the ids as the file writes them
    names = tuple(sorted({str(v) for v in present}))  # like datasets' class_encode_column
    return _checked_count(Task(SINGLE, max(len(names), 2), names, columns), num_labels)


def _checked_count(task: Task, num_labels: Optional[int]) -> Task:
    if num_labels is not None and task.label_names and len(task.label_names) > num_labels:
        raise UserError(
            f"{len(task.label_names)} label names {list(task.label_names)} but num_labels={num_labels}; set "
            "model.num_labels or data.label_names"
        )
    if num_labels is not None and num_labels > task.num_labels:
        return replace(task, num_labels=num_labels)
    return task
