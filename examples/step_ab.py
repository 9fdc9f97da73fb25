"""Step time of model switches side by side, interleaved in one process.

On a shared machine the load changes from minute to minute, so runs one after another (as `bench`
does) can differ several-fold for the same settings. Here every variant is built once and their
training steps (forward, then backward with the fused optimizer step inside) alternate, so the
load hits all of them alike; the median step per variant is printed, and the first step apart
(it includes compilation).

    # the recompute cost of checkpointing: BERT-large width, 2 layers, bf16 autocast, 8-bit AdamW
    python examples/step_ab.py --config_overrides '{"num_hidden_layers": 2}' --batch 8 --length 128 \\
        --bf16 --adamw8bit --variants '[{}, {"gradient_checkpointing": true}, {"gradient_checkpointing": "selective"}]'
    # torch.compile on the launch-bound proxy (BERT-large depth, tiny width): fused.yaml's settings,
    # then 4gb.yaml's (checkpointing, bf16, 8-bit AdamW)
    python examples/step_ab.py --config_overrides '{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size":
    256}' \\
        --batch 8 --length 16 --steps 20 --variants '[{}, {"compile": true}]'
    python examples/step_ab.py --config_overrides '{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size":
    256}' \\
        --batch 8 --length 16 --steps 20 --bf16 --adamw8bit \\
        --variants '[{"gradient_checkpointing": true}, {"gradient_checkpointing": true, "compile": true}, {}]'
    # clipping by norm (a measuring backward before the fused one): "gradient_clip_val" is the step's, not the model's
    python examples/step_ab.py --config_overrides '{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size":
    256}' \\
        --batch 8 --length 16 --steps 40 --variants '[{}, {"gradient_clip_val": 1.0}]'
    # fp16 with torch's GradScaler: the unfused step (backward, unscale_, step, update) against the fused one (a
    # backward that checks for overflow, then the one that steps); "fused" is the step's too
    python examples/step_ab.py --config_overrides '{"hidden_size": 64, "num_attention_heads": 4, "intermediate_size":
    256}' \\
        --batch 8 --length 16 --steps 40 --fp16 --variants '[{"fused": false}, {}, {"fused": false, "gradient_clip_val":
        1.0}, {"gradient_clip_val": 1.0}]'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from functools import partial
from typing import Optional

import torch

from lit_memory.fused import Clipping, OptimizerInBackward
from lit_memory.hf.anatomy import parameter_units
from lit_memory.model import SequenceClassifier


class Step:
    """One variant's training step: forward, then backward with the fused optimizer step inside (or, with
    ``"fused": false``, Lightning's order after it: unscale, clip, step, update, free the gradients)."""

    def __init__(
        self, module: SequenceClassifier, optimizer, fused: Optional[OptimizerInBackward], clip, scaler
    ) -> None:
        self.module, self.optimizer, self.fused, self.clip, self.scaler = module, optimizer, fused, clip, scaler

    def __call__(self, batch: dict, autocast) -> None:
        with autocast():
            loss = self.module.model(**batch).loss
        scaler = self.fused.scaler if self.fused is not None else self.scaler
        if scaler is not None:
            loss = scaler.scale(loss)
        if self.fused is not None:
            self.fused.backward(loss.backward)
            if scaler is not None:
                scaler.step(self.optimizer)
                scaler.update()
            return
        loss.backward()
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.module.model.parameters(), self.clip)
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()


def build(variant: dict, args: argparse.Namespace) -> Step:
    torch.manual_seed(0)
    variant = dict(variant)
    clip = variant.pop("gradient_clip_val", None)  # clipping by norm, as trainer.gradient_clip_val
    fusion = variant.pop("fused", True)
    module = SequenceClassifier(
        model_name_or_path="bundled:bert-large", pretrained=False, config_overrides=args.config_overrides, **variant
    )
    if args.adamw8bit:
        import bitsandbytes as bnb

        module.optimizer_factory = partial(bnb.optim.AdamW8bit, lr=2e-5, weight_decay=0.01)
    module.configure_model()
    optimizer = module.build_optimizer()
    # the scale a GradScaler settles at for this model: no step skipped (a skipped step would skip the update)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6) if args.fp16 else None
    if not fusion:
        return Step(module, optimizer, None, clip, scaler)
    # the fused step (layer buckets), as fused.yaml and 4gb.yaml train
    clipping = Clipping(max_norm=clip) if clip else None
    return Step(
        module,
        optimizer,
        OptimizerInBackward(optimizer, parameter_units(module.model), clipping=clipping, scaler=scaler),
        clip,
        scaler,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", type=json.loads, required=True,
        help="JSON list of SequenceClassifier kwargs (and the step's gradient_clip_val, fused)",
    )
    parser.add_argument("--config_overrides", type=json.loads, default={})
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as bf16-mixed")
    parser.add_argument("--fp16", action="store_true", help="fp16 autocast with torch's GradScaler, as 16-mixed")
    parser.add_argument("--adamw8bit", action="store_true", help="bitsandbytes AdamW8bit instead of AdamW")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(1000, 2000, (args.batch, args.length), generator=g),
        "attention_mask": torch.ones(args.batch, args.length, dtype=torch.long),
        "labels": torch.randint(0, 2, (args.batch,), generator=g),
    }
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    autocast = partial(torch.autocast, "cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext
    modules = [build(v, args) for v in args.variants]

    def step(variant: Step) -> float:
        start = time.perf_counter()
        variant(batch, autocast)
        return time.perf_counter() - start

    first = [step(m) for m in modules]
    for _ in range(args.warmup):
        for m in modules:
            step(m)
    times = [[] for _ in modules]
    for _ in range(args.steps):
        for i, m in enumerate(modules):
            times[i].append(step(m))
    base = statistics.median(times[0])
    for variant, first_s, ts in zip(args.variants, first, times):
        median = statistics.median(ts)
        print(
            f"{json.dumps(variant)}: first step {first_s:.2f} s, median step {median * 1000:.1f} ms "
            f"({median / base:.2f}x)"
        )


if __name__ == "__main__":
    main()
