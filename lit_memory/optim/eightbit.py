"""bitsandbytes 8-bit optimizers and what the model needs around them.

An 8-bit optimizer (`bitsandbytes.optim.AdamW8bit`, `PagedAdamW8bit`, ...) keeps 2 B of state per
parameter instead of AdamW's 8, quantised block by block. For NLP models bitsandbytes advises
keeping the embedding matrices on 32-bit state (rare tokens get rare, small updates that 8-bit
quantisation hurts most): by its per-parameter override, or by swapping in its `StableEmbedding`.
"""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Literal, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lit_memory.errors import UserError

# How an 8-bit optimizer treats the embedding matrices (the model's `embedding_optimizer_state`).
# How a low-bit optimizer (bitsandbytes', torchao's) treats the embedding matrices (the model's
# `embedding_optimizer_state`, parsed once by the CLI into one of these; `unquantised` says what each value does):
# ``32bit``: every embedding matrix's state unquantised in fp32; ``unquantized``: in the parameters' own dtype
# (torchao: bf16 state for bf16 weights; bitsandbytes keeps unquantised state in fp32: as ``32bit``); ``auto``:
# as ``32bit`` for matrices up to `AUTO_32BIT_VALUES` values, larger ones quantised like the rest; ``8bit``:
# all quantised like the rest (torchao: at its own bits); ``stable_embedding``: bitsandbytes' StableEmbedding.
EmbeddingState = Literal["auto", "32bit", "unquantized", "8bit", "stable_embedding"]
# ``auto``: matrices up to this many values keep 32-bit state (BERT's 31 M-value word embeddings, ModernBERT's
# 52 M), larger ones are quantised like the rest: 32-bit state costs 6 B per value more than 8-bit, 0.7 GiB
# for DeBERTa-v3's 128k x 1024 and 1.4 GiB for XLM-R's 250k x 1024, more than such a model's 4 GiB tier can spare.
AUTO_32BIT_VALUES = 64 * 2**20


def unquantised(state: EmbeddingState, embeddings: Sequence[nn.Embedding]) -> list[nn.Embedding]:
    """The embedding matrices whose optimizer state ``state`` keeps unquantised: all of them for ``32bit`` and
    ``unquantized``, those up to `AUTO_32BIT_VALUES` values for ``auto``, none for ``8bit`` (and for
    ``stable_embedding``, whose StableEmbedding asks bitsandbytes for 32-bit state itself)."""
    if state in ("32bit", "unquantized"):
        return list(embeddings)
    if state == "auto":
        return [e for e in embeddings if e.weight.numel() <= AUTO_32BIT_VALUES]
    return []


def unquantised_dtype(state: EmbeddingState) -> Optional[torch.dtype]:
    """The dtype of the unquantised state: the parameters' own (None) for ``unquantized``, else fp32."""
    return None if state == "unquantized" else torch.float32


def keep_32bit(optimizer: Optimizer, params: Sequence[torch.Tensor]) -> None:
    """bitsandbytes' per-parameter override: these parameters keep 32-bit optimizer state.

    bitsandbytes keeps overrides in a process-wide manager keyed by ``id(parameter)``; they are given
    to this optimizer alone (its own copy of the manager), so they cannot leak to a later model whose
    parameters reuse a freed id. Keyed by parameter, they also reach the fused step's copies.
    """
    manager = copy.copy(optimizer.mng)
    manager.pid2config = dict(manager.pid2config)
    for param in params:
        manager.pid2config[id(param)] = {**manager.pid2config.get(id(param), {}), "optim_bits": 32}
    optimizer.mng = manager


def config_of(optimizer: Optimizer, group: int, index: int) -> dict[str, Any]:
    """The settings bitsandbytes steps the ``index``-th parameter of group ``group`` with: the group's and the
    optimizer's, and its manager's overrides for it (by position, by id, or by module: `StableEmbedding` registers
    its weight), read without ``check_overrides``, which would record them in the process-wide manager."""
    manager = optimizer.mng
    param = optimizer.param_groups[group]["params"][index]
    config = optimizer.get_config(group, index, optimizer.param_groups[group])
    for module, name, module_config in manager.module_weight_config_triple:
        if getattr(module, name) is param:
            config.update(module_config)
    return config


def overrides_for_copy(
    manager: Any, positions: list[list[tuple[int, int]]], params: list[list[torch.Tensor]], min_8bit_size: int
) -> Any:
    """bitsandbytes' per-parameter overrides (e.g. 32-bit state for embeddings) for a copy of an optimizer
    (`lit_memory.optim.optimizers.copy_for`: the fused step's buckets, the memory model's probes).

    The process-wide `GlobalOptimManager` finds overrides by the parameter's (group, index) in the
    optimizer, by parameter id, or by module (`StableEmbedding` registers its weight). In the copy a
    parameter has another (group, index), and may be stepped as a local shard, or a probe's stand-in, with another
    id, so the copy gets a manager of its own whose (group, index) entries are everything its parameters were given
    (and nothing by id or module: its first step then records nothing in the process-wide manager).

    A shard's state is 8-bit or 32-bit as the whole parameter's would be (bitsandbytes compares the tensor it
    steps with ``min_8bit_size``): the same on every number of ranks, so a checkpoint reshards without changing
    its kind (`lit_memory.optim.eightbit_shards`), and as the memory model counts it.
    """
    from torch.distributed.tensor import DTensor  # deferred: ~1 s to import; the optimizers import this module

    view = copy.copy(manager)
    view.index2config, view.pid2config, view.module_weight_config_triple = {}, {}, []
    for g, (group_positions, group_params) in enumerate(zip(positions, params)):
        for i, (position, param) in enumerate(zip(group_positions, group_params)):
            config = dict(manager.index2config.get(position, {}))
            for module, name, module_config in manager.module_weight_config_triple:
                if getattr(module, name) is param:
                    config.update(module_config)
            config.update(manager.pid2config.get(id(param), {}))
            if isinstance(param, DTensor):
                quantised = param.numel() >= config.get("min_8bit_size", min_8bit_size)
                config["min_8bit_size"] = 0 if quantised else sys.maxsize
            if config:
                view.index2config[(g, i)] = config
    return view


@contextmanager
def one_sync_per_step(optimizer: Optimizer, params: list[torch.Tensor]) -> Iterator[None]:
    """bitsandbytes' ``Optimizer8bit.step`` synchronises the whole device after every parameter
    (``bitsandbytes.utils.sync_gpu``, a global of its optimizer module, ``torch.cuda.synchronize()``): inside
    backward that stops the host ~390 times per BERT-large step, and under FSDP2 inside the reduce-scatter hook,
    so communication and the host's launches stop overlapping compute. Its non-paged kernels need none (the stream
    orders them: `lit_memory.fused.DeviceStreams`; bitsandbytes PR #2050 drops them too), so none is made. A paged
    optimizer prefetches and updates its unified-memory state asynchronously and keeps bitsandbytes' own sync at the
    end of the step: one per fused bucket (~25 per BERT-large step with ``layer`` buckets), each draining the
    device's queue."""
    module = sys.modules["bitsandbytes.optim.optimizer"]
    own = _DEPTH[0] if _DEPTH else module.sync_gpu  # bitsandbytes' own sync, however deep the steps are nested
    if not _DEPTH:  # the outermost step (an unfused step runs fused buckets' inside it): patched once
        _DEPTH.append(own)
        module.sync_gpu = _no_sync
    else:
        _DEPTH.append(None)
    try:
        yield
    finally:
        if _DEPTH.pop() is not None:  # the outermost step ends: bitsandbytes' own function back
            module.sync_gpu = own
    if optimizer.is_paged and params:
        param = params[0]
        own(param.to_local() if hasattr(param, "to_local") else param)


_DEPTH: list = []  # the steps inside `one_sync_per_step` now; the first entry is bitsandbytes' own sync_gpu


def _no_sync(tensor: torch.Tensor) -> None:
    """bitsandbytes' per-parameter device sync, left out (`one_sync_per_step`)."""


def check_stable_embedding(embedding: nn.Module) -> None:
    """One line if swapping ``embedding`` for StableEmbedding would change what the model computes: a family's
    own embedding class (Gemma3's scales its output by sqrt(hidden)) would lose its forward."""
    if type(embedding) is not nn.Embedding:
        raise UserError(
            f"embedding_optimizer_state stable_embedding would replace {type(embedding).__name__} with bitsandbytes' "
            "StableEmbedding, losing what that class adds to a lookup (e.g. Gemma3's embed_scale): use 32bit or auto "
            "(32-bit state for the embeddings, the model unchanged)"
        )


def swap_stable_embedding(model: nn.Module) -> None:
    """Replace the input (token) embeddings with `bitsandbytes.nn.StableEmbedding`, keeping the
    pretrained vectors. StableEmbedding adds a LayerNorm after the lookup (initialised to identity
    scale, but it does renormalise the vectors) and registers its weight for 32-bit state."""
    from bitsandbytes.nn import StableEmbedding  # deferred: bitsandbytes is heavy; only this option uses it here

    old = model.get_input_embeddings()
    check_stable_embedding(old)
    # `_weight` hands over the pretrained matrix; it also avoids StableEmbedding's device/dtype,
    # which it passes positionally to nn.Embedding (misplaced on torch versions with `_freeze`).
    new = StableEmbedding(old.num_embeddings, old.embedding_dim, old.padding_idx, _weight=old.weight.detach().clone())
    new.weight.requires_grad_(old.weight.requires_grad)
    model.set_input_embeddings(new)


def quantised_embeddings(embeddings: Sequence[nn.Embedding]) -> list[nn.Embedding]:
    """The matrices ``auto`` leaves on quantised state (larger than `AUTO_32BIT_VALUES`)."""
    return [e for e in embeddings if e.weight.numel() > AUTO_32BIT_VALUES]

