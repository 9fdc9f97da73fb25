"""The fused Trainer strategies: one device, and FSDP over 2 CPU processes (Fabric's: tests/test_fabric.py).

Multi-process and resumed runs go through ``tests/fused_worker.py`` in a subprocess: Lightning's
launcher re-executes ``sys.argv`` for the other ranks, which must not be pytest.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import fused_worker as worker
import lightning as L
import pytest
import torch
from conftest import CONFIGS, RECIPES, REPO, HostReads, StepLog, assert_same, the_error
from lightning.pytorch.callbacks import BaseFinetuning, Callback, GradientAccumulationScheduler
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification

from lit_memory import fused
from lit_memory.__main__ import main
from lit_memory.cli import LitMemoryCLI
from lit_memory.errors import UserError
from lit_memory.fabric import FusedFabricFSDPStrategy, FusedFabricStrategy
from lit_memory.fused import Bucketing
from lit_memory.memory.measure import records
from lit_memory.memory.measure.tracker import Tracker
from lit_memory.model import SequenceClassifier
from lit_memory.run import environment
from lit_memory.run.monitor import MemoryMonitor
from lit_memory.strategies import FSDP2Strategy, FusedFSDPStrategy, FusedSingleDeviceStrategy

CHECKPOINT = "checkpoints/epoch=0-step=6.ckpt"  # the worker keeps one every 6 steps


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for these small models


def load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path / "params.pt")


def run_worker(out: Path, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "fused_worker.py"), str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**environment.for_new_job(), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]


# -- one device ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """Unfused and fused Trainer runs: 10 steps, dropout on, linear warmup (3 steps) then decay."""
    runs = {}
    for strategy in ("single", "fused-single"):
        out = tmp_path_factory.mktemp(strategy)
        with StepLog() as log:
            module = worker.train(out, strategy)
        runs[strategy] = {"out": out, "module": module, "steps": log.by_name(module.model)}
    return runs


def test_single_device_fused_matches_unfused_with_lr_schedule(single_runs):
    plain, fusion = single_runs["single"], single_runs["fused-single"]
    assert getattr(fusion["module"].trainer.strategy, "fused_step", False)
    assert_same(load(plain["out"]), load(fusion["out"]))
    # Each parameter's own optimizer stepped with the lr the scheduler set for that step, and kept
    # its group's weight decay (matrices 0.01, biases and LayerNorm 0).
    assert fusion["steps"] == plain["steps"]
    lrs = [lr for lr, _ in fusion["steps"]["classifier.weight"]]
    assert len(lrs) == 10 and lrs[3] == max(lrs) and lrs[0] < lrs[1] < lrs[3] > lrs[-1]  # warmup, then decay
    assert {wd for _, wd in fusion["steps"]["classifier.weight"]} == {0.01}
    assert {wd for _, wd in fusion["steps"]["bert.encoder.layer.0.output.LayerNorm.weight"]} == {0.0}
    assert all(p.grad is None for p in fusion["module"].parameters())


def test_single_device_resumes_in_a_new_process(single_runs, tmp_path):
    fusion = single_runs["fused-single"]
    checkpoint = fusion["out"] / CHECKPOINT
    saved = torch.load(checkpoint, weights_only=False)["optimizer_states"][0]
    trainable = {f"model.{n}" for n, p in fusion["module"].model.named_parameters() if p.requires_grad}
    assert set(saved["state"]) == trainable  # optimizer state keyed by parameter name
    run_worker(tmp_path, "--strategy", "fused-single", "--resume", str(checkpoint))
    assert_same(load(tmp_path), load(fusion["out"]))  # 6 steps + resume to 10 == 10 steps


def test_an_unfused_checkpoint_resumes_fused(single_runs, tmp_path):
    plain = single_runs["single"]
    worker.train(tmp_path, "fused-single", resume=str(plain["out"] / CHECKPOINT))
    assert_same(load(tmp_path), load(plain["out"]))


class TrackedLoad(FusedSingleDeviceStrategy):
    """Tracks the tensors that loading the optimizer state allocates."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        tracker = Tracker("cpu")
        tracker.track_external(self.lightning_module, *self.optimizers)
        with tracker:
            tracker.enter_phase("load")
            super().load_optimizer_state_dict(checkpoint)
        self.loading = tracker.footprint


def test_resuming_allocates_less_than_a_training_step(tmp_path):
    """Loading the optimizer state creates no gradient and runs no step: its tracked peak stays under
    a steady-state training step's. torch's set_optimizer_state_dict would first give every parameter a
    zero gradient and run a full step: here 8 layers' gradients where a step holds one layer's (the
    embeddings are frozen, and a batch of 4 tokens keeps activations small)."""
    layers = {**worker.TINY, "num_hidden_layers": 8}
    data = DataLoader([{k: v[:4] if v.ndim else v for k, v in b.items()} for b in worker.batches(8)], batch_size=1)

    def fit(steps: int, strategy: FusedSingleDeviceStrategy, resume=None, callbacks=()) -> SequenceClassifier:
        torch.manual_seed(0)
        module = SequenceClassifier(
            "bundled:bert-large", pretrained=False, config_overrides=layers, freeze="embeddings", save_pretrained=False
        )
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=list(callbacks),
        )
        trainer.fit(module, data, ckpt_path=resume)
        if resume is None:
            trainer.save_checkpoint(tmp_path / "4.ckpt")
        return module

    fit(4, FusedSingleDeviceStrategy())
    strategy, monitor = TrackedLoad(), MemoryMonitor(track_steps=6)  # tracks the steps after resuming: 5 and 6
    resumed = fit(6, strategy, resume=tmp_path / "4.ckpt", callbacks=[monitor])
    assert resumed.trainer.global_step == 6 and monitor.tracked_batches == 2
    assert strategy.loading.peak <= monitor.measured.peak
    trainable = sum(4 * p.numel() for p in resumed.parameters() if p.requires_grad)
    assert strategy.loading.peak < monitor.measured.peak - trainable / 2  # far below: no gradients at all


class UnfreezeEmbeddings(BaseFinetuning):
    """Lightning's fine-tuning callback: at epoch 1 (step 6) the frozen embeddings train, as a new param group."""

    def freeze_before_training(self, pl_module) -> None:
        pass  # the module freezes them when it builds the model (`freeze="embeddings"`), after this hook

    def finetune_function(self, pl_module, epoch: int, optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.bert.embeddings, optimizer, lr=1e-3)


class GradientsAfterBackward(Callback):
    def __init__(self) -> None:
        self.held = []

    def on_after_backward(self, trainer, pl_module) -> None:
        self.held.append(sum(p.grad is not None for p in pl_module.parameters()))


class FrozenEmbeddingsNoSchedule(SequenceClassifier):
    """Embeddings frozen at build; no LR scheduler (torch's LambdaLR refuses param groups added later)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, freeze="embeddings", **kwargs)

    def configure_optimizers(self):
        return self.build_optimizer()


def test_parameters_unfrozen_during_training_are_fused_and_match_unfused(tmp_path):
    runs = {}
    for strategy in ("single", "fused-single"):
        held = GradientsAfterBackward()
        module = worker.tiny_bert(cls=FrozenEmbeddingsNoSchedule)
        worker.train(tmp_path / strategy, strategy, model=module, callbacks=[UnfreezeEmbeddings(), held])
        runs[strategy] = (load(tmp_path / strategy), held.held)
    assert_same(runs["single"][0], runs["fused-single"][0])
    assert runs["fused-single"][1] == [0] * 10  # every gradient applied inside backward, the new ones too
    assert runs["single"][1][5] < runs["single"][1][6]  # unfused: more gradients from step 6 on
    start = worker.tiny_bert()  # the same seed: the embeddings it starts from
    start.configure_model()
    word = "bert.embeddings.word_embeddings.weight"
    assert not torch.equal(runs["fused-single"][0][word], start.model.state_dict()[word])  # they trained


@pytest.mark.parametrize("clip", ["norm:0.3", "value:0.01"])
def test_fused_clipping_matches_unfused_clipping(clip, tmp_path):
    """trainer.gradient_clip_val, fused: by norm, a first backward measures the global norm, the fused one
    scales by torch's coefficient; by value, each bucket clamps before its step. Both equal Lightning's
    clipping after an unfused backward, where it is active at every step."""
    seen = {}
    for strategy in ("single", "fused-single"):
        seen[strategy] = worker.GradientNorms()
        worker.train(tmp_path / strategy, strategy, steps=6, callbacks=[seen[strategy]], clip=clip)
    assert_same(load(tmp_path / "single"), load(tmp_path / "fused-single"), atol=1e-5)
    algorithm, value = clip.split(":")
    plain, fusion = seen["single"], seen["fused-single"]
    assert fusion.held == [0] * 6 and min(plain.held) > 0
    if algorithm == "norm":
        assert min(plain.norms) > float(value)  # every step clipped
        torch.testing.assert_close(fusion.norms, plain.norms, rtol=1e-5, atol=0)
    else:
        assert min(plain.largest) > float(value)


def scale_trajectory(scales: list[float]) -> tuple[int, int]:
    """(steps skipped, growths) of a GradScaler's scales after each step (fused_worker.FP16_SCALER's start)."""
    before = [worker.FP16_SCALER["init_scale"], *scales[:-1]]
    return sum(a < b for b, a in zip(before, scales)), sum(a > b for b, a in zip(before, scales))


def test_single_device_fp16_matches_gradscaler_with_clipping_by_norm(tmp_path):
    """16-mixed (Lightning's MixedPrecision with torch's GradScaler; a plugin, as a CPU's 16-mixed would be
    bf16), clipping by norm, overflows forced: one measuring backward unscales, checks and measures; an
    overflow skips the step as GradScaler does, otherwise the fused backward unscales, clips and steps. A
    checkpoint resumes the scale exactly."""
    seen = {}
    for strategy in ("single", "fused-single"):
        seen[strategy] = worker.GradientNorms()
        worker.train(tmp_path / strategy, strategy, steps=10, callbacks=[seen[strategy]], clip="norm:0.3", fp16=True)
    assert_same(load(tmp_path / "single"), load(tmp_path / "fused-single"), atol=1e-6)
    plain, fusion = (torch.load(tmp_path / s / "norms.pt") for s in ("single", "fused-single"))
    assert fusion["scales"] == plain["scales"]
    skipped, grown = scale_trajectory(plain["scales"])
    assert skipped >= 3 and grown >= 1 and fusion["held"] == [0] * 10
    finite = [n for n in plain["norms"] if n == n and n != float("inf")]  # a skipped step's norm is inf/NaN
    assert len(finite) == 10 - skipped and min(finite) > 0.3  # every step that stepped was clipped
    torch.testing.assert_close(seen["fused-single"].norms, seen["single"].norms, rtol=1e-5, atol=0, equal_nan=True)
    # The checkpoint holds the scaler's state in its own format (through the fused step's view of it): resumed
    # at step 6, the last 4 steps skip and scale as the uninterrupted run's.
    checkpoint = tmp_path / "fused-single" / CHECKPOINT
    assert torch.load(checkpoint, weights_only=False)["MixedPrecision"]["scale"] == plain["scales"][5]
    worker.train(tmp_path / "resumed", "fused-single", steps=10, clip="norm:0.3", fp16=True, resume=str(checkpoint))
    assert_same(load(tmp_path / "resumed"), load(tmp_path / "fused-single"), atol=0)
    assert torch.load(tmp_path / "resumed" / "norms.pt")["scales"] == plain["scales"][6:]


def test_unfused_fp16_steps_adamws_fused_kernel_without_reading_the_overflow_flag_on_the_host(tmp_path, monkeypatch):
    """16-mixed, unfused, no clipping: the AdamW lit_memory gives its fused kernel takes GradScaler's scale and
    overflow flag into that kernel, so the scaler's step and update never read the flag on the host (a device sync
    per step on CUDA); the overflowing first steps are skipped all the same (the scale backs off)."""
    reads, steps = HostReads(), []

    def counted(method):
        def run(scaler, *args, **kwargs):
            steps.append(method.__name__)
            with reads:
                return method(scaler, *args, **kwargs)
        return run

    for name in ("step", "update"):  # torch's own, under the test's recording scaler (`fused_worker.fp16_plugin`)
        monkeypatch.setattr(torch.amp.GradScaler, name, counted(getattr(torch.amp.GradScaler, name)))
    worker.train(tmp_path, "single", steps=4, fp16=True)
    assert steps.count("step") == 4 and reads.count == 0
    assert scale_trajectory(torch.load(tmp_path / "norms.pt")["scales"])[0] >= 1  # a skipped step


# -- FSDP, 2 processes -----------------------------------------------------------------------


def test_fsdp_fused_matches_unfused_with_clipping_by_norm_and_fp16(tmp_path):
    """FSDP2 over 2 processes, trainer.gradient_clip_val by norm, 16-mixed with overflows forced: fused, one
    measuring backward unscales, checks and measures, its overflow flag and norm all-reduced over the ranks
    (both skip the same steps); unfused, GradScaler's unscale of the sharded gradients reduces the flag
    (DTensor) and Lightning clips after it. (Exact to 1e-6 with clipping by value: tests/test_fabric.py.)"""
    # Resuming FSDP runs (killed mid-epoch, from the sharded checkpoint): tests/run/test_resume.py.
    plain, fusion = tmp_path / "plain", tmp_path / "fused"
    run_worker(plain, "--strategy", "fsdp", "--devices", "2", "--clip", "norm:0.25", "--fp16")
    run_worker(fusion, "--strategy", "fused-fsdp", "--devices", "2", "--clip", "norm:0.25", "--fp16")
    assert_same(load(plain), load(fusion), atol=1e-5)  # the norm's reduction order differs: 1.6e-6 here
    norms, fused_norms = torch.load(plain / "norms.pt"), torch.load(fusion / "norms.pt")
    assert fused_norms["scales"] == norms["scales"] and fused_norms["held"] == [0] * 10
    skipped, grown = scale_trajectory(norms["scales"])
    assert skipped >= 3 and grown >= 1
    finite = [n for n in norms["norms"] if n == n and n != float("inf")]  # a skipped step's norm is inf/NaN
    assert len(finite) == 10 - skipped and min(finite) > 0.25  # every step that stepped was clipped
    torch.testing.assert_close(fused_norms["norms"], norms["norms"], rtol=1e-5, atol=0, equal_nan=True)
    exported = AutoModelForSequenceClassification.from_pretrained(fusion / "hf_model")  # gathered from the shards
    assert_same(exported.state_dict(), load(fusion))


@pytest.mark.parametrize("strategy", [FSDP2Strategy, FusedFabricFSDPStrategy])
def test_fsdp2_on_one_cuda_rank_starts_no_nccl_communicator(strategy):
    """One rank needs no NCCL communicator (FSDP2 neither gathers nor reduces there), whose memory a small card
    cannot spare (`lit_memory.memory.hardware.nccl`): the process group is gloo; several ranks keep Lightning's
    NCCL, and a backend the user names is theirs."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    def backend(world: int, given=None) -> str:
        found = strategy(process_group_backend=given)
        found.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
        found.cluster_environment = LightningEnvironment()
        found.cluster_environment.set_world_size(world)
        return found._get_process_group_backend()

    assert (backend(1), backend(2), backend(1, "nccl")) == ("gloo", "nccl", "nccl")


@pytest.mark.parametrize("recipe, fused", [("baseline", False), ("fused", True), ("4gb", True)])
def test_fsdp_config_shards_and_keeps_the_recipes_choice_of_fused_step(recipe, fused):
    configs = ["--config", str(RECIPES / f"{recipe}.yaml"), "--config", str(CONFIGS / "fsdp.yaml")]
    devices = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.num_nodes=3"]
    cli = LitMemoryCLI(args=[*configs, *devices], run=False)
    assert isinstance(cli.trainer.strategy, FSDP2Strategy) and cli.trainer.strategy.fused_step is fused
    assert cli.trainer.world_size == 6


def test_4gb_recipe_trains_on_fsdp_and_resumes_resharded_onto_three_then_four_processes(tmp_path):
    """bf16 + checkpointing + 8-bit AdamW (local shards, 32-bit embeddings) + fused step, sharded over 2 ranks; its
    checkpoint (8-bit state saved sharded) resumed on 3 ranks, whose checkpoint is resumed on 4, each saying in one
    line that it is resharded. The 2-label head and token-type embeddings (2 rows) leave the last ranks empty shards:
    no optimizer is handed one (bitsandbytes' CUDA kernels would exit the process). Every bucket's 8-bit step ran on
    the stream bitsandbytes launches on (the default one) after waiting for an event where FSDP2 made the gradients
    (its reduce-scatter stream, recorded through torch.cpu's stream objects: `streams.Probe`), with no device sync."""
    args = [
        "--config", str(RECIPES / "4gb.yaml"), "--config", str(CONFIGS / "fsdp.yaml"),
        "--trainer.accelerator=cpu", "--trainer.max_epochs=6", "--trainer.overfit_batches=1",
        "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--model.optimizer.init_args.lr=1e-4",
        "--data.limit_train_samples=64", "--data.limit_eval_samples=16", f"--trainer.default_root_dir={tmp_path}",
        "--data.padding=max_length",  # every batch the shape the per-rank memory prediction assumes
        # no validation: hf_model holds the last weights (what moved), not the best
        "--trainer.check_val_every_n_epoch=100",
    ]
    def fit(devices: int, *more: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "lit_memory", "fit", *args, f"--trainer.devices={devices}", *more],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env={
                **environment.for_new_job(),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
            },
        )

    result = fit(2)
    assert result.returncode == 0, result.stderr[-4000:]
    # A quiet console: no third-party advice (Lightning's sync_dist advice for the validation loss), and the
    # run's own lines once, not once per process.
    console = result.stdout + result.stderr
    assert "sync_dist" not in console and "It is recommended" not in console, console[-4000:]
    assert console.count("gradient_checkpointing auto: ") == 1
    run = tmp_path / "lightning_logs" / "version_0"
    losses = [float(row["train_loss"]) for row in csv.DictReader(open(run / "metrics.csv")) if row.get("train_loss")]
    assert len(losses) == 6 and losses[-1] < losses[0]  # the one batch is being learned
    # Memory per rank: each rank measured its own tensors; the analytic model predicted one rank's share.
    memory = records.read_memory(run)
    predicted = memory["predicted"]["analytic"]["peak_bytes"]
    assert memory["world_size"] == 2 and [r["rank"] for r in memory["ranks"]] == [0, 1]
    for rank in memory["ranks"]:
        assert rank["tracked"]["peak_bytes"] == pytest.approx(predicted, rel=0.10), rank["rank"]
        assert rank["process"]["max_rss_bytes"] > rank["tracked"]["peak_bytes"]
    tuned = AutoModelForSequenceClassification.from_pretrained(run / "hf_model")  # gathered from both ranks
    pretrained = SequenceClassifier()
    pretrained.configure_model()
    name = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(tuned.state_dict()[name], pretrained.model.state_dict()[name])

    for version, (before, devices) in enumerate([(2, 3), (3, 4)], start=1):
        (checkpoint,) = [c for c in (tmp_path / "lightning_logs" / f"version_{version - 1}" / "checkpoints").iterdir()
                         if not c.name.startswith("best-")]  # the resume checkpoint, not the best validated weights
        probes = tmp_path / f"probe{devices}"
        resumed = fit(
            devices, f"--ckpt_path={checkpoint}", f"--trainer.max_epochs={6 + version}",
            # the test's probe
            "--trust-recipe", "--trainer.callbacks+=streams.Probe", f"--trainer.callbacks.out={probes}",
        )
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        warnings = [line for line in resumed.stderr.splitlines() if "processes and this run has" in line]
        assert warnings == [
            f"warning: the checkpoint was written by {before} processes and this run has {devices}: training goes on "
            "resharded (weights and optimizer state), with other data shards and random states, so not bit-exact "
            "with the interrupted run"
        ]
        # One more step (lr 1e-4) from the checkpoint's weights: they moved, a little.
        weights = [_exported(tmp_path / "lightning_logs" / f"version_{v}") for v in (version - 1, version)]
        moved = max((weights[1][k] - weights[0][k]).abs().max().item() for k in weights[0])
        assert 0 < moved < 1e-2
        ranks = [torch.load(probes / f"rank{r}.pt") for r in range(devices)]
        assert [r["empty_shards"] > 0 for r in ranks] == [False, False] + [True] * (devices - 2)
        for rank in ranks:
            # every bucket with values here stepped once, and none was handed an empty shard
            assert rank["steps"] == rank["buckets"] > 6 and rank["smallest_handed"] > 0, rank
            assert rank["on_default"] == rank["ordered"] == rank["steps"] and rank["syncs"] == 0, rank


def _exported(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "hf_model" / "model.safetensors")


def test_lora_recipe_trains_on_fsdp_and_exports_the_merged_model(tmp_path):
    """peft's adapters inside FSDP2-sharded layers; at the end the gathered adapters are merged into
    plain weights (peft cannot merge DTensors) and saved for plain transformers."""
    args = [
        "--config",
        str(RECIPES / "lora.yaml"),
        "--config",
        str(CONFIGS / "fsdp.yaml"),
        "--trainer.accelerator=cpu",
        "--trainer.devices=2",
        "--trainer.max_steps=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_checkpointing=false",
        "--data.limit_train_samples=128",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "lit_memory", "fit", *args], cwd=REPO, capture_output=True, text=True,
        timeout=600, env={**environment.for_new_job(), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    tuned = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lightning_logs" / "version_0" / "hf_model")
    assert not any("lora" in name for name in tuned.state_dict())
    pretrained = SequenceClassifier()
    pretrained.configure_model()
    adapted, untouched = (
        "bert.encoder.layer.0.attention.self.query.weight",
        "bert.encoder.layer.0.attention.self.key.weight",
    )
    assert not torch.equal(tuned.state_dict()[adapted], pretrained.model.state_dict()[adapted])  # merged
    assert torch.equal(tuned.state_dict()[untouched], pretrained.model.state_dict()[untouched])  # no adapter



# -- what fusion cannot do: one line, before training ----------------------------------------


class ManualOptimization(SequenceClassifier):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


class ClipsGradients(SequenceClassifier):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


class TwoOptimizers(SequenceClassifier):
    def configure_optimizers(self):
        head = list(self.model.classifier.parameters())
        body = [p for p in self.model.parameters() if all(p is not h for h in head)]
        return [torch.optim.AdamW(head), torch.optim.AdamW(body)]


ERRORS = {
    "accumulation": (FusedSingleDeviceStrategy, worker.tiny_bert, {"accumulate_grad_batches": 2}, fused.ACCUMULATION),
    "manual": (FusedSingleDeviceStrategy, lambda: worker.tiny_bert(cls=ManualOptimization), {}, fused.MANUAL),
    "two-optimizers": (FusedSingleDeviceStrategy, lambda: worker.tiny_bert(cls=TwoOptimizers), {}, fused.SEVERAL),
    "fsdp-accumulation": (FusedFSDPStrategy, worker.tiny_bert, {"accumulate_grad_batches": 2}, fused.ACCUMULATION),
    # Raises trainer.accumulate_grad_batches at the start of epoch 1, long after the check of the setting.
    "accumulation-schedule": (
        FusedSingleDeviceStrategy,
        worker.tiny_bert,
        {"callbacks": [GradientAccumulationScheduler({1: 2})]},
        fused.ACCUMULATION_SCHEDULE,
    ),
    "clipping-hook": (FusedSingleDeviceStrategy, lambda: worker.tiny_bert(cls=ClipsGradients), {}, fused.CLIPPING_HOOK),
}


@pytest.mark.parametrize("case", ERRORS)
def test_what_fusion_cannot_do_fails_before_training(case, tmp_path):
    strategy, module, settings, message = ERRORS[case]
    module = module()
    with environment.restored():  # Lightning's launcher leaves its rendezvous variables in this process
        trainer = L.Trainer(strategy=strategy(), accelerator="cpu", max_steps=1, default_root_dir=tmp_path, **settings)
        with pytest.raises(UserError) as error:
            trainer.fit(module, DataLoader(worker.batches(8), batch_size=4))
    assert str(error.value) == message and "\n" not in message
    assert trainer.global_step == 0
    if case != "two-optimizers":  # the optimizers exist only once the model does
        assert module.model is None  # refused before the model was even built


@pytest.mark.parametrize("strategy", [FusedSingleDeviceStrategy, FusedFSDPStrategy, FusedFabricStrategy])
def test_a_bucket_setting_is_checked_when_the_strategy_is_built(strategy):
    assert str(strategy(bucket="16 MiB").bucket) == "16 MiB" and strategy().bucket == Bucketing("layer")
    for bad in ("16", "16 MB", "0 MiB", "layers", 16):
        with pytest.raises(UserError) as error:
            strategy(bucket=bad)
        assert str(error.value) == f"bucket must be layer, param or a size such as '25 MiB', got {bad!r}"


def test_cli_prints_a_bad_bucket_as_one_line(fast_args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(RECIPES / "fused.yaml"), "--trainer.strategy.init_args.bucket=big", *fast_args])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: bucket must be layer, param or a size such as '25 MiB', got 'big'"
    )


def test_cli_prints_the_refusal_as_one_line_and_writes_nothing(tmp_path, capsys):
    root = tmp_path / "runs"
    args = ["--config", str(RECIPES / "fused.yaml"), "--trainer.accumulate_grad_batches=4"]
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *args, f"--trainer.default_root_dir={root}"])
    assert exit_.value.code == 2
    assert the_error(capsys.readouterr().err) == f"error: {fused.ACCUMULATION}"
    assert not root.exists()


def test_a_single_file_checkpoint_of_sharded_8bit_state_is_refused_in_one_line_before_anything_runs(tmp_path, capsys):
    """bitsandbytes' state under FSDP2 is quantised per shard and saved sharded: gathering it into one file on rank
    0 (save_distributed_checkpoint false) is refused before the model is built or a run folder written."""
    from lit_memory.optim.eightbit_shards import ONE_FILE

    root = tmp_path / "runs"
    args = ["--config", str(RECIPES / "4gb.yaml"), "--config", str(CONFIGS / "fsdp.yaml"), "--trainer.accelerator=cpu",
            "--trainer.devices=1", "--trainer.strategy.init_args.save_distributed_checkpoint=false"]
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *args, f"--trainer.default_root_dir={root}"])
    assert exit_.value.code == 2
    assert the_error(capsys.readouterr().err) == f"error: {ONE_FILE}"
    assert not root.exists()
