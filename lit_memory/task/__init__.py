"""What a dataset asks of a sequence classifier: its columns, its problem type and its labels.

The columns are found by one rule (`lit_memory.task.columns`). Each of Hugging Face's ``problem_type``s is a
`ProblemKind`, one module each (`single_label`, `multi_label`, `regression`): how its labels are read and encoded,
its loss, outputs, metrics, thresholds and predictions. `infer` reads the labels of the training rows into a `Task`
(the problem type set, or the kind that claims the labels); a value that contradicts a ``problem_type`` the user
set is one error line naming the column and what was expected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Optional

from lit_memory.errors import UserError
from lit_memory.task.columns import (  # noqa: F401  (re-exported: `from lit_memory.task import find_columns`)
    ID_COLUMNS,
    LABEL_COLUMNS,
    PAIR_COLUMNS,
    TEXT_COLUMNS,
    Columns,
    Names,
    as_names,
    find_columns,
    id_column,
)

if TYPE_CHECKING:
    from lit_memory.task.kind import IGNORE, KINDS, ProblemKind, Task, kind_of, register  # noqa: F401

# The kinds import torch and torchmetrics: they load with the first name that needs them (`__getattr__`), so that
# finding a file's columns (the check `python -m lit_memory` makes before importing torch) costs none of it.
KIND_NAMES = ("IGNORE", "KINDS", "ProblemKind", "Task", "kind_of", "register")  # `lit_memory.task.kind`'s
MADE_NAMES = ("PROBLEM_TYPES", "ProblemType")
# Hugging Face's names of its three problem types (``config.problem_type``), which the kinds here take as theirs:
# plain strings, so naming one imports no kind.
SINGLE, MULTI, REGRESSION = "single_label_classification", "multi_label_classification", "regression"


def _load() -> None:
    """Import the kinds, each registering itself, and define the names made of them; once."""
    if "PROBLEM_TYPES" in globals():
        return
    from lit_memory.task import kind

    # Each module registers its kind on import; this order is the settings' and the error lines' (a new kind: its
    # line), kept also where a kind's module was imported on its own first.
    from lit_memory.task import single_label  # noqa: F401  # isort: skip
    from lit_memory.task import multi_label  # noqa: F401  # isort: skip
    from lit_memory.task import regression  # noqa: F401  # isort: skip

    ordered = {name: kind.KINDS[name] for name in [SINGLE, MULTI, REGRESSION, *kind.KINDS]}
    kind.KINDS.clear()
    kind.KINDS.update(ordered)
    names = {name: getattr(kind, name) for name in KIND_NAMES}
    problem_types = tuple(kind.KINDS)  # the registered kinds' names, in the order above
    globals().update(
        names,
        PROBLEM_TYPES=problem_types,
        ProblemType=Literal[problem_types],  # the settings' choices: every registered kind
    )


def __getattr__(name: str) -> Any:
    if name in KIND_NAMES or name in MADE_NAMES:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def infer(
    rows: Iterable[Mapping[str, Any]], columns: Columns, kind: Optional[ProblemKind] = None,
    num_labels: Optional[int] = None, label_names: Optional[Sequence[str]] = None, where: str = "the data",
) -> Task:
    """The task of labelled ``rows`` (every split's: a class seen only in validation is a class): the
    ``kind`` set or the one its labels show (a list of names per row, or several label columns:
    multi-label; a number with a fraction: regression; else single-label), ``num_labels`` and the class names
    set or read from the labels. A label the problem type cannot take is one error line."""
    _load()
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
    if kind is None:
        kind = next(k for k in KINDS.values() if k.claims(present, len(labels) > 1))
    return kind.task(present, columns, num_labels, label_names, where)


def head_kind(given: Optional[ProblemKind], own: Optional[str], num_labels: int) -> ProblemKind:
    """The problem kind a model config ends with: the one ``given``, else the config's ``own`` problem type where its
    head (``num_labels`` outputs) can still be of it, else transformers' rule (one output: regression; else
    single-label)."""
    _load()
    if given is not None:
        return given
    if own is not None and (KINDS[own].fits_head(num_labels) if own in KINDS else num_labels != 1):
        # else a head resized from the config's own: its problem type no longer applies
        return kind_of(own)  # one error line for a problem type no kind has
    return KINDS[REGRESSION if num_labels == 1 else SINGLE]
