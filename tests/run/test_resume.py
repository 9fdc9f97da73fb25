"""Exact resume (`lit_memory.run.resume`): a fit SIGKILLed mid-epoch and resumed with ``--ckpt_path last``
ends with the weights of the run that was never interrupted, and its log goes on with the same
steps, losses and learning rates.

Each run is a ``python -m lit_memory fit`` subprocess on a tiny random BERT with dropout, shuffled
data, fp32 on CPU: 2 epochs of 8 steps, a checkpoint every 5 steps, killed after step 11 (in the
second epoch), resumed from the step-10 checkpoint.
"""

from __future__ import annotations

import csv
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pytest
import torch
from conftest import CONFIGS, RECIPES, REPO, rows, write_csv
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.states import TrainerFn
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from lit_memory.cli import LitMemoryCLI
from lit_memory.run import environment
from lit_memory.run.best import BestCheckpoint, best_of
from lit_memory.run.resume import (
    EVERY_N_TRAIN_STEPS,
    ExactResume,
    ResumableDataLoader,
    ResumableSampler,
    ResumeCheckpoint,
    fit_callbacks,
    validates_next,
)

EVERY, KILL_AFTER, EPOCHS, STEPS_PER_EPOCH = 5, 11, 2, 8
TINY = '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}'

pytestmark = pytest.mark.fit  # end-to-end fits, most in a fresh process (a real restart)


@pytest.fixture(scope="module")
def reviews(tmp_path_factory) -> Path:
    # 40 rows: 32 train (8 batches of 4), 4 validation, 4 test
    return write_csv(tmp_path_factory.mktemp("data") / "reviews.csv", rows(40))


def fit(
    root: Path,
    recipe: str,
    data: Path,
    *more: str,
    launcher: Sequence[str] = (sys.executable,),
    log: Optional[Path] = None,
) -> Any:
    """``python -m lit_memory fit`` run to its end; with ``launcher`` (e.g. torchrun) and ``log``, started with its
    output going to ``log``."""
    args = [
        "--config",
        str(RECIPES / f"{recipe}.yaml"),
        "--model.model_name_or_path=bundled:bert-large",
        "--model.pretrained=false",
        f"--model.config_overrides={TINY}",
        "--model.lr_scheduler_type=linear",
        "--model.warmup_ratio=0.25",
        "--model.optimizer.init_args.lr=1e-3",
        f"--data.source={data}",
        "--data.batch_size=4",
        "--data.max_length=16",
        f"--trainer.max_epochs={EPOCHS}",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        # a validation after every checkpoint's step (steps 5, 10, 15): the best-model record must hold it on resume
        "--trainer.check_val_every_n_epoch=null",
        f"--trainer.val_check_interval={EVERY}",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.callbacks+=lit_memory.run.resume.ResumeCheckpoint",
        f"--trainer.callbacks.every_n_train_steps={EVERY}",
        "--trainer.callbacks+=LearningRateMonitor",
        "--trainer.callbacks.logging_interval=step",
        f"--trainer.default_root_dir={root}",
    ]
    command = [*launcher, "-m", "lit_memory", "fit", "--trust-recipe", *args, *more]  # trust: the test's killer
    env = {
        **environment.for_new_job(),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
    }
    if log is not None:
        with open(log, "w") as out:
            return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def kill_and_resume(full: Path, interrupted: Path, recipe: str, data: Path, *more: str) -> None:
    """The uninterrupted run in ``full``; in ``interrupted``, the run killed after step 11 and its resume, which
    exports the uninterrupted run's best step (its record holds the validation that ran after the step-10 checkpoint's
    step) and closes with its val: line."""
    done = fit(full, recipe, data, *more)
    assert done.returncode == 0, done.stderr[-4000:]
    killed = fit(interrupted, recipe, data, *more, "--trainer.callbacks+=interrupt.KillAfterStep",
                 f"--trainer.callbacks.step={KILL_AFTER}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    last = interrupted / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.resolve().name == "epoch=1-step=10.ckpt"  # mid-epoch: step 2 of the second epoch
    resumed = fit(interrupted, recipe, data, *more, "--ckpt_path=last")  # a new run folder, version_1
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"Restoring states from the checkpoint path at {last}" in resumed.stdout + resumed.stderr
    saved = torch.load(last, weights_only=True, map_location="cpu")["callbacks"]["BestCheckpoint"]
    assert saved["validated_step"] == 10  # written after the step's validation (it was 5: the one before)
    assert exported(resumed.stderr) == exported(done.stderr) and val_lines(resumed.stdout) == val_lines(done.stdout)


def exported(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("hf_model: ")).split(", saved ")[0]


def val_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("val")]


def run(root: Path, version: int = 0) -> Path:
    return root / "lightning_logs" / f"version_{version}"


def max_weight_difference(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "hf_model" / "model.safetensors"), load_file(b / "hf_model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def train_log(run_dir: Path) -> dict[int, dict[str, float]]:
    """Per logged training step: the loss and the learning rate of each parameter group."""
    log = {}
    for row in csv.DictReader(open(run_dir / "metrics.csv")):
        values = {k: float(v) for k, v in row.items() if v and (k == "train_loss" or k.startswith("lr-"))}
        if values:
            log.setdefault(int(row["step"]), {}).update(values)
    return log


def assert_log_goes_on(full: Path, resumed: Path) -> None:
    whole, rest = train_log(full), train_log(resumed)
    assert sorted(whole) == list(range(EPOCHS * STEPS_PER_EPOCH))
    assert sorted(rest) == list(range(10, EPOCHS * STEPS_PER_EPOCH))  # the step count goes on from 10
    lrs = sorted({k for step in whole.values() for k in step if k.startswith("lr-")})
    assert lrs and len({whole[s][lrs[0]] for s in whole}) > 10  # the linear schedule moves the lr every step
    for step, values in rest.items():
        assert values.keys() == whole[step].keys()
        for key, value in values.items():
            assert value == pytest.approx(whole[step][key], rel=1e-6, abs=1e-9), (step, key)


@pytest.mark.parametrize("recipe", ["baseline", "fused", "8bit"])
def test_a_run_killed_mid_epoch_resumes_exactly(recipe, reviews, tmp_path):
    kill_and_resume(tmp_path / "full", tmp_path / "interrupted", recipe, reviews)
    assert max_weight_difference(run(tmp_path / "full"), run(tmp_path / "interrupted", 1)) <= 1e-6
    assert_log_goes_on(run(tmp_path / "full"), run(tmp_path / "interrupted", 1))


def val_scores(run_dir: Path, metric: str) -> dict[int, float]:
    return {int(r["step"]): float(r[metric]) for r in csv.DictReader(open(run_dir / "metrics.csv")) if r.get(metric)}


@pytest.mark.parametrize("strategy", ["fused", "4gb-fsdp"])
def test_a_tie_at_an_epoch_end_validation_exports_the_uninterrupted_runs_step_after_a_resume(
    strategy, reviews, tmp_path
):
    """Validations at the ends of 5-step epochs (Lightning's default schedule) that tie (the recipes' learning rate
    moves no prediction of the tiny model), a checkpoint at each: the uninterrupted run exports the first of the tied
    steps, 5. Killed after step 6 and resumed from step 5's checkpoint, the run must hold step 5's validation in its
    best-model record, or it exports step 10 (the issue's 4gb + FSDP run: steps 4 and 8 tied, weights 1.3e-4 apart).
    ``fused`` on one device; ``4gb-fsdp``: 4gb (8-bit AdamW) + configs/fsdp.yaml on 2 CPU processes."""
    recipe, more = ("fused", ()) if strategy == "fused" else (
        "4gb", ("--config", str(CONFIGS / "fsdp.yaml"), "--trainer.accelerator=cpu", "--trainer.devices=2",
                "--data.batch_size=2"))
    schedule = [
        "--trainer.limit_train_batches=5",
        "--trainer.check_val_every_n_epoch=1",
        "--trainer.val_check_interval=1.0",
        "--model.optimizer.init_args.lr=2e-5",
        "--model.lr_scheduler_type=constant",
        *more,
    ]
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    done = fit(full, recipe, reviews, *schedule)
    assert done.returncode == 0, done.stderr[-4000:]
    scores = val_scores(run(full), "val_f1_macro")
    assert sorted(scores) == [5, 10] and scores[5] == scores[10]  # the tie
    assert exported(done.stderr).startswith(
        f"hf_model: the best validated weights: step 5, val_f1_macro={scores[5]:.4f}"
    )
    killed = fit(interrupted, recipe, reviews, *schedule, "--trainer.callbacks+=interrupt.KillAfterStep",
                 "--trainer.callbacks.step=6")
    assert killed.returncode != 0, killed.stderr[-4000:]
    assert (run(interrupted) / "checkpoints" / "last.ckpt").resolve().name == "epoch=0-step=5.ckpt"  # the epoch's end
    resumed = fit(interrupted, recipe, reviews, *schedule, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert exported(resumed.stderr) == exported(done.stderr) and val_lines(resumed.stdout) == val_lines(done.stdout)
    assert max_weight_difference(run(full), run(interrupted, 1)) <= 1e-6


def two_nodes(root: Path, recipe: str, data: Path, *more: str) -> list[subprocess.CompletedProcess]:
    """README's multi-node command, ``torchrun --nnodes 2 ... --rdzv-backend c10d --rdzv-endpoint HEAD:PORT -m
    lit_memory fit ... --trainer.num_nodes 2``, as two "nodes" of one process each on this machine: two torchrun
    agents meeting at a c10d rendezvous on 127.0.0.1, their output folders shared (as a cluster's file system)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", root.name,
    ]
    logs = [root.parent / f"{root.name}-node{i}-{port}.log" for i in range(2)]  # files: neither node blocks on a pipe
    nodes = [
        fit(root, recipe, data, *more, "--trainer.devices=1", "--trainer.num_nodes=2", launcher=torchrun, log=log)
        for log in logs
    ]
    return [
        subprocess.CompletedProcess(node.args, node.wait(600), "", log.read_text()) for node, log in zip(nodes, logs)
    ]


def test_4gb_on_fsdp_killed_mid_epoch_on_two_torchrun_nodes_resumes_exactly(reviews, tmp_path):
    """The 4gb recipe (bitsandbytes' 8-bit AdamW, its state saved sharded) under FSDP2 over 2 CPU processes: the run
    never interrupted launched by Lightning on one machine; the killed run and its resume launched by torchrun as two
    nodes (README's multi-node command, rehearsed on 127.0.0.1). The same 2 global ranks train the same shards, so
    the resumed run ends with the uninterrupted run's weights: each rank restores its shards of the weights and of
    the 8-bit state, and its own random state, from the sharded checkpoint."""
    fsdp = ["--config", str(CONFIGS / "fsdp.yaml"), "--trainer.accelerator=cpu", "--data.batch_size=2"]  # 8 steps/epoch
    done = fit(tmp_path / "full", "4gb", reviews, *fsdp, "--trainer.devices=2")
    assert done.returncode == 0, done.stderr[-4000:]
    interrupted = tmp_path / "interrupted"
    killed = two_nodes(interrupted, "4gb", reviews, *fsdp, "--trainer.callbacks+=interrupt.KillAfterStep",
                       f"--trainer.callbacks.step={KILL_AFTER}")
    for node in killed:  # each agent reports its process killed
        assert node.returncode != 0 and "Signal 9 (SIGKILL)" in node.stderr, node.stderr[-4000:]
    checkpoint = run(interrupted) / "checkpoints" / "epoch=1-step=10.ckpt"
    assert (run(interrupted) / "checkpoints" / "last.ckpt").resolve() == checkpoint
    saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata  # sharded: meta.pt + each rank's file
    codes = [k for k, v in saved.items() if k.startswith("optimizer_0.state.") and getattr(v, "properties", None)
             and v.properties.dtype == torch.uint8]
    assert (checkpoint / "meta.pt").is_file() and len(codes) > 10  # the 8-bit state, in the checkpoint
    resumed = two_nodes(interrupted, "4gb", reviews, *fsdp, "--ckpt_path=last")  # a new run folder, version_1
    for node in resumed:
        assert node.returncode == 0, node.stderr[-4000:]
    assert f"Restoring states from the checkpoint path at {run(interrupted) / 'checkpoints' / 'last.ckpt'}" in (
        resumed[0].stdout + resumed[0].stderr + resumed[1].stdout + resumed[1].stderr
    )
    assert max_weight_difference(run(tmp_path / "full"), run(interrupted, 1)) <= 1e-6
    assert_log_goes_on(run(tmp_path / "full"), run(interrupted, 1))


def test_8bit_state_on_three_fsdp_ranks_saves_with_an_empty_shard_and_resumes_exactly(reviews, tmp_path):
    """Every parameter on 8-bit state (``min_8bit_size 0``) over 3 FSDP2 ranks: the 2-label head's 2 rows leave the
    third rank an empty shard, which never steps and so holds no state for it. Its checkpoint still describes the
    whole state (an empty shard's rows: none, its absmax row: zeros), so torch's distributed checkpoint plans the
    save (it refused it: "Failed to validate global plan"), and the run resumes to the uninterrupted weights."""
    three = ["--config", str(CONFIGS / "fsdp.yaml"), "--trainer.accelerator=cpu", "--trainer.devices=3",
             "--data.batch_size=2", "--model.optimizer.init_args.min_8bit_size=0"]
    done = fit(tmp_path / "full", "4gb", reviews, *three)
    assert done.returncode == 0, done.stderr[-4000:]
    interrupted = tmp_path / "interrupted"
    killed = fit(interrupted, "4gb", reviews, *three, "--trainer.callbacks+=interrupt.KillAfterStep",
                 f"--trainer.callbacks.step={KILL_AFTER}")
    assert killed.returncode != 0, killed.stderr[-4000:]
    checkpoint = run(interrupted) / "checkpoints" / "last.ckpt"
    saved = FileSystemReader(checkpoint.resolve()).read_metadata().state_dict_metadata
    head = [k for k in saved if k.startswith("optimizer_0.state.") and "classifier.weight.absmax" in k]
    assert head and saved[head[0]].size == torch.Size([3, 1])  # a row per shard, the empty one's included
    resumed = fit(interrupted, "4gb", reviews, *three, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert max_weight_difference(run(tmp_path / "full"), run(interrupted, 1)) <= 1e-6


# -- the parts ----------------------------------------------------------------------------------


def test_the_training_order_is_a_function_of_seed_and_epoch_and_shards_the_data():
    data = list(range(10))
    order = lambda epoch, **kw: list(_at_epoch(ResumableSampler(data, seed=3, **kw), epoch))  # noqa: E731
    torch.manual_seed(0)
    first = order(1)
    torch.manual_seed(1)  # the global random state plays no part
    assert order(1) == first and sorted(first) == data
    assert order(2) != first
    halves = [order(1, num_replicas=2, rank=r) for r in (0, 1)]
    assert sorted(halves[0] + halves[1]) == data


def _at_epoch(sampler: ResumableSampler, epoch: int) -> ResumableSampler:
    sampler.set_epoch(epoch)
    return sampler


def test_the_loader_resumes_inside_the_epoch_and_starts_the_next_one_afresh():
    def loader() -> ResumableDataLoader:
        return ResumableDataLoader(list(range(10)), batch_size=2, sampler=ResumableSampler(list(range(10)), seed=0))

    original = loader()
    original.sampler.set_epoch(1)
    epoch1 = [b.tolist() for b in original]
    it = iter(original)
    seen = [next(it).tolist() for _ in range(2)]
    assert original.state_dict() == {"epoch": 1, "batches": 2}

    resumed = loader()
    resumed.load_state_dict(original.state_dict())
    resumed.sampler.set_epoch(1)  # Lightning sets the epoch before each pass
    it = iter(resumed)
    assert seen + [next(it).tolist()] == epoch1[:3]
    assert resumed.state_dict() == {"epoch": 1, "batches": 3}  # the skipped batches count: a second resume works
    assert [b.tolist() for b in it] == epoch1[3:]

    after_last = loader()  # a checkpoint after the epoch's last batch: Lightning goes on with the next epoch
    after_last.load_state_dict({"epoch": 1, "batches": 5})
    after_last.sampler.set_epoch(2)
    original.sampler.set_epoch(2)
    assert [b.tolist() for b in after_last] == [b.tolist() for b in original]


def test_every_random_state_comes_back_from_a_weights_only_checkpoint(tmp_path, capsys):
    def draw() -> tuple:
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()

    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    torch.save(ExactResume().state_dict(), tmp_path / "state.pt")
    expected = draw()
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    restored = ExactResume()
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    draw()  # anything in between, set-up for instance
    restored.on_train_start(trainer, None)
    assert draw() == expected

    other = ExactResume()  # written by 2 processes, resumed by 1: says so, restores nothing
    other.load_state_dict({"rng": 2 * torch.load(tmp_path / "state.pt", weights_only=True)["rng"]})
    other.on_train_start(trainer, None)
    assert capsys.readouterr().err.splitlines() == [
        "warning: the checkpoint was written by 2 processes and this run has 1: training goes on resharded (weights "
        "and optimizer state), with other data shards and random states, so not bit-exact with the interrupted run"
    ]
    assert draw() != expected


class FakeCuda:
    """torch.cuda's random-state functions over ``count`` visible GPUs, the process's own being ``current``."""

    def __init__(self, count: int, current: int = 0) -> None:
        self.states = [torch.tensor([10 * count + i]) for i in range(count)]
        self.current = current

    def is_available(self) -> bool:
        return bool(self.states)

    def device_count(self) -> int:
        return len(self.states)

    def current_device(self) -> int:
        return self.current

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return list(self.states)

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for index, state in enumerate(states):
            self.set_rng_state(state, index)

    def set_rng_state(self, state: torch.Tensor, device: int) -> None:
        self.states[device] = state  # an IndexError past the visible GPUs, as torch's


@pytest.mark.parametrize("saved, visible", [(8, 2), (2, 8), (2, 2), (0, 2), (2, 0)])
def test_resuming_with_fewer_or_more_visible_gpus_goes_on_with_one_warning_line(saved, visible, capsys):
    """A checkpoint holds one CUDA random state per GPU its process saw, and the index of its own (cuda:1 here).
    Resumed where the process sees another number, Lightning's restore by index raises IndexError with fewer; here
    the process's own GPU (cuda:0 now) gets the state its GPU had, the others keep theirs, and one line says so."""
    from lit_memory.run.resume import CudaRandom

    writer = CudaRandom(FakeCuda(saved, current=min(1, max(saved - 1, 0))))
    states = writer.states()
    reader = FakeCuda(visible, current=0)
    before = list(reader.states)
    CudaRandom(reader).restore(states["torch.cuda"], states.get("torch.cuda.device"))
    lines = capsys.readouterr().err.splitlines()
    if saved == visible:
        assert lines == [] and reader.states == states["torch.cuda"]  # as before: every state by index
        return
    assert len(lines) == 1 and lines[0].startswith(
        f"warning: the checkpoint holds the CUDA random states of {saved} visible GPUs and this process sees "
        f"{visible}: "
    )
    if saved and visible:
        assert "its own GPU's restored (saved as cuda:1, now cuda:0)" in lines[0]
        assert reader.states == [states["torch.cuda"][1]] + before[1:]
    else:
        assert reader.states == before  # nothing saved for it, or nothing to restore on


def test_last_is_the_newest_last_ckpt_of_the_earlier_runs(tmp_path):
    """Lightning's own lookup of ``ckpt_path="last"`` (which asks ResumeCheckpoint) on the run folders a
    kill leaves: each run writes into a new version_N, and a kill between removing the previous
    checkpoint and relinking last.ckpt leaves it dangling."""
    def checkpoints(version: int, *steps: int) -> Path:
        folder = tmp_path / "lightning_logs" / f"version_{version}" / "checkpoints"
        folder.mkdir(parents=True)
        for step in steps:
            (folder / f"epoch=0-step={step}.ckpt").write_bytes(b"")
            os.utime(folder / f"epoch=0-step={step}.ckpt", (step, step))  # written in step order
        return folder

    older, newer = checkpoints(0, 5), checkpoints(1, 10, 15)
    (older / "last.ckpt").symlink_to("epoch=0-step=5.ckpt")
    (newer / "last.ckpt").symlink_to("epoch=0-step=10.ckpt")
    trainer = Trainer(logger=CSVLogger(tmp_path), callbacks=[ResumeCheckpoint()], enable_progress_bar=False)

    def last() -> str:
        return trainer._checkpoint_connector._select_ckpt_path(TrainerFn.FITTING, "last", True, False)

    assert last() == str(newer / "last.ckpt")  # not the new run's own (empty) folder
    (newer / "epoch=0-step=10.ckpt").unlink()  # killed before last.ckpt was relinked to step 15
    assert last() == str(newer / "epoch=0-step=15.ckpt")


def test_fit_checkpoints_every_few_hundred_steps_unless_configured_otherwise():
    from lit_memory.run.best import BestCheckpoint, ValidationStep

    default = fit_callbacks(None, None)
    assert [type(c) for c in default] == [ExactResume, ValidationStep, BestCheckpoint, ResumeCheckpoint]
    assert default[3]._every_n_train_steps == EVERY_N_TRAIN_STEPS and default[3].save_last == "link"
    own = ModelCheckpoint(monitor="val_f1", mode="max")
    kept = fit_callbacks([own], None)  # the user's replaces the resume checkpoint; the best validated one stays
    assert kept[0] is own and [type(c) for c in kept[1:]] == [ExactResume, ValidationStep, BestCheckpoint]
    assert [type(c) for c in fit_callbacks(None, False)] == [ExactResume, ValidationStep]  # enable_checkpointing=false


def test_a_default_fit_keeps_last_ckpt(reviews, fast_args):
    args = [a for a in fast_args if not a.startswith("--trainer.enable_checkpointing")]
    tiny = ["--config", str(CONFIGS / "bert-large.yaml"), f"--model.config_overrides={TINY}", "--data.batch_size=4",
            f"--data.source={reviews}"]
    cli = LitMemoryCLI(args=["fit", "--config", str(RECIPES / "baseline.yaml"), *tiny, *args])
    from lit_memory.run.best import BestCheckpoint

    # the best-model record first (a step's checkpoint writes its state after it updates): Lightning's `best` is it
    assert [type(c) for c in cli.trainer.checkpoint_callbacks] == [BestCheckpoint, ResumeCheckpoint]
    assert any(isinstance(c, ExactResume) for c in cli.trainer.callbacks)
    # fewer steps than the interval: last.ckpt is written when the fit ends
    assert (Path(cli.trainer.log_dir) / "checkpoints" / "last.ckpt").is_file()


def test_a_run_trained_in_fp32_by_the_cpu_bf16_fallback_resumes_with_its_bf16_recipe(tmp_path, monkeypatch):
    """The checkpoint holds the precision the run trained with (after the CLI's fallback); resuming compares
    the same recipe's bf16 before the fallback has run: equal where it falls back, refused where it would not."""
    from jsonargparse import Namespace

    from lit_memory.errors import UserError
    from lit_memory.optim import precision
    from lit_memory.run.resume import RESUME_STATE, check_resume, resume_settings

    def settings(precision_: str, fallback: bool = True, ckpt=None) -> Namespace:
        return Namespace(
            trainer=Namespace(precision=precision_, accelerator="cpu", accumulate_grad_batches=1),
            cpu_bf16_fallback=fallback, ckpt_path=ckpt,
        )

    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: False)
    ckpt = tmp_path / "last.ckpt"
    torch.save({RESUME_STATE: resume_settings(settings("32-true"))}, ckpt)  # what the fallen-back run saved
    check_resume(settings("bf16-mixed", ckpt=str(ckpt)))  # the same recipe: it trains in 32-true again
    with pytest.raises(UserError, match=r"trainer.precision: '32-true' in the checkpoint, 'bf16-mixed' here"):
        check_resume(settings("bf16-mixed", fallback=False, ckpt=str(ckpt)))
    monkeypatch.setattr(precision, "native_cpu_bf16", lambda: True)  # a CPU with bf16 would train in bf16
    with pytest.raises(UserError, match=r"'32-true' in the checkpoint, 'bf16-mixed' here"):
        check_resume(settings("bf16-mixed", ckpt=str(ckpt)))


# -- the step's checkpoint and its validation, on Lightning alone (BoringModel: a fit takes a fraction of a second) --


class Killed(Exception):
    pass


class Scored(BoringModel):
    """A validation scores the step it follows (step 10 best); ``kill``: raise there, during a validation or after a
    training batch (``"validation"``/``"train"``, at ``at`` steps)."""

    def __init__(self, kill: Optional[str] = None, at: int = 10, empty_val: bool = False) -> None:
        super().__init__()
        self.kill, self.at, self.empty_val = kill, at, empty_val

    def validation_step(self, batch, batch_idx):
        if self.kill == "validation" and self.trainer.global_step == self.at:
            raise Killed
        self.log("val_score", -abs(self.trainer.global_step - 10.0))
        return super().validation_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.kill == "train" and self.trainer.global_step == self.at:
            raise Killed

    def val_dataloader(self):
        return torch.utils.data.DataLoader(RandomDataset(32, 0 if self.empty_val else 4), batch_size=2)


class Validated(Callback):
    """What `validates_next` says after each training batch, and whether a validation followed it."""

    def __init__(self) -> None:
        self.said: list[bool] = []
        self.followed: list[bool] = []
        self.validated: list[int] = []  # the steps validated

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.said.append(validates_next(trainer))
        self.followed.append(False)

    def on_validation_start(self, trainer, pl_module) -> None:
        self.followed[-1] = True
        self.validated.append(trainer.global_step)


def boring_fit(
    root: Path, version: str, model: BoringModel, *callbacks: Callback, ckpt_path=None, **settings: Any
) -> Trainer:
    settings = {"max_steps": 12, "limit_train_batches": 8, "val_check_interval": 5, "check_val_every_n_epoch": None,
                **settings}
    trainer = Trainer(
        default_root_dir=root, logger=CSVLogger(root, version=version), num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, *fit_callbacks([BestCheckpoint("val_score"), ResumeCheckpoint(every_n_train_steps=5)],
                                              None)],
        **settings,
    )
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except Killed:  # nothing written at it, as a SIGKILL
        pass
    return trainer


def test_validates_next_is_lightnings_decision(tmp_path):
    """Asked after every batch: true exactly where a validation follows (after every 3rd batch of 2 epochs of 6, with
    2-batch steps: after batches that stepped and batches that only accumulated), false where the validation set has
    no batch (Lightning's loop then skips it)."""
    spy = Validated()
    boring_fit(tmp_path, "a", Scored(), spy, max_steps=-1, max_epochs=2, limit_train_batches=6, val_check_interval=3,
               check_val_every_n_epoch=1, accumulate_grad_batches=2)
    # after batches 3 and 6 of each epoch: 1 step (batch 3 of the epoch only accumulated) and 3; 4 and 6
    assert spy.validated == [1, 3, 4, 6] and len(spy.said) == 12
    assert spy.said == spy.followed
    spy = Validated()
    boring_fit(tmp_path, "b", Scored(empty_val=True), spy)
    assert spy.validated == [] and len(spy.said) == 12 and not any(spy.said)


# Validations every 5 steps inside 8-step epochs, or at the end of 5-step epochs (Lightning's default schedule, where a
# ModelCheckpoint of its own would keep its best only at the epoch's end, after the step's checkpoint was written
# again).
SCHEDULES = {
    "interval": {},
    "epoch end": {"limit_train_batches": 5, "val_check_interval": 1.0, "check_val_every_n_epoch": 1},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("kill", ["validation", "train"])
def test_a_run_killed_at_a_checkpoints_step_resumes_there_and_keeps_the_uninterrupted_runs_best(
    kill, schedule, tmp_path
):
    """Validations after steps 5 and 10, a checkpoint at each, step 10 the best. Killed during step 10's validation, the
    run resumes from step 10 (written before it, no step lost) and runs that validation; killed after it (at step 11),
    from step 10's checkpoint written again after it, which holds it in the record."""
    full = boring_fit(tmp_path, "full", Scored(), **SCHEDULES[schedule])
    boring_fit(tmp_path, "killed", Scored(kill, at=10 if kill == "validation" else 11), **SCHEDULES[schedule])
    last = tmp_path / "lightning_logs" / "killed" / "checkpoints" / "last.ckpt"
    assert last.resolve().name == "epoch=1-step=10.ckpt"
    saved = torch.load(last, weights_only=True)["callbacks"]
    owed = next(v["validation_owed"] for k, v in saved.items() if k.startswith("ResumeCheckpoint"))
    assert (owed, saved["BestCheckpoint"]["validated_step"]) == ((10, 5) if kill == "validation" else (None, 10))
    resumed = boring_fit(tmp_path, "resumed", Scored(), ckpt_path=last, **SCHEDULES[schedule])
    assert (best_of(resumed).best_step(), best_of(resumed).best_model_score) == (10, best_of(full).best_model_score)
    log = tmp_path / "lightning_logs" / "resumed" / "metrics.csv"  # none where nothing was logged
    val_steps = [int(r["step"]) for r in csv.DictReader(open(log)) if r.get("val_score")] if log.exists() else []
    assert val_steps == ([10] if kill == "validation" else [])  # the validation owed, run once, at its step
    if kill == "validation":  # and step 10's checkpoint written again, in the resumed run's folder, holding it
        again = torch.load(tmp_path / "lightning_logs" / "resumed" / "checkpoints" / "last.ckpt", weights_only=True)
        assert again["global_step"] == 10 and again["callbacks"]["BestCheckpoint"]["validated_step"] == 10


def test_a_checkpoints_step_is_written_when_its_validation_has_no_batch(tmp_path):
    """Validations due after steps 5 and 10 on a validation set without a batch (the loop skips them): the steps'
    checkpoints are written all the same."""
    boring_fit(tmp_path, "a", Scored(empty_val=True))
    folder = tmp_path / "lightning_logs" / "a" / "checkpoints"
    assert (folder / "last.ckpt").resolve().name == "epoch=1-step=10.ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=1-step=10.ckpt", "last.ckpt"]


class Flat(Scored):
    """Every validation scores the same: a tie at each."""

    def validation_step(self, batch, batch_idx):
        self.log("val_score", 1.0)
        return BoringModel.validation_step(self, batch, batch_idx)


def test_a_run_killed_after_an_epoch_end_validation_stops_early_where_the_uninterrupted_run_stops(tmp_path):
    """Validations at the ends of 5-step epochs, every one a tie, patience 2: the uninterrupted run stops at step 15
    (no improvement at 10 and 15) and exports step 5. Killed after step 11 and resumed from step 10's checkpoint, the
    early-stopping count and the best-model record must hold step 10's validation, or the run goes on to step 20."""
    from lit_memory.run.best import EarlyStop

    epochs = {**SCHEDULES["epoch end"], "max_steps": 40}
    full = boring_fit(tmp_path, "full", Flat(), EarlyStop(patience=2), **epochs)
    assert full.global_step == 15 and best_of(full).best_step() == 5
    boring_fit(tmp_path, "killed", Flat("train", at=11), EarlyStop(patience=2), **epochs)
    last = tmp_path / "lightning_logs" / "killed" / "checkpoints" / "last.ckpt"
    assert last.resolve().name == "epoch=1-step=10.ckpt"
    resumed = boring_fit(tmp_path, "resumed", Flat(), EarlyStop(patience=2), ckpt_path=last, **epochs)
    assert (resumed.global_step, best_of(resumed).best_step()) == (15, 5)
