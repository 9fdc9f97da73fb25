"""The CUDA device a prediction is for: the GPU, the CUDA context, the libraries' workspaces.

A process that trains on a GPU holds more than its tensors (``max_memory_allocated``) and more than its
caching allocator's segments (``max_memory_reserved``): the CUDA context (the driver's own state and the
loaded kernel images) and the libraries' workspaces. ``nvidia-smi`` shows all of it. What the context
costs depends on the GPU, the CUDA version and lazy module loading; the defaults below are published
measurements (`CONTEXTS`, each with its source), and ``estimate --cuda-context SIZE`` replaces them with
the user's own reading (``nvidia-smi`` after ``torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from lit_memory.errors import UserError
from lit_memory.memory.hardware.allocator import AllocatorConfig, environment_conf
from lit_memory.memory.hardware.nccl import NcclSettings
from lit_memory.memory.margin import Limit
from lit_memory.memory.measure.footprint import format_bytes, parse_bytes

DEVICES = ("cuda", "cpu")  # the devices a prediction is for (`Target.type`)

MiB = 2**20


@dataclass(frozen=True)
class Gpu:
    """What a card exposes to a PyTorch process: ``torch.cuda.get_device_properties``' name, compute capability
    and ``total_memory`` (cudaDeviceProp.totalGlobalMem: on Linux a little less than the sticker, the driver's
    reserve taken out), and, for choosing between recompute and offloading only (`lit_memory.planning.recompute`),
    the datasheet's dense 16-bit peak with fp32 accumulation (what autocast's matmuls run at; tensor cores where
    the card has them) and the host link's bandwidth one way (pinned copies, as bandwidthTest measures them:
    PCIe 3.0 x16 about 12 GB/s, 4.0 x16 about 25, 5.0 x16 about 50; fewer lanes, proportionally less)."""

    name: str
    capability: tuple[int, int]  # compute capability (major, minor)
    memory: int  # bytes torch reports as total_memory (the capacity a plan must fit)
    tflops: float = 100.0
    fp32_tflops: Optional[float] = None  # the datasheet's plain fp32 (no TF32) peak, where known: fp32 recipes' MFU
    host_gbps: float = 25.0
    link: str = "PCIe 4.0 x16"
    key: str = ""  # its catalogue key (`GPUS`); empty for a card the catalogue does not know
    pattern: str = ""  # a regular expression matching torch's device name (`match`)

    @property
    def bf16(self) -> bool:
        """bf16 tensor cores (Ampere, sm80, and newer). Below that ``torch.cuda.is_bf16_supported()`` may still
        answer True (emulated), which is not what a recipe should plan on."""
        return self.capability >= (8, 0)

    @property
    def label(self) -> str:
        """How a decision names it: the catalogue key, else torch's name."""
        return self.key or self.name


def _card(key: str, name: str, capability: tuple[int, int], mib: float, tflops: float, link: str, pattern: str,
          fp32_tflops: Optional[float] = None) -> Gpu:
    return Gpu(name, capability, int(mib * MiB), tflops=tflops, host_gbps=HOST_GBPS[link], link=link, key=key,
               pattern=pattern, fp32_tflops=fp32_tflops)


# Pinned host-to-device bandwidth, one way, by link: PCIe 3.0 x16 ~12 GB/s, 4.0 x16 ~25 GB/s (bandwidthTest
# readings; 4.0 x8 and x4, half and a quarter of it), 5.0 x16 ~50 GB/s.
HOST_GBPS = {"PCIe 3.0 x16": 12.0, "PCIe 4.0 x4": 6.0, "PCIe 4.0 x8": 12.0, "PCIe 4.0 x16": 25.0, "PCIe 5.0 x16": 50.0}

# The catalogue. Capacity: torch's ``total_memory`` on Linux in MiB, from a published print of it (or of
# deviceQuery's "Total amount of global memory", the same cudaDeviceProp field, or an out-of-memory message's
# "total capacity" in GiB, torch's total_memory / 2**30), each with its source; it moves by a few MiB with the
# driver and the board (Windows reports the full sticker size: ignore those prints). Peak: the datasheet's dense
# (no sparsity) 16-bit throughput with fp32 accumulation; GeForce cards run fp32 accumulation at half their
# fp16-accumulate tensor rate, which is what their marketing quotes. Cards without tensor cores (GTX 16xx/10xx,
# T1000, MX450) at their shader fp16 rate.
GPUS = {
    c.key: c
    for c in (
        # RTX 3050 Laptop 4 GB (GA107, sm86): "3.81 GiB total capacity" on Linux; 3902 MiB in published
        # torch.cuda.get_device_properties prints; Windows deviceQuery shows 4096 MiB
        # (4294443008 B, WDDM). Peak: 15.2 TFLOP/s bf16 matmul measured through PyTorch
        # (https://github.com/zzc0721/torch-performance-test-data/issues/57). Link: GA107 has PCIe 4.0 x8.
        _card("rtx3050-4gb", "GeForce RTX 3050 Laptop GPU 4GB", (8, 6), 3902, 15.2, "PCIe 4.0 x8", r"RTX 3050 Laptop"),
        # GTX 1650 (TU117, sm75, no tensor cores): total_memory=3902MB in a printed _CudaDeviceProperties list
        # (a GNN training script's comment, two GTX 1650 beside RTX 3090s); "3.81 GiB total capacity"
        # (https://github.com/ultralytics/yolov5/issues/285, GTX 1650). fp16 at twice its 2.98 TFLOP/s fp32.
        _card("gtx1650", "GeForce GTX 1650", (7, 5), 3902, 5.97, "PCIe 3.0 x16", r"GTX 1650"),
        # GTX 1050 Ti (GP107, sm61): deviceQuery 4040 MiB (4236312576 B), CUDA 9.1 driver, several published
        # READMEs. Pascal GeForce runs fp16 at 1/64 of fp32 (2.14 TFLOP/s): 0.03; in practice it trains fp32.
        _card("gtx1050ti", "GeForce GTX 1050 Ti", (6, 1), 4040, 0.03, "PCIe 3.0 x16", r"GTX 1050 Ti"),
        # T1000 4 GB (TU117, sm75, no tensor cores): the GTX 1650's chip and 4 GB; no print of its own found,
        # so the 1650's 3902 MiB. fp16 at twice its 2.5 TFLOP/s fp32.
        _card("t1000", "T1000", (7, 5), 3902, 5.0, "PCIe 3.0 x16", r"\bT1000\b"),
        # MX450 2 GB (TU117, sm75, laptop): 2 GB cards report 1.96-2.00 GiB in published prints; 1.96 GiB taken (the
        # 4 GB TU117 boards lose 194 MiB to the driver, a 2 GB one proportionally less). PCIe 4.0 x4.
        _card("mx450", "GeForce MX450", (7, 5), 1.96 * 1024, 5.6, "PCIe 4.0 x4", r"MX450"),
        # Tesla T4 (sm75): total_memory=15102MB (Colab prints), 14.75 GiB in OOM messages;
        # 65 TFLOP/s fp16 tensor (datasheet).
        _card("t4", "Tesla T4", (7, 5), 15102, 65, "PCIe 3.0 x16", r"\bT4\b"),
        # L4 (sm89): deviceQuery 22518 MiB (23612293120 B, driver 12.0); 121 TFLOP/s bf16 dense (datasheet).
        _card("l4", "L4", (8, 9), 22518, 121, "PCIe 4.0 x16", r"\bL4\b"),
        # A10G (AWS g5, sm86): total_memory=22587MB (torch 2.x + cu130 print); NVIDIA publishes no tensor peak
        # for it: about 70 TFLOP/s bf16 dense is what AWS's and others' comparisons use.
        _card("a10g", "A10G", (8, 6), 22587, 70, "PCIe 4.0 x16", r"A10G"),
        # A10 (sm86): "total capacty of 21.99 GiB" (https://github.com/zai-org/CogVLM/issues/236, Lambda A10);
        # 125 TFLOP/s bf16 dense (datasheet).
        _card("a10", "A10", (8, 6), 21.99 * 1024, 125, "PCIe 4.0 x16", r"\bA10\b(?!G)"),
        # RTX 3060 12 GB (sm86): total_memory=12044MB (the printed list above); 25.6 TFLOP/s fp16 tensor with
        # fp32 accumulation (GA106: half of its 51.2 with fp16 accumulation).
        _card("rtx3060", "GeForce RTX 3060", (8, 6), 12044, 25.6, "PCIe 4.0 x16", r"RTX 3060(?! Ti)"),
        # RTX 3090 (sm86): total_memory=24259MB (the printed list above); 71 TFLOP/s with fp32 accumulation.
        _card("rtx3090", "GeForce RTX 3090", (8, 6), 24259, 71, "PCIe 4.0 x16", r"RTX 3090"),
        # RTX 4060 8 GB (AD107, sm89): "total capacity of 7.75 GiB" (https://github.com/ESRSchao/EdgeRegNet/issues/2);
        # 15.1 TFLOP/s with fp32 accumulation (half of 30.2). PCIe 4.0 x8.
        _card("rtx4060", "GeForce RTX 4060", (8, 9), 7.75 * 1024, 15.1, "PCIe 4.0 x8", r"RTX 4060(?! Ti)"),
        # RTX 4090 (sm89): "total capacty of 23.64 GiB" (https://github.com/3DTopia/Phidias-Diffusion/issues/8,
        # Linux; nvidia-smi shows 24564 MiB); 82.6 TFLOP/s with fp32 accumulation (half of 165.2).
        _card("rtx4090", "GeForce RTX 4090", (8, 9), 23.64 * 1024, 82.6, "PCIe 4.0 x16", r"RTX 4090"),
        # V100 (sm70): nvidia-smi's 16160 / 32510 MiB (driver 460 era, when it reported what torch did); 125 TFLOP/s
        # fp16 tensor; SXM2's host link is PCIe 3.0 x16.
        _card("v100-16gb", "Tesla V100 16GB", (7, 0), 16160, 125, "PCIe 3.0 x16", r"V100.*16\s?GB"),
        _card("v100-32gb", "Tesla V100 32GB", (7, 0), 32510, 125, "PCIe 3.0 x16", r"V100.*32\s?GB"),
        # A100 40GB (sm80): deviceQuery 40339 MiB (42298834944 B, driver 12.2;
        # https://github.com/bottlerocket-os/bottlerocket/pull/3873); 312 TFLOP/s bf16 dense.
        _card("a100-40gb", "A100 40GB", (8, 0), 40339, 312, "PCIe 4.0 x16", r"A100.*40\s?GB", fp32_tflops=19.5),
        # A100 80GB (sm80): deviceQuery 81158 MiB (85100068864 B, driver 12.5; 81051 MiB with driver 12.2).
        _card("a100-80gb", "A100 80GB", (8, 0), 81158, 312, "PCIe 4.0 x16", r"A100.*80\s?GB", fp32_tflops=19.5),
        # H100 80GB HBM3 (sm90): deviceQuery 81079 MiB (85017755648 B) with a CUDA 13.0 driver, as on this
        # project's lent machines (driver 580); nvidia-smi shows 81559 MiB there, 551 MiB of it reserved by the
        # driver; older drivers' torch said "79.11 GiB total capacity"
        # (https://github.com/vllm-project/vllm/issues/27508). 989 TFLOP/s bf16 dense, 67 fp32 (SXM datasheet), PCIe
        # 5.0.
        _card("h100", "H100 80GB HBM3", (9, 0), 81079, 989, "PCIe 5.0 x16", r"H100", fp32_tflops=67),
        # H200 (sm90, 141 GB HBM3e): total_memory=150109880320 B (143156 MiB) with torch 2.11+cu130 and driver 580 on
        # this project's lent machine, where nvidia-smi shows 143771 MiB (docs/gpu/h200.json's call). The H100's
        # compute: 989 TFLOP/s bf16 dense, 67 fp32 (H200 SXM datasheet), PCIe 5.0.
        _card("h200", "H200", (9, 0), 143156, 989, "PCIe 5.0 x16", r"H200", fp32_tflops=67),
    )
}

# MIG slices: a GPU instance is a device of its own to CUDA (torch's name: "<GPU> MIG 1g.5gb"), with the slice's
# memory as its total and its share of the streaming multiprocessors. Memory: ``nvidia-smi mig -lgip``'s GiB
# (NVIDIA's MIG user guide's tables, reprinted in many setup notes), which is what the slice reports as total.
# Peak: the parent's, by the slice's SMs (A100: 14 of 108 per g; H100 SXM: 16 of 132).
MIG = {
    "a100-40gb": (108, {"1g.5gb": (4.75, 14), "1g.10gb": (9.75, 14), "2g.10gb": (9.75, 28), "3g.20gb": (19.62, 42),
                        "4g.20gb": (19.62, 56), "7g.40gb": (39.5, 98)}),
    "a100-80gb": (108, {"1g.10gb": (9.5, 14), "1g.20gb": (19.5, 14), "2g.20gb": (19.5, 28), "3g.40gb": (39.25, 42),
                        "4g.40gb": (39.25, 56), "7g.80gb": (79.0, 98)}),
    "h100": (132, {"1g.10gb": (9.75, 16), "1g.20gb": (19.62, 26), "2g.20gb": (19.62, 32), "3g.40gb": (39.5, 60),
                   "4g.40gb": (39.5, 64), "7g.80gb": (79.25, 132)}),
}
for _parent, (_sms, _profiles) in MIG.items():
    for _profile, (_gib, _slice_sms) in _profiles.items():
        _of = GPUS[_parent]
        _key = f"{_parent}-{_profile}"
        GPUS[_key] = replace(
            _of,
            name=f"{_of.name} MIG {_profile}",
            memory=int(_gib * 1024 * MiB),
            tflops=round(_of.tflops * _slice_sms / _sms, 1),
            key=_key,
            pattern=f"(?:{_of.pattern}).*MIG {re.escape(_profile)}$",
        )
# Older names, kept working: the A10 entry once stood for both A10 and A10G.
ALIASES = {"a10-a10g": "a10g", "rtx3050": "rtx3050-4gb", "rtx3050-laptop": "rtx3050-4gb", "gtx1050-ti": "gtx1050ti"}
DEFAULT_GPU = "a100-80gb"
DEFAULT_CUDA = "12.4"


@dataclass(frozen=True)
class Context:
    """One row of the context table: what a PyTorch process holds on the GPU outside its allocator, measured."""

    lazy: bool  # CUDA_MODULE_LOADING=LAZY (PyTorch's default from 1.13 with CUDA >= 11.7)
    min_capability: tuple[int, int]
    bytes: int
    training: bool  # measured during training (the step's kernels loaded), or right after the first CUDA op
    source: str


MB = 10**6
# The most specific row applies: the target's module loading, the newest GPU generation at or below the target's.
CONTEXTS = (
    # V100-SXM2 16GB, driver 460.91, CUDA 11.2, eager module loading (every kernel loaded at start):
    # `torch.ones((1, 1)).to("cuda")` -> 1343 MB used (NVML, MiB), of which 2 MiB is that tensor's small-pool segment.
    Context(False, (0, 0), 1341 * MiB, False, "https://huggingface.co/docs/transformers/v4.21.0/perf_train_gpu_one"),
    # transformers' Trainer training roberta-base (torch 2.3.1+cu121, lazy loading) in optimum-benchmark's CUDA
    # results: max_global_vram (NVML) 3379.04 MB, max_reserved 2730.49 MB: 648.5 MB outside the allocator.
    Context(
        True, (0, 0), int(3379.03616 * MB - 2730.491904 * MB), True,
        "https://huggingface.co/datasets/optimum-benchmark/cuda/commit/e76ddfdb46790193e0470aa4f95752c1a217fc25",
    ),
    # RTX 6000 Ada (sm89), torch 2.10 with CUDA 13.0: 426 MiB in nvidia-smi after torch.cuda.mem_get_info, no tensor.
    Context(True, (8, 9), 426 * MiB, False, "https://github.com/unslothai/unsloth-zoo/pull/1053"),
)
# A bare lazily-loaded context (no kernel run yet) grows by the kernels a training step loads: the torch ops it
# runs, cuBLAS/cuBLASLt's GEMM kernels, the attention kernels. Estimated from two measurements: the training
# row above (648.5 MB) less a bare lazy context of the same era, 287,047,680 B used with one 20 MiB segment
# (torch 1.13, CUDA 11.7: https://github.com/pytorch/pytorch/pull/86509).
LAZY_KERNELS = int(3379.03616 * MB - 2730.491904 * MB) - (287_047_680 - 20 * MiB)
# cuBLAS workspaces, allocated through the caching allocator (they count as allocated and reserved): one per
# (handle, stream), i.e. one for the forward thread and one for autograd's backward thread. ":4096:2:16:8" by
# default (8,519,680 B: https://github.com/pytorch/pytorch/issues/95668 measured exactly that), 32 MiB on
# Hopper and newer (https://github.com/pytorch/pytorch/pull/120925).
CUBLAS_WORKSPACE = 8_519_680
CUBLAS_WORKSPACE_HOPPER = 32 * MiB
CUBLAS_THREADS = 2


@dataclass(frozen=True)
class Target:
    """The device a prediction is for. ``cpu`` has no context, allocator or workspaces."""

    type: str = "cuda"  # "cuda" or "cpu"
    gpu: Gpu = GPUS[DEFAULT_GPU]
    cuda: str = DEFAULT_CUDA  # the CUDA version PyTorch was built with
    lazy_loading: Optional[bool] = None  # None: PyTorch's default for that CUDA version
    context: Optional[int] = None  # bytes; None: from `CONTEXTS`
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    # by the caller or the environment: a recipe's ``memory.allocator`` does not replace it
    allocator_given: bool = False
    nccl: NcclSettings = field(default_factory=NcclSettings)  # a distributed run's NCCL settings (the environment's)
    torch: str = field(default_factory=lambda: _installed_torch())  # the PyTorch version the run uses
    devices: Optional[int] = None  # the GPUs this machine has, for a run's own target; None: `auto` counts one

    @property
    def cuda_device(self) -> bool:
        return self.type == "cuda"

    @property
    def lazy(self) -> bool:
        if self.lazy_loading is not None:
            return self.lazy_loading
        return cuda_tuple(self.cuda) >= (11, 7)  # torch >= 1.13 sets CUDA_MODULE_LOADING=LAZY when unset

    @property
    def context_row(self) -> Context:
        rows = [c for c in CONTEXTS if c.lazy == self.lazy and c.min_capability <= self.gpu.capability]
        return max(rows, key=lambda c: c.min_capability)

    @property
    def context_bytes(self) -> int:
        """CUDA context and loaded kernels: what nvidia-smi shows beyond the allocator's segments."""
        if not self.cuda_device:
            return 0
        if self.context is not None:
            return self.context
        row = self.context_row
        return row.bytes + (LAZY_KERNELS if self.lazy and not row.training else 0)

    @property
    def cublas_workspace(self) -> int:
        """Per thread, through the caching allocator (torch 2.0 on: https://github.com/pytorch/pytorch/issues/95668;
        torch 1.13 left it to cuBLAS, inside the context)."""
        if cuda_tuple(self.torch) < (2, 0):
            return 0
        return CUBLAS_WORKSPACE_HOPPER if self.gpu.capability >= (9, 0) else CUBLAS_WORKSPACE

    @property
    def softmax_keeps_input(self) -> bool:
        """torch before 1.11 kept softmax's input for backward (https://github.com/pytorch/pytorch/issues/64000)."""
        return cuda_tuple(self.torch) < (1, 11)

    def describe(self) -> str:
        if not self.cuda_device:
            return "cpu"
        if self.context is not None:
            context = f"context {self.context / MiB:.0f} MiB (given)"
        else:
            loading = "lazy module loading" if self.lazy else "eager module loading"
            row = self.context_row
            measured = "measured in training" if row.training else "measured"
            extra = f" + {LAZY_KERNELS / MiB:.0f} MiB for the step's kernels" if self.lazy and not row.training else ""
            context = (
                f"context {self.context_bytes / MiB:.0f} MiB ({loading}: {row.bytes / MiB:.0f} MiB {measured}{extra})"
            )
        card = (
            f"{self.gpu.name} (sm{self.gpu.capability[0]}{self.gpu.capability[1]}, {self.gpu.memory / 2**30:.2f} GiB)"
        )
        return f"{card}, CUDA {self.cuda}, {context}, {self.allocator.describe()}"


def add_levels(
    footprint: Any, reserved: int, phase: str, target: Target, communicators: int = 0, room: int = 0
) -> None:
    """A CUDA step's ``footprint`` (`lit_memory.memory.measure.footprint.Footprint`) given its reserved and device
    levels:
    ``reserved``, what the allocator holds at its peak as the prediction replayed it (at ``phase``), plus the cuBLAS
    workspaces (through the allocator), in whole MiB; the device adds the CUDA context and ``communicators``, NCCL's
    memory (`lit_memory.memory.hardware.nccl`). The allocator caches what it reserves: in the steady state every phase
    holds that peak. ``room``: what a cap must allow beyond that reserve for the allocator never to release its cache
    and retry (`lit_memory.memory.hardware.allocator.Replay.room`), in whole MiB. The one place both predictions add
    the levels."""
    workspaces = CUBLAS_THREADS * target.cublas_workspace
    footprint.reserved = -(-(reserved + workspaces) // MiB) * MiB
    footprint.reserved_phase = phase if phase in footprint.phases else footprint.peak_phase
    footprint.context = target.context_bytes
    footprint.communicators = communicators
    footprint.workspaces = workspaces  # allocated too: max_memory_allocated counts them (`Footprint.allocated`)
    footprint.room = -(-room // MiB) * MiB


def cuda_tuple(version: str) -> tuple[int, int]:
    """``"12.4"`` (or ``"2.13.0+cpu"``) -> (12, 4)."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if not match:
        raise UserError(f"cannot read version {version!r}: use e.g. 12.4")
    return int(match[1]), int(match[2])


def _installed_torch() -> str:
    import torch  # deferred: the catalogue and a run's memory settings are read without torch

    return ".".join(torch.__version__.split(".")[:2])


def gpu_key(name: str) -> str:
    """A catalogue key as typed (``RTX3050-4GB``, ``a100_40gb-1g.5gb``, an alias) -> its key in `GPUS`."""
    key = name.lower().replace(" ", "").replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise UserError(f"unknown GPU {name!r}; choose one of: {', '.join(GPUS)}")
    return key


def gpu(name: str) -> Gpu:
    return GPUS[gpu_key(name)]


def is_gpu_name(value: object) -> bool:
    """Whether ``value`` names a catalogue card (rather than a size such as ``4GiB``)."""
    if not isinstance(value, str):
        return False
    key = value.lower().replace(" ", "").replace("_", "-")
    return ALIASES.get(key, key) in GPUS


def capacity(value: object) -> int:
    """A memory size or a card: ``4GiB``, ``3.5GB``, a byte count, or a catalogue key (``rtx3050-4gb``: what
    torch reports as that card's total memory). What ``memory.tier``, ``memory.budget`` and ``plan --budget``
    read."""
    if is_gpu_name(value):
        return gpu(str(value)).memory
    try:
        return parse_bytes(value)  # type: ignore[arg-type]
    except UserError:
        raise UserError(
            f"cannot read {value!r} as a memory size or a GPU: use e.g. 4GiB, 3.5GB, 512MiB, or a GPU such as "
            "rtx3050-4gb or t4 (python -m lit_memory estimate --help lists them)"
        ) from None


def match(name: str, capability: tuple[int, int], total: int) -> Gpu:
    """A real card, as torch reports it, against the catalogue: the entry whose name pattern matches (MIG
    slices first), with torch's own name, capability and total memory, and the catalogue's peak and host link.
    A card the catalogue does not know keeps what torch reports, with default speeds."""
    entries = sorted(GPUS.values(), key=lambda g: " MIG " not in g.name)  # a slice's name contains its GPU's
    for entry in entries:
        if entry.pattern and re.search(entry.pattern, name, re.IGNORECASE):
            return replace(entry, name=name, capability=capability, memory=total)
    return Gpu(name, capability, total)


def target(
    device: str = "cuda",
    gpu_name: Optional[str] = None,
    cuda: Optional[str] = None,
    context: Optional[int] = None,
    allocator: Optional[AllocatorConfig] = None,
) -> Target:
    """The target a prediction is for: the GPU this process sees when it sees one (its real capability,
    memory and CUDA version), else the documented default; the allocator settings of this environment."""
    if device == "cpu":
        return Target(type="cpu")
    given = allocator is not None or environment_conf() is not None
    found = Target(allocator=allocator if allocator is not None else AllocatorConfig.from_env(), allocator_given=given,
                   nccl=NcclSettings.from_env())
    if gpu_name is None:
        found = _this_gpu(found)
    else:
        found = replace(found, gpu=gpu(gpu_name))
    if cuda is not None:
        cuda_tuple(cuda)
        found = replace(found, cuda=cuda)
    loading = os.environ.get("CUDA_MODULE_LOADING", "").upper()
    if loading in ("LAZY", "EAGER"):
        found = replace(found, lazy_loading=loading == "LAZY")
    return replace(found, context=context)


def _this_gpu(found: Target) -> Target:
    """This machine's GPU, matched to its catalogue entry by name (`match`): its real memory and capability,
    the catalogue's speeds (which `offload_activations: auto` weighs)."""
    import torch  # deferred, as in `_installed_torch`

    if not torch.cuda.is_available():
        return found
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    here = match(props.name, (props.major, props.minor), props.total_memory)
    return replace(found, gpu=here, cuda=torch.version.cuda or found.cuda, devices=torch.cuda.device_count())


# -- the run's own card at start -------------------------------------------------------------------


@dataclass(frozen=True)
class CardReading:
    """What the card a run trains on reports at its start: the seam the CUDA-only decisions read (`read_card`
    on a GPU; a test's fake anywhere).

    ``free`` is cudaMemGetInfo's free memory once this process's CUDA context exists; ``context`` is that
    context as measured then (this process's memory on the device less what its allocator reserved; None
    where it cannot be measured)."""

    name: str
    total: int
    free: int
    context: Optional[int] = None
    source: str = "cudaMemGetInfo"
    capability: tuple[int, int] = (0, 0)

    @property
    def available(self) -> int:
        """What this process may hold on the card in all (its context included): the free memory plus what
        its own context already takes (not measured: `BARE_CONTEXT`, the smallest published, so that the
        estimate errs low)."""
        return self.free + (self.context if self.context is not None else BARE_CONTEXT)

    @property
    def gpu(self) -> Gpu:
        """The card as a prediction's target: matched to the catalogue by name (`match`)."""
        return match(self.name, self.capability, self.total)


# A bare lazily-loaded context, before any kernel runs (torch 1.13, CUDA 11.7: 287,047,680 B used with one
# 20 MiB segment, https://github.com/pytorch/pytorch/pull/86509): what a reading without NVML assumes its own
# context holds at start.
BARE_CONTEXT = 287_047_680 - 20 * MiB


def planning_limit(limit: Optional[Limit], card: Optional[CardReading], margin: float) -> tuple[Optional[Limit], str]:
    """What ``auto`` plans for on the run's card: the smaller of ``limit`` (``memory.budget`` or the recipe's
    ``memory.tier``; None: neither) and what the card has free at start for this process (`CardReading.available`),
    with ``margin`` kept; and one line saying which applied. Without a card (a CPU run) the limit stands as it is."""
    if card is None:
        return limit, ""
    context = (
        f"this process's context {format_bytes(card.context)} ({card.source})" if card.context is not None
        else f"this process's context not measured (no nvidia-ml-py): {format_bytes(BARE_CONTEXT)} assumed"
    )
    free = (
        f"{card.name} has {format_bytes(card.available)} for this run at start ({format_bytes(card.free)} free "
        f"+ {context})"
    )
    if limit is not None and limit.bytes <= card.available:
        return limit, f"memory: auto plans for {limit}: {free}"
    below = f", less than {limit}" if limit is not None else ""
    available = Limit(card.available, f"{card.name}'s free memory at start ({format_bytes(card.available)})", margin)
    return available, f"memory: auto plans for what the card has free{below}: {free}"


def allocator_limit(budget: int, card: CardReading) -> tuple[int, str]:
    """``memory.budget`` as a cap on the device total: the caching allocator may reserve the budget less this
    process's CUDA context measured at start (`set_per_process_memory_fraction` limits the allocator only,
    pytorch#58466). A context not measured is taken as everything the card holds outside the allocator at
    start (other processes' memory too), so that the cap errs low. Kernels loaded later in the run (lazy
    loading) come on top; the margin of the plan (`lit_memory.memory.margin`) is what leaves room for them.
    Returns (bytes, one line)."""
    context = card.context if card.context is not None else max(card.total - card.free, 0)
    how = card.source if card.context is not None else "not measured: all the card holds at start"
    limit = max(min(budget - context, card.total), 0)
    return limit, (
        f"memory.budget {format_bytes(budget)}: the caching allocator is capped at {format_bytes(limit)} on "
        f"{card.name} "
        f"(the budget less this process's CUDA context at start, {format_bytes(context)}, {how})"
    )


def read_card(index: Optional[int] = None) -> CardReading:
    """The run's card now (CUDA only): total and free (cudaMemGetInfo, which creates this process's context
    if it does not exist yet), and this process's context: NVML's per-process figure (nvidia-ml-py) less
    the allocator's reserve, else nothing measured."""
    import torch  # deferred, as in `_installed_torch`

    device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    free, total = torch.cuda.mem_get_info(device)
    used, source = process_memory_used(device)
    context = max(used - torch.cuda.memory_reserved(device), 0) if used is not None else None
    props = torch.cuda.get_device_properties(device)
    return CardReading(
        props.name, int(total), int(free), context, source or "cudaMemGetInfo", (props.major, props.minor)
    )


def process_memory_used(device) -> tuple[Optional[int], Optional[str]]:
    """This process's memory on ``device`` as NVML counts it (what nvidia-smi's process list shows), or
    (None, None) without nvidia-ml-py, an NVML driver library or permission, or where NVML cannot tell which
    process is this one (`lit_memory.memory.measure.nvml.Nvml`: initialised once, matched inside containers)."""
    from lit_memory.memory.measure.nvml import nvml  # deferred: it imports torch (see `_installed_torch`)

    reader = nvml()
    if reader is None:
        return None, None
    try:
        found = reader.process_memory(device)
    except Exception:  # noqa: BLE001  a driver that stopped answering
        found = None
    return found if found is not None else (None, None)
