"""What a run's memory callbacks take from the models for a fit of one step
(`lit_memory.run.memory_callbacks.Predict`, `Advise`, `Timeline`): its predictions for the device it runs on, advice
when it runs out of memory, and the analytic step point by point for the picture of a step. Every hook leaves the run
training when the models do not cover it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

from lit_memory.memory.hardware.gpus import target
from lit_memory.memory.measure.footprint import Footprint
from lit_memory.memory.measure.records import METHODS
from lit_memory.planning.choose import advise
from lit_memory.planning.prediction.analytic import analytic
from lit_memory.planning.prediction.predict import simulate_or_decline
from lit_memory.planning.prediction.step import Step
from lit_memory.run.memory_callbacks import Advise, Predict, Timeline


def run_hooks(step: Step, recipes: Callable[[], list[tuple[str, dict[str, Any]]]]) -> tuple[Predict, Advise, Timeline]:
    """The ``predict``, ``advise`` and ``timeline`` hooks for a fit of ``step``: its predictions for the device it
    runs on, advice on running out of memory (the lightest of ``recipes()``, (path, dotted settings) pairs,
    predicted to fit), and the analytic step point by point (the picture's)."""

    def on(trainer: Any) -> Step:
        device = trainer.strategy.root_device.type
        found = step.on(target(device))
        return replace(found, world_size=trainer.world_size) if found.sharded else found

    def predict_hook(
        trainer: Any, module: Any, simulated: bool, shape: Optional[tuple[int, int]] = None
    ) -> dict[str, Footprint]:
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
