"""Selective checkpointing, activation offloading and the compile switch: same gradients, less kept."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from lit_memory.errors import UserError
from lit_memory.hf.anatomy import parameter_units
from lit_memory.memory.measure.tracker import Tracker
from lit_memory.model import SequenceClassifier, transformer_layers
from lit_memory.run.activation_checkpointing import (
    CheckpointPlan,
    OffloadActivations,
    enable_gradient_checkpointing,
    selective_policy,
)

# Dropout stays on (BERT's 0.1): recomputed dropout must draw the masks the forward pass drew.
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
aten = torch.ops.aten
pytestmark = pytest.mark.filterwarnings(r"ignore:You are trying to `self.log\(\)`")


def tiny(**kwargs) -> SequenceClassifier:
    torch.manual_seed(0)  # the same initial weights for every setting
    kwargs.setdefault("config_overrides", TINY)
    module = SequenceClassifier(model_name_or_path="bundled:bert-large", pretrained=False, **kwargs)
    module.configure_model()
    return module


def batch(n: int = 8, length: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(1000, 2000, (n, length), generator=g),
        "attention_mask": torch.ones(n, length, dtype=torch.long),
        "labels": torch.tensor([0, 1] * (n // 2)),
    }


def gradients(module: SequenceClassifier, seed: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # the dropout masks
    module.training_step(batch(), 0).backward()
    return {name: p.grad for name, p in module.model.named_parameters()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return gradients(tiny())


def test_dropout_is_on_so_the_gradients_depend_on_its_masks(reference):
    other_masks = gradients(tiny(), seed=6)
    assert not torch.allclose(other_masks["classifier.weight"], reference["classifier.weight"])


@pytest.mark.parametrize("checkpointing", [True, "full", "selective"])
def test_checkpointing_gives_the_gradients_of_no_checkpointing(reference, checkpointing):
    module = tiny(gradient_checkpointing=checkpointing)
    assert all(layer.gradient_checkpointing for layer in transformer_layers(module.model))
    assert_same(gradients(module), reference)


PLANS = [{"full": 1}, {"selective": 2}, {"full": 1, "selective": 1}, {"full": 2, "selective": 1}]


def test_a_per_layer_plan_switches_each_layer_input_side_first():
    module = tiny(gradient_checkpointing={"full": 1, "selective": 1}, config_overrides={**TINY, "num_hidden_layers": 3})
    layers = transformer_layers(module.model)
    assert [layer.gradient_checkpointing for layer in layers] == [True, True, False]
    contexts = [layer._gradient_checkpointing_func.keywords.get("context_fn") for layer in layers[:2]]
    assert contexts[0] is None and contexts[1] is not None  # full, then selective (torch's SAC contexts)
    assert CheckpointPlan.parse({"full": 1, "selective": 1}).modes(3) == ["full", "selective", None]


def test_the_setting_is_parsed_once_and_the_model_is_built_from_the_plan(monkeypatch):
    module = SequenceClassifier(
        model_name_or_path="bundled:bert-large", pretrained=False, gradient_checkpointing={"full": 1},
        config_overrides={**TINY, "num_hidden_layers": 3},
    )
    assert module.checkpoint_plan == CheckpointPlan(full=1)
    monkeypatch.setattr(CheckpointPlan, "parse", None)  # building parses nothing again
    module.checkpoint_plan = CheckpointPlan(selective=2)  # what the model is built with (tools/peer.py: None)
    module.configure_model()
    layers = transformer_layers(module.model)
    assert [layer.gradient_checkpointing for layer in layers] == [True, True, False]
    assert all(layer._gradient_checkpointing_func.keywords.get("context_fn") is not None for layer in layers[:2])


def test_a_plan_is_switched_on_in_a_plain_hugging_face_model():
    model = tiny().model
    enable_gradient_checkpointing(model, CheckpointPlan(full=1))
    assert [layer.gradient_checkpointing for layer in transformer_layers(model)] == [True, False]
    assert model.config.use_cache is False


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_every_per_layer_plan_trains_exactly_as_no_checkpointing_for_ten_steps(plan):
    """fp32, dropout on: ten AdamW steps, each with its own masks, give the weights of the unchecked model."""
    overrides = {**TINY, "num_hidden_layers": 3}

    def trained(**kwargs) -> dict[str, torch.Tensor]:
        module = tiny(config_overrides=overrides, **kwargs)
        optimizer = torch.optim.AdamW(module.model.parameters(), lr=1e-3)
        for step in range(10):
            torch.manual_seed(100 + step)  # the same dropout masks for both models, new ones every step
            module.training_step(batch(), step).backward()
            optimizer.step()
            optimizer.zero_grad()
        return {name: p.detach().clone() for name, p in module.model.named_parameters()}

    want, got = trained(), trained(gradient_checkpointing=plan)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(want[name], tiny(config_overrides=overrides).model.state_dict()[name]) for name in want)


def test_bad_plans_are_one_line():
    with pytest.raises(
        UserError, match=r"^model.gradient_checkpointing counts 2 full \+ 1 selective layers, but the model has 2"
    ):
        tiny(gradient_checkpointing={"full": 2, "selective": 1})
    with pytest.raises(UserError, match=r"^model.gradient_checkpointing.full must be a layer count >= 0, got -1"):
        tiny(gradient_checkpointing={"full": -1})
    with pytest.raises(UserError, match=r"^model.offload_activations needs every layer checkpointed"):
        tiny(gradient_checkpointing={"full": 1}, offload_activations=True)
    with pytest.raises(UserError, match=r"^model.gradient_checkpointing: auto is chosen for a device budget"):
        tiny(gradient_checkpointing="auto")


def kept_after_forward(**kwargs) -> int:
    """Activation bytes alive when the forward pass ends (what backward will use), tracked on CPU."""
    module = tiny(**kwargs)
    tracker = Tracker("cpu")
    tracker.track_external(module)
    with tracker:
        tracker.enter_phase("forward")
        loss = module.training_step(batch(32, 64), 0)
        kept = tracker.categories()["activations"]
    loss.backward()
    return kept


def test_selective_keeps_less_than_no_checkpointing_and_more_than_full():
    none, selective, full = (kept_after_forward(gradient_checkpointing=c) for c in (False, "selective", True))
    assert full < selective < none
    # It keeps the linear layers' outputs: Q, K, V, attention output, FFN in and out (5h + f values
    # per token and layer, fp32); math attention (CPU with attention dropout) is recomputed.
    tokens, h, f = 32 * 64, TINY["hidden_size"], TINY["intermediate_size"]
    assert selective - full == pytest.approx(TINY["num_hidden_layers"] * tokens * (5 * h + f) * 4, rel=0.02)


class Op:
    """Stands in for an OpOverload in the policy: its tags and argument names."""

    def __init__(self, op) -> None:
        self.tags, self._schema = op.tags, op._schema


def test_the_policy_keeps_matmuls_and_recomputes_cheap_ops_and_random_attention():
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert selective_policy(None, aten.addmm.default) is save
    assert selective_policy(None, aten.mm.default) is save
    for cheap in (aten.gelu.default, aten.native_layer_norm.default, aten.add.Tensor, aten.native_dropout.default):
        assert selective_policy(None, cheap) is recompute
    # A fused attention kernel is kept without dropout; with dropout it draws random numbers, and a
    # cached op would leave the generator behind for every later dropout in the recomputation.
    efficient = aten._scaled_dot_product_efficient_attention.default
    q = torch.empty(0)
    assert selective_policy(None, efficient, q, q, q, None, True, 0.0) is save
    assert selective_policy(None, efficient, q, q, q, None, True, 0.1) is recompute
    assert selective_policy(None, efficient, q, q, q, None, True, dropout_p=0.1) is recompute
    flash = aten._scaled_dot_product_flash_attention.default
    assert selective_policy(None, flash, q, q, q) is save  # dropout_p defaults to 0


@pytest.mark.parametrize("checkpointing", [True, "selective"])
def test_offloading_gives_the_same_gradients_and_its_hooks_see_the_layer_inputs(reference, checkpointing):
    module = tiny(gradient_checkpointing=checkpointing, offload_activations=True)
    assert_same(gradients(module), reference)
    seen, moved = module.activation_offload.seen, module.activation_offload.moved
    layer_input = 8 * 16 * TINY["hidden_size"] * 4
    assert seen[0] > TINY["num_hidden_layers"] and seen[1] >= TINY["num_hidden_layers"] * layer_input
    assert moved == [0, 0]  # on CPU the tensors are already in host memory: nothing is copied


def test_offloading_moves_saved_tensors_off_the_device_and_brings_them_back():
    # The CPU stands in for the device and `meta` for host memory (no data, so under fake tensors).
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(64, 64, requires_grad=True)
        offload = OffloadActivations(host="meta")
        with offload:
            y = (x.sin() * x).sum()  # saves x twice (sin's input, mul's input) and sin(x)
        y.backward()
    assert offload.moved == offload.seen and offload.moved[0] == 3
    assert x.grad.device.type == "cpu" and x.grad.shape == x.shape


def test_bad_settings_are_one_line():
    with pytest.raises(
        UserError,
        match=r"^gradient_checkpointing='partial' is not one of: false, true \(= full\), full, selective, auto",
    ):
        SequenceClassifier(gradient_checkpointing="partial")
    with pytest.raises(UserError, match=r"^model.offload_activations needs model.gradient_checkpointing"):
        SequenceClassifier(offload_activations=True)
    with pytest.raises(UserError, match=r"^model.offload_activations does not work with model.compile"):
        SequenceClassifier(gradient_checkpointing=True, offload_activations=True, compile=True)


@pytest.mark.skipif(shutil.which("c++") is None, reason="torch.compile (inductor) on CPU needs a C++ compiler")
def test_compiled_layers_keep_the_fused_step_and_its_gradients():
    """One compilation of a tiny layer: about 20 s on a 2-core CPU."""
    from lit_memory.fused import OptimizerInBackward

    no_dropout = {**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # compiled RNG differs

    def trained(compile: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        module = SequenceClassifier(
            model_name_or_path="bundled:bert-large", pretrained=False, config_overrides=no_dropout,
            gradient_checkpointing="selective", compile=compile,
        )
        module.configure_model()
        optimizer = torch.optim.AdamW(module.model.parameters(), lr=1e-3)
        OptimizerInBackward(optimizer, parameter_units(module.model))
        for _ in range(2):
            module.training_step(batch(), 0).backward()
        assert all(p.grad is None for p in module.model.parameters())  # every parameter stepped and freed
        return {name: p.detach().clone() for name, p in module.model.named_parameters()}

    eager, compiled = trained(False), trained(True)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=0, atol=1e-5, msg=name)


def test_the_4gb_recipe_trains_with_selective_checkpointing_and_offloading_from_the_command_line(fast_args):
    from conftest import RECIPES

    from lit_memory.cli import LitMemoryCLI

    switches = ["--model.gradient_checkpointing=selective", "--model.offload_activations=true"]
    cli = LitMemoryCLI(args=["fit", "--config", str(RECIPES / "4gb.yaml"), *switches, *fast_args])
    assert cli.trainer.global_step == 2
    assert cli.model.hparams.gradient_checkpointing == "selective" and cli.model.activation_offload.seen[0] > 0


def test_the_step_time_example_times_every_variant(monkeypatch, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "step_ab.py"
    spec = importlib.util.spec_from_file_location("step_ab", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    variants = [{}, {"gradient_checkpointing": "selective"}]
    argv = ["step_ab.py", "--config_overrides", json.dumps(TINY), "--batch", "4", "--length", "8", "--warmup", "0",
            "--steps", "2", "--variants", json.dumps(variants)]
    monkeypatch.setattr("sys.argv", argv)
    example.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.rsplit(": first step", 1)[0] for line in lines] == [json.dumps(v) for v in variants]
    assert lines[0].endswith("(1.00x)")
