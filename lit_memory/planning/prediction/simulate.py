"""One training step of the configured module on fake tensors, attributed by the tracker (`measure`: the
same step on real tensors, for models small enough to run here).

The module's own `configure_model` (checkpointing, freezing), optimizer (`build_optimizer`), the loop's
autocast (Lightning's, without its weight cache, or with it where `Loop.autocast_cache` says so) and the
"-true" precisions' init context, Lightning's order of zero_grad/backward/step (or the fused step's hooks),
all under ``FakeTensorMode``: nothing is allocated, and the same `Tracker` that measures real runs
attributes every tensor. Its allocations and frees, in order, are replayed through the caching-allocator
model (`lit_memory.memory.hardware.allocator`) for the reserved level. Seconds for BERT-large.

CUDA cannot be faked on the CPU build of torch, so the step runs CPU kernels. For a CUDA target, the
kernels whose memory differs stand in for CUDA's (`cuda_stand_ins`): attention runs a stand-in for the
kernel torch would pick on the target GPU (`lit_memory.memory.hardware.kernels`), which allocates and keeps what
that kernel does (q, k, v, the output laid out as the kernel lays it out, the log-sum-exp, the mask bias;
dq, dk, dv and the kernel's workspace in backward); dropout keeps a 1-byte mask (``native_dropout``, CUDA's
kernel) instead of the CPU's full-width noise; under autocast, softmax and LayerNorm run in fp32 as CUDA's
autocast policy has them (the CPU's runs them in bf16). What is left differs in small ways: CPU
kernels' own temporaries, bitsandbytes' CPU code, torchao's compiled kernel (stood in for by what it allocates:
`lit_memory.optim.optimizer_state.simulated_step`, which also answers the scalar reads of an optimizer's step).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch._subclasses.fake_tensor import FakeTensorMode

from lit_memory import task as task_
from lit_memory.fused import Clipping, OptimizerInBackward
from lit_memory.hf.anatomy import parameter_units
from lit_memory.hf.qlora import SIMULATION_DECLINED
from lit_memory.memory.hardware.allocator import replay
from lit_memory.memory.hardware.gpus import add_levels
from lit_memory.memory.hardware.kernels import Kernel
from lit_memory.memory.measure.tracker import Tracker
from lit_memory.model import SequenceClassifier
from lit_memory.optim.optimizer_state import StepNotSimulated, simulated_step
from lit_memory.optim.optimizers import library_of, use_device_defaults
from lit_memory.planning.prediction.step import Prediction, Step, build
from lit_memory.run.activation_checkpointing import OffloadActivations
from lit_memory.settings import patched


def fake_batch(step: Step, config) -> dict[str, torch.Tensor]:
    """The batch of ``step``'s worst case: every micro-batch full and padded to ``max_length``, with labels."""
    shape = (step.batch_size, step.max_length)
    kind = task_.kind_of(getattr(config, "problem_type", None))
    labels = kind.fake_labels(step.batch_size, config.num_labels)  # as the head's loss takes them
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, shape),
        "attention_mask": torch.ones(shape, dtype=torch.long),
        "labels": labels,
    }
    if getattr(config, "type_vocab_size", 0):
        batch["token_type_ids"] = torch.zeros(shape, dtype=torch.long)
    return batch


@dataclass
class _Stepping:
    """How the simulated step updates the parameters."""

    optimizers: list  # whose state exists before the tracked step (tracked from its start)
    warm: Callable[[], None]  # one step on zero gradients, leaving behind what a previous step leaves
    before_backward: Callable[[], None]  # what the loop runs between the forward pass and backward
    backward: Callable[[torch.Tensor], None]  # backward from the loss
    after_backward: Callable[[], None]  # what runs after backward


def _stepping(module: SequenceClassifier, optimizer: torch.optim.Optimizer, step: Step) -> _Stepping:
    """Lightning's step: ``optimizer.step()`` after backward, then `SequenceClassifier.optimizer_step`
    frees the gradients (other loops: `Loop.gradients`). With the fused step the strategy's own core steps
    and frees each gradient inside backward instead (clipping by norm: after a backward that only measures
    the norm)."""
    trainable = [p for p in module.model.parameters() if p.requires_grad]
    release = step.loop.gradients

    def warm() -> None:
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # creates the state; fused copies share the original optimizer's state
        if step.accumulate_grad_batches == 1 and release == "after_step":
            optimizer.zero_grad()  # a step leaves no gradient behind (see above)
        elif step.accumulate_grad_batches == 1 and release == "zeroed":
            optimizer.zero_grad(set_to_none=False)  # torch 1.x: zeroed in place, still allocated
        # else: a mid-window micro-batch keeps the window's gradients, as does a loop freeing them before backward

    def before_backward() -> None:
        # Before the backward phase begins, as the monitor's phases see it: Lightning's closure runs its
        # zero_grad between training_step and `on_before_backward`, a plain loop between forward and backward.
        if release == "before_backward" and step.accumulate_grad_batches == 1:
            optimizer.zero_grad()

    if step.fused:
        # hooks on the (throwaway, fake) model's parameters; any max_norm: only the extra backward matters here
        # (loss scaling's measuring backward holds what clipping by norm's does: the same pass, stood in by it)
        fused = OptimizerInBackward(
            optimizer, parameter_units(module), step.bucket, Clipping(max_norm=1.0) if step.measures else None
        )
        return _Stepping(
            [optimizer], warm, lambda: None, lambda loss: fused.backward(loss.backward), after_backward=lambda: None
        )
    return _Stepping([optimizer], warm, before_backward, lambda loss: loss.backward(), after_backward=optimizer.step)


STAND_IN_NOTE = (
    "simulated on CPU kernels, with CUDA's stood in where their memory differs: the attention kernel torch "
    "picks on the target GPU ({kernel}), 1-byte dropout masks, autocast's fp32 softmax and LayerNorm"
)


# -- CUDA's kernels, stood in for ----------------------------------------------------------------------


class _FusedAttention(torch.autograd.Function):
    """What a fused CUDA attention kernel (flash, memory-efficient, cuDNN) allocates and keeps: its output
    laid out (batch, length, heads, dim) as its inputs are, a fp32 log-sum-exp per row (padded to 32 rows by
    the memory-efficient kernel), the padding mask as a bias of the inputs' dtype; in backward dq, dk, dv
    and the kernel's fp32 workspaces. No values are computed: the tensors are fake."""

    @staticmethod
    def forward(ctx, q, k, v, name: str, masked: bool):  # type: ignore[override]
        batch, heads, length, dim = q.shape
        out = torch.empty((batch, length, heads, v.shape[-1]), dtype=q.dtype).transpose(1, 2)
        rows = math.ceil(length / 32) * 32 if name == "efficient" else length
        lse = torch.empty((batch, heads, rows), dtype=torch.float32)
        kept = [q, k, v, out, lse]
        if name == "efficient" and masked:
            kept.append(torch.empty((batch, 1, length, math.ceil(k.shape[-2] / 16) * 16), dtype=q.dtype))
        ctx.save_for_backward(*kept)
        ctx.name = name
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, out, lse, *bias = ctx.saved_tensors
        workspace = [torch.empty(lse.shape, dtype=torch.float32)]  # the rows' dot(dO, O)
        if ctx.name == "flash":
            workspace.append(torch.empty(q.shape, dtype=torch.float32))  # dq accumulator
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del workspace
        return dq, dk, dv, None, None


def _upcast(fn: Callable) -> Callable:
    """An op on CUDA autocast's fp32 list (softmax, LayerNorm): inputs cast to fp32, run in fp32."""

    def on_autocast_fp32(*args, **kwargs):
        if not torch.is_autocast_enabled("cpu"):
            return fn(*args, **kwargs)
        up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        with torch.autocast("cpu", enabled=False):
            return fn(*map(up, args), **{name: up(value) for name, value in kwargs.items() if name != "dtype"})

    return on_autocast_fp32


@contextlib.contextmanager
def cuda_stand_ins(step: Step):
    """CUDA's kernels where their memory differs from the CPU's (see the module docstring)."""
    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention
    capability = step.target.gpu.capability
    chosen: list[str] = []

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        kernel = Kernel.of(
            "sdpa", True, capability, query.dtype, query.shape[-1], dropout_p > 0, torch.is_grad_enabled(),
            attn_mask is not None,
        )
        chosen.append(kernel.name)
        if not kernel.fused:  # math: torch's own decomposition (16-bit inputs in fp32, as on CUDA)
            return sdpa(
                query.float(), key.float(), value.float(), attn_mask, dropout_p, is_causal, scale=scale, **kwargs
            ).to(query.dtype)
        if not torch.is_grad_enabled():
            return torch.empty_like(query)
        return _FusedAttention.apply(query, key, value, kernel.name, attn_mask is not None)

    def cuda_dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        return torch.native_dropout(input, p, True)[0]  # CUDA's kernel: the output and a bool mask

    stand_ins = {
        "scaled_dot_product_attention": attention,
        "dropout": cuda_dropout,
        "softmax": _upcast(functional.softmax),
        "layer_norm": _upcast(functional.layer_norm),
    }
    with contextlib.ExitStack() as stack:
        for name, stand_in in stand_ins.items():
            stack.enter_context(patched(functional, name, stand_in))
        yield chosen


def simulate(step: Step) -> Prediction:
    """One training step of the configured module on fake tensors, tracked per phase on the CPU (with
    CUDA's kernels stood in for a CUDA target). A 4-bit base (QLoRA) cannot be faked: `StepNotSimulated`."""
    if step.quantised_base:
        raise StepNotSimulated(SIMULATION_DECLINED)
    return _tracked_step(step, FakeTensorMode(allow_non_fake_inputs=True))  # the optimizer's own small real tensors


def measure(step: Step) -> Prediction:
    """The same step on real tensors on this CPU, tracked alike: the reference a prediction is held to where
    the model is small enough to run (tests' tiny models of each family). Real tensors run what fake ones
    cannot (DeBERTa's and ModernBERT's data-dependent shapes), so every family has a measured peak."""
    if step.device != "cpu":
        raise ValueError("measure runs the step here, on the CPU: give it a CPU target")
    if step.offloading:
        raise ValueError("measure keeps every tensor on this CPU: offloading has nowhere else to go")
    prediction = _tracked_step(step, contextlib.nullcontext())
    prediction.method = "measured"
    prediction.attention = prediction.attention.replace("(simulated)", "(measured)")
    return prediction


def _tracked_step(step: Step, mode) -> Prediction:
    start = time.perf_counter()
    compute, autocast = step.precision.compute, step.precision.autocast
    module, optimizer = build(step, mode)
    if step.offloading:
        # The step runs on the CPU here, standing in for the GPU: offload to the meta device instead
        # of host memory, so the offloaded tensors leave the tracked device as they would leave the GPU.
        module.activation_offload = OffloadActivations(host="meta")
    cuda = step.device == "cuda"
    stand_ins = cuda_stand_ins(step) if cuda else contextlib.nullcontext([])
    # Entered before the fake mode: torchao builds its quantisation maps from Python lists, which fake tensors cannot
    # give.
    stepped_fake = simulated_step(optimizer) if isinstance(mode, FakeTensorMode) else contextlib.nullcontext()
    with stepped_fake, mode, warnings.catch_warnings(), stand_ins as kernels:
        warnings.simplefilter("ignore")  # self.log() without a trainer; MemTracker's hook notices
        use_device_defaults(optimizer, step.device)
        stepping = _stepping(module, optimizer, step)
        stepping.warm()  # the steady state: the optimizer state exists
        batch = fake_batch(step, module.model.config)
        # Lightning's own autocast context (it disables autocast's weight cache; `Loop.autocast_cache`
        # keeps it, as Fabric and accelerate do); one per use.
        plugin = MixedPrecision(step.precision.name, "cpu") if autocast else None

        def forward_context() -> contextlib.AbstractContextManager:
            if plugin is None:
                return contextlib.nullcontext()
            if step.loop.autocast_cache:
                return torch.autocast("cpu", dtype=compute, cache_enabled=True)
            return plugin.forward_context()

        tracker = Tracker("cpu", record=cuda)  # compiled steps (torchao's) run eagerly here (`simulated_step`)
        tracker.track_external(module, *stepping.optimizers, batch)
        with tracker:
            tracker.enter_phase("forward")
            with forward_context():
                loss = module.training_step(batch, 0)
            stepping.before_backward()
            tracker.enter_phase("backward")
            stepping.backward(loss)
            tracker.enter_phase("step")
            stepping.after_backward()
        del loss

        optimizer.zero_grad()
        module.model.eval()
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        inference = Tracker("cpu")
        inference.track_external(module.model, inputs)
        with inference, torch.no_grad(), forward_context():
            inference.enter_phase("forward")
            module.model(**inputs)
    footprint = tracker.footprint
    own = library_of(optimizer).simulation_note() if isinstance(mode, FakeTensorMode) else None
    notes = [own] if own else []
    if cuda:
        kernel = kernels[0] if kernels else "eager attention"
        notes.append(STAND_IN_NOTE.format(kernel=kernel))
        found = steady_replay(tracker.events, step)
        add_levels(footprint, max(found.peak_reserved, footprint.peak), found.peak_phase, step.target,
                   step.communicators.total, found.room)
    return Prediction(
        method="simulated",  # `measure` renames its own
        device=step.device,
        footprint=footprint,
        inference=inference.footprint.peak,
        parameters=sum(p.numel() for p in module.model.parameters()),
        trainable=sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        seconds=time.perf_counter() - start,
        notes=notes,
        attention=f"{kernels[0] if kernels else 'eager'} (simulated)",
    )


def steady_replay(events: list, step: Step) -> Any:
    """The tracked step's allocations replayed twice after what existed before it (the second pass: the steady
    state, allocating into what the first left cached), through the target's allocator."""
    first = next((i for i, e in enumerate(events) if e[0] == "phase"), len(events))
    setup, body = events[:first], events[first:]
    made = {e[1] for e in body if e[0] == "+"}
    freed = {e[1] for e in body if e[0] == "-"}
    transient = made & freed  # made and released within the step: what the second pass repeats
    again = [
        (e[0], ("again", e[1]), *e[2:]) if e[0] != "phase" else e
        for e in body
        if e[0] == "phase" or e[1] in transient
    ]
    return replay([("phase", "setup"), *setup, *body, *again], step.target.allocator)
