"""Recipes are shared artefacts: each must be self-contained and honest about what it changes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import uuid
import zipfile
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import RECIPES, REPO
from lit_memory import recipes
from lit_memory.cli import main

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


def test_check_lists_import_paths_and_passes_a_shipped_recipe(capsys):
    code, out, _ = run_main(["recipes", "check", str(RECIPES / "adafactor.yaml")], capsys)
    assert code == 0
    assert "allowed  transformers.Adafactor  (model.optimizer.class_path)" in out
    assert out.strip().splitlines()[-1] == f"ok: {RECIPES / 'adafactor.yaml'} parses against the `fit` schema"


def test_check_reports_unknown_keys_and_type_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_step: 3\nmodel:\n  batchsize: 4\n  gradient_checkpointing: maybe\n")
    code, _, err = run_main(["recipes", "check", str(bad)], capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: {bad}: unknown keys: trainer.max_step, model.batchsize; ")
    assert 'Parser key "model.gradient_checkpointing"' in line and "maybe" in line


# -- trust: nothing a recipe names outside the allowlist is imported ---------------------------


@pytest.fixture
def boom(tmp_path, monkeypatch):
    """A module on sys.path that leaves a file behind when imported or called: did anything run?"""
    name = f"boom_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "IMPORTED"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(f"""
            import pathlib
            from lightning.pytorch.callbacks import Callback
            pathlib.Path({str(marker)!r}).write_text("import-time side effect")

            class Boom(Callback):
                pass

            def make(*args, **kwargs):
                pathlib.Path({str(marker)!r}).write_text("called")
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield SimpleNamespace(name=name, marker=marker, runs=tmp_path / "runs")
    sys.modules.pop(name, None)


UNTRUSTED_RECIPES = {
    "class_path": ("model:\n  optimizer:\n    class_path: os.system\n", "os.system", "model.optimizer.class_path"),
    "callable_as_string": ("model:\n  optimizer: os.system\n", "os.system", "model.optimizer"),
    "callback": ("trainer:\n  callbacks:\n    - class_path: MOD.Boom\n", "MOD.Boom", "trainer.callbacks.0.class_path"),
    "nested_init_args": (
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.LambdaCallback\n"
        "      init_args:\n        on_fit_start: MOD.make\n",
        "MOD.make",
        "trainer.callbacks.0.init_args.on_fit_start",
    ),
    "logger": ("trainer:\n  logger:\n    class_path: MOD.Boom\n", "MOD.Boom", "trainer.logger.class_path"),
    "plugin": ("trainer:\n  plugins: [MOD.Boom]\n", "MOD.Boom", "trainer.plugins.0"),
    "any_typed_dict": (
        "model:\n  config_overrides:\n    x: {class_path: MOD.Boom}\n",
        "MOD.Boom",
        "model.config_overrides.x.class_path",
    ),
    "re_export": (  # os.system, reached through a module that imports os
        "model:\n  optimizer: lightning.pytorch.cli.os.system\n",
        "lightning.pytorch.cli.os.system",
        "model.optimizer",
    ),
}


@pytest.mark.parametrize("case", UNTRUSTED_RECIPES)
def test_fit_refuses_a_recipe_naming_code_outside_the_allowlist(case, boom, tmp_path, capsys):
    text, path, key = (s.replace("MOD", boom.name) for s in UNTRUSTED_RECIPES[case])
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(text)
    code, _, err = run_main(["fit", "--config", str(recipe), f"--trainer.default_root_dir={boom.runs}"], capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: refusing to import code outside the recipe allowlist: {path} ({recipe}: {key}).")
    assert not boom.marker.exists() and not boom.runs.exists()


UNTRUSTED_ARGS = {  # argv, what the error names
    "override": (["--model.optimizer=os.system"], "os.system (command line: model.optimizer)"),
    "class_path": (["--model.optimizer.class_path", "MOD.Boom"], "MOD.Boom (command line: model.optimizer.class_path)"),
    "append": (["--trainer.callbacks+=MOD.Boom"], "MOD.Boom (command line: trainer.callbacks+)"),
    "json": (['--model.optimizer={"class_path": "MOD.Boom"}'], "MOD.Boom (command line: model.optimizer.class_path)"),
    "inline_config": (
        ["-c", "{trainer: {callbacks: [{class_path: MOD.Boom}]}}"],
        "MOD.Boom (command line: trainer.callbacks.0.class_path)",
    ),
}


@pytest.mark.parametrize("case", UNTRUSTED_ARGS)
def test_fit_refuses_command_line_overrides_naming_code_outside_the_allowlist(case, boom, capsys):
    args = [arg.replace("MOD", boom.name) for arg in UNTRUSTED_ARGS[case][0]]
    named = UNTRUSTED_ARGS[case][1].replace("MOD", boom.name)
    code, _, err = run_main(["fit", *args, f"--trainer.default_root_dir={boom.runs}"], capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: refusing to import code outside the recipe allowlist: {named}.")
    assert not boom.marker.exists() and not boom.runs.exists()


def test_nested_config_files_are_read_before_parsing(boom, tmp_path, capsys):
    (tmp_path / "model.yml").write_text(f"optimizer:\n  class_path: {boom.name}.Boom\n")
    (tmp_path / "outer.yaml").write_text("model: model.yml\n")
    code, _, err = run_main(["fit", "--conf", str(tmp_path / "outer.yaml")], capsys)  # --conf: argparse's prefix
    assert code == 2
    assert f"{boom.name}.Boom ({tmp_path / 'model.yml'}: optimizer.class_path)" in err.strip()
    assert not boom.marker.exists()


def test_a_data_file_named_like_a_module_is_not_taken_for_code(tmp_path, monkeypatch, capsys):
    (tmp_path / "train.py").write_text(f"open({str(tmp_path / 'IMPORTED')!r}, 'w')\n")
    (tmp_path / "train.csv").write_text("review,label\ngood,1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = yaml.safe_load(run_main(["fit", "--data.source=train.csv", "--print_config"], capsys)[1])
    assert config["data"]["source"] == "train.csv"
    assert not (tmp_path / "IMPORTED").exists()


def test_what_the_scan_cannot_see_the_parser_refuses(boom, tmp_path, capsys):
    # A trainer config in JSON (the scan reads nested .yaml/.yml only): jsonargparse's own allowlist stops it.
    (tmp_path / "trainer.json").write_text(json.dumps({"callbacks": [{"class_path": f"{boom.name}.Boom"}]}))
    code, _, err = run_main(["fit", "--trainer", str(tmp_path / "trainer.json"), "--print_config"], capsys)
    assert code == 2
    assert f"Importing '{boom.name}.Boom' is not allowed" in err
    assert not boom.marker.exists()


def test_trust_recipe_lets_the_parser_import_it(boom, capsys):
    argv = ["fit", f"--trainer.callbacks+={boom.name}.Boom", "--print_config", "--trust-recipe"]
    code, out, _ = run_main(argv, capsys)
    assert code == 0
    assert yaml.safe_load(out)["trainer"]["callbacks"] == [{"class_path": f"{boom.name}.Boom"}]
    assert boom.marker.read_text() == "import-time side effect"  # so the refusals above did stop real code


def test_check_lists_refused_paths_and_does_not_parse(boom, tmp_path, capsys):
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(
        f"trainer:\n  logger:\n    class_path: {boom.name}.Boom\n"
        f"  callbacks:\n    - class_path: lightning.pytorch.callbacks.LambdaCallback\n"
        f"      init_args:\n        on_fit_start: {boom.name}.make\n"
        "model:\n  optimizer:\n    class_path: transformers.Adafactor\n"
    )
    code, out, err = run_main(["recipes", "check", str(recipe)], capsys)
    assert code == 2
    assert out.splitlines() == [
        f"import paths named by {recipe}:",
        f"  REFUSED  {boom.name}.Boom  (trainer.logger.class_path)",
        "  allowed  lightning.pytorch.callbacks.LambdaCallback  (trainer.callbacks.0.class_path)",
        f"  REFUSED  {boom.name}.make  (trainer.callbacks.0.init_args.on_fit_start)",
        "  allowed  transformers.Adafactor  (model.optimizer.class_path)",
    ]
    assert err.strip().splitlines() == [
        f"error: {recipe}: 2 import path(s) outside the allowlist ({', '.join(recipes.ALLOWLIST)}); not parsed, "
        "since parsing imports them. Pass --trust-recipe to parse it anyway, only if you trust its source"
    ]
    assert not boom.marker.exists()


def test_a_checkpoint_with_pickled_code_is_refused_before_anything_loads_it(tmp_path, capsys):
    marker = tmp_path / "UNPICKLED"

    class Payload:
        def __reduce__(self):
            return open, (str(marker), "w")  # unpickling creates the file

    torch.save({"state_dict": {}, "hyper_parameters": {}, "payload": Payload()}, tmp_path / "bad.ckpt")
    argv = ["fit", f"--ckpt_path={tmp_path / 'bad.ckpt'}", f"--trainer.default_root_dir={tmp_path / 'runs'}"]
    code, _, err = run_main(argv, capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith(f"error: cannot load checkpoint {tmp_path / 'bad.ckpt'} with weights_only=True: ")
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_a_checkpoints_hyperparameters_are_checked_like_a_recipe(boom, tmp_path, capsys):
    ckpt = tmp_path / "resume.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"optimizer": {"class_path": f"{boom.name}.Boom"}}}, ckpt)
    code, _, err = run_main(["fit", "--ckpt_path", str(ckpt), f"--trainer.default_root_dir={boom.runs}"], capsys)
    assert code == 2
    assert f"{boom.name}.Boom ({ckpt}: hyper_parameters.optimizer.class_path)" in err
    assert not boom.marker.exists() and not boom.runs.exists()


def test_the_parser_allowlist_is_only_active_inside_the_cli():
    from jsonargparse import _common

    before = dict(_common.parsing_settings)
    with recipes.import_allowlist(enforced=True):
        assert _common.parsing_settings["import_path_verdicts"]["*"] is False
    assert _common.parsing_settings == before


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
