"""``python -m lit_memory bench --gpu-proof``: the memory model against one real GPU, in one command (docs/gpu.md).

Every shipped recipe trains a few optimizer steps on BERT-large built from its config (random weights: the
tokenizer files ship in ``lit_memory/assets/bert-large-uncased``, no weights are needed) over synthetic text of
full 128-token rows, each recipe in a fresh process (`lit_memory.tools.bench`). A recipe whose ``memory.tier``
names a card or a size runs under that as its ``memory.budget``: the 4 GB card of recipes/4gb.yaml
(``rtx3050-4gb``) is emulated on whatever GPU runs the proof, its allocator capped at the card's capacity less
the CUDA context measured at start (`lit_memory.memory.hardware.gpus.allocator_limit`), and ``auto`` planning for the
smaller of that and what the GPU has free. Per recipe, ``docs/gpu/<gpu>.json`` gets the measured tensors
(``max_memory_allocated``), reserved (``max_memory_reserved``) and device (NVML's figure for the process, what
nvidia-smi shows; cudaMemGetInfo's without nvidia-ml-py) against the analytic prediction the run made for that
GPU, their ratios, samples/s, and for the capped tiers whether the device total stayed within the card.

``--dry-run`` resolves every run and writes the synthetic data and the commands, trains nothing: it works on a
CPU (the tests run it).
"""

from __future__ import annotations

import csv
import json
import random
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from lit_memory import box, files, recipes
from lit_memory.errors import UserError
from lit_memory.memory.measure import records

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gpu"
MODEL = ["--model.model_name_or_path=bundled:bert-large", "--model.pretrained=false"]  # configs/bert-large.yaml's
WARMUP, STEPS = 2, 3
ROWS = 256  # synthetic training texts: more than any recipe's steps take (accumulation included)
WORDS = 200  # per text: more WordPiece tokens than max_length, so every row is full


def synthetic_csv(path: Path, rows: int = ROWS, seed: int = 0) -> Path:
    """Random words from BERT-large's vocabulary, two labels: every row truncates to a full 128-token sequence."""
    from lit_memory.bundled import resolve_model

    vocab = Path(resolve_model("bundled:bert-large")) / "vocab.txt"
    words = [w for w in vocab.read_text(encoding="utf-8").split("\n") if w.isalpha() and w.isascii() and len(w) > 2]
    rng = random.Random(seed)
    lines = [["text", "label"]] + [[" ".join(rng.choices(words, k=WORDS)), str(i % 2)] for i in range(rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with files.replacing(path) as f:
        csv.writer(f).writerows(lines)
    return path


def tier_of(entry: str) -> Optional[str]:
    """A recipe's ``memory.tier`` as written (a card such as ``rtx3050-4gb``, or a size), else None."""
    from lit_memory.bounds import read_yaml
    from lit_memory.tools.bench import recipe_file

    tree = read_yaml(recipe_file(entry))
    tier = (tree.get("memory") or {}).get("tier")
    return str(tier) if tier else None


def proof_args(data: Path) -> list[str]:
    """What every recipe of the proof gets after the recipe: the model, the synthetic data, one CUDA device,
    the allocator's peaks (no tensor tracking: its Python dispatch would slow the steps)."""
    return [
        *MODEL, f"--data.source={data}", "--data.text_column=text", "--data.label_column=label",
        f"--data.limit_train_samples={ROWS}", "--data.limit_eval_samples=16",
        "--trainer.accelerator=cuda", "--trainer.devices=1", "--memory.track_steps=0",
    ]


def budget_args(entry: str) -> list[str]:
    """A tier runs capped at its tier: the card it names emulated (its capacity less the context)."""
    tier = tier_of(entry)
    return [f"--memory.budget={tier}"] if tier else []


def gpu_name() -> str:
    """This machine's GPU as a file name: its catalogue key (``h100``), else torch's name made safe."""
    from lit_memory.memory.hardware.gpus import target

    card = target("cuda").gpu
    return card.key or re.sub(r"[^a-z0-9.-]+", "-", card.name.lower()).strip("-")


def proof_row(recipe: str, bench_row: dict[str, Any], run_dir: Path, budget: Optional[str]) -> dict[str, Any]:
    """One recipe's measured levels against its prediction (from its ``memory.json``), its speed and, under a
    budget, whether the device total stayed within it."""
    from lit_memory.memory.hardware.gpus import capacity

    row: dict[str, Any] = {"recipe": recipe, "budget": budget, "error": bench_row.get("error")}
    try:
        memory = records.read_memory(run_dir)
    except (OSError, ValueError, KeyError):
        return row
    cuda = memory["measured"].get("cuda") or {}
    predicted = (memory.get("predicted") or {}).get("analytic") or {}
    measured = {
        "tensors": cuda.get("max_allocated_bytes"), "reserved": cuda.get("max_reserved_bytes"),
        "device": cuda.get("max_device_bytes") or None,
    }
    expected = {"tensors": predicted.get("peak_bytes"), "reserved": predicted.get("reserved_bytes"),
                "device": predicted.get("device_bytes")}
    row.update(
        device_source=cuda.get("device_source"),
        measured_bytes=measured,
        predicted_bytes=expected,
        measured_over_predicted={
            k: round(measured[k] / expected[k], 4) if measured[k] and expected[k] else None for k in measured
        },
        samples_per_s=bench_row.get("samples_per_s"),
        step_time_s=bench_row.get("step_time_s"),
        oom=(memory.get("oom") or None) is not None,
    )
    if budget and measured["device"]:
        limit = capacity(budget)
        row["within_budget"] = measured["device"] <= limit
        row["spare"] = round(1 - measured["device"] / limit, 4)
    return row


def write_proof(rows: list[dict[str, Any]], info: dict[str, Any], path: Path) -> None:
    files.write_text(path, json.dumps({**info, "recipes": rows}, indent=2) + "\n")


def main(user_args: list[str], out: Path, dry_run: bool, names: str = "all") -> None:
    import torch

    from lit_memory.tools.bench import bench, machine, ordered, prepare

    if not dry_run and not torch.cuda.is_available():
        raise UserError("--gpu-proof trains on a CUDA GPU and this machine has none (--dry-run resolves it anywhere)")
    if recipes.recipes_dir() != recipes.CHECKOUT:
        raise UserError("--gpu-proof writes docs/gpu/ of a checkout: run it from a clone of the repository")
    box.allow_output(out, "--out")  # the runs, logs and data go where the user said (default bench/)
    entries = ordered(names)
    data = synthetic_csv(out / "synthetic.csv")
    budgets = {Path(e).stem: budget_args(e) for e in entries}
    runs = prepare(
        entries, [*proof_args(data), *user_args], out, WARMUP, STEPS, False, None,
        extra=lambda name: budgets[name], simulate=False, count_flops=False,
    )
    command = shlex.join(["python", "-m", "lit_memory", "bench", "--gpu-proof", *(["--dry-run"] if dry_run else []),
                          *([] if names == "all" else [f"--recipes={names}"]), *user_args])
    plan = [{"recipe": r.recipe, "fit": shlex.join(["python", "-m", "lit_memory", "fit", *r.fit_args])} for r in runs]
    if dry_run:
        files.write_text(out / "gpu-proof-runs.json", json.dumps({"command": command, "runs": plan}, indent=2) + "\n")
        for run in plan:
            print(run["fit"])
        print(f"dry run: {len(plan)} recipes resolved; the data is {data}; nothing trained")
        return
    target = DOCS / f"{gpu_name()}.json"
    if not target.parent.is_dir():  # a checkout has it (docs/gpu/README.md); a copy without it gets it back
        target.parent.mkdir(parents=True)
    box.allow_output(target, "--gpu-proof", file=True)  # the checkout's docs/gpu/<gpu>.json, which this command writes
    info: dict[str, Any] = {
        "command": command,
        "note": "BERT-large from its config (random weights), batch as each recipe states, synthetic 128-token rows; "
        f"{WARMUP} warm-up + {STEPS} timed optimizer steps; a recipe with memory.tier runs with it as memory.budget "
        "(rtx3050-4gb emulated: allocator capped at its capacity less the CUDA context at start); measured: "
        "max_memory_allocated (tensors), max_memory_reserved, the device level as device_source says",
    }

    def save(done: list[dict]) -> None:  # after every recipe: an interrupted proof keeps what it measured
        rows = [proof_row(r["recipe"], r, p.run_dir, tier_of_args(budgets[p.recipe])) for r, p in zip(done, runs)]
        write_proof(rows, {**info, "machine": machine(done)}, target)

    rows = bench(runs, out, WARMUP, STEPS, False, None, save)
    print(f"wrote {target}")
    for row in json.loads(target.read_text(encoding="utf-8"))["recipes"]:
        levels = row.get("measured_over_predicted") or {}
        print(f"{row['recipe']:>14}: measured/predicted " + ", ".join(f"{k} {v}" for k, v in levels.items())
              + (f"; {row['samples_per_s']:.1f} samples/s" if row.get("samples_per_s") else "")
              + (f"; error: {row['error']}" if row.get("error") else ""))
    failed = [r["recipe"] for r in rows if r.get("error")]
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out / 'logs'})", file=sys.stderr)


def table(record: dict[str, Any]) -> str:
    """A record as the markdown table docs/gpu.md shows: measured GiB and measured/predicted per level."""
    gib = 2**30
    lines = ["| recipe | budget | tensors GiB (x pred.) | reserved GiB (x pred.) | device GiB (x pred.) | samples/s | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in record["recipes"]:
        measured, ratio = row.get("measured_bytes") or {}, row.get("measured_over_predicted") or {}
        cells = [f"{measured[k] / gib:.2f} ({ratio[k]:.3f})" if measured.get(k) and ratio.get(k) else "-"
                 for k in ("tensors", "reserved", "device")]
        note = row.get("error") or (f"within the card, {row['spare']:.1%} to spare" if row.get("within_budget")
                                    else "over the card" if row.get("within_budget") is False else "")
        speed = f"{row['samples_per_s']:.1f}" if row.get("samples_per_s") else "-"
        lines.append(f"| {row['recipe']} | {row.get('budget') or '-'} | " + " | ".join(cells) + f" | {speed} | {note} |")
    return "\n".join(lines)


def cli(argv: list[str]) -> None:
    """``bench --gpu-proof [--dry-run] [--out DIR] [--recipes a,b]``; other arguments go to every recipe's fit."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m lit_memory bench --gpu-proof", allow_abbrev=False,
        description="Every recipe a few steps on BERT-large from its config on this GPU, the tiers capped at their "
        "cards (4gb.yaml: rtx3050-4gb emulated); writes docs/gpu/<gpu>.json (docs/gpu.md).",
    )
    parser.add_argument("--gpu-proof", action="store_true", required=True)
    parser.add_argument("--dry-run", action="store_true", help="resolve every run and write the data; train nothing")
    parser.add_argument("--out", type=Path, default=Path("bench"), help="runs, logs and data (default bench/)")
    parser.add_argument("--recipes", default="all", help="`all` or a,b,c (as bench takes them)")
    parser.add_argument("--show", type=Path, metavar="RECORD", help="print a record (docs/gpu/<gpu>.json) as a table")
    args, user_args = parser.parse_known_args(argv)
    if args.show:
        print(table(json.loads(args.show.read_text(encoding="utf-8"))))
        return
    main(user_args, args.out, args.dry_run, args.recipes)


def tier_of_args(args: list[str]) -> Optional[str]:
    return args[0].split("=", 1)[1] if args else None

