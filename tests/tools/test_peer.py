"""The HF Trainer peer: recipes map onto the reference post's TrainingArguments (running it:
tests/tools/test_bench.py)."""

from __future__ import annotations

import pytest
from conftest import RECIPES

from lit_memory.cli import resolve
from lit_memory.tools.peer import NoTrainerEquivalent, trainer_arguments


def arguments(recipe: str, *overrides: str) -> dict:
    return trainer_arguments(resolve(["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *overrides]))


def test_the_reference_tiers_map_onto_the_reference_posts_training_arguments():
    # The reference post's 5th tier: batch 1, accumulate 32, gradient checkpointing, optim="adafactor", lr 2e-5, wd
    # 0.01.
    freeze = arguments("freeze")
    assert {k: freeze[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps")} == {
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 32,
    }
    assert freeze["gradient_checkpointing"] is True and freeze["optim"] == "adafactor"
    assert (freeze["learning_rate"], freeze["weight_decay"]) == (2e-5, 0.01)
    baseline = arguments("baseline")
    assert baseline["per_device_train_batch_size"] == 32 and baseline["gradient_accumulation_steps"] == 1
    # AdamW with its kernel left to us: the fused one, as our run gives it and the Trainer's default is; chosen
    # otherwise in the recipe, the same choice
    assert baseline["optim"] == "adamw_torch_fused" and not baseline["gradient_checkpointing"]
    assert arguments("baseline", "--model.optimizer.init_args.fused=false")["optim"] == "adamw_torch"
    assert arguments("8bit")["optim"] == "adamw_bnb_8bit"
    assert arguments("baseline", "--trainer.accelerator=cpu")["use_cpu"] is True


def test_bf16_maps_to_bf16_unless_the_cli_falls_back_to_fp32():
    assert arguments("bf16", "--cpu_bf16_fallback=false", "--trainer.accelerator=cpu")["bf16"] is True


def test_torchao_8bit_and_bf16_weights_map_onto_the_trainers_torchao_optim_and_a_bf16_model():
    torchao = ["--model.optimizer.class_path=torchao.optim.AdamW8bit", "--cpu_bf16_fallback=false"]
    eight = arguments("8bit", *torchao)
    assert eight["optim"] == "adamw_torch_8bit" and eight["optim_args"] == "bf16_stochastic_round=False"
    # bf16-true: no autocast flag (the peer casts the model, as Lightning does); stochastic rounding passed on
    rounded = arguments(
        "8bit", *torchao, "--trainer.precision=bf16-true", "--model.optimizer.init_args.bf16_stochastic_round=true"
    )
    assert rounded["optim_args"] == "bf16_stochastic_round=True" and "bf16" not in rounded and "fp16" not in rounded


@pytest.mark.parametrize(
    "optimizer, reason",
    [
        ("torchao.optim.AdamW4bit", "AdamW4bit with block_size 128: the Trainer's adamw_torch_4bit uses 256"),
        ("torchao.optim.AdamWFp8", "optimizer torchao.optim.AdamWFp8"),
    ],
)
def test_torchao_settings_the_trainer_cannot_express_have_no_equivalent(optimizer, reason):
    with pytest.raises(NoTrainerEquivalent, match=f"^no Trainer equivalent \\(.*{reason}\\)$"):
        arguments("8bit", f"--model.optimizer.class_path={optimizer}")


@pytest.mark.parametrize("recipe", ["fused", "4gb", "2gb"])
def test_the_fused_step_has_no_trainer_equivalent(recipe):
    with pytest.raises(NoTrainerEquivalent, match="fused backward"):
        arguments(recipe)


def test_the_trainers_best_under_a_4gb_card_is_the_first_configuration_and_largest_micro_batch_predicted_to_fit():
    """4gb.yaml's fused step has no Trainer switch: its peer is the Trainer's best within the same cap. fp32 weights
    with their fp32 gradients do not fit 3.81 GiB at any micro-batch; bf16 weights do, and the largest that fits is
    taken."""
    from lit_memory.memory.hardware.gpus import Target, gpu
    from lit_memory.tools.peer import best_under_budget

    h200 = gpu("h200")
    run = resolve(["fit", "--config", str(RECIPES / "4gb.yaml"), "--model.model_name_or_path=bundled:bert-large",
                   "--model.pretrained=false", "--cpu_bf16_fallback=false", "--memory.budget=rtx3050-4gb"], gpu=h200)
    found = best_under_budget(run, Target(gpu=h200))
    chosen = found.pop("chosen")
    assert found["optim"] == "adamw_bnb_8bit" and found["gradient_checkpointing"] is True
    assert (
        chosen["precision"] == "bf16-true"
        and chosen["over_the_limit"][0]["predicted_device_bytes"] > chosen["limit_bytes"]
    )
    assert found["per_device_train_batch_size"] * found["gradient_accumulation_steps"] == 32
    assert chosen["predicted_device_bytes"] <= chosen["limit_bytes"]
    with pytest.raises(NoTrainerEquivalent, match="chosen for a memory budget"):
        best_under_budget(resolve(["fit", "--config", str(RECIPES / "fused.yaml")]))
