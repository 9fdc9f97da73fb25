"""lit_memory: fine-tune Transformer sequence classifiers in as little GPU memory as possible."""

import importlib
import logging

__version__ = "0.1.0"

# bitsandbytes warns on import, on CPUs with AVX512-BF16, that an optional 4-bit matmul kernel
# package is missing; lit_memory never uses 4-bit matmuls, so that line is only noise.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


class _DropImportNoise(logging.Filter):
    """torchao, which transformers imports whenever it is installed, logs on import that its CUDA kernel
    libraries do not load on this build, and makes torch log that it registers enums torch now handles:
    lines about kernels lit_memory never calls. Only records matching these messages are dropped."""

    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in str(record.msg) for fragment in self.fragments)


logging.getLogger("torchao").addFilter(_DropImportNoise("Failed to load"))
logging.getLogger("torch.utils._pytree").addFilter(_DropImportNoise("is an Enum subclass and is now natively supported"))

# `lit_memory.<name>` for YAML class paths, imported on first use: `import lit_memory.errors`
# must not pull in Lightning and transformers.
_EXPORTS = {
    "FusedSingleDeviceStrategy": "lit_memory.strategies",
    "FusedFSDPStrategy": "lit_memory.strategies",
    "FSDP2Strategy": "lit_memory.strategies",
    "FusedFabricStrategy": "lit_memory.strategies",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lit_memory' has no attribute {name!r}")
