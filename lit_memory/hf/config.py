"""A Hugging Face config loaded through `lit_memory.sandbox.guard` (head size, problem type, class names, pad token),
and transformers' loading messages said in our words."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from transformers import AutoConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from lit_memory import task as task_
from lit_memory.errors import UserError
from lit_memory.hf import bundled
from lit_memory.hf.tokenizing import pad_token_id
from lit_memory.sandbox import guard


def load_config(
    name_or_path: str, num_labels: Optional[int], overrides: Optional[dict[str, Any]] = None,
    kind: Optional[task_.ProblemKind] = None,
):
    """The Hugging Face config with the head's size and problem type (``kind``'s name): those given, else the config's
    own (a fine-tuned folder's), else transformers' rule (one output: regression; else single-label)."""
    path = bundled.resolve_model(name_or_path)
    if not str(name_or_path).startswith("bundled:"):  # untrusted: the folder's files, before transformers reads them
        guard.check_model_folder(path, f"model {name_or_path!r}")
    given = {"num_labels": num_labels} if num_labels is not None else {}
    fixed = kind.fixed_outputs() if kind is not None else None
    if fixed is not None:
        given["num_labels"] = fixed
    try:
        config = guard.call(
            AutoConfig.from_pretrained, f"model config {name_or_path!r}", path, **given, **(overrides or {})
        )
    except OSError as err:
        raise UserError(f"cannot load model config {name_or_path!r}: {str(err).splitlines()[0]}") from err
    guard.check_config(config)  # untrusted: no kernels from the Hub, no quantizer, a model a machine can build
    config.problem_type = task_.head_kind(kind, getattr(config, "problem_type", None), config.num_labels).name
    return config


# The dtypes a model's weights are made or saved in, by the short names settings use (`SequenceClassifier.save_dtype`).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# safetensors' names of the floating dtypes (a file's header, where the config names none).
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's short name (`DTYPES`), else torch's (``float64``)."""
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def saved_dtype(config, name_or_path: str) -> Optional[torch.dtype]:
    """The dtype the checkpoint's weights were saved in: what its config names (``dtype``; ``torch_dtype`` in older
    files), else, for a local folder, the first floating tensor's in its safetensors header (what transformers'
    ``dtype="auto"`` reads); None where neither says (a hub name whose config names none, pickled weights only).
    Read before the model is built: transformers writes the dtype it builds in over the config's."""
    named = getattr(config, "dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    if isinstance(named, torch.dtype):
        return named
    folder = Path(bundled.resolve_model(name_or_path))
    weights = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not weights:
        return None
    from safetensors import safe_open  # deferred: only a folder whose config names no dtype is read

    with safe_open(str(weights[0]), "pt") as f:  # the header only: no tensor is read
        for key in f.keys():
            found = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
            if found is not None:
                return found
    return None


def config_label_names(config) -> Optional[list[str]]:
    """The class names a Hugging Face config holds (a fine-tuned folder's id2label), or None where it holds
    transformers' defaults (``LABEL_<id>``) or another number of classes."""
    id2label = {int(i): str(name) for i, name in (getattr(config, "id2label", None) or {}).items()}
    names = [id2label.get(i) for i in range(config.num_labels)]
    if None in names or all(name == f"LABEL_{i}" for i, name in enumerate(names)):
        return None
    return names


def label_names_or_default(names: Optional[list[str]], num_labels: int) -> list[str]:
    """One name per class id: the given names, then transformers' default (``LABEL_<id>``) for ids beyond them."""
    names = list(names or [])
    return names + [f"LABEL_{i}" for i in range(len(names), num_labels)]


def set_pad_token(config, tokenizer_name_or_path: str) -> None:
    """A model without a pad token (most decoders: GPT-2, Llama, Qwen3) gets the tokenizer's, which is
    its EOS where it has none either (`lit_memory.hf.tokenizing.load_tokenizer`): the data is padded with it,
    and a decoder's classifier finds each sequence's last token as the last one that is not it. A folder without
    a tokenizer (a config.json alone, for ``estimate``/``plan``) gets the config's EOS by the same rule."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "pad_token_id", None) is not None:
        return
    try:
        pad = pad_token_id(tokenizer_name_or_path)
    except UserError:  # no tokenizer (a config-only folder): the data module says so when it needs one; its EOS
        eos = getattr(text, "eos_token_id", None)  # meanwhile, as the tokenizer's rule has it, so a decoder's
        pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos  # classifier builds and runs (memory work)
        if not isinstance(pad, int):
            return
    for part in {id(config): config, id(text): text}.values():
        part.pad_token_id = pad


@contextlib.contextmanager
def quiet_transformers():
    """transformers' loading/saving reports and progress bars off, for calls whose outcome we report ourselves."""
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def report_loading(model: PreTrainedModel, loading: dict[str, Any], new_head_line: bool = True) -> None:
    """One line for what every fine-tune expects (a new classification head; not where a checkpoint loaded next
    replaces it), a warning for anything else."""
    head = {name for name, _ in model.named_children() if name != model.base_model_prefix}
    missing = sorted(loading["missing_keys"])
    new_head = [key for key in missing if key.split(".")[0] in head]
    if new_head and new_head_line:
        rank_zero_info(f"classifier head initialised: {model.config.num_labels} labels ({', '.join(new_head)})")
    surprises = {
        "not in the checkpoint, initialised at random": sorted(set(missing) - set(new_head)),
        "in the checkpoint but not in the model, ignored": sorted(loading["unexpected_keys"]),
        "of another shape in the checkpoint, initialised at random": sorted(map(str, loading["mismatched_keys"])),
    }
    for what, keys in surprises.items():
        if keys:
            rank_zero_warn(f"{len(keys)} weight(s) {what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")
