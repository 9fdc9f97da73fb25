"""Settings as typed values and plain data: parsed once at the edge, then passed down.

- `Precision`: a trainer precision parsed once from what Lightning accepts (``"bf16-mixed"``, its aliases
  ``"bf16"``, ``16``, ``"32"``...), with what it means for tensors (the weights' dtype, the compute dtype, autocast,
  loss scaling). Everything below the edge asks it, never the string.
- `to_plain`: jsonargparse namespaces, ruamel maps and tuples as plain dicts, lists and scalars.
- Dotted keys (``model.optimizer.init_args.lr``, ``trainer.callbacks.0.init_args.x``): `dotted_leaves` walks a tree,
  `locate` finds one key, `assign` sets it, `overlay` lays dotted values over a copy.
- `key_of`: the one cache key of settings and typed values (JSON with sorted keys).
- `arguments`: a class's constructor arguments with their defaults, read from its signature as LightningCLI
  reads it, so a description of a run's sections copies no argument list by hand.
- `patched`: a library's attribute (a switch, a function) set for the length of a ``with`` block, then put back.

The bucket setting has its own type beside the fused step that owns it (`lit_memory.fused.Bucketing`); YAML files
are read through `lit_memory.sandbox.bounds.read_yaml`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import warnings
from collections import abc
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch

from lit_memory.errors import UserError

# -- precision -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """A trainer precision: its Lightning name (``str()`` gives it back), the dtype of the weights and gradients, the
    dtype linear layers compute in, and whether that is autocast's. Parse one with `Precision.of`."""

    name: str
    param: torch.dtype
    compute: torch.dtype
    autocast: bool = False

    @classmethod
    def of(cls, value: Any) -> "Precision":
        """``value`` as Lightning reads ``trainer.precision`` (its aliases included; None: ``32-true``), one
        `UserError` line for one it does not model (``transformer-engine``). A `Precision` is returned as it is."""
        found = cls.known(value)
        if found is None:
            raise UserError(f"precision {value!r} is not modelled; choose one of: {', '.join(PRECISIONS)}")
        return found

    @classmethod
    def known(cls, value: Any) -> Optional["Precision"]:
        """`of`, or None for a precision Lightning may run but lit_memory does not model (a run goes on with it)."""
        if isinstance(value, Precision):
            return value
        if isinstance(value, str) and value in PRECISIONS:  # the common case, without Lightning's conversion
            return PRECISIONS[value]
        return PRECISIONS.get(_unified(value))

    def __str__(self) -> str:
        return self.name

    @property
    def bf16(self) -> bool:
        """Computes in bf16 (autocast or bf16 weights): needs bf16 arithmetic (`lit_memory.optim.precision`)."""
        return self.compute == torch.bfloat16

    @property
    def scaled(self) -> bool:
        """fp16 autocast: Lightning gives it torch's GradScaler (dynamic loss scaling)."""
        return self.autocast and self.compute == torch.float16

    @property
    def half_weights(self) -> bool:
        """The weights themselves are 16-bit (``-true``), with no fp32 master copy."""
        return self.param.itemsize == 2


PRECISIONS = {
    p.name: p
    for p in (
        Precision("32-true", torch.float32, torch.float32),
        Precision("64-true", torch.float64, torch.float64),
        Precision("bf16-mixed", torch.float32, torch.bfloat16, autocast=True),
        Precision("16-mixed", torch.float32, torch.float16, autocast=True),
        Precision("bf16-true", torch.bfloat16, torch.bfloat16),
        Precision("16-true", torch.float16, torch.float16),
    )
}


def _unified(value: Any) -> str:
    """Lightning's own reading of a precision value (``16`` and ``"16"`` are ``16-mixed``, ``"bf16"`` is
    ``bf16-mixed``); what it refuses comes back as written."""
    # deferred: a base module, no Lightning at import
    from lightning.fabric.connector import _convert_precision_to_unified_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "16 is supported for historical reasons"
        try:
            return str(_convert_precision_to_unified_args(value if value is not None else "32-true"))
        except (ValueError, TypeError):
            return str(value)


# -- plain data and dotted keys ----------------------------------------------------------------------------------

_SCALARS = (str, int, float, bool, type(None))


def to_plain(value: Any) -> Any:
    """Plain dicts, lists and scalars (jsonargparse namespaces, ruamel's maps and scalars included), in new
    containers."""
    if type(value) in _SCALARS:  # most leaves: no typing-ABC checks (plan reads settings thousands of times)
        return value
    if type(value) is dict:
        return {k if type(k) is str else str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (str, int, float)):  # ruamel's round-trip scalars (ScalarFloat, ...): their base type
        return next(base for base in (str, float, int) if isinstance(value, base))(value)
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, (dict, abc.Mapping)):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def dotted_leaves(
    tree: Any, key: str = "", depth: Optional[int] = None, lists: bool = True
) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf: a Namespace flattened by jsonargparse (``items(branches=False)``), then the
    dicts and lists it keeps as values (``model.config_overrides.x``, ``trainer.callbacks.0.init_args.y``).
    ``depth``: stop that many keys down (2: a recipe's ``section.setting`` blocks); ``lists=False``: a list is a
    leaf."""
    from jsonargparse import Namespace  # deferred: a base module, no jsonargparse at import

    below = None if depth is None else depth - 1
    if depth == 0:
        yield key, tree
    elif isinstance(tree, Namespace):  # whole (its dotted leaves), or a level at a time
        for k, v in (tree.items(branches=False) if depth is None else vars(tree).items()):
            yield from dotted_leaves(v, f"{key}.{k}" if key else k, below, lists)
    elif isinstance(tree, (dict, abc.Mapping)):
        for k, v in tree.items():
            yield from dotted_leaves(v, f"{key}.{k}" if key else str(k), below, lists)
    elif lists and isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from dotted_leaves(v, f"{key}.{i}" if key else str(i), below, lists)
    else:
        yield key, tree


def get_dotted(tree: Any, key: str) -> Any:
    """The value at a dotted key (`locate`); KeyError if it is not there."""
    container, last = locate(tree, key)
    return container[last]


def locate(tree: Any, key: str) -> tuple[Any, Any]:
    """(container, key or index in it) of a dotted key named by `dotted_leaves`: through Namespaces by jsonargparse's
    own dotted access, then into dicts and lists. KeyError if it is not there."""
    from jsonargparse import Namespace  # deferred: a base module, no jsonargparse at import

    parts = key.split(".")
    node = tree
    while True:
        if isinstance(node, Namespace):
            head = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in node), None)
            if head is None:
                raise KeyError(key)
            rest = parts[head.count(".") + 1 :]
            if not rest:
                return node, head
            node, parts = node[head], rest
        else:
            step: Any = int(parts[0]) if isinstance(node, list) and parts[0].isdigit() else parts[0]
            present = (isinstance(node, abc.Mapping) and step in node) or (
                isinstance(node, list) and isinstance(step, int) and step < len(node)
            )
            if not present:
                raise KeyError(key)
            if len(parts) == 1:
                return node, step
            node, parts = node[step], parts[1:]


def assign(tree: Any, key: str, value: Any, create: bool = False) -> None:
    """Set a dotted key; ``create``: make the dicts on its way that are missing (else KeyError)."""
    if create:
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
        return
    container, last = locate(tree, key)
    container[last] = value


def overlay(settings: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` as plain data with dotted values laid over it (a value that is a dict replaces the whole key, as a
    recipe's block does: ``model.optimizer`` names the optimizer and all its arguments). Nothing given is changed."""
    out = to_plain(settings)  # new containers all the way down: the caller's stay as they are
    for key, value in values.items():
        assign(out, key, to_plain(value), create=True)
    return out


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name`` is ``value`` inside the block; afterwards it is what it was (an inherited one inherited again)."""
    getattr(owner, name)  # a name that is not there is a typo, not a patch
    own = vars(owner)
    saved = own[name] if name in own else _INHERITED
    setattr(owner, name, value)
    try:
        yield value
    finally:
        if saved is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)


_INHERITED = object()


# -- cache keys --------------------------------------------------------------------------------------------------


def key_of(value: Any) -> str:
    """The one cache key of settings and typed values: JSON with sorted keys of their plain data, a dataclass by its
    compared fields (what makes two equal), anything else (a dtype) by its ``str()``. Equal values, equal keys."""
    return json.dumps(value, sort_keys=True, default=_keyable)  # json's C encoder walks the plain data itself


def _keyable(value: Any) -> Any:
    """What `key_of` writes for a value JSON cannot (called by the encoder, which then writes what this returns)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"": type(value).__name__, **{name: getattr(value, name) for name in _compared(type(value))}}
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if isinstance(value, abc.Mapping):
        return dict(value)
    return str(value)


@functools.lru_cache(maxsize=None)
def _compared(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.compare)


# -- signatures --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def arguments(cls: type) -> Mapping[str, Any]:
    """``cls``'s constructor arguments with their defaults (`inspect.Parameter.empty` where it has none), in order:
    read from its signature, as LightningCLI (jsonargparse) reads a class's settings."""
    return {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def section(cls: type, values: Optional[Mapping[str, Any]], without: tuple[str, ...] = ()) -> dict[str, Any]:
    """One section of a run's settings (``model``, ``data``, ``trainer``) for ``cls``: every constructor argument,
    its value where ``values`` give one, else its default; keys that are not arguments are left out."""
    values = values or {}
    return {
        name: values[name] if name in values else default
        for name, default in arguments(cls).items()
        if name not in without and (name in values or default is not inspect.Parameter.empty)
    }
