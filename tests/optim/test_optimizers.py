"""What lit_memory knows of an optimizer's library (`lit_memory.optim.optimizers`): the library of a class or class
path, a library added in one place, the settings checks, torch's Adam and AdamW on their fused kernel."""

from __future__ import annotations

import functools

import bitsandbytes as bnb
import pytest
import torch
import torchao.optim
from conftest import HostReads
from torch import nn
from transformers import Adafactor

from lit_memory import fused
from lit_memory.config import trust
from lit_memory.errors import UserError
from lit_memory.optim import optimizers
from lit_memory.optim.configure import weight_decay_groups
from lit_memory.optim.optimizers import IMPORTABLE, Library, library_of, prepare, use_fused_kernels
from lit_memory.planning.prediction.step import OptimizerSpec
from lit_memory.run.checks import check_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for these small models


class SignMomentum(torch.optim.Optimizer):
    """An optimizer nobody special-cased: one momentum buffer per parameter, kept in bf16 (2 B per value whatever
    the weights' dtype), and the sign of it as the update."""

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p, dtype=torch.bfloat16)
                momentum = state["momentum"]
                momentum.mul_(group["beta"]).add_(p.grad.to(torch.bfloat16), alpha=1 - group["beta"])
                p.add_(momentum.sign().to(p.dtype), alpha=-group["lr"])


class Subclass8bit(bnb.optim.AdamW8bit):
    """A user's class built on bitsandbytes' (its library is bitsandbytes', wherever it is defined)."""


class PassesKeywords(torch.optim.AdamW):
    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)


def test_an_optimizers_library_is_read_one_way_from_its_class_or_class_path():
    assert library_of(torch.optim.AdamW).name == library_of("torch.optim.Adagrad").name == "torch"
    assert library_of(bnb.optim.Lion8bit).name == library_of("bitsandbytes.optim.PagedAdamW8bit").name == "bitsandbytes"
    assert library_of(Subclass8bit).name == "bitsandbytes"  # by its base class
    assert library_of(torchao.optim.AdamW4bit).name == library_of("torchao.optim.AdamW8bit").name == "torchao"
    assert library_of(Adafactor).name == library_of("transformers.Adafactor").name == "transformers"
    assert library_of(SignMomentum).name == "torch"  # a torch.optim.Optimizer subclass: torch-style
    assert library_of("mypackage.optim.Shiny").name == "mypackage"
    assert [
        library_of(c).quantises_state
        for c in (torch.optim.AdamW, Adafactor, bnb.optim.Adam8bit, torchao.optim.AdamW8bit)
    ] == [
        False,
        False,
        True,
        True,
    ]
    assert set(IMPORTABLE) <= set(trust.ALLOWLIST)  # the recipes' import allowlist names them from here


def test_a_library_added_in_one_place_is_what_every_other_place_asks(monkeypatch):
    """docs/memory.md, "Adding an optimizer", step 3: one `Library` in `LIBRARIES`, and the module's preparation,
    the settings checks, the fused step's buckets and the planner's view of the optimizer follow it."""

    class Mine(Library):
        name, packages = "mine", (__name__,)
        quantises_state, launch_stream, positive = True, "default", ("beta",)

        def keep_unquantised(self, optimizer, params, dtype) -> None:
            optimizer.unquantised = [id(p) for p in params]

    monkeypatch.setattr(optimizers, "LIBRARIES", (Mine(), *optimizers.LIBRARIES))
    assert library_of(SignMomentum).name == library_of(f"{__name__}.SignMomentum").name == "mine"
    assert OptimizerSpec(f"{__name__}.SignMomentum", {}).library.quantises_state
    with pytest.raises(UserError, match="model.optimizer: SignMomentum: beta must be > 0, got -0.5"):
        check_optimizer(functools.partial(SignMomentum, beta=-0.5))
    module, optimizer = built("cpu", SignMomentum, {}, torch.float32, True)
    assert optimizer.unquantised == [id(module.p0)]
    assert fused.copy_bucket(optimizer, list(module.parameters())).launch == "default"
    assert library_of(torch.optim.AdamW).name == "torch" and fused.copy_bucket(
        torch.optim.AdamW(module.parameters()), list(module.parameters())
    ).launch == "current"


# -- optimizers over a small module, on any device (the meta device included) ----------------------------

SHAPES = ((300, 64), (64, 96), (96,))  # an embedding-sized matrix, a layer's matrix, a bias: 19200, 6144, 96 values


def model(device: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Three parameters of `SHAPES` as a module (two weight-decay groups), on ``device``."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    for i, shape in enumerate(SHAPES):
        module.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device)))
    return module


def built(device: str, cls, kwargs, dtype=torch.float32, embeddings_unquantised=False):
    module = model(device, dtype)
    optimizer = cls(weight_decay_groups(module), **{"lr": 1e-3, **kwargs})
    prepare(optimizer, [module.p0] if embeddings_unquantised else [])  # p0 stands for the word embeddings
    return module, optimizer


# -- ranges: only the values the user set ------------------------------------------------------------------


def test_range_checks_apply_only_to_values_the_user_set():
    check_optimizer(functools.partial(bnb.optim.Lion8bit, lr=1e-4))  # keeps eps 0, which it never takes
    with pytest.raises(UserError, match="model.optimizer: PassesKeywords: eps must be > 0, got 0.0"):
        check_optimizer(functools.partial(PassesKeywords, lr=1e-3, eps=0.0))  # through **kwargs to AdamW's


# -- torch's fused kernel by default ----------------------------------------------------------------------


def test_torchs_adam_runs_its_fused_kernel_on_cuda_and_cpu_unless_the_config_chose_one():
    """On CUDA and the CPU lit_memory gives torch's Adam and AdamW their fused kernel (one call per group: no
    per-parameter host read of the step counter on CUDA, no per-parameter Python loop on the CPU) where the config
    leaves ``fused`` and ``foreach`` unset. A setting of the user's, another optimizer, another device or a loop
    that keeps torch's own default stays as it is."""
    _, default = built("meta", torch.optim.AdamW, {})
    library = library_of(default)
    group = default.param_groups[0]
    assert library.fuses_by_default(default, group, "cuda") and library.fuses_by_default(default, group, "cpu")
    assert not library.fuses_by_default(default, group, "mps")
    for chosen in ({"foreach": True}, {"fused": False}):
        _, optimizer = built("meta", torch.optim.AdamW, chosen)
        assert not library.fuses_by_default(optimizer, optimizer.param_groups[0], "cuda")
    _, adagrad = built("meta", torch.optim.Adagrad, {})
    assert not library.fuses_by_default(adagrad, adagrad.param_groups[0], "cuda")
    # at run time: only groups of plain tensors on the run's device (here the meta device stands for it)
    assert use_fused_kernels(default, torch.device("meta")) == []  # neither CUDA nor the CPU: unchanged
    assert all(g["fused"] is None for g in default.param_groups)


def scaled_steps(
    optimizer_for, amp_scaling: bool = True, steps: int = 4
) -> tuple[list[torch.Tensor], list[float], int]:
    """A GradScaler's steps of a small model on the CPU (the second's gradients overflow): (its final parameters, the
    scale after each step, the host reads inside the scaler's step and update)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = optimizer_for(model.parameters())
    if amp_scaling is not None:
        use_fused_kernels(optimizer, torch.device("cpu"), amp_scaling=amp_scaling)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    scales, reads = [], HostReads()
    for step in range(steps):
        x = torch.randn(4, 8)
        scaler.scale(model(x).square().mean()).backward()
        if step == 1:
            model[0].weight.grad[0, 0] = float("inf")
        with reads:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales, reads.count


def test_the_fused_kernel_takes_the_loss_scale_and_the_scaler_never_reads_it_on_the_host():
    """torch's GradScaler reads whether gradients overflowed on the host (``.item()``: a device sync every step)
    unless the optimizer's step takes the scale and the flag into its kernel, which torch marks only when the
    optimizer is built with ``fused=True``. lit_memory fuses an optimizer after it is built: it marks it too, and
    the steps (an overflow skipped, the scale backed off and grown) are those of AdamW built fused."""
    adamw = lambda params, **more: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, **more)  # noqa: E731
    built_fused = scaled_steps(lambda params: adamw(params, fused=True), amp_scaling=None)
    fused_after = scaled_steps(adamw)
    assert fused_after[2] == built_fused[2] == 0  # no host read in any step
    assert fused_after[1] == built_fused[1] == [2.0**11, 2.0**10, 2.0**11, 2.0**12]  # step 2 skipped
    for a, b in zip(fused_after[0], built_fused[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Clipping after backward needs unscaled gradients (Lightning refuses it for an optimizer that unscales): the
    # scaler then checks the flag on the host, once per step, with the same result.
    unmarked = scaled_steps(adamw, amp_scaling=False)
    assert unmarked[2] == 4 and unmarked[1] == built_fused[1]
    for a, b in zip(unmarked[0], built_fused[0]):
        torch.testing.assert_close(a, b)


def test_a_group_that_is_not_fused_unmarks_the_optimizer_before_its_step():
    """The mark is decided again before each step (`SequenceClassifier.optimizer_step`): a group added after the
    optimizer was fused, or fused groups replaced by a checkpoint's unfused ones, run torch's other kernels, which
    refuse GradScaler's scale ("Expected grad_scale and found_inf to be None"); unmarked, the scaler unscales them
    itself and the step goes through."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    use_fused_kernels(optimizer, torch.device("cpu"))
    assert optimizer._step_supports_amp_scaling
    optimizer.add_param_group({"params": list(model[1].parameters())})  # fused=None from the defaults
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    assert not optimizers.mark_amp_scaling(optimizer, True)  # marked, torch's AdamW raised on the unfused group
    scaler.step(optimizer)
    scaler.update()
    assert "step" in optimizer.state[model[1].weight]
    # where Lightning has no scaler (bf16-mixed, 32-true) nothing is marked, even with every group fused
    fused_only = torch.optim.AdamW(model.parameters(), lr=1e-2)
    use_fused_kernels(fused_only, torch.device("cpu"), amp_scaling=False)
    assert not getattr(fused_only, "_step_supports_amp_scaling", False)
    assert optimizers.mark_amp_scaling(fused_only, True) and not optimizers.mark_amp_scaling(fused_only, False)
