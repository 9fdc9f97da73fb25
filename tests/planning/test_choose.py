"""Advice after running out of memory (`lit_memory.planning.choose`): the lightest recipe predicted to fit."""

from __future__ import annotations

from lit_memory.memory.hardware.gpus import Target
from lit_memory.memory.margin import Limit
from lit_memory.planning.choose import advise, lightest_fitting
from lit_memory.planning.prediction.analytic import device_total
from lit_memory.planning.prediction.step import OptimizerSpec, Step

TINY = {
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "vocab_size": 512,
}


def test_a_recipe_whose_auto_finds_no_plan_within_the_limit_is_not_advised_and_the_others_are():
    base = Step(
        model={"model_name_or_path": "bundled:bert-large", "config_overrides": TINY},
        optimizer=OptimizerSpec.of({"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-4}}),
        batch_size=32, max_length=128, fused=True, target=Target(type="cpu"),
    )
    limit = device_total(base.with_settings({"model.gradient_checkpointing": True})) - 1  # every layer recomputed
    recipes = [
        ("auto.yaml", {"model.gradient_checkpointing": "auto"}),  # no plan fits: at fit, one error line
        ("short.yaml", {"model.gradient_checkpointing": True, "data.max_length": 64}),
    ]
    name, fit = lightest_fitting(
        base.with_settings({"memory.budget": limit, "memory.margin": 0}), Limit(limit), recipes
    )
    assert name == "short.yaml" and fit.predicted <= limit and fit.fits
    assert advise(base.with_settings({"memory.budget": limit}), limit, recipes[:1]).startswith("no shipped recipe")


def test_the_advice_keeps_the_margin_and_says_what_is_left():
    base = Step(
        model={"model_name_or_path": "bundled:bert-large", "config_overrides": TINY},
        optimizer=OptimizerSpec.of({"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-4}}),
        batch_size=32, max_length=128, fused=True, target=Target(type="cpu"),
    )
    short = [("short.yaml", {"model.gradient_checkpointing": True, "data.max_length": 64})]
    total = device_total(base.with_settings(short[0][1]))
    # it fits the limit itself, but not with 8 % of it kept free
    assert lightest_fitting(base, Limit(int(total / 0.95)), short) is None
    assert "with the 8 % margin" in advise(base, int(total / 0.95), short)
    line = advise(base, int(total / 0.85), short)
    assert "--config short.yaml (predicted peak: fits" in line and "% to spare" in line
