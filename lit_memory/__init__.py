"""lit_memory: fine-tune Transformer sequence classifiers in as little GPU memory as possible."""

import importlib
import logging

__version__ = "0.1.0"

# Import-time notices of libraries transformers imports when they are installed, about parts
# lit_memory never uses: bitsandbytes' optional 4-bit matmul kernels (on CPUs with AVX512-BF16),
# torchao's CUDA-only kernel libraries on a CPU build, and torchao's Enum registrations that torch's
# pytree now calls deprecated. Errors from those loggers still show.
for _name in ("bitsandbytes.backends.cpu.ops", "torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# `lit_memory.<name>` for YAML class paths (and `from lit_memory import <name>`), imported on first use: `import lit_memory.errors`
# must not pull in Lightning and transformers.
_EXPORTS = {
    "FusedSingleDeviceStrategy": "lit_memory.strategies",
    "FusedFSDPStrategy": "lit_memory.strategies",
    "FSDP2Strategy": "lit_memory.strategies",
    "FusedFabricStrategy": "lit_memory.fabric",
    "FusedFabricFSDPStrategy": "lit_memory.fabric",
    "fsdp_overlap_step_with_backward": "lit_memory.fabric",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lit_memory' has no attribute {name!r}")
