"""`lit_memory.hf.text_encoding` and the files the data module reads: a byte is never changed without saying so (UTF-8
or what the file's byte-order mark says, else the encoding the user names; a byte that does not decode is one error
line, or with replacement asked for, counted), and an empty file says it is empty."""

from __future__ import annotations

import json

import pytest

from lit_memory.data import FILE_FORMATS, TextClassificationData
from lit_memory.errors import UserError
from lit_memory.hf.text_encoding import decoding
from lit_memory.run import predict_file
from lit_memory.run.predict_file import read_texts

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
        f"{path} is not utf-8 text: line 2 has the byte 0xe9 (near '\"Caf\\xe9 owner pa'); name the file's encoding "
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


def test_replacement_asked_for_reads_json_lines_too(tmp_path):
    """`datasets`' json builder decodes only an encoding not spelled "utf-8": the bytes must be replaced all the same,
    not left for pyarrow to fail on when a text is read."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok", "label": 0}\n{"text": "Caf\xe9", "label": 1}\n' * 5)
    data = TextClassificationData(source=str(path), encoding_errors="replace", limit_train_samples=None,
                                  val_fraction=0.2, test_fraction=0.2)
    splits = data.load_splits()
    assert {t for name in ("train", "validation", "test") for t in splits[name]["text"]} == {"ok", "Caf\ufffd"}
    assert "5 lines of" in data.summary
    assert [r["text"] for r in read_texts(path, FILE_FORMATS, decoding(path, None, "replace"))][:2] == [
        "ok",
        "Caf\ufffd",
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_utf16_json_lines_and_arrays_read_past_a_chunk(suffix, tmp_path, monkeypatch):
    """UTF-16 JSON lines longer than a block of `datasets`' reader (cut at a newline byte: half of UTF-16's), and a
    UTF-16 JSON array (its "[" after the byte-order mark), for training and predict."""
    monkeypatch.setitem(FILE_FORMATS, ".jsonl", ("json", {"chunksize": 16 << 10}))  # datasets' 10 MB, smaller
    monkeypatch.setattr(predict_file, "JSON_LINES_CHUNK", 16 << 10)
    rows = [{"text": f"{TEXTS[i % 3]} {i}", "label": i % 2} for i in range(600)]  # ~60 KB in UTF-16
    path = tmp_path / f"texts{suffix}"
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(lines if suffix == ".jsonl" else json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-16")
    assert path.stat().st_size > 3 * (16 << 10)
    assert [r["text"] for r in read_texts(path, FILE_FORMATS, decoding(path))] == [r["text"] for r in rows]
    splits = TextClassificationData(source=str(path), limit_train_samples=None).load_splits()
    assert sorted(t for name in ("train", "validation", "test") for t in splits[name]["text"]) == sorted(
        r["text"] for r in rows)


def test_a_file_to_predict_is_read_in_its_own_encoding_not_the_training_files(tmp_path):
    """A run trained on a cp1252 file keeps data.encoding cp1252 in its config.yaml: a UTF-8 file to predict is read
    as UTF-8 all the same (cp1252 would read its "é" as "Ã©" without a word); data.predict_encoding names its own."""
    train = latin1_csv(tmp_path / "news.csv")
    new = tmp_path / "new.csv"
    new.write_text("text\n" + "".join(f'"{t}"\n' for t in TEXTS), encoding="utf-8")
    data = TextClassificationData(source=str(train), encoding="cp1252", predict_path=str(new))
    assert [row["text"] for _, row in data.predict_rows()] == TEXTS
    old = latin1_csv(tmp_path / "old.csv", copies=1)
    with pytest.raises(UserError, match=r"old.csv is not utf-8 text: line 2 .* --data.predict_encoding cp1252\)"):
        TextClassificationData(source=str(train), encoding="cp1252", predict_path=str(old)).predict_rows()
    data = TextClassificationData(source=str(train), encoding="cp1252", predict_path=str(old),
                                  predict_encoding="latin-1")
    assert [row["text"] for _, row in data.predict_rows()] == TEXTS


@pytest.mark.parametrize("given", [{"encoding": "cp1252"}, {"encoding_errors": "replace"}])
def test_an_encoding_for_a_hub_dataset_is_refused_in_one_line(given):
    """A hub dataset is read as published (datasets' builders): an encoding typed for it would do nothing."""
    name, value = next(iter(given.items()))
    with pytest.raises(
        UserError, match=rf"^data.{name} '{value}' is for a local data file: data.source 'someone/news' is a hub"
    ):
        TextClassificationData(source="someone/news", **given)
    assert TextClassificationData(source="someone/news", encoding_errors="strict").hparams.encoding_errors == "strict"
