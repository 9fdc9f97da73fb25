"""The columns a run reads, found by one rule for training and for ``predict`` alike (`find_columns`): the text (one
column, or two for a pair), the label (one column, or several 0/1 columns for multi-label), an id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from lit_memory.errors import UserError

# Looked for in this order where data.text_column / label_column / id_column are not set.
TEXT_COLUMNS = ("text", "sentence", "review", "content", "document", "comment_text", "comment", "tweet", "question")
PAIR_COLUMNS = (
    ("sentence1", "sentence2"), ("question1", "question2"), ("premise", "hypothesis"), ("question", "sentence"),
    ("text1", "text2"), ("text_a", "text_b"), ("query", "passage"), ("query", "document"), ("question", "passage"),
    ("question", "answer"), ("sentence_a", "sentence_b"),
)
LABEL_COLUMNS = ("label", "labels", "score", "target", "class", "sentiment", "rating")
ID_COLUMNS = ("id", "idx")

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
        pair = next(
            (p for p in [*[u for u in usual if len(u) == 2], *PAIR_COLUMNS] if all(c in columns for c in p)), None
        )
        single = next((c for c in [*[u[0] for u in usual if len(u) == 1], *TEXT_COLUMNS] if c in columns), None)
        texts = pair or ((single,) if single else ())
        if not texts:
            raise UserError(
                f"no text column in {where}: its columns are {columns}; looked for {', '.join(TEXT_COLUMNS)} and the "
                "pairs "
                + ", ".join("/".join(p) for p in PAIR_COLUMNS)
                + " (set data.text_column, a name or [first, second])"
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
