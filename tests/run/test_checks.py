"""Bad settings: one `error:` line before anything trains, nothing written (issue 20's fuzz)."""

from __future__ import annotations

import contextlib
import functools
import io

import pytest
import torch
import yaml
from conftest import COMPILED, RECIPES
from transformers.optimization import Adafactor

from lit_memory.__main__ import main
from lit_memory.errors import UserError
from lit_memory.run.checks import check_optimizer, check_trainer
from lit_memory.settings import dotted_leaves


@pytest.mark.parametrize(
    "factory, message",
    [
        (functools.partial(torch.optim.AdamW, lr=-1.0), "Invalid learning rate"),  # the class's own check
        (functools.partial(torch.optim.SGD, lr=0.1, momentum=float("nan")), "momentum must be finite"),
        (functools.partial(Adafactor, lr=1e-3, relative_step=False, weight_decay=-0.1), "weight_decay must be >= 0"),
        (functools.partial(torch.optim.AdamW, lr=2e-5, eps=0.0), "eps must be > 0"),
        (functools.partial(torch.optim.AdamW, lr=2e-5, amsgrad="maybe"), "amsgrad must be true or false"),
        (functools.partial(Adafactor, lr=1e-3, relative_step=False, eps=()), "eps must be a list of 2 numbers"),
        (functools.partial(Adafactor, lr=1e-3, relative_step=False, eps=5), "eps must be a list of 2 numbers"),
        (
            functools.partial(Adafactor, lr=1e-3, relative_step=False, scale_parameter="no"),
            "scale_parameter must be true or false",
        ),
    ],
)
def test_check_optimizer_refuses_in_one_line(factory, message):
    with pytest.raises(UserError, match=message) as err:
        check_optimizer(factory)
    assert str(err.value).startswith("model.optimizer: ") and "\n" not in str(err.value)


def test_check_optimizer_keeps_every_shipped_optimizer():
    for factory in (functools.partial(torch.optim.AdamW, lr=2e-5, weight_decay=0.01),
                    functools.partial(Adafactor, lr=None, relative_step=True, warmup_init=True, scale_parameter=True)):
        check_optimizer(factory)  # no error: Adafactor's negative decay_rate is an exponent, not a coefficient


def test_check_optimizer_reads_what_torchao_keeps_outside_defaults():
    lowbit = pytest.importorskip("torchao.optim")
    with pytest.raises(UserError, match="block_size must be > 0"):
        check_optimizer(functools.partial(lowbit.AdamW4bit, lr=1e-3, block_size=-1))


@pytest.mark.parametrize("trainer, message", [
    ({"accumulate_grad_batches": 0}, "accumulate_grad_batches must be a whole number >= 1"),
    ({"accumulate_grad_batches": -1}, "accumulate_grad_batches must be a whole number >= 1"),
    ({"accumulate_grad_batches": 1, "gradient_clip_val": float("nan")}, "gradient_clip_val must be a finite number"),
    ({"accumulate_grad_batches": 1, "gradient_clip_val": -1.0}, "gradient_clip_val must be a finite number"),
])
def test_check_trainer(trainer, message):
    with pytest.raises(UserError, match=message):
        check_trainer(trainer)
    check_trainer({"accumulate_grad_batches": 4, "gradient_clip_val": 1.0})


def _leaves(node: dict):
    return ((key, value) for key, value in dotted_leaves(node, lists=False) if not key.endswith("class_path"))


def _fuzz_cases() -> list[tuple[str, str, str]]:
    """Every numeric and enum setting of the shipped recipes (first recipe that sets it), with values
    that are wrong for any of them: negative, NaN, a word; flags get a word and a number."""
    first: dict[str, tuple[str, object]] = {}
    for recipe in sorted(RECIPES.glob("*.yaml"), key=lambda p: (p.stem in COMPILED, p.name)):  # compiling: minutes
        for key, value in _leaves(yaml.safe_load(recipe.read_text())):
            first.setdefault(key, (recipe.name, value))
    cases = []
    for key, (recipe, value) in sorted(first.items()):
        if isinstance(value, bool):
            bad = ["maybe", "2"]
        elif isinstance(value, (int, float)):
            bad = ["-1", "nan", "abc"]
        elif isinstance(value, str) or value is None:
            bad = ["bogus"]
        else:
            continue
        cases += [(recipe, key, v) for v in bad]
    return cases


FUZZ_FAST = ["--trainer.max_steps=1", "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0",
             "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
             "--trainer.enable_checkpointing=false", "--data.limit_train_samples=16", "--data.limit_eval_samples=8",
             "--model.save_pretrained=false", "--memory.simulate=false"]


@pytest.mark.fit
@pytest.mark.parametrize("recipe, key, value", _fuzz_cases())
def test_fuzzed_setting_is_one_error_line_or_a_clean_run(recipe, key, value, tmp_path):
    root = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["fit", "--config", str(RECIPES / recipe), *FUZZ_FAST, f"--{key}={value}",
                  f"--trainer.default_root_dir={root}"])
            code = 0
        except SystemExit as exit:
            code = exit.code
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    if code == 0:  # a value the setting takes (max_epochs: -1 is "no limit")
        assert not errors
        return
    assert code == 2 and len(errors) == 1, err.getvalue()[-2000:]
    assert not root.exists() or not any(root.rglob("*")), f"{key}={value} left {sorted(root.rglob('*'))}"
