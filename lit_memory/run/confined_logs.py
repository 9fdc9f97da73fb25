"""A confined run's logger writes into the ``version_N`` folder its parent made for it.

The parent makes the run's new, empty version folder and lets the run write there alone
(`lit_memory.sandbox.roots.new_version`, `lit_memory.confine.launch.run_folders`); Lightning's default logger would
number the run one past that folder, which the run may not make. So the child's default logger is Lightning's own
(TensorBoard where installed, else CSV, in the default root), with that version.
"""

from __future__ import annotations

import os
from typing import Any

from lit_memory.sandbox.roots import VERSION_VARIABLE


def logger_kwargs(trainer: Any, subcommand: str) -> dict[str, Any]:
    """The Trainer's ``logger`` for a confined run whose parent made its version folder (``{}`` otherwise: the
    logger is the user's or the recipe's, or predict's none). ``trainer``: the Trainer's settings."""
    version = os.environ.get(VERSION_VARIABLE, "")
    if not version.isdigit() or subcommand == "predict" or trainer.get("logger") not in (None, True):
        return {}
    from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    root = trainer.get("default_root_dir") or os.getcwd()
    kind = TensorBoardLogger if _TENSORBOARD_AVAILABLE or _TENSORBOARDX_AVAILABLE else CSVLogger
    return {"logger": kind(save_dir=root, version=int(version))}
