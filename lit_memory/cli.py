"""`python -m lit_memory`: LightningCLI for fit/validate/test/predict, plus the project's tools.

The Lightning subcommands keep all of LightningCLI's conventions (layered ``--config``, dotted
overrides, ``--print_config``). Tool subcommands (``estimate``, ``bench``, ...) are listed in
`TOOLS` and parsed by their own modules.
"""

from __future__ import annotations

import importlib
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Union

import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from lit_memory import recipes
from lit_memory.data import TextClassificationData
from lit_memory.errors import UserError
from lit_memory.fused import parse_bucket
from lit_memory.memory import MemoryMonitor
from lit_memory.model import SequenceClassifier
from lit_memory.precision import cpu_fallback

# subcommand -> "module:function"; each function takes the remaining argv.
TOOLS: dict[str, str] = {
    "bench": "lit_memory.bench:main",
    "estimate": "lit_memory.estimate:main",
    "plan": "lit_memory.plan:main",
    "recipes": "lit_memory.recipes:main",
}

# The seed's hyper-parameters (lr 2e-5, weight decay 0.01) as the CLI's optimizer default.
DEFAULT_OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-5, "weight_decay": 0.01}}


class SaveRecipe(SaveConfigCallback):
    """Lightning's ``config.yaml``, plus ``recipe.yaml`` after a fit: the same settings with a
    header (command, machine, versions, measured peak) and the run's own paths blanked."""

    def __init__(self, *args: Any, command: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.command = command

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.run_dir = Path(trainer.log_dir)  # a collective: every rank asks, rank 0 writes
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._write(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            self._write(trainer)  # again, now that the run has measured its memory

    def _write(self, trainer) -> None:
        config = self.config.clone()
        for key in recipes.RUN_SPECIFIC:
            if key in config:
                config[key] = None
        text = recipes.shared_recipe(
            self.parser.dump(config, skip_none=False), self.command, recipes.describe_machine(trainer), self.run_dir
        )
        (self.run_dir / recipes.SHARED_RECIPE).write_text(text, encoding="utf-8")


class LitMemoryCLI(LightningCLI):
    """LightningCLI for the project's module and data, plus ``--recipe NAME`` (a shipped recipe,
    expanded into ``--config <its path>`` where it stands) and the recipe trust check: class
    paths outside `recipes.ALLOWLIST` are refused unless ``--trust-recipe`` is given."""

    def __init__(self, args: Union[list[str], dict, Namespace, None] = None, run: bool = True, **kwargs) -> None:
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, (dict, Namespace)):  # LightningCLI also takes the config as an object
            tree = argv.as_dict() if isinstance(argv, Namespace) else argv
            recipes.refuse_untrusted(recipes.references_in_tree(tree, "args"))
            command, trusted = "LitMemoryCLI(args=<a config object>)", False
        else:
            command = shlex.join(["python", "-m", "lit_memory", *map(str, argv)])
            argv, trusted = recipes.prepare_argv(list(argv))
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("save_config_callback", SaveRecipe)
        if kwargs["save_config_callback"] is SaveRecipe:
            kwargs["save_config_kwargs"] = {"command": command, **(kwargs.get("save_config_kwargs") or {})}
        with recipes.import_allowlist(enforced=not trusted):
            super().__init__(
                SequenceClassifier,
                TextClassificationData,
                args=argv,
                run=run,
                auto_configure_optimizers=False,  # the module takes the optimizer (it builds decay groups)
                **kwargs,
            )

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # --recipe and --trust-recipe are taken out of argv before parsing: say so in --help.
        kwargs.setdefault("epilog", recipes.HELP)
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        # `args` is sys.argv rewritten by __init__: parse it without LightningCLI's warning about
        # being given both args and a command line.
        self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        # Load checkpoints with weights_only=True (tensors and plain data only, no pickled code)
        # unless told otherwise; Lightning's own default, None, defers to torch's default.
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        parser.set_defaults(weights_only=True)
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model.optimizer": DEFAULT_OPTIMIZER})
        # Memory is measured in every run: a forced callback (always present, unlike a default in
        # `trainer.callbacks`, which a user's list would replace) with its own `memory:` config block.
        parser.add_lightning_class_args(MemoryMonitor, "memory")
        # One source of truth: the model decides the classes and the tokenizer, the data follows.
        parser.link_arguments("model.num_labels", "data.num_labels")
        parser.link_arguments(
            ("model.tokenizer_name_or_path", "model.model_name_or_path"),
            "data.tokenizer_name_or_path",
            compute_fn=lambda tokenizer, model: tokenizer or model,
        )
        parser.add_argument(
            "--cpu_bf16_fallback",
            type=bool,
            default=True,
            help="On a CPU without native bf16 (AVX512-BF16/AMX), train bf16 recipes in 32-true, with a warning.",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.cpu_bf16_fallback:
            config.trainer.precision = cpu_fallback(config.trainer.precision, config.trainer.accelerator)
        # The fused strategies refuse a bad bucket when built, but jsonargparse would wrap that line into
        # its error for the Trainer's `strategy` union: check it first, as one line.
        bucket = getattr(getattr(config.trainer.strategy, "init_args", None), "bucket", None)
        if bucket is not None:
            parse_bucket(bucket)

    def after_fit(self) -> None:
        self._print_metrics("val")

    def after_validate(self) -> None:
        self._print_metrics("val")

    def after_test(self) -> None:
        self._print_metrics("test")

    def _print_metrics(self, stage: str) -> None:
        if not self.trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith(f"{stage}_")}
        if metrics:
            print(f"{stage}: " + "  ".join(f"{k[len(stage) + 1:]}={v:.4f}" for k, v in sorted(metrics.items())))


def main(argv: Optional[list[str]] = None) -> None:
    # Per-map progress bars of `datasets` (filter, cast, tokenise) drown the training log.
    import datasets

    datasets.disable_progress_bars()
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args and args[0] in TOOLS:
            module, function = TOOLS[args[0]].split(":")
            getattr(importlib.import_module(module), function)(args[1:])
        else:
            LitMemoryCLI(args=argv)  # None: LightningCLI reads sys.argv itself
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except torch.OutOfMemoryError as err:
        # The memory callback has printed the breakdown at the failure and a recipe that fits.
        print(f"error: out of memory: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)
