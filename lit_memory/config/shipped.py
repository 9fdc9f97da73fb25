"""The shipped recipes as files, and the two flags about recipes: found, listed and read without importing torch,
Lightning or transformers, so that ``python -m lit_memory --help``, ``recipes list`` and a wrong recipe name answer
in a second.

The recipes live in the repo's ``recipes/`` and are installed with the package (``lit_memory/assets/recipes`` in the
wheel), so ``--recipe NAME`` works from anywhere (`expand_recipes`). `lit_memory.config.shared_recipe` holds the
recipe every run shares, and the settings the memory advice lays over a run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

from lit_memory.errors import UserError
from lit_memory.memory.measure import records
from lit_memory.memory.measure.footprint import format_bytes
from lit_memory.sandbox import TRUST_FLAG

PACKAGED = Path(__file__).resolve().parents[1] / "assets" / "recipes"  # where the wheel puts `recipes/`
CHECKOUT = Path(__file__).resolve().parents[2] / "recipes"  # a repo checkout or an editable install
# The model and launch configs a recipe is layered with (``--config configs/fsdp.yaml``), installed beside the recipes.
PACKAGED_CONFIGS = PACKAGED.parent / "configs"
CHECKOUT_CONFIGS = CHECKOUT.parent / "configs"
MEASURED = records.BENCH_JSON  # the latest bench run's rows, beside the recipes (bench --update-readme)
RECIPE_FLAG = "--recipe"


def recipes_dir() -> Path:
    for folder in (PACKAGED, CHECKOUT):
        if folder.is_dir():
            return folder
    raise UserError(f"no recipes folder found (looked in {PACKAGED} and {CHECKOUT}): reinstall lit-memory")


def configs_dir() -> Optional[Path]:
    """The shipped configs (``configs/``): installed with the package, or the checkout's; None where neither is."""
    return next((folder for folder in (PACKAGED_CONFIGS, CHECKOUT_CONFIGS) if folder.is_dir()), None)


def names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The shipped recipe called `name` (``4gb`` or ``4gb.yaml``)."""
    path = recipes_dir() / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        raise UserError(f"unknown recipe {name!r}; choose one of: {', '.join(names())} (or --config FILE)")
    return path


def expand_recipes(argv: list[str]) -> list[str]:
    """``--recipe NAME`` becomes ``--config <its file>`` where it stands, so it layers with the other
    ``--config`` files and overrides in order (later sources win)."""
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == RECIPE_FLAG:
            name = next(tokens, None)
            if name is None:
                raise UserError(f"{RECIPE_FLAG} needs a recipe name; choose one of: {', '.join(names())}")
            out += ["--config", str(recipe_path(name))]
        elif token.startswith(RECIPE_FLAG + "="):
            out += ["--config", str(recipe_path(token.split("=", 1)[1]))]
        else:
            out.append(token)
    return out


def header(path: Path) -> dict[str, str]:
    """The ``# key: value`` lines at the top of a recipe (the first one is ``# <name>: description``)."""
    fields = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if match := re.match(r"# ([\w-]+): (.*)", line):
            fields[match[1]] = match[2].strip()
    return fields


def tier_order() -> list[str]:
    """The shipped recipes, parents before their children: the tiers read top down."""
    folder = recipes_dir()
    return _tier_order({name: header(folder / f"{name}.yaml") for name in names()})


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


def listing() -> str:
    """Every shipped recipe, parents before children, with the latest bench run's numbers (``bench.json`` beside the
    recipes, written by ``bench --update-readme``) where it measured them."""
    folder = recipes_dir()
    measured = records.read_bench(folder / MEASURED)
    headers = {name: header(folder / f"{name}.yaml") for name in names()}
    width = max(map(len, headers)) + 2
    lines = [f"{'recipe':{width}}{'parent':{width}}{'peak':>10}  {'samples/s':>9}  description"]
    for name in tier_order():
        row, fields = measured.get(name, {}), headers[name]
        peak = format_bytes(row["peak_measured_bytes"]) if row.get("peak_measured_bytes") else "-"
        speed = f"{row['samples_per_s']:.1f}" if row.get("samples_per_s") else "-"
        lines.append(
            f"{name:{width}}{fields.get('parent', '-'):{width}}{peak:>10}  {speed:>9}  {fields.get(name, '-')}"
        )
    lines.append(
        "\nrun one: python -m lit_memory fit --recipe NAME    read one: python -m lit_memory recipes show NAME"
    )
    return "\n".join(lines)


def recipe_help(allowlist: Optional[Sequence[str]] = None) -> str:
    """What ``--recipe`` and ``--trust-recipe`` do, for the helps: the packages a recipe may import named where the
    caller has them (`lit_memory.config.trust.ALLOWLIST`; the top-level help does not import what it is built from)."""
    allowed = f" ({', '.join(allowlist)})" if allowlist else ""
    return (
        f"{RECIPE_FLAG} NAME: use a shipped recipe, as --config <its file> at that place (list them: python -m "
        f"lit_memory recipes). Recipes naming code outside the allowlist{allowed}, or values that run code "
        f"(trust_remote_code, weights_only false, remote or pickled checkpoints), are refused; {TRUST_FLAG} lifts "
        "that, only for recipes from sources you trust."
    )
