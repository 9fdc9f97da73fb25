"""Templates and free-form values: strings Python formats with a run's metrics (a checkpoint's ``filename``) and
keyword dictionaries an allowlisted class passes on unchecked.
"""

from __future__ import annotations

import re
import string
from typing import Any, Iterator

from lit_memory.errors import UserError
from lit_memory.policy.refusal import PASS as HINT

TEMPLATE_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_/-]{0,63}")
TEMPLATE_SPEC = re.compile(r"[<>^=]?[+ -]?0?\d{0,2}(\.\d{1,2})?[dfegs%]?")


def check_template(key: str, value: str) -> None:
    """A value Python formats with the run's metrics (a checkpoint's ``filename``): plain ``{metric}`` or
    ``{metric:spec}`` fields with bounded widths; no attribute or item walk (``{epoch.__class__...}``)."""
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as err:
        raise UserError(f"refusing {key}={value!r}: it is not a plain {{metric}} or {{metric:spec}} template ({err}); "
                        f"{HINT}") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if not TEMPLATE_FIELD.fullmatch(name) or conversion or not TEMPLATE_SPEC.fullmatch(spec or ""):
            raise UserError(
                f"refusing {key}={value!r}: its field {{{name}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} is not a plain {{metric}} or {{metric:spec}}; {HINT}"
            )


TEMPLATE_KEYS = ("filename", "name", "version", "sub_dir", "prefix", "log_model_name")


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from leaves(value, f"{prefix}[{i}]")
    else:
        yield prefix, tree


def check_templates(settings: dict[str, Any]) -> None:
    for key, value in leaves(settings):
        if isinstance(value, str) and "{" in value and key.rsplit(".", 1)[-1] in TEMPLATE_KEYS:
            check_template(key, value)


FREE_KWARGS = re.compile(r"(^|\.)(dict_kwargs|kwargs|\w+_kwargs)(\.|\[|$)")


def check_free_kwargs(settings: dict[str, Any]) -> None:
    """Free-form keyword dictionaries of allowlisted classes (jsonargparse's ``dict_kwargs``, a profiler's
    ``**kwargs``): refused from a sent recipe, whose values they pass on unchecked."""
    for key, value in leaves(settings):
        if FREE_KWARGS.search(key) and value not in (None, {}, []):
            raise UserError(f"refusing {key.split('.dict_kwargs')[0]}.dict_kwargs: free-form keyword arguments from a "
                            f"recipe reach the class unchecked ({key}={value!r}); {HINT}")
