"""What the user typed (`lit_memory.policy.typed`): the command line without what reads files, the value typed for
a key, and the folders a recipe's own files may lie in."""

from __future__ import annotations

import os

from lit_memory.policy import typed


def test_the_command_line_alone_leaves_out_what_reads_files(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("trainer: {}\n")
    argv = ["fit", "--config", str(config), "--data.source", str(config), "--trainer.max_steps", "3", "--trust-recipe"]
    assert typed.command_line_only(argv) == ["fit", "--trainer.max_steps", "3"]


def test_the_value_typed_for_a_key_is_the_last_one():
    argv = ["fit", "--ckpt_path", "a.ckpt", "--ckpt_path=b.ckpt"]
    assert typed.typed_option(argv, "ckpt_path") == "b.ckpt"
    assert typed.typed_option(argv, "data.source") is None


def test_a_recipes_files_lie_in_its_folder_or_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sent").mkdir()
    config = tmp_path / "sent" / "recipe.yaml"
    config.write_text("trainer: {}\n")
    folders = typed.recipe_folders(["fit", f"--config={config}", "--config", str(tmp_path / "missing.yaml")])
    assert folders == [os.path.realpath(tmp_path), os.path.realpath(tmp_path / "sent")]
