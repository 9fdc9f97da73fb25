"""Texts longer than the window: ``data.long_texts truncate|chunk`` and ``data.stride``.

``truncate`` (the default) keeps each text's first ``max_length`` tokens. ``chunk`` cuts each text into overlapping
windows of ``max_length`` tokens, consecutive windows sharing ``stride`` tokens (the fast tokenizer's
``return_overflowing_tokens``, as Hugging Face's question-answering examples do); a pair keeps its first text
(at most half the window) in every window and cuts the second.

- Training: every window is a row, labelled with its document's label: a batch is ``batch_size`` windows of at most
  ``max_length`` tokens, the shape the memory plan is made for.
- Validation, test and predict: each document's logits are the mean of its windows' (single-label, regression) or
  their maximum (multi-label: a label any part of the text shows), and the metrics are per document. Evaluation
  batches hold whole documents, at most ``eval_batch_size`` windows each (a document longer than that alone):
  `groups`, `Groups`, `aggregate`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch
from torch.utils.data import Dataset

from lit_memory.errors import UserError

if TYPE_CHECKING:
    from lit_memory.task import ProblemKind

LongTexts = Literal["truncate", "chunk"]
LONG_TEXTS = ("truncate", "chunk")


def check(long_texts: str, stride: Optional[int], max_length: int) -> None:
    """One error line for settings no window can have (the tokenizer's own limit is checked by `room`)."""
    if long_texts not in LONG_TEXTS:
        raise UserError(f"data.long_texts {long_texts!r} is not one of: {', '.join(LONG_TEXTS)}")
    if stride is not None and (isinstance(stride, bool) or stride < 0 or stride >= max_length):
        raise UserError(
            f"data.stride {stride}: the tokens consecutive windows share must be >= 0 and less than max_length "
            f"({max_length}), or every window would repeat the one before"
        )


def default_stride(max_length: int) -> int:
    """A quarter of the window shared with the next (Hugging Face's question-answering examples: 128 of 384)."""
    return max_length // 4


def room(tokenizer: Any, max_length: int, pair: bool) -> int:
    """The tokens of text a window holds: ``max_length`` less the special tokens (a pair: less its first text, at most
    half of what is left)."""
    free = max_length - tokenizer.num_special_tokens_to_add(pair)
    return free - free // 2 if pair else free


def check_tokenizer(tokenizer: Any, stride: int, max_length: int, pair: bool) -> None:
    """One error line for windows this tokenizer cannot cut: a slow tokenizer, or a stride not less than a window's
    text."""
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"data.long_texts chunk needs a fast tokenizer (its overflowing windows); "
                        f"{type(tokenizer).__name__} is not one: use truncate")
    space = room(tokenizer, max_length, pair)
    if stride >= space:
        raise UserError(
            f"data.stride {stride}: a window of max_length {max_length} holds {space} tokens of "
            + ("the second text" if pair else "text")
            + f" (less its special tokens{' and the first text' if pair else ''}); the stride must be less than that"
        )


def _first_texts_cut(tokenizer: Any, texts: list[str], keep: int) -> list[str]:
    """The first texts of pairs cut to at most ``keep`` tokens (at a token's end: the text itself, shortened)."""
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    cut = []
    for text, offsets in zip(texts, encoded["offset_mapping"]):
        cut.append(text[: offsets[keep - 1][1]] if len(offsets) > keep else text)
    return cut


def cut(tokenizer: Any, columns: list[list[str]], max_length: int, stride: int, **kwargs: Any) -> tuple[Any, list[int]]:
    """Texts (one column, or two for pairs) as windows: the tokenizer's encoding of every window, and each window's
    row. ``kwargs`` go to the tokenizer (padding, tensors)."""
    if len(columns) == 2:
        free = max_length - tokenizer.num_special_tokens_to_add(True)
        columns = [_first_texts_cut(tokenizer, columns[0], free // 2), columns[1]]
    encoded = tokenizer(
        *columns, truncation="only_second" if len(columns) == 2 else True, max_length=max_length, stride=stride,
        return_overflowing_tokens=True, **kwargs,
    )
    owner = encoded.pop("overflow_to_sample_mapping")
    return encoded, [int(row) for row in owner]


def encode(rows: dict, indices: list[int], tokenizer: Any, texts: tuple[str, ...], max_length: int, stride: int,
           cap: Optional[int]) -> dict:
    """A batch of rows as windows: the tokenised windows, ``doc`` (the row's index in its split), ``labels``
    (the row's, repeated) and ``split`` (whether its row was cut into more than one window)."""
    columns = [["" if t is None else (t[:cap] if cap is not None else t) for t in rows[c]] for c in texts]
    encoded, owner = cut(tokenizer, columns, max_length, stride)
    windows = [0] * len(columns[0])
    for row in owner:
        windows[row] += 1
    out = dict(encoded)
    out["doc"] = [indices[row] for row in owner]
    out["labels"] = [rows["labels"][row] for row in owner]
    out["split"] = [windows[row] > 1 for row in owner]
    return out


def encode_splits(splits: Any, tokenizer: Any, texts: tuple[str, ...], max_length: int, stride: int,
                  cap: Optional[int]) -> tuple[Any, str]:
    """Every split of a `datasets.DatasetDict` as windows (a training row is a window; validation and test keep
    each window's text, ``doc``), and what the ``data:`` line says of them."""
    import datasets  # deferred: the model imports this module for `aggregate` alone

    pair = len(texts) == 2
    check_tokenizer(tokenizer, stride, max_length, pair)
    window = functools.partial(encode, tokenizer=tokenizer, texts=texts, max_length=max_length, stride=stride, cap=cap)
    out = {}
    for name, split in splits.items():
        feature = split.features["labels"]
        found = split.map(window, batched=True, with_indices=True, remove_columns=split.column_names,
                          desc="cutting into windows")
        out[name] = found if found.features["labels"] == feature else found.cast_column("labels", feature)
    train = out["train"]
    documents = len(splits["train"])
    split_docs = len({d for d, more in zip(train["doc"], train["split"]) if more})
    out["train"] = train.remove_columns(["doc", "split"])  # a training row is a window
    encoded = datasets.DatasetDict({n: (s if n == "train" else s.remove_columns("split")) for n, s in out.items()})
    return encoded, (f"{split_docs:,} of {documents:,} training " + ("pairs" if pair else "texts")
                     + f" cut into windows of max_length {max_length} sharing {stride} tokens: {len(train):,} windows "
                     "to train on (the rows of every batch), validation and test scored per text")


def groups(doc: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive windows (``doc``: each window's document, documents contiguous) grouped into ranges of whole
    documents, each range at most ``limit`` windows (a document with more, alone)."""
    ranges: list[tuple[int, int]] = []
    start = end = 0
    while end < len(doc):
        stop = end
        while stop < len(doc) and doc[stop] == doc[end]:
            stop += 1  # one document's windows: [end, stop)
        if stop - start > limit and end > start:
            ranges.append((start, end))
            start = end
        end = stop
    if end > start:
        ranges.append((start, end))
    return ranges


class Groups(Dataset):
    """An evaluation split of windows as items of whole documents (`groups`): one item is one batch."""

    def __init__(self, windows: Any, limit: int) -> None:
        self.windows = windows
        self.ranges = groups([int(d) for d in windows["doc"]], limit)

    def __len__(self) -> int:
        return len(self.ranges)

    def __getitem__(self, index: int) -> list[dict[str, Any]]:
        start, end = self.ranges[index]
        return [self.windows[i] for i in range(start, end)]


class GroupCollate:
    """A `Groups` item as a batch: its windows padded by ``pad`` (transformers' collator), ``doc`` numbering each
    window's document from 0, and ``labels`` one per document."""

    def __init__(self, pad: Any) -> None:
        self.pad = pad

    def __call__(self, items: list[list[dict[str, Any]]]) -> dict[str, torch.Tensor]:
        windows = [w for item in items for w in item]
        doc = torch.tensor([int(w["doc"]) for w in windows])
        _, local = torch.unique_consecutive(doc, return_inverse=True)
        first = [0] + [i for i in range(1, len(windows)) if doc[i] != doc[i - 1]]
        labels = torch.stack([torch.as_tensor(windows[i]["labels"]) for i in first])
        batch = self.pad([{k: v for k, v in w.items() if k not in ("doc", "labels")} for w in windows])
        batch["doc"] = local
        batch["labels"] = labels
        return batch


def aggregate(logits: torch.Tensor, doc: torch.Tensor, kind: ProblemKind) -> torch.Tensor:
    """Each document's logits from its windows' (``doc``: the window's document, numbered from 0), as the problem
    kind's ``window_reduce`` says: the maximum (multi-label: a label any window finds), else the mean."""
    docs = int(doc.max()) + 1 if doc.numel() else 0
    out = torch.zeros(docs, logits.shape[-1], dtype=logits.dtype, device=logits.device)
    index = doc.to(logits.device)
    if kind.window_reduce == "amax":
        return out.scatter_reduce_(0, index.unsqueeze(-1).expand_as(logits), logits, "amax", include_self=False)
    counts = torch.zeros(docs, dtype=logits.dtype, device=logits.device).index_add_(
        0, index, torch.ones_like(index, dtype=logits.dtype))
    return out.index_add_(0, index, logits) / counts.unsqueeze(-1)
