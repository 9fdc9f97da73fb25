"""`lit_memory.settings`: settings parsed once into typed values (the precision), dotted keys over the trees
the CLI and the recipes give, the one cache key, and a run's sections read from the classes' signatures; and the
step that reads a run's settings through them (`lit_memory.planning.prediction.step.Step`)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import pytest
import torch
from jsonargparse import Namespace

from lit_memory.errors import UserError
from lit_memory.fused import Bucketing, parse_bucket
from lit_memory.model import SequenceClassifier
from lit_memory.planning.prediction.step import OptimizerSpec, Step
from lit_memory.settings import (
    PRECISIONS,
    Precision,
    arguments,
    assign,
    dotted_leaves,
    key_of,
    locate,
    overlay,
    patched,
    section,
    to_plain,
)


@pytest.mark.parametrize(
    "value, name",
    [("bf16", "bf16-mixed"), (16, "16-mixed"), ("16", "16-mixed"), ("32", "32-true"), (32, "32-true"), (64, "64-true"),
     (None, "32-true"), ("bf16-true", "bf16-true"), ("16-true", "16-true")],
)
def test_a_precision_is_read_as_lightning_reads_it(value, name):
    """Lightning's aliases (``bf16`` is ``bf16-mixed``, ``16`` is ``16-mixed``) are the precision they stand for."""
    found = Precision.of(value)
    assert found is PRECISIONS[name] and str(found) == name
    assert Precision.of(found) is found


def test_what_a_precision_means_for_tensors():
    bf16_mixed, fp16_mixed, bf16_true = (PRECISIONS[n] for n in ("bf16-mixed", "16-mixed", "bf16-true"))
    assert (bf16_mixed.param, bf16_mixed.compute, bf16_mixed.autocast) == (torch.float32, torch.bfloat16, True)
    assert bf16_mixed.bf16 and not bf16_mixed.scaled and not bf16_mixed.half_weights
    assert fp16_mixed.scaled and not fp16_mixed.bf16
    assert bf16_true.bf16 and bf16_true.half_weights and not bf16_true.autocast and not bf16_true.scaled
    assert not PRECISIONS["32-true"].bf16 and not PRECISIONS["64-true"].half_weights


def test_a_precision_not_modelled_is_one_line_or_none():
    with pytest.raises(UserError, match="precision 'transformer-engine' is not modelled; choose one of: 32-true"):
        Precision.of("transformer-engine")
    assert Precision.known("transformer-engine") is None and Precision.known("nonsense") is None


def test_dotted_keys_walk_namespaces_dicts_and_lists():
    tree = Namespace(model=Namespace(lr=0.1, config_overrides={"a": {"b": 1}}), trainer=Namespace(callbacks=[{"x": 2}]))
    found = dict(dotted_leaves(tree))
    assert found == {"model.lr": 0.1, "model.config_overrides.a.b": 1, "trainer.callbacks.0.x": 2}
    assert dict(dotted_leaves(tree, lists=False))["trainer.callbacks"] == [{"x": 2}]
    assert dict(dotted_leaves(to_plain(tree), depth=2)) == {"model.lr": 0.1, "model.config_overrides": {"a": {"b": 1}},
                                                   "trainer.callbacks": [{"x": 2}]}
    container, last = locate(tree, "trainer.callbacks.0.x")
    assert container == {"x": 2} and last == "x"
    assign(tree, "model.config_overrides.a.b", 5)
    assert tree.model.config_overrides == {"a": {"b": 5}}
    with pytest.raises(KeyError):
        locate(tree, "model.config_overrides.a.c")
    with pytest.raises(KeyError):
        assign(tree, "trainer.nothing", 1)


def test_overlay_lays_dotted_values_over_a_copy():
    settings = {"model": {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}, "num_labels": 2}}
    out = overlay(settings, {"model.optimizer": {"class_path": "torch.optim.AdamW"}, "data.batch_size": 8})
    assert out == {
        "model": {"optimizer": {"class_path": "torch.optim.AdamW"}, "num_labels": 2},
        "data": {"batch_size": 8},
    }
    assert settings["model"]["optimizer"]["init_args"] == {"lr": 0.1}  # the caller's settings are left as they were


def test_the_cache_key_is_equal_for_equal_values_and_only_for_them():
    @dataclass(frozen=True)
    class Point:
        x: int
        y: torch.dtype

    assert key_of({"a": 1, "b": [1, 2]}) == key_of({"b": (1, 2), "a": 1})  # key order and tuples do not matter
    assert key_of({"a": 1}) != key_of({"a": 1.5}) != key_of({"a": "1.5"})
    assert key_of(Point(1, torch.float16)) == key_of(Point(1, torch.float16)) != key_of(Point(1, torch.bfloat16))
    assert key_of(PRECISIONS["bf16-mixed"]) == key_of(Precision.of("bf16")) != key_of(PRECISIONS["bf16-true"])
    assert key_of(Namespace(a=1)) == key_of({"a": 1})


def test_a_section_is_every_argument_of_the_class_with_its_default():
    class Module:
        def __init__(self, size: int, depth: int = 2, *args, name: str = "x", **kwargs) -> None: ...

    assert list(arguments(Module)) == ["size", "depth", "name"] and arguments(Module)["size"] is inspect.Parameter.empty
    assert section(Module, {"size": 3, "other": 1}) == {"size": 3, "depth": 2, "name": "x"}  # not an argument: left out
    assert section(Module, None) == {"depth": 2, "name": "x"}  # no value and no default: left out
    assert section(Module, {"name": "y"}, without=("depth",)) == {"name": "y"}


def test_a_steps_module_settings_are_the_modules_signature():
    """Every argument of `SequenceClassifier` but the optimizer, its default where a step's settings give none: a
    new argument of the module is a setting of the step with nothing copied by hand; a key that is no argument is
    one line."""
    step = Step(model={"num_labels": 3}, optimizer=OptimizerSpec("torch.optim.SGD", {"lr": 0.1}))
    expected = {k: v.default for k, v in inspect.signature(SequenceClassifier).parameters.items() if k != "optimizer"}
    assert step.model == {**expected, "num_labels": 3}
    with pytest.raises(
        UserError, match=r"model: 'nonsense': not arguments of SequenceClassifier \(those are: model_name_or_path"
    ):
        Step(model={"nonsense": 1}, optimizer=step.optimizer)


def test_a_step_is_parsed_once_and_states_the_settings_it_reads_back_from():
    """A step holds its precision and bucket parsed (as Lightning's values and as written alike); `as_settings`
    writes a step back, its fields changed in Python included, as settings that read back to the same step."""
    step = Step.from_settings({
        "model": {"num_labels": 3, "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}},
        "trainer": {"precision": "bf16", "strategy": {"class_path": "lit_memory.FusedSingleDeviceStrategy",
                                                      "init_args": {"bucket": "25 MiB"}}},
        "data": {"batch_size": 4},
    })
    assert step.precision is PRECISIONS["bf16-mixed"] and step.bucket == Bucketing("size", 25 * 2**20) and step.fused
    assert (step.batch_size, step.max_length, step.model["num_labels"]) == (4, 128, 3)  # max_length: the data's default
    assert Step.from_settings(step.as_settings()) == step
    changed = replace(step, precision="16-true", bucket="param", fused=True, sharded=True, world_size=4, clip_norm=True,
                      batch_size=2)
    assert changed.precision is PRECISIONS["16-true"] and changed.bucket == parse_bucket("param")
    assert Step.from_settings(changed.as_settings()) == changed
    plain_step = replace(step, fused=False, bucket="layer")  # no fused step: no bucket (Lightning's own strategy)
    assert (
        Step.from_settings(plain_step.as_settings()) == plain_step
        and plain_step.as_settings()["trainer"]["strategy"] == "auto"
    )
    assert step.key() == Step.from_settings(step.as_settings()).key() != changed.key()
    assert step.cache_key != step.key() and step.cache_key == replace(step, batch_size=1).cache_key


def test_patched_puts_back_what_was_there_an_inherited_attribute_inherited_again_and_refuses_a_typo():
    class Base:
        def step(self):
            return "base"

    class Child(Base):
        pass

    with patched(Child, "step", lambda self: "patched"):
        assert Child().step() == "patched" and Base().step() == "base"
    assert "step" not in vars(Child) and Child().step() == "base"
    with pytest.raises(KeyError), patched(Base, "step", lambda self: "patched"):
        raise KeyError("inside the block")
    assert Base().step() == "base"
    with pytest.raises(AttributeError), patched(Base, "stpe", None):
        pass
