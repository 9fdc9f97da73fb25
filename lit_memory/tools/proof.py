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

import argparse
import csv
import json
import random
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from lit_memory import files, shipped
from lit_memory.bounds import read_yaml
from lit_memory.bundled import resolve_model
from lit_memory.errors import UserError
from lit_memory.memory.hardware.gpus import capacity, match, target
from lit_memory.memory.measure import records
from lit_memory.tools.bench import bench, machine, ordered, prepare, recipe_file

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "gpu"
MODEL = ["--model.model_name_or_path=bundled:bert-large", "--model.pretrained=false"]  # configs/bert-large.yaml's
# Timed with CUDA events over STEPS steps after WARMUP (compile and the allocator's growth happen in those).
WARMUP, STEPS = 3, 20
ACCUMULATING_STEPS = 3  # the seed's batch-1 tiers: 32 micro-batches a step, launch-bound on any GPU
PROFILED = ("bf16", "4gb")  # one step each under torch.profiler, after the timed ones (`StepProfiler`)


@dataclass(frozen=True)
class Variant:
    """A proof row that is a shipped recipe with other settings: a path no recipe runs as it ships."""

    recipe: str
    args: tuple[str, ...]
    why: str


_LOSS_PER_STEP = "--trainer.log_every_n_steps=1"  # the loss curve of the fp16 pair, compared step by step
VARIANTS = {
    "bf16-compile": Variant("bf16", ("--model.compile=true",), "bf16.yaml with every layer compiled (regional)"),
    # Every layer checkpointed in full in both: the same recompute, so the loss curves compare step by step (selective
    # layers cannot run the fused step's measuring backward: `lit_memory.memory.planning.recompute.check_twice`).
    "4gb-fp16": Variant(
        "4gb", ("--trainer.precision=16-mixed", "--memory.budget=gtx1650", "--model.gradient_checkpointing=true",
                _LOSS_PER_STEP),
        "4gb.yaml in fp16 capped as a GTX 1650 (3.81 GiB, no bf16): the fused step with loss scaling",
    ),
    "4gb-fp16-unfused": Variant(
        "4gb", ("--trainer.precision=16-mixed", "--memory.budget=null", "--model.gradient_checkpointing=true",
                "--trainer.strategy.init_args.fused=false", _LOSS_PER_STEP),
        "the same unfused (Lightning's GradScaler), uncapped (all its gradients do not fit 3.81 GiB): the loss curve "
        "4gb-fp16's is compared with",
    ),
    "2gb-2560mib": Variant("2gb", ("--memory.budget=2560MiB",), "2gb.yaml at 2.5 GiB, which an H100's context leaves room for"),
    "fsdp": Variant(
        "4gb", ("--config", str(ROOT / "configs" / "fsdp.yaml"), "--trainer.devices=1"),
        "4gb.yaml under FSDP2 on one GPU, capped as its 4 GB card: the FSDP2 stream code on a real device, within the "
        "card (one rank starts no NCCL communicator, whose 0.8 GiB outside the allocator once overflowed it: docs/gpu.md)",
    ),
    "4gb-snapshot": Variant(
        "4gb", ("--memory.snapshot=memory_snapshot.pickle",),
        "4gb.yaml with torch's CUDA memory snapshot of its first 2 optimizer steps (pytorch.org/memory_viz draws it)",
    ),
}
ROWS = 1280  # synthetic texts: one epoch holds every step a run takes (no epoch boundary inside the timed steps)
WORDS = 200  # per text: more WordPiece tokens than max_length, so every row is full


def synthetic_csv(path: Path, rows: int = ROWS, seed: int = 0) -> Path:
    """Random words from BERT-large's vocabulary, two labels: every row truncates to a full 128-token sequence."""
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


def recipe_of(entry: str) -> str:
    """The shipped recipe an entry runs: a variant's, else the entry itself."""
    return VARIANTS[entry].recipe if entry in VARIANTS else entry


def extra_args(entry: str) -> list[str]:
    """After the proof's own arguments: the tier's budget, then a variant's settings (a variant's budget wins)."""
    return [*budget_args(recipe_of(entry)), *(VARIANTS[entry].args if entry in VARIANTS else ())]


def budget_of(args: list[str]) -> Optional[str]:
    """The last ``--memory.budget=`` in a run's arguments (the one that applies), else None."""
    found = [a.split("=", 1)[1] for a in args if a.startswith("--memory.budget=")]
    return found[-1] if found else None


def timed_steps(resolved: Any) -> int:
    return STEPS if resolved.settings.trainer.accumulate_grad_batches == 1 else ACCUMULATING_STEPS


def profile_args(entry: str) -> list[str]:
    """One step after the timed ones under torch.profiler, for the `PROFILED` recipes (none accumulates: `STEPS`)."""
    if entry not in PROFILED:
        return []
    callback = {"class_path": "lit_memory.step_profile.StepProfiler", "init_args": {"warmup": WARMUP + STEPS, "trace": True}}
    return [f"--trainer.max_steps={WARMUP + STEPS + 1}", f"--trainer.callbacks+={json.dumps(callback)}"]


def entries_of(names: str) -> list[str]:
    """``all``: every shipped recipe (the seed's tiers first) and every variant; else the names as given, in order."""
    if names.strip() == "all":
        return [*ordered("all"), *VARIANTS]
    entries = [n.strip() for n in names.split(",") if n.strip()]
    for entry in entries:
        if entry not in VARIANTS:
            ordered(entry)  # an unknown recipe: one error line
    if len(set(entries)) != len(entries) or not entries:
        raise UserError(f"--recipes {names!r}: give `all` or distinct recipe and variant names ({', '.join(VARIANTS)})")
    return entries


def gpu_name() -> str:
    """This machine's GPU as a file name: its catalogue key (``h100``), else torch's name made safe."""
    card = target("cuda").gpu
    return card.key or re.sub(r"[^a-z0-9.-]+", "-", card.name.lower()).strip("-")


def proof_row(recipe: str, bench_row: dict[str, Any], run_dir: Path, budget: Optional[str]) -> dict[str, Any]:
    """One recipe's measured levels against its prediction (from its ``memory.json``), its speed and, under a
    budget, whether the device total stayed within it."""
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
    # max_memory_allocated counts the cuBLAS workspaces too: the prediction's allocated level (records before
    # it existed hold the tensors alone)
    expected = {"tensors": predicted.get("allocated_bytes") or predicted.get("peak_bytes"), "reserved": predicted.get("reserved_bytes"),
                "device": predicted.get("device_bytes")}
    row.update(
        device_source=cuda.get("device_source"),
        measured_bytes=measured,
        predicted_bytes=expected,
        measured_over_predicted={
            k: round(measured[k] / expected[k], 4) if measured[k] and expected[k] else None for k in measured
        },
        peak_phase=cuda.get("peak_phase"),
        oom=(memory.get("oom") or None) is not None,
        **{k: bench_row.get(k) for k in SPEED_KEYS if bench_row.get(k) is not None},
    )
    row.update(utilisation(bench_row, memory))
    losses = train_losses(run_dir)
    if losses:
        row["train_loss"] = losses
    if budget and measured["device"]:
        limit = capacity(budget)
        by_step = cuda.get("device_bytes_by_step") or []
        row["within_budget"] = measured["device"] <= limit
        row["spare"] = round(1 - measured["device"] / limit, 4)
        if by_step:  # the device total read at every phase, its highest per optimizer step
            row["within_budget_every_step"] = all(b <= limit for b in by_step)
            row["device_bytes_by_step"] = by_step
    snapshot = run_dir / "memory_snapshot.pickle"  # the 4gb-snapshot variant's (`lit_memory.run_memory.MemorySnapshot`)
    if snapshot.is_file():
        row["snapshot"] = {"file": str(snapshot), "bytes": snapshot.stat().st_size}
    profile = run_dir / "profile.json"
    if profile.is_file():
        row["profile"] = json.loads(profile.read_text(encoding="utf-8"))
    return row


SPEED_KEYS = (
    "samples_per_s", "step_time_s", "step_time_min_s", "step_time_max_s", "step_time_iqr_s", "timed_steps", "clock",
    "flops_per_step", "recompute_share", "peer_samples_per_s", "peer_step_time_s", "samples_per_s_ours_over_peer",
    "peer_note", "peer_peak_bytes", "peer_reserved_bytes",
)


def peak_tflops(device_name: str, total: int, precision: str) -> tuple[Optional[float], str]:
    """The card's dense peak for a precision (16-bit tensor cores, else plain fp32), from the catalogue."""
    card = match(device_name, (0, 0), total)
    half = any(p in precision for p in ("16", "bf16"))
    peak = card.tflops if half else card.fp32_tflops
    return (peak if card.key else None), ("bf16/fp16 dense" if half else "fp32")


def utilisation(bench_row: dict[str, Any], memory: dict[str, Any]) -> dict[str, Any]:
    """Model FLOPs utilisation: the step's counted FLOPs without recompute over its time, against the card's peak
    for the run's precision (hardware FLOPs utilisation: recompute counted too)."""
    flops, step = bench_row.get("flops_per_step"), bench_row.get("step_time_s")
    precision = str(bench_row.get("precision") or "")
    device = memory.get("device") or {}
    if not flops or not step or not device.get("name"):
        return {}
    peak, kind = peak_tflops(device["name"], device.get("total_bytes") or 0, precision)
    if not peak:
        return {}
    share = bench_row.get("recompute_share") or 0.0
    achieved = flops / step / 1e12
    return {"tflops_achieved": round(achieved, 2), "peak_tflops": peak, "peak_kind": kind,
            "mfu": round(achieved * (1 - share) / peak, 4), "hfu": round(achieved / peak, 4)}


def train_losses(run_dir: Path) -> list[float]:
    """The training loss of every logged step (metrics.csv), in order."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]


def write_proof(rows: list[dict[str, Any]], info: dict[str, Any], path: Path) -> None:
    files.write_text(path, json.dumps({**info, "recipes": rows}, indent=2) + "\n")


def main(user_args: list[str], out: Path, dry_run: bool, names: str = "all", peer: bool = False) -> None:
    if not dry_run and not torch.cuda.is_available():
        raise UserError("--gpu-proof trains on a CUDA GPU and this machine has none (--dry-run resolves it anywhere)")
    if shipped.recipes_dir() != shipped.CHECKOUT:
        raise UserError("--gpu-proof writes docs/gpu/ of a checkout: run it from a clone of the repository")
    entries = entries_of(names)
    data = synthetic_csv(out / "synthetic.csv")
    extras = {e: extra_args(e) for e in entries}
    runs = prepare(
        entries, [*proof_args(data), *user_args], out, WARMUP, STEPS, False, "hf-trainer" if peer else None,
        extra=lambda name: extras[name], simulate=False, count_flops=True, steps_for=timed_steps,
        tail=profile_args, recipe_of=recipe_of, keep_going=True,
    )
    command = shlex.join(["python", "-m", "lit_memory", "bench", "--gpu-proof", *(["--dry-run"] if dry_run else []),
                          *(["--peer"] if peer else []), *([] if names == "all" else [f"--recipes={names}"]), *user_args])
    plan = [{"recipe": r.recipe, "fit": shlex.join(["python", "-m", "lit_memory", "fit", *r.fit_args]),
             **({"variant_of": VARIANTS[r.recipe].recipe, "why": VARIANTS[r.recipe].why} if r.recipe in VARIANTS else {})}
            for r in runs]
    if dry_run:
        files.write_text(out / "gpu-proof-runs.json", json.dumps({"command": command, "runs": plan}, indent=2) + "\n")
        for run in plan:
            print(run["fit"])
        print(f"dry run: {len(plan)} runs resolved; the data is {data}; nothing trained")
        return
    target = DOCS / f"{gpu_name()}.json"
    if not target.parent.is_dir():  # a checkout has it (docs/gpu/README.md); a copy without it gets it back
        target.parent.mkdir(parents=True)
    info: dict[str, Any] = {
        "command": command,
        "note": "BERT-large from its config (random weights), batch as each recipe states, synthetic 128-token rows; "
        f"{WARMUP} warm-up + {STEPS} timed optimizer steps ({ACCUMULATING_STEPS} for recipes that accumulate), timed "
        "with CUDA events (median, min, max, quartiles); a recipe with memory.tier runs with it as memory.budget "
        "(rtx3050-4gb emulated: allocator capped at its capacity less the CUDA context); measured: "
        "max_memory_allocated (tensors), max_memory_reserved, the device level as device_source says; mfu: counted "
        "FLOPs without recompute per second over the card's dense peak for the precision (hfu: recompute counted); "
        f"{', '.join(PROFILED)}: one more step under torch.profiler (profile); peer: transformers.Trainer, same "
        "settings, timed the same way",
        "variants": {name: {"recipe": v.recipe, "args": list(v.args), "why": v.why} for name, v in VARIANTS.items()},
        "optimizer_kernels": "fused",  # torch's Adam/AdamW on their fused CUDA kernel (lit_memory's default since 2026-11-27)
    }

    def save(done: list[dict]) -> None:  # after every recipe: an interrupted proof keeps what it measured
        rows = [proof_row(r["recipe"], r, p.run_dir, budget_of(p.fit_args)) for r, p in zip(done, runs)]
        write_proof(rows, {**info, "machine": machine(done)}, target)

    rows = bench(runs, out, WARMUP, STEPS, False, "hf-trainer" if peer else None, save)
    print(f"wrote {target}")
    for row in json.loads(target.read_text(encoding="utf-8"))["recipes"]:
        levels = row.get("measured_over_predicted") or {}
        print(f"{row['recipe']:>16}: measured/predicted " + ", ".join(f"{k} {v}" for k, v in levels.items())
              + (f"; {row['samples_per_s']:.1f} samples/s" if row.get("samples_per_s") else "")
              + (f", mfu {row['mfu']:.1%}" if row.get("mfu") else "")
              + (f"; peer {row['peer_samples_per_s']:.1f}" if row.get("peer_samples_per_s") else "")
              + (f"; error: {row['error']}" if row.get("error") else ""))
    failed = [r["recipe"] for r in rows if r.get("error")]
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out / 'logs'})", file=sys.stderr)


def table(record: dict[str, Any]) -> str:
    """A record as the markdown table docs/gpu.md shows: measured GiB and measured/predicted per level, the phase of
    the allocator's peak, speed, model FLOPs utilisation and the HF Trainer's speed where they were measured."""
    gib = 2**30
    lines = ["| recipe | budget | tensors GiB (x pred.) | reserved GiB (x pred.) | device GiB (x pred.) | peak in | samples/s "
             "| MFU | HF Trainer samples/s | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in record["recipes"]:
        measured, ratio = row.get("measured_bytes") or {}, row.get("measured_over_predicted") or {}
        cells = [f"{measured[k] / gib:.2f} ({ratio[k]:.3f})" if measured.get(k) and ratio.get(k) else "-"
                 for k in ("tensors", "reserved", "device")]
        note = row.get("error") or (f"within the card, {row['spare']:.1%} to spare" if row.get("within_budget")
                                    else "over the card" if row.get("within_budget") is False else "")
        speed = f"{row['samples_per_s']:.1f}" if row.get("samples_per_s") else "-"
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") else "-"
        peer = f"{row['peer_samples_per_s']:.1f}" if row.get("peer_samples_per_s") else "-"
        lines.append(f"| {row['recipe']} | {row.get('budget') or '-'} | " + " | ".join(cells)
                     + f" | {row.get('peak_phase') or '-'} | {speed} | {mfu} | {peer} | {note} |")
    return "\n".join(lines)


def cli(argv: list[str]) -> None:
    """``bench --gpu-proof [--dry-run] [--out DIR] [--recipes a,b]``; other arguments go to every recipe's fit."""
    parser = argparse.ArgumentParser(
        prog="python -m lit_memory bench --gpu-proof", allow_abbrev=False,
        description="Every recipe a few steps on BERT-large from its config on this GPU, the tiers capped at their "
        "cards (4gb.yaml: rtx3050-4gb emulated); writes docs/gpu/<gpu>.json (docs/gpu.md).",
    )
    parser.add_argument("--gpu-proof", action="store_true", required=True)
    parser.add_argument("--dry-run", action="store_true", help="resolve every run and write the data; train nothing")
    parser.add_argument("--out", type=Path, default=Path("bench"), help="runs, logs and data (default bench/)")
    parser.add_argument("--recipes", default="all", help=f"`all` or a,b,c: recipes and variants ({', '.join(VARIANTS)}), in that order")
    parser.add_argument("--peer", action="store_true", help="also train each recipe with transformers.Trainer where it has an equivalent")
    parser.add_argument("--show", type=Path, metavar="RECORD", help="print a record (docs/gpu/<gpu>.json) as a table")
    args, user_args = parser.parse_known_args(argv)
    if args.show:
        print(table(json.loads(args.show.read_text(encoding="utf-8"))))
        return
    main(user_args, args.out, args.dry_run, args.recipes, args.peer)


def tier_of_args(args: list[str]) -> Optional[str]:
    return args[0].split("=", 1)[1] if args else None

