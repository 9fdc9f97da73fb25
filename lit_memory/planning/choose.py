"""Choosing among setups: the rule that says which of two setups that fit is faster, and the advice a
run that ran out of memory prints (the lightest shipped recipe predicted to fit).

"Fastest" follows a stated rule; the first difference decides:

1. quality: every update reaches the weights (16-bit weights rounded to nearest drop every update below
   half a unit in their last place), then the mode (`MODES`): full fine-tuning, then LoRA, then QLoRA (LoRA over
   the base's 4-bit rounded weights), then the head alone on a frozen body (the seed's route); within a mode the
   fewest parameters frozen (by their share of the model: the embeddings alone cost less than the body), then
   every token kept (no truncation);
2. no gradient accumulation;
3. the least recompute, by counted FLOPs (`lit_memory.planning.recompute.recompute_ratio`: no checkpointing,
   then per-layer plans and selective, which recompute only cheap ops and attention, then full, which re-runs
   every layer's forward in backward); with equal recompute, no activation offloading (it copies each layer's
   input to host memory and back);
4. the larger micro-batch;
5. on CUDA 16-bit compute (bf16 autocast or bf16 weights: tensor cores) before fp32, on CPU fp32 first;
6. the optimizer that keeps more state (closest to AdamW's updates);
7. Lightning's optimizer step before the fused step (one optimizer step per parameter).

Whether a setup fits is decided on its device total (`lit_memory.planning.prediction.predict.device_total`: tensors,
the allocator's reserve and the CUDA context), the number ``nvidia-smi`` shows and a budget means, with the
margin ``memory.margin`` kept free (`lit_memory.memory.margin`).
"""

from __future__ import annotations

from typing import Any, Optional

from lit_memory.errors import UserError
from lit_memory.memory.margin import Fit, Limit
from lit_memory.memory.measure.footprint import format_bytes
from lit_memory.planning.prediction.analytic import analytic, device_total
from lit_memory.planning.prediction.step import Prediction, Step
from lit_memory.planning.recompute import planned, recompute_ratio

# How a setup fine-tunes, in the rule's order (`mode_of`).
MODES = ("full", "LoRA", "QLoRA", "head only")
RULE = (
    "quality (no 16-bit weights rounded to nearest > full fine-tuning, then LoRA, then QLoRA, then the head alone > "
    "the fewest parameters frozen > no truncation) "
    "> no accumulation > "
    "the least recompute (counted FLOPs) > no offloading > larger micro-batch > "
    "16-bit compute on CUDA > more optimizer state > Lightning's optimizer step before the fused step"
)


def mode_of(step: Step) -> str:
    """How ``step`` fine-tunes, one of `MODES`: LoRA or QLoRA (LoRA on a 4-bit base) where it has adapters, the head
    alone where the whole body is frozen, else full fine-tuning (embeddings or the first layers may be frozen)."""
    if step.model.get("lora"):
        return "QLoRA" if step.quantised_base else "LoRA"
    return "head only" if step.model.get("freeze") == "body" else "full"


def quality_class(step: Step) -> tuple[bool, int]:
    """The rule's first two keys, known before a prediction: 16-bit weights rounded to nearest, then the mode. A
    planner may predict one class at a time and stop at the first that fits (`lit_memory.tools.plan.ranked`)."""
    return step.loses_small_updates, MODES.index(mode_of(step))


def rank(step: Step, prediction: Prediction, longest: int) -> tuple:
    """Sort key of the module docstring's rule: smaller is faster."""
    sixteen_bit = step.precision.compute.itemsize == 2  # computes in 16 bits (autocast or 16-bit weights)
    precision = (0 if sixteen_bit else 1) if step.device == "cuda" else (0 if not sixteen_bit else 1)
    steady_state = prediction.footprint.phases["forward"]["optimizer"]
    frozen = 1 - prediction.trainable / prediction.parameters if prediction.parameters else 0.0
    return (
        (*quality_class(step), round(frozen, 2), step.max_length < longest),
        step.accumulate_grad_batches > 1,
        round(recompute_ratio(step), 4),
        bool(step.model.get("offload_activations")),
        -step.batch_size,
        precision,
        -steady_state,
        step.fused,
    )


def lightest_fitting(base: Step, limit: Limit, recipes: list[tuple[str, dict[str, Any]]]) -> Optional[tuple[str, Fit]]:
    """Of ``recipes`` ((name, dotted settings) pairs) laid over ``base``'s settings, the one the rule prefers
    among those predicted to fit ``limit`` (device total) with the margin kept (`lit_memory.memory.margin`):
    (its name, its fit). A recipe's ``auto`` plans for the smaller of its own budget and ``limit``."""
    fitting = []
    for name, values in recipes:
        try:
            step = base.with_settings(values)
            own = step.memory.limit
            step = planned(step, own if own is not None and own.bytes < limit.bytes else limit)
        except UserError:  # its `auto` checkpointing finds no plan within the limit: it does not fit
            continue
        fit = limit.with_margin(step.margin).fit(device_total(step))
        if fit.fits:
            fitting.append((name, step, analytic(step), fit))
    if not fitting:
        return None
    longest = max(step.max_length for _, step, _, _ in fitting)
    name, _, _, fit = min(fitting, key=lambda f: rank(f[1], f[2], longest))
    return name, fit


def advise(step: Step, limit: int, recipes: list[tuple[str, dict[str, Any]]]) -> str:
    """One line for a run that ran out of ``limit`` bytes: the lightest recipe predicted to fit, with what it
    leaves free, or plan."""
    size = format_bytes(limit)
    found = lightest_fitting(step, Limit(limit, size, step.margin), recipes)
    if found is None:
        budget = size.replace(" ", "")
        return (
            f"no shipped recipe is predicted to fit {size} with the {100 * step.margin:g} % margin: try "
            f"`python -m lit_memory plan --budget {budget}`"
        )
    name, fit = found
    where = "device total" if step.device == "cuda" else "peak"
    return f"lightest shipped recipe predicted to fit {size}: --config {name} (predicted {where}: {fit.line()})"
