"""`python -m lit_memory`: one help that lists every command, Lightning's and the project's tools."""

from __future__ import annotations

import pytest

from lit_memory.__main__ import LIGHTNING_COMMANDS, TOOL_COMMANDS, TOOLS, main

COMMANDS = ["fit", "validate", "test", "predict", "estimate", "plan", "cards", "bench", "recipes"]


def test_help_lists_every_command_on_one_line_each(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "usage: python -m lit_memory COMMAND [options]"
    listed = [line.split()[0] for line in out if line.startswith("  ") and not line.startswith("   ")]
    assert listed == COMMANDS
    assert set(TOOLS) == set(TOOL_COMMANDS) and set(LIGHTNING_COMMANDS) == {"fit", "validate", "test", "predict"}
    with pytest.raises(SystemExit) as exit_:
        main([])  # no command: the same help, and a failing status
    assert exit_.value.code == 2 and capsys.readouterr().err.splitlines()[0] == out[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_its_own_help(command, capsys):
    code = 0
    try:
        main([command, "--help"])  # a training command's short help returns; a tool's parser exits
    except SystemExit as exit_:
        code = exit_.code
    assert code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m lit_memory {command} ")
