"""Fabric on 2 CPU processes, for tests/test_fabric.py: every multi-process Fabric run in one launch.

    python tests/fabric_worker.py OUT

FSDP2: `lit_memory.FusedFabricFSDPStrategy` against Lightning's ``ModelParallelStrategy`` unfused (the same
sharding), clipping by norm and by value, and 16-mixed with overflows forced (fused_worker.FP16_SCALER); the
fused run checkpointed at step 3 and resumed in a new Fabric, with torch's AdamW and with bitsandbytes' AdamW8bit
(its sharded state). FSDP1: ``fsdp_overlap_step_with_backward`` under Lightning's ``FSDPStrategy`` against the plain
loop, and what it refuses. Lightning's FSDPStrategy refuses CPUs by its exact type and wraps with a CUDA
device, so here a subclass runs with a module wrapped beforehand on the CPU (gloo), as torch's FSDP1 allows.

Rank 0 writes ``OUT/results.pt``: per run the final full weights, each step's gradient norm and the
gradients held after each backward; FSDP1's largest difference to the plain loop over both ranks' shards.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins import MixedPrecision
from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
from transformers import AutoModelForSequenceClassification, get_scheduler

if __name__ == "__main__":  # a script: import this checkout's lit_memory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bitsandbytes as bnb  # noqa: E402
import torch.distributed.checkpoint.state_dict as dcp_state  # noqa: E402
from fused_worker import FP16_SCALER, RecordingScaler  # noqa: E402
from streams import Recording  # noqa: E402

from lit_memory import FusedFabricFSDPStrategy, fsdp_overlap_step_with_backward  # noqa: E402
from lit_memory.errors import UserError  # noqa: E402
from lit_memory.fused import hooks as fused_module  # noqa: E402
from lit_memory.hf.config import load_config  # noqa: E402
from lit_memory.optim.configure import weight_decay_groups  # noqa: E402
from lit_memory.run.export import full_state_dict  # noqa: E402
from lit_memory.strategies import shard_hugging_face  # noqa: E402

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
GLOBAL_BATCH, LENGTH, STEPS = 8, 16, 6
MAX_NORM, CLIP_VAL = 0.25, 0.01


def data(rank: int, ranks: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (STEPS, GLOBAL_BATCH, LENGTH), generator=g)
    labels = torch.randint(0, 2, (STEPS, GLOBAL_BATCH), generator=g)
    part = GLOBAL_BATCH // ranks
    mine = slice(rank * part, (rank + 1) * part)
    return [{"input_ids": i[mine], "labels": y[mine]} for i, y in zip(ids, labels)]


def tiny_bert(dropout: float = 0.1) -> torch.nn.Module:
    overrides = {**TINY, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    return AutoModelForSequenceClassification.from_config(load_config("bundled:bert-large", 2, overrides))


def launched(strategy, plugins=None) -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=plugins)
    fabric.launch()  # the first launch starts the other process; later ones find it running
    fabric.seed_everything(42)
    return fabric


def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
    shard_hugging_face(model, device_mesh["data_parallel"], "parallelize")
    return model


class Record:
    def __init__(self) -> None:
        self.norms, self.largest, self.held = [], [], []

    def gradients(self, model: torch.nn.Module) -> None:
        """After backward: how many gradients are held, and the largest value among them (all ranks)."""
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        self.held.append(len(grads))
        if grads:
            largest = torch.stack([g.abs().max() for g in grads]).max()
            torch.distributed.all_reduce(largest, torch.distributed.ReduceOp.MAX)
            self.largest.append(largest.item())


# -- FSDP2 -----------------------------------------------------------------------------------------


def fsdp2(fused: bool, clip: str, out: Path, resume_at: int = 0, eight_bit: bool = False, fp16: bool = False) -> dict:
    """6 steps of AdamW (weight-decay groups, linear schedule; ``eight_bit``: bitsandbytes' AdamW8bit); ``resume_at``:
    checkpoint there and go on in a new Fabric from the checkpoint; ``fp16``: 16-mixed with a GradScaler that
    overflows (as a plugin: Fabric makes a CPU's 16-mixed bf16), its scales after each step recorded, and at
    `POISONED_STEP` an overflow on rank 1 alone (`poison_on_rank_1`)."""
    clipping = {"max_norm": MAX_NORM} if clip == "norm" else {"clip_val": CLIP_VAL}
    record = Record()
    scaler = RecordingScaler("cpu", **FP16_SCALER) if fp16 else None
    plugins = [MixedPrecision("16-mixed", "cpu", scaler)] if fp16 else None

    def build():
        strategy = (
            FusedFabricFSDPStrategy(**clipping)
            if fused
            else ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
        )
        fabric = launched(strategy, plugins)
        model = fabric.setup_module(tiny_bert())
        if fp16:  # before the fused step's hooks: they see the poisoned gradient
            poison_on_rank_1(model, fabric.global_rank, at)
        make = bnb.optim.AdamW8bit if eight_bit else torch.optim.AdamW
        optimizer = fabric.setup_optimizers(make(weight_decay_groups(model), lr=1e-3, weight_decay=0.01))
        schedule = get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=STEPS)
        return fabric, model, optimizer, schedule

    at = {"step": -1}
    fabric, model, optimizer, schedule = build()
    start, created = 0, []
    batches = data(fabric.global_rank, fabric.world_size)
    for step in range(STEPS):
        if resume_at and step == resume_at:
            state = {"model": model, "optimizer": optimizer, "schedule": schedule, "rng": torch.get_rng_state()}
            fabric.save(out / f"checkpoint{'-8bit' if eight_bit else ''}", state)
            fabric, model, optimizer, schedule = build()  # a fresh model and optimizer, as a new process has
            initialize = dcp_state._init_optim_state
            dcp_state._init_optim_state = lambda optim: (created.append(not optim.state), initialize(optim))
            state = {"model": model, "optimizer": optimizer, "schedule": schedule}
            try:
                rest = fabric.load(out / f"checkpoint{'-8bit' if eight_bit else ''}", state)
            finally:
                dcp_state._init_optim_state = initialize
            schedule.load_state_dict(state["schedule"])  # Fabric hands back a plain object's state
            torch.set_rng_state(rest["rng"])
            start = step
        model.train()
        at["step"] = step
        loss = model(**batches[step]).loss
        fabric.backward(loss)
        record.gradients(model)
        if fused:
            norm = fabric.strategy.total_norm
        elif clip == "norm":
            norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        else:
            norm = None
            fabric.clip_gradients(model, optimizer, clip_val=CLIP_VAL)
        if norm is not None:
            record.norms.append(norm.item())
        optimizer.step()  # fused: finds no gradient left
        optimizer.zero_grad()
        schedule.step()
    weights = full_state_dict(model.module)
    scales = scaler.scales if scaler is not None else []
    return {**vars(record), "weights": weights, "resumed_at": start, "torch_created_state": created, "scales": scales}


POISONED_STEP = 3  # a step the scale would not overflow at


def poison_on_rank_1(model: torch.nn.Module, rank: int, at: dict) -> None:
    """An inf in rank 1's shard of the classifier's weight gradient (its second row) at `POISONED_STEP`,
    after FSDP2 reduce-scattered it: rank 0's shard stays finite, so only a flag reduced over the ranks
    makes rank 0 skip that step too."""

    def poison(param: torch.Tensor) -> None:
        if rank == 1 and at["step"] == POISONED_STEP:
            param.grad.to_local().view(-1)[0] = float("inf")

    model.module.classifier.weight.register_post_accumulate_grad_hook(poison)


def stale_optimizer() -> str:
    """An optimizer made before the model was sharded, set up with it: FusedFabricFSDPStrategy's refusal."""
    fabric = launched(FusedFabricFSDPStrategy())
    model = tiny_bert()
    try:
        fabric.setup(model, torch.optim.AdamW(model.parameters()))
    except UserError as err:
        return str(err)
    return "not refused"


# -- FSDP1 -----------------------------------------------------------------------------------------


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on the CPU: its connector refuses CPUs for exactly FSDPStrategy, and it wraps
    with the device's index, which a CPU has not; torch's FSDP1 runs on the CPU when given the device, so
    the module comes wrapped (Lightning then keeps that wrapping)."""


def fsdp1_wrapped(use_orig_params: bool = True) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.bert.modeling_bert import BertLayer

    model = tiny_bert(dropout=0.0)
    return FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        use_orig_params=use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy({BertLayer}),
    )


def fsdp1(fused: bool) -> dict:
    """The seed's loop under FSDP1: one AdamW per (original) parameter, clipped by value."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    fabric = launched(CPUFSDPStrategy())
    model = fabric.setup_module(fsdp1_wrapped())
    start = {n: p.detach().clone() for n, p in model.named_parameters()}  # this rank's flat slices
    optimizers = [torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()]
    held, flat = [], []
    recording = Recording()  # FSDP1 switches torch.cpu's stream objects as CUDA's: where did each step run?
    for batch in data(fabric.global_rank, fabric.world_size):
        loss = model(**batch).loss
        if fused:
            fused_module.device_streams, streams = (lambda device: recording), fused_module.device_streams
            try:
                with fsdp_overlap_step_with_backward(optimizers, model, clip_val=CLIP_VAL):
                    fabric.backward(loss)
            finally:
                fused_module.device_streams = streams
        else:
            fabric.backward(loss)
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VAL)
        held.append(sum(p.grad is not None for p in model.parameters()))
        flat.append(sum(m._handle.flat_param.grad is not None for m in FullyShardedDataParallel.fsdp_modules(model)))
        if not fused:
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    refusals = {}
    if fused:
        try:
            with fsdp_overlap_step_with_backward(optimizers, model, max_norm=1.0):
                pass
        except UserError as err:
            refusals["norm"] = str(err)
        fabric.strategy.precision.scaler = torch.amp.GradScaler("cpu")  # as Fabric's 16-mixed gives one
        try:
            with fsdp_overlap_step_with_backward(optimizers, model):
                pass
        except UserError as err:
            refusals["scaler"] = str(err)
        finally:
            del fabric.strategy.precision.scaler
        flat_model = fabric.setup_module(fsdp1_wrapped(use_orig_params=False))
        try:
            with fsdp_overlap_step_with_backward([torch.optim.AdamW(flat_model.parameters())], flat_model):
                pass
        except UserError as err:
            refusals["flat"] = str(err)
    recording.remove()
    post_backward = model._forward_module._post_backward_stream  # made at the first forward
    shards = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained = any(not torch.equal(shards[n], start[n]) for n in shards)
    # torch's AdamW steps on the compute (default) stream after FSDP1's post-backward stream, where it hands the
    # gradient over: (stepped on the post-backward stream, whether it waited for it)
    steps = [(s["on"] is post_backward, [w is post_backward for w in s["waited"]]) for s in recording.steps()]
    return {
        "shards": shards, "trained": trained, "held": held, "flat_gradients_held": flat, "refusals": refusals,
        "steps": steps,
    }


def main() -> None:
    out = Path(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {}
    for clip in ("norm", "value"):
        results[f"fsdp2-{clip}"] = fsdp2(False, clip, out)
        results[f"fsdp2-{clip}-fused"] = fsdp2(True, clip, out)
    results["fsdp2-norm-fused-resumed"] = fsdp2(True, "norm", out, resume_at=3)
    results["fsdp2-norm-fused-8bit"] = fsdp2(True, "norm", out, eight_bit=True)
    results["fsdp2-norm-fused-8bit-resumed"] = fsdp2(True, "norm", out, resume_at=3, eight_bit=True)
    results["fsdp2-fp16"] = fsdp2(False, "value", out, fp16=True)
    results["fsdp2-fp16-fused"] = fsdp2(True, "value", out, fp16=True)
    results["stale optimizer"] = stale_optimizer()
    plain, fused = fsdp1(False), fsdp1(True)
    shards = [n for n in plain["shards"] if plain["shards"][n].numel()]  # a rank may hold nothing of some
    # Both ranks' shards: the largest difference and whether any weight moved, over the ranks.
    difference = max((plain["shards"][n] - fused["shards"][n]).abs().max().item() for n in shards)
    both = torch.tensor([difference, float(fused["trained"])])
    torch.distributed.all_reduce(both, torch.distributed.ReduceOp.MAX)
    results["fsdp1"] = {
        "difference": both[0].item(),
        "trained": bool(both[1].item()),
        "held": fused["held"],
        "flat_gradients_held": fused["flat_gradients_held"],
        "plain_held": plain["held"],
        "refusals": fused["refusals"],
        "steps": fused["steps"],
    }
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(results, out / "results.pt")


if __name__ == "__main__":
    main()
