"""Values and bounds: settings a sent recipe may not have whatever they point at (code from elsewhere, a remote
location, a Hugging Face loading option) and `BOUNDS`, the rows of settings that can take the machine down however
little the run trains.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Optional

from jsonargparse import Namespace

from lit_memory.policy.checkpoints import MAX_KEPT_CHECKPOINTS, MIN_CHECKPOINT_STEPS
from lit_memory.policy.code import code_refusals
from lit_memory.policy.reads import is_remote
from lit_memory.policy.refusal import NOTHING, Context, Refusal, register

# Hugging Face loading options that `model.config_overrides` would hand to `from_pretrained` along with
# the config's attributes: where to download from and to, what code to run.
HF_LOADING_OPTIONS = frozenset({
    "trust_remote_code", "cache_dir", "proxies", "token", "use_auth_token", "revision", "code_revision",
    "subfolder", "force_download", "local_files_only", "gguf_file", "user_agent",
})
MIN_CHECKPOINT_SECONDS = 60
MAX_LENGTH = 131072  # tokens: the longest context of the families lit_memory knows


def _seconds(value: Any) -> Optional[float]:
    """A ``train_time_interval`` as jsonargparse leaves it (a timedelta, or its fields), in seconds."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (dict, Namespace)):
        try:
            return datetime.timedelta(**dict(value)).total_seconds()
        except TypeError:
            return None
    return None


def _cpus() -> int:
    return os.cpu_count() or 1


def _device_count(devices: Any) -> Optional[int]:
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int):
        return devices
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        return int(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, (list, tuple)):
        return len(devices)
    return None  # "auto", -1: Lightning picks what the machine has


# (key's last part, refused when, reason): settings that can take the machine down however little
# the run trains. Checked wherever the key appears (a ModelCheckpoint's, a subclass's).
BOUNDS: tuple[tuple[str, Callable[[Any], bool], Callable[[Any], str]], ...] = (
    ("num_workers", lambda v: isinstance(v, int) and v > _cpus(),
     lambda v: f"more DataLoader worker processes than this machine's {_cpus()} CPU cores"),
    ("every_n_train_steps", lambda v: isinstance(v, int) and 0 < v < MIN_CHECKPOINT_STEPS,
     lambda v: f"a checkpoint more often than every {MIN_CHECKPOINT_STEPS} optimizer steps"),
    ("save_top_k", lambda v: isinstance(v, int) and (v < 0 or v > MAX_KEPT_CHECKPOINTS),
     lambda v: f"keeps {'every' if v < 0 else v} checkpoint{'s' if v != 1 else ''}, more than {MAX_KEPT_CHECKPOINTS}"),
    ("max_length", lambda v: isinstance(v, int) and v > MAX_LENGTH,
     lambda v: f"sequences of more than {MAX_LENGTH} tokens (memory while tokenising and padding grows with it)"),
    ("train_time_interval", lambda v: _seconds(v) is not None and _seconds(v) < MIN_CHECKPOINT_SECONDS,
     lambda v: f"a checkpoint more often than every {MIN_CHECKPOINT_SECONDS} seconds"),
)


@register("parse")
def values(context: Context) -> list[Refusal]:
    """Settings (one subcommand's) that need ``--trust-recipe`` whatever they point at, and the `BOUNDS`."""
    code = code_refusals(context.get("model.config_overrides"))  # listed by `lit_memory.policy.code.settings`
    refusals: list[Refusal] = []
    for key, value in context.leaves():
        name = key.rsplit(".", 1)[-1]
        parent = key.rsplit(".", 2)[-2] if key.count(".") else ""
        if name == "trust_remote_code" and value:
            refusals.append(Refusal(key, value, "it runs Python files shipped with the model or tokenizer", safe=False))
        elif key == "weights_only" and value is not True:
            refusals.append(Refusal(key, value, "unpickling a checkpoint runs any code it names", safe=True))
        elif parent == "config_overrides" and name == "auto_map":
            refusals.append(Refusal(key, value,
                                    "it names Python code to load the model with (for whoever loads its export)"))
        elif any(_under_key(key, r.key) for r in code):
            continue  # inside a refused config override (a quantization config's fields)
        elif parent == "config_overrides" and name != "trust_remote_code" and (
                name in HF_LOADING_OPTIONS or name[:1] == "_"):
            refusals.append(Refusal(key, value, "a Hugging Face loading option, not a model setting"))
        elif isinstance(value, str) and is_remote(value) and key != "ckpt_path":
            refusals.append(Refusal(key, value, "it names a remote location: a recipe may name local files only "
                                                "(nothing is fetched from or sent to where it says)"))
        for bound, refused, reason in BOUNDS:
            if name == bound and refused(value):
                refusals.append(Refusal(key, value, reason(value)))
    return refusals


@register("parse")
def devices(context: Context) -> list[Refusal]:
    """A process per CPU device: no more than this machine's cores."""
    devices = context.get("trainer.devices")
    if (_device_count(devices) or 0) > _cpus() and _on_cpu(context.get("trainer.accelerator")):
        return [Refusal("trainer.devices", devices, f"a process per CPU device, more than this machine's {_cpus()} "
                                                    "cores")]
    return []


# Settings a batch-size finder may scale (`batch_arg_name`) that the bounds hold for the whole run.
BOUNDED_DURING_RUN = ("num_workers", "max_length")


@register("run")
def scaled_bounds(context: Context) -> list[Refusal]:
    """A batch-size finder told to scale a bounded setting would take it past its bound during the run. From the
    settings alone; in the running process the data module refuses the value it is changed to
    (`lit_memory.data.TextClassificationData`)."""
    if context.trainer is not None:
        return []
    return [Refusal(key, NOTHING, f"{value!r} would be scaled during the run past the bound that holds for "
                                  f"data.{value}")
            for key, value in context.leaves() if key.endswith(".batch_arg_name") and value in BOUNDED_DURING_RUN]


def _under_key(key: str, parent: str) -> bool:
    return key == parent or key.startswith(parent + ".")


def _on_cpu(accelerator: Any) -> bool:
    """Whether Lightning would run on CPU processes (on GPUs it refuses more devices than exist)."""
    if isinstance(accelerator, str) and accelerator not in ("auto", "cpu"):
        return False
    if accelerator == "cpu":
        return True
    import torch  # here: this module is imported before torch

    return not torch.cuda.is_available()
