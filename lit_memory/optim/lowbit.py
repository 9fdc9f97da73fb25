"""torchao's low-bit optimizers and bf16 stochastic rounding: what lit_memory checks around them.

`torchao.optim` keeps Adam's two moments quantised block by block: ``AdamW8bit`` (1 byte per value and a
fp32 scale per 256), ``AdamW4bit`` (half a byte and a scale per 128), ``AdamWFp8`` (an FP8 value and a
scale per 256); tensors under 4096 values, or not a whole number of blocks, keep plain state in the
parameter's dtype. With ``bf16_stochastic_round=True`` the update is computed in fp32 and rounded to
the bf16 weight stochastically, so a ``bf16-true`` run (2 B weights, no fp32 master copy) keeps, on
average, updates smaller than half a bf16 unit in the last place, which rounding to nearest loses.

Its state is DTensor-aware: under FSDP2 it steps the sharded parameters and its state is saved and
resharded like torch's own (bitsandbytes' by `lit_memory.optim.eightbit_shards`). Each step
runs one ``torch.compile``'d kernel per parameter, compiled once per parameter shape and setting.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch._functorch.config

from lit_memory.errors import UserError
from lit_memory.settings import Precision

PACKAGE = "torchao.optim"
# torchao's FP8 state needs FP8 casts in the GPU's kernels: compute capability 8.9 (Ada, Hopper) or newer.
FP8_CAPABILITY = (8, 9)


def keep_plain_state(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], dtype: Optional[torch.dtype] = torch.float32
) -> None:
    """Keep these parameters' state unquantised, in ``dtype`` (None: the parameter's): torchao quantises every state
    tensor of 4096 values or more, with no per-parameter override of its own. This is bitsandbytes' advice for NLP
    models (32-bit state for the embedding matrices: rare tokens get rare, small updates) made for torchao,
    and it keeps the compiled step's buffers off the largest tensor
    (`lit_memory.optim.optimizers.torchao_kernel_bytes`).

    It replaces the instance's ``_new_buffer`` (private torchao API: checked by tests/optim/test_lowbit.py), where
    torchao creates each state tensor; fused-step bucket copies share the instance's attributes, so theirs too.
    The ids and the dtype (None: the parameter's) are kept on the optimizer (``plain_state``): copies that step
    other tensors in their place (the memory model's probes) carry them over (`lit_memory.optim.optimizers.TorchAO`)."""
    from torch.distributed.tensor import DTensor  # deferred: ~1 s to import; the optimizers import this module

    plain = {id(p): dtype for p in params}
    quantised = optimizer._new_buffer

    def _new_buffer(p: torch.Tensor, signed: bool) -> torch.Tensor:
        if id(p) not in plain:
            return quantised(p, signed)
        if isinstance(p, DTensor):
            local = torch.zeros_like(p.to_local(), dtype=dtype or p.dtype)
            out = DTensor.from_local(
                local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            return out.cpu() if p.device.type == "cpu" else out
        return torch.zeros_like(p, dtype=dtype or p.dtype)

    optimizer._new_buffer = _new_buffer
    optimizer.plain_state = {**getattr(optimizer, "plain_state", {}), **plain}


def compile_steps_without_the_dtensor_cache_collision(optimizer: torch.optim.Optimizer) -> None:
    """torchao's compiled step over FSDP2's sharded (DTensor) parameters: AOTAutograd's on-disk cache off.

    torch 2.13 keys a DTensor input of that cache by its spec alone (``DTensor._stable_hash_for_caching``:
    mesh, placements, shape, stride, dtype), not by the type of its local tensor. torchao's step over a
    parameter whose state is quantised (a DTensor of ``OptimState8bit``) and over one of the same shape whose
    state is plain (a DTensor of a Tensor: `keep_plain_state`'s embeddings, torchao's own small shards) or of
    another subclass (``OptimState4bit``) is one dynamo graph, so a later process finds the other's compiled
    code in the cache (``$TMPDIR/torchinductor_$USER``, shared by every run of the user) and fails inside it:
    "'Tensor' object has no attribute 'codes'". Turned off by torch's own switch (process-wide; inductor's
    graph cache, keyed by the flattened tensors, still serves); unsharded state hashes its inner tensors."""
    from torch.distributed.tensor import DTensor  # deferred: ~1 s to import; the optimizers import this module

    if any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        torch._functorch.config.enable_autograd_cache = False


def check_settings(optimizer: Any, precision: Any, on_gpu: bool) -> None:
    """One `UserError` line for a torchao optimizer setting that cannot do what it says, before anything
    is built. ``optimizer``: the parsed ``model.optimizer`` of one of torchao's (a class path and its init args;
    `lit_memory.optim.optimizers.check_settings` asks its library)."""
    class_path = str(_get(optimizer, "class_path") or "")
    init_args = _get(optimizer, "init_args") or {}
    weights = getattr(Precision.known(precision), "param", None)
    if _get(init_args, "bf16_stochastic_round") and weights != torch.bfloat16:
        raise UserError(
            f"model.optimizer.init_args.bf16_stochastic_round rounds bf16 weights, and trainer.precision {precision} "
            "trains no bf16 weights (torchao ignores it there): set trainer.precision bf16-true, or drop "
            "bf16_stochastic_round"
        )
    name = class_path.rsplit(".", 1)[-1]
    if name.endswith("Fp8") and on_gpu and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < FP8_CAPABILITY:
            raise UserError(
                f"{class_path} keeps FP8 state, which needs a GPU with compute capability "
                f"{'.'.join(map(str, FP8_CAPABILITY))} or newer; this one has {'.'.join(map(str, capability))}: "
                f"use {PACKAGE}.AdamW8bit instead"
            )


def _get(node: Any, key: str) -> Any:
    return node.get(key) if hasattr(node, "get") else getattr(node, key, None)
