"""The analytic model of a training step's memory, at three levels: tensors, the allocator, the device.

**Tensors** (what ``torch.cuda.max_memory_allocated`` counts): the configured model and optimizer built on the
``meta`` device (nothing allocated, nothing downloaded), read by two sub-models: what the step keeps beside the
activations (`lit_memory.planning.prediction.state_model.state`: weights, gradients, optimizer state and
temporaries, the loss scaler, FSDP2's share, the fused step's buckets) and its activations layer by layer
(`lit_memory.planning.prediction.activation_model.activations`). `analytic` follows a training step in order:
``training_step`` (no gradient alive, except the window's in the middle of an accumulation window, or where the
loop keeps them), backward, the optimizer step (after which `SequenceClassifier.optimizer_step` frees the
gradients), and gives the bytes per category at the peak of each phase.

**Allocator** (``max_memory_reserved``): the step's allocations and frees in order (`lit_memory.memory.model.program`)
replayed through a model of PyTorch's caching allocator (`lit_memory.memory.hardware.allocator.replay`); what it
reserves beyond the tensors it holds is added to the tensors' peak.

**Device** (what ``nvidia-smi`` shows for the process): reserved plus the CUDA context and loaded kernels
(`lit_memory.memory.hardware.gpus.add_levels`), and a distributed run's NCCL communicators
(`lit_memory.memory.hardware.nccl`).

Milliseconds per setup for the tensors, tens of milliseconds with the replay (`device_total` caches it).
"""

from __future__ import annotations

import time

from lit_memory.memory.hardware.allocator import replay
from lit_memory.memory.hardware.gpus import add_levels
from lit_memory.memory.measure.footprint import Footprint
from lit_memory.memory.model import program
from lit_memory.planning.prediction.activation_model import Activations, activations
from lit_memory.planning.prediction.state_model import State, meta_build, nbytes, state
from lit_memory.planning.prediction.step import Prediction, Step


def file_gib(parameters: int, bytes_per_parameter: int) -> float:
    """The reference post's model-file size: parameters x bytes per parameter / 1024^3 (GiB)."""
    return parameters * bytes_per_parameter / 1024**3


def _total(categories: dict[str, int]) -> int:
    return sum(categories.values())


def analytic(step: Step, levels: bool = True, timeline: bool = False) -> Prediction:
    """The analytic prediction of ``step``; ``levels=False`` skips the allocator's replay (the tensors alone,
    milliseconds: what a search ranks hundreds of setups by); ``timeline``: also the step point by point
    (`Prediction.timeline`, what the picture of a step draws)."""
    start = time.perf_counter()
    module, optimizer = meta_build(step)
    kept = state(step, module, optimizer)
    act = activations(step, module.model)
    weights, grads, largest_grad = kept.weights, kept.gradients, kept.largest_gradient
    opt_state, step_temp, notes = kept.optimizer.state_bytes, kept.optimizer.temp_bytes, list(kept.optimizer.notes)
    unscaling = kept.unscaling
    batch = act.batch + kept.scaler  # "other": the batch, and GradScaler's state for the whole run
    sharding = kept.sharding
    loop = step.loop

    def phase(gradients=0, optimizer=opt_state, activations=0, other=batch, unsharded=0) -> dict[str, int]:
        """One phase's bytes per category, for one rank. ``unsharded``: gradients alive unsharded under
        FSDP (a unit's, before its reduce-scatter); ``gradients`` is then what the rank keeps sharded."""
        categories = {
            "weights": weights,
            "gradients": gradients,
            "optimizer": optimizer,
            "activations": activations,
            "other": other,
        }
        return sharding.per_rank(categories, unsharded) if sharding else categories

    footprint = Footprint()
    accumulating = step.accumulate_grad_batches > 1
    if step.fused:
        # Each bucket's gradients are applied by one optimizer step and freed as soon as the last of
        # them is accumulated: early in backward the activations dominate, later the bucket whose
        # gradients and step temporaries are largest is stepped. Under FSDP a bucket's gradients exist
        # unsharded until reduced, then as the rank's shard.
        footprint.add("forward", phase(activations=act.forward + act.transient))
        early = phase(activations=act.backward, other=batch + unscaling + act.backward_temp)
        late = max(
            (
                phase(
                    gradients=bucket.gradients,
                    optimizer=opt_state + bucket.optimizer.temp_bytes,
                    other=batch + unscaling,
                    unsharded=bucket.gradients if sharding else 0,
                )
                for bucket in kept.buckets
            ),
            key=_total,
            default=phase(),
        )
        measuring = phase()
        if step.measures:
            # Clipping by norm or loss scaling: a first backward only measures (the norm; whether a gradient
            # overflowed, each unscaled in place) and keeps the graph for the fused one, so every saved activation
            # stays to its end, where the largest gradient (the word embeddings') comes; each gradient lives only
            # until it is measured (under FSDP, a unit's unsharded ones until reduced). Inside the layers it is
            # as the fused backward: `early`.
            measuring = phase(
                gradients=largest_grad,
                activations=act.forward,
                other=batch + unscaling + act.backward_temp,
                unsharded=sharding.reducing if sharding else 0,
            )
        footprint.add("backward", max(early, late, measuring, key=_total))
        footprint.add("step", phase())  # Lightning's step after backward finds every gradient gone
    else:
        # SequenceClassifier.optimizer_step frees the gradients after the step; mid-window micro-batches
        # of an accumulation run their forward with the window's gradients alive, as do loops that release
        # them only before backward or zero them in place (`Loop.gradients`).
        forward_grads = grads if accumulating or loop.gradients != "after_step" else 0
        backward_grads = grads if accumulating or loop.gradients == "zeroed" else 0
        footprint.add("forward", phase(gradients=forward_grads, activations=act.forward + act.transient))
        early = phase(gradients=backward_grads, activations=act.backward, other=batch + act.backward_temp)
        if backward_grads:  # gradients accumulate into the existing ones, through a temporary
            late = phase(gradients=grads, other=batch + largest_grad)
        else:
            late = phase(gradients=grads, unsharded=sharding.reducing if sharding else 0)
        footprint.add("backward", max(early, late, key=_total))
        footprint.add("step", phase(gradients=grads, optimizer=opt_state + step_temp, other=batch + unscaling))
    if sharding:
        notes.append(sharding.describe())
    if step.device == "cuda" and step.communicators.total:
        notes.append(step.communicators.describe())
    prediction = Prediction(
        method="analytic",
        device=step.device,
        footprint=footprint,
        inference=weights + act.inference,
        parameters=kept.parameters,
        trainable=kept.trainable,
        notes=notes,
        attention=f"{act.spec.implementation} attention, {act.kernel.reason}",
    )
    if timeline:
        prediction.timeline = program.timeline(step_model(step, module.model, kept, act))
    if step.device == "cuda" and levels:
        # the allocator's reserve beyond what it holds, over the tensors' peak (its replay, not the model's sum)
        found = replay(program.events(step_model(step, module.model, kept, act)), step.target.allocator)
        reserve = footprint.peak + max(found.peak_reserved - found.peak_allocated, 0)
        add_levels(footprint, reserve, found.peak_phase, step.target, step.communicators.total, found.room)
    prediction.seconds = time.perf_counter() - start
    return prediction


# -- the allocator and the device ----------------------------------------------------------------------


def step_model(step: Step, model, kept: State, act: Activations) -> program.StepModel:
    """The step as `lit_memory.memory.model.program` writes it out for the allocator's replay, from its
    sub-models' results over ``model`` (the meta build's)."""
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    x, spec = act.shape, act.spec
    entries = [
        program.Param(
            bytes=nbytes(p),
            trainable=p.requires_grad,
            layer=act.layer_of.get(id(p)),
            head=id(p) in act.head_params,
            copy=p.numel() * x.compute_b if id(p) in act.autocast_copies else 0,
            made_at=act.made_at.get(id(p)),
        )
        for p in params
    ]
    tensors = list(act.layer_tensors)
    input_kept = any(t.name == "input" for t in tensors)
    runs = [
        program.LayerRun(tensors, trains=i >= act.first, input_kept=input_kept, checkpoint=mode)
        for i, mode in enumerate(act.modes)
    ]
    opt = kept.optimizer
    return program.StepModel(
        params=entries,
        buffers=kept.buffers,
        batch=act.batch,
        tokens=x.tokens,
        hidden_bytes=spec.hidden * x.param_b,
        layers=runs,
        states=[opt.state.get(id(p), []) for p in params],
        step_temps=opt.temps,
        buckets=[[index[id(p)] for p in bucket.params] for bucket in kept.buckets],
        bucket_temps=[bucket.optimizer.temps for bucket in kept.buckets],
        embeddings=list(act.embeddings),
        head=list(act.head),
        selective=act.selective,
        offload=step.offloading,
        fused=step.fused,
        measures=step.measures,
        accumulate=step.accumulate_grad_batches,
        gradients=step.loop.gradients,
        autocast_cache=step.loop.autocast_cache,
        backward_temp=act.backward_temp_per_token,
        workspace=step.target.cublas_workspace,
        shards=step.world_size if step.sharded else 1,
        gathers=step.sharded,
    )


def device_total(step: Step) -> int:
    """What ``nvidia-smi`` would show for this step's process at its peak, predicted analytically: tensors,
    the allocator's reserve and the CUDA context (bytes). Cached per step; cheap enough for a search
    over hundreds of setups."""
    return _levels(step)[0]


def capped_total(step: Step) -> int:
    """What a budget must allow this step (`Footprint.capped`): its `device_total` and, under a cap, the allocator's
    room beyond its reserve so that it never releases its cache and retries. What a plan fits to a budget."""
    return _levels(step)[1]


def _levels(step: Step) -> tuple[int, int]:
    key = step.key()
    if key not in _TOTALS:
        footprint = analytic(step).footprint
        device = footprint.device if footprint.device is not None else footprint.peak
        _TOTALS[key] = (device, device + (footprint.room or 0))
        if len(_TOTALS) > 4096:
            _TOTALS.pop(next(iter(_TOTALS)))
    return _TOTALS[key]


_TOTALS: dict[str, tuple[int, int]] = {}
