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

A lent GPU's call (docs/gpu.md, examples/gpu_speed.sh): ``--recipes call1`` or ``call2`` (`CALLS`: the rows in order
of importance, call 1 starting with the sandbox probe, `PROBE`), ``--deadline SECONDS`` (each row may take what is
left of the call, `lit_memory.tools.bench.Deadline`; a row that cannot start says so), ``--mirror DIR`` (the record,
its tables and the logs copied there after every row: what a cut call brings back), ``--append`` (call 2's rows
added to call 1's record of the same card). ``--rehearse`` runs all of it on a CPU with every process faked
(`rehearsal_runner`): the record goes to ``--out``, not docs/gpu/.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import random
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from lit_memory import files
from lit_memory.config import shipped
from lit_memory.errors import UserError
from lit_memory.hf.bundled import resolve_model
from lit_memory.memory.hardware.gpus import capacity, match, target
from lit_memory.memory.measure import records
from lit_memory.sandbox.bounds import read_yaml
from lit_memory.tools.bench import Deadline, Runner, _run, bench, counted_step, ordered, prepare, recipe_file
from lit_memory.tools.bench_table import machine
from lit_memory.tools.proof_tables import (
    DOCS,
    ROOT,
    STEPS,
    WARMUP,
    _trained,
    newest_record,
    speed_table,
    table,
    update_readme,
)

MODEL = ["--model.model_name_or_path=bundled:bert-large", "--model.pretrained=false"]  # configs/bert-large.yaml's
ACCUMULATING_STEPS = 3  # the seed's batch-1 tiers: 32 micro-batches a step, launch-bound on any GPU
# one step each under torch.profiler, after the timed ones and the one whose host operators are counted (`StepProfiler`)
PROFILED = ("bf16", "4gb", "bf16-compile", "4gb-compile")


@dataclass(frozen=True)
class Variant:
    """A proof row that is a shipped recipe with other settings: a path no recipe runs as it ships."""

    recipe: str
    args: tuple[str, ...]
    why: str


_LOSS_PER_STEP = "--trainer.log_every_n_steps=1"  # the loss curve of the fp16 pair, compared step by step
VARIANTS = {
    # Every layer checkpointed in full in both: the same recompute, so the loss curves compare step by step (selective
    # layers cannot run the fused step's measuring backward: `lit_memory.planning.recompute.check_twice`).
    "4gb-fp16": Variant(
        "4gb",
        (
            "--trainer.precision=16-mixed",
            "--memory.budget=gtx1650",
            "--model.gradient_checkpointing=true",
            _LOSS_PER_STEP,
        ),
        "4gb.yaml in fp16 capped as a GTX 1650 (3.81 GiB, no bf16): the fused step with loss scaling",
    ),
    "4gb-fp16-unfused": Variant(
        "4gb",
        (
            "--trainer.precision=16-mixed",
            "--memory.budget=null",
            "--model.gradient_checkpointing=true",
            "--trainer.strategy.init_args.fused=false",
            _LOSS_PER_STEP,
        ),
        "the same unfused (Lightning's GradScaler), uncapped (all its gradients do not fit 3.81 GiB): the loss curve "
        "4gb-fp16's is compared with",
    ),
    "2gb-2560mib": Variant(
        "2gb", ("--memory.budget=2560MiB",), "2gb.yaml at 2.5 GiB, which an H100's context leaves room for"
    ),
    "fsdp": Variant(
        "4gb",
        ("--config", str(ROOT / "configs" / "fsdp.yaml"), "--trainer.devices=1"),
        "4gb.yaml under FSDP2 on one GPU, capped as its 4 GB card: the FSDP2 stream code on a real device, within the "
        "card (one rank starts no NCCL communicator, whose 0.8 GiB outside the allocator once overflowed it: "
        "docs/gpu.md)",
    ),
    "4gb-snapshot": Variant(
        "4gb",
        ("--memory.snapshot=memory_snapshot.pickle", "--memory.snapshot_steps=2"),
        "4gb.yaml capped as its card, with torch's CUDA memory history of its first 2 steps (pytorch.org/memory_viz)",
    ),
}


@dataclass(frozen=True)
class PeerRow:
    """A proof row that is the HF Trainer alone (`lit_memory.tools.peer`), on a shipped recipe's model and data."""

    recipe: str
    flags: tuple[str, ...]
    why: str


PEER_ROWS = {
    "4gb-peer": PeerRow(
        "4gb", ("--best-under-budget",),
        "what a 4 GB-card user runs instead of 4gb.yaml: the HF Trainer's best configuration within the same cap "
        "(every layer recomputed, adamw_bnb_8bit, bf16, the largest micro-batch predicted to fit, accumulating to 32; "
        "bf16 weights where fp32 ones cannot fit), capped exactly as ours (`lit_memory.tools.peer.best_under_budget`)",
    ),
}
# The sandbox probe (examples/gpu_sandbox_probe.py): a child confined as an untrusted config's run is, using the GPU;
# a row of its own, bounded, first in call 1: the shipped recipes the proof runs are trusted (no confinement), so
# the speed rows never wait on it.
PROBE = "sandbox-probe"
PROBE_SECONDS = 45
PROBE_STEPS = ("cuda", "matmul", "nvml", "transformers", "lit_memory.model")
# A lent GPU's two calls (docs/gpu.md): the rows in order of importance, each call within its limit (`Deadline`).
CALLS = {
    "call1": (PROBE, "bf16", "4gb", "4gb-peer", "baseline", "8bit"),
    "call2": ("bf16-compile", "4gb-compile", "fsdp", "4gb-fp16", "2gb-2560mib", "4gb-snapshot"),
}
LEAST_S = 30  # a process started with less is stopped before its numbers exist (the H100's rows took 26-35 s)
REHEARSAL_S = 0.05  # what each faked process of a rehearsal takes
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
    """The shipped recipe an entry runs: a variant's or a peer row's, else the entry itself."""
    named = VARIANTS.get(entry) or PEER_ROWS.get(entry)
    return named.recipe if named is not None else entry


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
    """One step under torch.profiler after the timed ones and the counted one (`bench.counted_step`), for the
    `PROFILED` recipes (none accumulates: `STEPS`)."""
    if entry not in PROFILED:
        return []
    step = counted_step(WARMUP, STEPS) + 1
    callback = {"class_path": "lit_memory.run.step_profile.StepProfiler", "init_args": {"warmup": step, "trace": True}}
    return [f"--trainer.max_steps={step + 1}", f"--trainer.callbacks+={json.dumps(callback)}"]


def entries_of(names: str) -> list[str]:
    """``all``: every shipped recipe (the seed's tiers first), every variant and peer row; ``call1``/``call2``: a lent
    GPU's call (`CALLS`); else the names as given, in order (`PROBE` among them)."""
    if names.strip() == "all":
        return [*ordered("all"), *VARIANTS, *PEER_ROWS]
    if names.strip() in CALLS:
        return list(CALLS[names.strip()])
    entries = [n.strip() for n in names.split(",") if n.strip()]
    for entry in entries:
        if entry not in VARIANTS and entry not in PEER_ROWS and entry != PROBE:
            ordered(entry)  # an unknown recipe: one error line
    if len(set(entries)) != len(entries) or not entries:
        raise UserError(f"--recipes {names!r}: give `all`, {' or '.join(CALLS)}, or distinct recipe, variant and peer "
                        f"row names ({', '.join([*VARIANTS, *PEER_ROWS, PROBE])})")
    return entries


def gpu_name() -> str:
    """This machine's GPU as a file name: its catalogue key (``h100``), else torch's name made safe."""
    card = target("cuda").gpu
    return card.key or re.sub(r"[^a-z0-9.-]+", "-", card.name.lower()).strip("-")


CALL_KEYS = ("limit_s", "peer_limit_s", "row_s")  # a row's share of a call (`lit_memory.tools.bench.Deadline`)


def proof_row(recipe: str, bench_row: dict[str, Any], run_dir: Path, budget: Optional[str]) -> dict[str, Any]:
    """One recipe's measured levels against its prediction (from its ``memory.json``), its speed and, under a
    budget, whether the device total stayed within it."""
    row: dict[str, Any] = {"recipe": recipe, "budget": budget, "error": bench_row.get("error"),
                           **{k: bench_row[k] for k in CALL_KEYS if k in bench_row}}
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
    expected = {
        "tensors": predicted.get("allocated_bytes") or predicted.get("peak_bytes"),
        "reserved": predicted.get("reserved_bytes"),
        "device": predicted.get("device_bytes"),
    }
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
    row.update(allocator_counts(cuda))
    if budget and measured["device"]:
        limit = capacity(budget)
        row["within_budget"] = measured["device"] <= limit
        row["spare"] = round(1 - measured["device"] / limit, 4)
        row.update(every_step(cuda.get("device_bytes_by_step") or [], memory.get("optimizer_steps"), limit))
    # the 4gb-snapshot variant's (`lit_memory.run.memory_callbacks.MemorySnapshot`)
    snapshot = run_dir / "memory_snapshot.pickle"
    if snapshot.is_file():
        row["snapshot"] = {"file": str(snapshot), "bytes": snapshot.stat().st_size}
    profile = run_dir / "profile.json"
    if profile.is_file():
        row["profile"] = json.loads(profile.read_text(encoding="utf-8"))
    return row


def every_step(by_step: list[Optional[int]], steps: Optional[int], limit: int) -> dict[str, Any]:
    """Whether the device total stayed within ``limit`` in every optimizer step the run took: each step read (the
    monitor reads every step's end; a step never read is null) and within it. A run whose steps are not all in
    ``by_step`` (fewer readings than ``steps``) or any of them null has not shown it."""
    unread = [i for i, b in enumerate(by_step) if b is None] + list(range(len(by_step), steps or len(by_step)))
    return {
        "within_budget_every_step": bool(by_step) and not unread and all(b <= limit for b in by_step),
        "device_bytes_by_step": by_step,
        **({"unread_steps": unread} if unread else {}),
    }


def allocator_counts(cuda: dict[str, Any]) -> dict[str, Any]:
    """The allocator's per-step counts the monitor recorded (cudaMalloc retries near a cap, cudaMalloc/cudaFree calls),
    the retries per step after warm-up (the GPU goal: none), and under a cap the room it never used: its cap less
    its reserved peak (`lit_memory.run.monitor.allocator_cap`)."""
    found = {key: cuda[key] for key in ("alloc_retries_by_step", "device_allocs_by_step", "device_frees_by_step")
             if cuda.get(key) is not None}
    found.update(retry_rates(found.get("alloc_retries_by_step")))
    cap, reserved = cuda.get("allocator_cap_bytes"), cuda.get("max_reserved_bytes")
    if cap:
        found.update(allocator_cap_bytes=cap, cap_headroom_bytes=cap - reserved if reserved else None)
    return found


def retry_rates(by_step: Optional[list[Optional[int]]]) -> dict[str, float]:
    """Retries per step and per 10 steps after the warm-up steps (a step not read left out)."""
    retries = [r for r in (by_step or [])[WARMUP:] if r is not None]
    if not retries:
        return {}
    return {"alloc_retries_per_step": round(sum(retries) / len(retries), 3),
            "alloc_retries_per_10_steps": round(10 * sum(retries) / len(retries), 3)}


def peer_row(name: str, bench_row: dict[str, Any], budget: Optional[str], card: dict[str, Any]) -> dict[str, Any]:
    """A `PEER_ROWS` row: the Trainer's run alone, its speed, memory and host operators, its every setting and why
    they were chosen, and under a budget whether its device total stayed within the card every step. Its MFU counts
    the model's FLOPs (the recipe's samples per step; recompute apart) on ``card`` (name, total_bytes)."""
    peer = {k[len("peer_"):]: v for k, v in bench_row.items() if k.startswith("peer_")}
    row: dict[str, Any] = {
        "recipe": name,
        "budget": budget,
        "error": bench_row.get("error"),
        "peer_of": PEER_ROWS[name].recipe,
        "precision": (peer.get("chosen") or {}).get("precision"),
        **{k: bench_row[k] for k in CALL_KEYS if k in bench_row},
    }
    row.update({k: v for k, v in peer.items() if k in SPEED_KEYS or k in PEER_KEYS})
    share = bench_row.get("recompute_share") or 0.0
    speed = {"flops_per_step": (bench_row.get("flops_per_step") or 0) * (1 - share) or None,
             "step_time_s": row.get("step_time_s"), "precision": "bf16-mixed"}
    found = utilisation(speed, {"device": card})
    # its own recompute: not counted
    row.update({k: v for k, v in found.items() if k not in ("hfu", "tflops_achieved")})
    if peer.get("alloc_retries_by_step") is not None:  # counted as ours are
        row["alloc_retries_by_step"] = peer["alloc_retries_by_step"]
        row.update(retry_rates(peer["alloc_retries_by_step"]))
    if peer.get("allocator_limit_bytes") and peer.get("reserved_bytes"):
        row.update(allocator_cap_bytes=peer["allocator_limit_bytes"],
                   cap_headroom_bytes=peer["allocator_limit_bytes"] - peer["reserved_bytes"])
    by_step = peer.get("device_bytes_by_step")
    if budget and by_step:
        limit = capacity(budget)
        device = max((b for b in by_step if b is not None), default=None)
        row.update(within_budget=device is not None and device <= limit, peak_device_bytes=device,
                   spare=None if device is None else round(1 - device / limit, 4),
                   **every_step(by_step, len(by_step), limit))
    return row


PEER_KEYS = ("peak_bytes", "reserved_bytes", "training_arguments", "chosen", "allocator_limit_bytes",
             "host_ops_per_step", "top_host_ops")


def with_peer_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A recipe whose Trainer equivalent is a `PEER_ROWS` row gets that row's speed as its peer (4gb: 4gb-peer)."""
    by_name = {row["recipe"]: row for row in rows}
    for name, peer in PEER_ROWS.items():
        ours, theirs = by_name.get(peer.recipe), by_name.get(name)
        if ours is None or theirs is None or not theirs.get("samples_per_s"):
            continue
        ours.update(peer_samples_per_s=theirs["samples_per_s"], peer_step_time_s=theirs.get("step_time_s"),
                    peer_note=f"{name}: {PEER_ROWS[name].why.split(':')[0]}",
                    peer_host_ops_per_step=theirs.get("host_ops_per_step"))
        if ours.get("samples_per_s"):
            ours["samples_per_s_ours_over_peer"] = round(ours["samples_per_s"] / theirs["samples_per_s"], 4)
    return rows


SPEED_KEYS = (
    "samples_per_s", "step_time_s", "step_time_min_s", "step_time_max_s", "step_time_iqr_s", "timed_steps", "clock",
    "compile_s", "flops_per_step", "recompute_share", "host_ops_per_step", "top_host_ops",
    "peer_samples_per_s", "peer_step_time_s", "samples_per_s_ours_over_peer", "peer_note", "peer_peak_bytes",
    "peer_reserved_bytes", "peer_host_ops_per_step", "peer_top_host_ops", "host_ops_ours_over_peer",
    "peer_training_arguments",
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


def main(user_args: list[str], out: Path, dry_run: bool, names: str = "all", peer: bool = False,
         record: Optional[str] = None, deadline: Optional[float] = None, mirror: Optional[Path] = None,
         append: bool = False, rehearse: bool = False) -> None:
    # from the proof's start (resolving the runs takes of it too); no process starts with less than a row needs
    limit = Deadline(deadline, least=LEAST_S) if deadline else None
    if not dry_run and not rehearse and not torch.cuda.is_available():
        raise UserError("--gpu-proof trains on a CUDA GPU and this machine has none (--dry-run resolves it anywhere; "
                        "--rehearse runs a call's plumbing with every process faked)")
    if shipped.recipes_dir() != shipped.CHECKOUT:
        raise UserError("--gpu-proof writes docs/gpu/ of a checkout: run it from a clone of the repository")
    entries = entries_of(names)
    probe = PROBE in entries
    entries = [e for e in entries if e != PROBE]
    command = shlex.join(["python", "-m", "lit_memory", "bench", "--gpu-proof", *(["--dry-run"] if dry_run else []),
                          *(["--rehearse"] if rehearse else []), *(["--peer"] if peer else []),
                          *([] if names == "all" else [f"--recipes={names}"]),
                          *([f"--deadline={deadline:g}"] if deadline else []), *user_args])
    run: Runner = rehearsal_runner if rehearse else _run
    (out / "logs").mkdir(parents=True, exist_ok=True)
    call = None if dry_run else new_call(out, record, mirror, append, rehearse, entries, _info(command, deadline))
    first = [probe_row(out, limit, run)] if call is not None and probe else []
    if first:
        call.save(first)
    data = synthetic_csv(out / "synthetic.csv")
    extras = {e: extra_args(e) for e in entries}
    runs = prepare(
        entries, [*proof_args(data), *user_args], out, WARMUP, STEPS, False, "hf-trainer" if peer else None,
        extra=lambda name: extras[name], simulate=False, count_flops=True, steps_for=timed_steps,
        tail=profile_args, recipe_of=recipe_of, keep_going=True,
    )
    runs = [dataclasses.replace(r, peer_only=True, peer_flags=PEER_ROWS[r.recipe].flags, peer_note=None)
            if r.recipe in PEER_ROWS else r for r in runs]
    plan = [{"recipe": r.recipe, **_how(r)} for r in runs]
    if dry_run:
        files.write_text(out / "gpu-proof-runs.json", json.dumps({"command": command, "runs": plan}, indent=2) + "\n")
        for run_ in plan:
            print(run_.get("fit") or run_["peer"])
        print(f"dry run: {len(plan)} runs resolved; the data is {data}; nothing trained")
        return

    rows = run_call(call, runs, first, out, peer, limit, run)
    print(f"wrote {call.target}" + (f" (and its copy, tables and logs in {mirror})" if mirror else ""))
    for row in json.loads(call.target.read_text(encoding="utf-8"))["recipes"]:
        levels = row.get("measured_over_predicted") or {}
        print(f"{row['recipe']:>16}: measured/predicted " + ", ".join(f"{k} {v}" for k, v in levels.items())
              + (f"; {row['samples_per_s']:.1f} samples/s" if row.get("samples_per_s") else "")
              + (f", mfu {row['mfu']:.1%}" if row.get("mfu") else "")
              + (f"; peer {row['peer_samples_per_s']:.1f}" if row.get("peer_samples_per_s") else "")
              + (f"; took {row['row_s']:.0f} s" if row.get("row_s") is not None else "")
              + (f"; error: {row['error']}" if row.get("error") else ""))
    failed = [r["recipe"] for r in rows if r.get("error")]
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {out / 'logs'})", file=sys.stderr)


def new_call(out: Path, record: Optional[str], mirror: Optional[Path], append: bool, rehearse: bool,
             entries: list[str], info: dict[str, Any]) -> "Call":
    """This call's record: docs/gpu/<gpu>[-record].json (a rehearsal's in ``out``), with an earlier call's rows on the
    same card where ``append`` (but those this call runs again)."""
    card = ({"name": "rehearsal (no GPU)", "total_bytes": 0} if rehearse else
            {"name": torch.cuda.get_device_name(), "total_bytes": torch.cuda.get_device_properties(0).total_memory})
    name = "rehearsal" if rehearse else gpu_name()
    target = (out if rehearse else DOCS) / f"{name}{f'-{record}' if record else ''}.json"
    earlier = previous_record(target, card) if append else None
    kept = [row for row in earlier["recipes"] if row["recipe"] not in entries] if earlier else []
    calls = (earlier.get("calls") or [earlier["command"]]) if earlier else []
    return Call(target, mirror, card, info, out / "logs", kept, calls)


def run_call(call: "Call", runs: list[Any], first: list[dict[str, Any]], out: Path, peer: bool,
             deadline: Optional[Deadline], run: Runner) -> list[dict[str, Any]]:
    """The proof's rows after ``first`` (the probe's), in order, each within what is left of ``deadline``, the call's
    record saved after every row (`Call.save`: an interrupted proof keeps what it measured); ``run`` runs a process."""

    def save(done: list[dict]) -> None:
        rows = [peer_row(r["recipe"], r, budget_of(p.fit_args), call.card) if p.peer_only
                else proof_row(r["recipe"], r, p.run_dir, budget_of(p.fit_args)) for r, p in zip(done, runs)]
        call.save([*first, *rows], machine(done))

    rows = bench(runs, out, WARMUP, STEPS, False, "hf-trainer" if peer else None, save, deadline=deadline, run=run)
    if not rows:
        call.save(first)
    return rows


def _info(command: str, deadline: Optional[float]) -> dict[str, Any]:
    return {
        "command": command,
        "date": datetime.date.today().isoformat(),  # the newest record is the README's (`lit_memory.tools.speed`)
        **({"deadline_s": deadline} if deadline else {}),
        "note": "BERT-large from its config (random weights), batch as each recipe states, synthetic 128-token rows; "
        f"{WARMUP} warm-up + {STEPS} timed optimizer steps ({ACCUMULATING_STEPS} for recipes that accumulate), timed "
        "with CUDA events (median, min, max, quartiles); a recipe with memory.tier runs with it as memory.budget "
        "(rtx3050-4gb emulated: allocator capped at its capacity less the CUDA context); measured: "
        "max_memory_allocated (tensors), max_memory_reserved, the device level as device_source says; mfu: counted "
        "FLOPs without recompute per second over the card's dense peak for the precision (hfu: recompute counted); "
        f"{', '.join(PROFILED)}: one more step under torch.profiler (profile); peer: transformers.Trainer, same "
        "settings, timed the same way; alloc_retries_by_step: the allocator's cache released and a request retried, "
        "per optimizer step; cap_headroom_bytes: the allocator's cap less its reserved peak; limit_s, row_s: the "
        "seconds a row was given of its call and took",
        "variants": {name: {"recipe": v.recipe, "args": list(v.args), "why": v.why} for name, v in VARIANTS.items()},
        "peer_rows": {
            name: {"recipe": v.recipe, "flags": list(v.flags), "why": v.why} for name, v in PEER_ROWS.items()
        },
        # torch's Adam/AdamW on their fused CUDA kernel (lit_memory's default since 2026-11-27)
        "optimizer_kernels": "fused",
        # host_ops_per_step: dispatcher operators of the step after the timed ones, ours and the peer's counted alike
        # (lit_memory.run.step_profile.HostOps); every step's end read (null: not read); allocator counts per step
        "host_ops": "lit_memory.run.step_profile.HostOps, one step after the timed ones, loading to logging",
    }


@dataclass
class Call:
    """Where one call's record goes after every row: ``target`` (docs/gpu/<gpu>[-NAME].json), and with ``mirror``
    (the lent machine's $OUT) a copy of it, its two tables and the rows' logs so far; rows of an earlier call on the
    same card (``previous``, `--append`) stay in it, but for those run again."""

    target: Path
    mirror: Optional[Path]
    card: dict[str, Any]
    info: dict[str, Any]
    logs: Optional[Path] = None  # the rows' logs (``<out>/logs``)
    previous: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    calls: list[str] = dataclasses.field(default_factory=list)  # the earlier calls' commands

    def save(self, rows: list[dict[str, Any]], machine_: Optional[dict[str, Any]] = None) -> None:
        names = {row["recipe"] for row in rows}
        kept = [row for row in self.previous if row["recipe"] not in names]
        info = {**self.info, "machine": {**(machine_ or machine([])), "device": self.card["name"]}}
        if self.calls:
            info["calls"] = [*self.calls, self.info["command"]]
        self.target.parent.mkdir(parents=True, exist_ok=True)  # a checkout has docs/gpu (its README); a copy may not
        write_proof(with_peer_rows([*kept, *rows]), info, self.target)
        if self.mirror is not None:
            mirror_call(self.target, self.mirror, self.logs)


def previous_record(target: Path, card: dict[str, Any]) -> Optional[dict[str, Any]]:
    """An earlier call's record at ``target`` (`--append`), where it is of the same card; else None."""
    if not target.is_file():
        return None
    record = json.loads(target.read_text(encoding="utf-8"))
    return record if (record.get("machine") or {}).get("device") == card["name"] else None


def mirror_call(target: Path, mirror: Path, logs: Optional[Path] = None) -> None:
    """The record, its tables (``--show``'s, ``--speed-table``'s) and the last 256 KiB of each of its rows' logs
    (``logs``) into ``mirror``: what a call cut by its limit still brings back."""
    mirror.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(target, mirror / target.name)
    record = json.loads(target.read_text(encoding="utf-8"))
    files.write_text(mirror / "table.md", table(record) + "\n")
    source = f"docs/gpu/{target.name}"
    files.write_text(mirror / "speed-table.md", speed_table(record, source) if _trained(record) else
                     "no row of ours trained: no speed table\n")
    if logs is not None and logs.is_dir():
        (mirror / "logs").mkdir(exist_ok=True)
        for log in logs.glob("*.log"):
            with open(log, "rb") as f:
                f.seek(max(log.stat().st_size - 256 * 1024, 0))
                files.write_bytes(mirror / "logs" / log.name, f.read())


def probe_row(out: Path, deadline: Optional[Deadline], run: Runner) -> dict[str, Any]:
    """The sandbox probe (examples/gpu_sandbox_probe.py) as a row: at most `PROBE_SECONDS` (less where the call has
    less left), each of its steps ok, failed or not reached, its output in ``logs/sandbox-probe.log``."""
    log = out / "logs" / f"{PROBE}.log"
    left = deadline.left() if deadline is not None else PROBE_SECONDS
    limit = max(min(PROBE_SECONDS, left), 1.0)
    clock = deadline.clock if deadline is not None else time.monotonic
    started = clock()
    error = run([sys.executable, str(ROOT / "examples" / "gpu_sandbox_probe.py")], log, timeout=limit)
    text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    return {"recipe": PROBE, "error": error, "limit_s": round(limit, 1), "row_s": round(clock() - started, 1),
            "probe": probe_steps(text)}


def probe_steps(text: str) -> dict[str, str]:
    """Each probe step's outcome from its output (``cuda ok ...``, ``nvml FAILED``): ok, failed, or not reached."""
    found = {}
    for step in PROBE_STEPS:
        line = next((line for line in text.splitlines() if line.startswith(f"{step} ")), "")
        found[step] = "ok" if line.startswith(f"{step} ok") else "failed" if "FAILED" in line else "not reached"
    return found


def rehearsal_runner(command: list[str], log: Path, timeout: Optional[float] = None) -> Optional[str]:
    """A process of a rehearsal (``--rehearse``): not run; its log says what would have run, within which limit."""
    files.write_text(log, f"rehearsal: would run {shlex.join(command)}\nlimit: {timeout} s\n")
    time.sleep(REHEARSAL_S)
    return "rehearsal: not run" + (f" (its limit {timeout:.0f} s)" if timeout is not None else "")


def _how(run: Any) -> dict[str, Any]:
    """The command a proof entry runs, and what it is a variant of."""
    if run.peer_only:
        peer = PEER_ROWS[run.recipe]
        command = ["python", "-m", "lit_memory.tools.peer", *peer.flags, *run.peer_args]
        return {"peer": shlex.join(command), "peer_of": peer.recipe, "why": peer.why}
    found = {"fit": shlex.join(["python", "-m", "lit_memory", "fit", *run.fit_args])}
    if run.error is not None:
        found["refused"] = run.error
    if run.recipe in VARIANTS:
        found.update(variant_of=VARIANTS[run.recipe].recipe, why=VARIANTS[run.recipe].why)
    return found


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
    parser.add_argument("--recipes", default="all", help=f"`all`, {' or '.join(CALLS)} (a lent GPU's call), or a,b,c: "
                        f"recipes, variants ({', '.join(VARIANTS)}), peer rows and {PROBE}, in that order")
    parser.add_argument(
        "--peer",
        action="store_true",
        help="also train each recipe with transformers.Trainer where it has an equivalent",
    )
    parser.add_argument("--show", type=Path, metavar="RECORD", help="print a record (docs/gpu/<gpu>.json) as a table")
    parser.add_argument(
        "--record", metavar="NAME", help="write docs/gpu/<gpu>-NAME.json (a record of its own) instead of <gpu>.json"
    )
    parser.add_argument("--speed-table", nargs="?", const=True, type=Path, metavar="RECORD",
                        help="print README's speed table from a record (default: the newest in docs/gpu/)")
    parser.add_argument("--update-readme", action="store_true", help="with --speed-table: write it into README.md")
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help="the time the rows may take in all, from the start: each row gets what is left of it")
    parser.add_argument("--mirror", type=Path, metavar="DIR",
                        help="after every row, copy the record, its tables and the rows' logs into DIR ($OUT)")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of an earlier call's record on the same card, but for those run again")
    parser.add_argument("--rehearse", action="store_true",
                        help="run the rows' plumbing on any machine, every process faked; the record goes to --out")
    args, user_args = parser.parse_known_args(argv)
    if args.show:
        print(table(json.loads(args.show.read_text(encoding="utf-8"))))
        return
    if args.speed_table:
        path = newest_record() if args.speed_table is True else args.speed_table
        source = f"docs/gpu/{path.name}" if path.resolve().parent == DOCS.resolve() else str(path)
        text = speed_table(json.loads(path.read_text(encoding="utf-8")), source)
        if args.update_readme:
            update_readme(text)
        print(text, end="")
        return
    if args.record is not None and not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", args.record):
        raise UserError(f"--record {args.record!r}: a name of lowercase letters, digits, dots and dashes")
    if args.deadline is not None and args.deadline <= 0:
        raise UserError(f"--deadline {args.deadline:g}: the seconds the rows may take, more than 0")
    main(user_args, args.out, args.dry_run, args.recipes, args.peer, args.record, args.deadline, args.mirror,
         args.append, args.rehearse)
