"""Cheaper ways to keep activations than re-running every layer's forward: selective activation
checkpointing and activation offloading to host memory; and the per-layer plan switched on in a
Hugging Face model (`enable_gradient_checkpointing`).

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

from dataclasses import dataclass
from functools import partial
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lit_memory.errors import UserError
from lit_memory.hf.anatomy import find_layers

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


MODES = ("full", "selective")


@dataclass(frozen=True)
class CheckpointPlan:
    """What each transformer layer recomputes in backward: ``model.gradient_checkpointing`` parsed once.

    Counted from the input side: the first ``full`` layers keep only their input and re-run their whole
    forward, the next ``selective`` layers also keep their matmul and fused-attention outputs (recomputing
    only cheap ops), and the layers after them keep everything (nothing recomputed). ``rest`` names the mode
    of every layer the counts leave over (``None``: no recompute), so ``true`` is ``rest="full"``. The
    layers nearest the output are the ones left whole: backward reaches them first and frees what they keep
    before any checkpointed layer recomputes, so their activations never meet a recomputed layer's.
    """

    full: int = 0
    selective: int = 0
    rest: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("full", "selective"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"model.gradient_checkpointing.{name} must be a layer count >= 0, got {value!r}")
        if self.rest not in (None, *MODES):
            raise UserError(f"gradient checkpointing mode {self.rest!r} is not one of: full, selective")

    @classmethod
    def parse(cls, value: Any) -> Optional["CheckpointPlan"]:
        """``false``/``null`` (None: off), ``true``/``full``, ``selective``, or counts ``{full: F, selective: S}``
        (the remaining layers keep everything). ``auto`` is resolved before a plan is built (`is_auto`)."""
        if isinstance(value, CheckpointPlan):
            return value if value.recomputes else None
        if value is False or value is None:
            return None
        if value is True or value == "full":
            return cls(rest="full")
        if value == "selective":
            return cls(rest="selective")
        if isinstance(value, Mapping) and set(value) <= {"full", "selective"}:
            plan = cls(full=value.get("full", 0), selective=value.get("selective", 0))
            return plan if plan.recomputes else None
        if value == "auto":
            raise UserError(
                "model.gradient_checkpointing: auto is chosen for a device budget before the model is built "
                "(`python -m lit_memory fit/estimate` do it; in Python: lit_memory.planning.recompute.resolve)"
            )
        raise UserError(
            f"gradient_checkpointing={value!r} is not one of: false, true (= full), full, selective, auto, "
            "or layer counts such as {full: 12, selective: 6} (the remaining layers recompute nothing)"
        )

    @property
    def recomputes(self) -> bool:
        return bool(self.full or self.selective or self.rest)

    @property
    def uniform(self) -> Optional[str]:
        """The one mode of every layer, when the plan has one (``full``/``selective``; ``None`` for a mix)."""
        if self.rest and not self.full and not self.selective:
            return self.rest
        return None

    def modes(self, layers: int) -> list[Optional[str]]:
        """The mode of each of ``layers`` layers, input side first."""
        if self.full + self.selective > layers:
            raise UserError(
                f"model.gradient_checkpointing counts {self.full} full + {self.selective} selective layers, but "
                f"the model has {layers} transformer layers"
            )
        return (
            ["full"] * self.full + ["selective"] * self.selective + [self.rest] * (layers - self.full - self.selective)
        )

    def value(self) -> Any:
        """The setting that parses back to this plan (what a resolved ``auto`` writes into the config)."""
        if self.uniform:
            return self.uniform
        return {"full": self.full, "selective": self.selective}

    def describe(self, layers: Optional[int] = None) -> str:
        if self.uniform:
            return f"{self.uniform} checkpointing"
        if layers is not None and len(set(self.modes(layers))) == 1:
            return f"{self.modes(layers)[0]} checkpointing"
        none = f", {layers - self.full - self.selective} none" if layers is not None else ""
        return f"checkpointing {self.full} full, {self.selective} selective{none}"


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def checkpoint_function(mode: str):
    """The function transformers' checkpointed layers call (``layer._gradient_checkpointing_func``)."""
    return partial(checkpoint, **checkpoint_kwargs(mode))


def checkpoint_kwargs(policy: str) -> dict[str, Any]:
    """Keyword arguments for ``torch.utils.checkpoint.checkpoint``: ``full`` or ``selective``.

    Non-reentrant in both cases (the only kind that takes a ``context_fn``); it keeps the
    random-number state, so recomputed dropout draws the same masks as the forward pass did.
    """
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, selective_policy)
    return kwargs


def enable_gradient_checkpointing(
    model: nn.Module, plan: CheckpointPlan = CheckpointPlan(rest="full"), layers: Optional[nn.ModuleList] = None
) -> None:
    """Recompute ``layers`` of a Hugging Face model (default: its own, `lit_memory.hf.anatomy.find_layers`) in
    backward as ``plan`` says, layer by layer."""
    layers = find_layers(model) if layers is None else layers
    modes = plan.modes(len(layers))
    # transformers >= 5.2x renamed the switch; older releases (e.g. on the GPU image) only have the old name.
    # Both hand these kwargs to torch.utils.checkpoint.checkpoint (selective: its context_fn).
    kwargs = checkpoint_kwargs(next(mode for mode in modes if mode))
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers switches every layer the same way; the plan is per layer. Its GradientCheckpointingLayer
    # reads both attributes at every call, so each layer gets its own flag and checkpoint function.
    for layer, mode in zip(layers, modes):
        if hasattr(layer, "gradient_checkpointing"):
            layer.gradient_checkpointing = mode is not None
            if mode is not None:
                layer._gradient_checkpointing_func = checkpoint_function(mode)
    # transformers also makes the embeddings' output require grad, which only reentrant checkpointing
    # needs; with it a frozen encoder would still run (and keep memory for) a backward of its own.
    model.disable_input_require_grads()
    model.config.use_cache = False  # nothing to cache in training; transformers warns at every forward otherwise


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

