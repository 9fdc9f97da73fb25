"""`python -m lit_memory`: LightningCLI for fit/validate/test/predict, plus the project's tools.

The Lightning subcommands keep all of LightningCLI's conventions (layered ``--config``, dotted
overrides, ``--print_config``). Tool subcommands (``estimate``, ``bench``, ...) are listed in
`TOOLS` and parsed by their own modules.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_memory.data import TextClassificationData
from lit_memory.errors import UserError
from lit_memory.memory import MemoryMonitor
from lit_memory.model import SequenceClassifier

# subcommand -> "module:function"; each function takes the remaining argv.
TOOLS: dict[str, str] = {
    "estimate": "lit_memory.estimate:main",
    "plan": "lit_memory.plan:main",
}

# The seed's hyper-parameters (lr 2e-5, weight decay 0.01) as the CLI's optimizer default.
DEFAULT_OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-5, "weight_decay": 0.01}}


class LitMemoryCLI(LightningCLI):
    def __init__(self, args: Optional[list[str]] = None, run: bool = True, **kwargs) -> None:
        kwargs.setdefault("seed_everything_default", 42)
        super().__init__(
            SequenceClassifier,
            TextClassificationData,
            args=args,
            run=run,
            auto_configure_optimizers=False,  # the module takes the optimizer (it builds decay groups)
            **kwargs,
        )

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
