"""`BucketHooks`: each bucket stepped from its parameters' post-accumulate-grad hooks when backward has produced
the last of their gradients, clipped and unscaled first where set, ordered after them on a device with streams."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch._functorch.config
from torch.autograd import Variable

from lit_memory.errors import UserError
from lit_memory.fused.buckets import Bucket
from lit_memory.fused.clipping import Clipping, Measure
from lit_memory.fused.messages import UNCHECKED, UNMEASURED, UNSCALED
from lit_memory.fused.scaling import LossScaling, unscale
from lit_memory.fused.shards import local_part
from lit_memory.fused.streams import DeviceStreams, device_streams


def _drop(bucket: Bucket) -> None:
    """Free a bucket's gradients without stepping it."""
    for param in bucket.params:
        param.grad = None
    for shard in bucket.shards or ():
        shard.grad = None


def _allow_a_second_backward() -> None:
    """Clipping by norm runs two backwards over one forward. A torch.compile'd backward by default donates
    its saved tensors' memory to its outputs and then refuses a second backward; layers compiled from here
    on keep them, by torch's own switch (process-wide; a little more memory in compiled backwards)."""
    torch._functorch.config.donated_buffer = False


class BucketHooks:
    """Step each bucket from its parameters' post-accumulate-grad hooks once backward has made the last of
    their gradients; `remove` restores normal stepping.

    A bucket still waiting at the end of backward (a branch the batch did not use) steps with what it has.
    ``clipping`` clips before each step (by norm, and with ``scaling``, backward runs through `backward`);
    FSDP1 hands gradients over through `arrived`, ``groups`` and ``after_step``. ``streams`` orders each step
    after its gradients, one bucket late where they came from another stream (docs/fused.md, "Streams").
    """

    def __init__(
        self,
        buckets: list[Bucket],
        clipping: Optional[Clipping] = None,
        streams: Optional[DeviceStreams] = None,
        scaling: Optional[LossScaling] = None,
    ) -> None:
        self.buckets = buckets
        self.clipping = clipping
        self.scaling = scaling
        if self._measures:
            _allow_a_second_backward()
        self.groups: dict[int, Any] = {}  # id(parameter) -> the group its plain-tensor gradient is sharded over
        self.after_step: list[Callable[[Bucket], None]] = []
        first = next((p for b in buckets for p in b.params), None)
        self.streams = streams if streams is not None else device_streams(None if first is None else first.device)
        self._deferred: Optional[tuple[Bucket, list, Any]] = None  # (bucket, events to wait for, its launch stream)
        self._bucket_of = {id(p): bucket for bucket in buckets for p in bucket.params}
        # loss scaling: GradScaler skips each of the user's optimizers on its own gradients (a bucket's source)
        self._optimizer_of = {b: id(b.source if b.source is not None else b.optimizer) for b in buckets}
        self._optimizers = list(dict.fromkeys(self._optimizer_of.values()))
        self._skipping: set[int] = set()  # this backward's optimizers whose buckets drop their gradients
        self._waiting: dict[Bucket, None] = {}  # buckets with some of their gradients (an ordered set)
        self._flushing = -1  # the backward (autograd graph task) whose end steps them
        self._meter: Optional[Measure] = None  # while a backward only measures
        self._coefficient: Optional[torch.Tensor] = None  # clipping by norm: this backward's factor
        self._inv_scale: Optional[torch.Tensor] = None  # loss scaling: this backward's inverse scale
        self._handles = [p.register_post_accumulate_grad_hook(self.arrived) for b in buckets for p in b.params]

    def arrived(self, param: torch.Tensor) -> None:
        """``param``'s gradient for this backward is complete."""
        if self._meter is not None:  # a backward that only measures: take the norm, free the gradient
            self._meter.add(param.grad, self.groups.get(id(param)), self._optimizer_of[self._bucket_of[id(param)]])
            param.grad = None
            return
        if self.clipping is not None and self.clipping.by_norm and self._coefficient is None:
            raise UserError(UNMEASURED)
        if self.scaling is not None and self._inv_scale is None:
            raise UserError(UNSCALED if self.scaling.scaler._scale is None else UNCHECKED)
        backward = torch._C._current_graph_task_id()  # by id, not a flag: a failed backward runs no callback
        if backward != self._flushing:
            self._flushing = backward
            # Runs after every callback queued before it: FSDP2's (queued when backward starts), which
            # delivers the root module's gradients, comes first.
            Variable._execution_engine.queue_callback(self._flush)
        bucket = self._bucket_of[id(param)]
        bucket.arrived += 1
        if self.streams is not None:
            bucket.streams.add(self.streams.current())
        if bucket.arrived < len(bucket.params):
            self._waiting[bucket] = None
            return
        self._waiting.pop(bucket, None)
        self._step(bucket)

    @property
    def _measures(self) -> bool:
        return (self.clipping is not None and self.clipping.by_norm) or self.scaling is not None

    def backward(self, run: Callable[..., Any], **kwargs: Any) -> Optional[torch.Tensor]:
        """``run(**kwargs)``: a backward, during which the buckets step. Clipping by norm or scaling the loss, a
        first ``run(retain_graph=True)`` only measures: the total norm (returned) and which optimizers'
        gradients overflowed (their step is skipped; all of them: no second backward)."""
        if not self._measures:
            run(**kwargs)
            return None
        by_norm = self.clipping is not None and self.clipping.by_norm
        meter = self._meter = Measure(self.clipping.norm_type if by_norm else None, self.scaling, self._optimizers)
        try:
            run(**{**kwargs, "retain_graph": True})
            total, found_inf = meter.result()
        finally:
            self._meter = None
        skipped: set[int] = set()
        if found_inf is not None:
            skipped = {key for key, found in zip(self._optimizers, found_inf.tolist()) if found}  # the one host sync
            if len(skipped) == len(self._optimizers):
                self.scaling.update(found_inf, skipped)
                return total  # skipped, as GradScaler skips the step
        self._coefficient = self.clipping.coefficient(total) if by_norm else None
        self._inv_scale = meter.inv_scale if self.scaling is not None else None
        self._skipping = skipped
        try:
            run(**kwargs)
        finally:
            self._coefficient = self._inv_scale = None  # every backward measures its own
            self._skipping = set()
        if found_inf is not None:
            self.scaling.update(found_inf, skipped)
        return total

    def _clip(self, grads: list[torch.Tensor]) -> None:
        if self._inv_scale is not None:  # GradScaler's order: unscale, then clip
            unscale(grads, self._inv_scale)
        if self._coefficient is not None:
            for grad in grads:
                grad.mul_(self._coefficient.to(grad.device))
        elif self.clipping is not None and self.clipping.value is not None:
            for grad in grads:
                grad.clamp_(-self.clipping.value, self.clipping.value)

    def _step(self, bucket: Bucket, defer: bool = True) -> None:
        """Step ``bucket`` (all its gradients are here), ordered after them where they were made."""
        if self.streams is None:
            self._run(bucket)
            return
        target = self.streams.default()  # the compute stream: one allocator pool (`DeviceStreams`)
        made = [stream for stream in bucket.streams if stream != target]
        if not made:  # made on the stream its optimizer launches on: in order already
            self._run(bucket)
            return
        events = [self.streams.record(stream) for stream in made]
        if defer:  # step the one deferred before, defer this one
            previous, self._deferred = self._deferred, (bucket, events, target)
            if previous is None:
                return
            bucket, events, target = previous
        self._run_after(bucket, events, target)

    def _run_after(self, bucket: Bucket, events: list, target: Any) -> None:
        for event in events:
            self.streams.wait(target, event)
        with self.streams.use(target):
            for param in bucket.params:
                if param.grad is not None:
                    self.streams.used_on(local_part(param.grad), target)
            self._run(bucket)

    def _run(self, bucket: Bucket) -> None:
        bucket.arrived = 0
        bucket.streams.clear()
        if self._skipping and self._optimizer_of[bucket] in self._skipping:
            _drop(bucket)  # GradScaler skips this optimizer's step: its gradients are only freed
        else:
            bucket.step(self._clip if self.clipping is not None or self.scaling is not None else None)
        for callback in self.after_step:
            callback(bucket)

    def _flush(self) -> None:
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self._run_after(*deferred)
        waiting, self._waiting = self._waiting, {}
        for bucket in waiting:
            self._step(bucket, defer=False)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
