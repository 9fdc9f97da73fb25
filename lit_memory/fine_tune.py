"""A fine-tune, told top to bottom: what `lit_memory.cli.LitMemoryCLI`'s hooks do, in the order they run.

1. `check_settings`: the settings as parsed (a resumed checkpoint's hyper-parameters merged in), checked and
   derived once, in order: refusals, the trainer, compile, the optimizer, predict's output file, the CPU
   fallback's precision, a LoRA base's precision.
2. `enter_run`: the seed, the lines kept while parsing, the allocator's and NCCL's settings on CUDA.
3. `read_data` (``fit``): the run's data module, built from its settings and read once; what the labels show
   (``num_labels``, ``problem_type``, the label names) and the epochs a small file needs are written into the
   settings, so that the saved config and every checkpoint hold them. Lightning is handed this module
   (`LitMemoryCLI._data_module`): nothing reads the data a second time.
4. `plan`: ``auto`` settings (activation checkpointing, offload) resolved for the card the run trains on.
5. The model, the trainer and their callbacks: LightningCLI instantiates them from the settings as they now are.
6. The fit: the command line's preflight (the guard's checks of the run folder), Lightning's ``fit``.
7. The best model and the export: the module's ``on_fit_end`` restores the best validated checkpoint and writes
   ``hf_model/`` with its model card (`lit_memory.run.best`, `lit_memory.run.export`).
8. `after_fit`: the metrics of the step exported, printed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from lit_memory import console
from lit_memory.config.arguments import config_files
from lit_memory.config.shipped import recipes_dir
from lit_memory.console import say
from lit_memory.data import BUNDLED, TextClassificationData
from lit_memory.errors import UserError
from lit_memory.hf.lora import LoRA
from lit_memory.memory.hardware import nccl
from lit_memory.memory.hardware.allocator import recipe_settings
from lit_memory.optim import optimizers
from lit_memory.optim.precision import cpu_fallback, runs_on_cpu
from lit_memory.planning.prediction.step import ranks
from lit_memory.planning.recompute import resolve_auto
from lit_memory.run import checks, predict_file, training_length
from lit_memory.run.best import best_of
from lit_memory.sandbox import bounds
from lit_memory.settings import Precision, dotted_leaves, to_plain

# Every step takes the run's `lit_memory.cli.LitMemoryCLI` (``cli``: its settings, notes and memory settings); typed
# `Any`: the command line imports this module, not the other way.

LENGTH_SETTINGS = {"trainer.max_epochs", "trainer.max_steps"}


# -- 1. settings ---------------------------------------------------------------------------------------------


def check_settings(cli: Any) -> None:
    """The settings checked before anything is built, and the few derived from them, each once, in this order."""
    settings = cli.settings
    cli.check_values()  # again: a resumed checkpoint's hyper-parameters are merged in by now
    # As configured, before the CPU fallback below may change the precision.
    checks.check_trainer(settings.trainer)
    checks.check_compile(settings.model, settings.data)
    optimizers.check_settings(settings.model.optimizer, settings.trainer.precision,
                              not runs_on_cpu(settings.trainer.accelerator))
    if cli.config.get("subcommand") == "predict":  # the file, beside the model unless --output names one
        settings.predictions.output, settings.predictions.format = map(str, predict_file.destination_of(settings))
    if settings.cpu_bf16_fallback:
        settings.trainer.precision, warning = cpu_fallback(settings.trainer.precision, settings.trainer.accelerator)
        if warning:  # said when the run is built (`enter_run`): a confined run is parsed here twice
            cli.notes.append(warning)
    lora, trains_with = settings.model.get("lora"), Precision.known(settings.trainer.precision)
    if lora is not None and trains_with is not None:  # a LoRA base the precision cannot train, before anything is built
        LoRA(**to_plain(lora)).check_precision(trains_with)


# -- 2. the process ------------------------------------------------------------------------------------------


def enter_run(cli: Any, held: Any) -> None:
    """The seed, the lines kept while parsing (said here: a confined run is parsed twice, judged then run), and on
    CUDA the recipe's allocator settings (before anything allocates, and before the plan predicts with them) and a
    small tier's NCCL buffers (before any process group starts; the run's own processes inherit them), entered
    into ``held``."""
    cli._set_seed()  # once: a deferred run (`lit_memory.cli.resolve`) seeds when it is built
    for line in cli.notes:
        say(line)
    cli.notes = []
    if runs_on_cpu(cli.settings.trainer.accelerator):
        return
    warning = held.enter_context(recipe_settings(cli.memory.allocator))
    if warning:
        say(warning)
    setting, line = nccl.for_run(cli.memory.limit, world_size(cli.settings.trainer))
    if setting:
        held.enter_context(nccl.run_settings(setting))
        say(line)


# -- 3. the data, read once ----------------------------------------------------------------------------------


def read_data(cli: Any, build: Any) -> Optional[TextClassificationData]:
    """``fit``: the run's data module (``build(settings)`` makes it as Lightning would), read where the settings
    leave ``model.num_labels`` or ``model.problem_type`` to the labels, or where the run's length is not the user's
    and the data is theirs (enough epochs for `training_length.MIN_STEPS` optimizer steps). What it finds is
    written into the settings and the module's own; the module is the one the run trains with."""
    settings = cli.settings
    model, data, trainer = settings.model, settings.data, settings.trainer
    module = build(data)
    task_unset = model.num_labels is None or model.problem_type is None
    floor = data.source != BUNDLED and settings.get("ckpt_path") is None and not length_is_users(cli)
    accumulate = trainer.accumulate_grad_batches if isinstance(trainer.accumulate_grad_batches, int) else 1
    world = world_size(trainer) if floor else 1

    def length(rows: int) -> training_length.Length:
        return training_length.floor(rows, data.batch_size, accumulate, world, trainer.max_epochs)

    if floor and not task_unset and length(module.rows_at_most()).raised_from is None:
        return module  # a file large enough: the task is set, nothing to learn from the rows before the fit
    if not (task_unset or floor):
        return module
    splits = module.load_splits()
    found = module.task
    if task_unset:
        model.num_labels = data.num_labels = found.num_labels
        model.problem_type = data.problem_type = found.problem_type
        if found.label_names and not data.label_names:
            data.label_names = list(found.label_names)
        module.take_task(found)
    if floor:
        needed = length(len(splits["train"]))
        if needed.raised_from is not None:
            trainer.max_epochs = needed.epochs
            module.epochs_raised_from = needed.raised_from  # said in its data: line
    return module


def length_is_users(cli: Any) -> bool:
    """Whether the user set how long to train: ``trainer.max_epochs`` or ``trainer.max_steps`` on the command line
    or in a config file of their own (a shipped recipe's one epoch is sized for the bundled demo)."""
    if cli.argv is None:
        return True  # a config object: its values are its author's
    if LENGTH_SETTINGS & set(cli.typed_settings):
        return True
    shipped = {recipes_dir().resolve()}
    for path in config_files(cli.argv):
        if Path(path).resolve().parent in shipped or not Path(path).is_file():
            continue
        try:
            values = dict(dotted_leaves(bounds.read_yaml(Path(path)), depth=2))
        except UserError:
            return True  # unreadable here: the parse will say why; nothing is decided for it
        if LENGTH_SETTINGS & set(values):
            return True
    return False


# -- 4. the plan ---------------------------------------------------------------------------------------------


def plan(cli: Any, training: bool) -> None:
    """``auto`` settings planned, the plan written in their place: the saved config and checkpoints hold it."""
    for key, value in resolve_auto(cli.settings, cli.memory, training, cli.step, lambda: cli.read_card()).items():
        cli.settings[key] = value


# -- 6. the fit, and 8. after it -----------------------------------------------------------------------------


def after_fit(cli: Any) -> None:
    """The metrics of the step exported (`lit_memory.console.print_fit_metrics`)."""
    console.print_fit_metrics(cli.trainer, cli.model, best_of(cli.trainer))


def world_size(trainer: Any) -> int:
    """The processes a run's trainer settings start: devices per node (``auto`` or -1 on CUDA: every GPU this
    machine has, counted without starting CUDA) times nodes."""
    available = None if runs_on_cpu(trainer.accelerator) else torch.cuda.device_count()  # as its plan counts
    return ranks(trainer.devices, available) * int(trainer.num_nodes or 1)
