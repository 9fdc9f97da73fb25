"""`lit_memory.best`: early stopping watches the metric the best checkpoint keeps, and is off unless asked.
(The best checkpoint itself, kept across a resume and exported: tests/test_resume.py and tests/test_predict_file.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_memory.best import BestCheckpoint, EarlyStop
from lit_memory.errors import UserError


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
