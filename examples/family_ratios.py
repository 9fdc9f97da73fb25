"""The analytic activation model against the measured step, per model family: for each tiny random model of
tests/families.py (hidden 32, 2 layers, 4 heads), fp32, AdamW, CPU target, the analytic peak and forward-phase
activations over those `lit_memory.planning.prediction.simulate.measure` tracks on real tensors, at each shape
tests/hf/test_anatomy.py holds within 15 %. Prints the markdown table docs/memory.md shows.

    python examples/family_ratios.py [family ...]
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import families as fam  # noqa: E402

from lit_memory.memory.hardware.gpus import Target  # noqa: E402
from lit_memory.planning.prediction.analytic import analytic  # noqa: E402
from lit_memory.planning.prediction.simulate import measure  # noqa: E402
from lit_memory.planning.prediction.step import OptimizerSpec, Step  # noqa: E402

SHAPES = ((4, 32), (2, 64))  # (batch, length): the test's two shapes


def ratios(folder: Path, batch: int, length: int) -> tuple[float, float]:
    """(peak, forward activations): analytic over measured."""
    step = Step(
        model={"model_name_or_path": str(folder), "num_labels": 2},
        optimizer=OptimizerSpec("torch.optim.AdamW", {"lr": 1e-3}),
        batch_size=batch,
        max_length=length,
        target=Target(type="cpu"),
    )
    a, m = analytic(step, levels=False).footprint, measure(step).footprint
    forward = lambda f: f.phases["forward"]["activations"]  # noqa: E731
    return a.peak / m.peak, forward(a) / forward(m)


def main(families: list[str]) -> None:
    warnings.simplefilter("ignore")
    root = Path(tempfile.mkdtemp())
    heads = " | ".join(f"peak {b}x{s} | fwd act {b}x{s}" for b, s in SHAPES)
    print(f"| family | {heads} |")
    print("|---" * (1 + 2 * len(SHAPES)) + "|")
    for family in families:
        folder = fam.folder(family, root)
        cells = [f"{r:.3f}" for b, s in SHAPES for r in ratios(folder, b, s)]
        print(f"| {family} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(fam.FAMILIES))
