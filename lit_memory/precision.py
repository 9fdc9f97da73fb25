"""bf16 on a CPU without native bf16: run fp32 instead, and say so.

Without AVX512-BF16 or AMX, a CPU emulates bf16 arithmetic: autocast measured about 18x slower than
fp32 on such a machine (AVX2) for MiniLM. Recipes ask for bf16 because GPUs (and recent CPUs) run
it natively; on other CPUs the CLI switches those runs to fp32 with one warning line. GPU runs and
bf16-capable CPUs are never changed, and ``--cpu_bf16_fallback false`` keeps bf16 anyway.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only

BF16 = ("bf16-mixed", "bf16-true", "bf16")


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
    if not fallback or str(precision) not in BF16 or not runs_on_cpu(accelerator) or native_cpu_bf16():
        return precision
    return "32-true"


def cpu_fallback(precision: Any, accelerator: Any) -> Any:
    """`trains_with`, with one warning line where it changes the precision."""
    if trains_with(precision, accelerator) == precision:
        return precision
    _warn(
        f"warning: this CPU has no native bf16 (AVX512-BF16 or AMX), where bf16 runs about 18x slower than "
        f"fp32: training with trainer.precision=32-true instead of {precision} (memory numbers are fp32's; "
        f"--cpu_bf16_fallback false keeps {precision})"
    )
    return "32-true"


@rank_zero_only
def _warn(message: str) -> None:
    print(message, file=sys.stderr)
