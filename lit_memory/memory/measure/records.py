"""The two files memory numbers travel in, written and read only here.

- ``memory.json``, in every fit's run folder beside ``config.yaml``: what was predicted and measured
  (schema: docs/memory.md);
- ``bench.json``, in a bench output folder (and beside the shipped recipes, for ``recipes list``):
  the machine, the command and one row per recipe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from lit_memory import files
from lit_memory.memory.measure.footprint import Footprint, format_bytes
from lit_memory.sandbox import bounds

MEMORY_JSON = "memory.json"
MEMORY_SCHEMA = 3  # 3: predictions at three levels (reserved_bytes, device_bytes), measured CUDA device peak
BENCH_JSON = "bench.json"
# the predictions, by the names memory.json and `lit_memory.planning.prediction.predict` give them
METHODS = ("analytic", "simulated")


def memory_record(
    *,
    device: dict[str, Any],
    world_size: int,
    batch_shape: Optional[list[int]],
    batches: int,
    padding: Optional[str] = None,
    longest_batch: Optional[dict[str, Optional[list[int]]]] = None,
    predicted_at_longest: Optional[dict[str, dict[str, Optional[Footprint]]]] = None,
    tracked_batches: int,
    optimizer_steps: int,
    predicted: dict[str, Optional[Footprint]],
    measured: dict[str, Any],
    ranks: Optional[list[dict[str, Any]]] = None,
    oom: Optional[dict[str, Any]] = None,
    timeline: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """The content of ``memory.json``. Every number is for one rank (one device); ``measured`` is
    rank 0's and ``ranks`` has every rank's when there are several. ``predicted`` is for ``batch_shape`` (the
    worst case: every batch padded to max_length); ``predicted_at_longest`` for the longest batch the tracked
    steps (``tracked``) and all steps (``all``, on CUDA) saw, ``longest_batch``, where padding made it shorter;
    ``timeline`` the step point by point, predicted and measured (what ``memory.png`` draws)."""
    tracked = measured.get("tracked")
    return {
        "schema": MEMORY_SCHEMA,
        "device": device,
        "world_size": world_size,
        "config": "config.yaml",
        "batch_shape": batch_shape,
        "padding": padding,
        "longest_batch": longest_batch,
        "batches": batches,
        "tracked_batches": tracked_batches,
        "optimizer_steps": optimizer_steps,
        "predicted": {m: (f.to_dict() if f is not None else None) for m, f in predicted.items()},
        "predicted_at_longest": {
            key: {m: (f.to_dict() if f is not None else None) for m, f in found.items()}
            for key, found in (predicted_at_longest or {}).items()
        },
        "measured": {
            "tracked": tracked.to_dict() if isinstance(tracked, Footprint) else tracked,
            "process": measured.get("process"),
            "cuda": measured.get("cuda"),
        },
        "ranks": ranks,
        "oom": oom,
        "timeline": timeline,
    }


def write_memory(run_dir: Path, record: dict[str, Any]) -> None:
    files.write_text(run_dir / MEMORY_JSON, json.dumps(record, indent=2) + "\n")


def read_memory(run_dir: Path) -> dict[str, Any]:
    """A run's ``memory.json``; ValueError if it is missing, unreadable or of another schema."""
    try:  # a regular file within its bound: a FIFO planted in a shared run folder would block forever
        record = json.loads(bounds.read_bytes(run_dir / MEMORY_JSON, bounds.JSON_BYTES, MEMORY_JSON))
    except (OSError, bounds.UserError) as err:
        raise ValueError(f"no {MEMORY_JSON} in {run_dir}: {err}") from None
    except RecursionError:
        raise ValueError(f"{run_dir / MEMORY_JSON} is nested too deeply") from None
    if not isinstance(record, dict) or record.get("schema") != MEMORY_SCHEMA:
        raise ValueError(f"{run_dir / MEMORY_JSON} is not a schema-{MEMORY_SCHEMA} memory record")
    return record


def measured_peak(record: dict[str, Any]) -> Optional[int]:
    """What decides whether a device fits: the CUDA allocator's peak, else the tracked tensors' peak."""
    measured = record["measured"]
    if measured.get("cuda"):
        return measured["cuda"]["max_allocated_bytes"]
    return (measured.get("tracked") or {}).get("peak_bytes")


def predicted_peak(record: dict[str, Any]) -> tuple[Optional[int], Optional[str]]:
    """(peak, method): the simulated prediction where it ran, else the analytic one."""
    for method in reversed(METHODS):
        footprint = record["predicted"].get(method)
        if footprint:
            # on CUDA what max_memory_allocated counts: the tensors and the cuBLAS workspaces
            return footprint.get("allocated_bytes") or footprint["peak_bytes"], method
    return None, None


def peak_summary(run_dir: Path) -> Optional[str]:
    """The measured peak in words, for a shared recipe's header; None without a readable record."""
    try:
        record = read_memory(run_dir)
        measured = record["measured"]
    except (ValueError, KeyError, TypeError):
        return None
    cuda, tracked, process = measured.get("cuda"), measured.get("tracked"), measured.get("process")
    if cuda:
        device = f", {format_bytes(cuda['max_device_bytes'])} device" if cuda.get("max_device_bytes") else ""
        return (
            f"{format_bytes(cuda['max_allocated_bytes'])} allocated, "
            f"{format_bytes(cuda['max_reserved_bytes'])} reserved{device} (CUDA)"
        )
    parts = []
    if tracked:
        parts.append(f"{format_bytes(tracked['peak_bytes'])} tracked tensors")
    if process:
        parts.append(f"{format_bytes(process['growth_bytes'])} process RSS growth")
    return f"{', '.join(parts)} ({record['device']['type']})" if parts else None


def write_bench(out: Path, info: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    files.write_text(out / BENCH_JSON, json.dumps({**info, "rows": rows}, indent=2) + "\n")


def read_bench(path: Path) -> dict[str, dict[str, Any]]:
    """The rows of a ``bench.json`` by recipe name (empty if there is none)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return {row["recipe"]: row for row in data["rows"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
