"""`python -m lit_memory bench --gpu-proof`: its dry run on this CPU (every recipe resolved, the data written, the
tiers capped at their cards), and the record it writes from a run's memory.json."""

from __future__ import annotations

import csv
import json
import shlex

import pytest
from conftest import RECIPES

from lit_memory.__main__ import main
from lit_memory.errors import UserError
from lit_memory.memory.hardware.gpus import GPUS
from lit_memory.memory.measure import records
from lit_memory.memory.measure.footprint import Footprint
from lit_memory.tools import proof, proof_tables

GiB = 2**30


def test_the_dry_run_resolves_every_recipe_on_bert_large_with_the_tiers_capped(tmp_path, capsys):
    main(["bench", "--gpu-proof", "--dry-run", "--out", str(tmp_path)])
    assert "nothing trained" in capsys.readouterr().out
    planned = json.loads((tmp_path / "gpu-proof-runs.json").read_text())["runs"]
    runs = {r["recipe"]: shlex.split(r["fit"]) for r in planned if "fit" in r}
    assert set(runs) == {p.stem for p in RECIPES.glob("*.yaml")} | set(proof.VARIANTS)
    # 2gb.yaml under its 2 GiB as a cap: the allocator's room under the cap (its check counts a request's whole
    # segment: `Replay.room`) leaves no plan within the margin; refused before training, its row says why
    refused = {r["recipe"]: r["refused"] for r in planned if "refused" in r}
    assert set(refused) == {"2gb"} and "of room the allocator needs under the cap" in refused["2gb"]
    runs = {name: args for name, args in runs.items() if name not in refused}
    # the HF Trainer alone, on 4gb.yaml's model and data under its budget, in its best configuration there
    peer = {r["recipe"]: shlex.split(r["peer"]) for r in planned if "peer" in r}
    assert set(peer) == set(proof.PEER_ROWS) and "--best-under-budget" in peer["4gb-peer"]
    assert proof.budget_of(peer["4gb-peer"]) == "rtx3050-4gb" and peer["4gb-peer"][:3] == [
        "python",
        "-m",
        "lit_memory.tools.peer",
    ]
    for name, args in runs.items():
        assert "--model.model_name_or_path=bundled:bert-large" in args and "--model.pretrained=false" in args, name
        assert (
            "--trainer.accelerator=cuda" in args
            and "--memory.simulate=false" in args
            and "--memory.track_steps=0" in args
        )
        assert "--data.padding=max_length" in args
    assert "--memory.budget=rtx3050-4gb" in runs["4gb"] and "--memory.budget=2560MiB" in runs["2gb-2560mib"]
    assert not any(a.startswith("--memory.budget") for a in runs["baseline"])
    # a variant: its recipe, then its own settings after the tier's budget (the last budget is the one that applies)
    assert proof.budget_of(runs["4gb-fp16"]) == "gtx1650" and "--trainer.precision=16-mixed" in runs["4gb-fp16"]
    configs = [runs["fsdp"][i + 1] for i, a in enumerate(runs["fsdp"]) if a == "--config"]
    assert proof.budget_of(runs["fsdp"]) == "rtx3050-4gb" and configs[-1].endswith("configs/fsdp.yaml")  # capped
    assert "--trainer.devices=1" in runs["fsdp"] and "--memory.snapshot=memory_snapshot.pickle" in runs["4gb-snapshot"]
    # 20 timed steps after 3 warm-up ones, 3 for the seed's accumulating tiers, then one whose host operators are
    # counted; bf16, 4gb and their compiled recipes profile one more
    assert "--trainer.max_steps=25" in runs["bf16"] and "--trainer.max_steps=24" in runs["baseline"]
    assert "--trainer.max_steps=7" in runs["accumulate"] and any("HostOpCounter" in a for a in runs["baseline"])
    assert any("StepProfiler" in a for a in runs["4gb-compile"])
    assert any("StepProfiler" in a for a in runs["4gb"]) and not any("StepProfiler" in a for a in runs["fused"])
    with open(tmp_path / "synthetic.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == proof.ROWS and {r["label"] for r in rows} == {"0", "1"}
    assert min(len(r["text"].split()) for r in rows) >= 128  # every row truncates to a full sequence


def test_a_recipes_record_puts_each_measured_level_beside_its_prediction(tmp_path):
    footprint = Footprint(
        {"backward": {"weights": 2 * GiB, "gradients": 0, "optimizer": GiB, "activations": 0, "other": 0}},
        reserved=int(3.1 * GiB),
        context=400 * 2**20,
    )
    cuda = {"max_allocated_bytes": int(3.3 * GiB), "max_reserved_bytes": int(3.2 * GiB),
            "max_device_bytes": int(3.6 * GiB), "device_source": "nvml (this process)", "peak_phase": "backward"}
    record = records.memory_record(
        device={
            "type": "cuda",
            "name": "NVIDIA H100 80GB HBM3",
            "total_bytes": GPUS["h100"].memory,
            "limit_bytes": None,
        },
        world_size=1,
        batch_shape=[32, 128],
        batches=5,
        tracked_batches=0,
        optimizer_steps=5,
        predicted={"analytic": footprint, "simulated": None},
        measured={"tracked": None, "process": None, "cuda": cuda},
    )
    records.write_memory(tmp_path, record)
    row = proof.proof_row("4gb", {"samples_per_s": 120.0, "step_time_s": 0.27}, tmp_path, "rtx3050-4gb")
    assert row["measured_bytes"] == {"tensors": cuda["max_allocated_bytes"], "reserved": cuda["max_reserved_bytes"],
                                     "device": cuda["max_device_bytes"]}
    assert row["predicted_bytes"]["device"] == footprint.device
    assert row["measured_over_predicted"]["tensors"] == round(3.3 / 3.0, 4)
    assert row["device_source"] == "nvml (this process)" and row["samples_per_s"] == 120.0
    assert row["within_budget"] and row["spare"] == round(1 - cuda["max_device_bytes"] / GPUS["rtx3050-4gb"].memory, 4)
    assert proof.proof_row("lora", {"error": "exit status 1: out of memory"}, tmp_path / "none", None)["error"]
    (tmp_path / "memory_snapshot.pickle").write_bytes(b"x" * 10)  # the 4gb-snapshot variant's, beside memory.json
    assert proof.proof_row("4gb-snapshot", {}, tmp_path, "rtx3050-4gb")["snapshot"]["bytes"] == 10


def test_a_record_reads_back_as_the_table_docs_gpu_shows(capsys):
    """Every committed record (docs/gpu/<gpu>.json) shows one line per recipe, each measured level beside its
    ratio, the capped tiers with what was left of their card, a refusal with its reason; docs/gpu.md shows the
    H100's table exactly as `--show` prints it."""
    records_ = sorted(proof.DOCS.glob("*.json"))
    assert records_, "no GPU record committed"
    for path in records_:
        main(["bench", "--gpu-proof", "--show", str(path)])
        lines = capsys.readouterr().out.strip().splitlines()
        record = json.loads(path.read_text())
        assert len(lines) == 2 + len(record["recipes"])
        for row, line in zip(record["recipes"], lines[2:]):
            assert line.startswith(f"| {row['recipe']} |")
            ratios = row.get("measured_over_predicted") or {}
            for level, ratio in ratios.items():
                assert f"{row['measured_bytes'][level] / GiB:.2f} ({ratio:.3f})" in line
            if row.get("within_budget"):
                assert f"{row['spare']:.1%} to spare" in line
            if row.get("error"):
                assert row["error"] in line
    main(["bench", "--gpu-proof", "--show", str(proof.DOCS / "h100.json")])
    assert capsys.readouterr().out.strip() in (proof.DOCS.parent / "gpu.md").read_text()


def test_within_the_card_every_step_needs_every_step_read_and_the_allocators_retries_are_counted():
    limit = GPUS["rtx3050-4gb"].memory
    read = proof.every_step([int(3.4 * GiB)] * 3, 3, limit)
    assert read["within_budget_every_step"] and "unread_steps" not in read
    # h200.json's 4gb: steps 3-23 stored as 0, as if read; null now, and the claim fails on them
    unread = proof.every_step([int(3.4 * GiB), None, int(3.5 * GiB)], 5, limit)
    assert not unread["within_budget_every_step"] and unread["unread_steps"] == [1, 3, 4]
    assert not proof.every_step([int(3.9 * GiB)], 1, limit)["within_budget_every_step"]
    counts = proof.allocator_counts(
        {"alloc_retries_by_step": [2, 1, 0, 0, 1, 0, 0, None], "device_allocs_by_step": [9, 0]}
    )
    assert counts["alloc_retries_per_10_steps"] == 2.5 and counts["device_allocs_by_step"] == [9, 0]  # after 3 warm-up
    assert counts["alloc_retries_per_step"] == 0.25 and "cap_headroom_bytes" not in counts  # no cap: none read
    capped = proof.allocator_counts({"allocator_cap_bytes": 3144 * 2**20, "max_reserved_bytes": 2952 * 2**20})
    assert capped["cap_headroom_bytes"] == 192 * 2**20  # h200.json's 4gb: the room its allocator never used


def test_the_peer_row_stands_beside_the_recipe_it_is_the_trainers_answer_to():
    bench_row = {
        "recipe": "4gb-peer",
        "flops_per_step": 10e12,
        "recompute_share": 0.2,
        "peer_samples_per_s": 100.0,
        "peer_step_time_s": 0.32,
        "peer_host_ops_per_step": 9000,
        "peer_training_arguments": {"optim": "adamw_bnb_8bit"},
        "peer_chosen": {"precision": "bf16-true"},
        "peer_device_bytes_by_step": [int(3.5 * GiB)] * 2,
        "peer_alloc_retries_by_step": [3, 0, 0, 1, 0],
        "peer_allocator_limit_bytes": int(3.07 * GiB),
        "peer_reserved_bytes": int(2.8 * GiB),
    }
    card = {"name": "NVIDIA H200", "total_bytes": GPUS["h200"].memory}
    row = proof.peer_row("4gb-peer", bench_row, "rtx3050-4gb", card)
    assert row["peer_of"] == "4gb" and row["precision"] == "bf16-true" and row["samples_per_s"] == 100.0
    assert row["training_arguments"] == {"optim": "adamw_bnb_8bit"} and row["host_ops_per_step"] == 9000
    assert row["mfu"] == round(8e12 / 0.32 / 1e12 / GPUS["h200"].tflops, 4)  # the model's FLOPs, its recompute apart
    assert row["within_budget_every_step"] and "measured_bytes" not in row  # not a memory-model row
    assert row["alloc_retries_per_step"] == 0.5 and row["cap_headroom_bytes"] == int(3.07 * GiB) - int(2.8 * GiB)
    ours = {"recipe": "4gb", "samples_per_s": 150.0}
    proof.with_peer_rows([ours, row])
    assert ours["peer_samples_per_s"] == 100.0 and ours["samples_per_s_ours_over_peer"] == 1.5


def test_readmes_speed_table_comes_from_the_newest_record(tmp_path):
    old = {"command": "python -m lit_memory bench --gpu-proof", "machine": {"device": "NVIDIA H100 80GB HBM3"},
           "recipes": [{"recipe": "bf16", "samples_per_s": 300.0}]}
    new = {
        **old,
        "date": "2026-12-01",
        "machine": {"device": "NVIDIA H200"},
        "recipes": [
            {
                "recipe": "bf16",
                "samples_per_s": 410.0,
                "mfu": 0.098,
                "peer_samples_per_s": 400.0,
                "samples_per_s_ours_over_peer": 1.025,
                "step_time_s": 0.078,
                "step_time_min_s": 0.075,
                "step_time_max_s": 0.09,
                "host_ops_per_step": 15000,
                "alloc_retries_per_step": 0.05,
            },
            {
                "recipe": "4gb",
                "samples_per_s": 300.0,
                "within_budget": True,
                "spare": 0.05,
                "within_budget_every_step": False,
                "unread_steps": [4],
            },
            {
                "recipe": "4gb-peer",
                "peer_of": "4gb",
                "samples_per_s": 250.0,
                "chosen": {"configuration": "bf16 weights"},
                "training_arguments": {"per_device_train_batch_size": 32},
            },
            {"recipe": "lora"},
        ],
    }
    (tmp_path / "h100.json").write_text(json.dumps(old))
    (tmp_path / "h200-speed.json").write_text(json.dumps(new))
    assert proof_tables.newest_record(tmp_path).name == "h200-speed.json"  # dated: newer than a record without a date
    failed = {
        **new,
        "date": "2026-12-02",
        "recipes": [
            {"recipe": "bf16", "error": "exit status 1: ..."},
            {"recipe": "4gb-peer", "peer_of": "4gb", "samples_per_s": 186.4},
        ],
    }
    (tmp_path / "h200-sandboxed.json").write_text(json.dumps(failed))
    # newer, but none of ours trained: not the source
    assert proof_tables.newest_record(tmp_path).name == "h200-speed.json"
    text = proof_tables.speed_table(new, "docs/gpu/h200-speed.json")
    assert text.startswith("Measured on one NVIDIA H200 on 2026-12-01")
    rows = {
        line.split("`")[1]: [c.strip() for c in line.strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| `")
    }
    assert rows["bf16"][1:9] == ["410.0", "9.8%", "400.0", "1.02", "75 / 78 / 90", "0.05", "-", "15000"]
    assert rows["4gb"][-1] == "peak within the card, 5.0% to spare; not every step shown (1 unread)"
    assert rows["4gb-peer"][-1] == "the HF Trainer alone: bf16 weights, micro-batch 32" and "lora" not in rows
    readme = tmp_path / "README.md"
    readme.write_text("intro\n")
    with pytest.raises(UserError, match="no place for the speed table"):
        proof_tables.update_readme(text, readme)
    readme.write_text(f"intro\n{proof_tables.SPEED_MARKERS[0]}\nold\n{proof_tables.SPEED_MARKERS[1]}\nrest\n")
    proof_tables.update_readme(text, readme)
    assert (
        readme.read_text() == f"intro\n{proof_tables.SPEED_MARKERS[0]}\n{text}{proof_tables.SPEED_MARKERS[1]}\nrest\n"
    )


# -- a lent GPU's call: rows in order, the record after every row, each row within what is left ---------------------


class Clock:
    """A call's clock that moves only when a faked process runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run_of(name, out, note=None, **kwargs):
    from lit_memory.tools.bench import BenchRun

    args = ["--config", f"recipes/{proof.recipe_of(name)}.yaml", f"--trainer.default_root_dir={out / 'runs' / name}"]
    return BenchRun(name, args, args, note, out / "runs" / name, **kwargs)


def test_a_call_saves_its_record_after_every_row_and_gives_each_row_what_is_left_of_it(tmp_path):
    from lit_memory.tools.bench import Deadline

    clock = Clock()
    deadline = Deadline(200.0, reserve=10.0, least=20.0, clock=clock)
    out, mirror = tmp_path / "proof", tmp_path / "OUT"
    (out / "logs").mkdir(parents=True)
    target = tmp_path / "docs" / "h100-speed.json"
    card = {"name": "NVIDIA H100 80GB HBM3", "total_bytes": GPUS["h100"].memory}
    info = {"command": "python -m lit_memory bench --gpu-proof --recipes=call1"}
    call = proof.Call(target, mirror, card, info, out / "logs")
    runs = [_run_of("bf16", out), _run_of("4gb", out, "no Trainer equivalent (fused backward + step)"),
            _run_of("4gb-peer", out, peer_only=True, peer_flags=("--best-under-budget",)), _run_of("baseline", out)]
    takes = {"sandbox-probe.log": 20, "bf16.log": 30, "bf16.peer.log": 30, "4gb.log": 40, "4gb-peer.log": 60}
    seen = []

    def runner(command, log, timeout=None):  # a process: the record in $OUT as it stood, the limit it was given
        saved = json.loads((mirror / target.name).read_text())["recipes"] if (mirror / target.name).is_file() else []
        seen.append((log.name, [row["recipe"] for row in saved], timeout))
        log.write_text("cuda ok (True, 1)\nmatmul FAILED\n" if log.name == "sandbox-probe.log" else "a fit's log\n")
        clock.now += takes[log.name]
        return None if log.name == "sandbox-probe.log" else "exit status 1: faked"

    first = [proof.probe_row(out, deadline, runner)]
    call.save(first)
    rows = proof.run_call(call, runs, first, out, True, deadline, runner)
    # in order; before each, $OUT held every row finished; each limited by the call's 200 s less what was spent and
    # the 10 s kept (the probe by its own 45 s); baseline, with 10 s left, never started
    assert seen == [
        ("sandbox-probe.log", [], 45),
        ("bf16.log", ["sandbox-probe"], 170),
        ("bf16.peer.log", ["sandbox-probe"], 140),
        ("4gb.log", ["sandbox-probe", "bf16"], 110),
        ("4gb-peer.log", ["sandbox-probe", "bf16", "4gb"], 70),
    ]
    assert [r["recipe"] for r in rows] == ["bf16", "4gb", "4gb-peer", "baseline"]
    record = json.loads((mirror / target.name).read_text())
    assert record == json.loads(target.read_text())
    by_name = {row["recipe"]: row for row in record["recipes"]}
    assert list(by_name) == ["sandbox-probe", "bf16", "4gb", "4gb-peer", "baseline"]
    assert by_name["sandbox-probe"]["probe"] == {"cuda": "ok", "matmul": "failed", "nvml": "not reached",
                                                 "transformers": "not reached", "lit_memory.model": "not reached"}
    assert (by_name["bf16"]["limit_s"], by_name["bf16"]["peer_limit_s"], by_name["bf16"]["row_s"]) == (170, 140, 60)
    assert by_name["4gb-peer"]["limit_s"] == 70 and by_name["4gb-peer"]["error"] == "peer failed: exit status 1: faked"
    assert by_name["baseline"]["error"] == "not run: 10 s of the call's time left (a run needs at least 20)"
    assert (mirror / "logs" / "bf16.peer.log").read_text() == "a fit's log\n"
    assert (mirror / "table.md").read_text().startswith("| recipe |")
    assert "no row of ours trained" in (mirror / "speed-table.md").read_text()


def test_call_two_adds_its_rows_to_call_ones_record_of_the_same_card(tmp_path):
    card = {"name": "NVIDIA H100 80GB HBM3", "total_bytes": GPUS["h100"].memory}
    target = tmp_path / "h100-speed.json"
    first = proof.Call(target, None, card, {"command": "call 1"})
    first.save([{"recipe": "bf16", "samples_per_s": 380.0}, {"recipe": "fsdp", "error": "not run: ..."}])
    earlier = proof.previous_record(target, card)
    assert proof.previous_record(target, {"name": "NVIDIA H200"}) is None  # another card: a record of its own
    second = proof.Call(target, None, card, {"command": "call 2"}, None,
                        [r for r in earlier["recipes"] if r["recipe"] != "fsdp"], [earlier["command"]])
    second.save([{"recipe": "fsdp", "samples_per_s": 150.0}])
    record = json.loads(target.read_text())
    assert [(r["recipe"], r["samples_per_s"]) for r in record["recipes"]] == [("bf16", 380.0), ("fsdp", 150.0)]
    assert record["calls"] == ["call 1", "call 2"] and record["command"] == "call 2"


def test_a_rehearsal_runs_a_calls_plumbing_on_this_cpu_and_a_process_past_its_limit_is_stopped(tmp_path, capsys):
    import sys

    from lit_memory.tools.bench import _run

    main(["bench", "--gpu-proof", "--rehearse", "--recipes", "sandbox-probe", "--deadline", "60", "--record", "speed",
          "--out", str(tmp_path / "proof"), "--mirror", str(tmp_path / "OUT")])
    record = json.loads((tmp_path / "OUT" / "rehearsal-speed.json").read_text())
    assert record["machine"]["device"] == "rehearsal (no GPU)" and record["deadline_s"] == 60
    (probe,) = record["recipes"]
    assert probe["recipe"] == "sandbox-probe" and probe["error"] == "rehearsal: not run (its limit 45 s)"
    assert not any(p.name.startswith("rehearsal") for p in proof.DOCS.iterdir())  # docs/gpu/ untouched
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["bench", "--gpu-proof", "--rehearse", "--deadline", "0"])
    assert capsys.readouterr().err == "error: --deadline 0: the seconds the rows may take, more than 0\n"
    log = tmp_path / "sleep.log"
    assert _run([sys.executable, "-c", "import time; time.sleep(30)"], log, timeout=1.0) == (
        "stopped after 1 s: the time the call had left for it")


def test_readmes_speed_table_regenerates_from_the_newest_committed_record(capsys):
    path = proof_tables.newest_record()
    main(["bench", "--gpu-proof", "--speed-table", str(path)])
    text = capsys.readouterr().out
    assert text == proof_tables.speed_table(json.loads(path.read_text()), f"docs/gpu/{path.name}")
    readme = (proof.ROOT / "README.md").read_text()
    start, end = proof_tables.SPEED_MARKERS
    assert readme.split(start, 1)[1].split(end, 1)[0] == f"\n{text}", (
        "README's speed table is not the newest record's: "
        "python -m lit_memory bench --gpu-proof --speed-table --update-readme")
