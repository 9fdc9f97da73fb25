"""`lit_memory.config.trusted`: which configs run unconfined, judged by content (shipped, trusted once, a trusted
run's own config.yaml), and the store that remembers them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFIGS, RECIPES, REPO

from lit_memory.config import trusted
from lit_memory.config.trust import Decision
from lit_memory.errors import UserError


@pytest.fixture(autouse=True)
def store(tmp_path, monkeypatch):
    """A store of this test's own."""
    monkeypatch.setenv(trusted.STORE_VARIABLE, str(tmp_path / "config"))
    return tmp_path / "config" / trusted.STORE_NAME


def copy(recipe: str, to: Path, extra: str = "") -> Path:
    to.parent.mkdir(parents=True, exist_ok=True)
    to.write_text((RECIPES / recipe).read_text() + extra)
    return to


def test_a_shipped_recipe_or_config_is_trusted_wherever_its_copy_lies(tmp_path):
    verdict = trusted.judge(["--config", str(RECIPES / "4gb.yaml"), "--config", str(CONFIGS / "fsdp.yaml")])
    assert verdict.trusted and verdict.configs == (str(RECIPES / "4gb.yaml"), str(CONFIGS / "fsdp.yaml"))
    same = tmp_path / "elsewhere" / "mine.yaml"
    same.parent.mkdir()
    shutil.copy(RECIPES / "4gb.yaml", same)
    assert trusted.judge(["--config", str(same), "--data.source", "x.csv"]).trusted


def test_a_changed_copy_is_not_trusted_and_its_line_names_it_and_how_to_trust_it(tmp_path):
    mine = copy("4gb.yaml", tmp_path / "mine.yaml", "# one more line\n")
    verdict = trusted.judge(["--config", str(RECIPES / "bf16.yaml"), f"--config={mine}"])
    assert not verdict.trusted
    assert verdict.untrusted == ((str(mine), "is not a shipped recipe and nobody trusted it"),)
    line = verdict.line()
    assert line.startswith(f"sandbox: running confined, because {mine} is not a shipped recipe")
    assert f"python -m lit_memory recipes trust {mine}" in line and "\n" not in line


def test_trusting_a_recipe_records_its_content_and_a_change_untrusts_it_naming_the_file(tmp_path, store):
    folder = tmp_path / "sent"
    mine = copy(
        "4gb.yaml", folder / "mine.yaml", "data:\n  source: data/train.csv\ntrainer:\n  default_root_dir: runs\n"
    )
    (folder / "data").mkdir()
    (folder / "data" / "train.csv").write_text("text,label\ngood,1\n")
    (folder / "runs").mkdir()
    (folder / "runs" / "old.txt").write_text("a run's own file: not the recipe's content")
    named = trusted.trust(mine)
    assert named == [str((folder / "data" / "train.csv").resolve())]
    assert trusted.judge(["--config", str(mine)]).trusted
    entry = json.loads(store.read_text())["configs"][str(mine.resolve())]
    assert entry["sha256"] == trusted.digest(mine) and list(entry["files"]) == named

    (folder / "data" / "train.csv").write_text("text,label\nbad,0\n")  # the data it names changed
    verdict = trusted.judge(["--config", str(mine)])
    assert not verdict.trusted and f"names {named[0]}, which changed" in verdict.line()

    trusted.trust(mine)
    mine.write_text(mine.read_text() + "# edited\n")  # the recipe itself changed
    assert "changed since it was trusted on" in trusted.judge(["--config", str(mine)]).line()
    assert "CHANGED" in trusted.listing()

    trusted.trust(mine)
    assert trusted.untrust(mine) and not trusted.untrust(mine)
    assert "nobody trusted it" in trusted.judge(["--config", str(mine)]).line()


def test_a_run_is_trusted_only_when_every_config_is(tmp_path):
    mine = copy("4gb.yaml", tmp_path / "mine.yaml", "# mine\n")
    theirs = copy("4gb.yaml", tmp_path / "theirs.yaml", "# theirs\n")
    trusted.trust(mine)
    assert trusted.judge(["--config", str(RECIPES / "4gb.yaml"), "--config", str(mine)]).trusted
    verdict = trusted.judge(["--config", str(mine), "--config", str(theirs)])
    assert [path for path, _ in verdict.untrusted] == [str(theirs)]


def test_the_files_a_command_line_reads_as_configs(tmp_path):
    """``--config FILE`` and a file given to any option that is not data, a model or a checkpoint (jsonargparse reads
    it as that option's config); a command line with none is the user's own."""
    data, group = tmp_path / "train.json", tmp_path / "trainer.yaml"
    data.write_text("[]")
    group.write_text("max_steps: 2\n")
    argv = ["--data.source", str(data), f"--trainer={group}", "--ckpt_path", str(data), "-c", "x.yaml", "--seed", "3"]
    assert trusted.config_files(argv) == [str(group), "x.yaml"]
    assert trusted.judge(["--data.source", str(data), "--trainer.max_steps", "2"]).trusted


def test_a_pipe_or_missing_config_is_never_trusted(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    assert "not a regular file" in trusted.judge(["--config", str(fifo)]).line()
    assert not trusted.judge(["--config", str(tmp_path / "gone.yaml")]).trusted


def test_a_store_others_may_write_is_refused(tmp_path, store):
    mine = copy("4gb.yaml", tmp_path / "mine.yaml", "# mine\n")
    trusted.trust(mine)
    assert store.stat().st_mode & 0o777 == 0o600
    store.chmod(0o666)
    with pytest.raises(UserError, match="others may write it"):
        trusted.judge(["--config", str(mine)])
    store.chmod(0o600)
    store.write_text("not json")
    with pytest.raises(UserError, match="is not valid JSON"):
        trusted.read_store()


def test_a_trusted_runs_config_yaml_is_recorded_as_trusted(tmp_path):
    config = tmp_path / "lightning_logs" / "version_0" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("data:\n  source: /elsewhere/train.csv\n")
    assert not trusted.judge(["--config", str(config)]).trusted
    trusted.record_run_config(config)
    assert trusted.judge(["--config", str(config)]).trusted


def test_the_decision_of_a_command_line(tmp_path):
    mine = copy("4gb.yaml", tmp_path / "mine.yaml", "# mine\n")
    assert Decision.of(["--config", str(mine), "--trust-recipe"]).trusted
    shipped = Decision.of(["--recipe", "4gb"])
    assert shipped.configs_trusted and not shipped.confined and str((RECIPES / "4gb.yaml").resolve()) in shipped.pinned
    untrusted = Decision.of(["--config", str(mine)])
    assert untrusted.confined and untrusted.why.startswith("sandbox: running confined")
    assert Decision.of(["--recipe", "4gb"], trust_configs=False).confined  # recipes check judges as a stranger's


def test_a_trusted_config_changed_while_the_run_starts_is_refused(tmp_path):
    """The parse reads the bytes the verdict approved, or refuses: nothing swapped in between runs."""
    from jsonargparse import ArgumentParser

    mine = copy("4gb.yaml", tmp_path / "mine.yaml", "# mine\n")
    trusted.trust(mine)
    decision = Decision.of(["--config", str(mine)])
    mine.write_text(mine.read_text() + "trainer:\n  max_steps: 99\n")
    parser = ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_argument("--trainer", type=dict)
    with decision.applied(), pytest.raises(BaseException, match="changed while the run was starting"):
        parser.parse_args(["--config", str(mine)])


def test_recipes_trust_untrust_and_trusted_answer_without_torch(tmp_path):
    mine = copy("4gb.yaml", tmp_path / "mine.yaml", "# mine\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = ("import sys; from lit_memory.__main__ import main\n"
            "try:\n    main(sys.argv[1:])\nfinally:\n    print('torch' in sys.modules)")

    def recipes(*args: str) -> str:
        done = subprocess.run([sys.executable, "-c", code, "recipes", *args], env=env, capture_output=True, text=True,
                              cwd=tmp_path, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.rstrip().endswith("False")  # torch was never imported
        return done.stdout

    assert recipes("trust", str(mine)).startswith(f"trusted: {mine.resolve()}")
    assert str(mine.resolve()) in recipes("trusted") and " ok" in recipes("trusted")
    assert recipes("untrust", str(mine)).startswith(f"untrusted: {mine}")
    assert "no recipes trusted yet" in recipes("trusted")
