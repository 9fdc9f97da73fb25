"""What the user typed: the values a parse of the command line alone gives, the files named there, and the folders a
recipe's own files may lie in. What the user typed is theirs, exempt from the rules that judge a sent recipe
(`lit_memory.policy.refusal.Rule.exempt_typed`); everything else a run's settings hold came from a file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Optional

from jsonargparse import Namespace

from lit_memory.policy.refusal import TRUST_FLAG


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def command_line_only(argv: list[str]) -> list[str]:
    """``argv`` without what reads files: ``--config FILE`` and any ``--key VALUE`` whose value is an
    existing file (jsonargparse loads it as that key's config). URLs stay: with remote reading off
    they are strings, or an error."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("--config", "-c"):
            i += 2
            continue
        if token.startswith(("--config=", "-c=", "--print_config")) or token in ("-h", "--help", TRUST_FLAG):
            i += 1
            continue
        if token.startswith("--"):
            _, eq, value = token.partition("=")
            width = 1
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, width = argv[i + 1], 2
            if not _is_file(value):
                out += argv[i : i + width]
            i += width
            continue
        out.append(token)  # the subcommand
        i += 1
    return out


def typed_values(argv: list[str], parse: Callable[[list[str]], Namespace], subcommand: Optional[str]) -> Namespace:
    """What a parse of the command line alone produces (`command_line_only`), for one subcommand: the
    user's own values. Where the whole line does not parse alone (an override of a strategy or callback whose
    class only a file names), each option is parsed on its own and those that parse count: the others are
    exempt from nothing."""
    line = command_line_only(argv)
    try:
        return _of(parse(line), subcommand)
    except Exception:  # noqa: BLE001  parsed option by option below
        pass
    try:
        base = _of(parse(line[:1]), subcommand)
    except Exception:  # noqa: BLE001  not even the subcommand alone: nothing typed is trusted
        return Namespace()
    merged, defaults = base.clone(), dict(base.items(branches=False))
    for option in _options(line[1:]):
        try:
            alone = _of(parse([*line[:1], *option]), subcommand)
        except Exception:  # noqa: BLE001  this option needs what a file names
            continue
        for key, value in alone.items(branches=False):  # jsonargparse's leaves: a dict value is one
            if not _same(defaults.get(key), value):
                merged[key] = value
    return merged


def _of(parsed: Namespace, subcommand: Optional[str]) -> Namespace:
    return parsed.get(subcommand, Namespace()) if subcommand else parsed


def _options(tokens: list[str]) -> list[list[str]]:
    """``--key=value`` / ``--key value`` / ``--flag`` tokens, one list per option."""
    options: list[list[str]] = []
    for token in tokens:
        if token.startswith("-") or not options:
            options.append([token])
        else:
            options[-1].append(token)
    return options


def typed_option(argv: list[str], key: str) -> Optional[str]:
    """The value the user typed for ``--KEY`` (the last one), or None. A file named on the command line is the user's,
    though the parse of the command line alone leaves it out (`command_line_only`: jsonargparse would read it as that
    key's config): what a run reads is judged by this."""
    value = None
    for i, token in enumerate(argv):
        if token == f"--{key}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(f"--{key}="):
            value = token.split("=", 1)[1]
    return value


def recipe_folders(argv: list[str]) -> list[str]:
    """The folders a recipe's own files may lie in: the working folder and the folders of the configs the user named
    (``--config FILE``, ``--recipe NAME`` once expanded). A file a recipe names elsewhere is the user's, read only when
    they type it (`lit_memory.sandbox.rules.check_input`, `bounded_config_reading`)."""
    folders = [os.getcwd()]
    for i, token in enumerate(argv):
        value = argv[i + 1] if token in ("--config", "-c") and i + 1 < len(argv) else None
        if token.startswith(("--config=", "-c=")):
            value = token.split("=", 1)[1]
        if value and _is_file(value):
            folders.append(os.path.dirname(os.path.realpath(os.path.expanduser(re.sub(r"^file:///?", "/", value)))))
    return list(dict.fromkeys(os.path.realpath(f) for f in folders))


def _is_file(value: str) -> bool:
    """Whether jsonargparse would read ``value`` as a file: a path, or a ``file://`` URL it strips itself."""
    value = re.sub(r"^file:///?", "/", value)
    try:
        return bool(value) and Path(value).expanduser().is_file()
    except (OSError, ValueError):  # too long or too odd to be a path
        return False
