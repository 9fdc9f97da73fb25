"""The order of a bucket's step after its gradients on a device with streams (CUDA)."""

from __future__ import annotations

from typing import Any, Optional

import torch


# Where a bucket's gradients are made and where its optimizer's kernels run can differ:
# - FSDP2 runs the post-accumulate-grad hooks inside its reduce-scatter stream (all-reduce stream under HSDP), a
#   non-blocking stream from torch's pool (``foreach_reduce`` in torch/distributed/fsdp/_fully_shard/
#   _fsdp_collectives.py: the hooks run in ``device_handle.stream(post_reduce_stream)``); FSDP1 steps its
#   in-backward optimizers inside its post-backward stream; on one device, autograd runs a gradient's
#   accumulation, and so its hook, on the stream of its forward;
# - torch's optimizers (and anything made of torch ops) launch on torch's current stream, which is where the
#   gradient was made: in order. bitsandbytes 0.50 passes no stream to its optimizer kernels (``_optimizer_update_*``
#   in bitsandbytes/backends/cuda/ops.py), so they run on the legacy default stream, which a non-blocking stream
#   does not synchronise with (`lit_memory.optim.optimizers.Library.launch_stream`).
# Why the compute stream for torch's optimizers too, rather than the reduce-scatter stream their hook runs on: the
# caching allocator keeps a pool per stream and reuses no block across them, so a step there would put its
# temporaries and its first-step state in a second pool (reserved memory growing by a bucket's temporaries per
# rank) that the memory model does not replay. On the compute stream every allocation is in the one pool the
# model replays; the step runs one bucket late (as bitsandbytes' always did), so the reduce-scatter still
# overlaps the next layer's backward.
class DeviceStreams:
    """One device's streams, as the fused step orders its work on them: ``module`` is torch's module for the device
    type (``torch.cuda``; `device_streams` picks it).

    ``BucketHooks`` steps every bucket on the compute stream (the default stream): it waits for an event recorded
    where the gradients were made when the bucket completed, runs the whole step with that stream current (the
    library's torch ops, e.g. its zero-initialised first-step state, go where its kernels go) and marks the gradients
    used there (``record_stream``), so their memory is not reused before the step has read them. No host
    synchronisation."""

    def __init__(self, module: Any, device: torch.device) -> None:
        self.module, self.device = module, device

    def current(self) -> Any:
        return self.module.current_stream(self.device)

    def default(self) -> Any:
        return self.module.default_stream(self.device)

    def use(self, stream: Any) -> Any:
        return self.module.stream(stream)

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


def device_streams(device: Optional[torch.device]) -> Optional[DeviceStreams]:
    """The streams of ``device`` where work can run out of program order (CUDA, and devices with its stream
    API); None on the CPU, where it cannot. A function, so that a test can put a recording handle in its place
    (in `lit_memory.fused.hooks`, where `BucketHooks` looks it up)."""
    if device is None or device.type in ("cpu", "meta"):
        return None
    module = torch.get_device_module(device)
    if not all(hasattr(module, name) for name in ("current_stream", "default_stream", "stream")):
        return None
    return DeviceStreams(module, device)
