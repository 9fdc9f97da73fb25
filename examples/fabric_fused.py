"""Fabric with the fused backward + optimizer step.

``fabric.backward(loss)`` updates each parameter as soon as its gradient is ready and frees that
gradient, so a full set of gradients never exists. The loop is an ordinary Fabric loop; only the
strategy changes, and ``optimizer.step()`` / ``zero_grad()`` may stay (they find nothing to do).

    python examples/fabric_fused.py             # a tiny random BERT: a few seconds on a CPU
    python examples/fabric_fused.py --unfused   # the same loop unfused: the same numbers
    python examples/fabric_fused.py --max-norm 0.5 [--unfused]   # gradient clipping, fused or not
    python examples/fabric_fused.py --fp16 [--unfused]           # fp16 with torch's GradScaler (16-mixed)

Clipping: ``fabric.clip_gradients`` after backward finds no gradient under the fused step, so the
strategy takes ``max_norm`` (or ``clip_val``) and clips inside backward, with the same results; by
norm that costs one more backward, which only measures the norm.

fp16 (``precision="16-mixed"``, for GPUs without bf16): the strategy unscales and checks the gradients in
that same first backward (one more backward when not clipping by norm) and skips the step on an overflow, as
GradScaler does. On a CPU, Fabric would turn ``16-mixed`` into bf16, so the example passes the precision as a
plugin with its own GradScaler.
"""

from __future__ import annotations

import argparse
from typing import Optional

import lightning as L
import torch
from lightning.fabric.plugins import MixedPrecision
from transformers import AutoModelForSequenceClassification, get_scheduler

from lit_memory import FusedFabricStrategy
from lit_memory.hf.config import load_config
from lit_memory.model import weight_decay_groups

TINY_BERT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}


def random_batches(steps: int, batch_size: int = 4, length: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (steps, batch_size, length), generator=g)
    labels = torch.randint(0, 2, (steps, batch_size), generator=g)
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]


def train(
    fused: bool = True,
    steps: int = 10,
    max_norm: Optional[float] = None,
    clip_val: Optional[float] = None,
    scaler: Optional[torch.amp.GradScaler] = None,
):
    """Returns the model and each step's gradient norm (with ``max_norm``). ``scaler``: fp16 autocast with it."""
    clipping = {"max_norm": max_norm, "clip_val": clip_val}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plugins = [MixedPrecision("16-mixed", device, scaler)] if scaler is not None else None
    fabric = L.Fabric(devices=1, strategy=FusedFabricStrategy(**clipping) if fused else "auto", plugins=plugins)
    fabric.seed_everything(42)
    model = AutoModelForSequenceClassification.from_config(load_config("bundled:bert-large", 2, TINY_BERT))
    optimizer = torch.optim.AdamW(weight_decay_groups(model), lr=1e-3, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    schedule = get_scheduler("linear", optimizer, num_warmup_steps=steps // 3, num_training_steps=steps)
    model.train()
    norms = []
    for step, batch in enumerate(random_batches(steps)):
        loss = model(**fabric.to_device(batch)).loss
        fabric.backward(loss)  # fused: every parameter is updated here (clipped first) and its gradient freed
        held = sum(p.grad is not None for p in model.parameters())
        if fused:
            norm = fabric.strategy.total_norm  # with max_norm: the norm before clipping, as clip_gradients returns
        elif max_norm is not None or clip_val is not None:
            norm = fabric.clip_gradients(model, optimizer, **clipping)
        if max_norm is not None:
            norms.append(norm.item())
        optimizer.step()  # fused: no gradient left, nothing to do; unfused: the update (GradScaler's: or the skip)
        optimizer.zero_grad()
        schedule.step()
        fabric.print(f"step {step}: loss {loss.item():.4f}, gradients held after backward: {held}")
    return model, norms


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unfused", action="store_true", help="a plain strategy, for comparison")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-norm", type=float, help="clip the gradients to this global 2-norm")
    parser.add_argument("--clip-val", type=float, help="clip each gradient value to [-v, v]")
    parser.add_argument("--fp16", action="store_true", help="fp16 autocast with torch's GradScaler (16-mixed)")
    args = parser.parse_args()
    scaler = torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu") if args.fp16 else None
    train(fused=not args.unfused, steps=args.steps, max_norm=args.max_norm, clip_val=args.clip_val, scaler=scaler)
