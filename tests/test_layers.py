"""The package's layers: every import (function-level ones included) points down or sideways, never up,
and no module imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "lit_memory"
# Bottom to top. A module may import its own layer and the layers below.
LAYERS = {
    "errors": 0,  # and the one writer every file goes through (files), the box, the bounded readers and the typed settings
    "measure": 1,  # memory accounting over plain torch objects: categories, tracker, records, report
    "runtime": 2,  # what trains: model, data, fused step, strategies, the monitor that measures
    "predict": 3,  # memory accounting that builds the configured model: setup, analytic model, simulation
    "config": 4,  # from argv to a checked run: trust, the shipped recipes, the resolver
    "tools": 5,  # estimate, plan, bench, peer, recipe commands, out-of-memory advice
    "entry": 6,  # python -m lit_memory
}
PREDICT = {
    "lit_memory.memory.step",
    "lit_memory.memory.analytic",
    "lit_memory.memory.simulate",
    "lit_memory.memory.predict",
    "lit_memory.memory.choose",
    "lit_memory.memory.recompute",
}
CONFIG = {"lit_memory.trust", "lit_memory.recipes", "lit_memory.cli"}


def layer(module: str) -> int:
    if module in ("lit_memory.errors", "lit_memory.files", "lit_memory.box", "lit_memory.bounds", "lit_memory.settings"):
        return LAYERS["errors"]
    if module in PREDICT:
        return LAYERS["predict"]
    if module.startswith("lit_memory.memory"):
        return LAYERS["measure"]
    if module.startswith("lit_memory.tools"):
        return LAYERS["tools"]
    if module in CONFIG:
        return LAYERS["config"]
    if module in ("lit_memory.__main__", "lit_memory"):
        return LAYERS["entry"]
    return LAYERS["runtime"]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every lit_memory module a file imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module`
    # The package root is left out: it imports nothing when imported (checked below), so `from
    # lit_memory import x` costs only x; its lazy exports name runtime classes.
    return {m for m in found if m.startswith("lit_memory.") and module_exists(m)}


def module_exists(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) - {module_name(p)} for p in PACKAGE.rglob("*.py")}


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{source} ({layer(source)}) -> {target} ({layer(target)})"
        for source, targets in graph().items()
        for target in targets
        if layer(target) > layer(source)
    ]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_package_root_imports_nothing_at_import_time():
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(not (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("lit_memory")) for n in top_level)


def test_no_import_cycles():
    edges = graph()
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for target in edges.get(node, ()):
            if target in path:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path + [target])
        done.add(node)

    done: set[str] = set()
    for start in sorted(edges):
        if start not in done:
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))
