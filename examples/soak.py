"""Long runs in one process: does memory stay flat and step time steady?

Two modes, each a `python -m lit_memory fit` run through the same code path (`lit_memory.cli.resolve`), so
the memory monitor, the fused step and the optimizers' native kernels all take part:

- ``steps``: one fit of N optimizer steps; every K steps one line with the process's resident memory (RSS),
  the bytes of tensors alive in the process (every torch tensor the garbage collector can see, or the CUDA
  allocator's allocated/reserved bytes on a GPU) and the median step time of the last K steps. After the
  warm-up (``--settle`` steps) RSS should grow by no more than ``--rss-bound``.
- ``fits``: M fits of a tiny run in one process, as a notebook that fits again and again would; one line per
  fit with RSS after it (after ``gc.collect()``). RSS after the last should be within ``--rss-bound`` of RSS
  after the fifth.

Exit status 1 when the bound is not met, so it can run unattended::

    # 3,000 steps of 4gb on the launch-bound proxy (BERT-large depth at hidden 64, batch 8 x 16)
    python examples/soak.py steps --steps 3000 --every 200 -- \\
        --config recipes/4gb.yaml --config configs/bert-large.yaml --config configs/launch-bound.yaml
    # 50 fits of a tiny run (bundled MiniLM, 2 steps each)
    python examples/soak.py fits --fits 50 -- --config recipes/fused.yaml

Numbers are this machine's: RSS is the process's (tensors plus the Python runtime, libraries and the C
allocator's caches), not a GPU's.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time

import lightning as L
import torch

from lit_memory.cli import resolve
from lit_memory.memory.measure.footprint import format_bytes, parse_bytes
from lit_memory.memory.measure.tracker import current_rss

QUIET = [
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--model.save_pretrained=false",
]
TINY = [  # a fit of a few seconds on the bundled model
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=2",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_checkpointing=false",
    "--data.limit_train_samples=64",
    "--data.limit_eval_samples=16",
]


def tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector sees (CPU and CUDA alike)."""
    seen: set[int] = set()
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
                continue
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class Soak(L.Callback):
    """One line every ``every`` optimizer steps: RSS, live tensors, the median step time since the last line."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.rows: list[dict] = []
        self._last = time.perf_counter()
        self._times: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._times.append(now - self._last)
        self._last = now
        step = trainer.global_step
        if step % self.every:
            return
        row = {"step": step, "rss": current_rss(), "step_s": statistics.median(self._times)}
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            row["allocated"] = torch.cuda.memory_allocated(pl_module.device)
            row["reserved"] = torch.cuda.memory_reserved(pl_module.device)
        else:
            row["tensors"] = tensor_bytes()
        self.rows.append(row)
        self._times = []
        extra = "  ".join(f"{k} {format_bytes(v)}" for k, v in row.items() if k in ("tensors", "allocated", "reserved"))
        print(
            f"step {step:6d}  rss {format_bytes(row['rss'])}  {extra}  step {row['step_s'] * 1000:.1f} ms", flush=True
        )
        self._last = time.perf_counter()  # the measurement itself is not a step


def soak_steps(args: argparse.Namespace, fit_args: list[str]) -> bool:
    soak = Soak(args.every)
    with tempfile.TemporaryDirectory() as root:
        run = resolve(
            [
                "fit",
                *fit_args,
                *QUIET,
                f"--trainer.max_steps={args.steps}",
                "--trainer.max_epochs=-1",
                "--trainer.limit_val_batches=0",
                "--trainer.enable_checkpointing=false",
                f"--trainer.default_root_dir={root}",
            ],
            trainer_defaults={"callbacks": [soak]},
        )
        run.launch()
    settled = [r for r in soak.rows if r["step"] >= args.settle]
    if len(settled) < 2:
        print(f"soak: fewer than two reports after step {args.settle}; run more steps", file=sys.stderr)
        return False
    growth = settled[-1]["rss"] - settled[0]["rss"]
    first, last = settled[0]["step_s"], settled[-1]["step_s"]
    print(
        f"soak: RSS grew {format_bytes(growth)} from step {settled[0]['step']} to {settled[-1]['step']} "
        f"(bound {format_bytes(args.rss_bound)}); median step {first * 1000:.1f} -> {last * 1000:.1f} ms"
    )
    return growth <= args.rss_bound


def soak_fits(args: argparse.Namespace, fit_args: list[str]) -> bool:
    after: list[int] = []
    for i in range(args.fits):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as root:
            run = resolve(["fit", *fit_args, *QUIET, *TINY, f"--trainer.default_root_dir={root}"])
            run.launch()
            del run
        gc.collect()
        after.append(current_rss())
        print(f"fit {i + 1:3d}  rss {format_bytes(after[-1])}  {time.perf_counter() - start:.1f} s", flush=True)
    reference = after[min(4, len(after) - 1)]
    growth = after[-1] - reference
    print(
        f"soak: RSS after fit {len(after)} is {format_bytes(growth)} over RSS after fit {min(5, len(after))} "
        f"(bound {format_bytes(args.rss_bound)})"
    )
    return growth <= args.rss_bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    steps = sub.add_parser("steps", help="one long fit")
    steps.add_argument("--steps", type=int, default=3000)
    steps.add_argument("--every", type=int, default=200, help="report every K optimizer steps")
    steps.add_argument("--settle", type=int, default=200, help="steps of warm-up before RSS must stay flat")
    steps.add_argument("--rss-bound", type=parse_bytes, default="50MiB")
    fits = sub.add_parser("fits", help="many fits in one process")
    fits.add_argument("--fits", type=int, default=50)
    fits.add_argument("--rss-bound", type=parse_bytes, default="200MiB")
    argv = sys.argv[1:]
    fit_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    ok = soak_steps(args, fit_args) if args.mode == "steps" else soak_fits(args, fit_args)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
