"""Long sequences: the analytic activation model against tracked tensors on this CPU, for tiny versions of the
decoders and ModernBERT at 1,024-8,192 tokens (issue 48's 5 % bar).

Each family's tiny config (tests/families.py: hidden 32, 2 layers) with its positions raised to 8,192 and windows of
realistic proportion (Gemma 3's sliding window 128, ModernBERT's local attention 128), batch 1, fp32, AdamW, no
checkpointing: `analytic` (what `estimate` predicts, on a CPU target: the attention kernel torch picks on the CPU)
against `measure` (the same step on real tensors, tracked by torch's MemTracker), the step's peak and the activations
at the forward pass's peak. On a GPU the same comparison runs with the device's own kernels (flash or
memory-efficient SDPA): `python -m lit_memory bench --gpu-proof`.

    python examples/long_sequences.py                      # every family, 1024 2048 4096 8192
    python examples/long_sequences.py --families qwen3 --lengths 1024 2048
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import families as fam  # noqa: E402

from lit_memory.memory.hardware.gpus import Target  # noqa: E402
from lit_memory.planning.prediction.analytic import analytic  # noqa: E402
from lit_memory.planning.prediction.simulate import measure  # noqa: E402
from lit_memory.planning.prediction.step import OptimizerSpec, Step  # noqa: E402

LONG = {
    "qwen3": {"max_position_embeddings": 8192},
    "llama": {"max_position_embeddings": 8192},
    "gemma3": {"max_position_embeddings": 8192, "sliding_window": 128},
    "modernbert": {"max_position_embeddings": 8192, "local_attention": 128},
}


def ratios(folder: Path, length: int, batch: int = 1) -> tuple[float, float, str]:
    step = Step(
        model={"model_name_or_path": str(folder), "num_labels": 2},
        optimizer=OptimizerSpec("torch.optim.AdamW", {"lr": 1e-3}),
        batch_size=batch, max_length=length, target=Target(type="cpu"),
    )
    predicted, measured = analytic(step, levels=False), measure(step)
    forward = [p.footprint.phases["forward"]["activations"] for p in (predicted, measured)]
    return predicted.footprint.peak / measured.footprint.peak, forward[0] / forward[1], predicted.attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(LONG))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print("| family | tokens | peak: predicted / tracked | forward activations: predicted / tracked | attention |")
        print("|---|---:|---:|---:|---|")
        for family in args.families:
            folder = fam.folder(family, Path(tmp), **LONG[family])
            for length in args.lengths:
                peak, forward, attention = ratios(folder, length)
                print(f"| {family} | {length} | {peak:.3f} | {forward:.3f} | {attention} |", flush=True)


if __name__ == "__main__":
    main()
