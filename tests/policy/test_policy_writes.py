"""Where a sent recipe may write is one list (`lit_memory.policy.writes`): the confined launch's run folders,
``recipes check``, the launch's write-path rule and the trust of a recipe's files all follow it."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from jsonargparse import Namespace

from lit_memory.config import trusted
from lit_memory.confine import launch
from lit_memory.policy import phases, writes
from lit_memory.policy.refusal import Context
from lit_memory.tools import recipes


class Typed:
    """A decision in which the user typed everything (their folders, wherever they are)."""

    def is_typed(self, key, value):
        return True


def settings(tmp_path: Path) -> Namespace:
    return Namespace(trainer=Namespace(default_root_dir=str(tmp_path / "runs"), logger=None), predictions=None,
                     memory=Namespace(spool=str(tmp_path / "spool")))


def with_spool(monkeypatch):
    """A new kind of run folder, added where the policy says: one line of one file."""
    monkeypatch.setattr(writes, "ROOT_KEYS", (*writes.ROOT_KEYS, "spool"))


def test_the_launch_makes_a_run_folder_of_every_root_key_of_the_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = launch.run_folders(settings(tmp_path), Typed(), create=False)
    with_spool(monkeypatch)
    after = launch.run_folders(settings(tmp_path), Typed(), create=False)
    assert os.path.realpath(tmp_path / "spool") not in before
    assert os.path.realpath(tmp_path / "spool") in after


def test_recipes_check_judges_every_root_key_of_the_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    elsewhere = Namespace(memory=Namespace(spool="/var/spool/sent"), trainer=Namespace(default_root_dir="runs"))
    assert not any("memory.spool" in line for line in recipes.later_refusals(elsewhere))
    with_spool(monkeypatch)
    lines = recipes.later_refusals(elsewhere)
    assert any(line.startswith("memory.spool=") and "must be a new folder under the working folder" in line
               for line in lines), lines


def test_the_write_path_rule_leaves_a_root_to_the_root_rule(tmp_path, monkeypatch):
    """A write path outside the run's folders is refused; the same key made a root is judged as a run folder."""
    monkeypatch.chdir(tmp_path)
    sent = {"trainer": {"default_root_dir": "runs"}, "data": {"spool_path": "/var/spool/x"}}
    context = Context(sent, work=str(tmp_path), roots=[str(tmp_path / "runs")])
    assert [r.key for r in writes.write_paths(context)] == ["data.spool_path"]
    monkeypatch.setattr(writes, "ROOT_KEYS", (*writes.ROOT_KEYS, "spool_path"))
    assert writes.write_paths(context) == []
    assert [r.key for r in phases.refusals("launch", context) if r.key == "data.spool_path"] == ["data.spool_path"]


def test_a_trusted_recipes_named_files_leave_out_every_place_the_policy_says_a_run_writes(tmp_path, monkeypatch):
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / "old.log").write_text("written by an earlier run\n")
    (tmp_path / "train.csv").write_text("text,label\na,0\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"source": "train.csv"}, "memory": {"spool": "spool"}}))
    named = trusted.named_files(recipe)
    assert str((tmp_path / "spool" / "old.log").resolve()) in named  # not a place to write: content, hashed
    with_spool(monkeypatch)
    named = trusted.named_files(recipe)
    assert str((tmp_path / "train.csv").resolve()) in named
    assert str((tmp_path / "spool" / "old.log").resolve()) not in named
