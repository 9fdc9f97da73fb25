"""bitsandbytes 8-bit optimizers and what the model needs around them.

An 8-bit optimizer (`bitsandbytes.optim.AdamW8bit`, `PagedAdamW8bit`, ...) keeps 2 B of state per
parameter instead of AdamW's 8, quantised block by block. For NLP models bitsandbytes advises
keeping the embedding matrices on 32-bit state (rare tokens get rare, small updates that 8-bit
quantisation hurts most): by its per-parameter override, or by swapping in its `StableEmbedding`.
"""

from __future__ import annotations

import copy
import sys
from typing import Literal

from torch import nn
from torch.optim import Optimizer

# How an 8-bit optimizer treats the embedding matrices (the model's `embedding_optimizer_state`).
# ``unquantized``: in the parameters' own dtype (torchao's; bitsandbytes keeps unquantised state in fp32: as ``32bit``)
EmbeddingState = Literal["32bit", "unquantized", "8bit", "stable_embedding"]


def is_bitsandbytes(optimizer: Optimizer) -> bool:
    module = sys.modules.get("bitsandbytes.optim.optimizer")  # loaded if the optimizer is one
    return module is not None and isinstance(optimizer, module.Optimizer8bit)


def keep_embeddings_32bit(model: nn.Module, optimizer: Optimizer) -> None:
    """bitsandbytes' per-parameter override: every embedding matrix keeps 32-bit optimizer state.

    bitsandbytes keeps overrides in a process-wide manager keyed by ``id(parameter)``; they are given
    to this optimizer alone (its own copy of the manager), so they cannot leak to a later model whose
    parameters reuse a freed id. Keyed by parameter, they also reach the fused step's copies.
    """
    manager = copy.copy(optimizer.mng)
    manager.pid2config = dict(manager.pid2config)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.pid2config[id(module.weight)] = {**manager.pid2config.get(id(module.weight), {}), "optim_bits": 32}
    optimizer.mng = manager


def swap_stable_embedding(model: nn.Module) -> None:
    """Replace the input (token) embeddings with `bitsandbytes.nn.StableEmbedding`, keeping the
    pretrained vectors. StableEmbedding adds a LayerNorm after the lookup (initialised to identity
    scale, but it does renormalise the vectors) and registers its weight for 32-bit state."""
    from bitsandbytes.nn import StableEmbedding

    old = model.get_input_embeddings()
    # `_weight` hands over the pretrained matrix; it also avoids StableEmbedding's device/dtype,
    # which it passes positionally to nn.Embedding (misplaced on torch versions with `_freeze`).
    new = StableEmbedding(old.num_embeddings, old.embedding_dim, old.padding_idx, _weight=old.weight.detach().clone())
    new.weight.requires_grad_(old.weight.requires_grad)
    model.set_input_embeddings(new)
