"""What to run instead when a run runs out of memory: the monitor's ``advise`` hook.

It applies every shipped recipe to the failed run's model and data, predicts each analytically for
the run's own setup, and names the one `plan`'s rule prefers among those that fit the limit.
"""

from __future__ import annotations

import lightning as L

from lit_memory.memory.footprint import format_bytes
from lit_memory.memory.setup import Setup
from lit_memory.tools.plan import lightest_fitting_recipe


def advise(trainer: L.Trainer, limit: int) -> str:
    size = format_bytes(limit)
    try:
        setup = Setup.from_run(trainer, trainer.lightning_module)
    except AttributeError:  # not a SequenceClassifier with our data module
        setup = None
    found = lightest_fitting_recipe(setup, limit) if setup is not None else None
    if found is None:
        budget = size.replace(" ", "")
        return f"no shipped recipe is predicted to fit {size}: try `python -m lit_memory plan --budget {budget}`"
    path, peak = found
    return f"lightest shipped recipe predicted to fit {size}: --config {path} (predicted peak {format_bytes(peak)})"
