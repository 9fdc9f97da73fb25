"""The guard at the sinks (`lit_memory.sandbox.guard`): each loader that could run code from a file, under the
untrusted rules and without them, with a payload that leaves a marker file when unpickled.

The decision is process-wide; here each test sets it (and torch's switch) for itself and puts it back.
End-to-end runs of hostile files through the CLI are in tests/config/test_trust.py.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import CONFIGS, FAST, RECIPES, REPO
from lightning.fabric.plugins import TorchCheckpointIO
from torch.distributed.checkpoint.api import CheckpointException

from lit_memory.errors import UserError
from lit_memory.run import environment
from lit_memory.sandbox import checkpoint_reading, guard


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(params=[False, True], ids=["untrusted", "trusted"])
def decision(request, monkeypatch):
    """Each sink under both decisions: (trusted, marker that appears only if code ran)."""
    guard.harden()
    monkeypatch.setattr(guard, "_trusted", request.param)
    if request.param:
        monkeypatch.delenv(guard.FORCE_WEIGHTS_ONLY, raising=False)
    else:
        monkeypatch.setenv(guard.FORCE_WEIGHTS_ONLY, "1")
    return request.param


def test_the_sinks_it_replaces_still_exist_in_the_installed_versions():
    from lightning.fabric.utilities import load
    from torch.distributed.checkpoint import filesystem

    assert callable(filesystem.FileSystemReader._get_metadata_path)
    assert issubclass(load._LazyLoadingUnpickler, pickle.Unpickler)
    guard.harden()
    assert filesystem.FileSystemReader.read_metadata.__name__ == "guarded_read_metadata"
    assert load._LazyLoadingUnpickler.find_class.__name__ == "guarded_find_class"


def test_every_torch_load_is_weights_only(decision, tmp_path):
    marker = tmp_path / "RAN"
    torch.save({"w": torch.ones(1), "payload": Payload(marker)}, tmp_path / "x.pt")
    if decision:
        torch.load(tmp_path / "x.pt", weights_only=False)
    else:
        with pytest.raises(pickle.UnpicklingError, match="io.open"):
            torch.load(tmp_path / "x.pt", weights_only=False)  # the call site asks for unpickling: overridden
    assert marker.exists() == decision


def test_a_distributed_checkpoints_non_tensor_items_load_weights_only(decision, tmp_path):
    marker = tmp_path / "RAN"
    dcp.save({"w": torch.ones(2), "extra": Payload(marker)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    state = {"w": torch.zeros(2), "extra": None}
    if decision:
        dcp.load(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    else:
        with pytest.raises(CheckpointException, match="GLOBAL io.open was not an allowed global"):
            dcp.load(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert marker.exists() == decision
    assert checkpoint_reading.checkpoint_problem(tmp_path / "c").startswith("its item 'extra'")


@pytest.mark.parametrize("name", [".metadata", "__0.metadata"])
def test_a_distributed_checkpoints_metadata_files_are_read_with_the_restricted_unpickler(name, decision, tmp_path):
    """The global metadata, and the rank-local one torch falls back to when there is none."""
    marker = tmp_path / "RAN"
    folder = tmp_path / "c"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    (folder / ".metadata").unlink()
    (folder / name).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointException):  # torch's loader fails either way: the payload is no metadata
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=str(folder), no_dist=True)
    assert marker.exists() == decision
    assert (
        checkpoint_reading.checkpoint_problem(folder)
        == f"its {name} names code to run when unpickled (io.open is not checkpoint metadata)"
    )


def test_metadata_naming_files_outside_its_folder_is_refused(tmp_path):
    folder = tmp_path / "c"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    metadata = checkpoint_reading.load_metadata(io.BytesIO((folder / ".metadata").read_bytes()))
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    assert "outside the checkpoint folder" in checkpoint_reading.checkpoint_problem(folder)


def test_lightnings_own_unpickler_for_fsdp_checkpoints_is_restricted(decision, tmp_path):
    """`FSDPStrategy` reads a single-file checkpoint with `_lazy_load`, a pickle.Unpickler of Lightning's
    that ignores weights_only (the strategy needs CUDA: the sink is exercised directly)."""
    from lightning.fabric.utilities.load import _lazy_load, _materialize_tensors

    marker = tmp_path / "RAN"
    torch.save({"state_dict": {"w": torch.ones(3)}, "payload": Payload(marker)}, tmp_path / "x.ckpt")
    if decision:
        _lazy_load(tmp_path / "x.ckpt")
    else:
        with pytest.raises(pickle.UnpicklingError, match="io.open is not allowed"):
            _lazy_load(tmp_path / "x.ckpt")
    assert marker.exists() == decision
    torch.save({"state_dict": {"w": torch.ones(3)}}, tmp_path / "plain.ckpt")  # tensors still load lazily
    assert torch.equal(_materialize_tensors(_lazy_load(tmp_path / "plain.ckpt"))["state_dict"]["w"], torch.ones(3))


def test_the_checkpoint_io_of_any_strategy(decision, tmp_path):
    io_ = guard.GuardedCheckpointIO(TorchCheckpointIO())
    marker = tmp_path / "RAN"
    torch.save({"payload": Payload(marker)}, tmp_path / "x.ckpt")
    if decision:
        io_.load_checkpoint(tmp_path / "x.ckpt", weights_only=False)
    else:
        with pytest.raises(pickle.UnpicklingError):
            io_.load_checkpoint(tmp_path / "x.ckpt", weights_only=False)
        with pytest.raises(UserError, match="not a local file"):
            io_.load_checkpoint("https://example.com/x.ckpt")
    assert marker.exists() == decision

    victim = tmp_path / "victim"
    victim.write_text("mine")
    (tmp_path / "link.ckpt").symlink_to(victim)
    with pytest.raises(UserError, match="it is a symbolic link"):  # whatever the decision
        io_.save_checkpoint({"w": torch.ones(1)}, tmp_path / "link.ckpt")
    assert victim.read_text() == "mine"
    io_.save_checkpoint({"w": torch.ones(1)}, tmp_path / "sub" / "ok.ckpt")
    assert torch.equal(torch.load(tmp_path / "sub" / "ok.ckpt")["w"], torch.ones(1))


def test_a_checkpoint_lightning_picks_by_itself_is_the_users_only_in_a_folder_they_typed(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(guard, "_trusted", False)
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}}, hpc)
    connector = SimpleNamespace(_hpc_resume_path=str(hpc))
    monkeypatch.setattr(guard, "_own_folders", [])
    with pytest.raises(UserError, match=f"Lightning picked it by itself .*--ckpt_path {hpc}, or pass --trust-recipe"):
        guard.check_selected(connector, None, str(hpc))
    monkeypatch.setattr(guard, "_own_folders", [Path(os.path.realpath(tmp_path))])
    guard.check_selected(connector, None, str(hpc))  # a requeued SLURM job resuming in the user's own folder
    torch.save({"payload": Payload(tmp_path / "RAN")}, hpc)
    with pytest.raises(UserError, match="weights_only=True"):  # and still read with the restricted readers
        guard.check_selected(connector, None, str(hpc))
    assert not (tmp_path / "RAN").exists()


def test_hugging_face_loaders_never_ask_to_run_shipped_code_untrusted(monkeypatch):
    monkeypatch.setattr(guard, "_trusted", False)
    assert guard.pretrained_kwargs(num_labels=2) == {"num_labels": 2, "trust_remote_code": False}
    assert guard.pretrained_kwargs(trust_remote_code=True) == {"trust_remote_code": True}  # typed: the user's
    monkeypatch.setattr(guard, "_trusted", True)
    assert guard.pretrained_kwargs(num_labels=2) == {"num_labels": 2}


def test_a_model_folder_is_inspected_without_loading_it(tmp_path):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(REPO / "lit_memory" / "assets" / "bert-large-uncased", folder)
    assert guard.model_folder_problems(folder) == []
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "x.Y"}}))
    assert guard.model_folder_problems(folder) == []  # a type transformers knows: auto_map is ignored untrusted
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mine", "auto_map": {"AutoConfig": "x.Y"}}))
    torch.save({"w": Payload(tmp_path / "RAN")}, folder / "pytorch_model.bin")
    problems = guard.model_folder_problems(folder)
    assert len(problems) == 2 and "auto_map" in problems[0] and "io.open" in problems[1]
    assert not (tmp_path / "RAN").exists()


def test_a_model_folder_whose_index_names_a_fifo_or_a_file_outside_is_refused(tmp_path):
    """A sharded model's index naming a FIFO one folder down (safetensors' reader would block on it forever), or a
    shard outside the folder: refused before transformers reads it, in a trusted command's process too (a folder the
    user typed). A shard reached through a link to a regular file (the Hugging Face cache's layout) is fine."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(REPO / "lit_memory" / "assets" / "bert-large-uncased", folder)
    (folder / "shards").mkdir()
    (tmp_path / "blob").write_bytes(b"x")
    (folder / "shards" / "b.safetensors").symlink_to(tmp_path / "blob")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "shards/b.safetensors"}}))
    assert guard.model_folder_problems(folder) == []
    os.mkfifo(folder / "shards" / "a.safetensors")
    index.write_text(json.dumps({"weight_map": {"w": "shards/a.safetensors", "v": "shards/b.safetensors"}}))
    [problem] = guard.model_folder_problems(folder)
    assert problem.endswith("shards/a.safetensors: it is a FIFO, not a regular file")
    index.write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    assert guard.model_folder_problems(folder) == [f"{index} names ../../etc/passwd, outside the folder"]


# -- lit_memory's own checkpoints resume under the untrusted rules -------------------------------------


def fit(root: Path, *more: str) -> subprocess.CompletedProcess:
    """An untrusted `python -m lit_memory fit` (no --trust-recipe) of a tiny random BERT."""
    args = [
        "--config",
        str(RECIPES / "fused.yaml"),
        "--model.model_name_or_path=bundled:bert-large",
        "--model.pretrained=false",
        '--model.config_overrides={"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, '
        '"intermediate_size": 64}',
        *FAST,
        "--trainer.enable_checkpointing=true",
        "--model.save_pretrained=false",
        "--data.batch_size=4",
        "--data.max_length=16",
        "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={root}",
        *more,
    ]
    env = {
        **{k: v for k, v in environment.for_new_job().items() if k != guard.FORCE_WEIGHTS_ONLY},
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    return subprocess.run([sys.executable, "-m", "lit_memory", "fit", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_resuming_ones_own_sharded_run_needs_no_trust(tmp_path):
    """FSDP2's sharded folder (2 CPU processes; every rank's RNG state and the data position in meta.pt):
    every item loads with the restricted readers, so `--ckpt_path last` resumes untrusted. (A single-file
    checkpoint resumes untrusted in tests/test_cli.py's resume test, in-process.)"""
    more = ["--config", str(CONFIGS / "fsdp.yaml"), "--trainer.accelerator=cpu", "--trainer.devices=2"]
    first = fit(tmp_path, *more)
    assert first.returncode == 0, first.stderr[-3000:]
    [last] = tmp_path.glob("lightning_logs/version_0/checkpoints/last.ckpt")
    assert (last.resolve() / "meta.pt").is_file()
    assert checkpoint_reading.checkpoint_problem(last.resolve()) is None
    meta = torch.load(last.resolve() / "meta.pt", weights_only=True)
    assert len(meta["callbacks"]["ExactResume"]["rng"]) == 2  # each rank's random state
    resumed = fit(tmp_path, *more, "--ckpt_path=last", "--trainer.max_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restored all states from the checkpoint at {last}" in resumed.stdout + resumed.stderr


def test_checkpoints_over_all_callbacks_are_bounded_for_the_whole_run(monkeypatch):
    """The round-2 rule, for N callbacks and every_n_epochs: callbacks each within their own bounds that together
    save every step (five saving every 1..5 epochs of one batch: 45 saves in 20 steps) or keep more than 10 are one
    line once the epoch's length is known; and whatever the settings said, the saves the strategy makes are counted:
    more than two per callback, two more, and two per 50 steps is one line at the save that passes it. Callbacks the
    user typed and lit_memory's own are not counted."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    monkeypatch.setattr(guard, "_trusted", False)
    every = [ModelCheckpoint(every_n_epochs=i + 1, filename=f"c{i}-{{step}}") for i in range(5)]
    trainer = SimpleNamespace(
        checkpoint_callbacks=every,
        num_training_batches=1,
        accumulate_grad_batches=1,
        max_steps=20,
        max_epochs=None,
        global_step=0,
    )
    problem = guard.checkpoint_load(trainer)
    assert "every 0.4 optimizer steps (45 times in 20 steps), more often than every 50" in problem
    with pytest.raises(UserError, match="every 0.4 optimizer steps"):
        guard.RunBounds().on_train_start(trainer, None)
    assert guard.checkpoint_load(trainer, exempt=lambda c: True) is None  # the user's own: theirs
    kept = [ModelCheckpoint(monitor="train_loss", save_top_k=10, every_n_train_steps=100 + i) for i in range(5)]
    assert "keep 50 checkpoints, more than 10" in guard.checkpoint_load(
        SimpleNamespace(**{**vars(trainer), "checkpoint_callbacks": kept})
    )
    assert (
        guard.checkpoint_load(SimpleNamespace(**{**vars(trainer), "num_training_batches": 500, "max_steps": 1000}))
        is None
    )

    saved = []
    trainer.strategy = SimpleNamespace(save_checkpoint=lambda checkpoint, path, *a, **k: saved.append(path))
    ours = ModelCheckpoint(every_n_epochs=1)
    trainer.checkpoint_callbacks = [*every, ours]
    ours._save_checkpoint = lambda _trainer, path: trainer.strategy.save_checkpoint({}, path)
    guard.RunBounds(exempt=lambda c: c is ours)._count_saves(trainer)
    for step in range(12):  # lit_memory's own saves, at any cadence: not counted
        trainer.global_step = step
        ours._save_checkpoint(trainer, f"ours-{step}")
    with pytest.raises(UserError, match=r"refusing to save c-12: checkpoint 13 by step 12, more than one per 50"):
        for step in range(40):
            trainer.global_step = step
            trainer.strategy.save_checkpoint({}, f"c-{step}")
    assert len(saved) == 12 + 12  # the refused save wrote nothing
