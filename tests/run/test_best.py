"""`lit_memory.run.best`: the numbers a fit ends with are the model it saved (the closing ``val:`` line and the
per-class report are the exported step's, the last validation's named as such), one step numbering in ``metrics.csv``,
checkpoint names and the log; early stopping watches the metric the best checkpoint keeps, and is off unless asked."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import rows, write_csv
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from lit_memory.__main__ import main
from lit_memory.errors import UserError
from lit_memory.run.best import BestCheckpoint, EarlyStop, ValidationStep

TINY = '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}'


def val_rows(run: Path) -> dict[int, dict[str, float]]:
    found = {}
    for row in csv.DictReader(open(run / "metrics.csv")):
        values = {k[4:]: float(v) for k, v in row.items() if k.startswith("val_") and v}
        if values:
            found[int(row["step"])] = values
    return found


def line_of(values: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4f}" for k, v in sorted(values.items()))


@pytest.mark.fit
def test_the_closing_val_line_is_the_exported_steps_and_steps_are_numbered_once(tmp_path, capsys):
    """Validations after steps 2 and 4; the best kept by the lowest step (step 2), so the last is not the exported."""
    data = write_csv(tmp_path / "reviews.csv", rows(40))
    main([
        "fit", "--trust-recipe", "--model.model_name_or_path=bundled:bert-large", "--model.pretrained=false",
        f"--model.config_overrides={TINY}", f"--data.source={data}", "--data.batch_size=4", "--data.max_length=16",
        "--trainer.max_steps=4", "--trainer.check_val_every_n_epoch=null", "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--memory.track_steps=0", "--memory.picture=false",
        "--trainer.callbacks+=lit_memory.run.best.BestCheckpoint", "--trainer.callbacks.monitor=step",
        "--trainer.callbacks.mode=min", f"--trainer.default_root_dir={tmp_path}",
    ])
    out, err = capsys.readouterr()
    run = tmp_path / "lightning_logs" / "version_0"
    logged = val_rows(run)
    assert sorted(logged) == [2, 4]  # the steps taken before each validation, as the checkpoint names say
    assert [p.name for p in (run / "checkpoints").glob("best-*")] == ["best-step=2.ckpt"]
    assert "hf_model: the best validated weights: step 2, step=2.0000" in err
    lines = out.splitlines()
    assert f"val at the last validation (step 4, not exported): {line_of(logged[4])}" in lines
    assert "val at step 2, exported to hf_model:" in lines  # the per-class report of the exported step
    assert lines[-1] == f"val: {line_of(logged[2])}"  # the closing line: the model in hf_model/
    assert logged[2] != logged[4]


class Stepped(BoringModel):
    """Logs, at each validation, the optimizer steps taken before it."""

    def validation_step(self, batch, batch_idx):
        self.log("val_taken", float(self.trainer.global_step))
        return super().validation_step(batch, batch_idx)


def test_a_validation_is_logged_at_the_steps_taken_also_after_a_batch_that_only_accumulated(tmp_path):
    """Validations after batches 3 and 6 of 2-batch steps: after 1 step (batch 3 only accumulated) and after 3 steps
    (batch 6 stepped); metrics.csv's rows at 1 and 3, and checkpoints written at every step keep their steps' names."""
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=4, accumulate_grad_batches=2, val_check_interval=3,
        check_val_every_n_epoch=None, limit_val_batches=1, num_sanity_val_steps=0, logger=CSVLogger(tmp_path),
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ValidationStep(), ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}")],
    )
    trainer.fit(Stepped())
    run = tmp_path / "lightning_logs" / "version_0"
    logged = [(int(r["step"]), r["epoch"], float(r["val_taken"])) for r in csv.DictReader(open(run / "metrics.csv"))]
    assert logged == [(1, "0.0", 1.0), (3, "0.0", 3.0)]  # Lightning alone logs the first at 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"epoch=0-step={n}.ckpt" for n in range(1, 5)]


def trainer_with(*callbacks) -> SimpleNamespace:
    return SimpleNamespace(callbacks=list(callbacks), val_check_interval=1.0, check_val_every_n_epoch=1)


@pytest.mark.parametrize("best, monitor, mode", [
    (BestCheckpoint(), "val_f1_macro", "max"),  # the problem type's main metric
    (BestCheckpoint(monitor="val_loss"), "val_loss", "min"),
    (BestCheckpoint(monitor="val_mse"), "val_mse", "min"),
])
def test_early_stopping_watches_the_best_checkpoints_metric(best, monitor, mode):
    stop = EarlyStop(patience=2, min_delta=0.01)
    stop.setup(trainer_with(best), SimpleNamespace(main_metric="f1_macro"), "fit")
    assert (stop.monitor, stop.mode, stop.enabled, stop.patience) == (monitor, mode, True, 2)
    assert stop.min_delta == (0.01 if mode == "max" else -0.01)
    assert stop.best_score == torch.tensor(-torch.inf if mode == "max" else torch.inf)


def test_early_stopping_is_off_unless_patience_is_set_and_a_bad_patience_is_one_line():
    stop = EarlyStop()
    assert not stop.enabled
    stop.on_validation_end(SimpleNamespace(), None)  # does nothing: no metric asked for, no trainer touched
    with pytest.raises(UserError, match=r"^early_stopping.patience must be a number of validations >= 1"):
        EarlyStop(patience=0)


def test_the_best_and_the_early_stopping_count_are_kept_at_each_validations_end():
    """Not at the epoch's end, where Lightning would keep them after a validation that ends an epoch: the resume
    checkpoint written right after the validation must hold them (tests/run/test_resume.py resumes from one)."""
    assert (
        BestCheckpoint()._save_on_train_epoch_end is False and EarlyStop(patience=2)._check_on_train_epoch_end is False
    )
    with pytest.raises(UserError, match=r"^BestCheckpoint keeps the best at each validation's end: "
                                        r"save_on_train_epoch_end must be false$"):
        BestCheckpoint(save_on_train_epoch_end=True)
