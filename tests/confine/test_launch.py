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
