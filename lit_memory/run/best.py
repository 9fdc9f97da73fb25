"""The best validated model, kept and exported: Hugging Face's ``load_best_model_at_end`` for Lightning.

`BestCheckpoint` is Lightning's `ModelCheckpoint` keeping the one checkpoint (weights only) that scores best on
validation: by default the problem type's main metric (single-label ``val_f1_macro``, regression ``val_pearson``,
multi-label ``val_f1_micro``), or ``monitor`` as Lightning takes it. Its state (the best path and score, the best
step's metrics and per-class counts, the last step validated) travels in the run's checkpoints, so a resumed run keeps
the best of before. At the end of ``fit`` the module exports ``hf_model/`` from it (`restore_best`, which hands the
module back its decisions saved there: the tuned thresholds), the log names the step and the score, and the closing
``val:`` line, per-class report and model card are that step's (`best_of`). `EarlyStop` stops on the same metric.

`ValidationStep` gives the run one step numbering: Lightning logs a validation's metrics at its count of the batches
that stepped, one short of the steps taken after a step (``metrics.csv``: step 55) while checkpoints and progress lines
name the steps taken (``best-step=56``); the metrics of a validation are logged at the steps taken, as every name says
them (a row's step in ``metrics.csv`` is always "the weights after N optimizer steps").
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Literal, Optional

import lightning as L
import torch
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from lit_memory.console import say
from lit_memory.errors import UserError

# Metrics where less is better; anything else is taken as more is better.
LOWER_IS_BETTER = re.compile(r"(^|_)(loss|mse|mae|rmse|error)($|_)")


def mode_of(monitor: str) -> Literal["min", "max"]:
    return "min" if LOWER_IS_BETTER.search(monitor) else "max"


class BestCheckpoint(ModelCheckpoint):
    """Keep the checkpoint that scores best on validation (weights only), for ``hf_model/``.

    Args:
        monitor: the logged metric (``val_acc``, ``val_mcc``, ``val_loss``); null: the problem type's main metric.
        mode: ``max`` or ``min``; null: ``min`` for losses and errors (``val_loss``, ``val_mse``), else ``max``.
        filename: the file's name in the run's ``checkpoints/`` folder (Lightning's format fields).

    The record is kept at the end of every validation, also of one that ends an epoch (Lightning's `ModelCheckpoint`
    would wait for the epoch's end there): the resume checkpoint written again right after a validation
    (`lit_memory.run.resume.ResumeCheckpoint`) must hold it, or a run resumed from it exports another step.
    """

    def __init__(
        self, monitor: Optional[str] = None, mode: Optional[Literal["max", "min"]] = None,
        filename: str = "best-step={step}", **kwargs: Any,
    ) -> None:
        if kwargs.pop("save_on_train_epoch_end", None):
            raise UserError(
                "BestCheckpoint keeps the best at each validation's end: save_on_train_epoch_end must be false"
            )
        super().__init__(
            monitor=monitor or "val_best_placeholder", mode=mode or (mode_of(monitor) if monitor else "max"),
            filename=filename, save_top_k=1, save_weights_only=True, save_last=False, auto_insert_metric_name=False,
            save_on_train_epoch_end=False, **kwargs,
        )
        self._monitor_given, self._mode_given = monitor, mode
        self.best_metrics: dict[str, float] = {}  # the best validation's metrics (``val_*``)
        # its confusion counts (`lit_memory.task.evaluation.ClassCounts`), as lists
        self.best_counts: Optional[list] = None
        self.validated_step: Optional[int] = None  # the step of the last validation seen

    @property
    def state_key(self) -> str:  # one of its kind beside the run's other checkpoint callbacks, whatever it monitors
        return "BestCheckpoint"

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # Lightning warns that the folder changed and restores the path alone: `load_state_dict` takes the rest.
        warnings.filterwarnings("ignore", message=r"The dirpath has changed from")

    def watches(self, pl_module: L.LightningModule) -> tuple[str, Literal["max", "min"]]:
        """The metric and mode this checkpoint keeps the best by, for ``pl_module``."""
        monitor = self._monitor_given or f"val_{getattr(pl_module, 'main_metric', 'loss')}"
        return monitor, self._mode_given or mode_of(monitor)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._monitor_given is None:
            self.monitor, mode = self.watches(pl_module)
            if mode != self.mode:
                self.mode = mode
                # Lightning's own start for a mode (private, read in 2.6)
                self._ModelCheckpoint__init_monitor_mode(mode)
        if not trainer.limit_val_batches or trainer.val_check_batch == float("inf"):
            self.save_top_k = 0  # nothing is validated: nothing to keep (the last weights are exported)
        super().setup(trainer, pl_module, stage)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "best_metrics": dict(self.best_metrics), "best_counts": self.best_counts,
                "validated_step": self.validated_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed run (a new run folder) keeps the best of before, wherever its file is: Lightning restores only
        the path when the folder changed, and the resumed run would then export the best of after the resume."""
        super().load_state_dict(state_dict)
        for key in ("best_model_score", "kth_best_model_path", "kth_value", "best_k_models", "best_metrics",
                    "best_counts", "validated_step"):
            if key in state_dict:
                setattr(self, key, state_dict[key])

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        # A better model replaces the best of before, whose file may be in an earlier run's folder: left there.
        if self.dirpath and Path(filepath).resolve().parent == Path(self.dirpath).resolve():
            super()._remove_checkpoint(trainer, filepath)

    def _save_topk_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict) -> None:
        if self.monitor not in monitor_candidates:
            return  # no validation yet (a step-triggered save): kept at the next validation
        self.validated_step = trainer.global_step
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _update_best_and_save(self, current: Any, trainer: L.Trainer, monitor_candidates: dict) -> None:
        # A new best (one is kept): its metrics and per-class counts, for the closing val: line and report.
        self.best_metrics = {k: float(v) for k, v in monitor_candidates.items() if k.startswith("val_")}
        counts = getattr(trainer.lightning_module, "validation_counts", None)
        self.best_counts = counts.tolist() if counts is not None else None
        super()._update_best_and_save(current, trainer, monitor_candidates)

    def best_step(self) -> Optional[int]:
        found = re.search(r"step=(\d+)", Path(self.best_model_path).name) if self.best_model_path else None
        return int(found[1]) if found else None


def best_of(trainer: L.Trainer) -> Optional[BestCheckpoint]:
    """The run's `BestCheckpoint` holding a checkpoint, if any."""
    found = [c for c in trainer.callbacks if isinstance(c, BestCheckpoint) and c.best_model_path]
    return found[0] if found else None


def restore_best(trainer: L.Trainer) -> Optional[str]:
    """Load the best checkpoint's weights into the trained module (through the strategy: sharded checkpoints
    included); returns one line saying which weights these are, or None where there is no best checkpoint."""
    best = best_of(trainer)
    if best is None:
        return None
    path = Path(best.best_model_path)
    if path.is_dir():  # a sharded checkpoint (FSDP2): each rank loads its shards into the module in place
        checkpoint = _load_checkpoint(path, {"state_dict": trainer.strategy.model}, strict=True, weights_only=True)
    else:
        checkpoint = trainer.strategy.checkpoint_io.load_checkpoint(path, weights_only=True)
        trainer.strategy.load_model_state_dict(checkpoint, strict=True)
    trainer.lightning_module.on_load_checkpoint(checkpoint)  # what the module saved beside its weights (thresholds)
    score = float(best.best_model_score) if best.best_model_score is not None else float("nan")
    return f"the best validated weights: step {best.best_step()}, {best.monitor}={score:.4f}"


class ValidationStep(Callback):
    """A validation's metrics logged at the optimizer steps taken before it (what checkpoint names, progress lines
    and the hf_model line say), not Lightning's count of the batches that stepped before the last one (module
    docstring), through Lightning's public way to name a row's step: a logged ``step`` metric."""

    def __init__(self) -> None:
        self._logged = False

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's LoggerConnector.log_metrics takes a logged "step" as the row's step, and then adds no "epoch".
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            pl_module.log("step", float(trainer.global_step), sync_dist=True)  # the same on every rank
            pl_module.log("epoch", float(trainer.current_epoch), sync_dist=True)
            self._logged = True

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        # Not metrics: left in the callback metrics, they would name the checkpoints written at the next steps
        # (a ModelCheckpoint takes "step" and "epoch" from there before the trainer's own).
        if self._logged:
            self._logged = False
            for key in ("step", "epoch"):
                trainer.callback_metrics.pop(key, None)


class EarlyStop(EarlyStopping):
    """Lightning's `EarlyStopping` on the metric the best checkpoint keeps (`BestCheckpoint`: by default the problem
    type's main one), off unless ``patience`` is set: ``--early_stopping.patience 3``.

    Args:
        patience: validations in a row without improvement after which ``fit`` stops; null: never stop early.
        min_delta: the least change that counts as an improvement.

    It counts at the end of every validation, as `BestCheckpoint` keeps its record (not at the epoch's end, where
    Lightning would count a validation that ends an epoch): the checkpoint written right after the validation holds
    the count, and a run resumed from it stops where the uninterrupted run stops.
    """

    def __init__(self, patience: Optional[int] = None, min_delta: float = 0.0) -> None:
        if patience is not None and (isinstance(patience, bool) or patience < 1):
            raise UserError(
                f"early_stopping.patience must be a number of validations >= 1 (or null: off), got {patience}"
            )
        if min_delta < 0:
            raise UserError(f"early_stopping.min_delta must be >= 0, got {min_delta}")
        super().__init__(monitor="val_best_placeholder", patience=patience or 1, min_delta=min_delta, mode="max",
                         check_on_train_epoch_end=False)
        self.enabled = patience is not None

    @property
    def state_key(self) -> str:  # one of its kind, whatever it monitors
        return "EarlyStop"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        best = next((c for c in trainer.callbacks if isinstance(c, BestCheckpoint)), BestCheckpoint())
        monitor, mode = best.watches(pl_module)
        if (monitor, mode) != (self.monitor, self.mode):
            self.monitor, self.mode = monitor, mode
            self.min_delta = abs(self.min_delta) * (1 if mode == "max" else -1)
            self.best_score = torch.tensor(-torch.inf if mode == "max" else torch.inf)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled:
            super().on_validation_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.enabled and self.stopped_epoch and trainer.is_global_zero:
            say(
                f"early stopping: {self.monitor} did not improve by more than {abs(self.min_delta):g} for "
                f"{self.patience} validation(s); stopped at step {trainer.global_step} (epoch {self.stopped_epoch + 1})"
            )
