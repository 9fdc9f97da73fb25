"""Recipes are shared artefacts: each must be self-contained and honest about what it changes."""

from __future__ import annotations

import re

import pytest
import yaml

from conftest import RECIPES

SEED_TIERS = ["baseline", "accumulate", "checkpointing", "adafactor", "freeze", "short-seq"]


def header(name: str) -> dict[str, str]:
    lines = (RECIPES / f"{name}.yaml").read_text().splitlines()
    fields = dict(re.match(r"# (\w[\w-]*): (.*)", line).groups() for line in lines if re.match(r"# (\w[\w-]*): ", line))
    return fields


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.update(flatten(value, path + ".") if isinstance(value, dict) else {path: value})
    return out


def load(name: str) -> dict[str, object]:
    return flatten(yaml.safe_load((RECIPES / f"{name}.yaml").read_text()))


ALL = sorted(p.stem for p in RECIPES.glob("*.yaml"))


@pytest.mark.parametrize("name", ALL)
def test_header_names_the_recipe_its_parent_and_what_it_shrinks(name):
    fields = header(name)
    assert name in fields and fields[name]  # "# <name>: one-line description"
    assert {"parent", "changes", "shrinks"} <= set(fields)
    assert fields["parent"] == "none" or (RECIPES / f"{fields['parent']}.yaml").exists()


@pytest.mark.parametrize("name", [n for n in ALL if header(n)["parent"] != "none"])
def test_recipe_differs_from_its_parent_exactly_where_its_header_says(name):
    declared = [] if header(name)["changes"].startswith("none") else [c.strip() for c in header(name)["changes"].split(",")]
    mine, parent = load(name), load(header(name)["parent"])
    changed = {k for k in mine.keys() | parent.keys() if mine.get(k, "<absent>") != parent.get(k, "<absent>")}
    undeclared = {k for k in changed if not any(k == d or k.startswith(d + ".") for d in declared)}
    assert not undeclared, f"{name} changes {sorted(undeclared)} without saying so in '# changes:'"
    unchanged = [d for d in declared if not any(k == d or k.startswith(d + ".") for k in changed)]
    assert not unchanged, f"{name} declares {unchanged} as changed but they equal the parent's"


@pytest.mark.parametrize("name", ALL)
def test_every_setting_has_a_comment(name):
    for line in (RECIPES / f"{name}.yaml").read_text().splitlines():
        if re.match(r"\s*[\w.]+:\s*[^\s#]", line):  # a key with a value on the same line
            assert "#" in line, f"{name}: no comment on '{line.strip()}'"


def test_seed_tiers_form_one_cumulative_chain():
    assert [header(n)["parent"] for n in SEED_TIERS] == ["none", *SEED_TIERS[:-1]]
