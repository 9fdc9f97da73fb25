"""The fused strategies in Trainer (one device, FSDP over 2 CPU processes) and Fabric.

Multi-process and resumed runs go through ``tests/fused_worker.py`` in a subprocess: Lightning's
launcher re-executes ``sys.argv`` for the other ranks, which must not be pytest.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.callbacks import BaseFinetuning, Callback, GradientAccumulationScheduler
from lightning.pytorch.plugins import MixedPrecision
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification

import fused_worker as worker
from conftest import CONFIGS, RECIPES, REPO
from lit_memory import fused
from lit_memory.__main__ import main
from lit_memory.cli import LitMemoryCLI
from lit_memory.errors import UserError
from lit_memory.memory.tracker import Tracker
from lit_memory.monitor import MemoryMonitor
from lit_memory.model import SequenceClassifier
from lit_memory.fabric import FABRIC_CLIPPING, FusedFabricStrategy
from lit_memory.strategies import FSDP2Strategy, SHARD_STATE, FusedFSDPStrategy, FusedSingleDeviceStrategy

CHECKPOINT = "checkpoints/epoch=0-step=6.ckpt"  # the worker keeps one every 6 steps


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the two cores are shared with the worker processes
    yield
    torch.set_num_threads(threads)


class StepLog:
    """The lr and weight decay of every step applied to each parameter, by parameter identity.

    A global optimizer hook sees every step: the original optimizer's (a no-op when fused: its
    gradients are gone) and each per-parameter optimizer's inside backward.
    """

    def __init__(self) -> None:
        self.steps: dict[int, list[tuple[float, float]]] = defaultdict(list)

    def __enter__(self) -> "StepLog":
        self.handle = register_optimizer_step_post_hook(self._record)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def _record(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:  # this step applied to it
                    self.steps[id(param)].append((group["lr"], group["weight_decay"]))

    def by_name(self, module: torch.nn.Module) -> dict[str, list[tuple[float, float]]]:
        return {name: self.steps[id(param)] for name, param in module.named_parameters()}


def load(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path / "params.pt")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def run_worker(out: Path, *args: str) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "fused_worker.py"), str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
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


# -- FSDP, 2 processes -----------------------------------------------------------------------


def test_fsdp_fused_matches_unfused(tmp_path):
    # Resuming FSDP runs (killed mid-epoch, from the sharded checkpoint): tests/test_resume.py.
    plain, fusion = tmp_path / "plain", tmp_path / "fused"
    run_worker(plain, "--strategy", "fsdp", "--devices", "2")
    run_worker(fusion, "--strategy", "fused-fsdp", "--devices", "2")
    assert_same(load(plain), load(fusion))
    exported = AutoModelForSequenceClassification.from_pretrained(fusion / "hf_model")  # gathered from the shards
    assert_same(exported.state_dict(), load(fusion))


@pytest.mark.parametrize("recipe, fused", [("baseline", False), ("fused", True), ("4gb", True)])
def test_fsdp_config_shards_and_keeps_the_recipes_choice_of_fused_step(recipe, fused):
    configs = ["--config", str(RECIPES / f"{recipe}.yaml"), "--config", str(CONFIGS / "fsdp.yaml")]
    devices = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.num_nodes=3"]
    cli = LitMemoryCLI(args=[*configs, *devices], run=False)
    assert isinstance(cli.trainer.strategy, FSDP2Strategy) and cli.trainer.strategy.fused_step is fused
    assert cli.trainer.world_size == 6


def test_4gb_recipe_trains_on_fsdp_with_two_processes(tmp_path):
    """bf16 + checkpointing + 8-bit AdamW (local shards, 32-bit embeddings) + fused step, sharded over 2 ranks."""
    args = [
        "--config", str(RECIPES / "4gb.yaml"), "--config", str(CONFIGS / "fsdp.yaml"),
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_epochs=6", "--trainer.overfit_batches=1",
        "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--model.optimizer.init_args.lr=1e-4",
        "--data.limit_train_samples=64", "--data.limit_eval_samples=16", f"--trainer.default_root_dir={tmp_path}",
    ]
    def fit(*more: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "lit_memory", "fit", *args, *more], cwd=REPO, capture_output=True, text=True,
            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    result = fit()
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "lightning_logs" / "version_0"
    losses = [float(row["train_loss"]) for row in csv.DictReader(open(run / "metrics.csv")) if row.get("train_loss")]
    assert len(losses) == 6 and losses[-1] < losses[0]  # the one batch is being learned
    tuned = AutoModelForSequenceClassification.from_pretrained(run / "hf_model")  # gathered from both ranks
    pretrained = SequenceClassifier()
    pretrained.configure_model()
    name = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(tuned.state_dict()[name], pretrained.model.state_dict()[name])
    # Its checkpoint holds no 8-bit optimizer state (per-rank quantised shards): resuming says so, in one line.
    (checkpoint,) = (run / "checkpoints").iterdir()
    resumed = fit(f"--ckpt_path={checkpoint}", "--trainer.max_epochs=7")
    assert resumed.returncode == 2
    assert resumed.stderr.strip().splitlines()[-1] == f"error: {SHARD_STATE}"


def test_lora_recipe_trains_on_fsdp_and_exports_the_merged_model(tmp_path):
    """peft's adapters inside FSDP2-sharded layers; at the end the gathered adapters are merged into
    plain weights (peft cannot merge DTensors) and saved for plain transformers."""
    args = [
        "--config", str(RECIPES / "lora.yaml"), "--config", str(CONFIGS / "fsdp.yaml"),
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
        "--trainer.limit_val_batches=0", "--trainer.enable_checkpointing=false", "--data.limit_train_samples=128",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "lit_memory", "fit", *args], cwd=REPO, capture_output=True, text=True,
        timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    tuned = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lightning_logs" / "version_0" / "hf_model")
    assert not any("lora" in name for name in tuned.state_dict())
    pretrained = SequenceClassifier()
    pretrained.configure_model()
    adapted, untouched = "bert.encoder.layer.0.attention.self.query.weight", "bert.encoder.layer.0.attention.self.key.weight"
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
    "fp16-scaler": (
        FusedSingleDeviceStrategy,
        worker.tiny_bert,
        {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]},
        fused.SCALER,
    ),
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
    trainer = L.Trainer(strategy=strategy(), accelerator="cpu", max_steps=1, default_root_dir=tmp_path, **settings)
    with pytest.raises(UserError) as error:
        trainer.fit(module, DataLoader(worker.batches(8), batch_size=4))
    assert str(error.value) == message and "\n" not in message
    assert trainer.global_step == 0
    if case != "two-optimizers":  # the optimizers exist only once the model does
        assert module.model is None  # refused before the model was even built


@pytest.mark.parametrize("strategy", [FusedSingleDeviceStrategy, FusedFSDPStrategy, FusedFabricStrategy])
def test_a_bucket_setting_is_checked_when_the_strategy_is_built(strategy):
    assert strategy(bucket="16 MiB").bucket == "16 MiB" and strategy().bucket == "layer"
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
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {fused.ACCUMULATION}"]
    assert not root.exists()


# -- Fabric ----------------------------------------------------------------------------------


def test_fabric_example_matches_unfused_with_lr_schedule():
    spec = importlib.util.spec_from_file_location("fabric_fused", REPO / "examples" / "fabric_fused.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    models, steps = {}, {}
    for fusion in (False, True):
        with StepLog() as log:
            models[fusion] = example.train(fused=fusion, steps=10).module  # unwrapped from Fabric's
        steps[fusion] = log.by_name(models[fusion])
    assert_same(dict(models[False].named_parameters()), dict(models[True].named_parameters()))
    assert steps[True] == steps[False]
    assert len({lr for lr, _ in steps[True]["classifier.weight"]}) > 5  # the schedule moved the lr
    assert all(p.grad is None for p in models[True].parameters())


FABRIC_ERRORS = {
    "two-optimizers": (
        {},
        lambda fabric, net, opt: fabric.setup(net, opt, torch.optim.SGD(net.parameters())),
        fused.SEVERAL,
    ),
    "fp16-scaler": (
        {"plugins": [FabricMixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]},
        lambda fabric, net, opt: fabric.setup(net, opt),
        fused.SCALER,
    ),
    "clipping": ({}, lambda fabric, net, opt: fabric.clip_gradients(*fabric.setup(net, opt), 1.0), FABRIC_CLIPPING),
}


@pytest.mark.parametrize("case", FABRIC_ERRORS)
def test_fabric_refuses_what_fusion_cannot_do(case):
    settings, action, message = FABRIC_ERRORS[case]
    fabric = L.Fabric(accelerator="cpu", strategy=FusedFabricStrategy(), **settings)
    net = torch.nn.Linear(2, 2)
    with pytest.raises(UserError) as error:
        action(fabric, net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert str(error.value) == message
