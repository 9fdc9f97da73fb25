"""The options ``fit``, ``validate``, ``test`` and ``predict`` take, read from the sources of the classes they configure
without importing them: a mistyped option is one error line within a second, where the full parse (LightningCLI over
the module, the data module and Lightning's Trainer) first imports Lightning, torch and transformers.

Only the first two levels are read (``--data.source``, ``--trainer.max_epochs``); what lies deeper (a class spec's
``init_args``, a dict's keys) and the option values are the full parse's to check. argparse takes an unambiguous
prefix of an option (``--data.sour``), so a prefix counts as known here too. tests/config/test_option_names.py compares
these names with the real parser's.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from pathlib import Path
from typing import Optional

from lit_memory.errors import UserError

# The command line's groups and where the parameters they take are defined: (module, class, method); a method of
# None reads a dataclass's fields.
GROUPS = {
    "trainer": ("lightning.pytorch.trainer.trainer", "Trainer", "__init__"),
    "model": ("lit_memory.model", "SequenceClassifier", "__init__"),
    "data": ("lit_memory.data", "TextClassificationData", "__init__"),
    "memory": ("lit_memory.memory.settings", "MemorySettings", None),
    "progress": ("lit_memory.console", "LogProgress", "__init__"),
    "early_stopping": ("lit_memory.run.best", "EarlyStop", "__init__"),
}
COMMAND_GROUPS = {"predict": {"predictions": ("lit_memory.run.predict_file", "PredictionWriter", "__init__")}}
COMMAND_OPTIONS = {"predict": ("output",)}  # a command's own top-level options (`lit_memory.config.arguments`)
# Every command's own options: jsonargparse's and LightningCLI's, and `lit_memory.cli.LitMemoryCLI`'s.
COMMON = ("config", "c", "print_config", "help", "h", "seed_everything", "cpu_bf16_fallback")
# The Trainer method a command calls: its parameters are options too, but for what LightningCLI passes itself.
PASSED = ("self", "model", "train_dataloaders", "val_dataloaders", "dataloaders", "datamodule")


def source_of(module: str) -> Optional[Path]:
    """A module's source file, found without importing it (only its top package is looked up)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=None)
def parameters(module: str, cls: str, method: Optional[str]) -> tuple[str, ...]:
    """The parameter names of ``cls.method`` (or a dataclass's fields) as its source states them."""
    path = source_of(module)
    if path is None:
        return ()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if found is None:
        return ()
    if method is None:
        return tuple(n.target.id for n in found.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    function = next((n for n in found.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
    if function is None:
        return ()
    args = function.args
    return tuple(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg not in PASSED)


def options(command: str) -> dict[str, tuple[str, ...]]:
    """A command's options by level: ``""`` holds the top level's names, each group its parameters."""
    groups = {**GROUPS, **COMMAND_GROUPS.get(command, {})}
    top = (*COMMON, *COMMAND_OPTIONS.get(command, ()), *groups,
           *parameters("lightning.pytorch.trainer.trainer", "Trainer", command))
    return {"": top, **{name: parameters(*where) for name, where in groups.items()}}


def check(command: str, argv: list[str]) -> None:
    """Refuse, with one line, an option ``command`` does not take (``argv``: its arguments, ``--recipe`` expanded)."""
    known = options(command)
    if not all(known.values()):  # a source not found (an unusual install): the full parse judges
        return
    for token in argv:
        if not token.startswith("--") or token == "--":
            continue
        key = token[2:].split("=", 1)[0].removesuffix("+")  # --trainer.callbacks+=X appends
        group, _, rest = key.partition(".")
        name = rest.split(".", 1)[0]
        if not rest:
            ok = _known(group, known[""])
        elif group in known and group:
            ok = name == "help" or (_known(name, known[group]) if "." not in rest else name in known[group])
        else:
            ok = False
        if not ok:
            everything = [f"--{n}" for n in known[""] if len(n) > 1] + [
                f"--{g}.{n}" for g, names in known.items() if g for n in names
            ]
            close = difflib.get_close_matches(f"--{key}", everything, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(
                f"unknown option --{key} for {command}{hint}; every option: python -m lit_memory {command} --help all"
            )


def _known(name: str, names: tuple[str, ...]) -> bool:
    return name in names or any(n.startswith(name) for n in names)


def typed_keys(command: str, argv: list[str]) -> list[str]:
    """The dotted settings the options in ``argv`` set, an abbreviated group parameter written out
    (``--model.warmup_r 0.1``: ``model.warmup_ratio``; ``--trainer.callbacks+=X``: ``trainer.callbacks``), in order; a
    whole group given as a mapping (``--model '{"threshold": 0.3}'``) sets each of its leaves (``model.threshold``).
    Files (``--config``, a group given as a file) and options that name no setting (``--print_config``) are not among
    them."""
    known = options(command)
    found: list[str] = []
    for i, token in enumerate(argv):
        if not token.startswith("--") or token == "--":
            continue
        key, eq, value = token[2:].partition("=")
        key = key.removesuffix("+")
        group, _, rest = key.partition(".")
        if not rest:
            if group in ("config", "print_config", "help"):
                continue  # a file or a printing switch: no one setting
            if group in known:  # a whole group: a file (not typed), or a mapping typed inline
                if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    value = argv[i + 1]
                found += [f"{group}.{leaf}" for leaf in _mapping_leaves(value)]
                continue
            found.append(_written_out(group, known[""]))
            continue
        name, _, deeper = rest.partition(".")
        name = _written_out(name, known.get(group, ()))
        found.append(".".join(part for part in (group, name, deeper) if part))
    return list(dict.fromkeys(found))


def _mapping_leaves(value: str) -> list[str]:
    """The dotted leaves of a group's value typed inline as a YAML/JSON mapping; none for a file or anything else."""
    try:
        if not value or Path(value).expanduser().exists():
            return []
    except (OSError, ValueError):  # too long or too odd to be a path
        pass
    import yaml  # deferred: only a command that runs asks

    try:
        tree = yaml.safe_load(value)
    except yaml.YAMLError:
        return []

    def walk(node: object, prefix: str) -> list[str]:
        if isinstance(node, dict) and node:
            return [leaf for k, v in node.items() for leaf in walk(v, f"{prefix}.{k}" if prefix else str(k))]
        return [prefix] if prefix else []

    return walk(tree, "")


def _written_out(name: str, names: tuple[str, ...]) -> str:
    """``name`` as the one parameter it abbreviates, else as it is."""
    if name in names:
        return name
    matches = [n for n in names if n.startswith(name)]
    return matches[0] if len(matches) == 1 else name
