"""A trained `lit_memory.model.SequenceClassifier` saved as a plain Hugging Face folder (``hf_model/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import nn

from lit_memory import files
from lit_memory.hf import qlora
from lit_memory.hf.config import dtype_name, quiet_transformers
from lit_memory.hf.lora import is_lora
from lit_memory.hf.tokenizing import load_tokenizer
from lit_memory.run import model_card
from lit_memory.task import thresholds as thresholds_


def dtype_words(module: Any) -> str:
    """The dtype ``hf_model/`` is saved in, and why: ``bf16 (the checkpoint's dtype; trained in fp32)``."""
    saved, trained = dtype_name(module.export_dtype), dtype_name(module.weights_dtype)
    setting = module.hparams.save_dtype
    why = "model.save_dtype" if setting != "checkpoint" else (
        "the checkpoint's dtype" if module.checkpoint_dtype is not None else "the checkpoint names none: as trained"
    )
    if module.lora is not None and module.lora.quantised:
        trained += " adapters and head over a 4-bit base, merged into it dequantised"
    return f"{saved} ({why}{'' if saved == trained else f'; trained in {trained}'})"


def export_pretrained(module: Any, path: Path, trainer: Any) -> None:
    """Save the module's model and tokenizer so ``AutoModelForSequenceClassification.from_pretrained(path)`` loads it
    (``trainer``: the module's, or None)."""
    sharded = is_sharded(module.model)
    if is_lora(module.model) and not sharded:  # training is over: fold the adapters into the weights
        # a 4-bit base: into its weights dequantised (peft would requantise the sum)
        with quiet_transformers():  # its line on dequantising: said in the hf_model line
            module.model = (qlora.merged(module.model) if qlora.has_quantised_base(module.model)
                            else module.model.merge_and_unload())
    state = full_state_dict(module.model)  # a collective under sharding: every rank calls it
    run_dir = (trainer.log_dir or trainer.default_root_dir) if trainer is not None else None  # every rank asks
    _save_on_rank_zero(module, trainer, path, state, sharded, run_dir)
    if trainer is not None:
        trainer.strategy.barrier("export_pretrained")


@rank_zero_only
def _save_on_rank_zero(module: Any, trainer: Any, path: Path, state: dict[str, torch.Tensor], sharded: bool,
                       run_dir: Optional[str]) -> None:
    model = module.model
    if is_lora(model) and sharded:
        # peft cannot merge FSDP2's sharded (DTensor) weights: merge a plain copy of the gathered state.
        model = module.build_model(pretrained=False)
        model.load_state_dict(state)
        model = model.merge_and_unload()
        state = model.state_dict()
    module.name_classes(model.config)
    dtype = module.export_dtype
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    built = model.config.dtype
    found = module.decision_thresholds
    if found is not None:  # read back when the module starts from this folder (predict)
        setattr(model.config, thresholds_.CONFIG_KEY, found.to_config(module.label_names, module.kind))
    elif hasattr(model.config, thresholds_.CONFIG_KEY):  # a base folder's, stale
        delattr(model.config, thresholds_.CONFIG_KEY)
    card = model_card.build(module, trainer, Path(run_dir) if run_dir else None)
    with quiet_transformers(), files.replacing_folder(path) as folder:  # whole, never through a link
        files.write_text(Path(folder) / "README.md", card)
        model.save_pretrained(folder, state_dict=state)
        # save_pretrained names the module's own dtype in config.json: name the one saved, which from_pretrained's
        # dtype="auto" then loads in
        model.config.dtype = dtype
        try:
            model.config.save_pretrained(folder)
        finally:
            model.config.dtype = built
        tokenizer = load_tokenizer(module.tokenizer_name_or_path)
        # Written from the tokenizer the run uses, nothing more: a classifier has no use for a chat template, and a
        # sent folder's (a link to a private file, once) is not copied into what the user shares.
        tokenizer.chat_template = None
        tokenizer.save_pretrained(folder)


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 has sharded the model (its parameters are DTensors)."""
    from torch.distributed.tensor import DTensor  # deferred: about 1 s to import; only sharded runs have them

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU, gathering shards when parameters are DTensors (FSDP2)."""
    if is_sharded(model):
        # deferred: torch's distributed checkpointing, for sharded models only
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}
