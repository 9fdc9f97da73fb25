"""The device a prediction is for (lit_memory.memory.device): the context table, its overrides, the workspaces."""

from __future__ import annotations

import pytest

from lit_memory.errors import UserError
from lit_memory.memory.allocator import AllocatorConfig
from lit_memory.memory.device import CONTEXTS, GPUS, LAZY_KERNELS, MiB, Target, target

CUDA_ENV = ("CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF")


def test_the_context_follows_module_loading_and_the_gpu_generation():
    eager = Target(gpu=GPUS["v100-16gb"], cuda="11.2")
    lazy = Target(gpu=GPUS["a100-80gb"], cuda="12.4")
    newer = Target(gpu=GPUS["h100"], cuda="12.4")
    assert not eager.lazy and lazy.lazy  # CUDA 11.7 brought lazy loading; PyTorch turns it on from 1.13
    assert eager.context_bytes == 1341 * MiB  # the transformers docs' V100 reading, less its tensor's segment
    assert 600 * MiB < lazy.context_bytes < 650 * MiB  # measured in training
    assert newer.context_bytes == 426 * MiB + LAZY_KERNELS  # a bare sm89+ context and the step's kernels
    assert all(row.source.startswith("https://") for row in CONTEXTS)
    assert Target(type="cpu").context_bytes == 0
    assert Target(context=1234).context_bytes == 1234  # --cuda-context


def test_cublas_workspaces_count_from_torch_2_and_are_larger_on_hopper():
    assert Target(gpu=GPUS["a100-80gb"]).cublas_workspace == 8_519_680
    assert Target(gpu=GPUS["h100"]).cublas_workspace == 32 * MiB
    assert Target(torch="1.13").cublas_workspace == 0
    assert Target(torch="1.10").softmax_keeps_input and not Target(torch="2.0").softmax_keeps_input


def test_the_target_reads_this_environment(monkeypatch):
    for name in CUDA_ENV:
        monkeypatch.delenv(name, raising=False)
    found = target("cuda", "t4", "12.1", context=None)
    assert found.gpu == GPUS["t4"] and found.cuda == "12.1" and found.allocator == AllocatorConfig()
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    found = target("cuda", "t4", "12.1", context=None)
    assert not found.lazy and found.allocator.expandable_segments
    assert target("cpu").type == "cpu"
    with pytest.raises(UserError, match="unknown GPU 'k80'"):
        target("cuda", "k80")
    with pytest.raises(UserError, match="cannot read version"):
        target("cuda", "t4", "twelve")
