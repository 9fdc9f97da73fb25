"""The parent's plan for a confined run (`lit_memory.confine.launch`): what it refuses before anything starts.
Unit-level: no child is started here (the child's side is tests/sandbox/test_child.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lit_memory.confine import launch
from lit_memory.errors import UserError
from lit_memory.sandbox import namespaces, roots


def test_no_recipe_value_asks_for_the_hosts_network():
    """Class A: ``trainer.num_nodes: 2`` in a recipe kept the host's network for the child (one warning line, and the
    run went on, its UDP and TCP reaching listeners outside). Now anything that needs the network off this machine is
    one error line before the run starts, whoever asked for it; a run on one machine goes on."""
    with pytest.raises(UserError, match=r"^refusing trainer.num_nodes=2: .*loopback only"):
        launch.check_one_machine({"trainer.num_nodes": 2, "trainer.strategy": "ddp"}, {}, distributed=True)
    with pytest.raises(UserError, match=r"^refusing MASTER_ADDR=10.0.0.7: .*own loopback"):
        launch.check_one_machine({"trainer.num_nodes": 1}, {"MASTER_ADDR": "10.0.0.7"}, distributed=True)
    for address in ("127.0.0.1", "localhost", "::1", ""):
        launch.check_one_machine({"trainer.num_nodes": 1}, {"MASTER_ADDR": address}, distributed=True)
    launch.check_one_machine({}, {"MASTER_ADDR": "10.0.0.7"}, distributed=False)  # one process: no rendezvous
    assert launch._many({"trainer.num_nodes": 2}) and launch._many({"trainer.strategy": "ddp"})
    assert not launch._many({"trainer.devices": 1})


def test_an_input_the_view_cannot_hold_is_refused_before_the_child_starts(tmp_path):
    """Class B: a path the child could not bind into its view (``<private>/view`` + the path past PATH_MAX) is one
    error line in the parent, and what was made for the run is removed."""
    private = tmp_path / "lit_memory-run-x"
    (private / "view").mkdir(parents=True)
    made = roots.Made([str(tmp_path / "logs")])
    Path(made.folders[0]).mkdir()
    long_path = "/" + "/".join(["d" * 200] * 20)  # 4,020 characters: the host's limit holds it, the view's does not
    fits = [str(tmp_path), os.getcwd()]
    launch._check_placeable(str(private / "view"), fits, private, made)  # nothing to refuse: nothing removed
    assert private.exists()
    with pytest.raises(UserError) as refused:
        launch._check_placeable(str(private / "view"), [*fits, long_path], private, made)
    line = str(refused.value)
    assert line.startswith("refusing to run confined with /dddd") and "too long" in line and "\n" not in line
    assert f"({len(long_path)} characters)" in line and len(line) < 600
    assert not private.exists() and not Path(made.folders[0]).exists()
    assert namespaces.unplaceable("/v", [long_path]) is None  # short view: it fits


class Nobody:
    """A decision where the user typed nothing."""

    def is_typed(self, key, value) -> bool:
        return False


def settings(**values):
    from jsonargparse import Namespace

    found = Namespace()
    for key, value in {"trainer.default_root_dir": None, "trainer.logger": None, **values}.items():
        found[key.replace("__", ".")] = value
    return found


def test_a_confined_run_writes_only_its_own_new_version_folder(tmp_path, monkeypatch):
    """Class C: with no run folder set, the whole ``lightning_logs`` was the write root, and a confined run rewrote
    the user's earlier ``version_0`` (its last.ckpt, its hf_model) and planted ``lightning_logs/predict -> ~/.config``.
    Now the parent makes the run's own ``version_N`` empty, numbered as Lightning would, and that alone is written;
    the child's logger takes that version (`confined_logs`)."""
    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    earlier.mkdir(parents=True)
    (earlier / "last.ckpt").write_bytes(b"the user's")
    (tmp_path / "lightning_logs" / "version_7x").mkdir()  # not a version Lightning counts
    made = roots.Made()
    judged = launch.run_folders(settings(), Nobody(), create=False)
    assert judged == [str(tmp_path / "lightning_logs")] and not (tmp_path / "lightning_logs" / "version_1").exists()
    written = launch.run_folders(settings(), Nobody(), create=True, made=made)
    assert written == [str(tmp_path / "lightning_logs" / "version_1")] and made.version == 1
    assert not os.listdir(written[0])  # made empty, for this run
    again = roots.Made()  # a second run meanwhile: a folder of its own, never the first one's
    assert launch.run_folders(settings(), Nobody(), create=True, made=again) == [
        str(tmp_path / "lightning_logs" / "version_2")]
    # A root the user typed elsewhere: its lightning_logs' new version, not the root.
    typed = tmp_path.parent / f"{tmp_path.name}-typed"
    (typed / "lightning_logs" / "version_4").mkdir(parents=True)

    class Typed(Nobody):
        def is_typed(self, key, value) -> bool:
            return key == "trainer.default_root_dir"

    assert launch.run_folders(settings(trainer__default_root_dir=str(typed)), Typed(), create=True,
                              made=roots.Made()) == [str(typed / "lightning_logs" / "version_5")]
    # The child's logger numbers itself with the folder made for it; predict and a configured logger are left alone.
    from lit_memory.run import confined_logs

    monkeypatch.setenv(roots.VERSION_VARIABLE, "1")
    logger = confined_logs.logger_kwargs({"logger": None, "default_root_dir": None}, "fit")["logger"]
    assert logger.log_dir == str(tmp_path / "lightning_logs" / "version_1")
    assert confined_logs.logger_kwargs({"logger": None}, "predict") == {}
    assert confined_logs.logger_kwargs({"logger": False}, "fit") == {}


def test_no_link_a_confined_run_made_out_of_its_folder_is_left(tmp_path):
    """Class C: a later trusted command never follows a link a confined run made. Its own folder is all it could
    write; what it linked out of it (to ``~/.config``) is removed when it ends, Lightning's ``last.ckpt`` link to a
    checkpoint beside it kept."""
    run = tmp_path / "version_1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step=2.ckpt").write_bytes(b"w")
    (run / "checkpoints" / "last.ckpt").symlink_to("step=2.ckpt")
    (run / "predict").symlink_to(Path.home() / ".config")
    (run / "checkpoints" / "up").symlink_to("../../elsewhere")
    removed = roots.links_out(str(run))
    assert sorted(removed) == sorted([str(run / "predict"), str(run / "checkpoints" / "up")])
    assert (run / "checkpoints" / "last.ckpt").is_symlink() and not os.path.lexists(run / "predict")


def test_without_a_logger_another_runs_checkpoints_are_not_shared(tmp_path, monkeypatch):
    """Class C without a version folder: ``trainer.logger: false`` puts checkpoints in the working folder's
    ``checkpoints``; holding another run's, it is one error line before anything is made."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert launch.run_folders(settings(trainer__logger=False), Nobody(), create=False)  # empty: fine
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"the user's")
    with pytest.raises(UserError, match=r"^refusing to run confined with trainer.logger=false .*another run's"):
        launch.run_folders(settings(trainer__logger=False), Nobody(), create=False)


def test_a_recipe_asking_for_several_nodes_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Class A end to end, as the hunt ran it: a recipe nobody trusted with ``num_nodes: 2`` and ``strategy: ddp``
    (the child kept the host's network) is one error line, and no child starts."""
    from lit_memory.__main__ import main
    from lit_memory.sandbox import rules, watchdog

    (tmp_path / "sent.yaml").write_text("trainer:\n  num_nodes: 2\n  strategy: ddp\n")
    started = []
    monkeypatch.setattr(watchdog, "watch", lambda *a, **k: started.append(a) or 0)
    monkeypatch.delenv(rules.ENV, raising=False)
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC", "LSB_", "JSM_"))]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        main(["fit", "--config", "sent.yaml", "--trainer.accelerator=cpu"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert ended.value.code == 2 and not started
    assert len(errors) == 1 and "spans 2 nodes" in errors[0] and "recipes trust" in errors[0], errors
