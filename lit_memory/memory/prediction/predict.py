"""The one way into a memory prediction, for every caller (``estimate``, ``plan``, a fit's memory monitor,
the out-of-memory advice, the published-measurement table): a `Step` (`lit_memory.memory.prediction.step`) in, a
`Prediction` per method out, each at three levels (tensors, reserved, device; `lit_memory.memory.measure.footprint`).

- `predict(step, simulated)`: the analytic model, and the simulation when asked (or the one line saying why
  it cannot run for this model: `simulate_or_decline`);
- `device_total(step)`: the analytic device total alone, cached: what a search over many setups asks;
- `fits(step, budget)`: whether that total is within a budget (budgets are device budgets);
- `run_hooks(step)`: the memory monitor's ``predict``, ``advise`` and ``timeline`` hooks for a fit of this step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

from lit_memory.memory.prediction.analytic import analytic, device_total
from lit_memory.memory.hardware.gpus import target
from lit_memory.memory.measure.footprint import Footprint
from lit_memory.memory.measure.records import METHODS
from lit_memory.memory.prediction.simulate import simulate
from lit_memory.memory.prediction.step import Prediction, Step
from lit_memory.optimizers import StepNotSimulated

__all__ = ["METHODS", "device_total", "fits", "level", "predict", "run_hooks", "simulate_or_decline"]


def simulate_or_decline(step: Step) -> tuple[Optional[Prediction], Optional[str]]:
    """The simulated step, or None and one line saying why it cannot run: a forward that computes a shape
    or a Python number from the data (DeBERTa's relative positions call nonzero, ModernBERT reads a scalar
    back), which fake tensors cannot give, or an optimizer's step that computes a shape from the data (its
    scalar reads are answered: `lit_memory.optimizers.answering_scalars`). Everything else the simulation meets
    is raised as it is."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

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


def run_hooks(step: Step, recipes: Callable[[], list[tuple[str, dict[str, Any]]]]) -> tuple[Callable, Callable, Callable]:
    """The memory callbacks' hooks (`lit_memory.run_memory.Predict`, `Advise`, `Timeline`) for a fit of ``step``:
    its predictions for the device it runs on, advice on running out of memory (the lightest of ``recipes()``,
    (path, dotted settings) pairs, predicted to fit), and the analytic step point by point (the picture's)."""
    from lit_memory.memory.planning.choose import advise

    def on(trainer: Any) -> Step:
        device = trainer.strategy.root_device.type
        found = step.on(target(device))
        return replace(found, world_size=trainer.world_size) if found.sharded else found

    def predict_hook(trainer: Any, module: Any, simulated: bool, shape: Optional[tuple[int, int]] = None) -> dict[str, Footprint]:
        predictions: dict[str, Footprint] = {}
        try:
            run = on(trainer)
        except Exception as err:  # noqa: BLE001  as below: the run still trains and is measured
            print(f"warning: no memory prediction: {type(err).__name__}: {err}")
            return predictions
        if shape is not None:  # batches of this many rows and tokens (e.g. the longest a dynamically padded run saw)
            run = replace(run, batch_size=int(shape[0]), max_length=int(shape[1]))
        for method in METHODS if simulated else METHODS[:1]:
            try:
                declined = None
                if method == "simulated":
                    found, declined = (None, None) if run.sharded else simulate_or_decline(run)
                else:
                    found = analytic(run)
            except Exception as err:  # a model the predictions do not cover must still train (and be measured)
                print(f"warning: no {method} memory prediction: {type(err).__name__}: {err}")
                continue
            if declined:
                print(f"note: {declined}")
            if found is not None:
                predictions[method] = found.footprint
        return predictions

    def advise_hook(trainer: Any, limit: int) -> str:
        return advise(on(trainer), limit, recipes())

    def timeline_hook(trainer: Any, shape: Optional[tuple[int, int]] = None) -> Optional[list[dict]]:
        try:
            run = on(trainer)
            if shape is not None:
                run = replace(run, batch_size=int(shape[0]), max_length=int(shape[1]))
            return analytic(run, levels=False, timeline=True).timeline
        except Exception as err:  # noqa: BLE001  as above: no picture's prediction, the run goes on
            print(f"warning: no predicted timeline for the memory picture: {type(err).__name__}: {err}")
            return None

    return predict_hook, advise_hook, timeline_hook
