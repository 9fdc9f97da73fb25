"""The memory monitor: memory.json in every run, predicted vs measured, the out-of-memory report."""

from __future__ import annotations

import functools
import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import oom
import oom_worker
import pytest
import torch
import yaml
from conftest import COMPILED, FAST, RECIPES, REPO
from transformers import AutoModelForSequenceClassification

from lit_memory.__main__ import main
from lit_memory.cli import LitMemoryCLI, resolve
from lit_memory.hf.bundled import resolve_model
from lit_memory.memory.margin import Limit
from lit_memory.memory.measure import nvml as nvml_module
from lit_memory.memory.measure import records
from lit_memory.memory.measure.footprint import CATEGORIES, PHASES, format_bytes
from lit_memory.memory.settings import MemorySettings
from lit_memory.run import environment
from lit_memory.run import monitor as monitor_module
from lit_memory.run.memory_callbacks import BudgetCap, MemoryPredictions, MemoryTable
from lit_memory.run.monitor import MemoryMonitor, device_memory_used

# the compiled recipes' layers are tracked eagerly, as their parents' (tests/run/test_compiling.py trains them)
ALL_RECIPES = sorted(p.stem for p in RECIPES.glob("*.yaml") if p.stem not in COMPILED)
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
    budgeted = MemoryMonitor(track_steps=2, memory=MemorySettings(budget="1GiB"))  # enforced at every micro-batch
    assert all(budgeted._tracking(trainer, i) for i in range(16, 24))


def fit(args: list[str]) -> LitMemoryCLI:
    """A fit as `python -m lit_memory fit` runs it: the CLI hands the monitor its step's predictions and advice."""
    run = resolve(["fit", *args])
    run.launch()
    return run


def run(recipe: str, tmp_path: Path, *extra: str) -> tuple[LitMemoryCLI, dict]:
    cli = fit(
        ["--config", str(RECIPES / f"{recipe}.yaml"), *FAST, *MEASURE, f"--trainer.default_root_dir={tmp_path}", *extra]
    )
    return cli, records.read_memory(Path(cli.trainer.log_dir))


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_predictions_are_within_10_percent_of_the_tracked_peak(recipe, tmp_path, capsys):
    # Two optimizer steps: the first creates the optimizer state, the second is the steady state the
    # predictions describe. Accumulating 2 micro-batches keeps the recipes' memory shape (gradients
    # live across micro-batches) at a 16th of the steps.
    accumulate = yaml.safe_load((RECIPES / f"{recipe}.yaml").read_text())["trainer"]["accumulate_grad_batches"]
    cli, report = run(
        recipe, tmp_path, f"--trainer.accumulate_grad_batches={min(accumulate, 2)}", "--memory.simulate=true",
        "--trainer.log_every_n_steps=1",  # progress (the peak, the loss) is read on the steps the loggers write
    )
    tracked = report["measured"]["tracked"]
    measured = tracked["peak_bytes"]
    assert report["tracked_batches"] == report["batches"] == 2 * min(accumulate, 2)
    predictions = ["analytic", "simulated"]
    if report["predicted"]["simulated"] is None:  # declined (a 4-bit base: fake tensors cannot hold Params4bit), said
        assert recipe == "qlora"
        predictions = ["analytic"]
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
    assert cli.trainer.progress_bar_metrics["train_loss"] > 0  # the last step's mean loss, read on the host
    # The end-of-fit table: predicted and measured side by side, per category, then the process.
    out = capsys.readouterr().out
    table = out[out.index("memory on cpu") :].splitlines()
    assert table[0].split()[-len(predictions) - 2:] == [*predictions, "tracked", "tensors"]
    rows = {line[:28].strip(): line[28:].split() for line in table[1:8]}
    assert list(rows) == [
        "weights", "gradients", "optimizer state", "activations", "other/temporary", "peak (tensors)", "(phase)"
    ]
    assert rows["peak (tensors)"][-2:] == format_bytes(measured).split()
    # padded to max_length: the measured shape is the worst case, which the "fits" line names
    rows_, tokens = shape = report["batch_shape"]
    assert table[8].startswith(f"  fits (worst case: every batch {rows_} x {tokens}, padded to max_length): analytic ")
    assert table[9].startswith("  process: max RSS ")
    assert report["longest_batch"] == {"tracked": shape, "all": shape, "tracked_peak": shape}


def test_memory_is_measured_by_default_and_configurable(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["memory"] == {
        "track_steps": 2, "budget": None, "simulate": False, "tier": None, "allocator": None, "margin": 0.08,
        "snapshot": None, "snapshot_steps": 2, "picture": True,
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
    report, drawn, suggestion, error = err[-4:]
    assert report.startswith("out of memory in the forward phase of batch 0: ")
    # the predicted step drawn against the limit: where it crosses it, in the run folder
    run_dir = next(tmp_path.rglob("memory.json")).parent
    assert drawn.startswith("the predicted step crosses the limit ")
    assert drawn.endswith(f": see the picture of the step, {run_dir / 'memory.png'}")
    assert (run_dir / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert all(name in report for name in CATEGORIES) and report.endswith("(limit 600.00 MiB)")
    assert suggestion.startswith("lightest shipped recipe predicted to fit 600.00 MiB: --config recipes/")
    suggested = suggestion.split("--config ")[1].split()[0]
    assert suggested != "recipes/baseline.yaml"
    assert error.startswith("error: out of memory: tracked tensors need")
    memory = records.read_memory(next(tmp_path.rglob("memory.json")).parent)
    assert memory["oom"]["phase"] == "forward" and memory["oom"]["live_bytes"] > 600 * 2**20



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_out_of_memory(tmp_path_factory):
    """tests/oom_worker.py in two processes, as torchrun starts them: an out-of-memory error inside the first FSDP2
    step of each case (before backward and inside it, tracked and untracked), on one device and on 2 ranks."""
    out = tmp_path_factory.mktemp("oom")
    pair, one = _free_port(), _free_port()
    env = {**environment.for_new_job(), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(pair),
           "WORLD_SIZE": "2", "NODE_RANK": "0"}
    logs = [out / f"rank{r}.log" for r in range(2)]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "oom_worker.py"), str(out), str(one)],
            cwd=REPO,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
        )
        for r, log in zip(range(2), logs)
    ]
    codes = [rank.wait(600) for rank in ranks]
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    return out


@functools.lru_cache(maxsize=1)
def _bundled_bytes() -> int:
    """The bundled model's fp32 parameters (2 labels), in bytes."""
    model = AutoModelForSequenceClassification.from_pretrained(resolve_model("bundled:minilm"), num_labels=2)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _case(out: Path, case: str, rank: int) -> dict:
    return json.loads((out / case / f"rank{rank}.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", [*oom_worker.ONE_DEVICE, *oom_worker.TWO_RANKS])
def test_an_out_of_memory_error_inside_an_fsdp2_step_is_reported(fsdp_out_of_memory, case):
    """The report, not another exception: FSDP2's parameters and state are DTensors, which have no storage of their
    own (an untracked step's breakdown read the data pointer of one: "invalid python storage", hiding the error)."""
    out = fsdp_out_of_memory
    recipe, where, _ = {**oom_worker.ONE_DEVICE, **oom_worker.TWO_RANKS}[case]
    ranks = 1 if case in oom_worker.ONE_DEVICE else 2
    for rank in range(ranks):  # every rank ends with torch's error, through the command's own line
        ended = _case(out, case, rank)
        assert ended["uncaught"] is None and ended["code"] == 1, ended["stderr"][-3000:]
        assert ended["stderr"].splitlines()[-1] == f"error: out of memory: {oom.MESSAGE}"
        assert "Traceback" not in ended["stderr"] and "invalid python storage" not in ended["stderr"]
    err = _case(out, case, 0)["stderr"].splitlines()
    phase = "forward" if where == "before_backward" else "backward"  # raised after the forward, or inside backward
    (report,) = [line for line in err if line.startswith("out of memory in the ")]
    assert report.startswith(f"out of memory in the {phase} phase of batch 0: ") and report.endswith("(limit -)")
    run_dir = next((out / case).rglob("memory.json")).parent
    record = records.read_memory(run_dir)["oom"]
    assert record["phase"] == phase and record["batch"] == 0 and record["limit_bytes"] is None
    # What was live on rank 0: every weight's shard, no more than shards and a full gathered copy (FSDP2 keeps the
    # root unit gathered after its forward; on one device its "gathered" parameters are copies of the shards).
    full = _bundled_bytes()
    weights = record["categories"]["weights"]
    assert full / ranks <= weights <= full / ranks + full, (weights, full)
    assert record["live_bytes"] == sum(record["categories"].values())
    assert f"{format_bytes(record['live_bytes'])} live = weights {format_bytes(weights)} + " in report
    # the predicted step's picture, with where the run failed (no limit on a CPU without memory.budget)
    assert err[err.index(report) + 1] == (
        f"no limit to compare with (memory.budget is not set on this device): see the picture of the step, "
        f"{run_dir / 'memory.png'}"
    )
    assert (run_dir / "memory.png").read_bytes()[:4] == b"\x89PNG"


# Each memory switch of the 4gb recipe against the fp32 baseline (batch 32, length 128, bundled
# MiniLM, tracked tensor by tensor): the category it claims to shrink, as named in its recipe header.
# Steps tracked: one holds every category at its largest (the first step creates the optimizer state), but only
# from the second on does the peak hold the optimizer state beside the activations, which the optimizer switches
# shrink. bf16 and 4gb take one step: ~90 s each where bf16 is emulated (CI's CPU may lack it).
SWITCHES = {
    "bf16": (["--config", "bf16"], ["activations"], 1),
    "checkpointing": (["--model.gradient_checkpointing=true"], ["activations"], 1),
    "8bit": (["--config", "8bit"], ["optimizer"], 2),
    "fused": (["--config", "fused"], ["gradients"], 2),  # its first step makes the state while activations live
    "lora": (["--config", "lora"], ["gradients", "optimizer"], 2),
}


def tracked_categories(tmp_path: Path, *args: str, steps: int = 2) -> tuple[int, dict[str, int]]:
    """The measured peak over ``steps`` tracked steps, and each category's largest value over the training phases."""
    args = [str(RECIPES / f"{a}.yaml") if prev == "--config" else a for prev, a in zip(("",) + args, args)]
    cli = LitMemoryCLI(
        args=["fit", "--config", str(RECIPES / "baseline.yaml"), *args, *FAST, *MEASURE,
              "--cpu_bf16_fallback=false", f"--trainer.default_root_dir={tmp_path}",  # measure bf16 as written
              f"--trainer.max_steps={steps}", f"--memory.track_steps={steps}"]
    )
    report = records.read_memory(Path(cli.trainer.log_dir))
    assert report["batch_shape"] == [32, 128]
    tracked = report["measured"]["tracked"]
    phases = tracked["phases"].values()
    return tracked["peak_bytes"], {c: max(p["categories"][c] for p in phases) for c in CATEGORIES}


def test_4gb_is_a_third_of_baseline_and_each_switch_shrinks_its_category(tmp_path):
    baseline_peaks, by_steps = {}, {}
    for steps in (1, 2):
        baseline_peaks[steps], by_steps[steps] = tracked_categories(tmp_path / f"baseline{steps}", steps=steps)
    baseline = by_steps[2]
    for category, value in by_steps[1].items():  # one step holds every category's largest value (`SWITCHES`)
        assert value == pytest.approx(baseline[category], rel=0.01), category
    # every layer checkpointed, as on a card the tier must fit (on this CPU target `auto` needs no recompute)
    peak_4gb, _ = tracked_categories(
        tmp_path / "4gb", "--config", "4gb", "--model.gradient_checkpointing=true", steps=1
    )
    assert peak_4gb <= baseline_peaks[1] / 3, (format_bytes(peak_4gb), format_bytes(baseline_peaks[1]))
    for name, (args, shrunk, steps) in SWITCHES.items():
        peak, categories = tracked_categories(tmp_path / name, *args, steps=steps)
        assert peak < baseline_peaks[steps], name
        for category in shrunk:
            # At least 10 % less. bf16 is the weakest here: the CPU's attention (math kernel, taken for
            # attention dropout) computes in fp32, so only the linear layers' saved values halve.
            assert categories[category] < 0.9 * baseline[category], (name, category)
        assert categories["weights"] >= baseline["weights"], name  # nothing shrinks the fp32 master weights


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
    """A CUDA device the monitor reads from: 16 GiB, an allocator whose peak readings we set."""
    calls = SimpleNamespace(fractions=[], allocated=0, reserved=0, free=16 * 2**30, loaded=[])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=16 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.9)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.fractions.append(f))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: calls.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: calls.reserved)
    monkeypatch.setattr(
        torch.cuda, "memory_stats",
        lambda device: {"allocated_bytes.all.peak": calls.allocated, "reserved_bytes.all.peak": calls.reserved},
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (calls.free, 16 * 2**30))
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda *a: pytest.fail("a user's peak readings were reset")
    )
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)),
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        global_step=0,
    )
    return calls, trainer


def test_a_cuda_budget_caps_the_device_total_and_is_undone_when_it_ends(fake_cuda, capsys):
    """The allocator gets the budget less this process's CUDA context measured at the start (the card read
    through the cap's seam), so the device total, context included, stays within the budget."""
    from lit_memory.memory.hardware.gpus import GPUS, CardReading

    calls, trainer = fake_cuda
    cap = BudgetCap(MemorySettings(budget="4GiB").cap)
    cap.read_card = lambda device: CardReading("fake", 16 * 2**30, 15 * 2**30, 512 * 2**20, "nvml (this process)")
    cap.load_kernels = lambda device, half: calls.loaded.append(half)
    trainer.precision = "bf16-mixed"
    cap.setup(trainer, None, "fit")
    assert calls.loaded == [torch.bfloat16]  # the step's kernels were loaded before the context was measured
    assert calls.fractions == [(4 * 2**30 - 512 * 2**20) / (16 * 2**30)]
    assert "the caching allocator is capped at 3.50 GiB on fake" in capsys.readouterr().err
    cap.teardown(trainer, None, "fit")
    assert calls.fractions[1:] == [0.9]  # the process's own cap again: `plan --measure` runs several fits
    BudgetCap(None).setup(trainer, None, "fit")  # no budget: the process's cap stays as it is
    assert calls.fractions[2:] == []
    # a card as the budget: its capacity as torch reports it; the budget is the limit, before the tier
    settings = MemorySettings(budget="rtx3050-4gb", tier="t4")
    assert settings.limit == settings.cap == Limit(GPUS["rtx3050-4gb"].memory, "memory.budget rtx3050-4gb (3.81 GiB)")


def test_the_cap_follows_the_context_as_kernels_load_in_the_first_steps(fake_cuda, capsys):
    """The CUDA context grows after the start (kernels loaded on first use, outside the allocator): measured again
    after each of the first optimizer steps, the allocator's cap is lowered by what it grew, so that the device
    total (context + reserved) stays within the budget; it is never raised, and not read after `recheck` steps."""
    from lit_memory.memory.hardware.gpus import CardReading

    calls, trainer = fake_cuda
    budget, total, mib = 4 * 2**30, 16 * 2**30, 2**20
    contexts = iter([518 * mib, 700 * mib, 690 * mib, 760 * mib, 900 * mib])
    reads = []

    def read(device):
        reads.append(trainer.global_step)
        return CardReading("fake", total, 12 * 2**30, next(contexts), "nvml (this process)")

    cap = BudgetCap(Limit(budget), recheck=3)
    cap.read_card, cap.load_kernels = read, lambda device, half: None
    trainer.precision = "32-true"
    trainer.global_step = 0
    cap.setup(trainer, None, "fit")
    capsys.readouterr()
    for step in (1, 1, 2, 3, 4, 5):  # a batch ends after each optimizer step; the repeated 1: mid accumulation
        trainer.global_step = step
        cap.on_train_batch_end(trainer, None, None, None, 0)
    assert reads == [0, 1, 2, 3]  # at the start, then once after each of the first 3 steps
    limits = [f * total for f in calls.fractions]
    assert limits == [budget - 518 * mib, budget - 700 * mib, budget - 760 * mib]  # 690 after step 2: not raised
    assert all(limit + context <= budget for limit, context in zip(limits, (518 * mib, 700 * mib, 760 * mib)))
    err = capsys.readouterr().err
    assert "context grew by 182.00 MiB by optimizer step 1" in err and "cap is now 3.26 GiB" in err


def test_the_cap_measures_the_context_once_every_nccl_communicator_is_warmed_up(fake_cuda, monkeypatch):
    """NCCL connects a communicator's channels at its first collectives (outside the allocator): each group that
    runs collectives (the default group, each mesh dimension of more than one rank, once) takes a small and a large
    all-reduce, an all-gather and a reduce-scatter before the context is read; a one-rank dimension (Lightning's
    idle tensor_parallel under FSDP2) none, nor a gloo group."""
    from lit_memory.memory.hardware.gpus import CardReading
    from lit_memory.run.memory_callbacks import collective_groups, warm_up

    dist = torch.distributed
    world, solo, cpu_side = (SimpleNamespace(name=n) for n in ("world", "solo", "gloo"))
    sizes, backends = {"world": 4, "solo": 1, "gloo": 4}, {"world": "nccl", "solo": "nccl", "gloo": "gloo"}
    mesh = SimpleNamespace(ndim=3, get_group=lambda dim: (world, solo, cpu_side)[dim])  # dp reuses WORLD's group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(type(dist.group), "WORLD", property(lambda group: world))  # a property of its metaclass
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: sizes[group.name])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backends[group.name])
    assert collective_groups(SimpleNamespace(device_mesh=mesh)) == [world]
    assert collective_groups(SimpleNamespace()) == [world]  # a strategy without a mesh: the default group
    ran = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group: ran.append(("all_reduce", group.name, t.numel())))
    monkeypatch.setattr(dist, "all_gather_into_tensor",
                        lambda out, t, group: ran.append(("all_gather", group.name, out.numel() // t.numel())))
    monkeypatch.setattr(dist, "reduce_scatter_tensor",
                        lambda out, t, group: ran.append(("reduce_scatter", group.name, t.numel() // out.numel())))
    warm_up([world], torch.device("cpu"))
    assert ran == [("all_reduce", "world", 1), ("all_reduce", "world", 2**20), ("all_gather", "world", 4),
                   ("reduce_scatter", "world", 4)]
    calls, trainer = fake_cuda  # the cap warms them up, then reads the card
    order = []
    cap = BudgetCap(Limit(4 * 2**30))
    cap.load_kernels = lambda device, half: order.append("kernels")
    cap.warm_communicators = lambda strategy, device: order.append("communicators")
    cap.read_card = lambda device: order.append("read") or CardReading("fake", 16 * 2**30, 15 * 2**30, 2**30, "nvml")
    trainer.precision = "32-true"
    cap.setup(trainer, None, "fit")
    assert order == ["kernels", "communicators", "read"]


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
        "device_bytes_by_step": [107],  # every reading was in optimizer step 0
    }


def test_after_the_first_steps_the_device_is_read_once_at_every_step_end_with_the_allocators_counts(
    fake_cuda, monkeypatch
):
    """Phases are read in the first `PHASE_READ_STEPS` steps only; every optimizer step's end is read into that step,
    with its cudaMalloc retries and cudaMalloc/cudaFree calls; a step never read is null, not 0."""
    calls, trainer = fake_cuda
    counts = {"num_alloc_retries": 0, "num_device_alloc": 4, "num_device_free": 0}
    reads = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: reads.append(trainer.global_step) or {
        "allocated_bytes.all.peak": calls.allocated, "reserved_bytes.all.peak": calls.reserved, **counts})
    trainer.log_every_n_steps, trainer.accumulate_grad_batches = 0, 1
    monitor = MemoryMonitor(track_steps=0)
    monitor.on_fit_start(trainer, None)
    for step in range(5):
        trainer.global_step = step
        monitor.on_train_batch_start(trainer, None, {}, step)
        monitor.on_before_backward(trainer, None, None)
        monitor.on_before_optimizer_step(trainer, None, None)
        calls.allocated, calls.reserved, calls.free = 10 + step, 20 + step, 16 * 2**30 - 100 * (step + 1)
        counts["num_device_alloc"] += 2
        counts["num_alloc_retries"] += step == 3
        trainer.global_step = step + 1
        monitor.on_train_batch_end(trainer, None, None, {}, step)
    # the fit's start; the ends of forward, backward and the step in steps 0-2; then the end of steps 3 and 4 only
    assert reads == [0] + [0, 0, 1] + [1, 1, 2] + [2, 2, 3] + [4, 5]
    cuda = monitor.cuda
    assert cuda["device_bytes_by_step"] == [100 * (s + 1) for s in range(5)]
    assert cuda["alloc_retries_by_step"] == [0, 0, 0, 1, 0] and cuda["device_allocs_by_step"] == [2] * 5
    assert cuda["device_frees_by_step"] == [0] * 5 and cuda["max_allocated_bytes"] == 14
    assert cuda["peak_phase"] == "step"  # the last phase read; later peaks are found at a step's end
    # A step whose end was never read (no device reading there) stays null: no step passes unread.
    monkeypatch.setattr(monitor_module, "device_memory_used", lambda device: (None, None))
    trainer.global_step = 7
    monitor.on_train_batch_end(trainer, None, None, {}, 6)
    assert cuda["device_bytes_by_step"][5:] == [None, None] and cuda["alloc_retries_by_step"][5:] == [None, 0]
    # the run's end, before the cap is given back: the allocator's cap (what it never used: the cap less its peak)
    monitor.on_train_end(trainer, None)
    assert cuda["allocator_cap_bytes"] == int(0.9 * 16 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    assert monitor_module.allocator_cap(torch.device("cuda", 0)) is None  # no cap set


def test_the_end_of_run_table_puts_the_cuda_measurements_beside_the_three_predicted_levels(fake_cuda, capsys):
    from lit_memory.memory.measure.footprint import Footprint

    calls, trainer = fake_cuda
    trainer.world_size, trainer.datamodule = 1, SimpleNamespace(hparams={"batch_size": 4, "max_length": 8})
    monitor = MemoryMonitor(track_steps=0)
    categories = {"weights": 2 * 2**30, "gradients": 0, "optimizer": 2**30, "activations": 2**29, "other": 0}
    monitor.predictions = {
        "analytic": Footprint(
            {"backward": categories}, reserved=int(3.6 * 2**30), context=600 * 2**20, workspaces=64 * 2**20
        )
    }
    monitor.cuda = {
        "max_allocated_bytes": int(3.5 * 2**30), "max_reserved_bytes": int(3.75 * 2**30),
        "max_device_bytes": int(4.4 * 2**30), "device_source": "nvml (this process)", "peak_phase": "backward",
    }
    monitor.process = None
    MemoryTable(monitor).on_fit_end(trainer, None)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-3:] == ["analytic", "cuda", "(measured)"]
    rows = {line[:28].strip(): line[28:].split() for line in out[1:]}
    assert rows["peak (tensors)"] == ["3.50", "GiB", "3.50", "GiB"]
    assert rows["allocated (+cuBLAS)"] == ["3.56", "GiB", "3.50", "GiB"]  # max_memory_allocated counts the workspaces
    assert rows["reserved (allocator)"] == ["3.60", "GiB", "3.75", "GiB"]
    assert rows["device (nvidia-smi)"] == ["4.19", "GiB", "4.40", "GiB"]
    assert rows["weights"] == ["2.00", "GiB", "-"]


class FakeNvml:
    """NVML's functions as ``pynvml`` has them, with the processes the device lists (PIDs as NVML names them)."""

    def __init__(self, processes: dict[int, int]) -> None:
        self.processes, self.inits = processes, 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle {index}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes.items()]


@pytest.fixture
def nvml(monkeypatch):
    """A fake NVML as the `pynvml` module, the monitor's per-process NVML state reset."""
    import sys

    fake = FakeNvml({})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml_module, "_nvml", None)
    monkeypatch.setattr(nvml_module, "_nvml_failed_in", None)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6, 10))
    return fake


def test_the_device_level_reads_nvml_for_this_process_when_it_can(nvml, monkeypatch):
    """nvidia-ml-py is optional: with it, this process's own usage (NVML started once per process); without (or
    without a driver), the whole device's used memory from cudaMemGetInfo; neither: nothing."""
    import os

    nvml.processes = {1: 5, os.getpid(): 1234}
    cuda = torch.device("cuda", 0)
    for _ in range(3):  # a batch's three phase boundaries
        assert device_memory_used(cuda) == (1234, "nvml (this process)")
    assert nvml.inits == 1
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # not installed
    monkeypatch.setattr(nvml_module, "_nvml", None)
    assert device_memory_used(cuda) == (4, "cudaMemGetInfo (whole device)")

    def no_driver(device):
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_driver)
    assert device_memory_used(cuda) == (None, None)


def test_in_a_container_nvml_finds_this_process_by_what_its_allocator_holds(nvml, monkeypatch):
    """NVML lists host PIDs, none of them ours: the process whose NVML figure can hold this process's reserved
    memory is ours; while two can, the device-wide reading stands; the PID found is kept."""
    GiB = 2**30
    reserved = {"bytes": 2 * GiB}
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved["bytes"])
    nvml.processes = {70001: 3 * GiB, 70002: int(3.5 * GiB), 70003: GiB}  # others' processes and ours (70001)
    cuda = torch.device("cuda", 0)
    assert device_memory_used(cuda) == (4, "cudaMemGetInfo (whole device)")  # 70001 and 70002 could both be ours
    reserved["bytes"] = 4 * GiB
    nvml.processes = {70001: int(4.5 * GiB), 70002: int(3.5 * GiB), 70003: 5 * GiB}  # 70003 grew: not a candidate
    assert device_memory_used(cuda) == (
        int(4.5 * GiB),
        "nvml (this process, matched by memory: PIDs of another namespace)",
    )
    reserved["bytes"] = GiB // 2  # the allocator released memory: the PID found is kept
    nvml.processes = {70001: 2 * GiB, 70002: 5 * GiB, 70004: 3 * GiB}
    assert device_memory_used(cuda) == (2 * GiB, "nvml (this process)")
    assert nvml.inits == 1


def test_the_table_compares_with_predictions_for_the_longest_tracked_batch(capsys):
    """Dynamic padding: the tracked batches are shorter than max_length. The predictions beside the measurements
    are for the longest tracked batch (and the batch that reached the tracked peak); the worst case is the fits
    line; memory.json holds them all."""
    from lit_memory.memory.measure.footprint import Footprint

    asked = []

    def predict(trainer, module, simulate, shape):
        asked.append(shape)
        rows, tokens = shape or (32, 128)
        return {
            "analytic": Footprint(
                {
                    "backward": {
                        "weights": 100,
                        "gradients": 0,
                        "optimizer": 200,
                        "activations": rows * tokens,
                        "other": 0,
                    }
                }
            )
        }

    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cpu")), log_dir=None, default_root_dir=None, world_size=1,
        accumulate_grad_batches=1, global_step=0, is_global_zero=True, optimizers=[],
        datamodule=SimpleNamespace(hparams={"batch_size": 32, "max_length": 128, "padding": "longest"}),
    )
    memory = MemorySettings(tier="1MiB")
    monitor = MemoryMonitor(track_steps=2, memory=memory)
    predictions = MemoryPredictions(monitor, predict)
    predictions.on_fit_start(trainer, None)
    monitor.on_fit_start(trainer, None)
    for step, tokens in enumerate((50, 41, 60)):  # the third step is past the tracked ones
        trainer.global_step = step
        batch = {"input_ids": torch.zeros(32, tokens, dtype=torch.long), "labels": torch.zeros(32, dtype=torch.long)}
        monitor.on_train_batch_start(trainer, torch.nn.Linear(2, 2), batch, step)
        if monitor.tracker is not None:
            monitor._stop_tracker()
        monitor._phase = None
    monitor.peak_batch = (32, 41)  # as if the second step, with its optimizer state, reached the tracked peak
    predictions.on_fit_end(trainer, None)
    assert asked == [None, (32, 50), (32, 41)]  # the worst case at the start; the tracked shapes at the end
    assert (monitor.longest_tracked, monitor.longest) == ((32, 50), (32, 60))
    MemoryTable(monitor, memory).on_fit_end(trainer, None)
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:8] == ["memory", "on", "cpu,", "batch", "32", "x", "50", "tokens"]
    rows = {line[:44].strip(): line[44:].split() for line in table[1:8]}
    assert rows["activations"][:2] == format_bytes(32 * 50).split()  # predicted at 32 x 50
    assert table[8] == (
        "  shorter batches: dynamic padding (data.padding: longest) pads each batch to its longest text; the longest "
        "tracked batch was 32 x 50 tokens, not 32 x 128 (max_length): predictions above are for 32 x 50"
    )
    assert (
        table[9]
        == f"  the tracked peak came in another batch, 32 x 41 tokens: analytic {format_bytes(300 + 32 * 41)} at "
        "that shape"
    )
    assert table[10] == (
        f"  fits (worst case: every batch 32 x 128, padded to max_length): analytic {format_bytes(300 + 32 * 128)} "
        "tensors: "
        "fits memory.tier 1.00 MiB"
    )
    record = monitor.record(trainer)
    assert record["batch_shape"] == [32, 128] and record["padding"] == "longest"
    assert record["longest_batch"] == {"tracked": [32, 50], "all": [32, 60], "tracked_peak": [32, 41]}
    assert record["predicted"]["analytic"]["peak_bytes"] == 300 + 32 * 128
    assert record["predicted_at_longest"]["tracked"]["analytic"]["peak_bytes"] == 300 + 32 * 50
    assert record["predicted_at_longest"]["tracked_peak"]["analytic"]["peak_bytes"] == 300 + 32 * 41


def test_a_report_that_fails_never_hides_the_out_of_memory_error(tmp_path, capsys, monkeypatch):
    """Whatever goes wrong while the report is made (here the untracked step's breakdown), the out-of-memory error
    stays the command's error line, with one line saying the report failed."""
    import lit_memory.run.monitor as monitor_module

    def broken(*args, **kwargs):
        raise RuntimeError("a storage the breakdown cannot read")

    monkeypatch.setattr(monitor_module, "live_breakdown", broken)
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "fit",
                "--config",
                str(RECIPES / "baseline.yaml"),
                *FAST,
                *MEASURE,
                f"--trainer.default_root_dir={tmp_path}",
                "--memory.track_steps=0",
                "--trust-recipe",
                "--trainer.callbacks+=oom.RaiseOutOfMemory",
            ]
        )
    assert exit_.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert "out-of-memory report failed: RuntimeError: a storage the breakdown cannot read" in err
    assert err[-1] == f"error: out of memory: {oom.MESSAGE}"
