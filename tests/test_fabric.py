"""Fabric with the fused step (`lit_memory.fabric`): the strategies and `fsdp_overlap_step_with_backward`,
on one device in this process, and on 2 CPU processes (FSDP2, FSDP1) in one launch of tests/fabric_worker.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import REPO, StepLog, assert_same
from fused_worker import FP16_SCALER, RecordingScaler
from torch import nn

from lit_memory import FusedFabricStrategy, fsdp_overlap_step_with_backward, fused
from lit_memory.errors import UserError
from lit_memory.fabric import FABRIC_CLIPPING, FSDP1_FLAT, FSDP1_NORM, FSDP1_SCALER, SHARED, STALE_OPTIMIZER, UNOWNED
from lit_memory.run import environment

pytestmark = pytest.mark.usefixtures("one_thread", "seed_variables")  # conftest: one thread for these small models


@pytest.fixture
def seed_variables(monkeypatch):
    """The examples seed as a user's script does (``Fabric.seed_everything``), which sets ``PL_GLOBAL_SEED`` and
    ``PL_SEED_WORKERS`` for the process: as they were after each test (set and removed here, so that monkeypatch
    records what to put back)."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(script: Path, *args: str) -> None:
    """A script in new processes: Lightning's launcher re-executes ``sys.argv`` for the other rank."""
    result = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600,
        env={**environment.for_new_job(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-4000:]


# -- the strategies on one device --------------------------------------------------------------


def test_fabric_example_matches_unfused_with_lr_schedule():
    fabric_fused = example("fabric_fused")
    models, steps = {}, {}
    for fusion in (False, True):
        with StepLog() as log:
            models[fusion] = fabric_fused.train(fused=fusion, steps=10)[0].module  # unwrapped from Fabric's
        steps[fusion] = log.by_name(models[fusion])
    assert_same(dict(models[False].named_parameters()), dict(models[True].named_parameters()))
    assert steps[True] == steps[False]
    assert len({lr for lr, _ in steps[True]["classifier.weight"]}) > 5  # the schedule moved the lr
    assert all(p.grad is None for p in models[True].parameters())


@pytest.mark.parametrize("clipping", [{"max_norm": 0.3}, {"clip_val": 0.01}])
def test_fused_fabric_strategy_clips_as_fabric_clip_gradients(clipping):
    """FusedFabricStrategy(max_norm / clip_val) against fabric.clip_gradients after an unfused backward."""
    fabric_fused = example("fabric_fused")
    plain, plain_norms = fabric_fused.train(fused=False, steps=6, **clipping)
    fusion, fused_norms = fabric_fused.train(fused=True, steps=6, **clipping)
    assert_same(dict(plain.module.named_parameters()), dict(fusion.module.named_parameters()), atol=1e-5)
    if "max_norm" in clipping:
        assert len(plain_norms) == 6 and min(plain_norms) > clipping["max_norm"]  # clipped at every step
        torch.testing.assert_close(fused_norms, plain_norms, rtol=1e-5, atol=0)


@pytest.mark.parametrize("clipping", [{"clip_val": 0.01}, {}], ids=["value", "none"])
def test_fused_fabric_strategy_with_fp16_skips_and_scales_as_gradscaler(clipping):
    """Fabric's 16-mixed (a plugin with torch's GradScaler; Fabric makes a CPU's 16-mixed bf16), overflows
    forced: the measuring backward unscales and checks, an overflow skips the step; otherwise the fused
    backward unscales, clips and steps. Same weights, same scales after every step. (By norm, Fabric's own
    clip_gradients refuses an overflowed step's non-finite norm; the Trainer's test covers it.)"""
    fabric_fused = example("fabric_fused")
    runs = {}
    for fusion in (False, True):
        scaler = RecordingScaler("cpu", **FP16_SCALER)
        model, norms = fabric_fused.train(fused=fusion, steps=8, scaler=scaler, **clipping)
        runs[fusion] = (dict(model.module.named_parameters()), norms, scaler.scales)
    (plain, _, plain_scales), (fusion, _, fused_scales) = runs[False], runs[True]
    assert fused_scales == plain_scales and len(plain_scales) == 8
    assert min(plain_scales) < FP16_SCALER["init_scale"] and max(b > a for a, b in zip(plain_scales, plain_scales[1:]))
    assert_same(plain, fusion, atol=1e-6)


FABRIC_ERRORS = {
    "two-optimizers": (
        {},
        lambda fabric, net, opt: fabric.setup(net, opt, torch.optim.SGD(net.parameters())),
        fused.SEVERAL,
    ),
    "clipping": ({}, lambda fabric, net, opt: fabric.clip_gradients(*fabric.setup(net, opt), 1.0), FABRIC_CLIPPING),
}


@pytest.mark.parametrize("case", FABRIC_ERRORS)
def test_fabric_refuses_what_fusion_cannot_do(case):
    settings, action, message = FABRIC_ERRORS[case]
    fabric = L.Fabric(accelerator="cpu", strategy=FusedFabricStrategy(), **settings)
    net = torch.nn.Linear(2, 2)
    with pytest.raises(UserError) as error:
        action(fabric, net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert str(error.value) == message and "\n" not in message


# -- fsdp_overlap_step_with_backward on one device ----------------------------------------------


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def by_layer(model: nn.Module) -> list[torch.optim.Optimizer]:
    """An optimizer per linear layer (weight and bias): each is stepped once both gradients are there."""
    return [torch.optim.AdamW(layer.parameters(), lr=1e-2) for layer in model if isinstance(layer, nn.Linear)]


def overlap_run(fused: bool, clipping: dict, steps: int = 5) -> tuple[nn.Module, list[float], list[int]]:
    """The plain loop clips all parameters' gradients with torch.nn.utils, as the fused one must. Returns
    the model, per step the gradient norm (by norm) or the largest gradient value (plain), and the
    gradients held after backward."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(0)
    model = fabric.setup_module(net())
    optimizers = by_layer(model.module)
    x, y = torch.randn(16, 8) * 10, torch.randint(0, 2, (16,))
    norms, held = [], []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        if fused:
            with fsdp_overlap_step_with_backward(optimizers, model, **clipping) as overlap:
                fabric.backward(loss)
            norm = overlap.total_norm
        else:
            fabric.backward(loss)
            norm = torch.stack([p.grad.abs().max() for p in model.parameters()]).max()
            if "max_norm" in clipping:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clipping["max_norm"])
            elif "clip_val" in clipping:
                torch.nn.utils.clip_grad_value_(model.parameters(), clipping["clip_val"])
        held.append(sum(p.grad is not None for p in model.parameters()))
        if norm is not None:
            norms.append(norm.item())
        if not fused:
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    return model, norms, held


@pytest.mark.parametrize("clipping", [{}, {"max_norm": 0.5}, {"clip_val": 0.01}])
def test_overlap_steps_optimizers_over_several_parameters_as_the_plain_loop(clipping):
    """Optimizers over a layer's weight and bias each: stepped when both gradients are there, freed at
    once. Clipped by norm through fabric.backward (a measuring backward first), or by value."""
    plain, plain_norms, plain_held = overlap_run(False, clipping)
    fusion, fused_norms, fused_held = overlap_run(True, clipping)
    assert_same(dict(plain.named_parameters()), dict(fusion.named_parameters()), atol=1e-6)
    assert fused_held == [0] * 5 and min(plain_held) == 6
    if "max_norm" in clipping:
        assert min(plain_norms) > clipping["max_norm"]  # clipped at every step
        torch.testing.assert_close(fused_norms, plain_norms, rtol=1e-5, atol=0)
    if "clip_val" in clipping:
        assert min(plain_norms) > clipping["clip_val"]  # the largest gradient value: clipped at every step


def test_overlap_with_fp16_skips_each_optimizer_as_gradscaler():
    """Fabric's 16-mixed around fsdp_overlap_step_with_backward with an optimizer per layer: GradScaler decides
    each optimizer's step on its own gradients, so an inf in one layer's gradient (step 2) skips that layer's
    optimizer alone while the others step, and backs the scale off. The block does the same inside backward:
    the checking backward flags each optimizer, the stepping one drops the skipped one's gradients."""
    from lightning.fabric.plugins import MixedPrecision

    def run_(fused: bool) -> tuple[dict, list[float], list]:
        scaler = RecordingScaler("cpu", init_scale=2.0**8, growth_interval=2)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
        fabric.seed_everything(0)
        model = fabric.setup_module(net())
        optimizers = by_layer(model.module)
        at = {"step": -1}

        def poison(param):  # registered before the block's hooks: they see it
            if at["step"] == 2:
                param.grad.view(-1)[0] = float("inf")

        model.module[3].weight.register_post_accumulate_grad_hook(poison)
        x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
        moved = []
        for step in range(5):
            at["step"] = step
            before = [p.detach().clone() for p in model.parameters()]
            loss = nn.functional.cross_entropy(model(x), y)
            if fused:
                with fsdp_overlap_step_with_backward(optimizers, model):
                    fabric.backward(loss)
            else:
                fabric.backward(loss)
                for optimizer in optimizers:
                    scaler.unscale_(optimizer)
                    scaler.step(optimizer)
                scaler.update()
                for optimizer in optimizers:
                    optimizer.zero_grad()
            moved.append([not torch.equal(a, b) for a, b in zip(before, model.parameters())])
        return dict(model.named_parameters()), scaler.scales, moved

    (plain, plain_scales, plain_moved), (fusion, fused_scales, fused_moved) = run_(False), run_(True)
    assert fused_scales == plain_scales and plain_scales[2] < plain_scales[1]  # backed off at step 2
    assert fused_moved == plain_moved
    assert plain_moved[2] == [True, True, False, False, True, True]  # the poisoned layer's optimizer alone skipped
    assert_same(plain, fusion, atol=1e-6)


def test_overlap_refuses_what_it_cannot_honour():
    """A trainable parameter no optimizer holds, one held by two, a plain loss.backward() where clipping by
    norm needs the measuring backward: one line each (the last as backward starts, before any step)."""
    model = net()
    *held, last = model.parameters()
    with pytest.raises(UserError) as error:
        fsdp_overlap_step_with_backward([torch.optim.SGD(held, lr=0.1)], model).__enter__()
    assert str(error.value) == UNOWNED.format(name="5.bias")
    both = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD([last], lr=0.1)]
    with pytest.raises(UserError) as error:
        fsdp_overlap_step_with_backward(both, model).__enter__()
    assert str(error.value) == SHARED.format(name="5.bias")
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randn(4, 8)).sum()
    with pytest.raises(UserError) as error:
        with fsdp_overlap_step_with_backward([torch.optim.SGD(model.parameters(), lr=0.1)], model, max_norm=1.0):
            loss.backward()
    assert str(error.value) == fused.UNMEASURED
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing stepped
    for message in (
        UNOWNED,
        SHARED,
        fused.UNMEASURED,
        FSDP1_NORM,
        FSDP1_FLAT,
        FSDP1_SCALER,
        fused.UNCHECKED,
        fused.UNSCALED,
    ):
        assert "\n" not in message


# -- 2 processes ---------------------------------------------------------------------------------


def test_the_seeds_snippet_on_fsdp2_matches_one_unfused_process(tmp_path):
    """examples/fsdp_overlap.py: the seed's loop with only its import changed, FSDP2 (the user's
    parallelize_fn) on 2 processes, against the plain loop in one process on the same global batches."""
    run(REPO / "examples" / "fsdp_overlap.py", "--devices", "2", "--out", str(tmp_path / "fsdp.pt"))
    sharded = torch.load(tmp_path / "fsdp.pt")
    weights, held = example("fsdp_overlap").train(devices=1, fused=False)
    assert sharded["held"] == [0] * 6 and min(held) > 0
    assert_same(weights, sharded["weights"], atol=1e-5)
    start = example("fsdp_overlap").train(devices=1, steps=0)[0]
    assert not torch.equal(start["classifier.weight"], weights["classifier.weight"])  # it trained


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fabric")
    run(REPO / "tests" / "fabric_worker.py", str(out))
    return torch.load(out / "results.pt", weights_only=False)


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fused_fabric_fsdp_strategy_matches_unfused_fsdp2(two_processes, clip):
    """FusedFabricFSDPStrategy against ModelParallelStrategy with the same sharding, unfused, clipping with
    fabric.clip_gradients: by norm (active at every step, the norm all-reduced over the ranks) and by value."""
    plain, fusion = two_processes[f"fsdp2-{clip}"], two_processes[f"fsdp2-{clip}-fused"]
    assert_same(plain["weights"], fusion["weights"], atol=1e-5)
    assert fusion["held"] == [0] * 6 and min(plain["held"]) > 0
    if clip == "norm":
        assert min(plain["norms"]) > 0.25
        torch.testing.assert_close(fusion["norms"], plain["norms"], rtol=1e-5, atol=0)
    else:
        assert min(plain["largest"]) > 0.01


def test_fused_fabric_fsdp_strategy_with_fp16_skips_on_every_rank(two_processes):
    """16-mixed (a plugin with torch's GradScaler), overflows forced (a first scale too large, and once an
    inf in one rank's shard only), clipped by value: the fused step all-reduces the overflow flag (both ranks
    skip the same steps), GradScaler's unscale of the sharded gradients reduces it (DTensor): the same
    weights and the same scale after every step."""
    plain, fusion = two_processes["fsdp2-fp16"], two_processes["fsdp2-fp16-fused"]
    assert fusion["scales"] == plain["scales"] and len(plain["scales"]) == 6
    assert min(plain["scales"]) < FP16_SCALER["init_scale"]  # steps skipped
    # an inf in rank 1's shard alone at step 3 skipped it on both ranks (rank 0 alone would have stepped)
    assert plain["scales"][3] < plain["scales"][2]
    assert_same(plain["weights"], fusion["weights"], atol=1e-6)
    assert fusion["held"] == [0] * 6


def test_fused_fabric_fsdp_strategy_refuses_an_optimizer_made_before_sharding(two_processes):
    assert two_processes["stale optimizer"] == STALE_OPTIMIZER  # fabric.setup(model, optimizer): it would train nothing


def test_fused_fabric_fsdp_strategy_resumes_from_fabrics_checkpoint(two_processes):
    """fabric.save at step 3, a new Fabric, model and optimizer, fabric.load, 3 more steps: the uninterrupted
    run's weights. The optimizer state existed before torch's loader looked (it would have created it with a
    gradient for every parameter at once): made one bucket at a time by the strategy."""
    resumed = two_processes["fsdp2-norm-fused-resumed"]
    assert resumed["resumed_at"] == 3
    assert_same(two_processes["fsdp2-norm-fused"]["weights"], resumed["weights"], atol=0)
    assert resumed["torch_created_state"] and not any(resumed["torch_created_state"])


def test_fused_fabric_fsdp_strategy_resumes_bitsandbytes_8bit_state_exactly(two_processes):
    """bitsandbytes' AdamW8bit steps each rank's local shard; fabric.save keeps that state sharded (as DTensors) and
    fabric.load restores it, so the resumed run's weights are the uninterrupted run's, bit for bit."""
    resumed = two_processes["fsdp2-norm-fused-8bit-resumed"]
    assert resumed["resumed_at"] == 3
    uninterrupted = two_processes["fsdp2-norm-fused-8bit"]["weights"]
    assert_same(uninterrupted, resumed["weights"], atol=0)
    assert not all(
        torch.equal(uninterrupted[k], two_processes["fsdp2-norm-fused"]["weights"][k]) for k in uninterrupted
    )


def test_overlap_under_fsdp1(two_processes):
    """Lightning's FSDPStrategy (FSDP1, use_orig_params): per-parameter optimizers over each rank's flat
    slices stepped inside backward, clipped by value, equal the plain loop; no gradient, flat or original,
    is left after backward. Clipping by norm, fp16 loss scaling and flat parameters are refused in one line each."""
    result = two_processes["fsdp1"]
    assert result["trained"] and result["difference"] <= 1e-6
    assert result["held"] == [0] * 6 and result["flat_gradients_held"] == [0] * 6 and min(result["plain_held"]) > 0
    assert result["refusals"] == {"norm": FSDP1_NORM, "scaler": FSDP1_SCALER, "flat": FSDP1_FLAT}
    # Each step ran on the compute stream (one allocator pool: `lit_memory.fused.DeviceStreams`) after waiting for
    # FSDP1's post-backward stream, where it hands the gradient over.
    assert result["steps"] and all(not on_post and waited == [True] for on_post, waited in result["steps"])
