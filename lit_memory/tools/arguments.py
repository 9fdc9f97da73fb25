"""The tools' command lines (``estimate``, ``plan``, ``cards``, ``bench``, ``recipes``), built without importing torch,
Lightning or transformers: each tool parses its arguments with its parser here, and ``python -m lit_memory TOOL
--help`` prints that parser's help before anything heavy is imported (`PARSERS`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lit_memory.config import shipped
from lit_memory.memory.hardware.gpus import ALIASES, DEFAULT_GPU, DEVICES, GPUS
from lit_memory.memory.model.loops import LOOPS

MEASURED = 3  # plan --measure: the candidates timed
# cards: the published configs shipped in the package, and 4, 8, 12 and 24 GB cards of the catalogue.
MODELS = {
    "qwen3-0.6b": "Qwen3-0.6B", "qwen3-1.7b": "Qwen3-1.7B", "qwen3-4b": "Qwen3-4B", "llama-3.2-1b": "Llama-3.2-1B",
    "llama-3.2-3b": "Llama-3.2-3B", "gemma-3-1b": "Gemma-3-1B", "modernbert-large": "ModernBERT-large",
}
CARDS = ("rtx3050-4gb", "rtx4060", "rtx3060", "rtx4090")
PEERS = ("hf-trainer",)  # bench --peer
# bench: the memory callback tracks the first optimizer steps tensor by tensor (a slow Python dispatch mode): warm-up
# covers them, so only untracked steps are timed.
MIN_WARMUP = 2


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say which device a prediction is for (estimate, plan and cards)."""
    parser.add_argument(
        "--device", choices=DEVICES, default="cuda", help="device the prediction is for (default: cuda)"
    )
    parser.add_argument(
        "--gpu", choices=sorted([*GPUS, *ALIASES]), default=None, metavar="GPU",
        help=f"the GPU (default: this machine's, else {DEFAULT_GPU}): its capacity is what the verdict fits, its "
        "architecture picks the attention kernel and the cuBLAS workspace, its generation the CUDA context; one of "
        f"{', '.join(GPUS)} (MIG slices as <gpu>-<profile>)",
    )
    parser.add_argument(
        "--cuda", default=None, help="CUDA version PyTorch is built with (default: this machine's, else 12.4)"
    )
    parser.add_argument(
        "--cuda-context", default=None,
        help="CUDA context and loaded kernels of your setup (e.g. 1343MiB: nvidia-smi after the first CUDA "
        "op and a matmul); default: the documented table (docs/memory.md)",
    )
    parser.add_argument(
        "--allocator-conf",
        default=None,
        help="allocator settings to predict for (default: this environment's PYTORCH_CUDA_ALLOC_CONF or "
        "PYTORCH_ALLOC_CONF, "
        "as torch reads them), e.g. expandable_segments:True",
    )
    parser.add_argument(
        "--loop", choices=sorted(LOOPS), default="lightning",
        help="the training loop whose memory behaviour to predict (default: lightning, lit_memory's fit)",
    )


def estimate() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lit_memory estimate",
        description="Predict a training step's memory per category and at three levels (tensors, reserved, device). "
        "Every other argument is a fit argument: --config FILE (repeatable), dotted overrides.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-simulate", action="store_true", help="analytic only (milliseconds instead of seconds)")
    add_target_arguments(parser)
    parser.add_argument(
        "--published", action="store_true",
        help="print published GPU measurements beside lit_memory's predictions (docs/memory.md's table)",
    )
    parser.add_argument(
        "--update-docs", action="store_true", help="with --published: write the table into docs/memory.md"
    )
    parser.add_argument(
        "--plot", metavar="FILE", default=None,
        help="draw the predicted step into the PNG FILE: each category's bytes layer by layer through forward, "
        "backward and the optimizer step, against the card and the budget (needs matplotlib)",
    )
    parser.add_argument(
        "--vs", action="store_true",
        help="what follows is another run, drawn beside the first with --plot (it inherits the options before it, "
        "e.g. --gpu; give it its own --config)",
    )
    return parser


def plan() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lit_memory plan",
        description="Write the fastest recipe predicted to fit a memory budget. Every other argument is a fit "
        "argument (--config FILE for the model/data, dotted overrides).",
    )
    parser.add_argument(
        "--budget", required=True,
        help="device memory to fit (what nvidia-smi would show for the process), e.g. 4GiB, 8GB, 6000MiB, or a "
        "GPU (rtx3050-4gb: its capacity); a setup fits with --memory.margin (default 0.08) of it kept free",
    )
    add_target_arguments(parser)
    parser.add_argument("--output", default="planned.yaml", help="where to write the recipe (default: planned.yaml)")
    parser.add_argument(
        "--measure",
        action="store_true",
        help=f"time the {MEASURED} best candidates on this machine and keep the fastest",
    )
    parser.add_argument(
        "--no-simulate", action="store_true", help="trust the analytic model without simulating the choice"
    )
    return parser


def cards() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lit_memory cards",
        description="What fits your card: plan's choice (full, LoRA or QLoRA) for the shipped real-size configs on "
        "4, 8, 12 and 24 GB cards, predicted. Every other argument is a fit argument (e.g. --data.max_length 512).",
    )
    parser.add_argument(
        "--models", nargs="+", default=list(MODELS), help=f"bundled models (default: {', '.join(MODELS)})"
    )
    parser.add_argument(
        "--cards", nargs="+", default=list(CARDS), help=f"catalogue cards (default: {', '.join(CARDS)})"
    )
    parser.add_argument("--update-readme", action="store_true", help="write the table into README.md (a checkout's)")
    add_target_arguments(parser)
    return parser


def bench() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lit_memory bench",
        allow_abbrev=False,
        description="Run recipes, each in a fresh process, and tabulate predicted and measured peak memory, "
        "step time and samples/s. Every other argument goes to each recipe's fit after the recipe: "
        "--config FILE (model/data configs), dotted overrides such as --trainer.accelerator=cuda. "
        "bench --gpu-proof [--dry-run]: the memory model against this GPU in one command (docs/gpu.md).",
    )
    parser.add_argument(
        "--recipes",
        default="all",
        help="`all` (the reference post's tiers in its order, then ours) or a,b,c: shipped recipe names, or paths "
        "to recipe files (dir/mine.yaml) to compare in the same run",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per recipe (default 5)")
    parser.add_argument(
        "--warmup", type=int, default=3, help=f"untimed optimizer steps first (default 3, at least {MIN_WARMUP})"
    )
    parser.add_argument("--eval", action="store_true", help="validate after the steps; adds val f1")
    parser.add_argument("--peer", help=f"also train each recipe with: {', '.join(PEERS)}")
    parser.add_argument("--out", type=Path, default=Path("bench"), help="output folder (default bench/)")
    parser.add_argument(
        "--update-readme",
        action="store_true",
        help="also write the table into a checkout's recipes/README.md (and README.md) and its rows into "
        f"recipes/{shipped.MEASURED}, which `recipes list` reads",
    )
    return parser


def recipes() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lit_memory recipes", description="List, show and check recipes.")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("list", help="the shipped recipes (the default)")
    commands.add_parser("show", help="print a shipped recipe with its comments").add_argument("name")
    check_ = commands.add_parser("check", help="validate a recipe file without running it")
    check_.add_argument("file", type=Path)
    check_.add_argument(
        shipped.TRUST_FLAG, dest="trusted", action="store_true", help="parse it even if it names other code"
    )
    trust_ = commands.add_parser("trust", help="run these files (and what they name beneath their folder) unconfined, "
                                               "as long as they do not change")
    trust_.add_argument("files", type=Path, nargs="+")
    untrust_ = commands.add_parser("untrust", help="forget files trusted with `recipes trust`")
    untrust_.add_argument("files", type=Path, nargs="+")
    commands.add_parser("trusted", help="every file you trusted, and whether it is still as trusted")
    headers_ = commands.add_parser("headers", help="write each shipped recipe's predicted memory into its header")
    headers_.add_argument("--check", action="store_true", help="only compare, and fail on a stale header")
    return parser


PARSERS = {"estimate": estimate, "plan": plan, "cards": cards, "bench": bench, "recipes": recipes}
