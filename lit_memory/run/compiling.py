"""``model.compile``: each transformer layer compiled on its own (regional compilation), and what keeps it compiled.

torch.compile declines a frame that runs while a Python dispatch mode is active (the memory monitor's tensor tracker,
torch's FLOP counter on fake tensors when ``gradient_checkpointing: auto`` plans), and it declines the frame's *code*
for good: every layer of the model shares that code, so one tracked step, or one plan, left every layer eager for the
rest of the run (torch 2.13: ``ConvertFrameReturn`` skips the code "for all future intercepted frames too"). A layer
compiled here runs its plain forward while such a mode is active, without asking dynamo, and compiled otherwise.
Modes that say they ignore compiled code (`lit_memory.run.step_profile.HostOps`, selective checkpointing's) do not
count.
"""

from __future__ import annotations

from typing import Any, Iterable, Literal, Optional, Union

import torch
from torch import nn

CUDA_GRAPHS = "cudagraphs"
# true: each transformer layer compiled; cudagraphs: and replayed as CUDA graphs (static shapes only)
Compile = Union[bool, Literal["cudagraphs"]]


def mode_of(setting: Compile) -> Optional[str]:
    """torch.compile's ``mode`` for the setting: ``reduce-overhead`` (CUDA graphs) for ``cudagraphs``, else its
    default."""
    return "reduce-overhead" if setting == CUDA_GRAPHS else None


def compile_layers(layers: Iterable[nn.Module], setting: Compile) -> None:
    """Compile each layer (`compile_layer`) as ``setting`` asks; nothing for ``false``."""
    if not setting:
        return
    for layer in layers:
        compile_layer(layer, mode_of(setting))


def compile_layer(layer: nn.Module, mode: Optional[str] = None) -> None:
    """``layer.compile(mode=mode)``, run eagerly while a dispatch mode that would make dynamo decline it is active."""
    eager = layer._call_impl
    compiled = torch.compile(eager, mode=mode)

    def call(*args: Any, **kwargs: Any) -> Any:
        return (eager if declined_by_dynamo() else compiled)(*args, **kwargs)

    layer._compiled_call_impl = call  # what nn.Module.compile sets, and nn.Module.__call__ runs


def declined_by_dynamo() -> bool:
    """Whether a dispatch mode is active that torch.compile would decline a frame under (and its code for good)."""
    from torch.utils import _python_dispatch as dispatch  # private: torch's own test of the same condition

    on_stack = getattr(dispatch, "any_torch_dispatch_mode_on_stack", None)
    if on_stack is not None:
        return on_stack()
    return dispatch.is_in_torch_dispatch_mode(include_infra_modes=False)  # older torch (the GPU image's 2.11 has both)
