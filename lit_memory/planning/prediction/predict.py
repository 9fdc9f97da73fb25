"""The one way into a memory prediction: a `Step` (`lit_memory.planning.prediction.step`) in, a `Prediction` per
method out, each at three levels (tensors, reserved, device; `lit_memory.memory.measure.footprint`).

- `predict(step, simulated)`: the analytic model, and the simulation when asked (or the one line saying why
  it cannot run for this model: `simulate_or_decline`);
- `device_total(step)`: the analytic device total alone, cached: what a search over many setups asks;
- `fits(step, budget)`: whether that total is within a budget (budgets are device budgets).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from lit_memory.memory.measure.footprint import Footprint
from lit_memory.memory.measure.records import METHODS
from lit_memory.optim.optimizer_state import StepNotSimulated
from lit_memory.planning.prediction.analytic import analytic, device_total
from lit_memory.planning.prediction.simulate import simulate
from lit_memory.planning.prediction.step import Prediction, Step

__all__ = ["METHODS", "device_total", "fits", "level", "predict", "simulate_or_decline"]


def simulate_or_decline(step: Step) -> tuple[Optional[Prediction], Optional[str]]:
    """The simulated step, or None and one line saying why it cannot run: a forward that computes a shape
    or a Python number from the data (DeBERTa's relative positions call nonzero, ModernBERT reads a scalar
    back), which fake tensors cannot give, or an optimizer's step that computes a shape from the data (its
    scalar reads are answered: `lit_memory.optim.optimizer_state.answering_scalars`). Everything else the simulation
    meets is raised as it is."""
    try:
        return simulate(step), None
    except StepNotSimulated as err:
        return None, f"not simulated: {err}, which fake tensors cannot give; the analytic prediction stands alone"
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        return None, (
            f"not simulated: the model's forward computes from the data what fake tensors cannot give ({err}); "
            "the analytic prediction stands alone"
        )


def predict(step: Step, simulated: bool = False) -> dict[str, Prediction]:
    """The analytic prediction, and the simulated one when asked (not under FSDP: the simulation runs one
    device, so a sharded step's per-rank numbers are the analytic model's). A simulation the model's forward
    cannot run on fake tensors is left out, and the analytic prediction's notes say why."""
    out = {"analytic": analytic(step)}
    if simulated and not step.sharded:
        found, declined = simulate_or_decline(step)
        if declined:
            out["analytic"] = replace(out["analytic"], notes=[*out["analytic"].notes, declined])
        else:
            out["simulated"] = found
    return out


def level(footprint: Footprint) -> int:
    """What decides whether a step fits: the device total where there is one (CUDA), else the tensors."""
    return footprint.device if footprint.device is not None else footprint.peak


def fits(step: Step, budget: int) -> bool:
    return device_total(step) <= budget
