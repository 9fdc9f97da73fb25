"""The device a prediction is for (lit_memory.memory.hardware.gpus): the context table, its overrides, the
workspaces."""

from __future__ import annotations

import pytest

from lit_memory.errors import UserError
from lit_memory.memory.hardware.allocator import AllocatorConfig
from lit_memory.memory.hardware.gpus import CONTEXTS, GPUS, LAZY_KERNELS, MiB, Target, target

CUDA_ENV = ("CUDA_MODULE_LOADING", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # either allocator variable is read


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


# -- the catalogue: what cards expose ------------------------------------------------------------------

GiB = 2**30
ISSUE_KEYS = (
    "rtx3050-4gb", "gtx1650", "gtx1050ti", "t1000", "mx450", "t4", "l4", "a10g", "rtx3060", "rtx3090", "rtx4060",
    "rtx4090", "a100-40gb", "a100-80gb", "h100",
)


def test_the_catalogue_states_what_torch_reports_not_the_sticker():
    from lit_memory.memory.hardware.gpus import gpu

    assert set(ISSUE_KEYS) <= set(GPUS)
    for key in ISSUE_KEYS:
        card = GPUS[key]
        assert card.key == key and card.tflops > 0 and card.host_gbps > 0 and card.link.startswith("PCIe")
    # 4 GB cards: "3.81 GiB total capacity" on Linux; 2 GB about 1.96; a T4 14.75; an 80 GB card about 79
    for key in ("rtx3050-4gb", "gtx1650", "t1000"):
        assert GPUS[key].memory / GiB == pytest.approx(3.81, abs=0.01), key
    assert 3.9 < GPUS["gtx1050ti"].memory / GiB < 4.0
    assert GPUS["mx450"].memory / GiB == pytest.approx(1.96, abs=0.02)
    assert GPUS["t4"].memory == 15102 * MiB
    for key in ("a100-80gb", "h100"):
        assert 79 * GiB < GPUS[key].memory < 80 * GiB
    assert GPUS["a100-40gb"].memory == 42298834944 // MiB * MiB
    # bf16 from the compute capability: Ampere (sm80) and newer
    assert {k for k in ISSUE_KEYS if GPUS[k].bf16} == {
        "rtx3050-4gb", "l4", "a10g", "rtx3060", "rtx3090", "rtx4060", "rtx4090", "a100-40gb", "a100-80gb", "h100"
    }
    assert GPUS["gtx1050ti"].capability == (6, 1) and GPUS["t4"].capability == (7, 5)
    assert gpu("A10") is GPUS["a10"] and gpu("a10-a10g") is GPUS["a10g"]  # the old combined key, kept
    assert gpu("RTX3050_Laptop") is GPUS["rtx3050-4gb"]


def test_mig_slices_are_targets_with_the_slices_memory_and_share_of_the_peak():
    slice_ = GPUS["a100-40gb-1g.5gb"]
    assert slice_.memory == int(4.75 * GiB) and slice_.capability == (8, 0)
    assert slice_.tflops == pytest.approx(GPUS["a100-40gb"].tflops / 7.7, rel=0.05)
    assert GPUS["h100-1g.10gb"].memory == int(9.75 * GiB) and GPUS["a100-80gb-7g.80gb"].memory == 79 * GiB
    assert Target(gpu=slice_).describe().startswith("A100 40GB MIG 1g.5gb (sm80, 4.75 GiB)")


@pytest.mark.parametrize("name, key", [
    ("NVIDIA GeForce RTX 3050 Laptop GPU", "rtx3050-4gb"),
    ("NVIDIA GeForce GTX 1650", "gtx1650"),
    ("NVIDIA GeForce GTX 1050 Ti", "gtx1050ti"),
    ("Quadro T1000", "t1000"),
    ("NVIDIA GeForce MX450", "mx450"),
    ("Tesla T4", "t4"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA A10G", "a10g"),
    ("NVIDIA A10", "a10"),
    ("NVIDIA GeForce RTX 3060", "rtx3060"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "a100-40gb-1g.5gb"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "h100-3g.40gb"),
])
def test_a_real_card_is_matched_by_name_and_keeps_its_own_numbers(name, key):
    from lit_memory.memory.hardware.gpus import match

    found = match(name, (8, 6), 1234 * MiB)
    assert found.key == key and found.name == name
    assert found.memory == 1234 * MiB and found.capability == (8, 6)  # what torch reports wins
    assert (found.tflops, found.host_gbps) == (GPUS[key].tflops, GPUS[key].host_gbps)  # the catalogue's speeds


def test_an_unknown_card_keeps_what_torch_reports(monkeypatch):
    """`target` on a machine with a GPU (torch's answers faked): a known card keeps the catalogue's speeds
    (before, `_this_gpu` replaced them with defaults), an unknown one what torch says."""
    from types import SimpleNamespace

    import torch

    from lit_memory.memory.hardware.gpus import match

    unknown = match("NVIDIA Some Future GPU", (12, 0), 96 * GiB)
    assert (unknown.key, unknown.memory, unknown.capability, unknown.tflops) == ("", 96 * GiB, (12, 0), 100.0)
    props = SimpleNamespace(name="Tesla T4", major=7, minor=5, total_memory=15095 * MiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    found = target("cuda").gpu
    assert found.key == "t4" and found.memory == 15095 * MiB and found.tflops == 65 and found.host_gbps == 12


def test_a_memory_setting_reads_a_card_or_a_size():
    from lit_memory.memory.hardware.gpus import capacity

    assert capacity("rtx3050-4gb") == GPUS["rtx3050-4gb"].memory
    assert capacity("4GiB") == 4 * GiB and capacity(123) == 123
    with pytest.raises(UserError, match="cannot read 'rtx9999' as a memory size or a GPU"):
        capacity("rtx9999")


# -- the run's own card (a fake reading: these decisions are CUDA-only) ----------------------------


def reading(free: float, context=300 * MiB, total=GPUS["rtx3050-4gb"].memory):
    from lit_memory.memory.hardware.gpus import CardReading

    return CardReading(
        "NVIDIA GeForce RTX 3050 Laptop GPU", total, int(free * GiB), context, "nvml (this process)", (8, 6)
    )


def test_auto_plans_for_the_smaller_of_the_budget_and_what_the_card_has_free():
    from lit_memory.memory.hardware.gpus import BARE_CONTEXT, planning_limit
    from lit_memory.memory.margin import Limit

    tier = Limit(GPUS["rtx3050-4gb"].memory, "memory.tier rtx3050-4gb (3.81 GiB)", 0.1)
    # a desktop beside the run holds memory: less free than the tier, the card's limit applies, with the margin
    limit, line = planning_limit(tier, reading(3.2), 0.1)
    assert limit.bytes == int(3.2 * GiB) + 300 * MiB and limit.margin == 0.1  # free, plus this process's context
    assert "free memory at start" in limit.words and "less than memory.tier rtx3050-4gb" in line
    # a bare card: the tier applies
    two = Limit(2 * GiB, "memory.tier 2.00 GiB")
    limit, line = planning_limit(two, reading(3.4), 0.08)
    assert limit == two and line.startswith("memory: auto plans for memory.tier")
    # no budget: the card's free memory; no NVML: the smallest published context assumed (errs low)
    limit, line = planning_limit(None, reading(3.0, context=None), 0.08)
    assert limit.bytes == int(3.0 * GiB) + BARE_CONTEXT and "not measured" in line
    assert planning_limit(two, None, 0.08) == (two, "")  # CPU


def test_the_budget_caps_the_device_total_the_context_included():
    from lit_memory.memory.hardware.gpus import allocator_limit

    limit, line = allocator_limit(3 * GiB, reading(3.5, context=400 * MiB))
    assert limit == 3 * GiB - 400 * MiB and "less this process's CUDA context at start, 400.00 MiB" in line
    total = GPUS["rtx3050-4gb"].memory
    limit, _ = allocator_limit(3 * GiB, reading(3.0, context=None))  # not measured: all the card holds
    assert limit == 3 * GiB - (total - int(3.0 * GiB))
    assert allocator_limit(10 * GiB, reading(3.5))[0] == total  # never above the card
