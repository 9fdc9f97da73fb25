"""``bench --quality`` (lit_memory.tools.quality): the routes' commands, the record, its table and README's line from a
fixture, the HF Trainer's route on two steps; the measurement itself is docs/benchmarks.md's (minutes, not a test)."""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

import pytest
from conftest import FAST

from lit_memory.errors import UserError
from lit_memory.tools import quality

RECORD = {
    "command": "python -m lit_memory bench --quality", "rows": 4000, "seeds": [1, 2, 3],
    "machine": {"cores": 2, "cpu": "AMD EPYC", "torch": "2.13.0+cpu", "transformers": "5.25.0"},
    "peer_configuration": {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 1,
                           "gradient_checkpointing": True, "optim": "adamw_bnb_8bit", "precision": "bf16-true",
                           "configuration": "bf16 weights (the model loaded in bf16: no fp32 master copy)"},
    "routes": {
        "4gb": {"why": "ours", "runs": [
            {"seed": s, "val_acc": a, "val_f1": f, "val_f1_macro": m}
            for s, a, f, m in ((1, 0.87, 0.78, 0.84), (2, 0.88, 0.80, 0.86), (3, 0.86, 0.77, 0.83))]},
        "4gb-peer": {"why": "theirs", "runs": [{"seed": 1, "val_acc": 0.70, "val_f1": 0.0, "val_f1_macro": 0.41},
                                               {"seed": 2, "error": "exit status 1: boom"}]},
    },
}


def test_the_table_gives_each_metrics_mean_spread_and_range_over_the_seeds_and_readme_one_line():
    text = quality.table(RECORD)
    rows = {line.split("`")[1]: [c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")}
    macro = [0.84, 0.86, 0.83]
    assert rows["4gb"][5] == f"{statistics.fmean(macro):.4f} ± {statistics.stdev(macro):.4f}; 0.8300-0.8600"
    assert rows["4gb"][2] == "3" and rows["4gb-peer"][2] == "1 (1 failed)"
    assert rows["4gb-peer"][5] == "0.4100 ± 0.0000; 0.4100-0.4100"
    line = quality.readme_line(RECORD)
    assert "`4gb` 0.8433 (0.8300-0.8600)" in line and "`4gb-peer` 0.4100 (0.4100-0.4100)" in line
    caption = quality.caption(RECORD)
    assert "125 optimizer steps" in caption and "micro-batch 32 x 1, adamw_bnb_8bit" in caption


def test_update_docs_writes_between_the_markers_and_refuses_a_file_without_them(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(f"# B\n{quality.MARKERS[0]}\nold\n{quality.MARKERS[1]}\nafter\n")
    (tmp_path / "README.md").write_text(f"intro\n{quality.LINE_MARKERS[0]}\nold\n{quality.LINE_MARKERS[1]}\n")
    quality.update_docs(RECORD, tmp_path)
    benchmarks = (tmp_path / "docs" / "benchmarks.md").read_text()
    generated = f"{quality.caption(RECORD)}\n\n{quality.table(RECORD)}"
    assert f"{quality.MARKERS[0]}\n{generated}\n{quality.MARKERS[1]}\nafter" in benchmarks
    assert f"\n{quality.readme_line(RECORD)}\n" in (tmp_path / "README.md").read_text()
    (tmp_path / "README.md").write_text("no markers\n")
    with pytest.raises(UserError, match="has no place for it"):
        quality.update_docs(RECORD, tmp_path)


def test_each_route_runs_once_per_seed_in_its_own_process_and_a_failed_run_is_a_row_of_its_own(tmp_path, monkeypatch):
    chosen = {k: v for k, v in RECORD["peer_configuration"].items()}
    monkeypatch.setattr(quality, "peer_configuration", lambda: dict(chosen))
    seen = []

    def fake(command, log):  # writes what the real run would, from its command line
        seen.append(command)
        seed = int(next(a for a in command if a.startswith("--seed_everything=")).split("=")[1])
        if "lit_memory.tools.peer" in command:
            run_dir = Path(command[command.index("--out") + 1])
            (run_dir / "quality.json").write_text(json.dumps({"val_acc": 0.7, "val_f1": 0.1, "val_f1_macro": 0.45}))
            return None
        if seed == 2 and any("bf16_stochastic_round" in a for a in command):
            return "exit status 1: faked"
        run_dir = Path(next(a.split("=", 1)[1] for a in command if a.startswith("--trainer.default_root_dir=")))
        (run_dir / "metrics.csv").write_text("step,val_acc,val_f1,val_f1_macro\n124,0.88,0.79,0.85\n")
        return None

    record = quality.measure(["4gb", "4gb-peer", "bf16-sr"], [1, 2], 4000, tmp_path, run=fake)
    assert [len(r["runs"]) for r in record["routes"].values()] == [2, 2, 2]
    assert record["routes"]["4gb"]["runs"][0]["val_f1_macro"] == 0.85
    assert record["routes"]["bf16-sr"]["runs"][1]["error"] == "exit status 1: faked"
    peer = next(c for c in seen if "lit_memory.tools.peer" in c)
    assert "--steps=125" in peer and json.loads(peer[peer.index("--warmup=0") + 2].split("=", 1)[1]) == {
        k: v for k, v in chosen.items() if k != "configuration"}
    ours = next(c for c in seen if "bf16_stochastic_round" in shlex.join(c))
    assert "--trainer.precision=bf16-true" in ours and "--model.optimizer.class_path=torchao.optim.AdamW8bit" in ours
    assert any(a.endswith("recipes/4gb.yaml") for a in ours) and "--data.limit_train_samples=4000" in ours


def test_the_trainers_4gb_configuration_is_the_gpu_proofs_4gb_peer_for_bert_large():
    chosen = quality.peer_configuration()
    assert chosen["precision"] == "bf16-true" and chosen["optim"] == "adamw_bnb_8bit"
    assert chosen["gradient_checkpointing"]
    assert chosen["per_device_train_batch_size"] * chosen["gradient_accumulation_steps"] == 32


def test_the_trainers_route_trains_bf16_weights_and_is_validated_as_ours_on_two_steps(tmp_path):
    from lit_memory.tools.peer import validated

    args = ["--config", str(quality.shipped.recipe_path("4gb")), *[a for a in FAST if not a.startswith("--trainer.")],
            "--trainer.accelerator=cpu", "--seed_everything=1"]
    arguments = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_checkpointing": True,
                 "optim": "adamw_bnb_8bit", "precision": "bf16-true"}
    metrics = validated(args, arguments, 2, tmp_path)
    assert {"val_acc", "val_f1", "val_f1_macro"} <= set(metrics)
    assert all(0.0 <= metrics[k] <= 1.0 for k in ("val_acc", "val_f1", "val_f1_macro"))


def test_the_committed_quality_table_and_readme_line_are_the_committed_records():
    record = json.loads((quality.ROOT / "docs" / "quality" / "quality.json").read_text())
    benchmarks = (quality.ROOT / "docs" / "benchmarks.md").read_text()
    generated = f"{quality.caption(record)}\n\n{quality.table(record)}"
    assert f"{quality.MARKERS[0]}\n{generated}\n{quality.MARKERS[1]}" in benchmarks
    readme = (quality.ROOT / "README.md").read_text()
    assert f"{quality.LINE_MARKERS[0]}\n{quality.readme_line(record)}\n{quality.LINE_MARKERS[1]}" in readme
    for entry in record["routes"].values():
        assert len(entry["runs"]) == 3 and not any("error" in run for run in entry["runs"])
