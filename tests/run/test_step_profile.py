"""`lit_memory.run.step_profile`: one step's profile as numbers (on this CPU; a GPU's kernels are events of the same
kind)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lit_memory.run.step_profile import (
    HostOpCounter,
    HostOps,
    StepProfiler,
    device_work,
    source_of,
    summarise,
    union_length,
)


def test_overlapping_intervals_count_once():
    assert union_length([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert union_length([]) == 0


def _event(name, start, end, device=False, parent=None, annotation=False, stack=(), activity=None):
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=kind,
                           cpu_parent=parent, is_user_annotation=annotation, stack=list(stack), activity_type=activity,
                           is_python_function=bool(parent is None and ".py(" in name))


def test_a_step_is_busy_where_kernels_run_and_a_sync_is_named_by_who_asked():
    """Kernels on two streams overlap (busy once), an annotation mirrored on the device is no kernel, and a
    synchronisation is traced to the innermost Python frame that is not torch's machinery."""
    frame = _event("lit_memory/model.py(12): training_step", 0, 900)
    inner = _event("torch/_tensor.py(40): item", 100, 200, parent=frame)
    read = _event("aten::_local_scalar_dense", 110, 190, parent=inner)
    sync = _event("cudaStreamSynchronize", 120, 180, parent=read)
    launches = [_event("cudaLaunchKernel", t, t + 5) for t in (10, 300, 600)]
    kernels = [_event("gemm", 20, 220, device=True), _event("gemm", 200, 300, device=True),
               _event("softmax", 610, 660, device=True)]
    annotation = _event("Optimizer.step#AdamW.step", 0, 1000, device=True, annotation=True)
    found = summarise([frame, inner, read, sync, *launches, *kernels, annotation], cuda=True)
    assert found["device_busy_ms"] == (280 + 50) / 1000 and found["kernels"] == 3
    assert found["wall_ms"] == 0.9 and found["device_idle_ms"] == pytest.approx(0.57)
    assert found["syncs"] == 1 and found["scalar_reads"] == 1 and found["launches"] == 3
    assert found["host_blocked_in_syncs_ms"] == 0.06 and found["host_issue_ms"] == (605 - 60) / 1000
    assert found["sync_sources"] == {"cudaStreamSynchronize <- lit_memory/model.py(12): training_step": 1,
                                     "aten::_local_scalar_dense <- lit_memory/model.py(12): training_step": 1}
    assert found["top_kernels"][0] == {"name": "gemm", "calls": 2, "total_ms": 0.3}
    assert source_of(_event("x", 0, 1)) == "?"


def test_the_profiler_writes_the_step_after_warmup(tmp_path):
    """A real profile of one CPU step: the events of an optimizer step, host ops counted, the trace kept."""
    profiler = StepProfiler(warmup=1, trace=True)
    profiler.run_dir = tmp_path
    model = torch.nn.Linear(8, 8)
    module = SimpleNamespace(device=torch.device("cpu"))
    trainer = SimpleNamespace(global_step=0)
    for step in range(3):
        trainer.global_step = step
        profiler.on_train_batch_start(trainer, module, None, step)
        model(torch.randn(4, 8)).sum().backward()
        trainer.global_step = step + 1
        profiler.on_train_batch_end(trainer, module, None, None, step)
    summary = json.loads((tmp_path / StepProfiler.FILE).read_text())
    assert summary["device"] == "cpu" and summary["wall_ms"] > 0
    assert summary["top_host_ops"] and summary["scalar_reads"] == 0
    assert (tmp_path / StepProfiler.TRACE).stat().st_size > 0


def test_only_device_work_counts_as_kernels_and_a_sync_is_named_by_the_python_line_in_its_ops_stack():
    """torch 2.11's profile (the H200 record): the host's ``Optimizer.step#AdamW.step`` range mirrored on the device
    with no annotation flag is no kernel, and the frames of ``.item()`` are the op's ``stack``, not parents; torch
    2.13's: the activity type decides. The profiler's own synchronisations are left out."""
    host_range = _event("Optimizer.step#AdamW.step", 0, 900)
    mirror = _event("Optimizer.step#AdamW.step", 0, 900, device=True)
    kernel = _event("nvjet_sm90_gemm", 10, 60, device=True)
    assert device_work([mirror, kernel], [host_range]) == [kernel]
    typed = [
        _event("k", 0, 1, device=True, activity="kernel"),
        _event("Memcpy HtoD", 1, 2, device=True, activity="gpu_memcpy"),
        _event("ProfilerStep#3", 0, 9, device=True, activity="gpu_user_annotation"),
    ]
    assert [e.name for e in device_work(typed, [])] == ["k", "Memcpy HtoD"]
    item = _event(
        "aten::item",
        100,
        200,
        stack=[
            "lightning/pytorch/trainer/connectors/logger_connector/result.py(491): metrics",
            "lit_memory/model.py(330): on_train_batch_end",
            "train.py(3): <module>",
        ],
    )
    read = _event("aten::_local_scalar_dense", 110, 190, parent=item)
    sync = _event("cudaStreamSynchronize", 120, 180, parent=read)
    own = _event("cudaDeviceSynchronize", 890, 899, stack=["lit_memory/run/step_profile.py(80): on_train_batch_end"])
    found = summarise([host_range, item, read, sync, own, mirror, kernel], cuda=True)
    assert found["kernels"] == 1 and found["device_busy_ms"] == 0.05
    assert found["syncs"] == 1 and found["sync_sources"] == {
        "cudaStreamSynchronize <- lit_memory/model.py(330): on_train_batch_end": 1,
        "aten::_local_scalar_dense <- lit_memory/model.py(330): on_train_batch_end": 1}
    assert source_of(_event("x", 0, 1, parent=_event("aten::add", 0, 1))) == "aten::add"  # no frames: the nearest op


def test_host_ops_count_the_dispatched_operators_of_one_optimizer_step():
    """Forward, backward and the optimizer's step, each operator once as the dispatcher sees it below autograd
    (``linear``: ``t`` and ``addmm``; its backward's matmuls); the window is one step, end to end."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with HostOps() as counted:
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
    assert counted.ops["aten::addmm"] == 1 and counted.ops["aten::t"] >= 1 and counted.ops["aten::mm"] >= 1
    assert counted.total == sum(counted.ops.values()) > 6
    counter = HostOpCounter(step=1, save=True)
    counter.run_dir = None
    trainer = SimpleNamespace(global_step=0, accumulate_grad_batches=1, is_global_zero=False)
    counter.on_train_start(trainer, None)
    for step in range(3):
        with torch.no_grad():
            model(torch.ones(3, 4)) if step != 1 else [model(torch.ones(3, 4)) for _ in range(2)]
        trainer.global_step = step + 1
        counter.on_train_batch_end(trainer, None, None, None, step)
    assert counter.counted["step"] == 1 and counter.counted["top_host_ops"]["aten::addmm"] == 2  # step 1's two forwards
    assert counter._mode is None
