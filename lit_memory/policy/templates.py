"""Templates and free-form values: strings Python formats with a run's metrics (a checkpoint's ``filename``) and
keyword dictionaries an allowlisted class passes on unchecked.
"""

from __future__ import annotations

import re
import string
from typing import Any, Iterable, Iterator

from lit_memory.policy.refusal import PASS, Context, Refusal, refuse_first, register

TEMPLATE_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_/-]{0,63}")
TEMPLATE_SPEC = re.compile(r"[<>^=]?[+ -]?0?\d{0,2}(\.\d{1,2})?[dfegs%]?")


def template_refusals(key: str, value: str) -> list[Refusal]:
    """A value Python formats with the run's metrics (a checkpoint's ``filename``): plain ``{metric}`` or
    ``{metric:spec}`` fields with bounded widths; no attribute or item walk (``{epoch.__class__...}``)."""
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as err:
        return [Refusal(key, value, f"it is not a plain {{metric}} or {{metric:spec}} template ({err})", hint=PASS)]
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if not TEMPLATE_FIELD.fullmatch(name) or conversion or not TEMPLATE_SPEC.fullmatch(spec or ""):
            return [Refusal(key, value, f"its field {{{name}{'!' + conversion if conversion else ''}"
                                        f"{':' + spec if spec else ''}}} is not a plain {{metric}} or {{metric:spec}}",
                            hint=PASS)]
    return []


def check_template(key: str, value: str) -> None:
    """`template_refusals`, as one error line."""
    refuse_first(template_refusals(key, value))


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


def templates_of(chosen: Iterable[tuple[str, Any]]) -> list[Refusal]:
    """`template_refusals` of every template among ``(key, value)``."""
    return [r for key, value in chosen if isinstance(value, str) and "{" in value
            and key.rsplit(".", 1)[-1] in TEMPLATE_KEYS for r in template_refusals(key, value)]


def check_templates(settings: dict[str, Any]) -> None:
    refuse_first(templates_of(leaves(settings)))


FREE_KWARGS = re.compile(r"(^|\.)(dict_kwargs|kwargs|\w+_kwargs)(\.|\[|$)")


def free_kwargs_of(chosen: Iterable[tuple[str, Any]]) -> list[Refusal]:
    """Free-form keyword dictionaries of allowlisted classes (jsonargparse's ``dict_kwargs``, a profiler's
    ``**kwargs``): refused from a sent recipe, whose values they pass on unchecked."""
    return [Refusal(key, value,
                    f"free-form keyword arguments from a recipe reach the class unchecked ({key}={value!r})",
                    hint=PASS, head=f"{key.split('.dict_kwargs')[0]}.dict_kwargs")
            for key, value in chosen if FREE_KWARGS.search(key) and value not in (None, {}, [])]


def check_free_kwargs(settings: dict[str, Any]) -> None:
    refuse_first(free_kwargs_of(leaves(settings)))


@register("launch")
def templates(context: Context) -> list[Refusal]:
    """Templates the recipe chose (`template_refusals`)."""
    return templates_of(context.chosen().items())


@register("launch")
def free_kwargs(context: Context) -> list[Refusal]:
    """Free-form keyword dictionaries the recipe chose (`free_kwargs_of`)."""
    return free_kwargs_of(context.chosen().items())
