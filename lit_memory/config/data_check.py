"""The data files a command names, checked before torch, Lightning and transformers are imported: a mistyped path,
an empty file, a file in another encoding or a column its header does not have is one ``error:`` line within a
second, where the full run would give the same line only after importing them (tens of seconds on a small CPU).

The checks are the data module's own (`lit_memory.hf.data_file`), on the ``data:`` settings the command line gives:
its ``--data.KEY`` options, in order with the ``--config`` files it names (a file a sent config names is read here
only where its confined run would read it). Whatever this cannot read as the full parse would (a ``data:`` block
given whole, a value it does not take as written, a split named, a JSON file's columns) is left to the full run,
which checks everything again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from lit_memory.config import option_names, shipped
from lit_memory.errors import UserError
from lit_memory.hf import data_file
from lit_memory.sandbox import bounds, rules
from lit_memory.task.columns import find_columns

# The data settings the checks read, and what each takes: a string, or (text and label columns) a list of them.
STRINGS = ("source", "subset", "encoding", "encoding_errors", "predict_path", "predict_encoding",
           "predict_encoding_errors", "train_split", "validation_split", "test_split")
NAMES = ("text_column", "label_column")
NULL = ("null", "None", "~", "")  # what jsonargparse reads as None for an optional string
SPLITS = {"train_split": "train", "validation_split": None, "test_split": None}  # a local file: one split, train


class Unread(Exception):
    """The command's data settings are not read here as the full parse reads them: it checks them."""


def check(command: str, argv: list[str], trusted: bool) -> None:
    """Refuse, with the data module's line, a data file ``command`` would refuse (``argv``: its arguments, recipes
    expanded, ``--trust-recipe`` taken out; ``trusted``: whether it was given)."""
    try:
        settings = data_settings(command, argv, trusted)
    except Unread:
        return
    source = settings.get("source", data_file.BUNDLED)
    if not isinstance(source, str) or "://" in source:
        return  # a remote location: the full parse refuses it from a sent recipe, names it otherwise
    path = data_file.local_file(source)  # as the data module checks its source first, whatever the command
    if path is None and (settings.get("encoding") is not None or settings.get("encoding_errors") == "replace"):
        return  # a hub dataset with a file's settings: the data module says so first
    predict_path = settings.get("predict_path")
    if predict_path is not None:
        predict = data_file.predict_file(predict_path)
        if command == "predict":
            errors = settings.get("predict_encoding_errors")
            if errors in (None, "strict", "replace"):
                data_file.predict_decoding(predict, settings.get("predict_encoding"), errors)
            return  # the training file is not read
    if path is None or source == data_file.BUNDLED:
        return  # a hub dataset; the bundled tweets
    errors = settings.get("encoding_errors")
    if settings.get("subset") is not None or errors not in (None, "strict", "replace"):
        return
    where = str(path)
    decoding = data_file.decoding(path, where, settings.get("encoding"), errors or "strict")
    if any(settings.get(key, default) != default for key, default in SPLITS.items()):
        return
    names = data_file.header(path, decoding)
    if names is not None:
        find_columns(names, settings.get("text_column"), settings.get("label_column"), where)


def data_settings(command: str, argv: list[str], trusted: bool) -> dict[str, Any]:
    """The ``data:`` settings of `STRINGS` and `NAMES` that ``argv`` gives, later sources over earlier ones; `Unread`
    where it cannot tell them as the full parse would."""
    known = option_names.options(command).get("data", ())
    recipes = shipped.recipes_dir().resolve()
    settings: dict[str, Any] = {}
    tokens = iter(argv)
    for token in tokens:
        if token in ("--config", "-c") or token.startswith(("--config=", "-c=")):
            path = token.split("=", 1)[1] if "=" in token else next(tokens, None)
            settings.update(_config_data(path, trusted, recipes))
        elif token in ("--data", "--print_config") or token.startswith(("--data=", "--print_config")):
            raise Unread  # a data block given whole; or a command that prints its settings and reads no file
        elif token.startswith("--data."):
            key, eq, value = token[len("--data."):].partition("=")
            value = value if eq else next(tokens, None)
            if "." in key or value is None or value.startswith("-"):
                raise Unread
            name = option_names._written_out(key.removesuffix("+"), known)
            if name in STRINGS or name in NAMES:
                settings[name] = _typed(name, value)
    return settings


def _config_data(path: Optional[str], trusted: bool, recipes: Path) -> dict[str, Any]:
    """A config file's ``data:`` settings of `STRINGS` and `NAMES`, read within a sent config's bounds. A file a config
    other than a shipped recipe names (untrusted) is read here only where its confined run would read it too: beneath
    the working folder or the config's own (`lit_memory.sandbox.rules.check_input`; the run's rule takes every
    config's folder)."""
    if path is None or not Path(path).is_file():
        raise Unread  # a config's text typed inline, or a URL
    try:
        tree = bounds.read_yaml(path, "config")
    except UserError:
        raise Unread from None  # the full parse says why
    block = tree.get("data") if isinstance(tree, dict) else None
    if block is None:
        return {}
    if not isinstance(block, dict) or "class_path" in block or "init_args" in block:
        raise Unread
    found = {name: value for name, value in block.items() if name in STRINGS or name in NAMES}
    if not all(_plain(name, value) for name, value in found.items()):
        raise Unread
    if not trusted and Path(path).resolve().parent != recipes:
        folders = [os.getcwd(), os.path.dirname(os.path.realpath(path))]
        for key in ("source", "predict_path"):
            if isinstance(found.get(key), str):
                try:
                    rules.check_input(f"data.{key}", found[key], found[key], folders)
                except UserError:
                    raise Unread from None  # refused, or judged by the run's own rule
    return found


def _typed(name: str, value: str) -> Any:
    """An option's value as the full parse takes it: a string as written (None for null), a list of names in YAML."""
    if name in NAMES and value.lstrip().startswith("["):
        import yaml  # deferred: only a list of columns asks

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise Unread from None
    elif value in NULL:
        return None
    elif value[:1] in "'\"{[&*!|>%@`" or not _plain(name, value):
        raise Unread  # YAML would read it otherwise than as written
    if not _plain(name, value):
        raise Unread
    return value


def _plain(name: str, value: Any) -> bool:
    if value is None or isinstance(value, str):
        return True
    return name in NAMES and isinstance(value, list) and all(isinstance(v, str) for v in value)
