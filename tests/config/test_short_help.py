"""`lit_memory.config.short_help`: ``COMMAND --help`` lists the options a user sets first with the help the full parser
gives them (read from the same docstrings without importing torch), and says where every option is."""

from __future__ import annotations

import pytest

from lit_memory.config import short_help

COMMANDS = ("fit", "validate", "test", "predict")


@pytest.fixture(scope="module")
def parsers():
    from lit_memory.cli import resolve

    return resolve(["fit"]).parser._subcommands_action._name_parser_map


@pytest.mark.parametrize("command", COMMANDS)
def test_the_short_help_is_the_full_parsers_for_the_options_set_first(parsers, command):
    parser = parsers[command]
    real = {option: action.help for action in parser._actions for option in action.option_strings}
    read = short_help.read_helps(command)
    assert read == {option: real[option] for option in short_help.wanted(command)}  # every one found, word for word
    full = parser.format_help()  # `COMMAND --help all`: the same rows open it
    rows = short_help.short_help(command).split("\n\n")[1].splitlines()[1:]
    assert full.split("\n\n")[1].splitlines()[1:] == rows


@pytest.mark.parametrize("command", COMMANDS)
def test_the_short_help_lists_the_recipe_data_model_and_trust_and_points_at_every_option(command):
    text = short_help.short_help(command)
    listed = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert listed[:4] == ["--recipe", "--config", "--data.source", "--data.text_column"]
    assert {"--model.model_name_or_path", "--memory.budget", "--trainer.max_epochs", "--trust-recipe"} <= set(listed)
    assert f"python -m lit_memory {command} --help all" in text
    assert "--trust-recipe lifts that" in text  # what --recipe and --trust-recipe do
    assert len(text.splitlines()) < 30
