"""lit_memory: fine-tune Transformer sequence classifiers in as little GPU memory as possible."""

import os
import sys

# `python -m lit_memory` puts the working folder first on sys.path (what `python -P` does not): a folder someone sent,
# holding `datasets/` or `logging.py`, would shadow the installed packages. Dropped before anything else is imported,
# so the console script and `python -m` import the same code; and every Python this command starts, or a library it
# calls starts (jsonargparse's typeshed_client runs `python -c` in the working folder while parsing), gets
# PYTHONSAFEPATH: neither the working folder nor a script's folder on its path, and PATH keeps no entry naming the
# working folder (`lit_memory.run.environment.safe_path` holds both for `lit_memory.__main__.main`). (A `lit_memory/`
# folder there is found before this file runs: `python -P -m lit_memory` or the `lit-memory` script avoid it.)
if sys.argv[:1] == ["-m"]:
    os.environ["PYTHONSAFEPATH"] = "1"
    if "PATH" in os.environ:
        os.environ["PATH"] = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if os.path.isabs(p))
    if not sys.flags.safe_path and sys.path and os.path.realpath(sys.path[0] or ".") == os.path.realpath(os.getcwd()):
        del sys.path[0]

import importlib  # noqa: E402
import logging  # noqa: E402

__version__ = "0.1.0"

# Import-time notices of libraries transformers imports when they are installed, about parts
# lit_memory never uses: bitsandbytes' optional 4-bit matmul kernels (on CPUs with AVX512-BF16),
# torchao's CUDA-only kernel libraries on a CPU build, and torchao's Enum registrations that torch's
# pytree now calls deprecated. Errors from those loggers still show.
for _name in ("bitsandbytes.backends.cpu.ops", "torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# The package's layers, bottom to top, one folder (or top-level module) each where it can be: a module imports its own
# layer and the layers below, never one above, function-level imports included, and no top-level folder or module
# imports itself back through others (tests/test_layers.py checks every import). A module falls in the layer of the
# longest name that holds it; the runtime holds the rest.
LAYERS = (
    ("base", ("lit_memory.errors", "lit_memory.files", "lit_memory.settings")),
    ("policy", ("lit_memory.policy",)),  # every rule that judges a sent recipe
    ("sandbox", ("lit_memory.sandbox",)),  # the kernel's layers and the trust guard at the sinks
    ("memory below the runtime", ("lit_memory.memory",)),  # what a run measures; the device and the memory model
    ("parts", ("lit_memory.task", "lit_memory.console", "lit_memory.hf", "lit_memory.optim", "lit_memory.fused")),
    ("run", ("lit_memory.run",)),  # a training run's machinery: checkpoints, resume, the monitor, predictions written
    ("runtime", ("lit_memory",)),  # model, data, strategies, Fabric
    ("memory above the runtime", ("lit_memory.planning",)),  # predictions and plans: they build the configured model
    ("config", ("lit_memory.config", "lit_memory.cli", "lit_memory.fine_tune")),  # from argv to a checked run, told
    ("tools", ("lit_memory.tools", "lit_memory.confine")),  # the tools; a sent recipe's run, confined
    ("entry", ("lit_memory.__main__",)),  # python -m lit_memory
)


def layer_of(module: str) -> int:
    """The index in `LAYERS` of a module of this package."""
    best, found = -1, 0
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    return found


# `lit_memory.<name>` for YAML class paths (and `from lit_memory import <name>`), imported on first use: `import
# lit_memory.errors` must not pull in Lightning and transformers.
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
