"""What an optimizer's state holds, measured by a probe step on meta tensors (`lit_memory.optim.optimizer_state`):
against real state, against the tracked step of a real run, and an optimizer nobody special-cased predicted and
simulated like the shipped ones."""

from __future__ import annotations

import functools

import bitsandbytes as bnb
import pytest
import torch
import torchao.optim
from test_optimizers import SHAPES, SignMomentum, built
from transformers import Adafactor

from lit_memory.memory.hardware.gpus import Target
from lit_memory.optim.optimizer_state import optimizer_tensors, unquantised_extra
from lit_memory.planning.prediction.analytic import analytic
from lit_memory.planning.prediction.predict import simulate_or_decline
from lit_memory.planning.prediction.simulate import measure
from lit_memory.planning.prediction.step import OptimizerSpec, Step

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for these small models


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


# -- the state, measured on meta tensors, against real state ------------------------------------------------

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


def test_torchs_adam_on_its_default_fused_kernel_makes_no_temporaries():
    """torch's AdamW on the fused kernel lit_memory gives it where the config chooses none updates in place: no
    temporaries to predict; a config that chose foreach, or no fused kernel, has a group's temporaries at once."""
    assert optimizer_tensors(built("meta", torch.optim.AdamW, {})[1], "cuda").temps == []
    for chosen in ({"foreach": True}, {"fused": False}):
        assert optimizer_tensors(built("meta", torch.optim.AdamW, chosen)[1], "cuda").temps


# -- an optimizer nobody special-cased, end to end on the bundled model ------------------------------------


@pytest.fixture
def custom_optimizers(monkeypatch):
    """This module's optimizers by class path, without jsonargparse's import (a test process may have enforced the
    recipes' allowlist; a run names such a class with ``--trust-recipe``)."""
    classes = {f"{__name__}.{c.__name__}": c for c in (SignMomentum, NonzeroSGD)}
    factory = OptimizerSpec.factory
    monkeypatch.setattr(
        OptimizerSpec,
        "factory",
        lambda self: (
            functools.partial(classes[self.class_path], **self.init_args)
            if self.class_path in classes
            else factory(self)
        ),
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
    same step on real tensors, tracked (`lit_memory.planning.prediction.simulate.measure`), on the bundled MiniLM; and
    the simulation on fake tensors runs it (Adagrad's step reads its counter, made before the fake mode, as a
    number)."""
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
