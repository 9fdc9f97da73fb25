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
from typing import Optional

from lit_memory.errors import UserError
from lit_memory.memory.allocator import ENV, AllocatorConfig

MiB = 2**20


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]  # compute capability (major, minor)
    memory: int  # bytes the driver reports as total
    # For choosing between recompute and offloading only (`lit_memory.memory.recompute`): the datasheet's dense
    # 16-bit tensor-core peak, and the host link's bandwidth one way (PCIe 3/4/5 x16 with pinned memory, as
    # measured by bandwidthTest-style copies: about 12, 25, 50 GB/s).
    tflops: float = 100.0
    host_gbps: float = 25.0

    @property
    def bf16(self) -> bool:
        return self.capability >= (8, 0)


# Nominal sizes: what the cards are sold as (the driver reports a little less; nvidia-smi's V100 16GB: 16160 MiB).
GPUS = {
    "v100-16gb": Gpu("Tesla V100 16GB", (7, 0), 16160 * MiB, tflops=125, host_gbps=12),
    "v100-32gb": Gpu("Tesla V100 32GB", (7, 0), 32510 * MiB, tflops=125, host_gbps=12),
    "t4": Gpu("Tesla T4", (7, 5), 15360 * MiB, tflops=65, host_gbps=12),
    "rtx3090": Gpu("GeForce RTX 3090", (8, 6), 24576 * MiB, tflops=71, host_gbps=25),
    "a10": Gpu("A10 / A10G", (8, 6), 23028 * MiB, tflops=125, host_gbps=25),
    "a100-40gb": Gpu("A100 40GB", (8, 0), 40960 * MiB, tflops=312, host_gbps=25),
    "a100-80gb": Gpu("A100 80GB", (8, 0), 81920 * MiB, tflops=312, host_gbps=25),
    "l4": Gpu("L4", (8, 9), 23034 * MiB, tflops=121, host_gbps=25),
    "rtx4090": Gpu("GeForce RTX 4090", (8, 9), 24564 * MiB, tflops=165, host_gbps=25),
    "h100": Gpu("H100 80GB", (9, 0), 81559 * MiB, tflops=989, host_gbps=50),
}
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
    allocator_given: bool = False  # by the caller or the environment: a recipe's ``memory.allocator`` does not replace it
    torch: str = field(default_factory=lambda: _installed_torch())  # the PyTorch version the run uses

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
            context = f"context {self.context_bytes / MiB:.0f} MiB ({loading}: {row.bytes / MiB:.0f} MiB {measured}{extra})"
        return f"{self.gpu.name} (sm{self.gpu.capability[0]}{self.gpu.capability[1]}), CUDA {self.cuda}, {context}, {self.allocator.describe()}"


def cuda_tuple(version: str) -> tuple[int, int]:
    """``"12.4"`` (or ``"2.13.0+cpu"``) -> (12, 4)."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if not match:
        raise UserError(f"cannot read version {version!r}: use e.g. 12.4")
    return int(match[1]), int(match[2])


def _installed_torch() -> str:
    import torch

    return ".".join(torch.__version__.split(".")[:2])


def gpu(name: str) -> Gpu:
    key = name.lower().replace(" ", "").replace("_", "-")
    if key not in GPUS:
        raise UserError(f"unknown GPU {name!r}; choose one of: {', '.join(GPUS)}")
    return GPUS[key]


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
    given = allocator is not None or ENV in os.environ
    found = Target(allocator=allocator if allocator is not None else AllocatorConfig.from_env(), allocator_given=given)
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
    import torch

    if not torch.cuda.is_available():
        return found
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    here = Gpu(props.name, (props.major, props.minor), props.total_memory)
    return replace(found, gpu=here, cuda=torch.version.cuda or found.cuda)
