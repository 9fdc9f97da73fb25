"""Recipes are shared artefacts: each must be self-contained and honest about what it changes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile

import pytest
import yaml

from conftest import RECIPES, REPO
from lit_memory import recipes
from lit_memory.__main__ import main

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


# -- recipes as named, packaged artefacts (lit_memory/recipes.py) --------------------------------


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
    assert recipes.names() == ALL
    assert recipes.recipe_path("4gb") == recipes.recipe_path("4gb.yaml") == RECIPES / "4gb.yaml"


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
    code = "from lit_memory import recipes; print(recipes.recipe_path('4gb')); recipes.main([])"
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


BENCH_README = """# Measured recipes

| machine | GPU |
|---|---|
| lab | H100 |

| recipe | peak GPU memory | samples/s | val f1 |
|---|---:|---:|---:|
| `baseline` | 15.10 GiB | 70.1 | 0.91 |
| [4gb](4gb.yaml) | 3.90 GiB | 50.2 | 0.90 |
| `4gb` | 3.41 GiB | 55.0 | 0.90 |
"""


def test_list_shows_tiers_in_order_with_parent_description_and_measured_numbers(tmp_path, monkeypatch, capsys):
    shipped = tmp_path / "recipes"
    shipped.mkdir()
    for name in ALL:
        (shipped / f"{name}.yaml").write_bytes((RECIPES / f"{name}.yaml").read_bytes())
    (shipped / "README.md").write_text(BENCH_README)
    monkeypatch.setattr(recipes, "PACKAGED", shipped)
    code, out, _ = run_main(["recipes"], capsys)
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1 : 1 + len(ALL)]}
    assert_parents_first(list(rows))
    assert rows["4gb"].split()[:4] == ["4gb", header("4gb")["parent"], "3.41", "GiB"]  # the latest row wins
    assert rows["4gb"].split()[4] == "55.0"
    assert rows["4gb"].endswith(header("4gb")["4gb"])
    assert rows["baseline"].split()[1:5] == ["none", "15.10", "GiB", "70.1"]
    assert rows["freeze"].split()[1:4] == ["adafactor", "-", "-"]  # not measured


def test_show_prints_the_recipe_with_its_comments(capsys):
    code, out, _ = run_main(["recipes", "show", "4gb"], capsys)
    assert code == 0 and out == (RECIPES / "4gb.yaml").read_text()


@pytest.mark.parametrize("name", ALL)
def test_check_passes_every_shipped_recipe_and_says_what_it_imports(name, capsys):
    code, out, _ = run_main(["recipes", "check", str(RECIPES / f"{name}.yaml")], capsys)
    assert code == 0
    optimizer = load(name)["model.optimizer.class_path"]
    assert f"model.optimizer: {optimizer}" in out.splitlines()[0]
    assert out.strip().splitlines()[-1] == (
        f"ok: {RECIPES / f'{name}.yaml'} parses against the `fit` schema and needs no --trust-recipe"
    )


def test_check_reports_unknown_keys_and_type_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_step: 3\nmodel:\n  batchsize: 4\n  gradient_checkpointing: maybe\n")
    code, out, err = run_main(["recipes", "check", str(bad)], capsys)
    assert code == 2
    problems = [line for line in out.splitlines() if line.startswith("  problem  ")]
    assert problems[0] == "  problem  unknown keys: trainer.max_step, model.batchsize"
    assert problems[1] == "  problem  Parser key \"model.gradient_checkpointing\": Expected a <class 'bool'>. Got value: maybe"
    assert err.strip().splitlines() == [f"error: {bad}: 2 problem(s)"]


def test_measured_peak_reads_memory_json_defensively(tmp_path):
    assert recipes.measured_peak(tmp_path) is None  # no memory.json
    (tmp_path / "memory.json").write_text("{not json")
    assert recipes.measured_peak(tmp_path) is None
    (tmp_path / "memory.json").write_text(json.dumps({"peak_bytes": 3}))  # another schema
    assert recipes.measured_peak(tmp_path) is None
    cpu = {"device": {"type": "cpu"}, "peak_bytes": {"measured": 3 * 2**30 + 2**29}, "cuda": None}
    (tmp_path / "memory.json").write_text(json.dumps(cpu))
    assert recipes.measured_peak(tmp_path) == "3.50 GiB (tensor tracker, cpu)"
    cuda = {**cpu, "device": {"type": "cuda"}, "cuda": {"max_allocated_bytes": 2**31, "max_reserved_bytes": 5 * 2**29}}
    (tmp_path / "memory.json").write_text(json.dumps(cuda))
    assert recipes.measured_peak(tmp_path) == "2.00 GiB allocated, 2.50 GiB reserved (CUDA)"
