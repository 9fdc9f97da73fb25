"""The analytic model of a training step's memory, at three levels: tensors, the allocator, the device.

**Tensors** (what ``torch.cuda.max_memory_allocated`` counts): the reference post's accounting (bytes per
parameter by precision and optimizer) over the parameter shapes of the configured model, built on the
``meta`` device (nothing allocated, nothing downloaded), plus a per-layer activation model
(`lit_memory.memory.hardware.layers`: what a layer keeps, by its description and the attention kernel torch picks,
`lit_memory.memory.hardware.kernels`). It follows a training step in order: ``training_step`` (no gradient alive,
except the window's in the middle of an accumulation window, or where the loop keeps them), backward,
optimizer step (after which `SequenceClassifier.optimizer_step` frees the gradients), and gives the bytes
per category at the peak of each phase, with every transient the step makes: foreach and per-parameter
optimizer temporaries, Adafactor's and torchao's per-step buffers, autocast's weight copies (and its cache,
where the loop keeps it), gradients of activations in backward.

**Allocator** (``max_memory_reserved``): the step's allocations and frees in order (`lit_memory.memory.hardware.program`)
replayed through a model of PyTorch's caching allocator (`lit_memory.memory.hardware.allocator`); what it reserves
beyond the tensors it holds (segment rounding, blocks split and cached) is added to the tensors' peak.

**Device** (what ``nvidia-smi`` shows for the process): reserved plus the CUDA context and loaded kernels
(`lit_memory.memory.hardware.gpus`).

The sub-models it assembles: the activations of each layer (`lit_memory.memory.prediction.activation_model`) and
what the step keeps beside them, the loss scaler's state, one rank's share under FSDP2, the fused step's buckets
(`lit_memory.memory.prediction.state_model`); the optimizer's tensors are measured by `lit_memory.optimizers`.

Milliseconds per setup for the tensors, tens of milliseconds with the replay (`device_total` caches it):
`lit_memory.tools.plan` predicts hundreds.
"""

from __future__ import annotations

import time

from lit_memory.anatomy import in_out, linear_types
from lit_memory.memory.hardware import program
from lit_memory.memory.hardware.allocator import replay
from lit_memory.memory.hardware.gpus import add_levels
from lit_memory.memory.measure.footprint import Footprint
from lit_memory.memory.hardware.layers import (
    LayerSpec,
    Tensor,
    backward_temp_per_token,
    batch_bytes,
    kernel,
    layer_tensors,
    selective_bytes_per_token,
)
from lit_memory.memory.prediction.activation_model import (
    _activations, _after_layers_per_token, _embedding_tensors, _inference, _linear_params, _lora_adapters, _modes,
    _nbytes, _parts, _per_build, _trains, shape_of, spec_of,
)
from lit_memory.memory.prediction.state_model import Sharding, _bucket_tensors, _buckets, _meta_build, _total, scaler_bytes
from lit_memory.memory.prediction.step import Prediction, Step
from lit_memory.optimizers import OptimizerTensors, optimizer_tensors


def file_gib(parameters: int, bytes_per_parameter: int) -> float:
    """The reference post's model-file size: parameters x bytes per parameter / 1024^3 (GiB)."""
    return parameters * bytes_per_parameter / 1024**3


def reference_bytes(frozen: int, trainable: int, bytes_per_value: int = 4, optimizer_values: int = 2) -> dict[str, int]:
    """The reference post's accounting for K frozen and N trainable parameters: weights K+N, gradients N, optimizer
    state 2N values (Adam's two moments). Full fine-tuning is K = 0: 4 values per parameter."""
    return {
        "weights": (frozen + trainable) * bytes_per_value,
        "gradients": trainable * bytes_per_value,
        "optimizer": optimizer_values * trainable * bytes_per_value,
    }


def analytic(step: Step, levels: bool = True, timeline: bool = False) -> Prediction:
    """The analytic prediction of ``step``; ``levels=False`` skips the allocator's replay (the tensors alone,
    milliseconds: what a search ranks hundreds of setups by); ``timeline``: also the step point by point
    (`Prediction.timeline`, what the picture of a step draws)."""
    start = time.perf_counter()
    module, optimizer = _meta_build(step)
    model = module.model
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weights = sum(_nbytes(p) for p in params) + sum(_nbytes(b) for b in model.buffers())
    grads = sum(_nbytes(p) for p in trainable)
    largest_grad = max((_nbytes(p) for p in trainable), default=0)
    opt = _per_build(optimizer, ("state", step.device), lambda: optimizer_tensors(optimizer, step.device))
    state, step_temp, notes = opt.state_bytes, opt.temp_bytes, list(opt.notes)
    shape = shape_of(model.config, step)
    spec = _per_build(model, ("spec",), lambda: spec_of(model))
    capability = step.target.gpu.capability
    k = kernel(spec, shape, capability)
    act = _activations(model, spec, shape, k, step)
    scaler_state, unscaling = scaler_bytes(step)
    batch = batch_bytes(shape) + scaler_state  # "other": the batch, and GradScaler's state for the whole run
    sharding = Sharding.of(model, step)
    loop = step.loop

    def phase(gradients=0, optimizer=state, activations=0, other=batch, unsharded=0) -> dict[str, int]:
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
    buckets = _per_build(optimizer, ("buckets", step.bucket), lambda: _buckets(module, optimizer, step.bucket)) if step.fused else []
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
                    gradients=(size := sum(_nbytes(p) for p in bucket)),
                    optimizer=state + _bucket_tensors(optimizer, step.device, by_group).temp_bytes,
                    other=batch + unscaling,
                    unsharded=size if sharding else 0,
                )
                for bucket, by_group in buckets
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
        footprint.add("step", phase(gradients=grads, optimizer=state + step_temp, other=batch + unscaling))
    if sharding:
        notes.append(sharding.describe())
    eval_kernel = kernel(spec, shape, capability, training=False)
    prediction = Prediction(
        method="analytic",
        device=step.device,
        footprint=footprint,
        inference=_inference(spec, shape, eval_kernel, weights),
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in trainable),
        notes=notes,
        attention=f"{spec.implementation} attention, {k.reason}",
    )
    if timeline:
        prediction.timeline = program.timeline(_step_model(module, optimizer, opt, buckets, spec, shape, k, step, act))
    if step.device == "cuda" and levels:
        model_ = _step_model(module, optimizer, opt, buckets, spec, shape, k, step, act)
        # the allocator's reserve beyond what it holds, over the tensors' peak (its replay, not the model's sum)
        found = replay(program.events(model_), step.target.allocator)
        reserve = footprint.peak + max(found.peak_reserved - found.peak_allocated, 0)
        add_levels(footprint, reserve, found.peak_phase, step.target)
    prediction.seconds = time.perf_counter() - start
    return prediction


# -- the allocator and the device ----------------------------------------------------------------------


def _step_model(module, optimizer, opt: OptimizerTensors, buckets, spec, shape, k, step: Step, act) -> program.StepModel:
    """The analytic model's step as `lit_memory.memory.hardware.program` writes it out for the allocator."""
    model = module.model
    layers, embeddings, pooler, head, first = _parts(model)
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    head_ids = {id(p) for m in head for p in m.parameters()}
    autocast_copy = {id(p) for p in _linear_params(layers + head)} if shape.autocast else set()
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    stage = _ffn_stages(layers, spec)
    entries = [
        program.Param(
            bytes=_nbytes(p),
            trainable=p.requires_grad,
            layer=layer_of.get(id(p)),
            head=id(p) in head_ids,
            copy=p.numel() * shape.compute_b if id(p) in autocast_copy else 0,
            made_at=stage.get(id(p)),
        )
        for p in params
    ]
    lora = _lora_adapters(layers[first]) if first < len(layers) else None
    tensors = layer_tensors(spec, shape, k, lora)
    modes = _modes(step, len(layers))
    runs = [
        program.LayerRun(
            tensors, trains=i >= first, input_kept=any(t.name == "input" for t in tensors), checkpoint=modes[i]
        )
        for i in range(len(layers))
    ]
    emb_trains = _trains(embeddings)
    emb = [Tensor(t.name, t.bytes, emb_trains) for t in _embedding_tensors(model, spec, shape)]
    head_kept = []
    if first < len(layers) or (pooler is not None and _trains(pooler)):
        head_kept = [shape.batch * spec.hidden * shape.compute_b] * 3
    if first < len(layers) and (after := _after_layers_per_token(model, spec, shape)):
        head_kept.append(after * shape.tokens)
    selective = selective_bytes_per_token(spec, shape, k, lora) if "selective" in modes else 0
    return program.StepModel(
        params=entries,
        buffers=sum(_nbytes(b) for b in model.buffers()),
        batch=batch_bytes(shape),
        tokens=shape.tokens,
        hidden_bytes=spec.hidden * shape.param_b,
        layers=runs,
        states=[opt.state.get(id(p), []) for p in params],
        step_temps=opt.temps,
        buckets=[[index[id(p)] for p in bucket] for bucket, _ in buckets],
        bucket_temps=[_bucket_tensors(optimizer, step.device, by_group).temps for _, by_group in buckets],
        embeddings=emb,
        head=head_kept,
        selective=selective,
        offload=step.offloading,
        fused=step.fused,
        measures=step.measures,
        accumulate=step.accumulate_grad_batches,
        gradients=step.loop.gradients,
        autocast_cache=step.loop.autocast_cache,
        backward_temp=backward_temp_per_token(spec, shape, k),
        workspace=step.target.cublas_workspace,
        shards=step.world_size if step.sharded else 1,
    )


def _ffn_stages(layers, spec: LayerSpec) -> dict[int, str]:
    """`program.Param.made_at` of each FFN weight and bias, read from the linear modules' shapes (any family):
    "down" for a projection from the FFN's width, "up" for one into it (gate and up, or a fused gate+up)."""
    stages = {}
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, linear_types()):
                into, out = in_out(module)
                stage = "down" if into == spec.ffn else "up" if into == spec.hidden and out in (spec.ffn, 2 * spec.ffn) else None
                if stage:
                    stages.update({id(p): stage for p in module.parameters(recurse=False)})
    return stages


def device_total(step: Step) -> int:
    """What ``nvidia-smi`` would show for this step's process at its peak, predicted analytically: tensors,
    the allocator's reserve and the CUDA context (bytes). Cached per step; cheap enough for a search
    over hundreds of setups."""
    key = step.key()
    if key not in _TOTALS:
        prediction = analytic(step)
        _TOTALS[key] = prediction.footprint.device if prediction.footprint.device is not None else prediction.footprint.peak
        if len(_TOTALS) > 4096:
            _TOTALS.pop(next(iter(_TOTALS)))
    return _TOTALS[key]


_TOTALS: dict[str, int] = {}
