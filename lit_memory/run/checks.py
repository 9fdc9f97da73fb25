"""Settings Lightning and the optimizers accept and then fail on mid-run, checked before anything
trains: one `UserError` line each.

The optimizer (`check_optimizer`, called by the module at construction):

Optimizers check some of their arguments themselves (torch: a negative learning rate), others only at
their first step, deep in a kernel (torchao's ``block_size``, HF Adafactor's ``eps`` pair), and some
never (a string where a flag belongs is truthy). So the module builds the configured optimizer once on
a dummy parameter, which runs the class's own checks, then checks what it kept (``defaults``) against
the types of the class's own defaults and the ranges every optimizer shares: only the values the user set,
the constructor's arguments that differ from its defaults (a class may keep a value it never takes, such as
bitsandbytes' Lion8bit's ``eps`` of 0, which no range of ours is about).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from lit_memory.errors import UserError
from lit_memory.fused import parse_bucket
from lit_memory.optim.optimizers import library_of

# The ranges every optimizer shares; a library's own arguments' are its
# (`lit_memory.optim.optimizers.Library.positive`).
NON_NEGATIVE = ("lr", "weight_decay", "momentum", "dampening")
POSITIVE = ("eps",)
IN_UNIT = ("betas", "beta1", "beta2")  # coefficients of running averages (not Adafactor's decay_rate: an exponent)


def check_optimizer(factory: Callable[..., torch.optim.Optimizer]) -> None:
    """Build ``factory`` (params -> optimizer) on one dummy parameter and check its settings."""
    dummy = torch.nn.Parameter(torch.zeros(64))
    try:
        optimizer = factory([dummy])
    except (ValueError, TypeError, RuntimeError, AssertionError) as err:
        raise UserError(f"model.optimizer: {' '.join(str(err).split()) or type(err).__name__}") from None
    positive = (*POSITIVE, *library_of(optimizer).positive)
    problems = [
        p
        for key, value in _settings(optimizer).items()
        if (parameter := _parameter(type(optimizer), key)) is not None and _set(value, parameter.default)
        for p in _problems(key, value, parameter.default, positive)
    ]
    if problems:
        raise UserError(f"model.optimizer: {type(optimizer).__name__}: {'; '.join(problems)}")


def _settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the optimizer kept of its arguments: ``defaults``, and attributes for those kept outside it
    (torchao keeps ``block_size`` on the instance)."""
    kept = dict(optimizer.defaults)
    for cls in type(optimizer).__mro__:
        for key in _arguments(cls):
            if key not in kept and key not in ("self", "params") and hasattr(optimizer, key):
                kept[key] = getattr(optimizer, key)
    return kept


def _arguments(cls: type) -> dict[str, inspect.Parameter]:
    init = cls.__dict__.get("__init__")
    return dict(inspect.signature(init).parameters) if init is not None else {}


def _parameter(cls: type, key: str) -> Optional[inspect.Parameter]:
    """The constructor argument ``key`` of ``cls``: its own ``__init__``'s, or, through ``**kwargs``, a base's."""
    for base in cls.__mro__:
        arguments = _arguments(base)
        if not arguments:
            continue
        if key in arguments and arguments[key].kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            return arguments[key]
        if not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in arguments.values()):
            return None
    return None


def _set(value: Any, default: Any) -> bool:
    """Whether ``value`` is one the user set: a required argument's, or another than the default."""
    if default is inspect.Parameter.empty or isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return True
    try:
        if isinstance(value, Sequence) and isinstance(default, Sequence) and not isinstance(value, str):
            return list(value) != list(default)
        return type(value) is not type(default) or bool(value != default)
    except Exception:  # noqa: BLE001  values that do not compare: checked
        return True


def _problems(key: str, value: Any, default: Any, positive: Sequence[str] = POSITIVE) -> list[str]:
    if isinstance(default, bool) and not isinstance(value, bool):
        return [f"{key} must be true or false, got {value!r}"]
    if isinstance(default, numbers.Real) and not isinstance(default, bool):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            if not isinstance(value, torch.Tensor):
                return [f"{key} must be a number, got {value!r}"]
    if isinstance(default, Sequence) and not isinstance(default, str):
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(default):
            return [f"{key} must be a list of {len(default)} numbers like {list(default)}, got {value!r}"]
    numbers_in = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    out = []
    for number in numbers_in:
        if isinstance(number, bool) or not isinstance(number, numbers.Real):
            if isinstance(value, Sequence) and not isinstance(value, str) and number is not None:
                out.append(f"{key} must hold numbers, got {value!r}")
            continue
        if not math.isfinite(number):
            out.append(f"{key} must be finite, got {value!r}")
        elif key in NON_NEGATIVE and number < 0:
            out.append(f"{key} must be >= 0, got {value!r}")
        elif key in positive and number <= 0:
            out.append(f"{key} must be > 0, got {value!r}")
        elif key in IN_UNIT and not 0 <= number < 1:
            out.append(f"{key} must be in [0, 1), got {value!r}")
    return out[:1]


def check_trainer(trainer: Any) -> None:
    """Trainer settings Lightning takes as given and fails on later (``accumulate_grad_batches: 0`` divides
    by zero in the loop, ``-1`` silently never steps; a NaN clip value clips everything to NaN), and a fused
    strategy's bucket: the strategy parses it when built (`lit_memory.fused.parse_bucket`, the one parser), where
    jsonargparse would wrap its line into an error about the Trainer's ``strategy`` union."""
    get = trainer.get if hasattr(trainer, "get") else lambda k, d=None: getattr(trainer, k, d)
    accumulate = get("accumulate_grad_batches", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise UserError(f"trainer.accumulate_grad_batches must be a whole number >= 1, got {accumulate!r}")
    clip = get("gradient_clip_val", None)
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not 0 <= clip < math.inf):
        raise UserError(f"trainer.gradient_clip_val must be a finite number >= 0 (or null), got {clip!r}")
    strategy = get("strategy", None)
    bucket = getattr(getattr(strategy, "init_args", None), "bucket", None)
    if bucket is not None:
        parse_bucket(bucket)


def check_compile(model: Any, data: Any) -> None:
    """``model.compile: cudagraphs`` replays each layer as a CUDA graph recorded for one batch shape: with batches
    padded each to its longest (``data.padding: longest``) every new length would record another graph, and keep
    its memory. One line before training."""
    get = lambda node, key: node.get(key) if hasattr(node, "get") else getattr(node, key, None)  # noqa: E731
    if get(model, "compile") == "cudagraphs" and get(data, "padding") != "max_length":
        raise UserError(
            "model.compile cudagraphs records each layer's CUDA graph for one batch shape, and data.padding "
            f"{get(data, 'padding')} makes a new shape at every batch length: set data.padding: max_length (every "
            "batch "
            "padded to max_length), or model.compile: true"
        )
