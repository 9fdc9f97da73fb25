"""Checkpoints: which checkpoint a sent recipe may name for a run to load (`checkpoint_refusals`), and how often and how
many a run's checkpoint callbacks together may save (`checkpoint_load`, `save_budget`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, Optional

from lit_memory.errors import UserError
from lit_memory.policy.reads import is_remote
from lit_memory.policy.refusal import NOTHING, Context, Refusal, register

# Lightning's own names for checkpoints it finds itself.
SPECIAL_CKPT = ("last", "best", "hpc")
# Settings naming a folder Lightning picks a checkpoint from by itself (SLURM's hpc checkpoint in the root folder, an
# OnExceptionCheckpoint's in its dirpath): one the user typed is theirs (`lit_memory.sandbox.guard.preflight`).
PICKED_FROM = ("default_root_dir", "dirpath")
MIN_CHECKPOINT_STEPS = 50  # on average, over every callback: at most one checkpoint per this many optimizer steps
MAX_KEPT_CHECKPOINTS = 10  # kept at once, over every callback


def checkpoint_load(trainer: Any, exempt: Callable[[Any], bool] = lambda c: False) -> Optional[str]:
    """Why the run's checkpoint callbacks, together, would save too often or keep too many, or None.
    Each callback's interval in optimizer steps (``every_n_train_steps``, or ``every_n_epochs`` times the
    optimizer steps of an epoch, known once the training data is loaded); the saves over the run
    (``max_steps``, else ``max_epochs`` epochs) may exceed one per callback by at most one per
    `MIN_CHECKPOINT_STEPS` steps. ``exempt``: callbacks the user typed, and lit_memory's own."""
    callbacks = [c for c in trainer.checkpoint_callbacks if not exempt(c)]
    if not callbacks:
        return None
    batches = trainer.num_training_batches
    finite = batches not in (None, float("inf"))
    per_epoch = max(1, int(batches) // max(1, trainer.accumulate_grad_batches)) if finite else None
    if trainer.max_steps and trainer.max_steps > 0:
        total = trainer.max_steps
    elif per_epoch is not None and trainer.max_epochs is not None and trainer.max_epochs >= 0:
        total = per_epoch * trainer.max_epochs
    else:
        total = None  # endless: every cadence counts
    saves, kept, rate = 0.0, 0, 0.0
    for c in callbacks:
        steps = getattr(c, "_every_n_train_steps", 0) or 0
        epochs = getattr(c, "_every_n_epochs", 0) or 0
        interval = steps if steps > 0 else (epochs * per_epoch if epochs > 0 and per_epoch else None)
        copies = 2 if c.save_last is True else 1  # last.ckpt written again beside each save (a link costs nothing)
        if interval:
            rate += copies / interval
            saves += copies * (total // interval if total is not None else float("inf"))
        top_k = c.save_top_k if c.monitor is not None else min(c.save_top_k, 1)
        kept += (top_k if top_k >= 0 else MAX_KEPT_CHECKPOINTS + 1) + (1 if c.save_last is True else 0)
    if kept > MAX_KEPT_CHECKPOINTS:
        return (f"the checkpoint callbacks together keep {kept} checkpoints, more than {MAX_KEPT_CHECKPOINTS} "
                "(save_top_k and save_last summed over trainer.callbacks)")
    allowed = len(callbacks) + (total // MIN_CHECKPOINT_STEPS if total is not None else 0)
    if rate * MIN_CHECKPOINT_STEPS > 1 and saves > allowed:
        return (f"the checkpoint callbacks together save a checkpoint every {1 / rate:.1f} optimizer steps "
                f"({'endlessly' if total is None else f'{saves:.0f} times in {total} steps'}), more often than every "
                f"{MIN_CHECKPOINT_STEPS} (every_n_train_steps, every_n_epochs x steps per epoch, summed over "
                "trainer.callbacks)")
    return None


def save_budget(step: int, callbacks: int) -> int:
    """How many checkpoints a run may have saved by optimizer step ``step`` over its ``callbacks`` counted
    checkpoint callbacks: two per callback (a save and last.ckpt's copy) and two more (a batch-size finder's, an
    exception's), plus two per `MIN_CHECKPOINT_STEPS` steps."""
    return 2 * callbacks + 2 + 2 * (step // MIN_CHECKPOINT_STEPS)


def checkpoint_refusals(
    ckpt_path: Any, typed: bool = False, approved: Callable[[Any], bool] = lambda path: False,
    problem: Callable[[Any], Optional[str]] = lambda path: None,
) -> list[Refusal]:
    """Refusals for a ``ckpt_path`` as Lightning resolves it: a path relative to the working folder,
    a URL or fsspec chain, a model registry name, or one of Lightning's special names. What a path
    points at is never the user's: checked wherever it was set, unless a config the user trusted named it (its content
    approved with the config: ``approved``). A single file is read by the resume check
    (`lit_memory.run.resume.check_resume`), weights-only."""
    if ckpt_path is None:
        return []
    ckpt_path = str(ckpt_path)
    if ckpt_path in SPECIAL_CKPT:
        if typed:
            return []  # the user's own choice: what Lightning finds is checked then (`guard.preflight`)
        return [Refusal("ckpt_path", ckpt_path, "Lightning would pick the checkpoint itself, in folders the recipe "
                        f"chose: name one with --ckpt_path PATH (or type --ckpt_path {ckpt_path} yourself)")]
    if ckpt_path.startswith("registry:"):
        return [Refusal("ckpt_path", ckpt_path, "it downloads a model from Lightning's model registry")]
    if is_remote(ckpt_path):
        return [Refusal("ckpt_path", ckpt_path,
                        "it is not a local file or folder: download it and pass the local path")]
    path = Path(ckpt_path).expanduser()
    if not path.exists():
        raise UserError(f"checkpoint not found: {ckpt_path} (a relative path is read from {Path.cwd()})")
    if approved(path):  # named by a config the user trusted, whose content they approved with it
        return []
    if problem := problem(path):
        return [Refusal("ckpt_path", ckpt_path, problem)]
    return []


@register("parse", exempt_typed=False, reads=True)
def checkpoint(context: Context) -> list[Refusal]:
    """The ``ckpt_path`` a run loads (`checkpoint_refusals`): what a path points at is judged wherever it was set."""
    ckpt_path = context.get("ckpt_path")
    return checkpoint_refusals(ckpt_path, typed=context.typed("ckpt_path", ckpt_path), approved=context.approved,
                               problem=context.checkpoint_problem)


@register("run")
def cadence(context: Context) -> list[Refusal]:
    """How often and how many the run's checkpoint callbacks together save: the running trainer's
    (`checkpoint_load`, ``context.exempt``: the user's callbacks and lit_memory's own), or from the settings alone how
    many the recipe's ModelCheckpoints keep together."""
    if context.trainer is not None:
        problem = checkpoint_load(context.trainer, context.exempt)
        return [Refusal("trainer.callbacks", NOTHING, problem, head="")] if problem else []
    if context.settings is None:
        return []
    from lightning.pytorch.callbacks import ModelCheckpoint

    kept = 0
    for _, spec in leaves_of_class(context, ModelCheckpoint):
        init = spec.get("init_args") or {}
        top_k = init.get("save_top_k", 1) if init.get("monitor") is not None else min(init.get("save_top_k", 1), 1)
        kept += (top_k if top_k >= 0 else MAX_KEPT_CHECKPOINTS + 1) + (1 if init.get("save_last") is True else 0)
    if kept > MAX_KEPT_CHECKPOINTS:
        return [Refusal("trainer.callbacks", NOTHING, f"the checkpoint callbacks together keep {kept} checkpoints, "
                                                      f"more than {MAX_KEPT_CHECKPOINTS}")]
    return []


@register("run")
def picked_by_lightning(context: Context) -> list[Refusal]:
    """A checkpoint Lightning would resume from by itself in a folder the recipe chose: an OnExceptionCheckpoint's
    file, SLURM's ``hpc_ckpt_N.ckpt`` in the run's root folder. From the settings alone; in the running trainer the
    guard refuses the one Lightning picks (`lit_memory.sandbox.guard.install`)."""
    if context.settings is None or context.trainer is not None:
        return []
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    found = []
    for key, callback in leaves_of_class(context, OnExceptionCheckpoint):
        init = callback.get("init_args") or {}
        file = Path(str(init.get("dirpath") or ".")) / f"{init.get('filename') or 'on_exception'}.ckpt"
        if file.exists():
            found.append(Refusal(key, NOTHING, f"{file} exists: fit would resume from it by itself (pass --ckpt_path "
                                               "to choose a checkpoint)"))
    root = Path(str(context.get("trainer.default_root_dir") or "."))
    for file in sorted(root.glob("hpc_ckpt_*.ckpt")) if root.is_dir() else []:
        found.append(Refusal("trainer.default_root_dir", NOTHING,
                             f"{file} exists: under SLURM, fit would resume from it by itself"))
    return found


def leaves_of_class(context: Context, base: type) -> list[tuple[str, Any]]:
    """(key, class spec) of every class spec in the settings naming a subclass of ``base`` (already
    imported by the parse that produced them)."""
    from lit_memory.settings import locate  # (torch: loaded by whoever has settings)

    found = []
    for key, value in context.leaves():
        if not key.endswith("class_path") or not isinstance(value, str) or "." not in value:
            continue
        module, _, name = value.rpartition(".")
        cls = getattr(importlib.import_module(module), name, None)
        if isinstance(cls, type) and issubclass(cls, base):
            spec_key = key.removesuffix(".class_path")
            container, last = locate(context.settings, spec_key)
            found.append((spec_key, container[last]))
    return found
