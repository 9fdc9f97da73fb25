"""The policy's registry: every rule has a phase, each phase's runner calls exactly its rules, a refusal names its
key, and what the user typed is theirs where the rule says so."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from lit_memory.policy import phases, refusal
from lit_memory.policy.refusal import NOTHING, PHASES, Context, Refusal, register

# A sent recipe that breaks one rule of each subject the parse and launch phases judge.
HOSTILE = {
    "model": {"config_overrides": {"trust_remote_code": True, "quantization_config": {"bits": 4}}},
    "weights_only": False,
    "data": {"num_workers": 1_000_000},
    "trainer": {
        "default_root_dir": "/",
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"name": "../up"}},
        "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                       "init_args": {"filename": "{epoch.__class__}", "dict_kwargs": {"x": 1}}}],
    },
}


def test_every_rule_has_a_phase_a_unique_name_and_a_subject_in_the_order():
    rules = [r for phase in PHASES for r in phases.rules_of(phase)]
    assert len(rules) == len(refusal.RULES) > 10
    assert len({r.name for r in rules}) == len(rules)
    for rule in rules:
        assert rule.phase in PHASES and rule.name.split(".")[0] in phases.ORDER, rule
    assert {r.name.split(".")[0] for r in rules} == set(phases.ORDER)  # each subject module holds rules


def test_a_rule_of_an_unknown_phase_is_refused_when_registered():
    with pytest.raises(ValueError, match="unknown phase"):
        register("later")(lambda context: [])


@pytest.mark.parametrize("phase", PHASES)
def test_each_phases_runner_calls_exactly_the_rules_of_its_phase(phase, monkeypatch):
    called = []

    def recording(rule):
        return dataclasses.replace(rule, check=lambda context: called.append(rule.name) or [])

    monkeypatch.setattr(refusal, "RULES", [recording(r) for r in refusal.RULES])
    monkeypatch.setattr(phases, "RULES", refusal.RULES)
    phases.refusals(phase, Context(HOSTILE))
    assert called == [r.name for r in phases.rules_of(phase)]
    assert set(called) == {r.name for r in refusal.RULES if r.phase == phase} != set()


def test_a_refusal_names_its_key_and_its_line_says_it(tmp_path):
    found = [*phases.refusals("parse", Context(HOSTILE)),
             *phases.refusals("launch", Context(HOSTILE, work=str(tmp_path)))]
    keys = {r.key.split(".dict_kwargs")[0] for r in found}
    for expected in ("model.config_overrides.trust_remote_code", "model.config_overrides.quantization_config",
                     "weights_only", "data.num_workers", "trainer.default_root_dir", "trainer.logger.init_args.name",
                     "trainer.callbacks.0.init_args.filename", "trainer.callbacks.0.init_args"):
        assert expected in keys, (expected, keys)
    for r in found:
        assert str(r).startswith(f"refusing {r.shown()}: ") and r.key.split(".")[0] in str(r), r
        assert "--trust-recipe" in str(r)


def test_a_value_the_user_typed_is_theirs_where_the_rule_exempts_it(tmp_path):
    def typed(key, value):
        return key in ("weights_only", "trainer.default_root_dir")

    keys = {r.key for r in phases.refusals("parse", Context(HOSTILE, typed=typed))}
    assert "weights_only" not in keys and "data.num_workers" in keys
    launch = {r.key for r in phases.refusals("launch", Context(HOSTILE, typed=typed, work=str(tmp_path)))}
    assert "trainer.default_root_dir" not in launch and "trainer.logger.init_args.name" in launch
    # the checkpoint rule says itself what is exempt: a typed checkpoint that is not a local file is still refused
    remote = {"ckpt_path": "s3://bucket/x.ckpt"}
    assert [r.key for r in phases.refusals("parse", Context(remote, typed=lambda k, v: True))] == ["ckpt_path"]


def test_a_refusal_without_a_value_shows_its_key_or_its_head():
    assert Refusal("trainer.callbacks", NOTHING, "keeps 12").line() == "trainer.callbacks: keeps 12"
    assert Refusal("k", 3, "why").line() == "k=3: why"
    assert Refusal("k", NOTHING, "the callbacks save too often", head="").line() == "the callbacks save too often"
    lifted = Refusal.of_error("trainer.default_root_dir", "refusing trainer.default_root_dir=lightning_logs: x is a "
                              "link; pass --trust-recipe only if you trust its source")
    assert lifted.line() == "trainer.default_root_dir=lightning_logs: x is a link"


def test_the_policy_and_what_the_user_typed_load_no_torch():
    """`lit_memory.config.trusted` decides where a run goes before torch is imported, with the write list."""
    code = ("import sys; import lit_memory.policy.writes, lit_memory.policy.reads, lit_memory.policy.refusal; "
            "print('torch' in sys.modules, 'lightning' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
