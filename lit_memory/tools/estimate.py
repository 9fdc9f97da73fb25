"""``python -m lit_memory estimate``: a training step's memory before any run, at three levels (tensors,
the CUDA caching allocator's reserve, the device as ``nvidia-smi`` shows it), predicted two ways: the
analytic model and the simulated step (`lit_memory.planning.prediction.predict`), for the run ``fit`` would train with
the same arguments, on the GPU the options describe (this machine's when it has one).

``--plot FILE`` draws the predicted step point by point (`lit_memory.memory.measure.picture`: the predicted half of a
fit's ``memory.png``); ``--vs`` separates the arguments of further runs drawn beside it (each inherits the options
before it), e.g. ``estimate --gpu rtx3050-4gb --plot cmp.png --config recipes/bf16.yaml --vs --config
recipes/4gb.yaml``.

``--published`` prints the table of published GPU measurements against these predictions
(`lit_memory.tools.published`); ``--published --update-docs`` writes it into docs/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from lit_memory.cli import resolve
from lit_memory.config.shipped import RECIPE_FLAG, recipes_dir
from lit_memory.errors import UserError
from lit_memory.hf.anatomy import Anatomy, skeleton
from lit_memory.memory.hardware.allocator import AllocatorConfig
from lit_memory.memory.hardware.gpus import GPUS, Target, target
from lit_memory.memory.margin import Fit, Limit
from lit_memory.memory.measure import picture
from lit_memory.memory.measure.footprint import Footprint, format_bytes, parse_bytes
from lit_memory.memory.measure.report import table
from lit_memory.memory.model.loops import loop
from lit_memory.optim.eightbit import quantised_embeddings
from lit_memory.optim.optimizer_state import unquantised_extra
from lit_memory.planning.choose import mode_of
from lit_memory.planning.prediction.analytic import analytic, file_gib
from lit_memory.planning.prediction.predict import level, predict
from lit_memory.planning.prediction.step import Prediction, Step, build
from lit_memory.planning.recompute import Flops, count_or_decline, planned
from lit_memory.tools import arguments
from lit_memory.tools.arguments import add_target_arguments  # noqa: F401  (plan, cards and tests take it from here)

DEFAULT_MODEL = "bundled:minilm"
DEFAULT_MODEL_WORDS = (
    " (all-MiniLM-L6-v2, the recipes' model unless a config names another: --config configs/bert-large.yaml or "
    "--model.model_name_or_path NAME)"
)
CUDA_NOTES = (
    "the CPU simulation runs CPU kernels; CUDA's stand in where their memory differs (attention kernel, dropout "
    "masks, autocast's fp32 ops); the analytic model predicts CUDA's directly"
)


def target_of(args: argparse.Namespace) -> Target:
    context = parse_bytes(args.cuda_context) if args.cuda_context is not None else None
    allocator = AllocatorConfig.parse(args.allocator_conf) if args.allocator_conf is not None else None
    return target(args.device, args.gpu, args.cuda, context, allocator)


def step_of(rest: list[str], args: argparse.Namespace, for_card: bool = False) -> Step:
    """The step ``fit`` would train with these arguments, for the options' device and loop: resolved by the
    same parser (`lit_memory.cli.resolve`), built once (`Step.from_settings`). The CPU's bf16 fallback is
    this machine's business, not the predicted device's: it stays off; the target GPU's bf16 support decides
    the precision as it would for a run there (`lit_memory.optim.precision.on_gpu`, one line when it changes it).
    ``auto`` is planned as the run would plan it; ``for_card`` (estimate's own): for the card ``--gpu`` names
    (`card_limit`)."""
    fallback = ["--cpu_bf16_fallback=false"] if args.device == "cuda" else []
    device = target_of(args)
    run = resolve(["fit", *rest, *fallback], gpu=device.gpu if device.cuda_device else None)
    step = Step.from_settings(run.settings.as_dict(), device, loop(args.loop))
    limit = card_limit(step, args.gpu, "memory.tier" in run.typed_settings) if for_card else None
    found = planned(step, limit)
    if limit is not None and found.planned and step.memory.limit is not None:
        tier = step.memory.limit.words
        found = replace(found, planned=f"{found.planned} (planned for the card asked about; a run there plans for "
                                       f"{tier} unless given --memory.tier {step.target.gpu.label})")
    return found


def card_limit(step: Step, gpu: Optional[str], tier_typed: bool) -> Optional[Limit]:
    """What ``auto`` plans for in an estimate for the card ``--gpu`` names: that card's memory, as the verdict fits
    it, in place of a recipe's ``memory.tier`` (the card the recipe was made for, not the one asked about); None (the
    run's own limit) without ``--gpu``, on a CPU target, or where ``memory.budget`` (enforced) or a typed
    ``memory.tier`` says what to plan for."""
    if gpu is None or not step.target.cuda_device or step.memory.cap is not None or tier_typed:
        return None
    card = step.target.gpu
    return Limit(card.memory, f"{card.label} ({format_bytes(card.memory)}, --gpu)", step.margin)


def embedding_state_notes(step: Step) -> list[str]:
    """What ``embedding_optimizer_state: auto`` did with an optimizer whose state is quantised: which embedding
    matrices it left on quantised state (`lit_memory.optim.eightbit.unquantised`), and what unquantised state would have
    added (measured: `lit_memory.optim.optimizer_state.unquantised_extra`; already in the numbers, said so they can be
    traded)."""
    model = step.model
    trained = model.get("freeze") is None and model.get("lora") is None  # every freeze setting and LoRA freeze them
    if (
        model.get("embedding_optimizer_state", "auto") != "auto"
        or not step.optimizer.library.quantises_state
        or not trained
    ):
        return []
    if not quantised_embeddings(skeleton(step.module().hf_config).embeddings):
        return []
    module, optimizer = build(step, torch.device("meta"))
    embeddings = quantised_embeddings(Anatomy.of(module.model).embeddings)
    extra = unquantised_extra(optimizer, [e.weight for e in embeddings], step.device)
    notes = []
    for e in embeddings:
        what = f"{e.num_embeddings} x {e.embedding_dim} {type(e).__name__} ({e.weight.numel() / 1e6:.1f} M values"
        notes.append(
            f"optimizer state: embedding_optimizer_state auto keeps {step.optimizer.name}'s quantised state for "
            f"{what}; "
            f"32-bit state would add {format_bytes(extra[id(e.weight)])}: estimate --model.embedding_optimizer_state "
            "32bit for the whole step)"
        )
    return notes


def report(step: Step, predictions: dict[str, Prediction], counted: Optional[Flops] = None) -> dict[str, Any]:
    """The --json object; ``predicted`` has the footprints as ``memory.json`` keeps them, and the step's counted
    FLOPs (`lit_memory.planning.recompute`)."""
    analytic_ = predictions["analytic"]
    simulated = predictions.get("simulated")
    params = analytic_.parameters
    notes = ([step.planned] if step.planned else []) + list(analytic_.notes)
    if simulated is not None:
        notes.append(f"simulated on CPU with fake tensors (nothing allocated) in {simulated.seconds:.1f} s")
        notes += simulated.notes
        if step.device == "cuda":
            notes.append(CUDA_NOTES)
    if step.sharded:
        notes.append("not simulated: the simulation runs one device, so per-rank numbers are analytic")
    return {
        "model": {
            "name": step.model.get("model_name_or_path"),
            "parameters": params,
            "trainable": analytic_.trainable,
            "file_bytes": {"fp32": 4 * params, "fp16": 2 * params, "int8": params},
        },
        "setup": {
            "batch_size": step.batch_size,
            "max_length": step.max_length,
            "precision": step.precision.name,
            "optimizer": step.optimizer_name,
            "accumulate_grad_batches": step.accumulate_grad_batches,
            "gradient_checkpointing": step.checkpointing.value() if step.checkpointing else False,
            "offload_activations": bool(step.model.get("offload_activations")),
            "freeze": step.model.get("freeze"),
            "mode": mode_of(step),  # full, LoRA, QLoRA, head only
            "lora": step.model.get("lora"),
            "fused": step.fused,
            "measuring_backward": step.measures,
            "sharded": step.sharded,
            "world_size": step.world_size,
            "loop": step.loop.name,
            "attention": analytic_.attention,
        },
        "device": {
            "analytic": step.device,
            "simulated": step.device,
            "target": step.target.describe(),
            "gpu": step.target.gpu.label if step.target.cuda_device else None,
            # what torch reports as the target card's total memory (`lit_memory.memory.hardware.gpus.GPUS`)
            "capacity_bytes": step.target.gpu.memory if step.target.cuda_device else None,
        },
        "verdict": fit.to_dict() if (fit := verdict(step, analytic_.footprint)) else None,
        "predicted": {
            **{
                k: (p.footprint.to_dict() if p else None)
                for k, p in {"analytic": analytic_, "simulated": simulated}.items()
            },
            **(flops_fields(counted) if counted else {}),
        },
        "inference_bytes": {"analytic": analytic_.inference, "simulated": simulated.inference if simulated else None},
        "notes": notes,
    }


def verdict(step: Step, footprint: Footprint) -> Optional[Fit]:
    """Whether the step fits the card asked about, with the margin kept (`lit_memory.memory.margin`): its
    predicted device total against the card's capacity, or against ``memory.budget`` where that caps the card lower
    (the allocator is capped there), named with the card; ``memory.tier`` is what the plan was made for, not a limit
    on this card. On a CPU target, the tensors against the budget or tier (None without one)."""
    cap, limit = step.memory.cap, step.memory.limit
    if step.target.cuda_device:
        gpu = step.target.gpu
        card = f"{gpu.label} ({format_bytes(gpu.memory)})"
        if cap is not None and cap.bytes < gpu.memory:
            return Fit(level(footprint), cap.bytes, step.margin, f"{card} capped at {cap.words}")
        return Fit(level(footprint), gpu.memory, step.margin, card)
    return limit.with_margin(step.margin).fit(level(footprint)) if limit is not None else None


# Where the project's GPU records are (`python -m lit_memory bench --gpu-proof`): installed with the package, or a
# checkout's docs/gpu. A record named after a catalogue key is a card's current one (h200-before.json is not).
GPU_RECORDS = (
    Path(__file__).resolve().parents[1] / "assets" / "gpu",
    Path(__file__).resolve().parents[2] / "docs" / "gpu",
)


def record_rows() -> list[tuple[dict[str, Any], str]]:
    """Every measured recipe row of the cards' current GPU records, with its record's file name."""
    folder = next((f for f in GPU_RECORDS if f.is_dir()), None)
    rows = []
    for path in sorted(folder.glob("*.json")) if folder else []:
        if path.stem not in GPUS:
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        rows += [(row, path.name) for row in record.get("recipes", []) if row.get("samples_per_s") and row.get("hfu")]
    return rows


def busy_utilisation(rows: list[tuple[dict[str, Any], str]]) -> Optional[tuple[float, str]]:
    """The share of its dense peak a card computes at where the card, not the host, sets the pace: the highest
    utilisation (counted FLOPs, recompute included, per second over the peak: a record's ``hfu``) the records measured
    for a whole step, and which row. The records' 16-bit steps on an H200 wait on the host (its profile: the device
    idle most of the step), so their own utilisation says little about a card with a fraction of that peak."""
    if not rows:
        return None
    row, name = max(rows, key=lambda item: item[0]["hfu"])
    return float(row["hfu"]), f"{row['recipe']} ({row.get('peak_kind')}) on {name}"


def host_bound(rows: list[tuple[dict[str, Any], str]], recipe: Optional[str], step: Step,
               model_flops: float) -> Optional[tuple[float, str]]:
    """The samples per second the host let the same recipe train at on a record's card (its step time, whatever the
    card computed meanwhile), for a step with the same model FLOPs per sample (the records' model and shape, within
    2 %), scaled to this step's samples per optimizer step; None where no record has such a row."""
    found = []
    for row, name in rows:
        if row.get("recipe") != recipe or not row.get("flops_per_step") or not row.get("step_time_s"):
            continue
        per_step = row["samples_per_s"] * row["step_time_s"]  # samples per optimizer step
        theirs = row["flops_per_step"] * (1 - (row.get("recompute_share") or 0)) / per_step
        if abs(theirs - model_flops) <= 0.02 * model_flops:
            found.append((step.batch_size * step.accumulate_grad_batches / row["step_time_s"], f"{recipe} on {name}"))
    return max(found) if found else None


def throughput(step: Step, counted: Flops, recipe: Optional[str] = None) -> dict[str, Any]:
    """Training samples per second on the target card, an estimate from the project's GPU records: the step's
    counted FLOPs per sample (recompute and any measuring backward included: what the card computes) at the share
    of the card's dense peak for the step's precision (the catalogue, `lit_memory.memory.hardware.gpus`) that a busy
    card reached (`busy_utilisation`), and no faster than the host let ``recipe`` train on a record's card
    (`host_bound`); ``utilisation`` is the share of the peak that rate is. ``why`` says what is missing where there is
    no estimate."""
    if not step.target.cuda_device:
        return {"samples_per_s": None, "why": "a GPU estimate (the CPU is not a GPU)"}
    gpu = step.target.gpu
    half = "16" in step.precision.name
    kind = "bf16/fp16 dense" if half else "fp32"
    peak = gpu.tflops if half else gpu.fp32_tflops
    if not peak:
        return {"samples_per_s": None, "why": f"no {kind} peak for {gpu.label} in the catalogue"}
    rows = record_rows()
    busy = busy_utilisation(rows)
    if busy is None:
        return {"samples_per_s": None, "why": "no GPU record (docs/gpu) to take a utilisation from"}
    per_sample = counted.per_sample
    compute = busy[0] * peak * 1e12 / per_sample
    host = host_bound(rows, recipe, step, (counted.total - counted.recompute - counted.measuring) / counted.samples)
    bound = "host" if host is not None and host[0] < compute else "card"
    rate = host[0] if bound == "host" else compute
    return {"samples_per_s": rate, "gpu": gpu.label, "peak_tflops": peak, "peak_kind": kind,
            "utilisation": rate * per_sample / (peak * 1e12), "bound": bound, "flops_per_sample": per_sample,
            "busy_utilisation": busy[0], "busy_from": busy[1],
            "host_samples_per_s": host[0] if host else None, "host_from": host[1] if host else None}


def flops_fields(counted: Flops) -> dict[str, Any]:
    return {
        "flops_per_step": counted.total,
        "flops": {
            "forward": counted.forward,
            "backward": counted.backward,
            "recompute": counted.recompute,
            "recompute_share": round(counted.recompute_share, 4),
            "measuring": counted.measuring,
            "per_sample": counted.per_sample,
            "counted": FLOPS_NOTE,
        },
    }


FLOPS_NOTE = (
    "one micro-batch's forward and backward (recompute included; the fused step's measuring backward for clipping "
    "by norm or loss scaling, a second backward), counted by torch's FlopCounterMode on fake "
    "tensors: matmuls and attention only; device-independent (what a GPU computes, not how long it takes)"
)


def format_report(data: dict) -> str:
    model, setup = data["model"], data["setup"]
    device = data["device"]["analytic"]
    heads = {"analytic": f"analytic ({device})", "simulated": f"simulated ({device})"}
    footprints = {k: f for k, f in data["predicted"].items() if k in heads and f is not None}
    columns = {heads[k]: Footprint.from_dict(f) for k, f in footprints.items()}
    inference = [format_bytes(data["inference_bytes"][k]) for k in footprints]
    sizes = ", ".join(
        f"{name} {file_gib(model['parameters'], n):.2f} GiB" for name, n in (("fp32", 4), ("fp16", 2), ("int8", 1))
    )
    lines = [
        f"estimating {model['name']}{DEFAULT_MODEL_WORDS if model['name'] == DEFAULT_MODEL else ''}: "
        f"{model['parameters'] / 1e6:.1f} M parameters ({model['trainable'] / 1e6:.1f} M trainable); "
        f"batch {setup['batch_size']} x {setup['max_length']} tokens, {setup['precision']}, {setup['optimizer']}, "
        f"accumulate {setup['accumulate_grad_batches']}, "
        f"checkpointing {setup['gradient_checkpointing'] or 'off'}, "
        f"offloading {'on' if setup.get('offload_activations') else 'off'}, "
        f"freeze {setup['freeze']}, fused step {'on' if setup['fused'] else 'off'}"
        + (f", {setup['mode']} (LoRA rank {setup['lora'].get('rank', 8)}"
           f"{', a 4-bit NF4 base' if setup['mode'] == 'QLoRA' else ''})" if setup.get("lora") else "")
        + (" (a measuring backward first)" if setup.get("measuring_backward") else "")
        + (f", per rank of {setup['world_size']} (FSDP)" if setup.get("sharded") else "")
        + (f", {setup['loop']} loop" if setup.get("loop", "lightning") != "lightning" else ""),
        f"on {data['device']['target']}; {setup['attention']}",
        "",
        table("training step, at the peak", columns, {"inference (no autograd)": inference}),
        f"model file (parameters x bytes / 1024^3): {sizes}",
    ]
    if "flops" in data["predicted"]:
        found = data["predicted"]["flops"]
        lines.append(
            f"FLOPs per step (counted, device-independent): {data['predicted']['flops_per_step'] / 1e12:.2f} TFLOP "
            f"({found['per_sample'] / 1e9:.1f} GFLOP per sample), recompute {100 * found['recompute_share']:.1f} % "
            "of them"
            + (f", measuring backward {found['measuring'] / 1e12:.2f} TFLOP" if found.get("measuring") else "")
        )
    speed = data.get("throughput") or {}
    if speed.get("samples_per_s"):
        if speed["bound"] == "card":
            why = (f"the utilisation a busy card reached in this project's GPU records ({speed['busy_from']}, docs/gpu)"
                   + (f"; the host let {speed['host_from']} train at {speed['host_samples_per_s']:,.0f} samples/s, no "
                      "limit here" if speed.get("host_from") else ""))
        else:
            why = (
                f"as fast as the host let {speed['host_from']} train (docs/gpu), its card waiting on the host; a busy "
                f"card reached {100 * speed['busy_utilisation']:.1f} % ({speed['busy_from']})"
            )
        lines.append(
            f"throughput on {speed['gpu']}: about {speed['samples_per_s']:,.0f} samples/s, an estimate, not a "
            "measurement: "
            f"{speed['flops_per_sample'] / 1e9:.1f} GFLOP per sample (counted above) at "
            f"{100 * speed['utilisation']:.1f} % "
            f"of its {speed['peak_kind']} peak {speed['peak_tflops']:g} TFLOP/s: {why}"
        )
    elif speed.get("why"):
        lines.append(f"throughput: no estimate ({speed['why']})")
    if data.get("verdict"):
        lines.append(f"verdict: {data['verdict']['line']}")
    lines += [f"note: {n}" for n in data["notes"]]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = arguments.estimate()
    segments = split_runs(argv)
    ours, rest = parser.parse_known_args(segments[0])
    if len(segments) > 1 and ours.plot is None:
        raise UserError("--vs compares runs in a picture: give --plot FILE")
    if ours.plot is not None:
        plot(parser, ours, rest, segments[1:])
        return
    if ours.published:
        # deferred: published builds its tables of sources at import (~0.2 s); only --published needs them
        from lit_memory.tools.published import main as published

        published(ours.update_docs)
        return
    if ours.update_docs:
        raise UserError("--update-docs goes with --published")
    step = step_of(rest, ours, for_card=True)
    predictions = predict(step, simulated=not ours.no_simulate)
    predictions["analytic"].notes += embedding_state_notes(step)
    counted, declined = count_or_decline(step)
    if declined:
        predictions["analytic"].notes.append(declined)
    data = report(step, predictions, counted)
    if counted is not None:
        data["throughput"] = throughput(step, counted, recipe_named(rest))
    print(json.dumps(data, indent=2) if ours.json else format_report(data))


def recipe_named(argv: list[str]) -> Optional[str]:
    """The shipped recipe the arguments train with (``--recipe NAME``, or ``--config`` naming a file of the recipes'
    folder; the last one), as the GPU records name their rows."""
    found = None
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg in (RECIPE_FLAG, "--config") and i + 1 < len(argv) else None
        if arg.startswith((f"{RECIPE_FLAG}=", "--config=")):
            value = arg.split("=", 1)[1]
        if value is None:
            continue
        if arg.startswith(RECIPE_FLAG):
            found = value
        elif Path(value).suffix in (".yaml", ".yml") and Path(value).resolve().parent == recipes_dir().resolve():
            found = Path(value).stem
    return found


def split_runs(argv: list[str]) -> list[list[str]]:
    """The arguments of each run ``--vs`` separates."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--vs":
            runs.append([])
        else:
            runs[-1].append(arg)
    if any(not run for run in runs[1:]):
        raise UserError("--vs needs the arguments of the run to compare after it, e.g. --vs --config recipes/4gb.yaml")
    return runs


def plot(parser: argparse.ArgumentParser, ours: argparse.Namespace, rest: list[str], others: list[list[str]]) -> None:
    """Each run's report and its predicted step, drawn side by side into ``ours.plot``."""
    try:  # deferred: matplotlib is optional and heavy; a presence check (picture.draw imports it to draw)
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(
            "--plot draws with matplotlib, which is not installed: pip install 'lit-memory[plot]'"
        ) from None
    runs = [(ours, rest)]
    for argv in others:  # each inherits the options before it
        runs.append(parser.parse_known_args(argv, namespace=argparse.Namespace(**vars(runs[-1][0]))))
    panels = []
    for i, (options, fit_args) in enumerate(runs):
        step = step_of(fit_args, options, for_card=True)
        predictions = predict(step, simulated=False)
        data = report(step, predictions)
        print(("\n" if i else "") + (json.dumps(data) if ours.json else format_report(data)))
        panels.append(panel(step, predictions["analytic"], run_title(fit_args, step)))
    drawn = picture.draw(panels, ours.plot, "one training step, predicted (python -m lit_memory estimate --plot)")
    print(f"memory picture: {drawn}")


def panel(step: Step, prediction: Prediction, title: str) -> Any:
    """The picture of a step not yet run: the analytic model's step point by point (`Prediction.timeline`)."""
    points = analytic(step, levels=False, timeline=True).timeline
    fit = verdict(step, prediction.footprint)
    gpu = step.target.gpu if step.target.cuda_device else None
    return picture.Panel(
        title=title,
        predicted=points,
        device=prediction.footprint.device,
        budget=step.memory.cap.bytes if step.memory.cap else None,
        capacity=gpu.memory if gpu else None,
        margin=step.margin,
        notes=[f"verdict: {fit.line()}"] if fit else [],
    )


def run_title(fit_args: list[str], step: Step) -> str:
    """A run in words: its configs and overrides, the batch, the card."""
    shown, it = [], iter(fit_args)
    for arg in it:
        if arg == "--config" or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else next(it, "")
            relative = os.path.relpath(path) if os.path.isabs(path) else path
            shown.append(relative if not relative.startswith("..") else os.path.basename(path))
        elif arg.startswith("--"):
            shown.append(arg[2:])
    where = step.target.gpu.label if step.target.cuda_device else step.device
    return (f"{' + '.join(shown) or 'the defaults'}: batch {step.batch_size} x {step.max_length}, "
        f"{step.precision.name}, on {where}")
