"""`OptimizerInBackward`: the optimizer the user configured, stepped bucket by bucket inside backward through
copies of it, while everyone else (Lightning, Fabric, LR schedulers, checkpoints) keeps talking to the original."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.optim import Optimizer

from lit_memory.fused.buckets import DEFAULT_BUCKET, copy_bucket, group_parameters, parse_bucket
from lit_memory.fused.clipping import Clipping
from lit_memory.fused.hooks import BucketHooks
from lit_memory.fused.scaling import LossScaling, ScalerView
from lit_memory.fused.streams import DeviceStreams


class OptimizerInBackward:
    """Step ``optimizer`` bucket by bucket inside backward; `remove` restores normal stepping.

    ``optimizer`` stays the one that Lightning, LR schedulers and checkpoints use; its buckets step
    copies of it (`copy_bucket`). ``units``: the model's parameters in the units a ``layer`` bucket
    steps together, in the model's parameter order (`lit_memory.hf.anatomy.parameter_units`: each
    transformer layer, each other module's own parameters); parameters in no unit are one bucket each.
    ``bucket``: a `Bucketing` or the setting as written (`parse_bucket`).
    ``clipping``: see `Clipping`; by norm, run backward through `backward`.
    ``streams``: see `BucketHooks` (by default the parameters' device's).
    ``scaler``: the loop's ``torch.amp.GradScaler`` (fp16): the loss it scales is unscaled and checked inside
    backward (`LossScaling`); run backward through `backward`, and call `scaler` (the scaler's view) where
    the loop called the GradScaler, or nothing: the scale is already updated.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        units: Optional[Sequence[Sequence[torch.Tensor]]] = None,
        bucket: Any = DEFAULT_BUCKET,
        clipping: Optional[Clipping] = None,
        streams: Optional[DeviceStreams] = None,
        scaler: Any = None,
    ) -> None:
        self.optimizer, self.units, self.clipping = optimizer, list(units or ()), clipping
        self.bucket = parse_bucket(bucket)
        self.streams = streams
        self.scaling = LossScaling.of(scaler)
        self._fuse()

    @property
    def scaler(self) -> Optional[ScalerView]:
        """The GradScaler as the loop sees it after a fused backward (`ScalerView`); None without one."""
        return self.scaling.view if self.scaling is not None else None

    def _fuse(self) -> None:
        self._trainable = self._signature()
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        groups = group_parameters(params, self.units, self.bucket)
        buckets = [copy_bucket(self.optimizer, group) for group in groups]
        self.hooks = BucketHooks(buckets, self.clipping, self.streams, self.scaling)

    def _signature(self) -> tuple:
        return tuple((id(p), p.requires_grad) for group in self.optimizer.param_groups for p in group["params"])

    def refresh(self) -> None:
        """Re-fuse if the optimizer's trainable parameters changed (a parameter group added, parameters
        unfrozen or frozen, as Lightning's `BaseFinetuning` does between epochs): a parameter without a
        hook would be stepped only after backward, its gradient held through it. One pass over the
        parameters' flags: call it before every backward."""
        if self._signature() != self._trainable:
            self.hooks.remove()
            self._fuse()

    def backward(self, run: Callable[..., Any], **kwargs: Any) -> Optional[torch.Tensor]:
        """Run backward (``run(**kwargs)``) as the clipping needs (`BucketHooks.backward`)."""
        return self.hooks.backward(run, **kwargs)

    @property
    def steps_shards(self) -> bool:
        """Whether some bucket steps local shards (bitsandbytes under FSDP2): their state is checkpointed by
        `lit_memory.optim.eightbit_shards`, not by torch's optimizer state dict."""
        return any(bucket.shards for bucket in self.hooks.buckets)

    @torch.no_grad()
    def initialize_state(self) -> None:
        """Create the optimizer state as a first step would, one bucket at a time on zero gradients and
        a zero learning rate, if it does not exist yet.

        torch's distributed checkpoint loads optimizer state into existing state, and creates it
        otherwise (``_init_optim_state``) with a zero gradient for every parameter at once and a full
        unfused step: a full set of gradients, on exactly the setups that cannot afford one. Here at
        most one bucket's zero gradients exist at a time.
        """
        if self.optimizer.state:
            return
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:  # as torch does: lr 0 leaves the parameters as they are
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        try:
            for bucket in self.hooks.buckets:
                for param in bucket.params:
                    param.grad = torch.zeros_like(param)
                bucket.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr

    def remove(self) -> None:
        self.hooks.remove()
