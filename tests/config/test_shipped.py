"""Recipes are shared artefacts: each must be self-contained and honest about what it changes."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile

import pytest
import yaml
from conftest import RECIPES, REPO, flatten

from lit_memory.__main__ import main
from lit_memory.config import shipped
from lit_memory.memory.measure import records

SEED_TIERS = ["baseline", "accumulate", "checkpointing", "adafactor", "freeze", "short-seq"]


def header(name: str) -> dict[str, str]:
    lines = (RECIPES / f"{name}.yaml").read_text().splitlines()
    fields = dict(re.match(r"# (\w[\w-]*): (.*)", line).groups() for line in lines if re.match(r"# (\w[\w-]*): ", line))
    return fields


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
    declared = (
        [] if header(name)["changes"].startswith("none") else [c.strip() for c in header(name)["changes"].split(",")]
    )
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


# -- recipes as named, packaged artefacts (lit_memory/config/shipped.py) --------------------------------


def run_main(argv, capsys):
    """`python -m lit_memory ARGV`: (exit status, stdout, stderr)."""
    try:
        main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def test_shipped_recipes_resolve_by_name_from_a_checkout():
    assert shipped.names() == ALL
    assert shipped.recipe_path("4gb") == shipped.recipe_path("4gb.yaml") == RECIPES / "4gb.yaml"


def test_an_unknown_name_is_one_line_naming_the_recipes(tmp_path, capsys):
    code, _, err = run_main(["fit", "--recipe", "5gb", f"--trainer.default_root_dir={tmp_path / 'runs'}"], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: unknown recipe '5gb'; choose one of: {', '.join(ALL)} (or --config FILE)"
    ]
    assert not (tmp_path / "runs").exists()


def test_the_wheel_ships_the_recipes_and_finds_them_by_name_from_anywhere(tmp_path, monkeypatch):
    import hatchling.build

    monkeypatch.chdir(REPO)
    wheel = tmp_path / hatchling.build.build_wheel(str(tmp_path))  # the hook pip calls
    with zipfile.ZipFile(wheel) as archive:
        for name in ALL:
            assert archive.read(f"lit_memory/assets/recipes/{name}.yaml") == (RECIPES / f"{name}.yaml").read_bytes()
        archive.extractall(tmp_path / "site")  # a pure-Python wheel installs by unpacking
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("from lit_memory.config import shipped; from lit_memory.tools import recipes as c; "
            "print(shipped.recipe_path('4gb')); c.main([])")
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=elsewhere,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == str(tmp_path / "site" / "lit_memory" / "assets" / "recipes" / "4gb.yaml")
    assert_parents_first([line.split()[0] for line in lines[2 : 2 + len(ALL)]])


def assert_parents_first(order: list[str]) -> None:
    """Every shipped recipe listed once, each after its parent tier."""
    assert sorted(order) == ALL
    for position, name in enumerate(order):
        parent = header(name)["parent"]
        assert parent == "none" or order.index(parent) < position, f"{name} listed before its parent {parent}"


def test_list_shows_tiers_in_order_with_parent_description_and_measured_numbers(tmp_path, monkeypatch, capsys):
    from lit_memory.config import shipped as where

    shipped = tmp_path / "recipes"
    shipped.mkdir()
    for name in ALL:
        (shipped / f"{name}.yaml").write_bytes((RECIPES / f"{name}.yaml").read_bytes())
    rows = [{"recipe": "baseline", "peak_measured_bytes": int(15.1 * 2**30), "samples_per_s": 70.1},
            {"recipe": "4gb", "peak_measured_bytes": int(3.41 * 2**30), "samples_per_s": 55.0}]
    records.write_bench(shipped, {"command": "python -m lit_memory bench"}, rows)  # what bench --update-readme leaves
    monkeypatch.setattr(where, "PACKAGED", shipped)
    code, out, _ = run_main(["recipes"], capsys)
    assert code == 0
    listed = {line.split()[0]: line for line in out.splitlines()[1 : 1 + len(ALL)]}
    assert_parents_first(list(listed))
    assert listed["4gb"].split()[:5] == ["4gb", header("4gb")["parent"], "3.41", "GiB", "55.0"]
    assert listed["4gb"].endswith(header("4gb")["4gb"])
    assert listed["baseline"].split()[1:5] == ["none", "15.10", "GiB", "70.1"]
    assert listed["freeze"].split()[1:4] == ["adafactor", "-", "-"]  # not measured


def test_show_prints_the_recipe_with_its_comments(capsys):
    code, out, _ = run_main(["recipes", "show", "4gb"], capsys)
    assert code == 0 and out == (RECIPES / "4gb.yaml").read_text()


@pytest.mark.parametrize("name", ALL)
def test_check_passes_every_shipped_recipe_and_says_what_it_imports(name, capsys):
    code, out, _ = run_main(["recipes", "check", str(RECIPES / f"{name}.yaml")], capsys)
    assert code == 0
    optimizer = load(name)["model.optimizer.class_path"]
    assert f"model.optimizer: {optimizer}" in out.splitlines()[0]
    assert out.strip().splitlines()[-2:] == [
        f"ok: {RECIPES / f'{name}.yaml'} parses against the `fit` schema and needs no --trust-recipe",
        f"trust: {RECIPES / f'{name}.yaml'} is byte-identical to the shipped recipes/{name}.yaml: a run of it is not "
        "confined",
    ]


def test_check_reports_unknown_keys_and_type_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_step: 3\nmodel:\n  batchsize: 4\n  gradient_checkpointing: maybe\n")
    code, out, err = run_main(["recipes", "check", str(bad)], capsys)
    assert code == 2
    problems = [line for line in out.splitlines() if line.startswith("  problem  ")]
    assert problems[0] == "  problem  unknown keys: trainer.max_step, model.batchsize"
    assert problems[1].startswith('  problem  Parser key "model.gradient_checkpointing": ') and "maybe" in problems[1]
    assert err.strip().splitlines() == [f"error: {bad}: 2 problem(s)"]
