"""The sub-models of `lit_memory.memory.prediction.analytic` for what a step keeps beside the activations: the loss
scaler's state and temporaries, one rank's share under FSDP2 (`Sharding`), the fused step's buckets and the
optimizer's tensors per bucket (measured by `lit_memory.optimizers`), and the meta-device builds they are read
from, kept for the hundreds of predictions `plan` makes over one model."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lit_memory.anatomy import parameter_units
from lit_memory.fused import Bucketing, group_parameters
from lit_memory.memory.prediction.activation_model import _nbytes, _per_build
from lit_memory.memory.prediction.step import Step, build
from lit_memory.model import SequenceClassifier, transformer_layers
from lit_memory.optimizers import OptimizerTensors, optimizer_tensors


# -- the optimizer -----------------------------------------------------------------------------------
# What an optimizer keeps and allocates is measured by `lit_memory.optimizers.optimizer_tensors` (a probe step on
# meta tensors), the one place that knows optimizers.


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


def _total(categories: dict[str, int]) -> int:
    return sum(categories.values())


# The last meta-device builds: `plan` predicts hundreds of setups that share a handful of models.
_META_BUILDS: OrderedDict[str, tuple[SequenceClassifier, torch.optim.Optimizer]] = OrderedDict()
META_BUILDS_KEPT = 128  # plan cycles through ~100 builds; a meta BERT-large build is ~1 MiB of Python objects


@dataclass(frozen=True)
class Sharding:
    """One rank's share under FSDP2 as lit_memory applies it (`fully_shard` on each transformer layer,
    then on the model): 1/N of the weights, gradients and optimizer state, plus what FSDP2 gathers.

    The root unit (embeddings, pooler, head) stays gathered from its forward to the end of backward
    (FSDP2 does not reshard the root after forward); a layer is gathered while it computes, and the
    next one is prefetched meanwhile: two layers at once. A unit's gradients exist unsharded until its
    reduce-scatter: the largest unit's at most.
    """

    ranks: int
    gathered: int  # unsharded parameters alive at once
    reducing: int  # unsharded gradients of the largest unit

    @classmethod
    def of(cls, model: nn.Module, step: Step) -> Optional["Sharding"]:
        if not step.sharded or step.world_size < 2:
            return None
        layers = transformer_layers(model)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_layers]
        layer_bytes = [sum(_nbytes(p) for p in layer.parameters()) for layer in layers]
        layer_grads = [sum(_nbytes(p) for p in layer.parameters() if p.requires_grad) for layer in layers]
        root_grads = sum(_nbytes(p) for p in root if p.requires_grad)
        return cls(
            ranks=step.world_size,
            gathered=sum(_nbytes(p) for p in root) + 2 * max(layer_bytes, default=0),
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
        return (
            f"per rank of {self.ranks} (FSDP2): 1/{self.ranks} of weights, gradients and optimizer state, plus "
            f"{self.gathered / 2**20:.0f} MiB of gathered weights (the root unit and two layers) and up to "
            f"{self.reducing / 2**20:.0f} MiB of a unit's gradients before they are reduced"
        )


def _buckets(
    module: SequenceClassifier, optimizer: torch.optim.Optimizer, bucket: Bucketing
) -> list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]:
    """The fused step's buckets of the trainable parameters (`lit_memory.fused.group_parameters`), each
    with its parameters split by group, as its optimizer steps them (one foreach call per group)."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"] if p.requires_grad}
    buckets = group_parameters([p for p in module.parameters() if id(p) in group_of], parameter_units(module), bucket)
    return [(b, [[p for p in b if group_of[id(p)] == g] for g in sorted({group_of[id(p)] for p in b})]) for b in buckets]


def _bucket_tensors(optimizer: torch.optim.Optimizer, device: str, by_group: list[list[torch.Tensor]]) -> "OptimizerTensors":
    key = ("bucket", device, tuple(id(p) for group in by_group for p in group))
    return _per_build(optimizer, key, lambda: optimizer_tensors(optimizer, device, by_group))


def _meta_build(step: Step) -> tuple[SequenceClassifier, torch.optim.Optimizer]:
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
