"""`python -m lit_memory`: Lightning's subcommands (fit, validate, test, predict) and the project's tools,
all listed by ``python -m lit_memory --help``.

The top of the package: the one place that imports both the runtime (through `lit_memory.cli`) and
the tools. A run's memory predictions and out-of-memory advice come from `lit_memory.memory.predict`,
which the CLI hands to the run's memory monitor itself.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from lit_memory import cli
from lit_memory.errors import UserError
from lit_memory.tools import bench, estimate, plan, recipes

TOOLS = {"bench": bench.main, "estimate": estimate.main, "plan": plan.main, "recipes": recipes.main}
# One line per command for `python -m lit_memory --help`; `COMMAND --help` has every option.
LIGHTNING_COMMANDS = {
    "fit": "train a model (python -m lit_memory fit --config recipes/4gb.yaml); the run folder gets config, checkpoints, hf_model, memory.json",
    "validate": "evaluate a checkpoint (--ckpt_path) or a saved model on the validation split",
    "test": "evaluate a checkpoint (--ckpt_path) or a saved model on the test split",
    "predict": "label a file of texts (--data.predict_path texts.csv) with a checkpoint or a saved hf_model; writes predictions.csv",
}
TOOL_COMMANDS = {
    "estimate": "a run's memory before running it: tensors, allocator and device, predicted two ways",
    "plan": "the fastest recipe predicted to fit a memory budget (--budget 4GiB)",
    "bench": "train every recipe in a fresh process and tabulate measured memory and speed",
    "recipes": "list the shipped recipes, show one, or check a recipe someone sent",
}


def usage() -> str:
    width = max(map(len, [*LIGHTNING_COMMANDS, *TOOL_COMMANDS]))
    lines = [
        "usage: python -m lit_memory COMMAND [options]",
        "       python -m lit_memory COMMAND --help     (every option of one command)",
        "",
        "Fine-tune Hugging Face sequence classifiers with PyTorch Lightning in as little GPU memory as possible.",
        "",
        "training and inference (LightningCLI: --config FILE, --recipe NAME, dotted overrides like --data.batch_size 8):",
        *(f"  {name:<{width}}  {line}" for name, line in LIGHTNING_COMMANDS.items()),
        "",
        "tools:",
        *(f"  {name:<{width}}  {line}" for name, line in TOOL_COMMANDS.items()),
        "",
        cli.HELP,
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    # Per-map progress bars of `datasets` (filter, cast, tokenise) drown the training log.
    import datasets

    datasets.disable_progress_bars()
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        sys.exit(0 if args else 2)
    try:
        if args and args[0] in TOOLS:
            TOOLS[args[0]](args[1:])
        else:
            cli.resolve(args).launch()
    except UserError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    except torch.OutOfMemoryError as err:
        # The memory monitor has printed the breakdown at the failure and a recipe that fits.
        print(f"error: out of memory: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
