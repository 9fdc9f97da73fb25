"""What a run prints while it runs: progress lines off a terminal (the rich bar on one), the model summary without
Lightning's column of zero FLOPs. (A fit's progress lines themselves: tests/run/test_predict_file.py's shared fit.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from conftest import FAST
from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar

from lit_memory import console as console_module
from lit_memory.cli import LitMemoryCLI
from lit_memory.console import LogProgress, ModelSummary, interactive, total_epochs
from lit_memory.errors import UserError

SUMMARY = [
    (" ", ["0", "1"]),
    ("Name", ["val_metrics", "model"]),
    ("Type", ["MetricCollection", "BertForSequenceClassification"]),
    ("Params", ["0", "22.7 M"]),
    ("Mode", ["train", "train"]),
    ("FLOPs", ["0", "0"]),
]


def summarize(total_flops: int) -> None:
    ModelSummary.summarize(SUMMARY, 22_700_000, 22_700_000, 90.8, {"train": 131, "eval": 0}, total_flops)


def test_the_model_summary_leaves_out_flops_lightning_did_not_count(caplog, capsys, monkeypatch):
    with caplog.at_level(logging.INFO):
        summarize(0)
    text = caplog.text
    assert "BertForSequenceClassification" in text and "22.7 M" in text and "Trainable params" in text
    assert "FLOPs" not in text and "Flops" not in text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        summarize(12_000)
    assert "FLOPs" in caplog.text and "12.0 K" in caplog.text  # counted (an example_input_array): shown
    monkeypatch.setattr("lit_memory.console.interactive", lambda stream=None: True)  # a terminal: rich's table
    summarize(0)
    out = capsys.readouterr().out
    assert "BertForSequenceClassification" in out and "Total params" in out and "FLOPs" not in out


def test_a_terminal_keeps_the_rich_bar_and_a_log_gets_progress_lines(monkeypatch):
    args = [*FAST, "--trainer.enable_progress_bar=true", "--trainer.enable_model_summary=true", "--progress.interval=5"]
    monkeypatch.setattr(console_module, "interactive", lambda: False)
    callbacks = LitMemoryCLI(args=args, run=False).trainer.callbacks
    (progress,) = [c for c in callbacks if isinstance(c, LogProgress)]
    assert progress.interval == 5 and not any(isinstance(c, RichProgressBar) for c in callbacks)
    assert any(type(c) is ModelSummary for c in callbacks) and not any(
        isinstance(c, RichModelSummary) for c in callbacks
    )
    monkeypatch.setattr(console_module, "interactive", lambda: True)
    callbacks = LitMemoryCLI(args=args, run=False).trainer.callbacks
    assert any(isinstance(c, RichProgressBar) for c in callbacks) and not any(
        isinstance(c, LogProgress) for c in callbacks
    )
    # the progress bar turned off: neither
    callbacks = LitMemoryCLI(args=[*args, "--trainer.enable_progress_bar=false"], run=False).trainer.callbacks
    assert not any(isinstance(c, (RichProgressBar, LogProgress)) for c in callbacks)


def test_whether_output_is_a_terminal_is_rich_s_decision(monkeypatch, tmp_path):
    with open(tmp_path / "log", "w") as log:
        assert not interactive(log)
        monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich's switch for a terminal it cannot detect (CI runners)
        monkeypatch.setenv("TERM", "xterm")
        assert interactive(log)


def test_the_interval_is_checked_and_the_epochs_follow_max_steps():
    with pytest.raises(UserError, match="progress.interval must be a number of seconds > 0, got 0"):
        LogProgress(0)
    trainer = SimpleNamespace(max_epochs=-1, max_steps=10, num_training_batches=4, accumulate_grad_batches=2)
    assert total_epochs(trainer) == 5  # 2 optimizer steps an epoch
    trainer.max_epochs = 3
    assert total_epochs(trainer) == 3
    assert (
        total_epochs(
            SimpleNamespace(max_epochs=None, max_steps=-1, num_training_batches=float("inf"), accumulate_grad_batches=1)
        )
        is None
    )


def test_progress_lines_give_the_mean_loss_since_the_last_line_and_time_the_steps_after_the_first(monkeypatch, capsys):
    """A first step of 100 s (warm-up), then 10 s steps: the time left follows the 10 s steps, and each line's loss is
    the mean of the steps since the line before."""
    import torch

    clock = [0.0]
    monkeypatch.setattr(console_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(console_module, "memory_peak", lambda device: "peak RSS 1 GiB")
    trainer = SimpleNamespace(global_step=0, estimated_stepping_batches=10, current_epoch=0, max_epochs=1, max_steps=-1,
                              num_training_batches=10, accumulate_grad_batches=1, world_size=1, progress_bar_metrics={},
                              strategy=SimpleNamespace(root_device=torch.device("cpu")))
    module = SimpleNamespace(progress_loss=console_module.RunningLoss())
    progress = LogProgress(interval=25)
    progress.on_train_start(trainer, module)
    batch = {"input_ids": torch.zeros(4, 3)}
    for step, (seconds, loss) in enumerate([(100, 1.0), (10, 0.5), (10, 0.3), (10, 0.1), (10, 0.9)], start=1):
        clock[0] += seconds
        module.progress_loss.add(torch.tensor(loss))
        trainer.global_step = step
        progress.on_train_batch_end(trainer, module, None, batch, step - 1)
    progress.on_train_end(trainer, module)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["train step 1/10 (10%)", "train step 4/10 (40%)",
                                                        "train step 5/10 (50%)"]
    first, fourth, last = (dict(part.split(" ", 1) for part in line.split(" | ")[1:]) for line in lines)
    assert first["loss"] == "1.0000" and "ETA" not in first  # one step: all warm-up
    assert fourth["loss"] == "0.3000" and fourth["ETA"] == "0:01:00"  # (0.5 + 0.3 + 0.1) / 3; 6 steps of 10 s
    assert " | 0.4 samples/s | " in lines[1]  # 12 samples in the 30 s after the first step
    assert last["loss"] == "0.9000" and last["took"] == "0:02:20" and "ETA" not in last
