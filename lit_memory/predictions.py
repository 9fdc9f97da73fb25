"""Predictions for a file of texts, streamed in and written out batch by batch.

- **In**: `read_texts` streams a CSV, TSV, JSON or JSONL file with Hugging Face `datasets` (``streaming=True``:
  pandas reads CSV in chunks, JSON lines in blocks; a JSON array, which `datasets` would read whole, is decoded
  item by item here), so the whole file is never in memory. `Rows` numbers the rows and, under several
  processes, deals them out round-robin (every rank the same number of batches: a sharded forward is a
  collective). `Collate` tokenises each batch and maps the labels, where the file has them, to the model's ids.
- **Out**: `PredictionWriter`, Lightning's `BasePredictionWriter` at every batch (the CLI runs ``predict`` with
  ``return_predictions=false``, so Lightning collects nothing): rank 0 writes one row per input (its id, or its
  text; the predicted label's name; a probability per label; the given label where there is one) in input order
  into ``predictions.<csv|tsv|jsonl>`` in the run folder, through a temporary file renamed at the end
  (`lit_memory.files`): the file is whole or absent.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import json
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Literal, Optional

import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from lit_memory import files, guard
from lit_memory.bounds import CHARS_PER_TOKEN
from lit_memory.errors import UserError
from lit_memory.local_data import load_local

# Columns looked for, in this order, when data.text_column / label_column / id_column are not set.
TEXT_COLUMNS = ("text", "sentence", "review", "content")
LABEL_COLUMNS = ("label", "labels")
ID_COLUMNS = ("id",)
IGNORE = -100  # a row without a label the model knows (and padding rows): not in the metrics
FORMATS = {"csv": ",", "tsv": "\t", "jsonl": None}
JSON_CHUNK = 1 << 16  # characters read at a time from a JSON array
JSON_LINES_CHUNK = 1 << 20  # bytes of JSON lines parsed at a time


def read_texts(path: Path, file_formats: dict[str, tuple[str, dict[str, Any]]]):
    """The rows of a local text file as a `datasets.IterableDataset` (plain dicts, read as they are consumed)."""
    import datasets

    suffix = path.suffix.lower()
    if suffix not in file_formats:
        raise UserError(f"unsupported file {path}: use one of " + ", ".join(file_formats))
    builder, kwargs = file_formats[suffix]
    if builder == "json" and _first_char(path) == "[":
        # `datasets` reads a JSON array whole; decode it item by item instead.
        return datasets.IterableDataset.from_generator(json_array_rows, gen_kwargs={"path": str(path)})
    if builder == "csv":
        # Texts verbatim ("NA", "null" and empty cells stay strings, not NaN); odd bytes replaced, as for training.
        kwargs = {**kwargs, "na_filter": False, "encoding_errors": "replace"}
    else:  # JSON lines in blocks of 1 MB (datasets' default, 10 MB, is a lot to hold for the first batch)
        kwargs = {**kwargs, "chunksize": JSON_LINES_CHUNK}
    try:
        return load_local(builder, path, streaming=True, split="train", **kwargs)
    except Exception as err:
        raise UserError(f"cannot read {path}: {str(err).splitlines()[0]}") from err


def _first_char(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(codecs.BOM_UTF8):
        head = head[len(codecs.BOM_UTF8) :]
    stripped = head.lstrip()
    return chr(stripped[0]) if stripped else ""


def json_array_rows(path: str) -> Iterator[dict[str, Any]]:
    """The items of a JSON array file, one at a time (objects as rows; strings as ``{"text": ...}``, as
    `datasets` reads them), holding at most one chunk plus one item in memory."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        buffer, pos, eof = "", 0, False

        def more() -> bool:
            nonlocal buffer, pos, eof
            chunk = f.read(JSON_CHUNK)
            eof = not chunk
            buffer, pos = buffer[pos:] + chunk, 0
            return not eof

        def skip(chars: str) -> str:
            nonlocal pos
            while True:
                while pos < len(buffer) and buffer[pos] in chars:
                    pos += 1
                if pos < len(buffer) or not more():
                    return buffer[pos] if pos < len(buffer) else ""

        if skip(" \t\r\n") != "[":
            raise ValueError(f"{path} is not a JSON array")
        pos += 1
        while True:
            if skip(" \t\r\n,") in ("]", ""):
                return
            try:
                item, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if not more():
                    raise
                continue
            if end == len(buffer) and not eof and more():
                continue  # an item that ends with the chunk (a number) may go on in the next one
            pos = end
            yield item if isinstance(item, dict) else {"text": item}


def pick_columns(
    columns: Sequence[str], text: Optional[str], label: Optional[str], id_: Optional[str], where: str,
    defaults: tuple[Optional[str], Optional[str]] = (None, None),
) -> tuple[str, Optional[str], Optional[str]]:
    """(text, label or None, id or None) columns of a file with ``columns``: the ones set, else the first found of
    the training data's (``defaults``: the bundled tweets' ``sentiment``) and the usual names. Only the text column
    is required."""

    def first(given: Optional[str], usual: Sequence[str]) -> Optional[str]:
        if given is not None:
            return given if given in columns else None
        return next((c for c in usual if c in columns), None)

    found = first(text, (*filter(None, defaults[:1]), *TEXT_COLUMNS))
    if found is None:
        wanted = f"column {text!r}" if text is not None else "text column (" + ", ".join(TEXT_COLUMNS) + ")"
        raise UserError(f"{where} has no {wanted}; its columns are {list(columns)} (set data.text_column)")
    if id_ is not None and id_ not in columns:
        raise UserError(f"{where} has no column {id_!r}; its columns are {list(columns)} (set data.id_column)")
    return found, first(label, (*filter(None, defaults[1:]), *LABEL_COLUMNS)), first(id_, ID_COLUMNS)


class Rows(torch.utils.data.IterableDataset):
    """``(index, row)`` for every row of ``source`` this rank predicts: every ``world_size``-th from ``rank``. Each
    rank reads the whole stream and ends with padding rows (index -1) up to ``ceil(rows / world_size)``, so
    every rank runs the same number of batches."""

    def __init__(self, source: Any, rank: int = 0, world_size: int = 1, where: str = "the input") -> None:
        self.source, self.rank, self.world_size, self.where = source, rank, world_size, where

    def __iter__(self) -> Iterator[tuple[int, Optional[dict[str, Any]]]]:
        total = mine = 0
        rows = iter(self.source)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                break
            except Exception as err:  # a malformed line part-way: one line (the output file is not kept)
                raise UserError(f"cannot read {self.where} after row {total}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
            if total % self.world_size == self.rank:
                mine += 1
                yield total, row
            total += 1
        for _ in range(math.ceil(total / self.world_size) - mine):
            yield -1, None


class Collate:
    """A batch of `Rows` items: the tokenised texts, ``labels`` (ids; `IGNORE` where the row's label is not one
    the model knows) where the file has a label column, and ``rows``: each row's index, key (id or text) and
    given label, for the writer."""

    def __init__(
        self, tokenizer: Any, max_length: int, padding: str, text: str, label: Optional[str], id_: Optional[str],
        label_names: Sequence[str],
    ) -> None:
        self.tokenizer, self.max_length, self.padding = tokenizer, max_length, padding
        self.text, self.label, self.id = text, label, id_
        self.label_names = list(label_names)
        self.ids = {name: i for i, name in enumerate(self.label_names)}

    def label_id(self, value: Any) -> int:
        """A given label as the model's id: its name, or an id in range (as an int or its digits)."""
        if isinstance(value, str) and value in self.ids:
            return self.ids[value]
        if isinstance(value, bool):
            return IGNORE
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return value if isinstance(value, int) and 0 <= value < len(self.label_names) else IGNORE

    def __call__(self, items: list[tuple[int, Optional[dict[str, Any]]]]) -> dict[str, Any]:
        texts, labels, keys, given = [], [], [], []
        for _, row in items:
            row = row or {}
            value = row.get(self.text)
            texts.append("" if value is None else str(value))
            key = row.get(self.id) if self.id else value
            keys.append("" if key is None else key)
            if self.label:
                raw = row.get(self.label)
                missing = raw is None or raw == ""
                labels.append(IGNORE if missing else self.label_id(raw))
                given.append(None if missing else raw)
        if guard.restricted():  # as the training data: a huge row costs no more than max_length tokens' text
            cap = self.max_length * CHARS_PER_TOKEN
            texts = [t[:cap] for t in texts]
        padding = "max_length" if self.padding == "max_length" else "longest"
        batch = dict(self.tokenizer(texts, truncation=True, max_length=self.max_length, padding=padding, return_tensors="pt"))
        if self.label:
            batch["labels"] = torch.tensor(labels, dtype=torch.long)
        batch["rows"] = {"index": [index for index, _ in items], "key": keys, "given": given or None, "id_column": self.id}
        return batch


class PredictionWriter(BasePredictionWriter):
    """Write every prediction batch as it comes into one file in the run folder (written whole: a temporary
    file renamed when the last batch is in, removed if the run fails).

    Args:
        format: ``csv`` (default), ``tsv`` or ``jsonl``. The file is ``predictions.<format>`` in the run folder.
    """

    def __init__(self, format: Literal["csv", "tsv", "jsonl"] = "csv") -> None:
        super().__init__("batch")
        if format not in FORMATS:
            raise UserError(f"predictions.format must be one of {', '.join(FORMATS)}, got {format!r}")
        self.format = format
        self.path: Optional[Path] = None
        self.rows = 0
        self.unknown = 0  # given labels the model does not know
        self._stack: Optional[contextlib.ExitStack] = None
        self._out: Optional[IO] = None
        self._csv: Any = None
        self._header: Optional[list[str]] = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.run_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank asks

    def on_predict_start(self, trainer, pl_module) -> None:
        self.rows = self.unknown = 0
        self._header = None
        if trainer.is_global_zero:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.path = self.run_dir / f"predictions.{self.format}"
            self._stack = contextlib.ExitStack()
            self._out = self._stack.enter_context(files.replacing(self.path))
            if FORMATS[self.format]:
                self._csv = csv.writer(self._out, delimiter=FORMATS[self.format], lineterminator="\n")

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx) -> None:
        rows = batch["rows"]
        probs = prediction["probs"].float().cpu().tolist()
        labels = batch.get("labels")
        labels = labels.tolist() if labels is not None else [None] * len(probs)
        given = rows["given"] or [None] * len(probs)
        mine = [
            (index, key, p, label, raw)
            for index, key, p, label, raw in zip(rows["index"], rows["key"], probs, labels, given)
            if index >= 0  # not padding
        ]
        if trainer.world_size > 1:  # every rank's rows of this batch, to rank 0, in input order
            gathered: list = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, mine)
            mine = sorted((row for part in gathered for row in part), key=lambda row: row[0])
        if trainer.is_global_zero:
            self._write(mine, pl_module.label_names, id_column=batch["rows"].get("id_column"),
                        labelled=batch.get("labels") is not None)

    def _write(self, rows: list, names: Sequence[str], id_column: Optional[str], labelled: bool) -> None:
        if self._header is None:
            self._header = [id_column or "text", "label", *(f"prob_{n}" for n in names)]
            if labelled:
                self._header.append("given_label")
            if self._csv is not None:
                self._csv.writerow(self._header)
        for _, key, probs, label, raw in rows:
            values = [key, names[max(range(len(probs)), key=probs.__getitem__)], *(round(p, 6) for p in probs)]
            if labelled:
                if label is None or label < 0:
                    self.unknown += raw is not None
                    values.append("" if raw is None else raw)
                else:
                    values.append(names[label])
            if self._csv is not None:
                self._csv.writerow(values)
            else:
                self._out.write(json.dumps(dict(zip(self._header, values)), ensure_ascii=False) + "\n")
        self.rows += len(rows)

    def on_predict_end(self, trainer, pl_module) -> None:
        if self._stack is None:
            return
        stack, self._stack = self._stack, None
        stack.close()  # the temporary file takes its name
        print(f"predictions: {self.rows} rows written to {self.path}")
        if self.unknown:
            print(
                f"note: {self.unknown} row(s) have a label the model does not know (its labels: "
                f"{', '.join(pl_module.label_names)}): left out of the metrics",
                file=sys.stderr,
            )

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self._stack is not None:  # nothing half-written: the temporary file goes
            stack, self._stack = self._stack, None
            with contextlib.suppress(BaseException):
                stack.__exit__(type(exception), exception, exception.__traceback__)
