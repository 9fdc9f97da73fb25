"""What a step computes, and how much of it is recompute: FLOPs counted by torch's FLOP counter, and the
per-layer checkpointing plan with the fewest FLOPs that fits a device budget (``gradient_checkpointing: auto``).

FLOPs are counted, not modelled: `torch.utils.flop_counter.FlopCounterMode` over the configured module's
training forward and backward on fake tensors (`lit_memory.planning.prediction.step.build`, as the simulation builds
it), with its checkpointing plan switched on, so a checkpointed layer's forward re-run inside backward is counted
where it happens. They are device-independent: what a GPU will have to compute, not how long it takes. The
counter counts matrix products and attention (``mm``, ``addmm``, ``bmm``, the fused attention kernels), which
are nearly all of a Transformer's arithmetic; element-wise ops (GELU, dropout, LayerNorm, the optimizer's
update) are not counted, which is why selective checkpointing (it recomputes only those, and attention that
draws dropout) costs few counted FLOPs. The step runs CPU kernels: attention with dropout runs torch's math
path (batched matmuls) where a GPU runs a fused kernel with the same count.

The plan search (`resolve`): a layer that recomputes fully costs one more forward of the layer and keeps only
its input; selective keeps its matmul outputs too and recomputes only the cheap ops; none keeps everything.
Each layer's cost is the count's difference between the plans with every layer one way (averaged over the
layers: the families' stacks are uniform or alternate two kinds). The device total comes from the analytic
memory model (`lit_memory.planning.prediction.analytic.device_total`), the number a budget means.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from lit_memory.console import say
from lit_memory.data import check_shape
from lit_memory.errors import UserError
from lit_memory.hf.anatomy import find_layers
from lit_memory.memory.hardware.gpus import planning_limit, target
from lit_memory.memory.margin import Fit, Limit
from lit_memory.memory.measure.footprint import format_bytes
from lit_memory.memory.settings import MemorySettings
from lit_memory.model import SequenceClassifier
from lit_memory.optim.precision import runs_on_cpu
from lit_memory.planning.prediction.analytic import analytic, capped_total, device_total
from lit_memory.planning.prediction.simulate import fake_batch
from lit_memory.planning.prediction.step import Step, build, clips_by_norm, is_fused
from lit_memory.run.activation_checkpointing import CheckpointPlan, is_auto
from lit_memory.settings import Precision


@dataclass(frozen=True)
class Flops:
    """Counted FLOPs of one training micro-batch (forward, and backward with any recompute inside it; the fused
    step's measuring backward for clipping by norm or loss scaling, which is a second backward: `Step.measures`)."""

    forward: int
    backward: int
    recompute: int  # of `backward`: the checkpointed layers' forward run again
    samples: int
    measuring: int = 0  # the backward that only measures (its recompute included), before the one that steps

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.measuring

    @property
    def per_sample(self) -> float:
        return self.total / self.samples

    @property
    def recompute_share(self) -> float:
        return self.recompute / self.total if self.total else 0.0


_COUNTS: dict[str, tuple[int, int]] = {}


def _count(step: Step) -> tuple[int, int]:
    """(forward, backward) FLOPs of ``step``'s micro-batch, counted on fake tensors."""
    # where kept tensors wait changes no count; a 4-bit base runs its dense equivalent's matmuls (and fake tensors
    # cannot hold bitsandbytes' weights)
    if step.batch_size > 1:  # every op FlopCounterMode counts (matmuls, attention) is linear in the batch: one sample
        forward, backward = _count(replace(step, batch_size=1))
        return forward * step.batch_size, backward * step.batch_size
    step = _with_plan(step.dense_equivalent(), step.checkpointing, offload=False)
    # what the count depends on: the model's settings that change its matmuls, its plan among them, and the batch
    # shape (not the optimizer or the precision)
    model = {k: v for k, v in step.model.items() if k not in SequenceClassifier.SAME_FLOPS}
    key = step.key("model", "batch_size", "max_length", model=model)
    if key in _COUNTS:
        return _COUNTS[key]
    compute, autocast = step.precision.compute, step.precision.autocast
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    module, _ = build(step, fake)
    forward, backward = FlopCounterMode(display=False), FlopCounterMode(display=False)
    cast = torch.autocast("cpu", dtype=compute, cache_enabled=False) if autocast else contextlib.nullcontext()
    with fake, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log() without a trainer
        batch = fake_batch(step, module.model.config)
        with forward, cast:
            loss = module.training_step(batch, 0)
        with backward:
            loss.backward()
    _COUNTS[key] = (forward.get_total_flops(), backward.get_total_flops())
    if len(_COUNTS) > 256:
        _COUNTS.pop(next(iter(_COUNTS)))
    return _COUNTS[key]


def _with_plan(step: Step, plan: Optional[CheckpointPlan], offload: Optional[bool] = None) -> Step:
    """``step`` with ``plan`` (and, given, ``offload_activations``) in its module's settings (what
    `Step.as_settings` then states)."""
    model = {**step.model, "gradient_checkpointing": plan.value() if plan else False}
    if offload is not None:
        model["offload_activations"] = offload
    return replace(step, model=model)


def count_or_decline(step: Step) -> tuple[Optional[Flops], Optional[str]]:
    """``step``'s counted FLOPs, or None and one line saying why they cannot be counted (a forward that computes
    a shape or a number from the data, which fake tensors cannot give: DeBERTa's relative positions)."""
    try:
        return flops(step), None
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        return (
            None,
            f"FLOPs not counted: the model's forward computes from the data what fake tensors cannot give ({err})",
        )


def flops(step: Step) -> Flops:
    """``step``'s counted FLOPs per micro-batch, and how much of them its checkpointing recomputes."""
    forward, backward = _count(step)
    plain = _count(_with_plan(step, None))[1] if step.checkpointing else backward
    recompute = max(backward - plain, 0)
    return Flops(forward, backward, recompute, step.batch_size, measuring=backward if step.measures else 0)


def recompute_ratio(step: Step) -> float:
    """FLOPs ``step``'s checkpointing adds, as a share of the same step without it (0: none): what ``plan``
    ranks setups by. Counted at batch 1 (FLOPs per sample do not depend on the batch), so setups that differ
    only in batch, optimizer or precision share one count."""
    if step.checkpointing is None:
        return 0.0
    counted, _ = count_or_decline(replace(step, batch_size=1))
    if counted is None:  # not countable: full layers cost a forward each (see UNCOUNTED)
        modes = [m for m in step.checkpointing.modes(layer_costs(step).layers)]
        return sum(UNCOUNTED[0] if m == "full" else UNCOUNTED[1] for m in modes if m) / (3 * len(modes))
    return counted.recompute / (counted.forward + counted.backward - counted.recompute)


@dataclass(frozen=True)
class LayerCosts:
    """Per transformer layer: FLOPs recomputed by each mode (counted), and the step's FLOPs with none."""

    layers: int
    base: int
    full: float
    selective: float
    forward: int = 0  # of `base`: the forward pass

    def of(self, plan: Optional[CheckpointPlan]) -> float:
        if plan is None:
            return float(self.base)
        modes = plan.modes(self.layers)
        return self.base + self.full * modes.count("full") + self.selective * modes.count("selective")


# A model whose FLOPs cannot be counted (see `count_or_decline`) is planned by layers recomputed instead: a
# full layer costs a forward (1), a selective one the share of cheap ops counted for BERT (2 %).
UNCOUNTED = (1.0, 0.02)


def layer_costs(step: Step) -> LayerCosts:
    module = _with_plan(step, None, offload=False).module()
    with torch.device("meta"):
        layers = len(find_layers(module.build_model(pretrained=False)))
    try:
        forward, backward = _count(_with_plan(step, None))
    except (DataDependentOutputException, DynamicOutputShapeException):
        return LayerCosts(layers=layers, base=0, full=UNCOUNTED[0], selective=UNCOUNTED[1])
    base = forward + backward
    full = sum(_count(_with_plan(step, CheckpointPlan(rest="full")))) - base
    selective = sum(_count(_with_plan(step, CheckpointPlan(rest="selective")))) - base
    return LayerCosts(
        layers=layers, base=base, full=max(full, 0) / layers, selective=max(selective, 0) / layers, forward=forward
    )


# -- offloading against recompute: a stated device model (no GPU measured it here) ---------------------------
# A training step sustains this share of the GPU's dense 16-bit tensor-core peak
# (`lit_memory.memory.hardware.gpus.Gpu`): matmul-bound BERT-large steps run at 40-60 % of it (MLPerf BERT on A100:
# about half).
UTILISATION = 0.5


def seconds(step: Step, costs: LayerCosts, plan: Optional[CheckpointPlan], offloaded: int) -> float:
    """Modelled seconds of one micro-batch: its counted FLOPs at `UTILISATION` of the GPU's peak, plus what the
    host copies of an offloaded step do not hide. The copies run on a side stream (`OffloadActivations`): out
    during the forward pass, back during backward; each direction costs ``offloaded`` bytes at the host link's
    bandwidth, and only the part longer than the compute beside it shows."""
    gpu = step.target.gpu
    rate = gpu.tflops * 1e12 * UTILISATION
    total = costs.of(plan)
    compute = total / rate
    if not offloaded:
        return compute
    copy = offloaded / (gpu.host_gbps * 1e9)
    return compute + max(0.0, copy - costs.forward / rate) + max(0.0, copy - (total - costs.forward) / rate)


@dataclass(frozen=True)
class Resolved:
    """What ``auto`` chose, and why: for the one line a run prints."""

    plan: Optional[CheckpointPlan]
    limit: Limit
    total: int  # predicted device total (or tensors, on a CPU target)
    flops: float  # per micro-batch
    flops_none: float  # the same step without checkpointing
    layers: int
    offload: bool = False
    offloaded: int = 0  # bytes per direction per micro-batch
    exposed: float = 0.0  # modelled seconds the copies add

    @property
    def fit(self) -> Fit:
        return self.limit.fit(self.total)

    def line(self) -> str:
        chosen = self.plan.describe(self.layers) if self.plan else "no checkpointing"
        if self.offload:
            chosen += (
                f", checkpoints offloaded ({format_bytes(self.offloaded)} each way per micro-batch; "
                f"modelled to add {1e3 * self.exposed:.1f} ms, less than the recompute it saves)"
            )
        cost = (
            f"FLOPs per step {self.flops / self.flops_none:.3f}x no checkpointing" if self.flops_none
            else "FLOPs not countable for this model: the fewest layers recomputed"
        )
        return f"gradient_checkpointing auto: {chosen}: {self.fit.line()}; {cost}"


def resolve(step: Step, limit: Limit) -> Resolved:
    """The plan with the least modelled time whose predicted device total fits ``limit`` with its margin kept
    free (`lit_memory.memory.margin`): the fewest
    counted FLOPs, unless ``offload_activations: auto`` lets offloading the checkpointed layers' inputs buy
    room for less recompute where its copies cost less time than that recompute (`seconds`; CUDA only).

    Every plan (full and selective counts, with and without offloading) is taken in order of modelled time, and
    the first that fits wins. The allocator's rounding makes the device total move a little against the layer
    counts (a plan with one more selective layer can reserve a few MiB more), so no plan is skipped by assuming
    it does not; a plan whose tensors alone leave no room for the CUDA context is skipped before its replay
    (milliseconds each). Under a cap (``memory.budget`` on CUDA) a plan must also leave the allocator's room beyond
    its reserve (`capped_total`), so that the cap never makes it release its cache and retry. No plan fits: one
    error line with the total of every layer recomputed."""
    costs = layer_costs(step)
    n = costs.layers
    setting = step.model.get("offload_activations")
    cuda = step.device == "cuda"
    offloads = [True] if setting is True else ([False, True] if setting == "auto" and cuda and costs.base else [False])
    context = step.outside_allocator  # the CUDA context and NCCL's communicators
    # Selective layers refuse a second backward, and a fused step that measures first runs two (`check_twice`).
    most_selective = 0 if step.measures else n
    plans: list[Optional[CheckpointPlan]] = [
        (CheckpointPlan(full=full, selective=selective) if full + selective else None)
        for full in range(n + 1)
        for selective in range(min(n - full, most_selective) + 1)
    ]

    def activations(plan: Optional[CheckpointPlan], offload: bool) -> int:
        found = analytic(_with_plan(step, plan, offload=offload and cuda), levels=False)
        return found.footprint.phases["forward"]["activations"]

    candidates = []
    for offload in offloads:
        for plan in plans:
            # offloading needs every layer checkpointed (`SequenceClassifier`)
            if offload and (plan is None or None in plan.modes(n)):
                continue
            offloaded = activations(plan, False) - activations(plan, True) if offload and cuda else 0
            candidates.append(
                (seconds(step, costs, plan, offloaded) if costs.base else costs.of(plan), plan, offload, offloaded)
            )
    room = limit.usable
    total_of = capped_total if step.memory.cap is not None and cuda else device_total
    for _, plan, offload, offloaded in sorted(candidates, key=lambda c: (c[0], c[2])):
        candidate = _with_plan(step, plan, offload=offload)
        if analytic(candidate, levels=False).footprint.peak + context > room:
            continue
        total = total_of(candidate)
        if total <= room:
            exposed = seconds(step, costs, plan, offloaded) - seconds(step, costs, plan, 0) if offloaded else 0.0
            return Resolved(
                plan=plan, limit=limit, total=total, flops=costs.of(plan), flops_none=float(costs.base), layers=n,
                offload=offload, offloaded=offloaded, exposed=exposed,
            )
    everything = _with_plan(step, CheckpointPlan(rest="full"), offload=offloads[-1])
    smallest, device = total_of(everything), device_total(everything)
    room_words = (f" (device {format_bytes(device)} and {format_bytes(smallest - device)} of room the allocator needs "
                  "under the cap)" if smallest > device else "")
    raise UserError(
        f"gradient_checkpointing auto: no plan fits {limit} with the {100 * limit.margin:g} % "
        f"margin ({format_bytes(room)}); every layer recomputed is predicted at {format_bytes(smallest)}{room_words} "
        "(python -m lit_memory plan --budget ... finds other settings; --memory.margin sets the margin)"
    )


def resolved_setting(step: Step, limit: Optional[Limit]) -> tuple[Any, Resolved]:
    """``auto`` as the setting it resolves to (what the run's config then holds), with the reasons."""
    if limit is None:
        raise UserError(
            "model.gradient_checkpointing auto needs a device budget: pass --memory.budget (e.g. 4GiB), or use a "
            "recipe that names its tier (memory.tier)"
        )
    found = resolve(step, limit)
    return (found.plan.value() if found.plan else False), found


def planned(step: Step, limit: Optional[Limit] = None) -> Step:
    """``step`` with ``gradient_checkpointing: auto`` (and ``offload_activations: auto``) resolved for ``limit``
    (default: the run's, `lit_memory.memory.settings.MemorySettings.limit`): the plan with the fewest FLOPs
    predicted to fit, written into its module's settings as a run's config holds it. Other steps come back as they
    are."""
    if not is_auto(step.model.get("gradient_checkpointing")):
        return step
    limit = step.memory.limit if limit is None else limit
    value, found = resolved_setting(step, limit and limit.with_margin(step.margin))  # the step's margin, as it fits
    model = {**step.model, "gradient_checkpointing": value, "offload_activations": found.offload}
    return replace(step, model=model, planned=found.line())


def resolve_auto(
    settings: Any, memory: MemorySettings, training: bool, step_for: Callable[[Any], Step], read_card: Callable[[], Any]
) -> dict[str, Any]:
    """What a run trains with in place of ``model.gradient_checkpointing: auto`` and ``offload_activations: auto``
    (dotted keys; empty where nothing is auto): the plan with the fewest FLOPs predicted to fit its device budget,
    before the module is built. Outside training nothing is recomputed. On CUDA the budget is the smaller of the
    ``memory`` limit and what the run's card has free at start (``read_card()``); one line says which applied, one
    what was chosen. ``settings``: the run's resolved settings, read only; ``step_for(target)``: its step."""
    model = settings.model
    if training:
        check_twice(settings)
    if not training and is_auto(model.gradient_checkpointing):
        return {"model.gradient_checkpointing": False, **_offload_off(model)}  # no backward to plan for
    if not is_auto(model.gradient_checkpointing):
        return _offload_off(model)
    check_shape(settings.data.batch_size, settings.data.max_length)  # the shape the plan is sized for
    device = "cpu" if runs_on_cpu(settings.trainer.accelerator) else "cuda"  # (its allocator: set just before)
    found = target(device)
    card = _card(settings.trainer.strategy, read_card) if device == "cuda" else None
    if card is not None:
        found = replace(found, gpu=card.gpu)
    limit, line = planning_limit(memory.limit, card, memory.margin)
    if line:
        print(line, file=sys.stderr)  # every rank: each reads its own card
    step = planned(step_for(found), limit)
    say(step.planned)
    return {f"model.{key}": step.model[key] for key in ("gradient_checkpointing", "offload_activations")}


def _offload_off(model: Any) -> dict[str, Any]:
    """``offload_activations: auto`` without a plan being chosen: off."""
    return {"model.offload_activations": False} if is_auto(model.offload_activations) else {}


def check_twice(settings: Any) -> None:
    """One error line for selective checkpointing under a fused step that measures first: clipping by norm or fp16
    loss scaling runs a backward that only measures (the norm, an overflow) and then the one that steps, and torch's
    selective checkpointing allows one backward through a layer ("Trying to backward an extra time"; found on an
    H200 in 4gb.yaml's fp16 run, docs/gpu/h200.json). ``auto`` plans full or no checkpointing there instead."""
    trainer, value = settings.trainer, settings.model.gradient_checkpointing
    if is_auto(value) or not is_fused(trainer.strategy):
        return
    plan = CheckpointPlan.parse(value)
    if plan is None or not (plan.selective or plan.rest == "selective"):
        return
    why = [
        w
        for w, on in (
            (
                "clipping by norm (trainer.gradient_clip_val)",
                clips_by_norm(trainer.gradient_clip_val, trainer.gradient_clip_algorithm),
            ),
            (f"fp16 loss scaling (trainer.precision {trainer.precision})", Precision.of(trainer.precision).scaled),
        )
        if on
    ]
    if why:
        raise UserError(
            f"model.gradient_checkpointing {plan.describe()}: selective layers can be back-propagated once, and "
            f"{' and '.join(why)} makes the fused step run a measuring backward first: checkpoint those layers in "
            "full (or use auto, which plans so)"
        )


def _card(strategy: Any, read_card: Callable[[], Any]) -> Any:
    """The run's card at start, or None where reading it here would break the launch: a strategy that forks or
    spawns its processes must find CUDA uninitialised in this one."""
    name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "") or ""
    if "spawn" in name or "fork" in name:
        print(f"memory: the card is not read before {name} starts its processes: auto plans for the budget alone",
              file=sys.stderr)
        return None
    return read_card()
