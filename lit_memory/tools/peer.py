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
import json
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import TrainerCallback

from lit_memory import files
from lit_memory.cli import LitMemoryCLI, resolve
from lit_memory.errors import UserError
from lit_memory.memory.prediction.step import is_fused
from lit_memory.settings import Precision
from lit_memory.memory.measure.tracker import Tracker
from lit_memory.checkpointing import CheckpointPlan
from lit_memory.monitor import Stamps
from lit_memory.optimizers import compiles_its_step, library_of
from lit_memory.step_profile import HostOps

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


def trainer_arguments(cli: LitMemoryCLI) -> dict[str, Any]:
    """`TrainingArguments` keywords equivalent to a resolved fit run (`lit_memory.cli.resolve`)."""

    config = cli.settings
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
        raise NoTrainerEquivalent(f"no Trainer equivalent ({checkpointing.describe()}: the Trainer recomputes every layer)")
    if getattr(config.model, "offload_activations", False):
        raise NoTrainerEquivalent("no Trainer equivalent (activation offloading)")
    if getattr(config.model, "compile", False):
        raise NoTrainerEquivalent("no Trainer equivalent (per-layer compile)")
    clip, how = config.trainer.gradient_clip_val, config.trainer.gradient_clip_algorithm
    if clip and how not in (None, "norm"):
        raise NoTrainerEquivalent(f"no Trainer equivalent (gradient_clip_algorithm {how}: the Trainer clips by norm)")
    accelerator = str(config.trainer.accelerator)
    use_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    return {
        "per_device_train_batch_size": config.data.batch_size,
        "gradient_accumulation_steps": config.trainer.accumulate_grad_batches,
        "gradient_checkpointing": checkpointing is not None,
        "optim": optim,
        **optim_args,
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
        **PRECISION[precision],
    }


class PeerMeter(TrainerCallback):
    """Step times of `steps` optimizer steps after `warmup`; peak memory (tracked on CPU, allocator on CUDA); the
    host operators of step `count_step` (`HostOps`, from the end of the step before to its own end, as
    `lit_memory.step_profile.HostOpCounter` counts ours)."""

    def __init__(self, warmup: int, track_steps: int, cuda: bool, steps: Optional[int] = None,
                 count_step: Optional[int] = None) -> None:
        self.warmup, self.track_steps, self.cuda, self.steps = warmup, track_steps, cuda, steps
        self.stamps = Stamps(torch.device("cuda" if cuda else "cpu"))  # as our StepTimer times
        self.peak = 0
        self.tracker = None
        self.micro_batch = 0
        self.count_step = count_step
        self.counting: Optional[HostOps] = None
        self.counted: Optional[dict[str, Any]] = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

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
            "clock": self.stamps.kind,
            "samples_per_step": samples_per_step,
            "device": torch.cuda.get_device_name() if self.cuda else "cpu",
        }


def run(fit_args: list[str], out: Path, warmup: int, steps: int, track_steps: int = 2,
        count_step: Optional[int] = None) -> dict[str, Any]:
    """Train `warmup + steps` optimizer steps with `transformers.Trainer` (and step `count_step`, whose host operators
    are counted, where it comes after them); return the measurements."""
    # deferred: transformers.Trainer needs accelerate (optional) and takes ~4 s to import; only a peer run uses it
    from transformers import Trainer, TrainingArguments

    run_ = resolve(["fit", *fit_args])
    with run_.scope():  # the run's trust decision and switches hold while the Trainer loads and trains
        cli = run_.build(trainer=False)
        kwargs = trainer_arguments(cli)
        module, data = cli.model, cli.datamodule
        # The Trainer switches checkpointing on itself (its own defaults, as the seed had it): build without ours.
        module.checkpoint_plan = None
        module.configure_model()
        weights = Precision.of(cli.settings.trainer.precision).param
        if weights != torch.float32:  # bf16-true: the weights themselves in bf16
            module.model.to(weights)
        data.prepare_data()
        loader = data.train_dataloader()  # its dataset and fixed-length collator: the data ours trains on
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
        cuda = not args.use_cpu and torch.cuda.is_available()
        meter = PeerMeter(warmup, track_steps, cuda, steps, count_step)
        trainer = Trainer(
            model=module.model,
            args=args,
            train_dataset=loader.dataset,
            data_collator=loader.collate_fn,
            callbacks=[meter],
        )
        trainer.train()
    samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    # Every setting the Trainer ran with, as it reports them (its defaults included): what "the peer" was.
    return {**meter.record(samples), "training_arguments": json.loads(args.to_json_string())}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_memory.tools.peer", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--count-step", type=int, default=None, help="the optimizer step whose host operators to count")
    ours, fit_args = parser.parse_known_args(argv)
    try:
        record = run(fit_args, ours.out, ours.warmup, ours.steps, count_step=ours.count_step)
    except (UserError, NoTrainerEquivalent) as err:
        raise SystemExit(f"error: {err}") from err
    ours.out.mkdir(parents=True, exist_ok=True)
    files.write_text(ours.out / PEER_JSON, json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
