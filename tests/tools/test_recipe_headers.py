"""`python -m lit_memory recipes headers`: every shipped recipe states its predicted memory in its header, as the
command generates it (numbers in headers are generated, not typed); the memory tiers keep their promise."""

from __future__ import annotations

import pytest

from conftest import RECIPES
from lit_memory.errors import UserError
from lit_memory.memory.footprint import parse_bytes
from lit_memory.recipes import header
from lit_memory.tools import recipes as commands


def predicted(text: str) -> dict[str, int]:
    """tensors / reserved / device from a predicted line."""
    levels = text.split(": ", 2)[-1].split(" (python")[0]
    return {name: parse_bytes(value.replace(" ", "")) for name, value in (part.split(" ", 1) for part in levels.split(", "))}


def test_every_header_states_the_prediction_the_command_makes(capsys):
    commands.headers(check=True)  # raises if any header differs from what the command writes now
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(list(RECIPES.glob("*.yaml")))
    for path in RECIPES.glob("*.yaml"):
        line = header(path)["predicted"]
        assert line.startswith("BERT-large ") and "on A100 80GB" in line
        levels = predicted(line)
        assert levels["tensors"] <= levels["reserved"] < levels["device"]


def test_the_memory_tiers_fit_their_names_in_device_memory():
    assert predicted(header(RECIPES / "4gb.yaml")["predicted"])["device"] <= parse_bytes("4GiB")
    assert predicted(header(RECIPES / "2gb.yaml")["predicted"])["device"] <= parse_bytes("2GiB")
    assert "32 x 128" in header(RECIPES / "2gb.yaml")["predicted"]


def test_a_stale_header_is_found_and_rewritten_in_place():
    text = (RECIPES / "fused.yaml").read_text()
    line = header(RECIPES / "fused.yaml")["predicted"]
    stale = text.replace(line, "BERT-large 32 x 128: tensors 1 B, reserved 1 B, device 1 B")
    assert stale != text
    assert commands.with_predicted_line(stale, commands.PREDICTED + line) == text
    without = "\n".join(l for l in text.splitlines() if not l.startswith(commands.PREDICTED)) + "\n"
    assert commands.with_predicted_line(without, commands.PREDICTED + line) == text  # added after `# shrinks:`
    with pytest.raises(UserError, match="recipe headers out of date"):
        raise UserError("recipe headers out of date: fused (run: python -m lit_memory recipes headers)")
