"""What a run prints while it runs: progress as plain lines where the output is not a terminal, and the model
summary without a column of zeros.

- `LogProgress`: Lightning draws its rich progress bar only on a terminal; in a log file (nohup, SLURM, CI) it
  leaves nothing until the end. Off a terminal the CLI installs this progress "bar" instead: one line every
  ``interval`` seconds (and at the first step and the end) with the optimizer step of the total, the epoch, the
  loss (the mean since the last line), samples per second and the time left (from the steps after the first,
  which pays for warm-up: allocation, compilation, caches), and the memory peak; a line per validation with its
  metrics; and evaluation/prediction batches every ``interval`` seconds. On a terminal (or in a notebook) the rich
  bar stays.
- `ModelSummary`: Lightning 2.6's summary prints a FLOPs column and "Total FLOPs: 0" unless the module has an
  ``example_input_array``, which would run a forward at every fit's start (a collective under FSDP, on rank 0
  only). lit_memory counts a step's FLOPs itself (``estimate``, the recipe headers), so the summary leaves the
  zeros out; it is a rich table on a terminal and plain text in a log.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_summary.model_summary import (
    _format_summary_table,
    get_formatted_model_size,
    get_human_readable_count,
)

from lit_memory import errors
from lit_memory.errors import UserError
from lit_memory.memory.measure.footprint import format_bytes
from lit_memory.memory.measure.tracker import ProcessPeak

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")

DEFAULT_INTERVAL = 30.0  # seconds: a few lines a minute in a log, even for a 5-minute run


def interactive(stream: Any = None) -> bool:
    """Whether the output is a terminal a progress bar can redraw (or a notebook): what rich decides for
    Lightning's bar (``TTY_COMPATIBLE``/``FORCE_COLOR`` included), else whether stdout is a TTY."""
    try:  # deferred: rich is optional (Lightning's progress-bar extra); without it, stdout's TTY flag decides
        from rich.console import Console
    except ImportError:
        stream = stream or sys.stdout
        return bool(getattr(stream, "isatty", lambda: False)())
    console = Console(file=stream) if stream is not None else Console()
    return console.is_jupyter or console.is_interactive


class LogProgress(ProgressBar):
    """Training progress as a line every ``interval`` seconds, for logs (`interactive` is false).

    Args:
        interval: seconds between progress lines (training, evaluation and prediction batches alike).
    """

    def __init__(self, interval: float = DEFAULT_INTERVAL) -> None:
        super().__init__()
        if not interval > 0 or math.isinf(interval):
            raise UserError(f"progress.interval must be a number of seconds > 0, got {interval}")
        self.interval = interval
        self._enabled = True
        self._started = self._last = 0.0
        self._samples = 0
        self._first_step = 0
        self._warm: Optional[tuple[float, int, int]] = None  # (time, step, samples) when the first step was done
        self._loss: Optional[float] = None  # the module's mean training loss, at the last line
        self._shown = False
        self._eval_batches = 0
        self._eval_samples = 0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **kwargs)

    def _line(self, text: str) -> None:
        if self._enabled:
            print(text, flush=True)

    # -- training --------------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        self._started = self._last = time.monotonic()
        self._samples = 0
        self._first_step = trainer.global_step
        self._warm = self._loss = None
        self._shown = False
        if isinstance(getattr(pl_module, "progress_loss", None), RunningLoss):
            pl_module.progress_loss.mean()  # from this fit's first step on

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._samples += batch_size(batch) * trainer.world_size
        now = time.monotonic()
        if self._warm is None and trainer.global_step > self._first_step:
            self._warm = (now, trainer.global_step, self._samples)
        first = not self._shown and trainer.global_step > self._first_step  # a line once training is under way
        if first or now - self._last >= self.interval:
            self._last, self._shown = now, True
            self._line(self.train_line(trainer, now, module=pl_module))

    def on_train_end(self, trainer, pl_module) -> None:
        self._line(self.train_line(trainer, time.monotonic(), done=True, module=pl_module))

    def train_line(self, trainer, now: float, done: bool = False, module: Any = None) -> str:
        """The progress line: the loss is the mean over the steps since the last line (the module's `progress_loss`,
        else what Lightning's progress bar shows); speed and time left are measured over the steps after the first
        (warm-up), where there are any."""
        step, total = trainer.global_step, trainer.estimated_stepping_batches
        elapsed = now - self._started
        parts = [
            f"train step {step}/{_count(total)}" + (f" ({100 * step / total:.0f}%)" if _finite(total) and total else "")
        ]
        epochs = total_epochs(trainer)
        epoch = trainer.current_epoch + 1  # after the last epoch Lightning has counted it: not one more
        parts.append(f"epoch {min(epoch, epochs) if epochs else epoch}/{epochs or '?'}")
        losses = getattr(module, "progress_loss", None)
        if isinstance(losses, RunningLoss):
            mean = losses.mean()
            self._loss = float(mean) if mean is not None else self._loss  # no step since the last line: its loss
        loss = self._loss if self._loss is not None else _loss(trainer.progress_bar_metrics)
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        warm_at, warm_step, warm_samples = self._warm or (now, step, self._samples)
        warmed = step > warm_step and now > warm_at and not done  # steps measured after the first (the end: all)
        seconds, samples = (now - warm_at, self._samples - warm_samples) if warmed else (elapsed, self._samples)
        if seconds > 0:
            parts.append(f"{samples / seconds:.1f} samples/s")
        if done:
            parts.append(f"took {_duration(elapsed)}")
        elif _finite(total) and warmed:
            parts.append(f"ETA {_duration((now - warm_at) / (step - warm_step) * max(total - step, 0))}")
        parts.append(memory_peak(trainer.strategy.root_device))
        return " | ".join(parts)

    # -- validation, test, predict ----------------------------------------------------------------

    def _eval_start(self) -> None:
        self._eval_started = self._last = time.monotonic()
        self._eval_batches = self._eval_samples = 0

    def _eval_batch(self, trainer, what: str, batch: Any, totals: Any, dataloader_idx: int) -> None:
        total = totals[dataloader_idx] if isinstance(totals, list) and dataloader_idx < len(totals) else None
        self._eval_batches += 1
        self._eval_samples += batch_size(batch) * trainer.world_size
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            rate = self._eval_samples / max(now - self._eval_started, 1e-9)
            self._line(
                f"{what} batch {self._eval_batches}/{_count(total)} | {rate:.1f} samples/s | "
                f"{memory_peak(trainer.strategy.root_device)}"
            )

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._eval_start()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self._eval_batch(trainer, "validation", batch, trainer.num_val_batches, dataloader_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.state.fn == "fit":
            return
        metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
        shown = " ".join(f"{k}={float(v):.4f}" for k, v in sorted(metrics.items()))
        self._line(
            f"validation at step {trainer.global_step} (epoch {trainer.current_epoch + 1}): {shown}".rstrip(": ")
        )
        self._last = time.monotonic()

    def on_test_start(self, trainer, pl_module) -> None:
        self._eval_start()

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_batch(trainer, "test", batch, trainer.num_test_batches, dataloader_idx)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._eval_start()

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_batch(trainer, "predict", batch, trainer.num_predict_batches, dataloader_idx)


class RunningLoss:
    """The training loss summed where it is computed (on the device) since it was last read: adding is two operators
    on the device and no synchronisation; `mean` copies the mean to the host once, on the steps the progress is read.
    Lightning's ``self.log(..., prog_bar=True)`` of a device tensor every step would read it back (``.item()``, a
    device synchronisation) at every batch."""

    def __init__(self) -> None:
        self._sum: Optional[torch.Tensor] = None
        self._count = 0

    def add(self, loss: torch.Tensor) -> None:
        loss = loss.detach()
        self._sum = loss if self._sum is None else self._sum + loss
        self._count += 1

    def mean(self) -> Optional[torch.Tensor]:
        """The mean since the last read, on the host (a 0-d CPU tensor), and a fresh start; None if nothing was
        added."""
        if self._sum is None:
            return None
        mean = (self._sum.float() / self._count).cpu()
        self._sum, self._count = None, 0
        return mean


def logging_step(trainer) -> bool:
    """Whether the optimizer step just taken (asked in ``on_train_batch_end``) is one the loggers write: every
    ``trainer.log_every_n_steps`` optimizer steps, Lightning's cadence for logged metrics."""
    every = trainer.log_every_n_steps
    return bool(every) and trainer.global_step % every == 0


def total_epochs(trainer) -> Optional[int]:
    """The epochs this fit will run: ``max_epochs``, or fewer where ``max_steps`` ends it first; None if unknown."""
    limits = []
    if _finite(trainer.max_epochs) and trainer.max_epochs > 0:
        limits.append(int(trainer.max_epochs))
    per_epoch = trainer.num_training_batches
    if _finite(trainer.max_steps) and trainer.max_steps > 0 and _finite(per_epoch) and per_epoch > 0:
        steps_per_epoch = max(math.ceil(per_epoch / trainer.accumulate_grad_batches), 1)
        limits.append(math.ceil(trainer.max_steps / steps_per_epoch))
    return min(limits) if limits else None


def batch_size(batch: Any) -> int:
    """Rows in a batch of tensors (a dict's first tensor's first dimension)."""
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else [batch]
    for value in values:
        if isinstance(value, torch.Tensor) and value.ndim:
            return int(value.shape[0])
    return 0


def memory_peak(device: torch.device) -> str:
    """The memory peak so far, named for what it is: the CUDA allocator's (tensors), else the process's RSS."""
    if device.type == "cuda":
        return f"peak {format_bytes(torch.cuda.max_memory_allocated(device))} allocated (cuda)"
    return f"peak RSS {format_bytes(ProcessPeak().peak)}"


def _loss(metrics: dict[str, Any]) -> Optional[float]:
    for name in ("train_loss", "loss"):
        if name in metrics:
            return float(metrics[name])
    return next((float(v) for k, v in metrics.items() if "loss" in k and k.startswith("train")), None)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _count(value: Any) -> str:
    return str(int(value)) if _finite(value) else "?"


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class ModelSummary(LightningModelSummary):
    """Lightning's model summary, without the FLOPs column and total where it counted none (see the module's
    docstring); a rich table on a terminal, plain text in a log."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if not total_flops:
            summary_data = [(name, values) for name, values in summary_data if name != "FLOPs"]
        totals = [
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
        ]
        if total_flops:
            totals.append(("Total FLOPs", get_human_readable_count(total_flops)))
        if interactive():
            # deferred: rich is optional (Lightning's progress-bar extra); only a terminal's table needs it
            from rich import get_console
            from rich.table import Table

            table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
            for name, _ in summary_data:
                table.add_column(name, justify="right" if name in ("Params", "Params per Device", "FLOPs") else "left",
                                 style="dim" if name == " " else None, no_wrap=name == "Name")
            for row in zip(*(values for _, values in summary_data)):
                table.add_row(*row)
            get_console().print(table)
            grid = Table.grid(expand=True)
            for name, value in totals:
                grid.add_row(f"[bold]{name}[/]: {value}")
            get_console().print(grid)
            return
        text = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, total_flops, *summary_data
        )
        if not total_flops:
            text = text.rsplit("\n", 1)[0]  # "0 Total Flops", Lightning's last line
        log.info("\n" + text)


def forced_callbacks(config: dict[str, Any], callbacks: list) -> list:
    """The callbacks every run gets besides its own (``callbacks``, LightningCLI's forced ones), where they apply:
    progress lines (`LogProgress`) only off a terminal, with the progress bar on and none of the user's own; the
    model summary (`ModelSummary`) unless turned off or the user configured one, standing in for Lightning's
    default (``config``'s ``enable_model_summary`` is turned off then)."""
    given = config.get("callbacks") or []
    given = given if isinstance(given, list) else [given]
    progress = [c for c in callbacks if isinstance(c, LogProgress)]
    callbacks = [c for c in callbacks if not isinstance(c, LogProgress)]
    if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
        if not interactive():
            callbacks += progress
    if config.get("enable_model_summary") is not False and not any(isinstance(c, LightningModelSummary) for c in given):
        callbacks.append(ModelSummary())
        config["enable_model_summary"] = False
    return callbacks


def print_metrics(trainer: Any, stage: str, metrics: Optional[Mapping[str, Any]] = None, label: str = "") -> None:
    """One line of the stage's metrics (``val``, ``test``; default: the last evaluation's) from the global-zero
    process: ``val: acc=0.8751 f1=...`` (``label`` after the stage: ``val at the last validation (step 130, not
    exported)``)."""
    if not trainer.is_global_zero:
        return
    metrics = trainer.callback_metrics if metrics is None else metrics
    shown = {k: float(v) for k, v in metrics.items() if k.startswith(f"{stage}_")}
    if shown:
        print(f"{stage}{label}: " + "  ".join(f"{k[len(stage) + 1:]}={v:.4f}" for k, v in sorted(shown.items())))


def print_fit_metrics(trainer: Any, module: Any, best: Any) -> None:
    """The end of a fit: the metrics of the model exported to ``hf_model/`` (the best validated step,
    `lit_memory.run.best.BestCheckpoint`), its per-class report, and, where the last validation was another step, the
    last one's, named as such; the closing ``val:`` line is the exported model's. ``best``: the run's
    `lit_memory.run.best.BestCheckpoint` holding a checkpoint (`lit_memory.run.best.best_of`), or None."""
    if best is None or not best.best_metrics:  # nothing validated kept a best: the last weights were exported
        print_metrics(trainer, "val")
        return
    step = best.best_step()
    if best.validated_step is not None and best.validated_step != step:
        print_metrics(trainer, "val", label=f" at the last validation (step {best.validated_step}, not exported)")
    report = getattr(module, "report_evaluation", None)
    if best.best_counts is not None and report is not None:
        report("val", torch.tensor(best.best_counts), f" at step {step}, exported to hf_model")
    print_metrics(trainer, "val", best.best_metrics)


def print_predict_metrics(trainer: Any, module: Any) -> None:
    """Lightning keeps no metrics for predict: the module computed them where the inputs had labels."""
    results = getattr(module, "predict_results", None)
    if results and trainer.is_global_zero:
        print("predict: " + "  ".join(f"{k.removeprefix('predict_')}={v:.4f}" for k, v in sorted(results.items())))


def say(line: str) -> None:
    """A line on stderr from the process of global rank 0 only: Lightning's launcher runs a command again for every
    other rank (``LOCAL_RANK``/``RANK`` set), which would repeat it once per process."""
    if rank_zero_only.rank == 0:
        for part in line.splitlines():  # a warning may quote a recipe's value: its escape sequences shown
            print(errors.shown(part), file=sys.stderr)
