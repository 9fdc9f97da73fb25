"""The seed's fused step with Fabric + FSDP, unchanged but for its import: Lightning 2.0's
``fsdp_overlap_step_with_backward`` (removed in Lightning 2.1) now comes from lit_memory.

    python examples/fsdp_overlap.py --devices 2                        # FSDP2 over 2 CPU processes (gloo)
    python examples/fsdp_overlap.py --accelerator cuda --devices 8     # FSDP2 over 8 GPUs (nccl)
    python examples/fsdp_overlap.py --devices 1                        # one device, nothing sharded
    python examples/fsdp_overlap.py --devices 1 --unfused              # the plain loop: the same weights

A tiny random BERT without dropout trains on fixed random batches; each process takes its part of the
global batch, so every run above ends with the same weights (their sum is printed). Inside the ``with``
block every parameter's optimizer steps as soon as its gradient is ready, and the gradient is freed:
the loop prints how many gradients are left after each backward (none).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForSequenceClassification

from lit_memory import fsdp_overlap_step_with_backward  # was: from lightning.fabric.strategies.fsdp import ...
from lit_memory.hf.config import load_config
from lit_memory.model import full_state_dict

TINY_BERT = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "hidden_dropout_prob": 0.0,  # no dropout: one process and several draw no different masks
    "attention_probs_dropout_prob": 0.0,
}
GLOBAL_BATCH, LENGTH = 8, 16


def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
    """The user's FSDP2 sharding (ModelParallelStrategy's ``parallelize_fn``): each layer, then the model."""
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=device_mesh["data_parallel"])
    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def epoch(steps: int, rank: int, ranks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed random batches; this process's slice of each global batch."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (steps, GLOBAL_BATCH, LENGTH), generator=g)
    labels = torch.randint(0, 2, (steps, GLOBAL_BATCH), generator=g)
    part = GLOBAL_BATCH // ranks
    return [(i[rank * part : (rank + 1) * part], y[rank * part : (rank + 1) * part]) for i, y in zip(ids, labels)]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)


def train(devices: int = 1, accelerator: str = "cpu", steps: int = 6, fused: bool = True, out: Optional[Path] = None):
    """Train; returns (the full weights, gradients held after each backward). ``out``: rank 0 saves both there."""
    strategy = "auto"
    if devices > 1:  # FSDP2 over all processes: one data-parallel dimension
        strategy = ModelParallelStrategy(parallelize, data_parallel_size=devices, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator=accelerator, devices=devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)
    model = AutoModelForSequenceClassification.from_config(load_config("bundled:bert-large", 2, TINY_BERT))
    model = fabric.setup(model)
    model.train()

    # -- the seed's snippet --
    optimizers = [torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01) for p in model.parameters()]
    held = []
    for inputs, targets in epoch(steps, fabric.global_rank, fabric.world_size):
        inputs, targets = fabric.to_device((inputs, targets))
        loss = loss_fn(model(inputs), targets)
        if fused:
            with fsdp_overlap_step_with_backward(optimizers, model):
                loss.backward()
        else:  # the plain loop, for comparison
            loss.backward()
        held.append(sum(p.grad is not None for p in model.parameters()))
        if not fused:
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        fabric.print(f"loss {loss.item():.4f}, gradients held after backward: {held[-1]}")
    # --

    weights = full_state_dict(model.module)  # gathered from the shards: every rank takes part
    fabric.print(f"sum of the weights: {sum(w.double().sum().item() for w in weights.values()):.6f}")
    if out is not None and fabric.global_rank == 0:
        torch.save({"weights": weights, "held": held}, out)
    return weights, held


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--unfused", action="store_true", help="loss.backward() and optimizer steps after it")
    parser.add_argument("--out", type=Path, help="save the final weights here (rank 0)")
    args = parser.parse_args()
    train(args.devices, args.accelerator, args.steps, fused=not args.unfused, out=args.out)
