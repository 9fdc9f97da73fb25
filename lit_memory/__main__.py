"""`python -m lit_memory`: Lightning's subcommands (fit, validate, test, predict) and the project's tools.

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
from lit_memory.tools import bench, estimate, plan, proof, recipes


def _bench(argv: list[str]) -> None:
    """``bench``, or with ``--gpu-proof`` the GPU proof built on it (`lit_memory.tools.proof`)."""
    (proof.cli if "--gpu-proof" in argv else bench.main)(argv)


TOOLS = {"bench": _bench, "estimate": estimate.main, "plan": plan.main, "recipes": recipes.main}


def main(argv: Optional[list[str]] = None) -> None:
    # Per-map progress bars of `datasets` (filter, cast, tokenise) drown the training log.
    import datasets

    datasets.disable_progress_bars()
    args = sys.argv[1:] if argv is None else list(argv)
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
