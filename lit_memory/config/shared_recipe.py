"""The recipe every run shares, and the shipped recipes' settings the memory advice lays over a run.

A recipe is one YAML file for `LightningCLI`; the shipped ones are found, listed and expanded in
`lit_memory.config.shipped`. Every fit writes its fully resolved settings
back out as ``recipe.yaml`` in its run folder (`SaveRecipe`, `shared_recipe`): that file is what people
share, and ``python -m lit_memory recipes check FILE`` (`lit_memory.tools.recipes`) is how a receiver
inspects one (`lit_memory.config.trust` says what is refused).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import lightning
import torch
import transformers
from lightning.pytorch.cli import SaveConfigCallback

import lit_memory
from lit_memory import files
from lit_memory.config import trust, trusted
from lit_memory.config.shipped import names, recipe_path
from lit_memory.errors import UserError
from lit_memory.memory.measure import records
from lit_memory.run import resume
from lit_memory.sandbox import bounds
from lit_memory.settings import dotted_leaves

MEASURED = records.BENCH_JSON  # the latest bench run's rows, beside the recipes (bench --update-readme)
SHARED_RECIPE = "recipe.yaml"  # written into every fit's run folder

# Settings that belong to one run on one machine: blanked in the shared recipe.
RUN_SPECIFIC = ("trainer.default_root_dir", "ckpt_path")
# The command a shared recipe tells its receiver to run: the installed script, whose sys.path starts at its own
# folder, so nothing is imported from the folder the recipe came in (`python -m` would put that folder first).
SAFE_COMMAND = "lit-memory"

# -- the shipped recipes: found and read in `lit_memory.config.shipped` (light) ---------------------------


def shipped_settings() -> list[tuple[str, dict[str, Any]]]:
    """Every shipped recipe as (``recipes/<file>``, its settings as dotted ``section.key`` values): what the
    out-of-memory advice lays over a run's own settings. Read as plain data (`lit_memory.sandbox.bounds.read_yaml`)."""
    found = []
    for name in names():
        values = dict(dotted_leaves(bounds.read_yaml(recipe_path(name)), depth=2))
        found.append((f"recipes/{name}.yaml", values))
    return found


# -- the shared recipe written into every fit's run folder ------------------------------------


class SaveRecipe(SaveConfigCallback):
    """Lightning's ``config.yaml``, plus ``recipe.yaml`` after a fit: the same settings with a
    header (command, machine, versions, measured peak), the run's own paths blanked and any value
    that would need ``--trust-recipe`` made safe. Both are written whole and never through a link
    (`lit_memory.files`). Checkpoints carry the settings a resume must match (`lit_memory.run.resume`)."""

    def __init__(self, *args: Any, command: str = "", trusted: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.command = command
        # the run's configs were trusted: so is the config.yaml it writes (`trusted.record_run_config`)
        self.trusted = trusted

    def setup(self, trainer, pl_module, stage: str) -> None:
        # SaveConfigCallback.setup, writing config.yaml through lit_memory.files instead of jsonargparse's open().
        self.run_dir = Path(trainer.log_dir)  # a collective: every rank asks, rank 0 writes
        if self.already_saved:
            return
        path = self.run_dir / self.config_filename
        if self.save_to_log_dir:
            exists = trainer.strategy.broadcast(path.is_file() if trainer.is_global_zero else False)
            if exists and not self.overwrite:
                raise UserError(f"{path} exists: this run would overwrite another run's settings; use a new run folder")
            if trainer.is_global_zero:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                files.write_text(path, self.parser.dump(self.config, skip_none=False))
                if self.trusted:  # ``predict --config RUN/config.yaml`` then runs as this run did (unconfined)
                    trusted.record_run_config(path)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._write(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            self._write(trainer)  # again, now that the run has measured its memory

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[resume.RESUME_STATE] = resume.resume_settings(self.config)

    def _write(self, trainer) -> None:
        settings = trust.sanitize(self.config)
        for key in RUN_SPECIFIC:
            if key in settings:
                settings[key] = None
        text = shared_recipe(
            self.parser.dump(settings, skip_none=False), self.command, describe_machine(trainer), self.run_dir
        )
        files.write_text(self.run_dir / SHARED_RECIPE, text)


def shared_recipe(config_yaml: str, command: str, machine: str, run_dir: Path) -> str:
    """The run's resolved settings, under a header saying what they are, what made them and where."""
    versions = (
        f"lit_memory {lit_memory.__version__}, torch {torch.__version__}, "
        f"lightning {lightning.__version__}, transformers {transformers.__version__}"
    )
    lines = [
        f"# {SHARED_RECIPE}: the fully resolved settings of one lit_memory fit run, to share as one file.",
        f"# rerun: {SAFE_COMMAND} fit --config {SHARED_RECIPE}"
        f"   (inspect it first: {SAFE_COMMAND} recipes check {SHARED_RECIPE})",
        f"# command: {command}",
        f"# machine: {machine}",
        f"# versions: {versions}",
        f"# measured peak memory: {records.peak_summary(run_dir) or 'not measured (no memory.json in the run folder)'}",
        f"# blanked (they belong to the run, not the recipe): {', '.join(RUN_SPECIFIC)}",
    ]
    return "\n".join(lines) + "\n" + config_yaml


def describe_machine(trainer: Any) -> str:
    """Nodes x devices (GPU name), OS and CPU cores; no host name, since the file is shared."""
    device = trainer.strategy.root_device
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    return (
        f"{trainer.num_nodes} node(s) x {trainer.num_devices} {device.type} device(s){gpu}; "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores"
    )
