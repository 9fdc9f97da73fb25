"""lit_memory: fine-tune Transformer sequence classifiers in as little GPU memory as possible."""

import importlib
import logging

__version__ = "0.1.0"

# bitsandbytes warns on import, on CPUs with AVX512-BF16, that an optional 4-bit matmul kernel
# package is missing; lit_memory never uses 4-bit matmuls, so that line is only noise.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

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
