"""`python -m lit_memory bench`: one real bench run (two recipes, the peer, --eval, --update-readme)
on a tiny random BERT, checked from its outputs; a failing recipe; bad input."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil

import pytest
from conftest import RECIPES

from lit_memory.__main__ import main
from lit_memory.config import shipped as shipped_files
from lit_memory.errors import UserError
from lit_memory.memory.measure import records
from lit_memory.memory.measure.footprint import format_bytes
from lit_memory.run.monitor import StepTimer
from lit_memory.tools import bench, bench_table
from lit_memory.tools import recipes as recipe_commands

# A 2-layer BERT with random weights on a few short samples: each recipe runs in seconds.
TINY = [
    "--model.model_name_or_path=bundled:bert-large",
    "--model.pretrained=false",
    "--model.config_overrides={num_hidden_layers: 2, hidden_size: 64, num_attention_heads: 4, intermediate_size: 128}",
    "--data.limit_train_samples=64",
    "--data.limit_eval_samples=16",
    "--data.batch_size=4",
    "--data.max_length=32",
]
REQUIRED = ["recipe", "peak_measured_bytes", "peak_predicted_bytes", "step_time_s", "samples_per_s", "val_f1"]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A copy of a checkout's recipes folder, so --update-readme writes there."""
    folder = tmp_path_factory.mktemp("shipped") / "recipes"
    shutil.copytree(RECIPES, folder, ignore=shutil.ignore_patterns("README.md", records.BENCH_JSON))
    start, end = bench_table.README_MARKERS
    (folder.parent / "README.md").write_text(f"# project\n\n{start}\nold table\n{end}\n\n## next section\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shipped_files, "PACKAGED", folder.parent / "not-installed")
        patch.setattr(shipped_files, "CHECKOUT", folder)
        yield folder


def table_rows(markdown: str) -> dict[str, list[str]]:
    """The cells of a bench Markdown table, by recipe."""
    lines = [line for line in markdown.splitlines() if line.startswith("| `")]
    return {line.split("`")[1]: [c.strip() for c in line.strip("|").split("|")] for line in lines}


@pytest.fixture(scope="module")
def run(shipped, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    args = ["--recipes", "fused,baseline", "--steps", "2", "--warmup", "2", "--eval", "--peer", "hf-trainer"]
    with pytest.MonkeyPatch.context() as patch:
        # What Lightning's launcher leaves in the process that launched ranks: each run must still be one process
        # (transformers.Trainer would otherwise wrap the peer's model in DDP, a copy of the gradients more).
        for name, value in {
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29555",
        }.items():
            patch.setenv(name, value)
        main(["bench", *args, "--update-readme", "--out", str(out), *TINY])
    with open(out / "bench.csv", newline="") as f:
        rows = {row["recipe"]: row for row in csv.DictReader(f)}
    return out, rows


def test_bench_writes_table_csv_json_and_chart_with_numbers_per_recipe(run, shipped, capsys):
    out, rows = run
    assert list(rows) == ["baseline", "fused"]  # tier order, whatever order they were asked in
    for name, row in rows.items():
        assert not row["error"], row["error"]
        for column in REQUIRED[1:-1]:
            assert float(row[column]) > 0, (name, column)
        assert 0 <= float(row["val_f1"]) <= 1  # validated once, after the step budget
        # bench reads the predicted and measured peaks of the same run (memory accounting keeps them within 10 %)
        assert abs(int(row["peak_predicted_bytes"]) / int(row["peak_measured_bytes"]) - 1) < 0.10
        assert float(row["samples_per_s"]) == pytest.approx(4 / float(row["step_time_s"]))  # batch 4, no accumulation
        times = json.loads((out / "runs" / name / StepTimer.FILE).read_text())
        assert len(times["step_times_s"]) == 2 and times["samples_per_step"] == 4  # the 2 steps after warm-up
        assert len(times["warmup_step_times_s"]) == 2
        assert float(row["process_growth_bytes"]) > 0  # on CPU: what the process grew by, beside the tensors

    table = table_rows((out / "bench.md").read_text())
    assert list(table) == ["baseline", "fused"]
    assert format_bytes(int(rows["baseline"]["peak_measured_bytes"])) in table["baseline"]
    assert (
        "| recipe | tracked tensors | peak predicted | peak in | process RSS growth |" in (out / "bench.md").read_text()
    )

    record = json.loads((out / "bench.json").read_text())
    assert [r["recipe"] for r in record["rows"]] == ["baseline", "fused"]
    assert record["command"].startswith("python -m lit_memory bench --recipes fused,baseline")
    assert record["machine"]["device"] == "cpu" and record["machine"]["torch"]
    header = (out / "bench.md").read_text().split("\n|")[0]
    assert record["command"] in header and f"torch {record['machine']['torch']}" in header

    from matplotlib.image import imread

    image = imread(out / "bench.png")
    assert image.shape[0] > 100 and image.shape[1] > 100

    # --update-readme: the checkout's recipes folder holds the same table and rows, and `recipes list` shows them.
    assert table_rows((shipped / "README.md").read_text()) == table
    assert records.read_bench(shipped / records.BENCH_JSON)["baseline"] == record["rows"][0]
    project = (shipped.parent / "README.md").read_text()  # the project README's copy, between its markers
    assert "old table" not in project and project.endswith("<!-- /bench table -->\n\n## next section\n")
    assert table_rows(project) == table
    recipe_commands.list_recipes()
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:] if line.strip()}
    baseline = record["rows"][0]
    assert format_bytes(baseline["peak_measured_bytes"]) in listed["baseline"]
    assert f"{baseline['samples_per_s']:.1f}" in listed["baseline"].split()


def test_the_peer_trains_the_same_settings_with_the_trainer_and_is_measured_the_same_way(run):
    out, rows = run
    baseline, fused = rows["baseline"], rows["fused"]
    # Same model, data and fp32 AdamW, same tensor tracker: the same memory within a few percent.
    assert float(baseline["memory_ours_over_peer"]) == pytest.approx(1.0, abs=0.05)
    assert float(baseline["peer_samples_per_s"]) > 0
    assert float(baseline["samples_per_s_ours_over_peer"]) == pytest.approx(
        float(baseline["samples_per_s"]) / float(baseline["peer_samples_per_s"])
    )
    # Host operators of one more step, ours and the Trainer's counted alike: the same model and optimizer kernel
    # dispatch about as many (the loading and logging around them differ by a few)
    assert float(baseline["host_ops_ours_over_peer"]) == pytest.approx(
        int(baseline["host_ops_per_step"]) / int(baseline["peer_host_ops_per_step"]))
    assert float(baseline["host_ops_ours_over_peer"]) == pytest.approx(1.0, abs=0.05)
    row = {r["recipe"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}["baseline"]
    assert row["top_host_ops"]["aten::addmm"] == row["peer_top_host_ops"]["aten::addmm"] > 0
    arguments = row["peer_training_arguments"]  # the Trainer's every setting, recorded: like for like
    assert arguments["max_grad_norm"] == 0.0 and arguments["optim"] == "adamw_torch_fused"
    assert arguments["dataloader_pin_memory"] is False and arguments["per_device_train_batch_size"] == 4
    assert fused["peer_note"] == "no Trainer equivalent (fused backward + step)"
    assert not fused["peer_peak_bytes"]
    assert "no Trainer equivalent" in table_rows((out / "bench.md").read_text())["fused"][-1]


def test_a_failing_recipe_is_a_row_with_its_error_not_a_crash(tmp_path, capsys):
    # The fused step refuses gradient accumulation: the fit exits with its one-line error.
    accumulate = "--trainer.accumulate_grad_batches=2"
    main(["bench", "--recipes", "fused", "--steps", "1", "--out", str(tmp_path), *TINY, accumulate])
    with open(tmp_path / "bench.csv", newline="") as f:
        (row,) = csv.DictReader(f)
    assert "cannot accumulate gradients" in row["error"] and not row["peak_measured_bytes"]
    assert "error: exit status 2: the fused step" in (tmp_path / "bench.md").read_text()
    assert "failed: fused" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recipes", "baseline,nope"], "error: unknown recipe 'nope'; choose one of: 2gb, 4gb,"),
        (["--recipes", "baseline,gone/mine.yaml"], "error: recipe file not found: gone/mine.yaml"),
        (["--peer", "deepspeed"], "error: unknown peer 'deepspeed'; choose one of: hf-trainer"),
        (["--steps", "0"], "error: --steps must be at least 1, got 0"),
        (["--warmup", "1"], "error: --warmup must be at least 2"),
        (["--recipes", "baseline", "--config", "gone.yaml"], 'error: recipe baseline: Parser key "config": File'),
    ],
)
def test_bad_input_is_one_line_before_anything_runs(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *args, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_missing_bench_extra_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(SystemExit):
        main(["bench", "--recipes", "baseline", "--peer", "hf-trainer", "--out", str(tmp_path / "out")])
    assert capsys.readouterr().err == "error: bench needs accelerate: pip install 'lit-memory[bench]'\n"
    assert not (tmp_path / "out").exists()


def test_update_readme_refuses_an_installed_package_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shipped_files, "PACKAGED", RECIPES)  # as if installed from the wheel
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--recipes", "baseline", "--update-readme", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: --update-readme writes into a checkout's recipes/")
    assert not (tmp_path / "out").exists()


def test_all_runs_the_reference_tiers_in_their_order_then_ours():
    order = bench.ordered("all")
    assert order[:6] == list(bench.REFERENCE_TIERS)
    assert sorted(order) == shipped_files.names()
    assert bench.ordered("4gb,baseline, freeze.yaml") == ["baseline", "freeze", "4gb"]


def test_recipe_files_join_the_shipped_recipes_under_their_own_names(tmp_path):
    variant = tmp_path / "4gb-variant.yaml"
    variant.write_text((RECIPES / "4gb.yaml").read_text())
    assert bench.ordered(f"{variant},4gb") == ["4gb", str(variant)]
    runs = bench.prepare([str(variant)], [], tmp_path / "out", 2, 1, False, None)
    assert runs[0].recipe == "4gb-variant" and runs[0].fit_args[:2] == ["--config", str(variant)]
    clash = tmp_path / "4gb.yaml"
    clash.write_text(variant.read_text())
    with pytest.raises(UserError, match="two recipes named 4gb in --recipes"):
        bench.ordered(f"4gb,{clash}")


def test_a_runs_error_names_the_cause_of_a_chained_traceback(tmp_path):
    """A run that dies in a traceback whose last exception wraps another (transformers' lazy import turns any import
    failure into "Could not import module ..."): the row's error names the first exception, the cause, too."""
    import sys

    from lit_memory.tools import bench

    code = (
        "try:\n    raise RuntimeError('cuInit: operation not permitted')\n"
        "except RuntimeError as e:\n    raise ModuleNotFoundError(\"Could not import module 'PreTrainedModel'\") "
        "from e\n"
    )
    error = bench._run([sys.executable, "-c", code], tmp_path / "log")
    assert error == ("exit status 1: ModuleNotFoundError: Could not import module 'PreTrainedModel' "
                     "(cause: RuntimeError: cuInit: operation not permitted)")
    assert bench._run([sys.executable, "-c", "import sys; print('error: no such column'); sys.exit(2)"],
                      tmp_path / "log2") == "exit status 2: no such column"
