"""The activation model (lit_memory.planning.prediction.activation_model) at long sequences on the CPU: its
forward activations and the step's peak against the same step on real tensors (`measure`), for a windowed
family of each kind (Gemma 3's causal sliding window, ModernBERT's bidirectional local attention) and a
full-attention one with grouped-query k/v (Qwen3), at two lengths: the windows' O(L^2) masks and k/v as SDPA
receives them (issue 48; examples/long_sequences.py prints the table to 8,192 tokens)."""

from __future__ import annotations

import families as fam
import pytest

from lit_memory.memory.hardware.gpus import Target
from lit_memory.planning.prediction.analytic import analytic
from lit_memory.planning.prediction.simulate import measure
from lit_memory.planning.prediction.step import OptimizerSpec, Step

LONG = {
    "qwen3": {"max_position_embeddings": 2048},
    "gemma3": {"max_position_embeddings": 2048, "sliding_window": 128},
    "modernbert": {"max_position_embeddings": 2048, "local_attention": 128},
}


@pytest.mark.parametrize("family", list(LONG))
def test_long_sequence_activations_are_predicted_within_5_percent_of_the_tracked_tensors(family, tmp_path):
    folder = fam.folder(family, tmp_path, **LONG[family])
    for length in (1024, 2048):
        step = Step(
            model={"model_name_or_path": str(folder), "num_labels": 2},
            optimizer=OptimizerSpec("torch.optim.AdamW", {"lr": 1e-3}),
            batch_size=1, max_length=length, target=Target(type="cpu"),
        )
        predicted, measured = analytic(step, levels=False), measure(step)
        forward = [p.footprint.phases["forward"]["activations"] for p in (predicted, measured)]
        assert forward[0] == pytest.approx(forward[1], rel=0.05), length
        assert predicted.footprint.peak == pytest.approx(measured.footprint.peak, rel=0.05), length
