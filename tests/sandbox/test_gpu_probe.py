"""examples/gpu_sandbox_probe.py (issue 57, item 7): the GPU call's first step, rehearsed on this CPU.

Each probe runs in a child that `python -m lit_memory fit --config SENT` launches through the project's own path
(`lit_memory.__main__.main`, `lit_memory.confine.launch`): confined exactly as an untrusted run, only the child's
last step replaced. Here the probes run on their CPU equivalents (``--rehearse``), confined for real.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import REPO

from lit_memory.sandbox import landlock

needs_landlock = pytest.mark.skipif(landlock.abi() < 4, reason="needs Landlock ABI 4 (Linux 6.7) or later")


def _probe_module():
    spec = importlib.util.spec_from_file_location("gpu_sandbox_probe", REPO / "examples" / "gpu_sandbox_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = _probe_module()


@needs_landlock
def test_the_rehearsal_runs_each_probe_confined_and_writes_the_record(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LIT_MEMORY_SANDBOX", raising=False)
    code = probe.main(["--rehearse", "--probes", "compile,bnb,group,profiler", "--seconds", "120",
                       "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    record = json.loads((tmp_path / probe.RECORD).read_text())
    rows = {row["probe"]: row for row in record["probes"]}
    assert record["mode"] == "rehearsal" and list(rows) == ["compile", "bnb", "group", "profiler"]
    for name in ("compile", "group", "profiler"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["confined"] and rows[name]["exit"] == 0
    assert rows["compile"]["detail"].startswith("inductor on cpu, matches eager")
    assert rows["group"]["detail"].startswith("2 ranks, gloo, all_reduce over 127.0.0.1:")
    assert rows["bnb"]["status"] == "ok" or rows["bnb"]["detail"].startswith("skipped: bitsandbytes does not import")
    assert rows["bnb"]["confined"]
    for name in rows:  # one result line each, as the record has it
        assert f"probe {probe.line_of(rows[name])}\n" in printed
    assert code == 0


@needs_landlock
def test_a_probe_is_confined_by_the_launch_of_the_command_it_stands_for(tmp_path, monkeypatch, capsys):
    """The two ranks meet under the plan of ``--trainer.devices 2`` (its ports granted: the test above) and cannot
    under a one-device run's (no TCP at all): the confinement is the launch path's, built from the command."""
    monkeypatch.delenv("LIT_MEMORY_SANDBOX", raising=False)
    probe.sent_recipe(tmp_path)
    monkeypatch.chdir(tmp_path)
    one = probe.run_probe("group", ["fit", "--config", "sent/sent.yaml", "--trainer.accelerator=cpu"], "cpu", 60)
    assert one["confined"] and one["status"] == "fail", one
    assert one["error"].startswith("RuntimeError: ranks ended [1, ") and "operation not permitted" in one["error"]
    assert probe.probe_args("group", tmp_path / "sent" / "sent.yaml", "cpu", 0)[3:] == [
        "--trainer.devices=2", "--trainer.accelerator=cpu"]


def test_without_cuda_every_probe_and_fit_is_skipped_unless_rehearsed(tmp_path, monkeypatch):
    monkeypatch.delenv("REHEARSE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (this CPU has none; a GPU machine too)
    assert probe.main(["--fits", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / probe.RECORD).read_text())
    assert record["mode"] == "no CUDA"
    assert [(r["probe"], r["status"], r["detail"]) for r in record["probes"]] == [
        (name, "skipped", "skipped: no CUDA") for name in probe.PROBES]
    assert [(r["fit"], r["status"]) for r in record["fits"]] == [("confined fit", "skipped"), ("main job", "skipped")]


def test_a_probes_row_says_what_ended_it():
    confined = "sandbox: running confined, because sent/sent.yaml is not a shipped recipe\n"
    cut = probe.judge("compile", confined + "compiling\nerror: stopped: starting took longer than 45 s, the bound\n",
                      2, 45.3)
    assert (cut["status"], cut["error"], cut["confined"]) == (
        "fail", "error: stopped: starting took longer than 45 s, the bound", True)
    result = {"probe": "bnb", "status": "ok", "detail": "step", "error": None, "child_s": 3.0}
    free = probe.judge("bnb", probe.RESULT + json.dumps(result) + "\n", 0, 4.0)
    assert free["status"] == "fail" and "not confined" in free["error"]
    missing = probe.judge("bnb", confined + "warning: sandbox: no seccomp layer here (x): y\n" + probe.RESULT
                          + json.dumps(result) + "\n", 0, 4.0)
    assert (missing["status"], missing["missing_layers"], missing["child_s"]) == ("ok", ["seccomp"], 3.0)
    assert probe.line_of(missing) == "bnb: ok 4.0 s: step"


def test_readmes_main_job_is_the_shipped_recipes_fit():
    assert probe.readme_main_job() == ["fit", "--config", f"recipes/{probe.SHIPPED}"]


def test_without_landlock_no_probe_starts_and_the_record_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(landlock, "abi", lambda: 0)
    assert probe.main(["--rehearse", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / probe.RECORD).read_text())
    assert record["machine"]["landlock_abi"] == 0
    details = {r["detail"] for r in record["probes"]}
    [detail] = details
    assert detail.startswith("skipped: an untrusted run is confined by the kernel (Landlock")


def test_call_one_runs_the_probe_first_then_the_proofs_rows_but_its_own_probe_row():
    from lit_memory.tools import proof

    script = (REPO / "examples" / "gpu_speed.sh").read_text()
    [rows] = [line.split("=", 1)[1] for line in script.splitlines() if line.strip().startswith("CALL1_ROWS=")]
    assert rows.split(",") == [row for row in proof.CALLS["call1"] if row != proof.PROBE]
    assert script.index("examples/gpu_sandbox_probe.py --fits") < script.index("-m lit_memory bench --gpu-proof")
