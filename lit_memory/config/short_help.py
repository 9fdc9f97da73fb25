"""``COMMAND --help`` for ``fit``, ``validate``, ``test`` and ``predict``: the options a user of this project sets first
(the recipe, the data, the model and its task, memory, how long), each with the first sentence of its help, and where
every option is (``COMMAND --help all``: the full parser's help, Lightning's Trainer included, some 850 lines).

The short help needs no torch: each option's help is read, as jsonargparse reads it for the full parser, from the
docstring of the class or method that defines it (`option_names.GROUPS`), in its source, with docstring_parser, so it
prints within a second. The full parser's help opens with the same lines, from its own actions (`section`);
tests/config/test_short_help.py compares the two.
"""

from __future__ import annotations

import ast
import functools
from typing import Optional

from lit_memory.config import option_names, shipped

# What a user of this project sets first, at the top of ``COMMAND --help`` (every option follows with ``--help all``):
# the recipe, the data, the model and its task, memory, how long; then the command's own.
FIRST_OPTIONS = (
    "--config", "--data.source", "--data.text_column", "--data.label_column", "--model.model_name_or_path",
    "--model.problem_type", "--model.num_labels", "--model.threshold", "--memory.budget", "--memory.tier",
    "--data.batch_size", "--data.max_length", "--trainer.max_epochs", "--ckpt_path",
)
COMMAND_FIRST_OPTIONS = {"predict": ("--data.predict_path", "--output", "--predictions.format")}
ALL = "all"  # ``COMMAND --help all``: every option
RECIPE_ROW = (shipped.RECIPE_FLAG + " NAME", "a shipped recipe, as --config <its file> (python -m lit_memory recipes)")
TRUST_ROW = (shipped.TRUST_FLAG,
             "run a recipe, config or checkpoint someone sent as it says (only from a source you trust)")
# Where the options that are no class's parameter are defined, with their help: LightningCLI's ``--config``, the
# commands' own (`lit_memory.config.arguments.add_command_arguments`).
ARGUMENT_SOURCES = {"--config": "lightning.pytorch.cli", "--output": "lit_memory.config.arguments"}


def wanted(command: str) -> list[str]:
    return [*FIRST_OPTIONS, *COMMAND_FIRST_OPTIONS.get(command, ())]


def section(command: str, helps: dict[str, str], heading: str) -> list[str]:
    """The lines that open a command's help: its usage and the options set first, with the first sentence of each
    one's help in ``helps`` (an option without one is left out)."""
    rows = [RECIPE_ROW, *((key, first_sentence(helps[key])) for key in wanted(command) if key in helps), TRUST_ROW]
    width = max(len(key) for key, _ in rows) + 2
    return [f"usage: python -m lit_memory {command} [options]", "", heading,
            *(f"  {key:<{width}}{text}" for key, text in rows)]


def short_help(command: str) -> str:
    """``COMMAND --help``: the options set first, and where the rest are."""
    groups = {**option_names.GROUPS, **option_names.COMMAND_GROUPS.get(command, {})}
    return "\n".join([
        *section(command, read_helps(command), "the options you set first:"), "",
        "every setting of a run is an option: " + ", ".join(f"--{group}.KEY" for group in groups),
        f"every option, with its type, default and help (Lightning's Trainer's too): python -m lit_memory {command} "
        f"--help {ALL}", "",
        shipped.recipe_help(),
    ])


def first_sentence(text: str) -> str:
    """The first sentence of an option's help, on one line, without its reST quotes."""
    text = " ".join(text.replace("``", "").split())
    end = text.find(". ")
    return text[: end + 1] if end > 0 else text


def read_helps(command: str) -> dict[str, str]:
    """The help of each option in `wanted`, as the full parser has it, read from the sources without importing them."""
    groups = {**option_names.GROUPS, **option_names.COMMAND_GROUPS.get(command, {})}
    found = {}
    for option in wanted(command):
        key = option[2:]
        group, _, name = key.partition(".")
        if option in ARGUMENT_SOURCES:
            text = _argument_help(ARGUMENT_SOURCES[option], option)
        elif not name:  # the command's own: an argument of the Trainer method it calls
            text = _parameter_docs("lightning.pytorch.trainer.trainer", "Trainer", command).get(key)
        elif group in groups:
            text = _parameter_docs(*groups[group]).get(name)
        else:
            text = None
        if text:
            found[option] = text
    return found


@functools.lru_cache(maxsize=None)
def _parameter_docs(module: str, cls: str, method: Optional[str]) -> dict[str, str]:
    """Each parameter's description in the docstrings of ``cls.method`` (None: a dataclass's fields) as jsonargparse
    reads them (docstring_parser): the method's, then the class's, which wins."""
    found = _class_node(module, cls)
    if found is None:
        return {}
    nodes = [found]
    if method is not None:
        function = next((n for n in found.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
        nodes = [function] if method != "__init__" else [function, found]  # a method's own docstring alone
    import docstring_parser  # deferred: only a help reads docstrings

    docs: dict[str, str] = {}
    for node in nodes:
        text = ast.get_docstring(node, clean=False) if node is not None else None
        if not text:
            continue
        try:
            parsed = docstring_parser.parse(text)
        except docstring_parser.ParseError:
            continue
        docs.update({p.arg_name: p.description for p in parsed.params if p.description})
    return docs


def _class_node(module: str, cls: str) -> Optional[ast.ClassDef]:
    path = option_names.source_of(module)
    if path is None:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)


def _argument_help(module: str, option: str) -> Optional[str]:
    """The help an ``add_argument(option, ...)`` call in ``module``'s source gives (LightningCLI's ``--config``,
    predict's ``--output`` in `lit_memory.config.arguments`)."""
    path = option_names.source_of(module)
    if path is None:
        return None
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        if option in [a.value for a in node.args if isinstance(a, ast.Constant)]:
            helps = [k.value.value for k in node.keywords if k.arg == "help" and isinstance(k.value, ast.Constant)]
            return helps[0] if helps else None
    return None
