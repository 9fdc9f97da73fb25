"""LoRA adapters through peft: the body is frozen, low-rank adapters and the head train.

Memory (per the seed's accounting, K frozen + N trainable parameters): weights K+N, gradients N,
AdamW state 2N. The adapters are merged into the weights before saving, so the exported model is
a plain transformers model.

The frozen base (``base``) is held as the trained weights are (the trainer precision's dtype: fp32 under
``32-true`` and ``bf16-mixed``), in bf16 (2 B per weight, for a run that computes in bf16), or, QLoRA, with the
layers' linear weights in 4-bit NF4 (`lit_memory.hf.qlora`). The adapters and the head train in full precision
whatever the base's dtype (peft upcasts 16-bit adapters; the head is cast here).

Which layers get adapters (`lora_targets`) and which head parts train in full come from the model's
anatomy (`lit_memory.hf.anatomy`), not from BERT's names: peft's own per-architecture defaults where
it has them (``query``/``value`` for BERT, ``query_proj``/``value_proj`` for DeBERTa-v2/v3,
``c_attn`` for GPT-2, ``q_proj``/``v_proj`` for Llama, Qwen3, Gemma3), the attention block's
projections otherwise (DistilBERT's ``q_lin``..., ModernBERT's ``Wqkv``/``Wo``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, Optional, Union

import torch
from torch import nn

from lit_memory.errors import UserError
from lit_memory.hf.anatomy import Anatomy, linear_types
from lit_memory.settings import Precision

Base = Optional[Literal["bf16", "nf4"]]
BASES = ("bf16", "nf4")

_ATTENTION = re.compile(r"attn|attention", re.IGNORECASE)


@dataclass
class LoRA:
    """LoRA settings (`model.lora` in YAML).

    Args:
        rank: rank of each adapter's two matrices.
        alpha: scaling; the update is multiplied by alpha / rank.
        dropout: dropout on the adapter's input.
        target_modules: names of the linear layers that get adapters (a name matches a module whose
            name is it or ends in ``.`` + it); ``null``: the family's default (`lora_targets`).
        base: how the frozen base is held: ``null`` as the trained weights (the precision's dtype); ``bf16``
            2 B per weight (a run that computes in bf16: ``bf16-mixed``); ``nf4`` QLoRA, the layers' linear weights
            in 4-bit NormalFloat with double quantisation (bitsandbytes, about 0.52 B per weight), the rest of the
            base as the trained weights (``32-true`` or ``bf16-mixed``: the adapters and head train in fp32).
    """

    rank: int = 8
    alpha: int = 16
    dropout: float = 0.1
    target_modules: Optional[list[str]] = None
    base: Base = None

    def check(self) -> "LoRA":
        """One line for a value peft would refuse mid-build or take silently (the module calls it: raised
        while jsonargparse parses, it would become that parser's union message)."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise UserError(f"model.lora.rank must be a whole number >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise UserError(f"model.lora.alpha must be a number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise UserError(f"model.lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.base is not None and self.base not in BASES:
            raise UserError(f"model.lora.base {self.base!r} is not one of: null, {', '.join(BASES)}")
        return self

    @property
    def quantised(self) -> bool:
        """QLoRA: the base's linear weights in 4 bits."""
        return self.base == "nf4"

    def check_precision(self, precision: Precision) -> None:
        """One `UserError` line for a base the precision cannot train with: a bf16 base under a precision that
        computes in fp32 (its bf16 outputs would meet the fp32 head), a 4-bit base under a precision that casts every
        weight to 16 bits (``-true``: the adapters and head would train in 16 bits, and bitsandbytes' packed weights
        cannot be cast)."""
        if self.base == "bf16" and precision.compute != torch.bfloat16:
            raise UserError(
                f"model.lora.base bf16 holds the frozen base in bf16, which computes in bf16: trainer.precision "
                f"{precision} computes in {str(precision.compute).removeprefix('torch.')}; use bf16-mixed, or "
                "model.lora.base null"
            )
        if self.quantised and precision.half_weights:
            raise UserError(
                "model.lora.base nf4 (QLoRA) trains its adapters and head in fp32 over the 4-bit base: "
                "trainer.precision "
                f"{precision} would cast every weight to 16 bits; use bf16-mixed (bf16 compute) or 32-true"
            )

    def frozen_dtype(self, trained: torch.dtype) -> torch.dtype:
        """The dtype of the frozen base's weights that are not 4-bit, the trained weights being ``trained``."""
        return torch.bfloat16 if self.base == "bf16" else trained


def family_targets(anatomy: Anatomy) -> Union[list[str], str]:
    """peft's default targets for the family (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, by
    ``model_type``), else every linear layer inside the first transformer layer's attention block."""
    # deferred: peft is heavy (~1.5 s); only LoRA runs need it
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    known = PEFT_DEFAULTS.get(anatomy.family)
    if known is not None:
        return known if isinstance(known, str) else list(known)
    found = []
    for name, module in anatomy.layers[0].named_modules():
        path = name.split(".")
        if isinstance(module, linear_types()) and any(_ATTENTION.search(part) for part in path[:-1]):
            found.append(path[-1])
    return list(dict.fromkeys(found))


def lora_targets(anatomy: Anatomy, lora: LoRA) -> Union[list[str], str]:
    """The ``target_modules`` to give peft: the configured ones, or the family's; one `UserError` line
    naming the model's linear layers if they match none of its modules (peft would raise a 20-frame
    error after the run folder exists)."""
    targets = list(lora.target_modules) if lora.target_modules else family_targets(anatomy)
    if isinstance(targets, str):  # a regular expression from peft's table: peft matches it in full
        names = [name for name, _ in anatomy.model.named_modules()]
        matched = any(re.fullmatch(targets, name) for name in names)
    else:
        adaptable = linear_types() + (nn.Embedding, nn.Conv1d, nn.Conv2d)  # what peft's LoRA can adapt
        names = [name for name, m in anatomy.model.named_modules() if isinstance(m, adaptable)]
        matched = any(name == t or name.endswith("." + t) for name in names for t in targets)
    if not matched:
        shown = "none found" if not targets else ", ".join(targets) if isinstance(targets, list) else targets
        raise UserError(
            f"model.lora.target_modules ({shown}) match no layer of {type(anatomy.model).__name__}; its linear "
            f"layers are: {', '.join(anatomy.linear_names)}"
        )
    return targets


def apply_lora(model: nn.Module, lora: LoRA, trained: Optional[torch.dtype] = None) -> nn.Module:
    """``model`` with LoRA adapters on `lora_targets`; the head parts a fine-tune initialises
    (`Anatomy.head`: classifier, DeBERTa's pooler, a decoder's score) train in full, in ``trained`` (the trained
    weights' dtype) where given, whatever the base's."""
    from peft import LoraConfig, TaskType, get_peft_model  # deferred: peft is heavy; only LoRA runs need it

    anatomy = Anatomy.of(model)
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_targets(anatomy, lora),
        modules_to_save=list(anatomy.head_names),
    )
    model = get_peft_model(model, config)  # (adapters in 16 bits are upcast to fp32: autocast_adapter_dtype)
    if trained is not None:
        for param in model.parameters():
            if param.requires_grad and param.dtype != trained:
                param.data = param.data.to(trained)
    return model


def is_lora(model: nn.Module) -> bool:
    from peft import PeftModel  # deferred: peft is heavy; only LoRA runs need it

    return isinstance(model, PeftModel)
