"""The package's layers: every import (function-level ones included) points down or sideways, never up,
and no module imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

import lit_memory

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


def unit(module: str) -> str:
    """The top-level folder or module of the package that holds a module: ``lit_memory.<first name>``."""
    return ".".join(module.split(".")[:2])


def test_no_import_loop_between_top_level_folders_and_modules():
    """The folders are the layers: no top-level folder or module imports itself back through others (a module
    loop inside one folder would show in `test_no_import_cycles`; here two folders reaching into each other do)."""
    units: dict[str, set[str]] = {}
    for source, targets in graph().items():
        if source != "lit_memory":
            units.setdefault(unit(source), set()).update(unit(t) for t in targets if unit(t) != unit(source))
    loops = []

    def visit(node: str, path: list[str]) -> None:
        for target in units.get(node, ()):
            if target in path:
                loops.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in done:
                visit(target, path + [target])
        done.add(node)

    done: set[str] = set()
    for start in sorted(units):
        if start not in done:
            visit(start, [start])
    assert not loops, "top-level import loops:\n" + "\n".join(sorted(set(loops)))
    assert len(units) > 10  # the graph was built: the package has that many top-level folders and modules


def test_the_top_of_the_package_is_short():
    """Modules live in the folder of their layer; the top keeps the entry points, the base and the runtime's classes
    that recipes name by path (`lit_memory.model`, `lit_memory.data`, `lit_memory.strategies`, `lit_memory.fabric`)."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 16, top


def test_every_module_is_placed_where_the_map_and_the_docstrings_say():
    """The map names real modules; each package of memory accounting says what it holds (its docstring names each
    of its modules and sub-packages), memory/ sits below the runtime and planning/ above it."""
    for _, names in lit_memory.LAYERS:
        for name in names:
            assert module_exists(name), name
    runtime = lit_memory.layer_of("lit_memory.model")
    for root, below in (("memory", True), ("planning", False)):
        for init in (PACKAGE / root).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
            held = [p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"]
            held += [p.parent.name for p in init.parent.glob("*/__init__.py")]
            for name in held:
                assert f"`{name}`" in doc, f"{init.relative_to(PACKAGE)} does not name {name}"
            assert (layer(module_name(init)) < runtime) == below, module_name(init)
