"""Cheaper ways to keep activations than re-running every layer's forward: selective activation
checkpointing and activation offloading to host memory.

* **Selective checkpointing** (`selective_policy`): inside each checkpointed transformer layer the
  outputs of the matrix multiplications (the linear layers) and of the fused attention kernels are
  kept, everything cheap (GELU, dropout, LayerNorm, adds, casts, the softmax and batched matmuls of
  the math attention path) is recomputed in backward. It is torch's own machinery
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) handed to transformers' checkpointing
  switch as the non-reentrant checkpoint's ``context_fn``.
* **Offloading** (`OffloadActivations`): tensors that autograd saves during the forward pass go to
  pinned host memory (copied on a side CUDA stream) and come back for backward, as torchtune's
  ``OffloadActivations`` does. torchtune and trl are not dependencies of this project, and
  transformers' own ``offload=`` switch (5.2x only) copies on the compute stream, so this is a
  small copy of the idea. Used with checkpointing (the model refuses it without): what autograd
  saves is then only each layer's input (and the few tensors outside the layers), so little crosses
  the bus, and the copies overlap the forward pass. Tensors already on the host are left as they
  are, which makes it a no-op on a CPU run.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Union

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten

# Ops whose outputs selective checkpointing keeps: the linear layers' matmuls and fused attention.
# The math attention path (CPU with attention dropout, eager attention) runs as batched matmuls
# (aten.bmm) that are recomputed: its scores are heads x length values per token, the largest
# activation of a layer, and cost only O(length) per token to recompute.
SAVED_OPS = frozenset(
    op
    for name in (
        "mm",
        "addmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if (op := getattr(getattr(aten, name, None), "default", None)) is not None
)


def draws_random_numbers(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call consumes the random-number generator (an attention kernel with dropout).

    Selective checkpointing must recompute such an op: a cached op is skipped in the recomputation,
    so the generator would not advance past it and every later dropout in the layer would draw a
    different mask in backward than it did in forward (wrong gradients; on CUDA the fused attention
    kernels draw their dropout from the generator's offset).
    """
    if torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return True
    index = names.index("dropout_p")
    p = kwargs.get("dropout_p", args[index] if index < len(args) else 0.0)
    return p != 0.0


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul and fused-attention outputs, recompute the rest (see the module docstring)."""
    if op in SAVED_OPS and not draws_random_numbers(op, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(policy: str) -> dict[str, Any]:
    """Keyword arguments for ``torch.utils.checkpoint.checkpoint``: ``full`` or ``selective``.

    Non-reentrant in both cases (the only kind that takes a ``context_fn``); it keeps the
    random-number state, so recomputed dropout draws the same masks as the forward pass did.
    """
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, selective_policy)
    return kwargs


class OffloadActivations(saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it live on ``host`` until backward needs them.

    Tensors already on ``host``, parameters and tensors under ``min_bytes`` stay where they are. From
    CUDA, each tensor is copied into pinned host memory on a side stream that waits for the compute
    stream, and its device memory is released to the caching allocator once that copy is done
    (``record_stream``); in backward it comes back on the compute stream after the side stream's copies.
    Other devices (the ``meta`` host the memory simulation uses) copy synchronously.

    ``seen`` counts the tensors and bytes offered by autograd, ``moved`` those that left the device.
    """

    def __init__(self, host: Union[str, torch.device] = "cpu", min_bytes: int = 1024) -> None:
        self.host = torch.device(host)
        self.min_bytes = min_bytes
        self.seen = [0, 0]
        self.moved = [0, 0]
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        self.seen[0] += 1
        self.seen[1] += nbytes
        if tensor.device == self.host or nbytes < self.min_bytes or isinstance(tensor, torch.nn.Parameter):
            return tensor
        self.moved[0] += 1
        self.moved[1] += nbytes
        device = tensor.device
        if device.type == "cuda" and self.host.type == "cpu":
            stream = self._side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                copy = torch.empty_like(tensor, device=self.host, pin_memory=True)
                copy.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # the allocator reuses this memory only after the copy
            return device, copy
        return device, tensor.to(self.host)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, copy = packed
        if device.type == "cuda" and device in self._streams:
            torch.cuda.current_stream(device).wait_stream(self._streams[device])  # the host copy is complete
            return copy.to(device, non_blocking=True)
        return copy.to(device)

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

