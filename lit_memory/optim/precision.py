"""bf16 where the device has none: the precision a recipe's bf16 becomes, and one line that says so.

Recipes ask for bf16 because GPUs from compute capability 8.0 (Ampere) and recent CPUs run it natively.

- **A CPU** without AVX512-BF16 or AMX emulates bf16 arithmetic: autocast measured about 18x slower than
  fp32 on such a machine (AVX2) for MiniLM, so the CLI switches those runs to fp32 with one warning line
  (`cpu_fallback`: said by the process that trains, once, though a confined run is parsed twice);
  ``--cpu_bf16_fallback false`` keeps bf16 anyway.
- **A GPU below compute capability 8.0** (Pascal, Volta, Turing: P100, V100, T4, GTX 10xx/16xx, RTX 20xx) has
  no bf16 tensor cores; ``torch.cuda.is_bf16_supported()`` still answers True (emulation), so nothing would
  stop a bf16 run there, without tensor cores, and SDPA's fused attention kernels refuse bf16 below sm80, so
  attention falls back to the math kernel (`lit_memory.memory.hardware.kernels`). `on_gpu`: bf16 autocast becomes
  fp16 autocast with dynamic loss scaling (``16-mixed``: torch's GradScaler, exact under the fused step,
  `lit_memory.fused.LossScaling`), with one warning line; bf16 weights without a master copy (``bf16-true``,
  the 2gb tier) have no fp16 counterpart that keeps quality, so they stop with one error line naming the tier
  that trains there (`NO_BF16_WEIGHTS`; docs/fused.md says why). A ``--trainer.precision`` the user typed is
  kept (the CLI asks `lit_memory.config.trust.typed_values`). The GPU is `training_gpu`'s (this machine's) for a run,
  the ``--gpu`` target's for ``estimate``/``plan``: a `lit_memory.memory.hardware.gpus.Gpu`, so tests drive it with the
  catalogue's cards.

Each function takes ``trainer.precision`` as configured (Lightning's aliases included: ``bf16`` is ``bf16-mixed``),
reads it as a `lit_memory.settings.Precision`, and returns it unchanged, as written, where it changes nothing.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_only

from lit_memory.errors import UserError
from lit_memory.memory.hardware.gpus import Gpu, target
from lit_memory.settings import Precision

FP16_MIXED = "16-mixed"
NO_BF16_WEIGHTS = (
    "trainer.precision {precision} keeps the weights in bf16 without an fp32 master copy (the 2gb tier), which needs "
    "bf16 arithmetic: {gpu} has none (compute capability 8.0+; torch would emulate it, slowly), and fp16 weights lose "
    "updates bf16's stochastic rounding keeps: train the 4gb tier instead (--recipe 4gb: fp16 with dynamic loss "
    "scaling and fp32 master weights, for 4 GiB), or type --trainer.precision {precision} to run it emulated"
)


def native_cpu_bf16() -> bool:
    # torch's own CPU feature probes (private: torch.cpu has no public one) for AVX512-BF16 and AMX.
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def runs_on_cpu(accelerator: Any) -> bool:
    name = accelerator if isinstance(accelerator, str) or accelerator is None else type(accelerator).__name__.lower()
    if name in (None, "auto"):
        return not (torch.cuda.is_available() or torch.backends.mps.is_available())
    return "cpu" in name


def trains_with(precision: Any, accelerator: Any, fallback: bool = True) -> Any:
    """The precision a run configured with ``precision`` trains with: ``32-true`` for bf16 on a CPU that lacks
    it (with ``fallback``, the CLI's ``--cpu_bf16_fallback``), else unchanged."""
    if not fallback or not _bf16(precision) or not runs_on_cpu(accelerator) or native_cpu_bf16():
        return precision
    return "32-true"


def cpu_fallback(precision: Any, accelerator: Any) -> tuple[Any, Optional[str]]:
    """`trains_with`, and the warning line to say where it changes the precision (else None): the caller says it
    when the run is built, so that a run parsed twice (judged, then run in its confined child) says it once."""
    if trains_with(precision, accelerator) == precision:
        return precision, None
    return "32-true", (
        f"warning: this CPU has no native bf16 (AVX512-BF16 or AMX), where bf16 runs about 18x slower than "
        f"fp32: training with trainer.precision=32-true instead of {precision} (memory numbers are fp32's; "
        f"--cpu_bf16_fallback false keeps {precision})"
    )


@rank_zero_only
def _warn(message: str) -> None:
    print(message, file=sys.stderr)


def _bf16(precision: Any) -> bool:
    """Computes in bf16 (autocast or bf16 weights); a precision lit_memory does not model is left alone."""
    found = Precision.known(precision)
    return found is not None and found.bf16


def gpu_words(gpu: Gpu) -> str:
    return f"{gpu.name} (sm{gpu.capability[0]}{gpu.capability[1]})"


def changes_on(precision: Any, gpu: Optional[Gpu]) -> bool:
    """Whether `on_gpu` changes ``precision`` on ``gpu`` (None: no CUDA GPU)."""
    return gpu is not None and not gpu.bf16 and _bf16(precision)


def trains_on(precision: Any, gpu: Optional[Gpu]) -> Any:
    """The precision a run configured with ``precision`` trains with on ``gpu`` (None: not a CUDA GPU): bf16
    autocast becomes ``16-mixed`` on a GPU without bf16; bf16 weights (``bf16-true``) are one error line there
    (`NO_BF16_WEIGHTS`); anything else is unchanged."""
    if not changes_on(precision, gpu):
        return precision
    if Precision.of(precision).half_weights:  # bf16 weights
        raise UserError(NO_BF16_WEIGHTS.format(precision=precision, gpu=gpu_words(gpu)))
    return FP16_MIXED


def on_gpu(precision: Any, gpu: Optional[Gpu]) -> Any:
    """`trains_on`, with one warning line where it changes the precision."""
    if trains_on(precision, gpu) == precision:
        return precision
    _warn(
        f"warning: {gpu_words(gpu)} has no bf16 (compute capability 8.0+; torch would emulate it without tensor cores, "
        f"and attention would fall back to its math kernel): training with trainer.precision={FP16_MIXED} (fp16 "
        f"autocast, dynamic loss scaling) instead of {precision} (--trainer.precision {precision} keeps it)"
    )
    return FP16_MIXED


def training_gpu(accelerator: Any) -> Optional[Gpu]:
    """The CUDA GPU a run configured with ``accelerator`` trains on (this machine's current one), None where it
    trains on no CUDA GPU."""
    if runs_on_cpu(accelerator) or not torch.cuda.is_available():
        return None
    return target("cuda").gpu


def follow_device(trainer: Any, gpu: Optional[Gpu], typed: Any) -> None:
    """A run's trainer settings (changed in place) follow the GPU it trains on: a recipe's bf16 becomes `on_gpu`'s on
    a GPU without bf16, unless the user typed it (``typed(key, value)``: whether they did)."""
    if changes_on(trainer.precision, gpu) and not typed("trainer.precision", trainer.precision):
        trainer.precision = on_gpu(trainer.precision, gpu)


def fp16_under_fsdp2(trainer: dict[str, Any]) -> dict[str, Any]:
    """Trainer arguments that run ``16-mixed`` under FSDP2 on CUDA (a GPU without bf16, above). Lightning refuses the
    precision flag with ModelParallelStrategy (`lit_memory.FSDP2Strategy` is one), yet GradScaler works there: its
    unscale of the sharded gradients reduces the overflow flag over the ranks (torch's DTensor), and the fused step
    reduces its own. So the same precision comes as a plugin."""
    precision = Precision.known(trainer.get("precision"))  # Lightning's aliases too (16, "16")
    if precision is None or not precision.scaled or not isinstance(trainer.get("strategy"), ModelParallelStrategy):
        return {}
    if runs_on_cpu(trainer.get("accelerator")):
        return {}  # Lightning's own answer on a CPU (it runs 16-mixed as bf16)
    plugins = trainer.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    return {"precision": None, "plugins": [*plugins, MixedPrecision(precision.name, "cuda")]}
