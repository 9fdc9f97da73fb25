"""One training step of the configured module on fake tensors, attributed by the tracker.

The module's own `configure_model` (checkpointing, freezing), optimizer (`build_optimizer`), Lightning's
autocast context for mixed precision and the "-true" precisions' init context, Lightning's order of
zero_grad/backward/step (or the fused step's hooks), all under ``FakeTensorMode``: nothing is
allocated, and the same `Tracker` that measures real runs attributes every tensor. CUDA cannot be
faked on the CPU build of torch, so the step runs CPU kernels. Seconds for BERT-large.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from unittest import mock
from dataclasses import dataclass
from typing import Callable

import torch

from lit_memory.activations import OffloadActivations
from lit_memory.anatomy import parameter_units
from lit_memory.fused import Clipping, OptimizerInBackward
from lit_memory.lowbit import is_torchao
from lit_memory.memory.analytic import foreach_default, torchao_kernel_bytes
from lit_memory.memory.setup import PRECISIONS, Prediction, Setup, build
from lit_memory.memory.tracker import Tracker
from lit_memory.model import SequenceClassifier

def _fake_batch(setup: Setup, config) -> dict[str, torch.Tensor]:
    # The worst case a run can see: every micro-batch full and padded to max_length.
    shape = (setup.batch_size, setup.max_length)
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, shape),
        "attention_mask": torch.ones(shape, dtype=torch.long),
        "labels": torch.zeros(setup.batch_size, dtype=torch.long),
    }
    if getattr(config, "type_vocab_size", 0):
        batch["token_type_ids"] = torch.zeros(shape, dtype=torch.long)
    return batch


def _use_device_defaults(optimizer: torch.optim.Optimizer, device: str) -> None:
    """Run the optimizer implementation torch picks on ``device``: on CUDA, foreach kernels (their
    temporaries are a whole parameter group at once) where the config leaves ``foreach`` unset."""
    if device == "cuda" and foreach_default(optimizer, device):
        for group in optimizer.param_groups:
            if group.get("foreach", False) is None:
                group["foreach"] = True


@dataclass
class _Stepping:
    """How the simulated step updates the parameters."""

    optimizers: list  # whose state exists before the tracked step (tracked from its start)
    warm: Callable[[], None]  # one step on zero gradients, leaving behind what a previous step leaves
    backward: Callable[[torch.Tensor], None]  # backward from the loss
    after_backward: Callable[[], None]  # what runs after backward


def _stepping(module: SequenceClassifier, optimizer: torch.optim.Optimizer, setup: Setup) -> _Stepping:
    """Lightning's step: ``optimizer.step()`` after backward, then `SequenceClassifier.optimizer_step`
    frees the gradients. With the fused step the strategy's own core steps and frees each gradient
    inside backward instead (clipping by norm: after a backward that only measures the norm).
    """
    trainable = [p for p in module.model.parameters() if p.requires_grad]

    def warm() -> None:
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # creates the state; fused copies share the original optimizer's state
        if setup.accumulate_grad_batches == 1:  # else: a mid-window micro-batch keeps the window's gradients
            optimizer.zero_grad()  # a step leaves no gradient behind (see above)

    if setup.fused:
        # hooks on the (throwaway, fake) model's parameters; any max_norm: only the extra backward matters here
        fused = OptimizerInBackward(optimizer, parameter_units(module), setup.bucket, Clipping(max_norm=1.0) if setup.clip_norm else None)
        return _Stepping([optimizer], warm, lambda loss: fused.backward(loss.backward), after_backward=lambda: None)
    return _Stepping([optimizer], warm, lambda loss: loss.backward(), after_backward=optimizer.step)


TORCHAO_NOTE = (
    "torchao's update kernel is compiled, and compiled code cannot run on fake tensors: the simulation creates "
    "its state with torchao's own code and allocates the kernel's buffers as inductor's CPU code does "
    "(lit_memory.memory.analytic.torchao_kernel_bytes) instead of running it"
)


@contextlib.contextmanager
def _torchao_kernel_as_buffers(optimizer: torch.optim.Optimizer):
    """Step torchao's optimizer on fake tensors: its Python code as it is (state creation, the step
    counter), its compiled per-parameter kernel (`torchao.optim.adam.single_param_adam`, private) replaced
    by the buffers that kernel allocates, run eagerly. Enter before the fake mode: torchao builds its
    quantisation maps from Python lists (cached), which fake tensors cannot give."""
    if not is_torchao(optimizer):
        yield
        return
    from torchao.optim import adam, subclass_4bit, subclass_8bit

    for maps in (subclass_8bit, subclass_4bit):
        maps.get_qmap_signed(), maps.get_qmap_unsigned()

    def buffers(p, grad, step, exp_avg, *rest) -> None:
        kind = type(exp_avg).__name__.removeprefix("OptimState")
        block = getattr(exp_avg, "block_size", float("inf"))
        held = torch.empty(torchao_kernel_bytes(kind, exp_avg.numel(), block), dtype=torch.uint8)
        del held

    with mock.patch.object(adam, "single_param_adam", buffers), torch.compiler.set_stance("force_eager"):
        yield


def simulate(setup: Setup) -> Prediction:
    """One training step of the configured module on fake tensors, tracked per phase on ``cpu``."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    autocast = PRECISIONS[setup.precision][2]
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the optimizer's own small real tensors
    module, optimizer = build(setup, fake)
    if setup.offloading:
        # The step runs on the CPU here, standing in for the GPU: offload to the meta device instead
        # of host memory, so the offloaded tensors leave the tracked device as they would leave the GPU.
        module.activation_offload = OffloadActivations(host="meta")
    with _torchao_kernel_as_buffers(optimizer), fake, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log() without a trainer; MemTracker's hook notices
        _use_device_defaults(optimizer, setup.device)
        stepping = _stepping(module, optimizer, setup)
        stepping.warm()  # the steady state: the optimizer state exists
        batch = _fake_batch(setup, module.model.config)
        # Lightning's own autocast context (it disables autocast's weight cache); one per use.
        plugin = MixedPrecision(setup.precision, "cpu") if autocast else None

        def forward_context() -> contextlib.AbstractContextManager:
            return plugin.forward_context() if plugin else contextlib.nullcontext()

        tracker = Tracker("cpu", compiled_steps=False)  # torchao's steps run eagerly here
        tracker.track_external(module, *stepping.optimizers, batch)
        with tracker:
            tracker.enter_phase("forward")
            with forward_context():
                loss = module.training_step(batch, 0)
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
    return Prediction(
        method="simulated",
        device="cpu",
        footprint=tracker.footprint,
        inference=inference.footprint.peak,
        parameters=sum(p.numel() for p in module.model.parameters()),
        trainable=sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        seconds=time.perf_counter() - start,
        notes=[TORCHAO_NOTE] if is_torchao(optimizer) else [],
    )


