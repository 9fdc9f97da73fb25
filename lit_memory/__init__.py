"""lit_memory: fine-tune Transformer sequence classifiers in as little GPU memory as possible."""

import logging

__version__ = "0.1.0"

# bitsandbytes warns on import, on CPUs with AVX512-BF16, that an optional 4-bit matmul kernel
# package is missing; lit_memory never uses 4-bit matmuls, so that line is only noise.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
