"""The picture of a step (memory.png): drawn after every fit from memory.json, by `estimate --plot` before a run, on an
out-of-memory error with where the step crossed the limit; torch's CUDA memory snapshot on request."""

from __future__ import annotations

import builtins
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CONFIGS, FAST, RECIPES

from lit_memory.__main__ import main
from lit_memory.cli import resolve
from lit_memory.hf.anatomy import find_layers
from lit_memory.memory.hardware.gpus import target
from lit_memory.memory.measure import picture, records
from lit_memory.memory.measure.footprint import CATEGORIES
from lit_memory.planning.prediction.analytic import analytic
from lit_memory.run.memory_callbacks import MemorySnapshot

PNG = b"\x89PNG\r\n\x1a\n"
MEASURE = ["--data.padding=max_length", "--trainer.limit_val_batches=0", "--model.save_pretrained=false"]


def totals(points: list[dict]) -> list[int]:
    return [sum(p["categories"][c] for c in CATEGORIES) for p in points]


def test_a_fit_draws_its_step_predicted_beside_measured_from_memory_json(tmp_path, capsys):
    args = ["--config", str(RECIPES / "fused.yaml"), *FAST, *MEASURE, f"--trainer.default_root_dir={tmp_path}"]
    run = resolve(["fit", *args])
    run.launch()
    run_dir = Path(run.trainer.log_dir)
    out = capsys.readouterr().out
    assert f"memory picture: {run_dir / 'memory.png'}" in out.splitlines()
    assert (run_dir / "memory.png").read_bytes()[:8] == PNG
    record = records.read_memory(run_dir)
    timeline = record["timeline"]
    measured, predicted = timeline["measured"], timeline["predicted"]
    assert measured["batch_shape"] == predicted["batch_shape"] == record["batch_shape"]  # padded to max_length
    # The predicted points are the analytic model's step at that shape, as estimate --plot draws it.
    rows, tokens = predicted["batch_shape"]
    step = replace(run.step().on(target("cpu")), batch_size=rows, max_length=tokens)
    assert predicted["points"] == analytic(step, levels=False, timeline=True).timeline
    # The measured points: the tracker at each layer's forward and backward and the phases' edges; the step's
    # highest point between them is the tracked peak, which the measured points never exceed.
    labels = [p["label"] for p in measured["points"]]
    layers = len(find_layers(run.model.model))
    assert labels[0] == "start" and "forward: head and loss" in labels
    assert all(f"forward: layer {i}" in labels and f"backward: layer {i}" in labels for i in range(1, layers + 1))
    tracked_peak = record["measured"]["tracked"]["peak_bytes"]
    assert max(totals(measured["points"])) <= tracked_peak
    # the analytic step's peak is within 10 % of the tracked peak, as the analytic footprint is (test_monitor)
    assert max(totals(predicted["points"])) == pytest.approx(tracked_peak, rel=0.10)
    # What the picture plots is memory.json's: the predicted totals, the measured ones at their points, the peak.
    series = picture.of_record(record, "t").series()
    assert series["predicted"] == totals(predicted["points"])
    drawn = [p for p in measured["points"] if p["label"] in series["labels"]]
    assert [v for _, v in series["measured"]] == totals(drawn)
    # the fused step has no optimizer step of its own (its buckets step in backward): that point has no place
    assert [p["label"] for p in measured["points"] if p not in drawn] == ["optimizer step"]
    assert series["lines"]["measured peak"] == tracked_peak
    assert series["lines"]["predicted peak"] == max(totals(predicted["points"]))


def test_estimate_plot_draws_two_recipes_side_by_side_for_one_card(tmp_path, capsys):
    out = tmp_path / "cmp.png"
    bert = ["--config", str(CONFIGS / "bert-large.yaml")]
    main(["estimate", "--gpu", "rtx3050-4gb", "--plot", str(out), *bert, "--config", str(RECIPES / "bf16.yaml"),
          "--vs", *bert, "--config", str(RECIPES / "4gb.yaml")])
    printed = capsys.readouterr().out
    assert out.read_bytes()[:8] == PNG and printed.splitlines()[-1] == f"memory picture: {out}"
    verdicts = [line for line in printed.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 2 and verdicts[0].startswith("verdict: does not fit") and "verdict: fits" in verdicts[1]
    # the panels are the analytic steps: 4gb takes the gradients away (fused) and shrinks the activations
    import argparse

    from lit_memory.tools.estimate import add_target_arguments, panel, step_of

    parser = argparse.ArgumentParser()
    add_target_arguments(parser)
    peaks = {}
    for recipe in ("bf16", "4gb"):
        options, rest = parser.parse_known_args(
            ["--gpu", "rtx3050-4gb", *bert, "--config", str(RECIPES / f"{recipe}.yaml")]
        )
        step = step_of(rest, options)
        prediction = analytic(step)
        drawn = panel(step, prediction, recipe)
        series = drawn.series()
        assert series["predicted"] == totals(analytic(step, levels=False, timeline=True).timeline)
        assert series["lines"]["predicted device total"] == prediction.footprint.device
        assert series["lines"]["card less the margin"] == int(step.target.gpu.memory * 0.92)
        peaks[recipe] = {c: max(p["categories"][c] for p in drawn.predicted) for c in CATEGORIES}
    assert peaks["4gb"]["gradients"] < peaks["bf16"]["gradients"] / 10
    assert peaks["4gb"]["activations"] < peaks["bf16"]["activations"] / 2


def test_vs_without_plot_and_plot_without_matplotlib_are_one_error_line(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["estimate", "--config", str(RECIPES / "bf16.yaml"), "--vs", "--config", str(RECIPES / "4gb.yaml")])
    assert capsys.readouterr().err == "error: --vs compares runs in a picture: give --plot FILE\n"
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)
    with pytest.raises(SystemExit):
        main(["estimate", "--plot", str(tmp_path / "x.png")])
    assert capsys.readouterr().err == (
        "error: --plot draws with matplotlib, which is not installed: pip install 'lit-memory[plot]'\n"
    )
    assert picture.draw([picture.Panel("t", [{"label": "a", "categories": {}}])], tmp_path / "y.png") is None
    assert not list(tmp_path.iterdir())


def test_the_crossing_is_the_first_point_above_the_limit():
    points = [{"label": f"p{i}", "categories": {"activations": v}} for i, v in enumerate([1, 5, 9, 4])]
    points[2]["between"] = True
    assert picture.crossing(points, 4)["label"] == "p1"
    assert picture.crossing(points, 9) is None
    assert picture.where(points[2]) == "just before p2" and picture.where(points[1]) == "at p1"


def test_a_snapshot_on_cpu_is_one_error_line_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", *FAST, f"--trainer.default_root_dir={tmp_path}", "--memory.snapshot=snap.pickle"])
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: memory.snapshot records the CUDA caching allocator's history")
    assert "this run is on cpu" in err[-1]
    assert not list(tmp_path.rglob("memory.json")) and not list(tmp_path.rglob("snap.pickle"))


def test_on_cuda_the_snapshot_records_the_first_steps_into_the_run_folder(tmp_path, capsys):
    calls = []

    class Seams(MemorySnapshot):
        def record_history(self, on):
            calls.append(("record", on))

        @staticmethod
        def dump(path):
            calls.append(("dump", path))
            Path(path).write_bytes(b"snapshot")

    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)),
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        world_size=1,
        global_rank=0,
        global_step=0,
    )
    snapshot = Seams("snap.pickle", steps=2)
    snapshot.setup(trainer, None, "fit")
    for step in (1, 2, 3):
        trainer.global_step = step
        snapshot.on_train_batch_end(trainer, None, None, None, step)
    snapshot.on_fit_end(trainer, None)
    assert calls == [("record", True), ("dump", tmp_path / "snap.pickle"), ("record", False)]  # once, after step 2
    err = capsys.readouterr().err
    assert f"memory snapshot (2 optimizer steps): {tmp_path / 'snap.pickle'}" in err
    assert "https://pytorch.org/memory_viz" in err and "python -m torch.cuda._memory_viz trace_plot" in err


def test_the_fused_buckets_are_named_by_the_layers_they_hold():
    """The x axis of a fused step names each bucket by what it holds, in forward order (it said ``bucket 2 of 12``,
    ``bucket 1``, ..., ``12, 11, 10, 9``): in backward's order, the head, the layers from the last down, the
    embeddings; several buckets of one part numbered."""
    import re

    run = resolve(["fit", "--config", str(RECIPES / "fused.yaml")])  # MiniLM: 6 layers, a bucket each
    step = run.step().on(target("cpu"))
    labels = [p["label"] for p in analytic(step, levels=False, timeline=True).timeline
              if p["label"].startswith("step: ") and not p.get("between")]
    assert labels and len(labels) == len(set(labels)) and not any("bucket" in label for label in labels)
    layers = [int(m[1]) for label in labels if (m := re.fullmatch(r"step: layer (\d+)", label))]
    assert layers == [6, 5, 4, 3, 2, 1]
    assert labels[0].startswith("step: head") and labels[-1].startswith("step: embeddings")
