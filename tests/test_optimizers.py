"""What lit_memory knows of optimizers, in one place (`lit_memory.optimizers`): the library of a class, the state
and temporaries measured by a probe step on meta tensors (against real state, and against the tracked step of a
real run), and an optimizer nobody special-cased predicted and simulated like the shipped ones."""

from __future__ import annotations

import functools

import bitsandbytes as bnb
import pytest
import torch
import torchao.optim
from transformers import Adafactor

from lit_memory import fused, optimizers, trust
from lit_memory.checks import check_optimizer
from lit_memory.errors import UserError
from lit_memory.memory.prediction.analytic import analytic
from lit_memory.memory.hardware.gpus import Target
from lit_memory.memory.prediction.predict import simulate_or_decline
from lit_memory.memory.prediction.simulate import measure
from lit_memory.memory.prediction.step import OptimizerSpec, Step
from lit_memory.model import weight_decay_groups
from lit_memory.optimizers import IMPORTABLE, Library, library_of, optimizer_tensors, prepare, unquantised_extra

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


class NonzeroSGD(torch.optim.Optimizer):
    """An optimizer whose step computes a shape from the data (the gradient's non-zero entries)."""

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    where = p.grad.flatten().nonzero()
                    p.view(-1)[where] -= group["lr"]


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
    assert [library_of(c).quantises_state for c in (torch.optim.AdamW, Adafactor, bnb.optim.Adam8bit, torchao.optim.AdamW8bit)] == [
        False, False, True, True,
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


# -- the state, measured on meta tensors, against real state ------------------------------------------------

SHAPES = ((300, 64), (64, 96), (96,))  # an embedding-sized matrix, a layer's matrix, a bias: 19200, 6144, 96 values


def model(device: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Three parameters of `SHAPES` as a module (two weight-decay groups), on ``device``."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    for i, shape in enumerate(SHAPES):
        module.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device)))
    return module


OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {}),
    "AdamW bf16": (torch.optim.AdamW, {}, torch.bfloat16),
    "Adagrad": (torch.optim.Adagrad, {}),
    "RMSprop": (torch.optim.RMSprop, {}),
    "RMSprop centered, momentum": (torch.optim.RMSprop, {"centered": True, "momentum": 0.9}),
    "SGD momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "SGD": (torch.optim.SGD, {"lr": 0.1}),
    "Adamax": (torch.optim.Adamax, {}),
    "NAdam": (torch.optim.NAdam, {}),
    "torch Adafactor": (torch.optim.Adafactor, {}),
    "transformers Adafactor, relative step": (Adafactor, {"lr": None}),
    "bitsandbytes AdamW8bit": (bnb.optim.AdamW8bit, {}),
    "bitsandbytes AdamW8bit, embeddings 32-bit": (bnb.optim.AdamW8bit, {}, torch.float32, True),
    "bitsandbytes Lion8bit": (bnb.optim.Lion8bit, {}),
    "bitsandbytes Adam (32-bit)": (bnb.optim.Adam, {}),
    "torchao AdamW8bit": (torchao.optim.AdamW8bit, {}),
    "torchao AdamW4bit": (torchao.optim.AdamW4bit, {}),
    "torchao AdamW8bit, embeddings plain": (torchao.optim.AdamW8bit, {}, torch.float32, True),
    "SignMomentum (bf16 state)": (SignMomentum, {}),
}


def built(device: str, cls, kwargs, dtype=torch.float32, embeddings_unquantised=False):
    module = model(device, dtype)
    optimizer = cls(weight_decay_groups(module), **{"lr": 1e-3, **kwargs})
    prepare(optimizer, [module.p0] if embeddings_unquantised else [])  # p0 stands for the word embeddings
    return module, optimizer


def real_state(optimizer) -> dict[str, int]:
    """Bytes per dtype of every tensor the optimizer's state holds (inside tensor subclasses), each storage once."""
    found: dict[int, tuple[str, int]] = {}

    def visit(value):
        if isinstance(value, torch.Tensor):
            if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
                for name in value.__tensor_flatten__()[0]:
                    visit(getattr(value, name))
            else:
                storage = value.untyped_storage()
                found[storage.data_ptr()] = (str(value.dtype).removeprefix("torch."), storage.nbytes())

    for state in optimizer.state.values():
        for value in state.values():
            visit(value)
    out: dict[str, int] = {}
    for dtype, nbytes in found.values():
        out[dtype] = out.get(dtype, 0) + nbytes
    return out


@pytest.mark.parametrize("case", OPTIMIZERS)
def test_the_state_measured_on_meta_tensors_is_the_state_a_real_step_makes(case):
    """Every optimizer's state, counted by dtype, as the probe measures it over meta parameters (any size, nothing
    allocated), equals what one real step on CPU tensors of the same shapes makes: moments, factored statistics,
    8-bit and 4-bit codes with their block scales and quantile maps (shared ones once), step counters, the
    32-bit/plain override of the embeddings."""
    cls, kwargs, *rest = OPTIMIZERS[case]
    real_module, real = built("cpu", cls, kwargs, *rest)
    for p in real_module.parameters():
        p.grad = torch.randn_like(p)
    with torch.compiler.set_stance("force_eager"):  # torchao: its kernel eagerly (the state is what matters here)
        real.step()
    _, meta = built("meta", cls, kwargs, *rest)
    measured = optimizer_tensors(meta, "cpu")
    assert measured.by_dtype == real_state(real)
    assert measured.state_bytes == sum(real_state(real).values())
    assert not measured.notes  # measured, not assumed


def test_adagrad_and_rmsprop_keep_one_value_per_parameter_adam_two():
    values = sum(torch.Size(s).numel() for s in SHAPES)
    per_value = {  # torch's own kernels (foreach): step counters on the host on CUDA
        name: optimizer_tensors(built("meta", cls, kwargs)[1], "cuda").state_bytes / values
        for name, cls, kwargs in (("AdamW", torch.optim.AdamW, {"fused": False}), ("Adagrad", torch.optim.Adagrad, {}),
                                  ("RMSprop", torch.optim.RMSprop, {}))
    }
    assert per_value == {"AdamW": 8.0, "Adagrad": 4.0, "RMSprop": 4.0}
    fused = optimizer_tensors(built("meta", torch.optim.AdamW, {})[1], "cuda")  # lit_memory's default on CUDA
    assert fused.state_bytes == 8 * values + 4 * len(SHAPES)  # its step counters on the device, one per parameter


def test_temporaries_are_a_whole_group_at_once_where_the_target_runs_foreach():
    """Adagrad's step: torch's foreach kernels (CUDA's default) hold the std and the scaled gradient of every
    parameter of a group at once; its loop over parameters (the CPU's) one std at a time (the gradient is scaled
    inside ``addcdiv_``)."""
    _, optimizer = built("meta", torch.optim.Adagrad, {})
    decay, no_decay = [[p.numel() * 4 for p in g["params"]] for g in optimizer.param_groups]
    on_cuda, on_cpu = optimizer_tensors(optimizer, "cuda").temps, optimizer_tensors(optimizer, "cpu").temps
    assert sorted(map(sorted, on_cuda)) == sorted([sorted(decay * 2), sorted(no_decay * 2)])
    assert sorted(on_cpu) == sorted([b] for b in decay + no_decay)
    fused = optimizer_tensors(built("meta", torch.optim.AdamW, {"fused": True})[1], "cuda")
    assert fused.temps == [] and fused.state_bytes == 8 * sum(decay + no_decay) // 4 + 4 * 3  # counters on the device


def test_what_unquantised_embeddings_would_add_is_measured_not_assumed_adam_like():
    """The estimate's note on ``embedding_optimizer_state: auto``: Lion8bit keeps one state, AdamW8bit two."""
    extra = {}
    for cls in (bnb.optim.AdamW8bit, bnb.optim.Lion8bit):
        module, optimizer = built("meta", cls, {})
        extra[cls.__name__] = unquantised_extra(optimizer, [module.p0], "cuda")[id(module.p0)]
    one_state = 300 * 64 * (4 - 1) - 4 * 300 * 64 // 256  # fp32 instead of an 8-bit code and its block's absmax
    assert extra == {"AdamW8bit": 2 * one_state, "Lion8bit": one_state}


# -- ranges: only the values the user set ------------------------------------------------------------------


def test_range_checks_apply_only_to_values_the_user_set():
    check_optimizer(functools.partial(bnb.optim.Lion8bit, lr=1e-4))  # keeps eps 0, which it never takes
    with pytest.raises(UserError, match="model.optimizer: PassesKeywords: eps must be > 0, got 0.0"):
        check_optimizer(functools.partial(PassesKeywords, lr=1e-3, eps=0.0))  # through **kwargs to AdamW's


# -- an optimizer nobody special-cased, end to end on the bundled model ------------------------------------


@pytest.fixture
def custom_optimizers(monkeypatch):
    """This module's optimizers by class path, without jsonargparse's import (a test process may have enforced the
    recipes' allowlist; a run names such a class with ``--trust-recipe``)."""
    classes = {f"{__name__}.{c.__name__}": c for c in (SignMomentum, NonzeroSGD)}
    factory = OptimizerSpec.factory
    monkeypatch.setattr(
        OptimizerSpec, "factory",
        lambda self: functools.partial(classes[self.class_path], **self.init_args) if self.class_path in classes else factory(self),
    )
    return classes


def minilm(class_path: str, **init_args) -> Step:
    return Step(
        model={"model_name_or_path": "bundled:minilm"}, optimizer=OptimizerSpec(class_path, init_args),
        target=Target(type="cpu"), batch_size=2, max_length=32,
    )


@pytest.mark.parametrize("class_path", [f"{__name__}.SignMomentum", "torch.optim.Adagrad", "torch.optim.RMSprop"])
def test_a_new_optimizer_is_predicted_as_a_real_run_measures_it(custom_optimizers, class_path):
    """The predicted optimizer state and step of an optimizer added by naming it (nothing else changed) against the
    same step on real tensors, tracked (`lit_memory.memory.prediction.simulate.measure`), on the bundled MiniLM; and the
    simulation on fake tensors runs it (Adagrad's step reads its counter, made before the fake mode, as a number)."""
    setup = minilm(class_path, lr=1e-3)
    predicted, tracked = analytic(setup), measure(setup)
    steady, stepping = (
        {name: p.footprint.phases[phase]["optimizer"] for name, p in (("predicted", predicted), ("tracked", tracked))}
        for phase in ("forward", "step")
    )
    assert steady["predicted"] == steady["tracked"]
    assert stepping["predicted"] == pytest.approx(stepping["tracked"], rel=0.02)
    trained = predicted.trainable
    per_value = {"SignMomentum": 2, "Adagrad": 4, "RMSprop": 4}[class_path.rsplit(".", 1)[-1]]
    assert steady["predicted"] == pytest.approx(per_value * trained, rel=0.001)  # + step counters on the CPU
    simulated, declined = simulate_or_decline(setup)
    assert declined is None and simulated.footprint.phases["forward"]["optimizer"] == steady["tracked"]


def test_an_optimizer_step_the_simulation_cannot_run_is_declined_in_its_own_name(custom_optimizers):
    simulated, declined = simulate_or_decline(minilm(f"{__name__}.NonzeroSGD", lr=1e-3))
    assert simulated is None
    assert declined.startswith("not simulated: NonzeroSGD's step computes a shape from the data")
    assert "forward" not in declined


def test_torchs_adam_runs_its_fused_kernel_on_cuda_and_cpu_unless_the_config_chose_one():
    """On CUDA and the CPU lit_memory gives torch's Adam and AdamW their fused kernel (one call per group: no
    per-parameter host read of the step counter on CUDA, no per-parameter Python loop on the CPU) where the config
    leaves ``fused`` and ``foreach`` unset; its step then makes no temporaries to predict. A setting of the
    user's, another optimizer, another device or a loop that keeps torch's own default stays as it is."""
    from lit_memory.optimizers import use_fused_kernels

    _, default = built("meta", torch.optim.AdamW, {})
    library = library_of(default)
    group = default.param_groups[0]
    assert library.fuses_by_default(default, group, "cuda") and library.fuses_by_default(default, group, "cpu")
    assert not library.fuses_by_default(default, group, "mps")
    assert optimizer_tensors(default, "cuda").temps == []  # fused: updated in place
    for chosen in ({"foreach": True}, {"fused": False}):
        _, optimizer = built("meta", torch.optim.AdamW, chosen)
        assert not library.fuses_by_default(optimizer, optimizer.param_groups[0], "cuda")
        assert optimizer_tensors(optimizer, "cuda").temps  # foreach: a group's temporaries at once
    _, adagrad = built("meta", torch.optim.Adagrad, {})
    assert not library.fuses_by_default(adagrad, adagrad.param_groups[0], "cuda")
    # at run time: only groups of plain tensors on the run's device (here the meta device stands for it)
    assert use_fused_kernels(default, torch.device("meta")) == []  # neither CUDA nor the CPU: unchanged
    assert all(g["fused"] is None for g in default.param_groups)
