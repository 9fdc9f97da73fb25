"""`lit_memory.text_encoding` and the files the data module reads: a byte is never changed without saying so (UTF-8
or what the file's byte-order mark says, else the encoding the user names; a byte that does not decode is one error
line, or with replacement asked for, counted), and an empty file says it is empty."""

from __future__ import annotations

import json

import pytest

from lit_memory.data import FILE_FORMATS, TextClassificationData
from lit_memory.errors import UserError
from lit_memory.predict_file import read_texts
from lit_memory.text_encoding import decoding

TEXTS = ["Café owner pays £5m for Zürich site", "a plain line", "naïve résumé, 30 °C"]


def latin1_csv(path, copies: int = 10):
    lines = ["text,label"] + [f'"{t}",{i % 2}' for _ in range(copies) for i, t in enumerate(TEXTS)]
    path.write_bytes(("\n".join(lines) + "\n").encode("latin-1"))
    return path


def test_a_latin1_file_is_refused_in_one_line_naming_the_line_and_the_encoding_to_type(tmp_path):
    path = latin1_csv(tmp_path / "news.csv")
    with pytest.raises(UserError) as refused:
        decoding(path)
    assert str(refused.value) == (
        f"{path} is not utf-8 text: line 2 has the byte 0xe9 (near '\"Caf\\\\xe9 owner pa'); name the file's encoding "
        "with --data.encoding ENCODING (it decodes as cp1252, Windows' Western encoding: --data.encoding cp1252), or "
        "replace what does not decode with --data.encoding_errors replace (the lines changed are counted)"
    )
    with pytest.raises(UserError, match=r"^data.encoding: unknown encoding 'latin-9000'"):
        decoding(path, "latin-9000")


def test_training_and_predict_read_the_text_as_written_in_the_encoding_named(tmp_path):
    path = latin1_csv(tmp_path / "news.csv")
    with pytest.raises(UserError, match=r"news.csv is not utf-8 text: line 2 has the byte 0xe9"):
        TextClassificationData(source=str(path)).load_splits()
    data = TextClassificationData(source=str(path), encoding="latin-1", limit_train_samples=None)
    splits = data.load_splits()
    read = {t for name in ("train", "validation", "test") for t in splits[name]["text"]}
    assert read == set(TEXTS)
    assert "read as iso8859-1" in data.summary
    assert [r["text"] for r in read_texts(path, FILE_FORMATS, decoding(path, "latin-1"))][:3] == TEXTS
    data = TextClassificationData(source=str(path), encoding_errors="replace", limit_train_samples=None)
    data.load_splits()  # asked for: replaced, and the lines changed counted
    assert "20 lines of" in data.summary and "held bytes that are not utf-8, replaced by U+FFFD" in data.summary


def test_a_byte_order_mark_names_the_encoding(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_text("text,label\n" + "".join(f'"{t}",{i % 2}\n' for i, t in enumerate(TEXTS * 4)), encoding="utf-16")
    splits = TextClassificationData(source=str(path), limit_train_samples=None).load_splits()
    assert {t for name in ("train", "validation", "test") for t in splits[name]["text"]} == set(TEXTS)
    jsonl = tmp_path / "texts.json"
    jsonl.write_text(json.dumps([{"text": t} for t in TEXTS]), encoding="utf-8-sig")
    assert [r["text"] for r in read_texts(jsonl, FILE_FORMATS, decoding(jsonl))] == TEXTS


@pytest.mark.parametrize("name, content, message", [
    ("empty.csv", b"", "data file {path} is empty"),
    ("blank.jsonl", b"\n \n", "data file {path} is empty"),
    ("header.csv", b"text,label\n", "data file {path} has no rows (only its header)"),
    ("array.json", b"[]", "data file {path} has no rows"),
])
def test_an_empty_file_says_it_is_empty(name, content, message, tmp_path):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserError) as refused:
        TextClassificationData(source=str(path)).load_splits()
    assert str(refused.value) == message.format(path=path)
