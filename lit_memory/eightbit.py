"""bitsandbytes 8-bit optimizers and what the model needs around them.

An 8-bit optimizer (`bitsandbytes.optim.AdamW8bit`, `PagedAdamW8bit`, ...) keeps 2 B of state per
parameter instead of AdamW's 8, quantised block by block. For NLP models bitsandbytes advises
keeping the embedding matrices on 32-bit state (rare tokens get rare, small updates that 8-bit
quantisation hurts most): by its per-parameter override, or by swapping in its `StableEmbedding`.
"""

from __future__ import annotations

import copy
import sys
from typing import Literal, Optional, Sequence

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


def is_bitsandbytes(optimizer: Optimizer) -> bool:
    module = sys.modules.get("bitsandbytes.optim.optimizer")  # loaded if the optimizer is one
    return module is not None and isinstance(optimizer, module.Optimizer8bit)


def keep_embeddings_32bit(embeddings: Sequence[nn.Embedding], optimizer: Optimizer) -> None:
    """bitsandbytes' per-parameter override: these embedding matrices (`lit_memory.anatomy.Anatomy.embeddings`,
    as `unquantised` picks them for the setting) keep 32-bit optimizer state.

    bitsandbytes keeps overrides in a process-wide manager keyed by ``id(parameter)``; they are given
    to this optimizer alone (its own copy of the manager), so they cannot leak to a later model whose
    parameters reuse a freed id. Keyed by parameter, they also reach the fused step's copies.
    """
    manager = copy.copy(optimizer.mng)
    manager.pid2config = dict(manager.pid2config)
    for module in embeddings:
        manager.pid2config[id(module.weight)] = {**manager.pid2config.get(id(module.weight), {}), "optim_bits": 32}
    optimizer.mng = manager


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
    from bitsandbytes.nn import StableEmbedding

    old = model.get_input_embeddings()
    check_stable_embedding(old)
    # `_weight` hands over the pretrained matrix; it also avoids StableEmbedding's device/dtype,
    # which it passes positionally to nn.Embedding (misplaced on torch versions with `_freeze`).
    new = StableEmbedding(old.num_embeddings, old.embedding_dim, old.padding_idx, _weight=old.weight.detach().clone())
    new.weight.requires_grad_(old.weight.requires_grad)
    model.set_input_embeddings(new)


def quantised_embeddings(embeddings: Sequence[nn.Embedding]) -> list[tuple[nn.Embedding, int]]:
    """The matrices ``auto`` leaves on 8-bit state, each with the bytes 32-bit state would add (6 per value:
    two fp32 moments instead of two 8-bit codes)."""
    return [(e, 6 * e.weight.numel()) for e in embeddings if e.weight.numel() > AUTO_32BIT_VALUES]

