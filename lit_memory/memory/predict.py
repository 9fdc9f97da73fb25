"""The one way into a memory prediction, for every caller (``estimate``, ``plan``, a fit's memory monitor,
the out-of-memory advice, the published-measurement table): a `Step` (`lit_memory.memory.step`) in, a
`Prediction` per method out, each at three levels (tensors, reserved, device; `lit_memory.memory.footprint`).

- `predict(step, simulated)`: the analytic model, and the simulation when asked;
- `device_total(step)`: the analytic device total alone, cached: what a search over many setups asks;
- `fits(step, budget)`: whether that total is within a budget (budgets are device budgets);
- `run_hooks(step)`: the memory monitor's ``predict`` and ``advise`` hooks for a fit of this step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from lit_memory.memory.analytic import analytic, device_total
from lit_memory.memory.device import target
from lit_memory.memory.footprint import Footprint
from lit_memory.memory.simulate import simulate
from lit_memory.memory.step import Prediction, Step

METHODS = ("analytic", "simulated")

__all__ = ["METHODS", "device_total", "fits", "level", "predict", "run_hooks"]


def predict(step: Step, simulated: bool = False) -> dict[str, Prediction]:
    """The analytic prediction, and the simulated one when asked (not under FSDP: the simulation runs one
    device, so a sharded step's per-rank numbers are the analytic model's)."""
    out = {"analytic": analytic(step)}
    if simulated and not step.sharded:
        out["simulated"] = simulate(step)
    return out


def level(footprint: Footprint) -> int:
    """What decides whether a step fits: the device total where there is one (CUDA), else the tensors."""
    return footprint.device if footprint.device is not None else footprint.peak


def fits(step: Step, budget: int) -> bool:
    return device_total(step) <= budget


def run_hooks(step: Step, recipes: Callable[[], list[tuple[str, dict[str, Any]]]]) -> tuple[Callable, Callable]:
    """The memory monitor's hooks (`lit_memory.monitor.Predict`, `Advise`) for a fit of ``step``: its
    predictions for the device it runs on, and advice on running out of memory (the lightest of
    ``recipes()``, (path, dotted settings) pairs, predicted to fit)."""
    from lit_memory.memory.choose import advise

    def on(trainer: Any) -> Step:
        device = trainer.strategy.root_device.type
        found = step.on(target(device))
        return replace(found, world_size=trainer.world_size) if found.sharded else found

    def predict_hook(trainer: Any, module: Any, simulated: bool) -> dict[str, Footprint]:
        predictions: dict[str, Footprint] = {}
        for method in METHODS if simulated else METHODS[:1]:
            try:
                found = predict(on(trainer), simulated=method == "simulated").get(method)
            except Exception as err:  # a model the predictions do not cover must still train (and be measured)
                print(f"warning: no {method} memory prediction: {type(err).__name__}: {err}")
                continue
            if found is not None:
                predictions[method] = found.footprint
        return predictions

    def advise_hook(trainer: Any, limit: int) -> str:
        return advise(on(trainer), limit, recipes())

    return predict_hook, advise_hook
