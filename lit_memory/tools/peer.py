"""The peer: the same model, data and settings trained by `transformers.Trainer`, measured like ours.

A recipe's resolved config is mapped onto the `TrainingArguments` the reference post used (batch,
accumulation, gradient checkpointing, ``optim``, learning rate, weight decay, bf16); freezing and
LoRA are applied to the model by our `SequenceClassifier.configure_model`, the data comes from our
`TextClassificationData` (same split, tokenisation and fixed-length collator). Everything else is
the Trainer's default, as people run it, but for what would make the two runs differ in kind: it clips as the recipe
clips (by norm; no clipping unless the recipe sets it, where the Trainer's default is 1.0) and loads as ours loads
(workers, pinned memory). ``bf16-true``
is the model cast to bf16 (the Trainer trains the dtype it is given); torchao's 8-bit and 4-bit AdamW are
its ``adamw_torch_8bit``/``adamw_torch_4bit`` (``bf16_stochastic_round`` through ``optim_args``). Settings
the Trainer has no switch for (the fused backward + step, sharded strategies, other optimizers)
raise `NoTrainerEquivalent`.

Run by ``python -m lit_memory bench --peer hf-trainer`` in a fresh process per recipe:
``python -m lit_memory.tools.peer --out DIR --warmup W --steps N <fit args>``. Writes ``DIR/peer.json``:
the peak memory (CUDA: the allocator's peaks; CPU: tensors tracked by the same `Tracker` as our
`MemoryMonitor`, over the first optimizer steps) and the wall time of each step after warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch
from transformers import TrainerCallback

from lit_memory import files
from lit_memory.cli import LitMemoryCLI, resolve
from lit_memory.errors import UserError
from lit_memory.memory.measure.tracker import Tracker
from lit_memory.optim.optimizers import compiles_its_step, library_of
from lit_memory.planning.prediction.step import is_fused
from lit_memory.run.activation_checkpointing import CheckpointPlan
from lit_memory.run.monitor import Stamps, device_memory_used
from lit_memory.run.step_profile import HostOps
from lit_memory.settings import Precision

PEER_JSON = "peer.json"
# Our optimizer class paths -> the Trainer's `optim` names.
OPTIM = {
    "torch.optim.AdamW": "adamw_torch",
    "transformers.Adafactor": "adafactor",
    "transformers.optimization.Adafactor": "adafactor",
    "bitsandbytes.optim.AdamW8bit": "adamw_bnb_8bit",
    "torchao.optim.AdamW8bit": "adamw_torch_8bit",
    "torchao.optim.AdamW4bit": "adamw_torch_4bit",
}
# The block size the Trainer gives torchao's optimizers: its `optim_args` would pass another as a string,
# which torchao cannot use, so only this one has an equivalent.
TRAINER_TORCHAO_BLOCK = 256
# Precision -> TrainingArguments. bf16-true has no argument: the Trainer trains a model in the dtype it
# is given, so `run` casts the model to bf16 (no autocast, no fp32 master copy), as Lightning's bf16-true does.
PRECISION = {"32-true": {}, "bf16-mixed": {"bf16": True}, "16-mixed": {"fp16": True}, "bf16-true": {}}


class NoTrainerEquivalent(Exception):
    """A recipe setting `transformers.Trainer` has no switch for; the message says which."""


def trainer_arguments(cli: LitMemoryCLI, best: bool = False) -> dict[str, Any]:
    """`TrainingArguments` keywords equivalent to a resolved fit run (`lit_memory.cli.resolve`). ``best``: only the
    settings every configuration shares (learning rate, schedule, clipping, loader, device), for `best_under_budget`'s
    choices to complete."""

    config = cli.settings
    if best:
        return _shared_arguments(config)
    if is_fused(config.trainer.strategy):
        raise NoTrainerEquivalent("no Trainer equivalent (fused backward + step)")
    if config.trainer.strategy not in ("auto", "single_device"):
        raise NoTrainerEquivalent("no Trainer equivalent (strategy)")
    precision = Precision.of(config.trainer.precision).name
    if precision not in PRECISION:
        raise NoTrainerEquivalent(f"no Trainer equivalent (precision {precision})")
    optimizer = config.model.optimizer
    if optimizer.class_path not in OPTIM:
        raise NoTrainerEquivalent(f"no Trainer equivalent (optimizer {optimizer.class_path})")
    init = optimizer.init_args
    optim_args = {}
    optim = OPTIM[optimizer.class_path]
    if optim == "adamw_torch" and getattr(init, "fused", None) is not False and getattr(init, "foreach", None) is None:
        optim = "adamw_torch_fused"  # the Trainer's default, and the kernel our run gives AdamW (`use_fused_kernels`)
    if library_of(optimizer.class_path).name == "torchao":
        if init.block_size != TRAINER_TORCHAO_BLOCK:
            raise NoTrainerEquivalent(
                f"no Trainer equivalent ({optimizer.class_path} with block_size {init.block_size}: the Trainer's "
                f"{OPTIM[optimizer.class_path]} uses {TRAINER_TORCHAO_BLOCK})"
            )
        optim_args["optim_args"] = f"bf16_stochastic_round={init.bf16_stochastic_round}"
    if config.model.gradient_checkpointing == "auto":
        raise NoTrainerEquivalent("no Trainer equivalent (checkpointing planned per layer for a budget)")
    checkpointing = CheckpointPlan.parse(config.model.gradient_checkpointing)
    if checkpointing is not None and checkpointing.uniform != "full":
        raise NoTrainerEquivalent(
            f"no Trainer equivalent ({checkpointing.describe()}: the Trainer recomputes every layer)"
        )
    if getattr(config.model, "offload_activations", False):
        raise NoTrainerEquivalent("no Trainer equivalent (activation offloading)")
    if getattr(config.model, "compile", False):
        raise NoTrainerEquivalent("no Trainer equivalent (per-layer compile)")
    return {
        "per_device_train_batch_size": config.data.batch_size,
        "gradient_accumulation_steps": config.trainer.accumulate_grad_batches,
        "gradient_checkpointing": checkpointing is not None,
        "optim": optim,
        **optim_args,
        **_shared_arguments(config),
        **PRECISION[precision],
    }


def _shared_arguments(config: Any) -> dict[str, Any]:
    clip, how = config.trainer.gradient_clip_val, config.trainer.gradient_clip_algorithm
    if clip and how not in (None, "norm"):
        raise NoTrainerEquivalent(f"no Trainer equivalent (gradient_clip_algorithm {how}: the Trainer clips by norm)")
    accelerator = str(config.trainer.accelerator)
    use_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    init = config.model.optimizer.init_args
    return {
        "learning_rate": init.lr,
        "weight_decay": init.weight_decay,
        "lr_scheduler_type": config.model.lr_scheduler_type,
        "warmup_steps": config.model.warmup_ratio,  # a float below 1 is a ratio of the steps
        "use_cpu": use_cpu,
        "seed": config.seed_everything if type(config.seed_everything) is int else 42,  # not a bool
        # Like for like: the same clipping (none unless the recipe clips; the Trainer's default is 1.0) and loader.
        "max_grad_norm": float(clip or 0.0),
        "dataloader_num_workers": config.data.num_workers,
        "dataloader_pin_memory": not use_cpu if config.data.pin_memory is None else bool(config.data.pin_memory),
    }


# What a 4 GB-card user runs in the HF Trainer instead of a fused recipe under a budget (`best_under_budget`): every
# layer recomputed, bitsandbytes' 8-bit AdamW (the Trainer keeps nn.Embedding weights on 32-bit state), bf16; and the
# weights in bf16 (no fp32 master copy, updates below half a bf16 unit lost) only where fp32 ones cannot fit.
TRAINER_BEST = {
    "trainer.strategy": "auto", "model.gradient_checkpointing": True, "model.offload_activations": False,
    "model.compile": False, "model.embedding_optimizer_state": "32bit",
}
TRAINER_BEST_OPTIMIZER = "bitsandbytes.optim.AdamW8bit"
# The configurations tried in turn, the first to fit wins: (what it gives up, lit_memory's precision for it)
TRAINER_RUNGS = (
    ("fp32 weights, bf16 autocast (the Trainer's bf16=True)", "bf16-mixed"),
    ("bf16 weights (the model loaded in bf16: no fp32 master copy)", "bf16-true"),
)


def best_under_budget(cli: LitMemoryCLI, target: Any = None) -> dict[str, Any]:
    """The HF Trainer's best configuration within a recipe's memory budget, for a recipe with a budget the Trainer
    has no switch for (4gb.yaml's fused step): `TRAINER_BEST`, in the first of `TRAINER_RUNGS` where some micro-batch
    fits, the largest micro-batch dividing the recipe's samples per step whose step lit_memory's memory model predicts
    within the budget less the margin on ``target`` (default: this machine's GPU), in the Trainer's loop
    (`lit_memory.planning.prediction.step.LOOPS`: its autocast cache, torch's default kernels), accumulating to the
    recipe's samples per step. Returns `TrainingArguments` keywords and, under ``chosen``, the choice and why.
    `NoTrainerEquivalent` without a budget, or where nothing fits."""
    from lit_memory.memory.hardware.gpus import target as this_target
    from lit_memory.memory.model.loops import loop
    from lit_memory.planning.prediction.analytic import capped_total

    config = cli.settings
    budget = cli.memory.limit if cli.memory is not None else None
    if budget is None:
        raise NoTrainerEquivalent("no Trainer equivalent (its best configuration is chosen for a memory budget)")
    samples = config.data.batch_size * config.trainer.accumulate_grad_batches
    init = config.model.optimizer.init_args
    optimizer = {"class_path": TRAINER_BEST_OPTIMIZER, "init_args": {"lr": init.lr, "weight_decay": init.weight_decay}}
    step = dataclasses.replace(cli.step(target if target is not None else this_target("cuda")), loop=loop("hf-trainer"))
    limit = budget.with_margin(step.margin).usable
    tried = []
    for rung, precision in TRAINER_RUNGS:
        for micro in (b for b in range(samples, 0, -1) if samples % b == 0):
            settings = {**TRAINER_BEST, "trainer.precision": precision, "model.optimizer": optimizer,
                        "data.batch_size": micro, "trainer.accumulate_grad_batches": samples // micro}
            predicted = capped_total(step.with_settings(settings))  # under the cap ours runs under: its room too
            if predicted <= limit:
                return {
                    "per_device_train_batch_size": micro, "gradient_accumulation_steps": samples // micro,
                    "gradient_checkpointing": True, "optim": "adamw_bnb_8bit", **PRECISION[precision],
                    "chosen": {"configuration": rung, "precision": precision, "predicted_device_bytes": predicted,
                               "limit_bytes": limit, "over_the_limit": tried,
                               "why": "the first configuration and the largest micro-batch predicted within the "
                                      "budget less the margin (lit_memory's memory model, the Trainer's loop)"},
                }
        tried.append({"configuration": rung, "micro_batch": 1, "predicted_device_bytes": predicted})
    raise NoTrainerEquivalent(f"no Trainer configuration fits {budget}: micro-batch 1 is predicted over it")


class PeerMeter(TrainerCallback):
    """Step times of `steps` optimizer steps after `warmup`; peak memory (tracked on CPU, allocator on CUDA); the
    host operators of step `count_step` (`HostOps`, from the end of the step before to its own end, as
    `lit_memory.run.step_profile.HostOpCounter` counts ours)."""

    def __init__(self, warmup: int, track_steps: int, cuda: bool, steps: Optional[int] = None,
                 count_step: Optional[int] = None) -> None:
        self.warmup, self.track_steps, self.cuda, self.steps = warmup, track_steps, cuda, steps
        self.stamps = Stamps(torch.device("cuda" if cuda else "cpu"))  # as our StepTimer times
        self.peak = 0
        self.tracker = None
        self.micro_batch = 0
        self.count_step = count_step
        self.device_bytes_by_step: list[Optional[int]] = []
        self.alloc_retries_by_step: list[int] = []  # the allocator's cache released and a request retried
        self._retries = 0
        self.counting: Optional[HostOps] = None
        self.counted: Optional[dict[str, Any]] = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)

    # One tracker per micro-batch (MemTracker follows one forward per module), and as the memory callback
    # does, of an accumulation window only the micro-batches that differ: the first, the second, the last.
    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.micro_batch = 0
        if not self.cuda and state.global_step < self.track_steps:
            self._track(model, optimizer)

    def on_substep_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.tracker is not None:
            self._stop_tracking()
        self.micro_batch += 1
        last = args.gradient_accumulation_steps - 1
        if not self.cuda and state.global_step < self.track_steps and self.micro_batch in (1, last):
            self._track(model, optimizer)

    def _track(self, model, optimizer) -> None:
        self.tracker = Tracker("cpu", compiled_steps=compiles_its_step)  # torchao's steps are compiled
        # What exists already (parameters, gradients, optimizer state) is registered; the rest is seen made.
        self.tracker.track_external(model, getattr(optimizer, "optimizer", optimizer))
        self.tracker.__enter__()

    def _stop_tracking(self) -> None:
        self.peak = max(self.peak, sum(self.tracker.categories("peak").values()))
        self.tracker.__exit__(None, None, None)
        self.tracker = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self._stop_tracking()
        if self.cuda:  # the device level and the allocator's retries at every step's end, as our monitor reads them
            used, _ = device_memory_used(torch.device("cuda", torch.cuda.current_device()))
            self.device_bytes_by_step.append(used)
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            self.alloc_retries_by_step.append(retries - self._retries)
            self._retries = retries
        if state.global_step >= self.warmup:
            self.stamps.mark()
        if self.counting is not None and state.global_step > self.count_step:
            self.counting.__exit__(None, None, None)
            self.counted, self.counting = {"step": self.count_step, **self.counting.record()}, None
        elif self.count_step is not None and self.counted is None and state.global_step == self.count_step:
            self.counting = HostOps().__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        if self.counting is not None:  # ended inside the counted step: not a whole step
            self.counting.__exit__(None, None, None)
            self.counting = None

    def record(self, samples_per_step: int) -> dict[str, Any]:
        return {
            "peak_bytes": torch.cuda.max_memory_allocated() if self.cuda else self.peak,
            "reserved_bytes": torch.cuda.max_memory_reserved() if self.cuda else None,
            "step_times_s": self.stamps.intervals()[: self.steps],
            "host_ops": self.counted,
            "device_bytes_by_step": self.device_bytes_by_step if self.cuda else None,
            "alloc_retries_by_step": self.alloc_retries_by_step if self.cuda else None,
            "clock": self.stamps.kind,
            "samples_per_step": samples_per_step,
            "device": torch.cuda.get_device_name() if self.cuda else "cpu",
        }


def run(fit_args: list[str], out: Path, warmup: int, steps: int, track_steps: int = 2,
        count_step: Optional[int] = None, best: bool = False) -> dict[str, Any]:
    """Train `warmup + steps` optimizer steps with `transformers.Trainer` (and step `count_step`, whose host operators
    are counted, where it comes after them); return the measurements. ``best``: the Trainer's best configuration
    within the recipe's budget (`best_under_budget`) instead of the recipe's own settings. A budget caps the
    Trainer's process as it caps ours (`lit_memory.run.memory_callbacks.BudgetCap`, the same code)."""
    # deferred: transformers.Trainer needs accelerate (optional) and takes ~4 s to import; only a peer run uses it
    from transformers import Trainer, TrainingArguments

    run_ = resolve(["fit", *fit_args])
    with run_.scope():  # the run's trust decision and switches hold while the Trainer loads and trains
        cli = run_.build(trainer=False)
        chosen: dict[str, Any] = {}
        precision = cli.settings.trainer.precision
        if best:
            found = best_under_budget(cli)
            chosen = found.pop("chosen")
            precision = chosen["precision"]
            kwargs = {**trainer_arguments(cli, best=True), **found}
        else:
            kwargs = trainer_arguments(cli)
        module, data = cli.model, cli.datamodule
        # The Trainer switches checkpointing on itself (its own defaults, as the seed had it): build without ours.
        module.checkpoint_plan = None
        if best:  # the Trainer's own configuration: no compiled layers
            module.hparams.compile = False
        module.configure_model()
        weights = Precision.of(precision).param
        if weights != torch.float32:  # bf16-true: the weights themselves in bf16
            module.model.to(weights)
        data.prepare_data()
        loader = data.train_dataloader()  # its dataset and fixed-length collator: the data ours trains on
        cuda = kwargs["use_cpu"] is False and torch.cuda.is_available()
        cap = capped(cli, cuda)  # before the Trainer moves the model onto the device, as ours caps at setup
        try:
            while True:
                args = TrainingArguments(
                    output_dir=str(out),
                    max_steps=max(warmup + steps, (count_step or 0) + 1),
                    report_to=[],
                    save_strategy="no",
                    eval_strategy="no",
                    logging_strategy="no",
                    disable_tqdm=True,
                    **kwargs,
                )
                meter = PeerMeter(warmup, track_steps, cuda, steps, count_step)
                trainer = Trainer(
                    model=module.model,
                    args=args,
                    train_dataset=loader.dataset,
                    data_collator=loader.collate_fn,
                    callbacks=[meter],
                )
                try:
                    trainer.train()
                    break
                except torch.OutOfMemoryError as err:
                    # the best configuration's micro-batch was predicted to fit and did not: half of it, as its user
                    # would try next (the prediction's miss is in the record)
                    micro = kwargs["per_device_train_batch_size"]
                    if not best or micro % 2:
                        raise
                    chosen.setdefault("out_of_memory_at", []).append(
                        {"micro_batch": micro, "error": str(err).splitlines()[0][:200]}
                    )
                    del trainer
                    for param in module.model.parameters():
                        param.grad = None
                    gc.collect()
                    torch.cuda.empty_cache()
                    kwargs.update(
                        per_device_train_batch_size=micro // 2,
                        gradient_accumulation_steps=2 * kwargs["gradient_accumulation_steps"],
                    )
        finally:
            if cap is not None:
                cap.teardown(cap.view, None, "fit")
    samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    # Every setting the Trainer ran with, as it reports them (its defaults included): what "the peer" was.
    record = {**meter.record(samples), "training_arguments": json.loads(args.to_json_string())}
    if chosen:
        record["chosen"] = chosen
    if cap is not None:
        record["allocator_limit_bytes"] = cap.limit
    return record



QUALITY_JSON = "quality.json"


def validated(fit_args: list[str], arguments: dict[str, Any], steps: int, out: Path) -> dict[str, Any]:
    """Train ``steps`` optimizer steps with `transformers.Trainer` in a configuration chosen elsewhere (``arguments``:
    `TrainingArguments` keywords, with ``precision``, lit_memory's name for the weights' precision: ``bf16-true``
    casts the model), on the run's model and data, then validate it as ours validates (`SequenceClassifier`'s
    metrics on the same held-out split, through a Lightning validation loop). Returns the validation metrics.
    What `lit_memory.tools.quality` measures the Trainer's 4 GB configuration by."""
    import lightning as L
    from transformers import Trainer, TrainingArguments

    arguments = dict(arguments)
    precision = arguments.pop("precision")
    run_ = resolve(["fit", *fit_args])
    with run_.scope():
        cli = run_.build(trainer=False)
        module, data = cli.model, cli.datamodule
        module.checkpoint_plan = None  # the Trainer switches its own checkpointing on (`gradient_checkpointing`)
        module.configure_model()
        weights = Precision.of(precision).param
        if weights != torch.float32:
            module.model.to(weights)
        data.prepare_data()
        loader = data.train_dataloader()
        kwargs = {**trainer_arguments(cli, best=True), **arguments}
        args = TrainingArguments(output_dir=str(out), max_steps=steps, report_to=[], save_strategy="no",
                                 eval_strategy="no", logging_strategy="no", disable_tqdm=True, **kwargs)
        Trainer(model=module.model, args=args, train_dataset=loader.dataset, data_collator=loader.collate_fn).train()
        checker = L.Trainer(accelerator="cpu" if kwargs["use_cpu"] else "auto", devices=1, precision=precision,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=str(out))
        (metrics,) = checker.validate(module, datamodule=data, verbose=False)
    return {key: float(value) for key, value in metrics.items()}


def capped(cli: LitMemoryCLI, cuda: bool) -> Optional[Any]:
    """The run's ``memory.budget`` as ours applies it on CUDA (`BudgetCap`: the allocator capped at the budget less
    the context measured now, the step's kernels loaded first), for the Trainer's process; None without one."""
    budget = cli.memory.cap if cli.memory is not None else None
    if not cuda or budget is None:
        return None
    from lit_memory.run.memory_callbacks import BudgetCap  # deferred: only a capped peer needs it

    cap = BudgetCap(budget)
    precision = "bf16-mixed" if cli.settings.trainer.precision is None else cli.settings.trainer.precision
    cap.view = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", torch.cuda.current_device())),
                               precision=precision, global_step=0)
    cap.setup(cap.view, None, "fit")
    return cap


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_memory.tools.peer", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--count-step", type=int, default=None, help="the optimizer step whose host operators to count")
    parser.add_argument("--best-under-budget", action="store_true",
                        help="the Trainer's best configuration within the recipe's memory budget (best_under_budget)")
    parser.add_argument("--validate-with", metavar="JSON",
                        help="train --steps steps with these TrainingArguments (and precision), then validate as ours "
                        f"does; writes {QUALITY_JSON} (`validated`)")
    ours, fit_args = parser.parse_known_args(argv)
    ours.out.mkdir(parents=True, exist_ok=True)
    try:
        if ours.validate_with is not None:
            metrics = validated(fit_args, json.loads(ours.validate_with), ours.steps, ours.out)
            files.write_text(ours.out / QUALITY_JSON, json.dumps(metrics, indent=2) + "\n")
            return
        record = run(
            fit_args, ours.out, ours.warmup, ours.steps, count_step=ours.count_step, best=ours.best_under_budget
        )
    except (UserError, NoTrainerEquivalent) as err:
        raise SystemExit(f"error: {err}") from err
    files.write_text(ours.out / PEER_JSON, json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
