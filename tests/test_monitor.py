"""The memory monitor: memory.json in every run, predicted vs measured, the out-of-memory report."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import FAST, RECIPES
from lit_memory.__main__ import main
from lit_memory.cli import LitMemoryCLI, resolve
from lit_memory.memory import records
from lit_memory.memory.footprint import CATEGORIES, PHASES, format_bytes
from lit_memory.monitor import MemoryMonitor, device_memory_used

ALL_RECIPES = sorted(p.stem for p in RECIPES.glob("*.yaml"))
# Every batch padded to max_length, so the measured batch has the predicted (worst-case) shape.
MEASURE = ["--data.padding=max_length", "--trainer.limit_val_batches=0", "--model.save_pretrained=false"]


def test_accumulation_windows_track_only_the_micro_batches_that_differ():
    monitor = MemoryMonitor(track_steps=2)
    trainer = SimpleNamespace(
        accumulate_grad_batches=8, global_step=0, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    assert [i for i in range(8) if monitor._tracking(trainer, i)] == [0, 1, 7]
    trainer.global_step = 2  # past the tracked steps
    assert not any(monitor._tracking(trainer, i) for i in range(16, 24))
    budgeted = MemoryMonitor(track_steps=2, budget="1GiB")  # a CPU budget is enforced at every micro-batch
    assert all(budgeted._tracking(trainer, i) for i in range(16, 24))


def fit(args: list[str]) -> LitMemoryCLI:
    """A fit as `python -m lit_memory fit` runs it: the CLI hands the monitor its step's predictions and advice."""
    run = resolve(["fit", *args])
    run.launch()
    return run


def run(recipe: str, tmp_path: Path, *extra: str) -> tuple[LitMemoryCLI, dict]:
    cli = fit(["--config", str(RECIPES / f"{recipe}.yaml"), *FAST, *MEASURE, f"--trainer.default_root_dir={tmp_path}", *extra])
    return cli, records.read_memory(Path(cli.trainer.log_dir))


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_predictions_are_within_10_percent_of_the_tracked_peak(recipe, tmp_path, capsys):
    # Two optimizer steps: the first creates the optimizer state, the second is the steady state the
    # predictions describe. Accumulating 2 micro-batches keeps the recipes' memory shape (gradients
    # live across micro-batches) at a 16th of the steps.
    accumulate = yaml.safe_load((RECIPES / f"{recipe}.yaml").read_text())["trainer"]["accumulate_grad_batches"]
    cli, report = run(
        recipe, tmp_path, f"--trainer.accumulate_grad_batches={min(accumulate, 2)}", "--memory.simulate=true"
    )
    tracked = report["measured"]["tracked"]
    measured = tracked["peak_bytes"]
    assert report["tracked_batches"] == report["batches"] == 2 * min(accumulate, 2)
    predictions = ["analytic", "simulated"]
    for method in predictions:
        assert report["predicted"][method]["peak_bytes"] == pytest.approx(measured, rel=0.10), method
    for footprint in (*(report["predicted"][m] for m in predictions), tracked):
        assert set(footprint["categories"]) == set(CATEGORIES)
        assert sum(footprint["categories"].values()) == footprint["peak_bytes"]
        assert set(footprint["phases"]) == set(PHASES)
    process = report["measured"]["process"]
    assert process["max_rss_bytes"] >= process["rss_at_start_bytes"] > measured / 4  # the process holds more
    assert report["device"]["type"] == "cpu" and report["config"] == "config.yaml" and report["world_size"] == 1
    assert (Path(cli.trainer.log_dir) / "config.yaml").exists()  # the resolved config beside the evidence
    assert cli.trainer.progress_bar_metrics["mem_peak_gib"] == pytest.approx(measured / 2**30, rel=1e-4)
    # The end-of-fit table: predicted and measured side by side, per category, then the process.
    out = capsys.readouterr().out
    table = out[out.index("memory on cpu") :].splitlines()
    assert table[0].split()[-4:] == ["analytic", "simulated", "tracked", "tensors"]
    rows = {line[:28].strip(): line[28:].split() for line in table[1:8]}
    assert list(rows) == [
        "weights", "gradients", "optimizer state", "activations", "other/temporary", "peak (tensors)", "(phase)"
    ]
    assert rows["peak (tensors)"][-2:] == format_bytes(measured).split()
    assert table[8].startswith("  process: max RSS ")


def test_memory_is_measured_by_default_and_configurable(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["memory"] == {
        "track_steps": 2, "budget": None, "simulate": False, "tier": None, "allocator": None, "margin": 0.08,
    }


def test_out_of_memory_prints_the_breakdown_and_a_recipe_that_fits(tmp_path, capsys):
    # baseline needs about 1.4 GiB on the bundled model: a 600 MiB budget fails in the first forward.
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "fit",
                "--config",
                str(RECIPES / "baseline.yaml"),
                *FAST,
                *MEASURE,
                f"--trainer.default_root_dir={tmp_path}",
                "--memory.budget=600MiB",
            ]
        )
    assert exit_.value.code == 1
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith(("/", " "))]
    report, suggestion, error = err[-3:]
    assert report.startswith("out of memory in the forward phase of batch 0: ")
    assert all(name in report for name in CATEGORIES) and report.endswith("(limit 600.00 MiB)")
    assert suggestion.startswith("lightest shipped recipe predicted to fit 600.00 MiB: --config recipes/")
    suggested = suggestion.split("--config ")[1].split()[0]
    assert suggested != "recipes/baseline.yaml"
    assert error.startswith("error: out of memory: tracked tensors need")
    memory = records.read_memory(next(tmp_path.rglob("memory.json")).parent)
    assert memory["oom"]["phase"] == "forward" and memory["oom"]["live_bytes"] > 600 * 2**20


# Each memory switch of the 4gb recipe against the fp32 baseline (batch 32, length 128, bundled
# MiniLM, tracked tensor by tensor): the category it claims to shrink, as named in its recipe header.
SWITCHES = {
    "bf16": (["--config", "bf16"], ["activations"]),
    "checkpointing": (["--model.gradient_checkpointing=true"], ["activations"]),
    "8bit": (["--config", "8bit"], ["optimizer"]),
    "fused": (["--config", "fused"], ["gradients"]),
    "lora": (["--config", "lora"], ["gradients", "optimizer"]),
}


def tracked_categories(tmp_path: Path, *args: str) -> tuple[int, dict[str, int]]:
    """The measured peak, and each category's largest value over the training phases."""
    args = [str(RECIPES / f"{a}.yaml") if prev == "--config" else a for prev, a in zip(("",) + args, args)]
    cli = LitMemoryCLI(
        args=["fit", "--config", str(RECIPES / "baseline.yaml"), *args, *FAST, *MEASURE,
              "--cpu_bf16_fallback=false", f"--trainer.default_root_dir={tmp_path}"]  # measure bf16 as written
    )
    report = records.read_memory(Path(cli.trainer.log_dir))
    assert report["batch_shape"] == [32, 128]
    tracked = report["measured"]["tracked"]
    phases = tracked["phases"].values()
    return tracked["peak_bytes"], {c: max(p["categories"][c] for p in phases) for c in CATEGORIES}


def test_4gb_is_a_third_of_baseline_and_each_switch_shrinks_its_category(tmp_path):
    baseline_peak, baseline = tracked_categories(tmp_path / "baseline")
    # every layer checkpointed, as on a card the tier must fit (on this CPU target `auto` needs no recompute)
    peak_4gb, _ = tracked_categories(tmp_path / "4gb", "--config", "4gb", "--model.gradient_checkpointing=true")
    assert peak_4gb <= baseline_peak / 3, (format_bytes(peak_4gb), format_bytes(baseline_peak))
    for name, (args, shrunk) in SWITCHES.items():
        peak, categories = tracked_categories(tmp_path / name, *args)
        assert peak < baseline_peak, name
        for category in shrunk:
            # At least 10 % less. bf16 is the weakest here: the CPU's attention (math kernel, taken for
            # attention dropout) computes in fp32, so only the linear layers' saved values halve.
            assert categories[category] < 0.9 * baseline[category], (name, category)
        assert categories["weights"] >= baseline["weights"], name  # nothing shrinks the fp32 master weights


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
    """A CUDA device the monitor reads from: 16 GiB, an allocator whose peak readings we set."""
    calls = SimpleNamespace(fractions=[], allocated=0, reserved=0, free=16 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=16 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.9)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.fractions.append(f))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: calls.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: calls.reserved)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (calls.free, 16 * 2**30))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: pytest.fail("a user's peak readings were reset"))
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), log_dir=str(tmp_path), default_root_dir=str(tmp_path)
    )
    return calls, trainer


def test_a_cuda_budget_caps_the_device_total_and_is_undone_when_it_ends(fake_cuda, capsys):
    """The allocator gets the budget less this process's CUDA context measured at the start (the card read
    through the monitor's seam), so the device total, context included, stays within the budget."""
    from lit_memory.memory.device import GPUS, CardReading

    calls, trainer = fake_cuda
    monitor = MemoryMonitor(budget="4GiB")
    monitor.read_card = lambda device: CardReading("fake", 16 * 2**30, 15 * 2**30, 512 * 2**20, "nvml (this process)")
    monitor.setup(trainer, None, "fit")
    assert calls.fractions == [(4 * 2**30 - 512 * 2**20) / (16 * 2**30)]
    assert "the caching allocator is capped at 3.50 GiB on fake" in capsys.readouterr().err
    monitor.teardown(trainer, None, "fit")
    assert calls.fractions[1:] == [0.9]  # the process's own cap again: `plan --measure` runs several fits
    # a card as the budget: its capacity as torch reports it
    assert MemoryMonitor(budget="rtx3050-4gb", tier="t4").budget == GPUS["rtx3050-4gb"].memory


def test_cuda_peaks_are_read_per_phase_without_resetting_them(fake_cuda):
    """Allocated and reserved from the allocator's peak counters, the device level from cudaMemGetInfo (no
    NVML here) at every phase boundary: the highest readings, the phase in which allocated last rose."""
    calls, trainer = fake_cuda
    monitor = MemoryMonitor(track_steps=0)
    monitor.cuda = {
        "max_allocated_bytes": 0, "max_reserved_bytes": 0, "max_device_bytes": 0, "device_source": None,
        "peak_phase": None,
    }
    for phase, allocated in (("forward", 3), ("backward", 7), ("step", 7), ("forward", 5)):
        monitor._enter_phase(trainer, phase)
        calls.allocated, calls.reserved = allocated, allocated + 1
        calls.free = 16 * 2**30 - (allocated + 100)  # context 99 B + reserved: what the device would show
    monitor._read_cuda(trainer)
    assert monitor.cuda == {
        "max_allocated_bytes": 7, "max_reserved_bytes": 8, "max_device_bytes": 107,
        "device_source": "cudaMemGetInfo (whole device)", "peak_phase": "backward",
    }


def test_the_end_of_run_table_puts_the_cuda_measurements_beside_the_three_predicted_levels(fake_cuda, capsys):
    from lit_memory.memory.footprint import Footprint

    calls, trainer = fake_cuda
    trainer.world_size, trainer.datamodule = 1, SimpleNamespace(hparams={"batch_size": 4, "max_length": 8})
    monitor = MemoryMonitor(track_steps=0)
    categories = {"weights": 2 * 2**30, "gradients": 0, "optimizer": 2**30, "activations": 2**29, "other": 0}
    monitor.predictions = {"analytic": Footprint({"backward": categories}, reserved=int(3.6 * 2**30), context=600 * 2**20)}
    monitor.cuda = {
        "max_allocated_bytes": int(3.5 * 2**30), "max_reserved_bytes": int(3.75 * 2**30),
        "max_device_bytes": int(4.4 * 2**30), "device_source": "nvml (this process)", "peak_phase": "backward",
    }
    monitor.process = None
    monitor._print_table(trainer, None)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-3:] == ["analytic", "cuda", "(measured)"]
    rows = {line[:28].strip(): line[28:].split() for line in out[1:]}
    assert rows["peak (tensors)"] == ["3.50", "GiB", "3.50", "GiB"]
    assert rows["reserved (allocator)"] == ["3.60", "GiB", "3.75", "GiB"]
    assert rows["device (nvidia-smi)"] == ["4.19", "GiB", "4.40", "GiB"]
    assert rows["weights"] == ["2.00", "GiB", "-"]


def test_the_device_level_reads_nvml_for_this_process_when_it_can(monkeypatch):
    """nvidia-ml-py is optional: with it, this process's own usage; without (or without a driver), the whole
    device's used memory from cudaMemGetInfo; neither: nothing."""
    import sys
    from types import ModuleType

    fake = ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByIndex = lambda index: "handle"
    fake.nvmlDeviceGetComputeRunningProcesses = lambda handle: [
        SimpleNamespace(pid=1, usedGpuMemory=5), SimpleNamespace(pid=__import__("os").getpid(), usedGpuMemory=1234)
    ]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda device: 0)
    assert device_memory_used(torch.device("cuda", 0)) == (1234, "nvml (this process)")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6, 10))
    assert device_memory_used(torch.device("cuda", 0)) == (4, "cudaMemGetInfo (whole device)")

    def no_driver(device):
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_driver)
    assert device_memory_used(torch.device("cuda", 0)) == (None, None)
