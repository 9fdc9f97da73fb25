"""What a training step keeps beside the activations, read from its model and optimizer built on the ``meta``
device: `state(step, module, optimizer)` gives the weights, the gradients, the optimizer's state and step
temporaries (measured by `lit_memory.optim.optimizer_state`), the loss scaler's state and what unscaling adds, one
rank's share under FSDP2 (`Sharding`) and the fused step's buckets. The meta builds themselves are here too
(`meta_build`), with what is read once per build (`per_build`): a search predicts hundreds of setups over a
handful of models."""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
from torch import nn

from lit_memory.fused import Bucketing, group_parameters
from lit_memory.hf.anatomy import parameter_units
from lit_memory.hf.qlora import values, weight_bytes
from lit_memory.model import SequenceClassifier, transformer_layers
from lit_memory.optim.optimizer_state import OptimizerTensors, optimizer_tensors
from lit_memory.planning.prediction.step import Step, build

T = TypeVar("T")

# What a meta build's model and optimizer give whatever the step's checkpointing plan: `plan` predicts hundreds of
# plans over one build (`meta_build`), and reading them again was most of each prediction.
_PER_BUILD: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

# The last meta-device builds: `plan` predicts hundreds of setups that share a handful of models.
_META_BUILDS: OrderedDict[str, tuple[SequenceClassifier, torch.optim.Optimizer]] = OrderedDict()
META_BUILDS_KEPT = 128  # plan cycles through ~100 builds; a meta BERT-large build is ~1 MiB of Python objects


def per_build(owner: Any, key: tuple, make: Callable[[], T]) -> T:
    """``make()``, once per ``owner`` (a meta build's model or optimizer) and ``key``."""
    found = _PER_BUILD.setdefault(owner, {})
    if key not in found:
        found[key] = make()
    return found[key]


def nbytes(t: torch.Tensor) -> int:
    """A tensor's bytes (its shape and dtype: meta tensors have no storage), with a 4-bit weight's quantisation
    state (QLoRA's base: `lit_memory.hf.qlora.weight_bytes`)."""
    return weight_bytes(t)


def meta_build(step: Step) -> tuple[SequenceClassifier, torch.optim.Optimizer]:
    """``step``'s module and optimizer built on the ``meta`` device, kept for the next predictions of the same build."""
    # One build serves every checkpointing plan: the model reads the plan from the step, not from the module.
    key = step.build_key
    if key in _META_BUILDS:
        _META_BUILDS.move_to_end(key)
    else:
        module, optimizer = build(step, torch.device("meta"))
        module.optimizer_factory = None  # what it references is not needed once the optimizer exists
        _META_BUILDS[key] = module, optimizer
        if len(_META_BUILDS) > META_BUILDS_KEPT:
            _META_BUILDS.popitem(last=False)
    return _META_BUILDS[key]


# -- the loss scaler ---------------------------------------------------------------------------------


# torch's GradScaler (16-mixed): its scale (fp32) and growth tracker (int32) live through the run. Unscaling is in
# place on the gradients (one foreach kernel, or per bucket fused); it adds the found-inf flag and the inverse
# scale, made through fp64 (the scale as a double, its reciprocal, the float): four scalars at most at once.
# On CUDA each scalar is a 512-byte block of the caching allocator (its smallest), within the small pool's
# segments the weights' biases already reserve; on the CPU its own bytes.
SCALER_STATE = (4, 4)
UNSCALE_TEMPORARIES = (4, 8, 8, 4)
CUDA_BLOCK = 512


def scaler_bytes(step: Step) -> tuple[int, int]:
    """(GradScaler's state, what unscaling adds while it runs) for ``step``: 0 without loss scaling."""
    if not step.scaled:
        return 0, 0
    size = (lambda b: -(-b // CUDA_BLOCK) * CUDA_BLOCK) if step.device == "cuda" else (lambda b: b)
    return sum(map(size, SCALER_STATE)), sum(map(size, UNSCALE_TEMPORARIES))


# -- sharding ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sharding:
    """One rank's share under FSDP2 as lit_memory applies it (`fully_shard` on each transformer layer,
    then on the model): 1/N of the weights, gradients and optimizer state, plus what FSDP2 gathers.

    The root unit (embeddings, pooler, head) stays gathered from its forward to the end of backward
    (FSDP2 does not reshard the root after forward); a layer is gathered while it computes, and the
    next one is prefetched meanwhile: two layers at once. A unit's gradients exist unsharded until its
    reduce-scatter: the largest unit's at most. On one rank too: FSDP2 then copies a unit's parameters where it
    would gather them, and its gradients where it would reduce them (torch 2.13, ``_fsdp_param_group``).
    """

    ranks: int
    gathered: int  # unsharded parameters alive at once
    reducing: int  # unsharded gradients of the largest unit

    @classmethod
    def of(cls, model: nn.Module, step: Step) -> Optional["Sharding"]:
        if not step.sharded:
            return None
        layers = transformer_layers(model)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_layers]
        layer_bytes = [sum(nbytes(p) for p in layer.parameters()) for layer in layers]
        layer_grads = [sum(nbytes(p) for p in layer.parameters() if p.requires_grad) for layer in layers]
        root_grads = sum(nbytes(p) for p in root if p.requires_grad)
        return cls(
            ranks=step.world_size,
            gathered=sum(nbytes(p) for p in root) + 2 * max(layer_bytes, default=0),
            reducing=max([root_grads, *layer_grads]),
        )

    def per_rank(self, categories: dict[str, int], unsharded: int) -> dict[str, int]:
        n = self.ranks
        return {
            **categories,
            "weights": math.ceil(categories["weights"] / n) + self.gathered,
            "gradients": math.ceil(categories["gradients"] / n) + unsharded,
            "optimizer": math.ceil(categories["optimizer"] / n),
        }

    def describe(self) -> str:
        if self.ranks == 1:
            return (
                f"FSDP2 on one rank: {self.gathered / 2**20:.0f} MiB of weights copied where they would be gathered "
                f"(the root unit and two layers) and up to {self.reducing / 2**20:.0f} MiB of a unit's gradients "
                "where they would be reduced"
            )
        return (
            f"per rank of {self.ranks} (FSDP2): 1/{self.ranks} of weights, gradients and optimizer state, plus "
            f"{self.gathered / 2**20:.0f} MiB of gathered weights (the root unit and two layers) and up to "
            f"{self.reducing / 2**20:.0f} MiB of a unit's gradients before they are reduced"
        )


# -- the fused step's buckets ------------------------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """One bucket of the fused step: its parameters in gradient order, their gradients' bytes, and what its
    optimizer step allocates (the bucket's parameters split by group, one foreach call per group)."""

    params: tuple[torch.Tensor, ...]
    gradients: int
    optimizer: OptimizerTensors


def _buckets(
    module: SequenceClassifier, optimizer: torch.optim.Optimizer, bucket: Bucketing, device: str
) -> tuple[Bucket, ...]:
    """The fused step's buckets of the trainable parameters (`lit_memory.fused.group_parameters`)."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"] if p.requires_grad}
    found = group_parameters([p for p in module.parameters() if id(p) in group_of], parameter_units(module), bucket)
    out = []
    for params in found:
        by_group = [[p for p in params if group_of[id(p)] == g] for g in sorted({group_of[id(p)] for p in params})]
        key = ("bucket", device, tuple(id(p) for group in by_group for p in group))
        tensors = per_build(optimizer, key, lambda: optimizer_tensors(optimizer, device, by_group))
        out.append(Bucket(params=tuple(params), gradients=sum(nbytes(p) for p in params), optimizer=tensors))
    return tuple(out)


# -- the state of a step -----------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """What a step keeps beside the activations, in bytes for one device (unsharded: `Sharding.per_rank` splits it)."""

    weights: int  # parameters and buffers
    buffers: int
    gradients: int  # every trainable parameter's
    largest_gradient: int
    optimizer: OptimizerTensors  # its state per parameter, and one step's temporaries over all parameters
    scaler: int  # GradScaler's state, for the whole run
    unscaling: int  # what unscaling the gradients adds while it runs
    sharding: Optional[Sharding]  # one rank's share under FSDP2; None unsharded
    buckets: tuple[Bucket, ...]  # the fused step's; () without it
    parameters: int  # parameters (values), all and trainable
    trainable: int


def state(step: Step, module: SequenceClassifier, optimizer: torch.optim.Optimizer) -> State:
    """What ``step`` keeps beside the activations, read from its meta build (``module``, ``optimizer``:
    `meta_build`)."""
    model = module.model
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    buffers = sum(nbytes(b) for b in model.buffers())
    tensors = per_build(optimizer, ("state", step.device), lambda: optimizer_tensors(optimizer, step.device))
    scaler, unscaling = scaler_bytes(step)
    buckets = (
        per_build(
            optimizer,
            ("buckets", step.bucket, step.device),
            lambda: _buckets(module, optimizer, step.bucket, step.device),
        )
        if step.fused
        else ()
    )
    return State(
        weights=sum(nbytes(p) for p in params) + buffers,
        buffers=buffers,
        gradients=sum(nbytes(p) for p in trainable),
        largest_gradient=max((nbytes(p) for p in trainable), default=0),
        optimizer=tensors,
        scaler=scaler,
        unscaling=unscaling,
        sharding=Sharding.of(model, step),
        buckets=buckets,
        parameters=sum(values(p) for p in params),
        trainable=sum(p.numel() for p in trainable),
    )
