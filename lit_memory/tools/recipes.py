"""``python -m lit_memory recipes``: list the shipped recipes, show one, check a recipe someone sent."""

from __future__ import annotations

import argparse
import tempfile
from argparse import ArgumentError
from pathlib import Path
from typing import Any

import yaml

from lit_memory.cli import ImportRefused, resolve
from lit_memory.errors import UserError
from lit_memory.memory import records
from lit_memory.memory.footprint import format_bytes
from lit_memory.recipes import MEASURED, header, names, recipe_path, recipes_dir, tier_order
from lit_memory.trust import TRUST_FLAG


def list_recipes() -> None:
    """Every shipped recipe, parents before children, with the latest bench run's numbers (``bench.json``
    beside the recipes, written by ``bench --update-readme``) where it measured them."""
    folder = recipes_dir()
    measured = records.read_bench(folder / MEASURED)
    headers = {name: header(folder / f"{name}.yaml") for name in names()}
    width = max(map(len, headers)) + 2
    print(f"{'recipe':{width}}{'parent':{width}}{'peak':>10}  {'samples/s':>9}  description")
    for name in tier_order():
        row, fields = measured.get(name, {}), headers[name]
        peak = format_bytes(row["peak_measured_bytes"]) if row.get("peak_measured_bytes") else "-"
        speed = f"{row['samples_per_s']:.1f}" if row.get("samples_per_s") else "-"
        print(f"{name:{width}}{fields.get('parent', '-'):{width}}{peak:>10}  {speed:>9}  {fields.get(name, '-')}")
    print("\nrun one: python -m lit_memory fit --recipe NAME    read one: python -m lit_memory recipes show NAME")


# -- the predicted line of every shipped recipe's header ------------------------------------------------

PREDICTED = "# predicted: "
HEADER_MODEL = "configs/bert-large.yaml"


def predicted_line(path: Path) -> str:
    """The header line a shipped recipe states its predicted memory in: BERT-large (``configs/bert-large.yaml``)
    with the recipe's own batch and length, analytic, at three levels, for the documented default GPU."""
    from lit_memory.memory.analytic import analytic
    from lit_memory.memory.device import Target
    from lit_memory.memory.step import Step

    # configs/bert-large.yaml's two settings (the configs folder is not installed with the package)
    model = ["--model.model_name_or_path=bundled:bert-large", "--model.pretrained=false"]
    run = resolve(["fit", "--config", str(path), *model, "--cpu_bf16_fallback=false"])
    step = Step.from_settings(run.settings.as_dict(), Target())
    footprint = analytic(step).footprint
    return (
        f"{PREDICTED}BERT-large {step.batch_size} x {step.max_length}"
        + (f" x {step.accumulate_grad_batches} accumulated" if step.accumulate_grad_batches > 1 else "")
        + f" ({HEADER_MODEL}) on {step.target.gpu.name}: "
        f"tensors {format_bytes(footprint.peak)}, reserved {format_bytes(footprint.reserved)}, device "
        f"{format_bytes(footprint.device)} (python -m lit_memory recipes headers)"
    )


def with_predicted_line(text: str, line: str) -> str:
    """``text`` with its header's predicted line replaced by ``line`` (added after ``# shrinks:`` if missing)."""
    lines = text.splitlines()
    header_end = next((i for i, l in enumerate(lines) if not l.startswith("#")), len(lines))
    found = [i for i in range(header_end) if lines[i].startswith(PREDICTED)]
    if found:
        lines[found[0]] = line
    else:
        after = next((i for i in range(header_end) if lines[i].startswith("# shrinks:")), header_end - 1)
        lines.insert(after + 1, line)
    return "\n".join(lines) + "\n"


def headers(check: bool) -> None:
    """Write (or with ``check``, compare) each shipped recipe's predicted line."""
    folder = recipes_dir()
    stale = []
    for name in names():
        path = folder / f"{name}.yaml"
        text = path.read_text(encoding="utf-8")
        updated = with_predicted_line(text, predicted_line(path))
        print(f"{name}: {updated.splitlines()[[l.startswith(PREDICTED) for l in updated.splitlines()].index(True)][len(PREDICTED):]}")
        if updated != text:
            stale.append(name)
            if not check:
                path.write_text(updated, encoding="utf-8")
    if check and stale:
        raise UserError(f"recipe headers out of date: {', '.join(stale)} (run: python -m lit_memory recipes headers)")


def check(path: Path, trusted: bool) -> None:
    """Resolve a recipe exactly as ``fit --config FILE`` would (`lit_memory.cli.resolve`), build and
    run nothing, and report every refused import and value with its key, and every problem."""
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
    headers_ = commands.add_parser("headers", help="write each shipped recipe's predicted memory into its header")
    headers_.add_argument("--check", action="store_true", help="only compare, and fail on a stale header")
    args = parser.parse_args(argv)
    if args.command == "show":
        print(recipe_path(args.name).read_text(encoding="utf-8"), end="")
    elif args.command == "check":
        check(args.file, args.trusted)
    elif args.command == "headers":
        headers(args.check)
    else:
        list_recipes()
