"""`python -m lit_memory estimate`: the run's settings read from recipes, the bars the recipes promise, the outputs.
The memory model itself: tests/memory/test_analytic.py."""

from __future__ import annotations

import json

import pytest
from conftest import CONFIGS, RECIPES

from lit_memory.__main__ import main
from lit_memory.memory.footprint import CATEGORIES

GiB = 2**30


def test_2gb_fits_2_gib_at_bert_large_both_ways_with_bf16_weights_and_8bit_state(capsys):
    """The issue's bar: BERT-large full fine-tuning at batch 32 x 128 predicted at most 2.0 GiB by both the
    analytic model and the simulation (estimate, as a user runs it)."""
    main(["estimate", "--json", "--config", str(RECIPES / "2gb.yaml"), "--config", str(CONFIGS / "bert-large.yaml")])
    data = json.loads(capsys.readouterr().out)
    assert data["setup"]["batch_size"] == 32 and data["setup"]["max_length"] == 128
    assert data["model"]["trainable"] == data["model"]["parameters"] > 330e6  # nothing frozen, no LoRA
    for method in ("analytic", "simulated"):
        footprint = data["predicted"][method]
        assert footprint["peak_bytes"] <= 2 * GiB, method
        categories = footprint["categories"]
        # bf16 weights (and the position/token-type id buffers): 2 B per parameter, no fp32 master copy
        assert categories["weights"] == pytest.approx(2 * data["model"]["parameters"], rel=0.001)
        # 8-bit moments: 2 x (1 B + a fp32 scale per 256) per value; bf16 state under 4096 values
        assert categories["optimizer"] / data["model"]["parameters"] == pytest.approx(2 * (1 + 4 / 256), rel=0.01)
    assert any("compiled code cannot run on fake tensors" in note for note in data["notes"])


def test_estimate_json_baseline_bert_large_is_above_10_gib(capsys):
    main(
        ["estimate", "--json", "--config", str(RECIPES / "baseline.yaml"), "--config", str(CONFIGS / "bert-large.yaml")]
    )
    data = json.loads(capsys.readouterr().out)
    assert set(data["predicted"]) == {"analytic", "simulated"}
    for method in ("analytic", "simulated"):
        footprint = data["predicted"][method]
        assert isinstance(footprint["peak_bytes"], int) and footprint["peak_bytes"] > 10 * GiB
        assert set(footprint["categories"]) == set(CATEGORIES)
        assert sum(footprint["categories"].values()) == footprint["peak_bytes"]
    assert data["model"]["file_bytes"]["fp32"] == 4 * data["model"]["parameters"]
    assert data["device"] == {"analytic": "cuda", "simulated": "cpu"}
    assert any("simulated on CPU" in note for note in data["notes"])


def test_estimate_without_simulation_prints_a_table(capsys):
    main(["estimate", "--no-simulate", "--device", "cpu", "--config", str(RECIPES / "accumulate.yaml")])
    out = capsys.readouterr().out
    for label in (
        "weights",
        "gradients",
        "optimizer state",
        "activations",
        "other/temporary",
        "peak",
        "inference",
        "model file",
    ):
        assert label in out
    assert "simulated (cpu)" not in out


def test_estimate_json_without_simulation_has_null_simulated_entries(capsys):
    main(["estimate", "--json", "--no-simulate", "--config", str(RECIPES / "accumulate.yaml")])
    data = json.loads(capsys.readouterr().out)
    assert data["predicted"]["simulated"] is None and data["inference_bytes"]["simulated"] is None
    assert data["setup"]["accumulate_grad_batches"] == 32 and data["setup"]["batch_size"] == 1


def test_estimate_reads_clipping_by_norm_from_the_trainer_settings(capsys):
    """fused.yaml with trainer.gradient_clip_val (norm by default): the measuring backward is predicted, its
    largest gradient (the word embeddings') at the peak; by value, nothing changes."""
    peaks = {}
    for clip in ([], ["--trainer.gradient_clip_val=1.0"], ["--trainer.gradient_clip_val=1.0", "--trainer.gradient_clip_algorithm=value"]):
        main(["estimate", "--json", "--no-simulate", "--config", str(RECIPES / "fused.yaml"), *clip])
        peaks[len(clip)] = json.loads(capsys.readouterr().out)["predicted"]["analytic"]
    assert peaks[1]["categories"]["gradients"] == 4 * 30522 * 384  # MiniLM's word embeddings
    assert peaks[1]["peak_bytes"] == peaks[0]["peak_bytes"] + 4 * 30522 * 384
    assert peaks[2] == peaks[0]


def test_unmodelled_precision_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--no-simulate", "--trainer.precision=transformer-engine"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().startswith("error: precision 'transformer-engine' is not modelled")


def test_under_fsdp_each_of_8_ranks_is_predicted_at_most_0_6_of_one_device(capsys):
    def peak(*more: str) -> int:
        args = ["--config", str(RECIPES / "4gb.yaml"), "--config", str(CONFIGS / "bert-large.yaml"), *more]
        main(["estimate", "--json", "--no-simulate", *args])
        return json.loads(capsys.readouterr().out)["predicted"]["analytic"]

    one = peak()
    sharded = peak("--config", str(CONFIGS / "fsdp.yaml"), "--trainer.devices=8")
    assert sharded["peak_bytes"] <= 0.6 * one["peak_bytes"]
    # weights and optimizer state are 1/8 each (plus the gathered units); activations are each rank's own
    assert sharded["categories"]["optimizer"] == pytest.approx(one["categories"]["optimizer"] / 8, rel=0.01)
    assert sharded["categories"]["activations"] == one["categories"]["activations"]
