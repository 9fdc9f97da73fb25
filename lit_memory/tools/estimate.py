"""``python -m lit_memory estimate``: a training step's memory per category, predicted two ways
before any run: the analytic model (`lit_memory.memory.analytic`) and the simulated step
(`lit_memory.memory.simulate`), for the run ``fit`` would train with the same arguments.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

import lightning as L

from lit_memory.anatomy import skeleton
from lit_memory.cli import LitMemoryCLI, resolve
from lit_memory.eightbit import quantised_embeddings
from lit_memory.memory.analytic import analytic, file_gib
from lit_memory.memory.footprint import Footprint, format_bytes
from lit_memory.memory.report import table
from lit_memory.memory.setup import (
    DEVICES,
    Prediction,
    Setup,
    clips_by_norm,
    init_args,
    is_fused,
    is_sharded,
    normalize_precision,
)
from lit_memory.memory.simulate import simulate
from lit_memory.model import SequenceClassifier

CUDA_NOTES = (
    "CUDA differs from the CPU simulation in: attention kernels (CUDA's memory-efficient/flash SDPA keeps "
    "no heads x length x length probabilities; CPU falls back to the math kernel when attention dropout is on), "
    "dropout masks (1 byte per value on CUDA, a full-width noise tensor on CPU), the caching allocator "
    "(rounds blocks to 512 B and reserves more than it allocates) and cuBLAS workspaces (a few MiB)."
)



def setup_of(run: LitMemoryCLI, device: str = "cuda") -> Setup:
    """The setup a resolved run (`lit_memory.cli.resolve`) would train; its model is not built."""
    if not hasattr(run, "model"):
        run.build(trainer=False)
    trainer = run.settings.trainer
    sharded = is_sharded(trainer.strategy)
    return Setup(
        model=init_args(SequenceClassifier, run.model.hparams),
        optimizer=run.model.optimizer_factory,
        precision=normalize_precision(trainer.precision),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        batch_size=run.datamodule.hparams.batch_size,
        max_length=run.datamodule.hparams.max_length,
        fused=is_fused(trainer.strategy),
        bucket=getattr(getattr(trainer.strategy, "init_args", None), "bucket", None) or "layer",
        clip_norm=clips_by_norm(trainer.gradient_clip_val, trainer.gradient_clip_algorithm),
        device=device,
        sharded=sharded,
        world_size=ranks(trainer.devices) * trainer.num_nodes if sharded else 1,
    )


def ranks(devices: Any) -> int:
    """Devices per node as configured: a count, a list of indices, or "auto"/-1 (every device this machine
    has, which is not the machine a prediction is for: then 1; pass --trainer.devices N)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    try:
        return max(int(devices), 1)
    except (TypeError, ValueError):
        return 1


def simulate_or_decline(setup: Setup) -> tuple[Optional[Prediction], Optional[str]]:
    """The simulated step, or None and one line saying why it cannot run: a forward that computes a shape
    or a Python number from the data (DeBERTa's relative positions call nonzero, ModernBERT reads a scalar
    back), which fake tensors cannot give. Everything else the simulation meets is raised as it is."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        return simulate(setup), None
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        return None, (
            f"not simulated: the model's forward computes from the data what fake tensors cannot give ({err}); "
            "the analytic prediction stands alone"
        )


def embedding_state_notes(module: SequenceClassifier, setup: Setup) -> list[str]:
    """What ``embedding_optimizer_state: auto`` did with a bitsandbytes optimizer: which embedding matrices it
    quantised, and what 32-bit state would have added (already in the numbers; said so they can be traded)."""
    bitsandbytes = getattr(setup.optimizer_class, "__module__", "").startswith("bitsandbytes")
    trained = module.hparams.freeze is None and module.lora is None  # every freeze setting and LoRA freeze them
    if module.hparams.embedding_optimizer_state != "auto" or not bitsandbytes or not trained:
        return []
    return [
        f"optimizer state: embedding_optimizer_state auto keeps 8-bit state for {e.num_embeddings} x {e.embedding_dim} "
        f"{type(e).__name__} ({e.weight.numel() / 1e6:.1f} M values; 32-bit would add {format_bytes(extra)}: "
        "--model.embedding_optimizer_state 32bit)"
        for e, extra in quantised_embeddings(skeleton(module.hf_config).embeddings)
    ]


def predict_run(trainer: L.Trainer, module: L.LightningModule, simulated: bool) -> dict[str, Footprint]:
    """The monitor's ``predict`` hook: this run's predicted footprints, by method (``memory.json``)."""
    try:
        setup = Setup.from_run(trainer, module)
    except AttributeError:  # not a SequenceClassifier with our data module: measure only
        return {}
    # The simulation runs one device: a sharded run's per-rank numbers are the analytic model's.
    methods = {"analytic": analytic, **({"simulated": simulate} if simulated and not setup.sharded else {})}
    predictions = {}
    for name, predict in methods.items():
        try:
            if predict is simulate:
                prediction, declined = simulate_or_decline(setup)
                if declined:
                    print(f"note: {declined}")
                    continue
                predictions[name] = prediction.footprint
            else:
                predictions[name] = predict(setup).footprint
        except Exception as err:  # a model the predictions do not cover must still train (and be measured)
            print(f"warning: no {name} memory prediction: {type(err).__name__}: {err}")
    return predictions


def report(setup: Setup, analytic_: Prediction, simulated: Optional[Prediction]) -> dict:
    """The --json object; ``predicted`` has the footprints as ``memory.json`` keeps them."""
    both = {"analytic": analytic_, "simulated": simulated}
    params = analytic_.parameters
    notes = list(analytic_.notes)
    if simulated is not None:
        notes.append(f"simulated on CPU with fake tensors (nothing allocated) in {simulated.seconds:.1f} s")
        notes += simulated.notes
        if setup.device == "cuda":
            notes.append(CUDA_NOTES)
    return {
        "model": {
            "name": setup.model.get("model_name_or_path"),
            "parameters": params,
            "trainable": analytic_.trainable,
            "file_bytes": {"fp32": 4 * params, "fp16": 2 * params, "int8": params},
        },
        "setup": {
            "batch_size": setup.batch_size,
            "max_length": setup.max_length,
            "precision": setup.precision,
            "optimizer": setup.optimizer_name,
            "accumulate_grad_batches": setup.accumulate_grad_batches,
            "gradient_checkpointing": setup.checkpointing or False,
            "offload_activations": bool(setup.model.get("offload_activations")),
            "freeze": setup.model.get("freeze"),
            "fused": setup.fused,
            "sharded": setup.sharded,
            "world_size": setup.world_size,
        },
        "device": {"analytic": setup.device, "simulated": "cpu"},
        "predicted": {k: (p.footprint.to_dict() if p else None) for k, p in both.items()},
        "inference_bytes": {k: (p.inference if p else None) for k, p in both.items()},
        "notes": notes,
    }


def format_report(data: dict) -> str:
    model, setup = data["model"], data["setup"]
    heads = {"analytic": f"analytic ({data['device']['analytic']})", "simulated": "simulated (cpu)"}
    columns = {heads[k]: Footprint.from_dict(f) for k, f in data["predicted"].items() if f is not None}
    inference = [format_bytes(data["inference_bytes"][k]) for k, f in data["predicted"].items() if f is not None]
    sizes = ", ".join(
        f"{name} {file_gib(model['parameters'], n):.2f} GiB" for name, n in (("fp32", 4), ("fp16", 2), ("int8", 1))
    )
    lines = [
        f"{model['name']}: {model['parameters'] / 1e6:.1f} M parameters ({model['trainable'] / 1e6:.1f} M trainable); "
        f"batch {setup['batch_size']} x {setup['max_length']} tokens, {setup['precision']}, {setup['optimizer']}, "
        f"accumulate {setup['accumulate_grad_batches']}, "
        f"checkpointing {setup['gradient_checkpointing'] or 'off'}, "
        f"offloading {'on' if setup.get('offload_activations') else 'off'}, "
        f"freeze {setup['freeze']}, fused step {'on' if setup['fused'] else 'off'}"
        + (f", per rank of {setup['world_size']} (FSDP)" if setup.get("sharded") else ""),
        "",
        table("training step, at the peak", columns, {"inference (no autograd)": inference}),
        f"model file (parameters x bytes / 1024^3): {sizes}",
    ]
    lines += [f"note: {n}" for n in data["notes"]]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lit_memory estimate",
        description="Predict a training step's memory per category (analytic and simulated). "
        "Every other argument is a fit argument: --config FILE (repeatable), dotted overrides.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-simulate", action="store_true", help="analytic only (milliseconds instead of seconds)")
    parser.add_argument(
        "--device", choices=DEVICES, default="cuda", help="device the analytic model predicts for (default: cuda)"
    )
    ours, rest = parser.parse_known_args(argv)
    run = resolve(["fit", *rest])
    setup = setup_of(run, ours.device)
    predicted = analytic(setup)
    predicted.notes += embedding_state_notes(run.model, setup)
    simulated = None
    if not (ours.no_simulate or setup.sharded):
        simulated, declined = simulate_or_decline(setup)
        if declined:
            predicted.notes.append(declined)
    if setup.sharded and not ours.no_simulate:
        predicted.notes.append("not simulated: the simulation runs one device, so per-rank numbers are analytic")
    data = report(setup, predicted, simulated)
    print(json.dumps(data, indent=2) if ours.json else format_report(data))
