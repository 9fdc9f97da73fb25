"""How a data file's bytes become text: never a byte changed without saying so.

A file is read as UTF-8 unless it says otherwise (a byte-order mark names UTF-8, UTF-16 or UTF-32) or the user names
its encoding (``data.encoding``). `decoding` reads the file once, as a stream, before anything else does: a byte its
encoding cannot decode is one error line naming the line it is on and what to type (the encoding it does decode as,
where Windows' Western one does), unless the user asked for replacement (``data.encoding_errors: replace``), and then
the lines changed are counted for the ``data:`` line. Guessing an encoding silently would change text as surely as
replacing bytes (``£`` is ``Ł`` in Central European Windows), so nothing is guessed.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from lit_memory.errors import UserError

Errors = Literal["strict", "replace"]
CHUNK = 1 << 20  # bytes read at a time
# Byte-order marks, longest first (UTF-32's starts with UTF-16's), and the codec that reads past them.
BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
        (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
# What a file that is not UTF-8 most often is (Excel's "CSV" on Western Windows; Latin-1 is its subset): suggested
# where the file decodes with it, never used unasked.
SUGGESTED = "cp1252"


@dataclass(frozen=True)
class Decoding:
    """How to read a file: its ``encoding`` (a Python codec name), ``errors`` as Python takes them, and how many lines
    held bytes the encoding cannot decode (replaced by U+FFFD; 0 when ``errors`` is strict)."""

    encoding: str
    errors: Errors = "strict"
    replaced_lines: int = 0
    named: bool = False  # the user named the encoding (else: UTF-8, or what the file's byte-order mark says)

    def note(self, where: str, why: str = "data.encoding_errors replace") -> Optional[str]:
        """The words for the ``data:`` line: an encoding other than UTF-8, lines with bytes replaced (and ``why``)."""
        parts = []
        if self.encoding not in ("utf-8", "utf-8-sig"):
            parts.append(f"read as {self.encoding}" + ("" if self.named else " (its byte-order mark)"))
        if self.replaced_lines:
            parts.append(
                f"{self.replaced_lines:,} line{'s' if self.replaced_lines != 1 else ''} of {where} held bytes that are "
                f"not {self.encoding}, replaced by U+FFFD ({why})"
            )
        return "; ".join(parts) or None

    def for_datasets(self) -> dict[str, str]:
        """``encoding`` and ``encoding_errors`` for a `datasets` builder. Its json builder decodes a batch only where
        the encoding is not spelled "utf-8" (it hands UTF-8 bytes to pyarrow as they are, errors and all): UTF-8 with
        replacement is named by another of its aliases, so that the bytes are replaced as asked."""
        encoding = "utf_8" if self.encoding == "utf-8" and self.errors != "strict" else self.encoding
        return {"encoding": encoding, "encoding_errors": self.errors}

    @property
    def ascii_compatible(self) -> bool:
        """Whether the encoding writes ASCII (newlines, JSON's punctuation) as ASCII bytes, one byte each, as readers
        that split a file at newline bytes (`datasets`' JSON lines) assume; UTF-16 and UTF-32 do not."""
        return ascii_compatible(self.encoding)


def ascii_compatible(encoding: str) -> bool:
    """Whether ``encoding`` writes ASCII text as the same bytes (UTF-8, cp1252, Shift JIS: yes; UTF-16/32: no)."""
    sample = '\n\r\t []{}",:0aZ'
    try:
        return sample.encode(encoding).removeprefix(codecs.BOM_UTF8) == sample.encode("ascii")  # utf-8-sig: its BOM
    except UnicodeError:
        return False


def decoding(
    path: Path, encoding: Optional[str] = None, errors: Errors = "strict", flag: str = "data.encoding"
) -> Decoding:
    """How ``path`` is read: ``encoding`` if given (checked to be a codec), else what its byte-order mark says, else
    UTF-8; the whole file decoded once to find a byte that does not decode (refused, or with ``errors="replace"``
    counted by line). ``flag``: the option that names the encoding, for the messages."""
    if errors not in ("strict", "replace"):
        raise UserError(f"{flag}_errors must be strict or replace, got {errors!r}")
    if encoding is not None:
        try:
            codec = codecs.lookup(encoding).name
        except LookupError:
            raise UserError(f"{flag}: unknown encoding {encoding!r} (a Python codec name: utf-8, cp1252, latin-1, "
                            "utf-16, shift_jis, gb18030, ...)") from None
    else:
        codec = _bom_codec(path)
    line, byte, context = _first_undecodable(path, codec)
    if line is None:
        return Decoding(codec, errors, 0, named=encoding is not None)
    if errors == "replace":
        return Decoding(codec, errors, _lines_undecodable(path, codec), named=encoding is not None)
    hint = f" (it decodes as {SUGGESTED}, Windows' Western encoding: --{flag} {SUGGESTED})" if (
        codec.startswith("utf") and _first_undecodable(path, SUGGESTED)[0] is None) else ""
    raise UserError(
        f"{path} is not {codec} text: line {line:,} has the byte 0x{byte:02x} ({context}); name the file's "
        "encoding with "
        f"--{flag} ENCODING{hint}, or replace what does not decode with --{flag}_errors replace (the lines changed "
        "are counted)"
    )


def blank(path: Path) -> bool:
    """Whether a file holds nothing but whitespace (or nothing at all)."""
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            if chunk.strip():
                return False
    return True


def first_char(path: Path, encoding: str = "utf-8") -> str:
    """The first character of a file that is not whitespace (or a byte-order mark), read in ``encoding``; "" for
    none in its first 4 KiB."""
    with open(path, "rb") as f:
        head = f.read(4096)
    text = codecs.getincrementaldecoder(encoding)("replace").decode(head)  # a character cut at 4 KiB waits
    return text.lstrip("\ufeff \t\r\n")[:1]


def _bom_codec(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4)
    return next((codec for bom, codec in BOMS if head.startswith(bom)), "utf-8")


def _first_undecodable(path: Path, codec: str) -> tuple[Optional[int], int, str]:
    """(line number, the byte, a few characters around it) of the first byte ``codec`` cannot decode; (None, 0, "")."""
    decoder = codecs.getincrementaldecoder(codec)("strict")
    lines = 1
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:  # err.object: what the decoder held from before, then this chunk
                data, start = bytes(err.object), max(err.start, 0)
                line_start = data.rfind(b"\n", 0, start) + 1
                shown = data[max(line_start, start - 30) : start + 10].decode(codec, errors="backslashreplace")
                return (
                    lines + data[:start].count(b"\n"),
                    data[start],
                    f"near '{_visible(shown.splitlines()[0].strip())}'",
                )
            if not chunk:
                return None, 0, ""
            lines += chunk.count(b"\n")


def _visible(text: str) -> str:
    """``text`` as one line shows it: a byte that does not decode as its escape (``Caf\\xe9``, once, as
    ``backslashreplace`` left it), control characters escaped, the rest as it is (no repr: it doubles backslashes)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _lines_undecodable(path: Path, codec: str) -> int:
    """Lines holding a byte ``codec`` cannot decode (a line split at newline bytes: ASCII-compatible codecs; for
    UTF-16/32, the replacement characters a decode leaves)."""
    if codec.startswith(("utf-16", "utf-32")):
        return path.read_bytes().decode(codec, errors="replace").count("\ufffd")
    count = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                raw.decode(codec)
            except UnicodeDecodeError:
                count += 1
    return count
