"""A source's rows as train, validation and test: the missing splits carved out of train (stratified by class where
there are classes), sub-sampled within their limits, and what was dropped said in words."""

from __future__ import annotations

from collections import Counter
from typing import Optional

import datasets

from lit_memory.errors import UserError
from lit_memory.task.kind import Task

SPLITS = ("train", "validation", "test")


def carve(encoded: dict[str, datasets.Dataset], classes: Optional[int], fractions: dict[str, float], seed: int,
          present: set[str] = frozenset()) -> tuple[dict[str, datasets.Dataset], dict[str, float]]:
    """Use the source's own splits; carve the missing validation/test splits out of train (``fractions``: each one's
    share of it). Returns the splits and what was carved (name: fraction)."""
    splits = dict(encoded)
    carve = {name: f for name, f in fractions.items() if name not in encoded and name not in present and f > 0}
    if carve:
        held_out = sum(carve.values())
        parts = train_test_split(encoded["train"], held_out, seed, classes)
        splits["train"] = parts["train"]
        if len(carve) == 2:
            rest = train_test_split(parts["test"], carve["test"] / held_out, seed, classes)
            splits["validation"], splits["test"] = rest["train"], rest["test"]
        else:
            splits[next(iter(carve))] = parts["test"]
    if "validation" not in splits:  # val_fraction > 0 always carves one; a source with test only
        splits["validation"] = splits["test"]
    splits.setdefault("test", splits["validation"])  # test_fraction 0: test on the validation split
    return {name: splits[name] for name in SPLITS}, carve


def train_test_split(split: datasets.Dataset, test_size: float, seed: int,
                     num_labels: Optional[int]) -> datasets.DatasetDict:
    """Stratified on the label so small classes land in every split (single-label); plain when a class is too rare,
    and for regression and multi-label."""
    if len(split) < 2:
        raise UserError(f"only {len(split)} usable row(s) left: too few to split into train/validation/test")
    if num_labels is None:
        return split.train_test_split(test_size=test_size, seed=seed)
    split = split.cast_column("labels", datasets.ClassLabel(num_classes=num_labels))
    try:
        return split.train_test_split(test_size=test_size, seed=seed, stratify_by_column="labels")
    except ValueError:
        return split.train_test_split(test_size=test_size, seed=seed)


def subsample(splits: dict[str, datasets.Dataset], limits: dict[str, Optional[int]], seed: int) -> dict[str, int]:
    """Each split cut to its limit (a seeded shuffle's first rows), in place; returns the rows each had."""
    available = {name: len(splits[name]) for name in SPLITS}
    for name in SPLITS:
        limit = limits[name]
        if limit is not None and limit < len(splits[name]):
            splits[name] = splits[name].shuffle(seed=seed).select(range(limit))
    return available


def rows_words(splits: dict[str, datasets.Dataset], available: dict[str, int]) -> str:
    """``train 4,000 of 8,000 · validation 1,000 · test 1,000``."""
    parts = []
    for name in SPLITS:
        rows = len(splits[name])
        parts.append(f"{name} {rows:,}" + (f" of {available[name]:,}" if rows < available[name] else ""))
    return " · ".join(parts)


def dropped_words(dropped: Counter, task: Task) -> str:
    """The rows dropped, by why: ``15,018 rows dropped: labelled neutral (15,018), not in data.label_names
    (negative, positive)``; ``3 with an empty text or no label``."""
    total = sum(dropped.values())
    parts = []
    unlisted = [(label, n) for label, n in dropped.most_common() if label]
    if unlisted:
        shown = ", ".join(f"{label} ({n:,})" for label, n in unlisted[:5]) + (", ..." if len(unlisted) > 5 else "")
        names = ", ".join(task.label_names or ())
        parts.append(f"labelled {shown}, not in data.label_names ({names})")
    if dropped[""]:
        parts.append(f"{dropped['']:,} with an empty text or no label")
    return f"{total:,} row{'s' if total != 1 else ''} dropped: " + "; ".join(parts)
