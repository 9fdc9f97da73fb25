"""FLOPs counted per step (lit_memory.planning.recompute) and the per-layer checkpointing plan ``auto`` picks."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from conftest import CONFIGS

from lit_memory.cli import resolve
from lit_memory.errors import UserError
from lit_memory.memory.hardware.gpus import Target
from lit_memory.memory.margin import Limit, usable
from lit_memory.planning.prediction.analytic import analytic, device_total
from lit_memory.planning.prediction.simulate import simulate
from lit_memory.planning.prediction.step import OptimizerSpec, Step
from lit_memory.planning.recompute import flops, layer_costs, resolve_auto
from lit_memory.planning.recompute import resolve as plan_for
from lit_memory.run.activation_checkpointing import CheckpointPlan

L, H, F, HEADS = 4, 64, 256, 4
TINY = {
    "num_hidden_layers": L,
    "hidden_size": H,
    "num_attention_heads": HEADS,
    "intermediate_size": F,
    "vocab_size": 512,
}
BATCH, LENGTH = 32, 128


def tiny(device: str = "cpu", **model) -> Step:
    return Step(
        model={"model_name_or_path": "bundled:bert-large", "config_overrides": TINY, **model},
        optimizer=OptimizerSpec.of({"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-4}}),
        batch_size=BATCH, max_length=LENGTH, fused=True, target=Target(type=device),
    )


def test_the_count_is_a_bert_layers_matmuls_and_attention():
    """Forward FLOPs of a BERT step, written out: per token and layer four h x h projections and two h x f
    ones, attention's two products over the sequence; the pooler and classifier once per sample."""
    tokens = BATCH * LENGTH
    per_layer = 2 * tokens * (4 * H * H + 2 * H * F) + 2 * 2 * BATCH * LENGTH * LENGTH * H
    head = 2 * BATCH * (H * H + H * 2)
    counted = flops(tiny())
    assert counted.forward == L * per_layer + head
    assert counted.backward == pytest.approx(2 * counted.forward, rel=0.02)  # input and weight gradients
    assert counted.recompute == 0 and counted.per_sample == counted.total / BATCH


def test_full_checkpointing_recomputes_every_layers_forward_and_selective_only_attention():
    none, full, selective = (flops(tiny(gradient_checkpointing=g)) for g in (False, True, "selective"))
    layers_forward = none.forward - 2 * BATCH * (H * H + H * 2)  # all but the pooler and classifier
    assert full.recompute == layers_forward and full.forward == none.forward
    attention = L * 2 * 2 * BATCH * LENGTH * LENGTH * H  # dropout on: the policy recomputes it (see checkpointing.py)
    assert selective.recompute == attention
    assert 0 < selective.recompute_share < full.recompute_share < 0.3


@pytest.mark.parametrize("plan", [{"full": 1}, {"full": 2, "selective": 1}, {"selective": 3}], ids=str)
def test_a_mixed_plan_counts_what_its_layers_cost_alone(plan):
    costs = layer_costs(tiny())
    counted = flops(tiny(gradient_checkpointing=plan))
    assert counted.total == pytest.approx(costs.of(CheckpointPlan.parse(plan)), rel=1e-9)


@pytest.mark.parametrize("plan", [{"full": 2}, {"full": 1, "selective": 2}], ids=str)
def test_a_mixed_plans_memory_agrees_with_the_simulation(plan):
    setup = tiny(gradient_checkpointing=plan)
    predicted, simulated = analytic(setup), simulate(setup)
    assert predicted.footprint.peak == pytest.approx(simulated.footprint.peak, rel=0.05)
    for phase in ("forward", "backward"):
        want = sum(simulated.footprint.phases[phase].values())
        assert sum(predicted.footprint.phases[phase].values()) == pytest.approx(want, rel=0.10), phase


def test_plans_order_memory_between_none_and_full():
    plans = (False, {"selective": 2}, {"full": 2}, "selective", True)
    values = [analytic(tiny("cuda", gradient_checkpointing=g)).footprint.peak for g in plans]
    assert values[0] > values[1] > values[3] > values[4] and values[0] > values[2] > values[4], values


def brute_force(step: Step, budget: int) -> tuple[float, Step]:
    costs = layer_costs(step)
    fitting = []
    for full, selective in itertools.product(range(L + 1), repeat=2):
        if full + selective > L:
            continue
        plan = CheckpointPlan(full=full, selective=selective)
        candidate = tiny("cuda", gradient_checkpointing=plan.value() if plan.recomputes else False)
        if device_total(candidate) <= budget:
            fitting.append((costs.of(plan if plan.recomputes else None), plan))
    return min(fitting, key=lambda f: f[0])


@pytest.mark.parametrize("fraction", [0.15, 0.5, 0.85, 1.0])
def test_auto_is_the_plan_with_the_fewest_flops_that_fits(fraction):
    """Without a margin, the plan of fewest FLOPs within the budget itself; with one, within what it leaves."""
    none = device_total(tiny("cuda"))
    full = device_total(tiny("cuda", gradient_checkpointing=True))
    budget = int(full + fraction * (none - full))
    bare = replace(tiny("cuda"), margin=0.0)
    found = plan_for(bare, Limit(budget, margin=0.0))
    assert found.total <= budget
    best, _ = brute_force(bare, budget)
    assert found.flops == pytest.approx(best, rel=1e-12)
    if fraction == 1.0:
        assert found.plan is None  # no checkpointing fits: nothing recomputed
    kept = replace(tiny("cuda"), margin=0.05)
    room = usable(int(budget / 0.95), 0.05)  # a budget whose 5 % margin leaves the same room
    found = plan_for(kept, Limit(int(budget / 0.95), "a card", 0.05))
    assert found.total <= room and found.flops == pytest.approx(brute_force(kept, room)[0], rel=1e-12)
    assert found.fit.fits and found.fit.spare >= 0.05
    assert f"fits a card with {math.floor(100 * found.fit.spare)} % to spare" in found.line()


def test_auto_keeps_the_margin_and_says_in_one_line_when_nothing_fits():
    full = device_total(tiny("cuda", gradient_checkpointing=True))
    with pytest.raises(
        UserError, match=r"^gradient_checkpointing auto: no plan fits .*every layer recomputed is predicted"
    ):
        plan_for(tiny("cuda"), Limit(full - 2**20))
    # every layer recomputed fits the budget itself, but not with the default 8 % of it kept free
    with pytest.raises(UserError, match=r"no plan fits rtx3050-4gb with the 8 % margin"):
        plan_for(tiny("cuda"), Limit(int(full / 0.95), "rtx3050-4gb"))


def test_the_command_line_resolves_auto_for_the_runs_budget_and_says_so(capsys):
    args = ["fit", "--model.model_name_or_path=bundled:bert-large", f"--model.config_overrides={TINY}",
            "--model.pretrained=false", "--model.gradient_checkpointing=auto", f"--data.batch_size={BATCH}",
            f"--data.max_length={LENGTH}", "--trainer.accelerator=cpu"]
    with pytest.raises(
        UserError, match=r"^model.gradient_checkpointing auto needs a device budget: pass --memory.budget"
    ):
        resolve(args).build(trainer=False)
    none = analytic(tiny()).footprint.peak
    cli = resolve([*args, f"--memory.tier={int(none * 0.8)}"]).build(trainer=False)
    plan = CheckpointPlan.parse(cli.model.hparams.gradient_checkpointing)
    assert plan is not None and plan.recomputes
    assert "gradient_checkpointing auto: checkpointing" in capsys.readouterr().err


def test_on_cuda_auto_plans_for_the_smaller_of_the_tier_and_what_the_card_has_free(capsys):
    """The run's own card (a fake reading: the seam `LitMemoryCLI.read_card`): with less free than the tier,
    the plan fits the free memory (its context included) with the margin kept, and one line says the card's
    limit applied; with more free, the tier applies."""
    from lit_memory.memory.hardware.gpus import CardReading

    args = ["fit", "--model.model_name_or_path=bundled:bert-large", f"--model.config_overrides={TINY}",
            "--model.pretrained=false", "--model.gradient_checkpointing=auto", f"--data.batch_size={BATCH}",
            f"--data.max_length={LENGTH}", "--trainer.accelerator=cuda", "--memory.tier=t4"]
    none, full = device_total(tiny("cuda")), device_total(tiny("cuda", gradient_checkpointing=True))
    context = 300 * 2**20
    available = int((full + (none - full) // 2) / 0.92)  # between every layer recomputed and none, margin kept
    card = CardReading("Tesla T4", 15102 * 2**20, available - context, context, "nvml (this process)", (7, 5))
    cli = resolve(args)
    cli.read_card = lambda: card
    cli.build(trainer=False)
    err = capsys.readouterr().err
    assert "memory: auto plans for what the card has free, less than memory.tier t4 (14.75 GiB)" in err
    assert "300.00 MiB (nvml (this process))" in err
    plan = CheckpointPlan.parse(cli.model.hparams.gradient_checkpointing)
    assert plan is not None and plan.recomputes
    planned = tiny("cuda", gradient_checkpointing=plan.value())
    assert device_total(replace(planned, target=replace(planned.target, gpu=card.gpu))) <= usable(available, 0.08)
    assert "with 8 % to spare" in err or "with 9 % to spare" in err

    roomy = replace(card, free=14 * 2**30)
    cli = resolve([*args, "--memory.tier=2GiB"])
    cli.read_card = lambda: roomy
    cli.build(trainer=False)
    err = capsys.readouterr().err
    assert "memory: auto plans for memory.tier 2.00 GiB: Tesla T4 has 14.29 GiB for this run at start" in err
    assert not cli.model.hparams.gradient_checkpointing  # 2 GiB: nothing to recompute for this tiny model


def test_a_small_tiers_distributed_cuda_run_plans_with_nccls_small_buffers_it_sets(capsys, monkeypatch):
    """FSDP2 on 2 GPUs within a 4 GB tier: the run sets NCCL's buffers small before anything starts (its processes
    inherit them) and says so in one line; its plan is made with them (NCCL's communicators in the device total);
    at the end the environment is as it was."""
    import os

    from lit_memory.memory.hardware import nccl
    from lit_memory.memory.hardware.gpus import CardReading

    for name in nccl.NUMBERS | nccl.FLAGS:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def card() -> CardReading:  # read by the plan: the variables in force then
        seen.update({name: os.environ.get(name) for name in nccl.SMALL})
        return CardReading(
            "NVIDIA GeForce RTX 3050 Laptop GPU", 3902 * 2**20, 3500 * 2**20, 300 * 2**20, "nvml", (8, 6)
        )

    cli = resolve(
        [
            "fit",
            "--config",
            str(CONFIGS / "fsdp.yaml"),
            "--model.model_name_or_path=bundled:bert-large",
            f"--model.config_overrides={TINY}",
            "--model.pretrained=false",
            "--model.gradient_checkpointing=auto",
            f"--data.batch_size={BATCH}",
            f"--data.max_length={LENGTH}",
            "--trainer.accelerator=cuda",
            "--trainer.devices=2",
            "--memory.tier=rtx3050-4gb",
        ]
    )  # the model and shape of the test above
    cli.read_card = card
    cli.build(trainer=False)
    assert seen == nccl.SMALL
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nccl: ")]
    assert lines == [nccl.for_run(Limit(3902 * 2**20, "memory.tier rtx3050-4gb (3.81 GiB)"), 2, {})[1]]
    assert not any(name in os.environ for name in nccl.SMALL)
    step = cli.step(Target(gpu=CardReading("RTX 3050 Laptop", 3902 * 2**20, 0, 0, "", (8, 6)).gpu))
    assert step.communicators.settings.buffsize == 2**20 and step.communicators.total > 480 * 2**20


def test_the_module_arguments_a_count_is_keyed_without_change_no_count():
    """`SequenceClassifier.SAME_FLOPS` are left out of the count's cache key: each, set away from its default,
    counts the same FLOPs when counted afresh (a new argument of the module is counted unless named there)."""
    from lit_memory.model import SequenceClassifier
    from lit_memory.planning import recompute

    values = {
        "embedding_optimizer_state": "stable_embedding",
        "offload_activations": True,
        "lr_scheduler_type": "linear",
        "warmup_ratio": 0.1,
        "save_pretrained": False,
        "save_dtype": "bf16",
    }
    assert set(values) == SequenceClassifier.SAME_FLOPS
    base = replace(tiny(), batch_size=2, max_length=16)
    counted = flops(base)
    for name, value in values.items():
        changed = replace(base, model={**base.model, name: value})
        assert changed.key("model") != base.key("model")
        recompute._COUNTS.clear()
        assert flops(changed) == counted, name


def test_a_fused_step_that_measures_first_plans_and_allows_no_selective_layer(capsys):
    """Clipping by norm and fp16 loss scaling make the fused step run a measuring backward, then the one that steps;
    torch's selective checkpointing allows one backward through a layer (found on an H200: docs/gpu/h200.json,
    4gb-fp16). `auto` then plans full or no checkpointing, and an explicit selective plan is one error line."""
    none = device_total(tiny("cuda"))
    full = device_total(tiny("cuda", gradient_checkpointing=True))
    budget = int(full + 0.5 * (none - full))
    bare = replace(tiny("cuda"), margin=0.0)
    assert plan_for(bare, Limit(budget, margin=0.0)).plan.selective  # unclipped: the cheapest plan has selective layers
    measuring = replace(bare, clip_norm=True)
    assert measuring.measures
    found = plan_for(measuring, Limit(budget, margin=0.0))
    assert found.plan is not None and not found.plan.selective and found.total <= budget
    args = ["fit", "--model.model_name_or_path=bundled:bert-large", f"--model.config_overrides={TINY}",
            "--model.pretrained=false", "--model.gradient_checkpointing={full: 1, selective: 2}",
            "--trainer.strategy=lit_memory.FusedSingleDeviceStrategy", "--trainer.accelerator=cpu"]
    resolve(args).build(trainer=False)  # no measuring backward: selective layers are fine
    with pytest.raises(UserError, match=r"^model.gradient_checkpointing checkpointing 1 full, 2 selective: selective "
                                        r"layers can be back-propagated once, and clipping by norm"):
        resolve([*args, "--trainer.gradient_clip_val=1.0"]).build(trainer=False)


def test_resolve_auto_returns_the_plan_and_leaves_the_parsed_settings_as_they_were():
    args = ["fit", "--model.model_name_or_path=bundled:bert-large", f"--model.config_overrides={TINY}",
            "--model.pretrained=false", "--model.gradient_checkpointing=auto", "--model.offload_activations=auto",
            f"--data.batch_size={BATCH}", f"--data.max_length={LENGTH}", "--trainer.accelerator=cpu"]
    none = analytic(tiny()).footprint.peak
    cli = resolve([*args, f"--memory.tier={int(none * 0.8)}"])
    before = cli.settings.clone()
    found = resolve_auto(cli.settings, cli.memory, True, cli.step, lambda: None)
    assert cli.settings == before  # decided, not written: the CLI writes what comes back
    assert set(found) == {"model.gradient_checkpointing", "model.offload_activations"}
    assert CheckpointPlan.parse(found["model.gradient_checkpointing"]).recomputes
    assert found["model.offload_activations"] is False  # offloading is a no-op on a CPU run
    # outside training nothing is recomputed, and nothing is predicted to decide it
    assert resolve_auto(cli.settings, cli.memory, False, None, None) == {
        "model.gradient_checkpointing": False, "model.offload_activations": False,
    }


def test_under_a_cap_a_plan_leaves_the_allocators_room_and_for_a_tier_it_need_not(monkeypatch):
    """``memory.budget`` caps the allocator, whose check counts a request's whole segment (`Replay.room`): the plan
    fits the device total and that room; ``memory.tier`` is a card, uncapped, where the device total alone fits."""
    from lit_memory.memory.settings import MemorySettings
    from lit_memory.planning import recompute

    full = device_total(tiny("cuda", gradient_checkpointing=True))
    none = device_total(tiny("cuda"))
    room = (none - full) // 3  # stood for: a request whose whole segment passes the cap where its pages would not
    monkeypatch.setattr(recompute, "capped_total", lambda step: device_total(step) + room)
    budget = Limit(int(full + 0.5 * (none - full)), margin=0.0)
    tier = replace(tiny("cuda"), margin=0.0, memory=MemorySettings(tier=str(budget.bytes)))
    capped = replace(tiny("cuda"), margin=0.0, memory=MemorySettings(budget=str(budget.bytes)))
    for_tier, for_cap = plan_for(tier, budget), plan_for(capped, budget)
    assert for_tier.total <= budget.bytes and for_cap.total <= budget.bytes
    assert for_cap.total == device_total(_with(capped, for_cap)) + room  # the room is in what it fitted
    assert for_cap.flops > for_tier.flops  # more recompute: the room is memory the plan cannot have


def _with(step, found):
    from lit_memory.planning.recompute import _with_plan

    return _with_plan(step, found.plan, offload=found.offload)
