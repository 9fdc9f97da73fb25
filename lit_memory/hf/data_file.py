"""A local data file checked before anything reads it: that it exists and is a file of a known kind, is not empty,
decodes in its encoding, and (a CSV/TSV file's header) holds the columns named.

One implementation for the data module (`lit_memory.data`) and for the check ``python -m lit_memory`` makes before it
imports torch (`lit_memory.config.data_check`): the standard library and the package's light modules only, so a
mistyped path, an empty file, a file in another encoding or a missing column is one ``error:`` line within a second,
the same line the data module would give.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

from lit_memory.errors import UserError
from lit_memory.hf import bundled, text_encoding

BUNDLED = "bundled"
# File suffix -> (datasets builder, extra builder kwargs).
FILE_FORMATS = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
}


def local_file(source: str) -> Optional[Path]:
    """A source with a known file suffix (or an existing path) is a local file: checked now; None for a hub dataset."""
    if source == BUNDLED:
        return bundled.tweets_csv()
    path = Path(source).expanduser()
    if path.suffix.lower() not in FILE_FORMATS and not path.exists():
        return None  # a hub dataset name
    if not path.is_file():
        if path.exists():  # a FIFO, a device: reading it may never end
            raise UserError(f"data file {source} is not a regular file")
        raise UserError(f"data file not found: {source}")
    if path.suffix.lower() not in FILE_FORMATS:
        raise UserError(f"unsupported data file {source}: use one of " + ", ".join(FILE_FORMATS))
    return path


def decoding(path: Path, where: str, encoding: Optional[str], errors: text_encoding.Errors) -> text_encoding.Decoding:
    """How the training file ``path`` (``where``, as the messages name it) is read (`text_encoding.decoding`), after
    refusing an empty one."""
    if text_encoding.blank(path):
        raise UserError(f"data file {where} is empty")
    return text_encoding.decoding(path, encoding, errors)


def predict_file(path: str) -> Path:
    """``data.predict_path`` checked: an existing file of a known kind."""
    found = Path(path).expanduser()
    if not found.is_file():
        raise UserError(f"data.predict_path: file not found: {path}")
    if found.suffix.lower() not in FILE_FORMATS:
        raise UserError(f"data.predict_path: unsupported file {path}: use one of " + ", ".join(FILE_FORMATS))
    return found


def predict_decoding(
    path: Path, encoding: Optional[str], errors: Optional[text_encoding.Errors]
) -> text_encoding.Decoding:
    """How the file to predict is read, after refusing an empty one (``data.predict_encoding`` names its encoding)."""
    if text_encoding.blank(path):
        raise UserError(f"data.predict_path: {path} is empty")
    return text_encoding.decoding(path, encoding, errors or "strict", flag="data.predict_encoding")


def header(path: Path, read_as: text_encoding.Decoding) -> Optional[list[str]]:
    """A CSV/TSV file's column names as `datasets`' csv builder (pandas) reads them from its first row, where that is
    plain; None where pandas would read another list: a repeated or empty name (renamed ``a.1``, ``Unnamed: 1``), a
    first data row with another number of fields (the extra ones become an index) or none (no rows), a JSON file."""
    builder, options = FILE_FORMATS[path.suffix.lower()]
    if builder != "csv":
        return None
    with open(path, encoding=read_as.encoding, errors=read_as.errors, newline="") as f:
        rows = (row for row in csv.reader(f, delimiter=options.get("delimiter", ",")) if row)
        names, first = next(rows, None), next(rows, None)
    if not names or first is None or len(first) != len(names) or "" in names or len(set(names)) != len(names):
        return None
    return names
