"""The package's layers: every import (function-level ones included) points down or sideways, never up,
and no module imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

import lit_memory
from conftest import REPO

PACKAGE = REPO / "lit_memory"


def layer(module: str) -> int:
    """The package's own map (`lit_memory.LAYERS`); the package root's lazy exports are the entry's."""
    return len(lit_memory.LAYERS) - 1 if module == "lit_memory" else lit_memory.layer_of(module)


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


def test_the_package_imports_no_test_machinery():
    """A patch inside the package is `lit_memory.settings.patched`, not `unittest.mock`."""
    found = [
        str(path.relative_to(REPO))
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(name.split(".")[0] in ("unittest", "pytest") for name in
                ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]))
    ]
    assert not found, found


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


def test_every_module_is_placed_where_the_map_and_the_docstrings_say():
    """The map names real modules, each sub-package of memory/ says what it holds (its docstring names each of
    its modules), and the memory packages sit where their docstring says: two below the runtime, two above."""
    for _, names in lit_memory.LAYERS:
        for name in names:
            assert module_exists(name), name
    runtime = lit_memory.layer_of("lit_memory.model")
    for package in (PACKAGE / "memory").iterdir():
        if not (package / "__init__.py").is_file():
            continue
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
        for module in package.glob("*.py"):
            if module.stem != "__init__":
                assert f"`{module.stem}`" in doc, f"{package.name}/__init__ does not name {module.stem}"
        below = package.name in ("measure", "hardware")
        assert (layer(f"lit_memory.memory.{package.name}") < runtime) == below, package.name
