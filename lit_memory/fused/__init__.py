"""The fused backward + optimizer step: parameters are updated, and their gradients freed, bucket by bucket as
soon as backward has produced a bucket's gradients, so a full set of gradients never exists (docs/fused.md).

- `buckets`: the ``bucket`` setting, which parameters share a bucket, and a `Bucket` (one optimizer call);
- `hooks`: `BucketHooks`, which steps each bucket from its parameters' post-accumulate-grad hooks;
- `optimizer`: `OptimizerInBackward`, the optimizer the user configured, stepped in backward through copies of it;
- `clipping`: gradient clipping inside backward, and what the backward that only measures finds;
- `scaling`: fp16 loss scaling (torch's ``GradScaler``) inside backward;
- `streams`: the order of a bucket's step after its gradients on a device with streams (CUDA);
- `shards`: this rank's part of a sharded tensor, and the optimizer state a copy stepping local shards sees;
- `messages`: the one-line refusals of what fusion cannot do (it never sees the gradients after backward).
"""

from lit_memory.fused.buckets import (
    DEFAULT_BUCKET,
    Bucket,
    Bucketing,
    copy_bucket,
    gradient_bytes,
    group_parameters,
    parse_bucket,
)
from lit_memory.fused.clipping import Clipping
from lit_memory.fused.hooks import BucketHooks
from lit_memory.fused.messages import (
    ACCUMULATION,
    ACCUMULATION_SCHEDULE,
    CLIPPING_HOOK,
    FABRIC_CLIPPING,
    MANUAL,
    SEVERAL,
    UNCHECKED,
    UNMEASURED,
    UNSCALED,
)
from lit_memory.fused.optimizer import OptimizerInBackward
from lit_memory.fused.scaling import LossScaling, ScalerView
from lit_memory.fused.streams import DeviceStreams

__all__ = [
    "ACCUMULATION",
    "ACCUMULATION_SCHEDULE",
    "CLIPPING_HOOK",
    "DEFAULT_BUCKET",
    "FABRIC_CLIPPING",
    "MANUAL",
    "SEVERAL",
    "UNCHECKED",
    "UNMEASURED",
    "UNSCALED",
    "Bucket",
    "BucketHooks",
    "Bucketing",
    "Clipping",
    "DeviceStreams",
    "LossScaling",
    "OptimizerInBackward",
    "ScalerView",
    "copy_bucket",
    "gradient_bytes",
    "group_parameters",
    "parse_bucket",
]
