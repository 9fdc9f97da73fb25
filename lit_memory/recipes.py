"""Recipes as shared artefacts: find them by name, list/show/check them, write the one a run shares.

A recipe is one YAML file for `LightningCLI`. The shipped ones live in the repo's `recipes/`
and are installed with the package (``lit_memory/assets/recipes`` in the wheel), so
``--recipe NAME`` works from anywhere. Every fit writes its fully resolved settings back out as
``recipe.yaml`` in its run folder (`shared_recipe`): that file is what people share, and
``recipes check FILE`` is how a receiver inspects one (`lit_memory.trust` says what is refused).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from argparse import ArgumentError
from pathlib import Path
from typing import Any, Optional

import yaml

from lit_memory.errors import UserError
from lit_memory.trust import TRUST_FLAG

PACKAGED = Path(__file__).resolve().parent / "assets" / "recipes"  # where the wheel puts `recipes/`
CHECKOUT = Path(__file__).resolve().parents[1] / "recipes"  # a repo checkout or an editable install
BENCH_TABLE = "README.md"  # written into the recipes folder by the bench tool
SHARED_RECIPE = "recipe.yaml"  # written into every fit's run folder

# Settings that belong to one run on one machine: blanked in the shared recipe.
RUN_SPECIFIC = ("trainer.default_root_dir", "ckpt_path")



# -- the shipped recipes -----------------------------------------------------------------------


def recipes_dir() -> Path:
    for folder in (PACKAGED, CHECKOUT):
        if folder.is_dir():
            return folder
    raise UserError(f"no recipes folder found (looked in {PACKAGED} and {CHECKOUT}): reinstall lit-memory")


def names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The shipped recipe called `name` (``4gb`` or ``4gb.yaml``)."""
    path = recipes_dir() / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        raise UserError(f"unknown recipe {name!r}; choose one of: {', '.join(names())} (or --config FILE)")
    return path


def header(path: Path) -> dict[str, str]:
    """The ``# key: value`` lines at the top of a recipe (the first one is ``# <name>: description``)."""
    fields = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if match := re.match(r"# ([\w-]+): (.*)", line):
            fields[match[1]] = match[2].strip()
    return fields


def bench_table(text: str) -> dict[str, dict[str, str]]:
    """Rows of the first Markdown table that has a ``recipe`` column, by recipe name.

    The bench tool writes this table into ``recipes/README.md``. Cells are kept as written,
    keyed by their lower-cased column header; a recipe measured twice keeps its last row.
    """
    rows: dict[str, dict[str, str]] = {}
    columns: Optional[list[str]] = None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            if rows:
                break  # the table has ended
            columns = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if columns is None:
            columns = [c.lower() for c in cells] if "recipe" in (c.lower() for c in cells) else None
        elif not set("".join(cells)) <= set("-: "):  # not the |---|---| separator
            row = dict(zip(columns, cells))
            name = re.sub(r"^\[(.*)\]\(.*\)$", r"\1", row["recipe"]).strip("` ")  # 4gb, `4gb` or [4gb](4gb.yaml)
            rows[name] = row
    return rows


def _cell(row: dict[str, str], word: str) -> str:
    return next((value for column, value in row.items() if word in column and value), "-")


def tier_order() -> list[str]:
    """The shipped recipes, parents before their children: the tiers read top down."""
    folder = recipes_dir()
    return _tier_order({name: header(folder / f"{name}.yaml") for name in names()})


def list_recipes() -> None:
    folder = recipes_dir()
    table = folder / BENCH_TABLE
    measured = bench_table(table.read_text(encoding="utf-8")) if table.is_file() else {}
    headers = {name: header(folder / f"{name}.yaml") for name in names()}
    width = max(map(len, headers)) + 2
    print(f"{'recipe':{width}}{'parent':{width}}{'peak':>10}  {'samples/s':>9}  description")
    for name in tier_order():
        row, fields = measured.get(name, {}), headers[name]
        print(
            f"{name:{width}}{fields.get('parent', '-'):{width}}{_cell(row, 'peak'):>10}  "
            f"{_cell(row, 'samples/s'):>9}  {fields.get(name, '-')}"
        )
    print(f"\nrun one: python -m lit_memory fit --recipe NAME    read one: python -m lit_memory recipes show NAME")


def _tier_order(headers: dict[str, dict[str, str]]) -> list[str]:
    """Parents before their children (depth first, siblings by name): the tiers read top down."""
    children: dict[str, list[str]] = {}
    for name, fields in headers.items():
        parent = fields.get("parent", "none")
        children.setdefault(parent if parent in headers else "none", []).append(name)
    order: list[str] = []
    stack = sorted(children.get("none", []), reverse=True)
    while stack:
        order.append(name := stack.pop())
        stack += sorted(children.get(name, []), reverse=True)
    return order


# -- the shared recipe written into every fit's run folder ------------------------------------


def shared_recipe(config_yaml: str, command: str, machine: str, run_dir: Path) -> str:
    """The run's resolved settings, under a header saying what they are, what made them and where."""
    import lightning
    import torch
    import transformers

    import lit_memory

    versions = (
        f"lit_memory {lit_memory.__version__}, torch {torch.__version__}, "
        f"lightning {lightning.__version__}, transformers {transformers.__version__}"
    )
    lines = [
        f"# {SHARED_RECIPE}: the fully resolved settings of one lit_memory fit run, to share as one file.",
        f"# rerun: python -m lit_memory fit --config {SHARED_RECIPE}"
        f"   (inspect it first: python -m lit_memory recipes check {SHARED_RECIPE})",
        f"# command: {command}",
        f"# machine: {machine}",
        f"# versions: {versions}",
        f"# measured peak memory: {measured_peak(run_dir) or 'not measured (no memory.json in the run folder)'}",
        f"# blanked (they belong to the run, not the recipe): {', '.join(RUN_SPECIFIC)}",
    ]
    return "\n".join(lines) + "\n" + config_yaml


def measured_peak(run_dir: Path) -> Optional[str]:
    """The peak the run measured, from its ``memory.json`` (schema: docs/memory.md), or None.

    On CUDA the allocator's maxima (what decides whether a GPU fits); elsewhere the tensor tracker's peak.
    """
    try:
        record = json.loads((run_dir / "memory.json").read_text(encoding="utf-8"))
        cuda, tracked = record.get("cuda"), record["peak_bytes"]["measured"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    if cuda:
        return f"{gib(cuda['max_allocated_bytes'])} allocated, {gib(cuda['max_reserved_bytes'])} reserved (CUDA)"
    return f"{gib(tracked)} (tensor tracker, {record['device']['type']})" if tracked else None


def describe_machine(trainer: Any) -> str:
    """Nodes x devices (GPU name), OS and CPU cores; no host name, since the file is shared."""
    import os
    import platform

    import torch

    device = trainer.strategy.root_device
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    return (
        f"{trainer.num_nodes} node(s) x {trainer.num_devices} {device.type} device(s){gpu}; "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores"
    )


# -- python -m lit_memory recipes ---------------------------------------------------------------


def check(path: Path, trusted: bool) -> None:
    """Resolve a recipe exactly as ``fit --config FILE`` would (`lit_memory.cli.resolve`), build and
    run nothing, and report every refused import and value with its key, and every problem."""
    from lit_memory.cli import ImportRefused, resolve

    if not _is_file(path):
        raise UserError(f"recipe not found: {path}")
    tree = _load_yaml(path)
    refused: list[str] = []
    problems = [f"unknown keys: {', '.join(unknown)}"] if (unknown := _unknown_keys(tree, _fit_schema())) else []
    source, run = path, None
    with tempfile.TemporaryDirectory() as scratch:
        while run is None:
            try:
                run = resolve(["fit", "--config", str(source), *([TRUST_FLAG] if trusted else [])], collect=True)
            except ImportRefused as err:
                # jsonargparse stops at the first refusal: drop that key and parse again, to find them all.
                refused += [f"import {p}  ({k})" for p, k, _ in err.denied]
                if not all(_drop(tree, outer) for _, _, outer in err.denied):
                    break
                source = Path(scratch) / path.name
                source.write_text(yaml.safe_dump(tree), encoding="utf-8")
            except (ArgumentError, UserError) as err:
                problems.append(" ".join(str(err).split()))
                break
    if run is not None:
        refused += [f"{r.key}={r.value!r}  ({r.reason})" for r in run.refusals]
        problems += run.problems
        imports = [f"{k}: {v}" for k, v in _class_paths(run.settings.as_dict())]
        print(f"{path}: parsed as `fit --config {path}`; imports {', '.join(imports) or 'nothing'}")
    for line in refused:
        print(f"  REFUSED  {line}")
    for line in problems:
        print(f"  problem  {line}")
    if (refused and not trusted) or problems:
        verdict = [f"{len(refused)} refused"] if refused and not trusted else []
        verdict += [f"{len(problems)} problem(s)"] if problems else []
        hint = f"; pass {TRUST_FLAG} only if you trust its source" if refused and not trusted else ""
        raise UserError(f"{path}: {', '.join(verdict)}{hint}")
    print(f"ok: {path} parses against the `fit` schema" + ("" if refused else " and needs no " + TRUST_FLAG))


def _fit_schema() -> dict:
    """Every key `fit` accepts, with its default."""
    from lit_memory.cli import resolve

    cli = resolve(["fit"])
    return yaml.safe_load(cli.parser.dump(cli.config, skip_none=False))["fit"]


def _unknown_keys(tree: Any, schema: Any, key: str = "") -> list[str]:
    """Keys of `tree` that have no place in `schema` (the defaults). What sits inside a class
    spec (``class_path`` + ``init_args``), a dict or a list is left to the parser's type check."""
    if not isinstance(tree, dict) or not isinstance(schema, dict) or "class_path" in schema:
        return []
    unknown = []
    for k, value in tree.items():
        unknown += [_join(key, k)] if k not in schema else _unknown_keys(value, schema[k], _join(key, k))
    return unknown


def _class_paths(tree: Any, key: str = "") -> list[tuple[str, str]]:
    """(key, class path) of every class spec in a parsed config: what parsing imported."""
    if isinstance(tree, dict):
        found = [(key, tree["class_path"])] if isinstance(tree.get("class_path"), str) else []
        return found + [kv for k, v in tree.items() for kv in _class_paths(v, _join(key, k))]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in _class_paths(v, _join(key, i))]
    return []


def _drop(tree: dict, key: str) -> bool:
    """Remove a dotted key from a YAML tree; whether it was there."""
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.get(part) if isinstance(tree, dict) else None
    if isinstance(tree, dict) and last in tree:
        del tree[last]
        return True
    return False


def _join(key: str, part: Any) -> str:
    return f"{key}.{part}" if key else str(part)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a value too long or too odd to be a path
        return False


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from err


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_memory recipes", description="List, show and check recipes.")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("list", help="the shipped recipes (the default)")
    commands.add_parser("show", help="print a shipped recipe with its comments").add_argument("name")
    check_ = commands.add_parser("check", help="validate a recipe file without running it")
    check_.add_argument("file", type=Path)
    check_.add_argument(TRUST_FLAG, dest="trusted", action="store_true", help="parse it even if it names other code")
    args = parser.parse_args(argv)
    if args.command == "show":
        print(recipe_path(args.name).read_text(encoding="utf-8"), end="")
    elif args.command == "check":
        check(args.file, args.trusted)
    else:
        list_recipes()
