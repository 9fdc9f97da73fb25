"""`lit_memory.config.data_check`: the data files a command names, checked before torch is imported, refuse with the
very line the data module gives (each kind of refusal against `lit_memory.data.TextClassificationData`), and leave to
the full run what they cannot read as it does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import RECIPES, REPO

from lit_memory.config import data_check
from lit_memory.data import TextClassificationData
from lit_memory.errors import UserError

LATIN_1 = "text,label\nCaf\xe9 au lait,positive\nthe tea,negative\n".encode("latin-1")
GOOD = "text,label\nhello there,positive\ngoodbye,negative\n"


def files(tmp_path) -> dict[str, str]:
    (tmp_path / "empty.csv").write_bytes(b"")
    (tmp_path / "blank.tsv").write_text(" \n\n")
    (tmp_path / "latin1.csv").write_bytes(LATIN_1)
    (tmp_path / "good.csv").write_text(GOOD, encoding="utf-8")
    (tmp_path / "good.txt").write_text(GOOD, encoding="utf-8")
    (tmp_path / "folder.csv").mkdir()
    return {p.name: str(p) for p in tmp_path.iterdir()} | {"missing.csv": str(tmp_path / "missing.csv")}


def heavy(command: str, data: dict) -> str:
    """The data module's refusal, as the full run meets it: building the module, then reading the source (or, for
    predict, the file of texts)."""
    with pytest.raises(UserError) as error:
        module = TextClassificationData(**data)
        if command == "predict" and data.get("predict_path"):
            module._prepare_predict()
        else:
            module.load_splits()
    return str(error.value)


def light(command: str, data: dict, trusted: bool = False) -> str:
    argv = [token for key, value in data.items() for token in (f"--data.{key}", _typed(value))]
    with pytest.raises(UserError) as error:
        data_check.check(command, ["--config", str(RECIPES / "4gb.yaml"), *argv], trusted)
    return str(error.value)


def _typed(value) -> str:
    return f"[{', '.join(value)}]" if isinstance(value, list) else str(value)


@pytest.mark.parametrize("command, data", [
    ("fit", {"source": "missing.csv"}),
    ("fit", {"source": "folder.csv"}),  # not a regular file
    ("fit", {"source": "good.txt"}),  # an existing file of no known kind
    ("fit", {"source": "empty.csv"}),
    ("validate", {"source": "blank.tsv"}),
    ("fit", {"source": "latin1.csv"}),  # names --data.encoding cp1252
    ("test", {"source": "good.csv", "encoding": "latin-9x"}),  # not a codec
    ("fit", {"source": "latin1.csv", "encoding": "cp1252", "text_column": "txt"}),
    ("fit", {"source": "good.csv", "label_column": "class"}),
    ("fit", {"source": "good.csv", "text_column": ["text", "second"]}),
    ("fit", {"source": "good.csv", "predict_path": "missing.csv"}),
    ("predict", {"predict_path": "missing.csv"}),  # beside the bundled tweets
    ("predict", {"source": "good.csv", "predict_path": "empty.csv"}),
    ("predict", {"source": "good.csv", "predict_path": "latin1.csv"}),  # names --data.predict_encoding
])
def test_each_refusal_is_the_data_modules_line(tmp_path, monkeypatch, command, data):
    names = files(tmp_path)
    monkeypatch.chdir(tmp_path)
    data = {k: (names[v] if k in ("source", "predict_path") else v) for k, v in data.items()}
    data.setdefault("source", "bundled")
    assert light(command, data) == heavy(command, data)


def test_what_it_cannot_read_as_the_full_parse_is_left_to_the_run(tmp_path, monkeypatch):
    names = files(tmp_path)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    sent = tmp_path / "sent" / "mine.yaml"
    sent.parent.mkdir()
    sent.write_text(f"data:\n  source: {names['empty.csv']}\n")  # a sent config's file beside it: not beneath it
    for argv, trusted in (
        (["--data", "data.yaml"], False),  # a data block given whole
        (["--data.source", names["empty.csv"], "--print_config"], False),  # prints the settings, reads no file
        (["--config", str(sent)], False),  # the confined run judges the file a sent config names
        (["--data.source", names["empty.csv"], "--data.subset", "x"], False),  # the data module says why first
        (["--data.source", names["empty.csv"], "--data.encoding_errors", "ignore"], False),  # the parse refuses it
        (["--data.source", names["good.csv"], "--data.text_column", "txt", "--data.validation_split", "dev"], False),
        (["--data.source", "'quoted.csv'"], False),  # YAML would read it otherwise
        (["--data.source", "imdb"], False),  # a hub dataset
    ):
        data_check.check("fit", argv, trusted)
    with pytest.raises(UserError, match="is empty"):
        data_check.check("fit", ["--config", str(sent)], trusted=True)  # --trust-recipe: read as the run reads it
    data_check.check("fit", ["--data.source", names["good.csv"], "--data.text_column", "text"], False)  # all is well
    data_check.check("predict", ["--data.source", names["latin1.csv"], "--data.predict_path", names["good.csv"]], False)


def test_later_sources_win_and_options_may_be_abbreviated(tmp_path, monkeypatch):
    names = files(tmp_path)
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine.yaml"
    mine.write_text("data:\n  source: good.csv\n  text_column: body\n")  # beside it, in the working folder
    with pytest.raises(UserError, match="column 'body' not found"):
        data_check.check("fit", ["--data.source", names["empty.csv"], "--config", str(mine)], False)
    data_check.check("fit", ["--config", str(mine), "--data.text_col=text"], False)


def test_the_check_runs_before_torch_is_imported(tmp_path):
    names = files(tmp_path)
    code = (
        "import json, sys\n"
        "from lit_memory.__main__ import main\n"
        f"try:\n    main(['fit', '--recipe', '4gb', '--data.source', {names['latin1.csv']!r}])\nexcept SystemExit "
        "as e:\n"
        "    print(json.dumps([e.code, [m for m in ('torch', 'lightning', 'transformers', 'datasets') if m in "
        "sys.modules]]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout) == [2, []]
    assert (
        done.stderr.startswith(f"error: {names['latin1.csv']} is not utf-8 text: line 2")
        and "--data.encoding cp1252" in done.stderr
    )
