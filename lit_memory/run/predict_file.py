"""Predictions for a file of texts, streamed in and written out batch by batch.

- **In**: `read_texts` streams a CSV, TSV, JSON or JSONL file with Hugging Face `datasets` (``streaming=True``:
  pandas reads CSV in chunks, JSON lines in blocks; a JSON array, which `datasets` would read whole, is decoded
  item by item here), so the whole file is never in memory. `Rows` numbers the rows and, under several
  processes, deals them out round-robin (every rank the same number of batches: a sharded forward is a
  collective). `Collate` tokenises each batch and maps the labels, where the file has them, to the model's ids.
- **Out**: `PredictionWriter`, Lightning's `BasePredictionWriter` at every batch (the CLI runs ``predict`` with
  ``return_predictions=false``, so Lightning collects nothing): rank 0 writes one row per input (its id, or its
  text; the predicted label's name; a probability per label; the given label where there is one) in input order
  into one file, through a temporary file renamed at the end (`lit_memory.files`): the file is whole or absent.
- **Where**: `destination`: ``--output`` (a file, or a folder holding ``predictions.<format>``), else beside the
  model predicted with: the run folder of its checkpoint (``RUN/checkpoints/x.ckpt`` -> ``RUN/``) or of its exported
  folder (``RUN/hf_model`` -> ``RUN/``), where the run's logs, config and model are, and never inside the model
  folder, which is what gets shared or pushed to the Hub; a model from the Hub: ``lightning_logs/predict/``. One path
  per model, not a new folder per call: the next call replaces the file and says so.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Literal, Optional

import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from lit_memory import files
from lit_memory import task as task_
from lit_memory.errors import UserError
from lit_memory.hf import text_encoding, windows
from lit_memory.hf.local_data import load_local
from lit_memory.hf.text_encoding import Decoding
from lit_memory.sandbox import guard
from lit_memory.sandbox.bounds import CHARS_PER_TOKEN
from lit_memory.task import IGNORE

FORMATS = {"csv": ",", "tsv": "\t", "jsonl": None}
FILE_NAME = "predictions"  # predictions.<format> in a folder
PREDICT_FOLDER = ("lightning_logs", "predict")  # beneath the default root: a model that is not a local file or folder


def destination(
    output: Optional[str], format: Optional[str], ckpt_path: Optional[str] = None, model: Optional[str] = None,
    root: Optional[str] = None,
) -> tuple[Path, str]:
    """The file predictions go to and its format: ``output`` (a file, or a folder: an existing one, one ending with a
    separator or a name without a suffix, holding ``predictions.<format>``), else `beside_the_model`. The format is
    ``format``, else the file's suffix where it is one of `FORMATS`, else csv; a format the file's suffix contradicts is
    one error line."""
    if output:
        given = Path(output).expanduser()
        folder = given.is_dir() or output.endswith(("/", os.sep)) or not given.suffix
        path = given / FILE_NAME if folder else given
    else:
        path = beside_the_model(ckpt_path, model, root) / FILE_NAME
        folder = True
    suffix = path.suffix.lower().lstrip(".") if not folder else ""
    if format is not None and format not in FORMATS:
        raise UserError(f"predictions.format must be one of {', '.join(FORMATS)}, got {format!r}")
    if format is not None and suffix in FORMATS and suffix != format:
        raise UserError(f"--output {output} is a .{suffix} file and predictions.format is {format}: name a .{format} "
                        f"file, or leave predictions.format out")
    chosen = format or (suffix if suffix in FORMATS else "csv")
    return (path.with_name(f"{FILE_NAME}.{chosen}") if folder else path), chosen


def beside_the_model(ckpt_path: Optional[str], model: Optional[str], root: Optional[str]) -> Path:
    """The folder beside the model predicted with: its checkpoint's run folder (the folder holding ``checkpoints/``, a
    sharded checkpoint being a folder itself), else the folder holding its local model folder (``RUN/hf_model``:
    ``RUN``), else ``lightning_logs/predict`` beneath ``root`` (the working folder where null)."""
    if ckpt_path and ckpt_path not in guard.SPECIAL_CKPT and not guard.is_remote(str(ckpt_path)):
        folder = Path(ckpt_path).expanduser().parent
        return folder.parent if folder.name == "checkpoints" else folder
    if model and not model.startswith("bundled:") and Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve().parent
    return Path(root or ".").joinpath(*PREDICT_FOLDER)


def destination_of(settings: Any) -> tuple[Path, str]:
    """`destination` for a ``predict`` command's settings (`lit_memory.cli.LitMemoryCLI.settings`); one error line where
    it is the file predicted."""
    path, format = destination(
        settings.get("predictions.output"), settings.get("predictions.format"), settings.get("ckpt_path"),
        settings.get("model.model_name_or_path"), settings.get("trainer.default_root_dir"),
    )
    texts = settings.get("data.predict_path")
    if texts and os.path.realpath(os.path.expanduser(str(texts))) == os.path.realpath(path):
        raise UserError(f"the predictions would replace {texts}, the file predicted: name another file with --output")
    return path, format
JSON_CHUNK = 1 << 16  # characters read at a time from a JSON array
JSON_LINES_CHUNK = 1 << 20  # bytes of JSON lines parsed at a time


def read_texts(path: Path, file_formats: dict[str, tuple[str, dict[str, Any]]], decoding: Optional[Decoding] = None):
    """The rows of a local text file as a `datasets.IterableDataset` (plain dicts, read as they are consumed), decoded
    as ``decoding`` says (`lit_memory.hf.text_encoding.decoding`; default: UTF-8, strict)."""
    import datasets  # deferred: heavy (~0.6 s); only predict reads a file

    decoding = decoding or Decoding("utf-8")

    suffix = path.suffix.lower()
    if suffix not in file_formats:
        raise UserError(f"unsupported file {path}: use one of " + ", ".join(file_formats))
    builder, kwargs = file_formats[suffix]
    if builder == "json" and (
        not decoding.ascii_compatible or text_encoding.first_char(path, decoding.encoding) == "["
    ):
        # `datasets` reads a JSON array whole, and JSON lines in blocks cut at a newline byte (half of UTF-16's
        # newline): decoded here as text instead, item by item.
        gen_kwargs = {"path": str(path), "encoding": decoding.encoding, "errors": decoding.errors}
        return datasets.IterableDataset.from_generator(json_rows, gen_kwargs=gen_kwargs)
    kwargs = {**kwargs, **decoding.for_datasets()}
    if builder == "csv":
        # Texts verbatim ("NA", "null" and empty cells stay strings, not NaN).
        kwargs = {**kwargs, "na_filter": False}
    else:  # JSON lines in blocks of 1 MB (datasets' default, 10 MB, is a lot to hold for the first batch)
        kwargs = {**kwargs, "chunksize": JSON_LINES_CHUNK}
    try:
        return load_local(builder, path, streaming=True, split="train", **kwargs)
    except Exception as err:
        raise UserError(f"cannot read {path}: {str(err).splitlines()[0]}") from err


def json_dataset(path: Path, decoding: Decoding, where: str) -> Any:
    """A JSON file in UTF-16 or UTF-32 (`datasets` cuts JSON lines at newline bytes, half such a newline), its
    rows read as text (`json_rows`) into a `datasets.Dataset` cached under the file's path, size and time."""
    import datasets  # deferred: predict streams its rows without it

    stat = path.stat()
    fingerprint = hashlib.sha256(
        repr((str(path.resolve()), stat.st_size, stat.st_mtime_ns, decoding.encoding, decoding.errors)).encode()
    ).hexdigest()[:32]
    gen_kwargs = {"path": str(path), "encoding": decoding.encoding, "errors": decoding.errors}
    if next(json_rows(**gen_kwargs), None) is None:
        raise UserError(f"data file {where} has no rows")
    return datasets.Dataset.from_generator(json_rows, gen_kwargs=gen_kwargs, fingerprint=fingerprint)


def json_rows(path: str, encoding: str = "utf-8", errors: str = "strict") -> Iterator[dict[str, Any]]:
    """The rows of a JSON array or JSON Lines file (whichever its first character says), read as text in
    ``encoding``, one at a time: objects as rows, anything else as ``{"text": ...}``, as `datasets` reads them."""
    if text_encoding.first_char(Path(path), encoding) == "[":
        yield from json_array_rows(path, encoding, errors)
        return
    with open(path, encoding=encoding, errors=errors) as f:
        for number, line in enumerate(f):  # split at newlines as text: any encoding's
            if number == 0:
                line = line.lstrip("\ufeff")  # a byte-order mark is no text (UTF-8's, or one a named codec left)
            if line.strip():
                item = json.loads(line)
                yield item if isinstance(item, dict) else {"text": item}


def json_array_rows(path: str, encoding: str = "utf-8", errors: str = "strict") -> Iterator[dict[str, Any]]:
    """The items of a JSON array file, one at a time (objects as rows; strings as ``{"text": ...}``, as
    `datasets` reads them), holding at most one chunk plus one item in memory."""
    decoder = json.JSONDecoder()
    with open(path, encoding=encoding, errors=errors) as f:
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

        if skip("\ufeff \t\r\n") != "[":  # a byte-order mark is no item
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
                raise UserError(
                    f"cannot read {self.where} after row {total}: "
                    f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                ) from err
            if total % self.world_size == self.rank:
                mine += 1
                yield total, row
            total += 1
        for _ in range(math.ceil(total / self.world_size) - mine):
            yield -1, None


class Collate:
    """A batch of `Rows` items: the tokenised texts (a pair from two columns), ``labels`` where the input has them
    (as the model's problem type takes them: a class id, a value, one 0/1 per label) with ``known`` marking the rows
    whose label the model can score (a class it knows, a number, names it knows), and ``rows``: each row's index,
    key (id or text) and given label, for the writer. ``encoded``: the labels are the data module's already (its
    test split). ``stride`` (``data.long_texts chunk``): each text as windows sharing that many tokens, ``doc``
    naming each window's row (`lit_memory.hf.windows`)."""

    def __init__(
        self, tokenizer: Any, max_length: int, padding: str, columns: Any, id_: Optional[str],
        label_names: Sequence[str], kind: Optional[task_.ProblemKind] = None, encoded: bool = False,
        stride: Optional[int] = None,
    ) -> None:
        self.tokenizer, self.max_length, self.padding, self.stride = tokenizer, max_length, padding, stride
        self.texts, self.labels, self.id = tuple(columns.text), tuple(columns.label), id_
        self.label_names = list(label_names)
        self.ids = {name: i for i, name in enumerate(self.label_names)}
        self.kind = kind if kind is not None else task_.kind_of(None)  # no model to ask: the default kind
        self.encoded = encoded

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

    def target(self, row: dict[str, Any]) -> tuple[Any, bool, Any]:
        """(the label as the model takes it, whether it can be scored, the label as given) of one row."""
        if self.encoded:
            value = row["labels"]
            value = value.tolist() if isinstance(value, torch.Tensor) else value
            return value, True, self.kind.named(value, self.label_names)
        raw = [row.get(c) for c in self.labels]
        if any(v is None or v == "" for v in raw):
            return self.empty(), False, None
        return self.kind.target(raw, self.label_id, len(self.label_names))

    def empty(self) -> Any:
        return self.kind.unknown(len(self.label_names))

    def __call__(self, items: list[tuple[int, Optional[dict[str, Any]]]]) -> dict[str, Any]:
        columns: list[list[str]] = [[] for _ in self.texts]
        labels, known, keys, given = [], [], [], []
        for _, row in items:
            row = row or {}
            values = ["" if row.get(c) is None else str(row.get(c)) for c in self.texts]
            for column, value in zip(columns, values):
                column.append(value)
            key = row.get(self.id) if self.id else " | ".join(values)
            keys.append("" if key is None else key)
            if self.labels:
                value, scored, shown = self.target(row)
                labels.append(value)
                known.append(scored and row is not None and bool(row))
                given.append(shown)
        if guard.restricted():  # as the training data: a huge row costs no more than max_length tokens' text
            cap = self.max_length * CHARS_PER_TOKEN
            columns = [[t[:cap] for t in column] for column in columns]
        padding = "max_length" if self.padding == "max_length" else "longest"
        if self.stride is not None:
            encoded, owner = windows.cut(self.tokenizer, columns, self.max_length, self.stride, padding=padding,
                                         return_tensors="pt")
            batch = {**dict(encoded), "doc": torch.tensor(owner)}
        else:
            truncation = "longest_first" if len(columns) == 2 else True
            batch = dict(self.tokenizer(*columns, truncation=truncation, max_length=self.max_length, padding=padding,
                                        return_tensors="pt"))
        if self.labels:
            batch["labels"] = torch.tensor(labels, dtype=self.kind.target_dtype)
            batch["known"] = torch.tensor(known, dtype=torch.bool)
        batch["rows"] = {"index": [index for index, _ in items], "key": keys, "given": given or None,
                         "id_column": self.id, "text_columns": self.texts}
        return batch


class PredictionWriter(BasePredictionWriter):
    """Write every prediction batch as it comes into one file (written whole: a temporary file renamed when the
    last batch is in, removed if the run fails).

    Args:
        format: ``csv``, ``tsv`` or ``jsonl``; null: the output file's suffix where it is one of them, else csv.
        output: the file, or a folder to hold ``predictions.<format>`` (``predict --output PATH``); null: the run
            folder (``predict`` sets it beside the model predicted with: `destination`).
    """

    def __init__(self, format: Optional[Literal["csv", "tsv", "jsonl"]] = None, output: Optional[str] = None) -> None:
        super().__init__("batch")
        self.output = output
        self.path, self.format = destination(output, format, root=".") if output else (None, format or "csv")
        if format is not None and format not in FORMATS:  # (destination says so where there is an output)
            raise UserError(f"predictions.format must be one of {', '.join(FORMATS)}, got {format!r}")
        self.replaced = False  # a file was there before
        self.rows = 0
        self.unknown = 0  # given labels the model does not know
        self._stack: Optional[contextlib.ExitStack] = None
        self._out: Optional[IO] = None
        self._csv: Any = None
        self._header: Optional[list[str]] = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.output is None:
            run_dir = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank asks
            self.path = run_dir / f"{FILE_NAME}.{self.format}"

    def on_predict_start(self, trainer, pl_module) -> None:
        self.rows = self.unknown = 0
        self._header = None
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.replaced = self.path.exists()
            self._stack = contextlib.ExitStack()
            self._out = self._stack.enter_context(files.replacing(self.path))
            if FORMATS[self.format]:
                self._csv = csv.writer(self._out, delimiter=FORMATS[self.format], lineterminator="\n")

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        rows = batch["rows"]
        outputs = prediction["outputs"].float().cpu().tolist()
        known = batch.get("known")
        known = known.tolist() if known is not None else [None] * len(outputs)
        given = rows["given"] or [None] * len(outputs)
        mine = [
            (index, key, out, scored, raw)
            for index, key, out, scored, raw in zip(rows["index"], rows["key"], outputs, known, given)
            if index >= 0  # not padding
        ]
        if trainer.world_size > 1:  # every rank's rows of this batch, to rank 0, in input order
            gathered: list = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, mine)
            mine = sorted((row for part in gathered for row in part), key=lambda row: row[0])
        if trainer.is_global_zero:
            self._write(mine, pl_module, rows, labelled=batch.get("labels") is not None)

    def _header_of(self, pl_module: Any, rows: dict[str, Any], labelled: bool) -> list[str]:
        names = pl_module.label_names
        key = [rows.get("id_column") or ("text" if len(rows.get("text_columns") or ()) < 2 else "pair")]
        out = pl_module.kind.header(names)
        return key + out + (["given_label"] if labelled else [])

    def _write(self, rows: list, pl_module: Any, batch_rows: dict[str, Any], labelled: bool) -> None:
        names, kind = pl_module.label_names, pl_module.kind
        # The model's thresholds (`lit_memory.task.thresholds`), as float32 like the probabilities they are compared
        # with.
        found = getattr(pl_module, "decision_thresholds", None)
        limits = found.tensor.tolist() if found is not None else None
        if self._header is None:
            self._header = self._header_of(pl_module, batch_rows, labelled)
            if self._csv is not None:
                self._csv.writerow(self._header)
        for _, key, out, scored, raw in rows:
            values = [key, *kind.prediction(out, names, limits, joined=self._csv is not None)]
            if labelled:
                if raw is not None and not scored:
                    self.unknown += 1
                shown = "" if raw is None else raw
                if isinstance(shown, (list, tuple)) and self._csv is not None:
                    shown = "|".join(str(v) for v in shown)
                values.append(shown)
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
        print(
            f"predictions: {self.rows} rows written to {self.path}"
            + (" (replacing the file there)" if self.replaced else "")
        )
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
