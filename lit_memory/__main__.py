"""`python -m lit_memory`: Lightning's subcommands (fit, validate, test, predict) and the project's tools."""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import torch

from lit_memory.errors import UserError

# subcommand -> "module:function"; each function takes the remaining argv.
TOOLS: dict[str, str] = {
    "bench": "lit_memory.bench:main",
    "estimate": "lit_memory.estimate:main",
    "plan": "lit_memory.plan:main",
    "recipes": "lit_memory.recipes:main",
}


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
            from lit_memory.cli import resolve

            resolve(args).launch()
    except UserError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    except torch.OutOfMemoryError as err:
        # The memory callback has printed the breakdown at the failure and a recipe that fits.
        print(f"error: out of memory: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
