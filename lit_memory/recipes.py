"""Recipes as shared artefacts: find them by name, list/show/check them, refuse smuggled code.

A recipe is one YAML file for `LightningCLI`. The shipped ones live in the repo's `recipes/`
and are installed with the package (``lit_memory/assets/recipes`` in the wheel), so
``--recipe NAME`` works from anywhere. Every fit writes its fully resolved settings back out as
``recipe.yaml`` in its run folder (`shared_recipe`): that file is what people share.

Trust: jsonargparse imports every class path a config names while it parses (to build that
class's sub-parser), so a stranger's recipe could run code on import. `prepare_argv` scans the
raw YAML, the command line and a resumed checkpoint's hyperparameters *before* jsonargparse
sees them; `import_allowlist` makes jsonargparse itself refuse anything outside `ALLOWLIST`
while it parses, the backstop for places the scan cannot see.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from lit_memory.errors import UserError

PACKAGED = Path(__file__).resolve().parent / "assets" / "recipes"  # where the wheel puts `recipes/`
CHECKOUT = Path(__file__).resolve().parents[1] / "recipes"  # a repo checkout or an editable install
BENCH_TABLE = "README.md"  # written into the recipes folder by the bench tool
SHARED_RECIPE = "recipe.yaml"  # written into every fit's run folder

# Import paths a recipe may name without --trust-recipe: optimizers, schedulers, Lightning's own
# callbacks/loggers/strategies/plugins, this package and peft. Matched on module boundaries.
ALLOWLIST = (
    "torch.optim",
    "transformers.optimization",
    "transformers.Adafactor",
    "bitsandbytes.optim",
    "lightning",
    "lit_memory",
    "peft",
)
TRUST_FLAG = "--trust-recipe"
RECIPE_FLAG = "--recipe"
HELP = (
    f"{RECIPE_FLAG} NAME: use a shipped recipe, as --config <its file> at that place (list them: python -m "
    f"lit_memory recipes). Recipes naming code outside the allowlist ({', '.join(ALLOWLIST)}) are refused; "
    f"{TRUST_FLAG} lifts that, only for recipes from sources you trust."
)
# Settings that belong to one run on one machine: blanked in the shared recipe.
RUN_SPECIFIC = ("trainer.default_root_dir", "ckpt_path")

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_CONFIG_SUFFIXES = (".yaml", ".yml")


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
    print(f"\nrun one: python -m lit_memory fit {RECIPE_FLAG} NAME    read one: python -m lit_memory recipes show NAME")


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


# -- command line: --recipe NAME and --trust-recipe -------------------------------------------


def prepare_argv(argv: list[str]) -> tuple[list[str], bool]:
    """Expand ``--recipe NAME`` into ``--config <path>`` where it stands (so it layers with the
    other ``--config`` files and overrides in order), take out ``--trust-recipe``, and refuse
    untrusted code before jsonargparse sees any of it. Returns LightningCLI's argv and the trust."""
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
        elif token != TRUST_FLAG:
            out.append(token)
    trusted = TRUST_FLAG in argv
    if not trusted:
        refuse_untrusted(references_in_argv(out))
    return out, trusted


# -- trust: every import path a recipe names --------------------------------------------------


@dataclass(frozen=True)
class Reference:
    path: str  # a dotted import path, e.g. torch.optim.AdamW
    source: str  # the file, checkpoint or "command line" that names it
    key: str  # where in it, e.g. model.optimizer.class_path

    @functools.cached_property
    def allowed(self) -> bool:
        return _listed(self.path) and not _defined_outside(self.path)

    def __str__(self) -> str:
        return f"{self.path} ({self.source}: {self.key})" if self.key else f"{self.path} ({self.source})"


def refuse_untrusted(refs: list[Reference]) -> None:
    refused = [ref for ref in refs if not ref.allowed]
    if refused:
        raise UserError(
            f"refusing to import code outside the recipe allowlist: {', '.join(map(str, refused))}. "
            f"Allowed: {', '.join(ALLOWLIST)}. Inspect it with `python -m lit_memory recipes check FILE`; "
            f"pass {TRUST_FLAG} only if you trust its source"
        )


def references_in_argv(argv: list[str]) -> list[Reference]:
    """Every import path a command line names: in its values, in the config files it loads, in
    the config files those name, and in the hyperparameters of a checkpoint it resumes from."""
    refs: list[Reference] = []
    seen: set[Path] = set()
    flag = ""
    for token in argv:
        if token.startswith("-"):
            flag, eq, value = token.partition("=")
            if not eq and flag.startswith("-c") and not flag.startswith("--") and len(flag) > 2:
                flag, value = "-c", flag[2:]  # -cFILE
            elif not eq:
                continue  # its value is the next token
        else:
            value = token
        if not _is_config_flag(flag):  # jsonargparse reads every value as YAML
            tree = _load_yaml(value, flag, strict=False)
            refs += references_in_tree(tree, "command line", flag.lstrip("-"), Path.cwd(), seen)
        elif _is_file(Path(value)):
            refs += references_in_file(Path(value), seen)
        else:  # --config also takes the config itself, as a YAML string
            refs += references_in_tree(_load_yaml(value, flag), "command line", "", Path.cwd(), seen)
    return refs


def references_in_file(path: Path, seen: Optional[set[Path]] = None) -> list[Reference]:
    seen = set() if seen is None else seen
    if path.resolve() in seen:
        return []
    seen.add(path.resolve())
    tree = _load_yaml(path.read_text(encoding="utf-8"), str(path))
    return references_in_tree(tree, str(path), "", path.parent, seen)


def references_in_checkpoint(path: Path) -> list[Reference]:
    """LightningCLI parses a resumed checkpoint's hyperparameters as config, class paths included."""
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:
        reason = (str(err).strip() or type(err).__name__).splitlines()[0]
        raise UserError(f"cannot load checkpoint {path} with weights_only=True: {reason}") from err
    tree = {k: checkpoint.get(k) for k in ("hyper_parameters", "datamodule_hyper_parameters")}
    return references_in_tree(tree, str(path), "", path.parent)


def references_in_tree(
    tree: Any, source: str, key: str = "", base: Path = Path(), seen: Optional[set[Path]] = None
) -> list[Reference]:
    """Import paths hide in ``class_path`` values (at any depth: ``init_args`` of optimizers,
    callbacks, loggers, plugins, strategies) and in plain strings given to class- or
    callable-typed keys (``optimizer: os.system``). Config files and checkpoints named as
    values are read too."""
    seen = set() if seen is None else seen
    if isinstance(tree, dict):
        return [r for k, v in tree.items() for r in references_in_tree(v, source, _join(key, k), base, seen)]
    if isinstance(tree, list):
        return [r for i, v in enumerate(tree) for r in references_in_tree(v, source, _join(key, i), base, seen)]
    if not isinstance(tree, str):
        return []
    last = key.rsplit(".", 1)[-1]
    if last == "ckpt_path" and _is_file(base / tree):
        return references_in_checkpoint(base / tree)
    if tree.endswith(_CONFIG_SUFFIXES) and _is_file(base / tree):  # a nested config file
        return references_in_file(base / tree, seen)
    if last != "class_path" and (_is_file(base / tree) or _is_file(Path(tree))):
        return []  # a data file such as train.csv, even beside a train.py
    if _DOTTED.fullmatch(tree) and (last == "class_path" or _importable(tree)):
        return [Reference(tree, source, key)]
    return []


def _listed(path: str) -> bool:
    return any(path == entry or path.startswith(entry + ".") for entry in ALLOWLIST)


def _defined_outside(path: str) -> bool:
    """Whether an allowlisted path names code defined elsewhere, as ``lightning.pytorch.cli.os.system``
    (that is ``os.system``) does. Resolved the way the parser resolves it, which imports only
    allowlisted modules; a path that does not resolve is left to the parser to report."""
    from jsonargparse import _util  # private: the parser's own resolver

    with import_allowlist(enforced=True):
        try:
            obj = _util.import_object(path)
        except ImportError as err:  # jsonargparse's ImportDenied: defined outside the allowlist
            return type(err).__name__ == "ImportDenied"
        except (AttributeError, ValueError):
            return False
    return not _listed(obj.__name__ if inspect.ismodule(obj) else str(getattr(obj, "__module__", "")))


def _join(key: str, part: Any) -> str:
    return f"{key}.{part}" if key else str(part)


def _importable(dotted: str) -> bool:
    # find_spec of a top-level name only searches sys.path: it imports (runs) nothing.
    try:
        return importlib.util.find_spec(dotted.split(".", 1)[0]) is not None
    except (ImportError, ValueError):
        return True


def _is_config_flag(flag: str) -> bool:
    # argparse accepts unambiguous prefixes: --conf is --config
    return flag == "-c" or (flag.startswith("--co") and "--config".startswith(flag))


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a value too long or too odd to be a path
        return False


def _load_yaml(text: str, where: str, strict: bool = True) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        if strict:
            raise UserError(f"{where} is not valid YAML: {str(err).splitlines()[0]}") from err
        return text  # jsonargparse keeps a value that is not YAML as a string


@contextlib.contextmanager
def import_allowlist(enforced: bool) -> Iterator[None]:
    """While active, jsonargparse refuses to import any value's path outside `ALLOWLIST`.

    jsonargparse checks each import path before importing it, and again where the imported
    object is really defined, so ``lightning.pytorch.cli.os.system`` is refused too. Releases
    before this setting existed have no such check: the scan in `prepare_argv` then stands alone.
    """
    import jsonargparse
    from jsonargparse import _common  # private: set_parsing_settings cannot undo its own changes

    keys = ("import_path_verdicts", "import_paths_enforced")
    if not enforced or not all(k in _common.parsing_settings for k in keys):
        yield
        return
    saved = {k: _common.parsing_settings[k] for k in keys}
    jsonargparse.set_parsing_settings(import_path_denylist=["*"], import_path_allowlist=list(ALLOWLIST))
    try:
        yield
    finally:
        _common.parsing_settings.update(saved)


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
    """Validate a recipe against the CLI's ``fit`` schema without running anything."""
    if not _is_file(path):
        raise UserError(f"recipe not found: {path}")
    refs = references_in_file(path)
    print(f"import paths named by {path}:" if refs else f"{path} names no import paths")
    for ref in refs:
        where = ref.key if ref.source == str(path) else f"{ref.source}: {ref.key}"
        print(f"  {'allowed' if ref.allowed else 'REFUSED':8} {ref.path}  ({where})")
    refused = [ref for ref in refs if not ref.allowed]
    if refused and not trusted:
        raise UserError(
            f"{path}: {len(refused)} import path(s) outside the allowlist ({', '.join(ALLOWLIST)}); not parsed, "
            f"since parsing imports them. Pass {TRUST_FLAG} to parse it anyway, only if you trust its source"
        )
    problems = []
    if unknown := _unknown_keys(_load_yaml(path.read_text(encoding="utf-8"), str(path)), _fit_schema()):
        problems.append(f"unknown keys: {', '.join(unknown)}")
    code, output = _print_config(["--config", str(path)], trusted)
    if code:
        problems.append(" ".join(output.split("error: ", 1)[-1].split()))
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems))
    print(f"ok: {path} parses against the `fit` schema")


def _print_config(args: list[str], trusted: bool) -> tuple[int, str]:
    """Parse as ``fit ARGS --print_config`` does: LightningCLI validates, prints the config, exits.
    Returns the exit status and the printed config (or the parser's error)."""
    from lit_memory.cli import LitMemoryCLI

    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            LitMemoryCLI(args=["fit", *args, "--print_config", *([TRUST_FLAG] if trusted else [])])
    except SystemExit as exit_:  # --print_config always exits
        code = exit_.code or 0
    return code, (err if code else out).getvalue()


def _fit_schema() -> dict:
    """Every key `fit` accepts, with its default."""
    return yaml.safe_load(_print_config([], trusted=False)[1])


def _unknown_keys(tree: Any, schema: Any, key: str = "") -> list[str]:
    """Keys of `tree` that have no place in `schema` (the defaults). What sits inside a class
    spec (``class_path`` + ``init_args``), a dict or a list is left to the parser's type check."""
    if not isinstance(tree, dict) or not isinstance(schema, dict) or "class_path" in schema:
        return []
    unknown = []
    for k, value in tree.items():
        unknown += [_join(key, k)] if k not in schema else _unknown_keys(value, schema[k], _join(key, k))
    return unknown


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
