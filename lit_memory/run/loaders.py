"""The data module's batches: a collator that pads, loaders with a generator of their own, training rows sampled
resumably (sharded over the ranks), evaluation windows grouped by text."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding

from lit_memory.hf import windows
from lit_memory.run.resume import ResumableDataLoader, ResumableSampler


def collator(tokenizer: Any, padding: str, max_length: int) -> DataCollatorWithPadding:
    """Pads each batch: to its longest row, or to ``max_length`` (``padding: max_length``)."""
    if padding == "max_length":
        return DataCollatorWithPadding(tokenizer, padding="max_length", max_length=max_length)
    return DataCollatorWithPadding(tokenizer, padding="longest")


def loader(rows: Any, batch_size: int, shuffle: bool, collate: Any, *, num_workers: int, seed: int, pin_memory: bool,
           grouped: bool = False, shards: Optional[dict[str, Any]] = None) -> DataLoader:
    """A split's loader; ``grouped``: whole texts' windows together (at most ``batch_size``) for evaluation;
    ``shards``: Lightning's distributed sampler arguments, where the run has several ranks."""
    # A generator of its own: a DataLoader otherwise draws its workers' seed from the global
    # random state at every epoch, which would shift the dropout masks that follow.
    generator = torch.Generator().manual_seed(seed)
    kwargs = {"collate_fn": collate, "num_workers": num_workers, "generator": generator, "pin_memory": pin_memory}
    # The loaders read rows as Python lists: the collator makes one tensor per column and batch, where rows in the
    # splits' torch format cost a tensor per row and column, turned back into lists to pad (BERT's columns at
    # batch 32 on this project's CPU: 232 dispatcher operators and 2.7 ms a batch against 6 and 1.1 ms).
    rows = rows.with_format(None)
    if not shuffle and grouped:
        kwargs["collate_fn"] = windows.GroupCollate(collate)
        return DataLoader(windows.Groups(rows, batch_size), batch_size=1, shuffle=False, **kwargs)
    if not shuffle:
        return DataLoader(rows, batch_size=batch_size, shuffle=False, **kwargs)
    # Sharded here under DDP/FSDP (as Lightning's DistributedSampler would), by (seed, epoch).
    sampler = ResumableSampler(rows, seed=seed, **(shards or {}))
    return ResumableDataLoader(rows, batch_size=batch_size, sampler=sampler, **kwargs)
