"""The confined child's environment: an allowlist of what a run needs, not a denylist of names.

A name-based denylist (`lit_memory.sandbox.rules.scrubbed`) misses every secret that is not spelled like one
(``DATABASE_URL`` with its password, ``MYSQL_PWD``, ``HTTPS_PROXY`` with credentials, ``PIP_INDEX_URL`` with a token,
``SENTRY_DSN``, ``SLACK_WEBHOOK_URL``). A confined run gets only what a training run reads: the locale, ``PATH`` and
the user's identity, thread counts, CUDA's (and ROCm's) device selection, the offline flags, Python's output settings,
the project's own variables, and the settings of torch, NCCL, the allocator and Lightning. Everything else is dropped,
and a kept name that still looks like a secret (``NCCL_..._TOKEN``) is dropped too. The launch then sets the child's
own (its temporary folder and caches, ``PYTHONPATH``, offline: `lit_memory.confine.launch.child_environment`).
"""

from __future__ import annotations

import re
from typing import Mapping

# Names kept as they are.
NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "NO_COLOR", "COLUMNS",
    # libraries a run loads from where the user installed them (CUDA in a container, a cluster's modules)
    "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CC", "CXX",
    # the device the run may use
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_MODULE_LOADING",
    "CUDA_LAUNCH_BLOCKING", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
    # threads
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMEXPR_MAX_THREADS",
    "VECLIB_MAXIMUM_THREADS", "RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    # offline and quiet
    "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
    "TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS",
    # Python's output (not PYTHONPATH, PYTHONSTARTUP, PYTHONWARNINGS: they import code; the launch sets PYTHONPATH)
    "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONUTF8",
    # the run's own settings: allocator, determinism, a single-node launch's rendezvous port
    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING", "CUBLAS_WORKSPACE_CONFIG",
    "MASTER_PORT", "GLOO_SOCKET_IFNAME",
    # the project's own, the child reads them (the trust store's place: the child judges as the parent did)
    "LIT_MEMORY_STAGED_DATASET", "LIT_MEMORY_CONFIG_DIR", "XDG_CONFIG_HOME",
})
# Families of settings kept by prefix: the locale's categories, OpenMP's and MKL's, torch's, NCCL's, Lightning's.
PREFIXES = ("LC_", "OMP_", "KMP_", "MKL_", "TORCH_", "TORCHINDUCTOR_", "NCCL_", "PL_")
# A kept name that still looks like a secret is dropped (the allowlist's prefixes are families, not promises).
SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|PWD|CREDENTIAL|(^|_)KEY($|_)|APIKEY|PRIVATE|DSN|WEBHOOK|AUTH)",
                    re.IGNORECASE)


def allowed(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` a confined run is given: `NAMES` and `PREFIXES`, none that looks like a secret."""
    return {name: value for name, value in environ.items()
            if (name in NAMES or name.startswith(PREFIXES)) and not SECRET.search(name)}
