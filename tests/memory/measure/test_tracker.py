"""The tracker: every live tensor attributed, per phase; the process's own peak."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO
from torch import nn

from lit_memory.memory.measure.footprint import PHASES
from lit_memory.memory.measure.tracker import MemoryBudgetExceeded, Tracker
from lit_memory.optim.optimizers import compiles_its_step


def tiny_step(tracker: Tracker):
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 64)
    tracker.track_external(model, optimizer, x)
    with tracker:
        tracker.enter_phase("forward")
        loss = model(x).square().mean()
        tracker.enter_phase("backward")
        loss.backward()
        tracker.enter_phase("step")
        optimizer.step()
    return model


def test_tracker_attributes_each_phase():
    tracker = Tracker()
    model = tiny_step(tracker)
    params = sum(p.numel() * 4 for p in model.parameters())
    phases = tracker.footprint.phases
    assert set(phases) == set(PHASES)
    assert phases["forward"]["weights"] == params and phases["forward"]["gradients"] == 0
    assert phases["forward"]["activations"] >= 16 * 256 * 4  # at least the hidden layer's output
    assert 0 < phases["backward"]["gradients"] <= params and phases["step"]["gradients"] == params
    assert phases["step"]["optimizer"] >= 2 * params  # Adam's moments (+ step counters, temporaries)
    assert tracker.footprint.peak == sum(tracker.footprint.categories.values())


def test_a_tracked_step_keeps_nothing_alive_after_it():
    """torch's MemTracker (its ModTracker's multi-grad hooks) kept each tracked step's autograd graph alive in
    a reference cycle through C++, and the graph its model's parameters: a model's size per fit."""
    import gc
    import weakref

    refs = []
    for _ in range(3):
        model = tiny_step(Tracker())
        refs.append(weakref.ref(model[0].weight))
        del model
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_tracker_budget_raises_cudas_out_of_memory_error_with_the_breakdown():
    tracker = Tracker(budget=40_000)
    with pytest.raises(torch.OutOfMemoryError) as err:
        tiny_step(tracker)
    assert isinstance(err.value, MemoryBudgetExceeded)
    assert sum(err.value.categories.values()) > 40_000
    assert err.value.categories["weights"] > 0


def test_frozen_parameters_and_gradients_freed_inside_backward_are_tracked_quietly(recwarn):
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    model[0].weight.requires_grad_(False)  # MemTracker's own hooks raise on a frozen parameter
    for p in model[1].parameters():  # a fused step frees each gradient as soon as it is accumulated
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tracker = Tracker()
    tracker.track_external(model)
    with tracker:
        tracker.enter_phase("backward")
        model(torch.randn(8, 32)).sum().backward()
    assert tracker.footprint.phases["backward"]["weights"] == sum(p.numel() * 4 for p in model.parameters())
    assert not [w for w in recwarn if "Expected a tensor" in str(w.message)]  # MemTracker's, for a freed gradient


def test_only_the_stepped_optimizers_state_is_labelled_after_a_step():
    params = [nn.Parameter(torch.randn(64)) for _ in range(4)]
    shared = torch.optim.SGD(params, lr=0.1, momentum=0.9)  # the state both bucket optimizers share
    buckets = [torch.optim.SGD(params[:2], lr=0.1, momentum=0.9), torch.optim.SGD(params[2:], lr=0.1, momentum=0.9)]
    for bucket in buckets:
        bucket.state = shared.state
    tracker = Tracker()
    tracker.track_external(*params)
    labelled = []
    original = tracker._update_and_maybe_create_winfos
    tracker._update_and_maybe_create_winfos = lambda t, kind: labelled.append(kind) or original(t, kind)
    with tracker:
        tracker.enter_phase("step")
        for bucket in buckets:
            for p in params:
                p.grad = torch.ones_like(p)
            bucket.step()
    # 2 momentum buffers after each bucket: not the whole shared state again after the second
    assert sum(kind.value == "Optstate" for kind in labelled) == 4


def compiled_step(tracker: Tracker, closure: bool) -> None:
    """One torchao AdamW8bit step on a (64, 64) matrix and its bias (shapes tests/optim/test_lowbit.py compiles
    too), tracked by ``tracker``: with Lightning's closure (forward and backward inside the step) or, as a
    fused bucket is stepped, without one."""
    from torchao.optim import AdamW8bit

    model = nn.Linear(64, 64)
    optimizer = AdamW8bit([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}], lr=1e-3)
    x = torch.randn(8, 64)
    tracker.track_external(model, optimizer, x)

    def forward_backward():
        tracker.enter_phase("forward")
        loss = model(x).square().mean()
        tracker.enter_phase("backward")
        loss.backward()
        tracker.enter_phase("step")
        return loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as tests/optim/test_lowbit.py: its compiled kernels are reused, not compiled anew
    try:
        with tracker:
            if closure:
                optimizer.step(forward_backward)
            else:
                forward_backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("closure", [True, False], ids=["lightning-closure", "fused-bucket-call"])
def test_a_compiled_optimizer_step_runs_under_the_tracker_and_its_state_is_counted(closure):
    """torchao compiles its update with ``fullgraph=True``, which dynamo refuses under a dispatch mode
    ("torch.compile with fullgraph=True found no compiled frames", and afterwards in the whole process: not
    tried here): the tracker steps out for the update, after the closure's forward and backward, which
    it tracks, and labels the state the update made."""
    tracker = Tracker(compiled_steps=compiles_its_step)
    compiled_step(tracker, closure)
    step = tracker.footprint.phases["step"]
    assert step["gradients"] == (64 * 64 + 64) * 4  # made by the closure's backward, tracked
    # 8-bit moments of the matrix (codes, a fp32 scale per 256, a 256-entry fp32 map each), fp32 ones of the
    # bias, two step counters
    assert step["optimizer"] == 2 * (64 * 64 + 4 * 16 + 4 * 256) + 2 * 64 * 4 + 2 * 4


def test_process_peak_grows_with_a_large_allocation():
    """In a fresh process: a long-lived test worker can release memory between the start and the allocation
    (CI's worker, after the long files: 37.8 MiB of growth for 64 MiB), which then fits under its old peak."""
    code = (
        "import torch; from lit_memory.memory.measure.tracker import ProcessPeak; p = ProcessPeak(); "
        "b = torch.ones(64 * 2**20, dtype=torch.uint8); print(p.growth, p.peak - p.start)"  # 64 MiB, touched
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    growth, above_start = map(int, done.stdout.split())
    assert growth >= 48 * 2**20 and above_start >= 0


def test_process_peak_starts_afresh_in_a_process_started_by_a_large_one():
    """A run started by a large process (a test runner, a notebook) measures its own peak, not the
    parent's: getrusage's max RSS carries over fork and exec."""
    block = torch.ones(512 * 2**20, dtype=torch.uint8)  # 512 MiB, touched, in this (the parent) process
    code = "from lit_memory.memory.measure.tracker import ProcessPeak; p = ProcessPeak(); print(p.peak, p.growth)"
    peak, growth = map(
        int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    assert peak < 512 * 2**20 and growth < 128 * 2**20
    del block
