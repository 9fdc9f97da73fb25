"""LoRA adapters through peft: the body is frozen, low-rank adapters and the head train.

Memory (per the seed's accounting, K frozen + N trainable parameters): weights K+N, gradients N,
AdamW state 2N. The adapters are merged into the weights before saving, so the exported model is
a plain transformers model.

Which layers get adapters (`lora_targets`) and which head parts train in full come from the model's
anatomy (`lit_memory.anatomy`), not from BERT's names: peft's own per-architecture defaults where
it has them (``query``/``value`` for BERT, ``query_proj``/``value_proj`` for DeBERTa-v2/v3,
``c_attn`` for GPT-2, ``q_proj``/``v_proj`` for Llama, Qwen3, Gemma3), the attention block's
projections otherwise (DistilBERT's ``q_lin``..., ModernBERT's ``Wqkv``/``Wo``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Union

from torch import nn

from lit_memory.anatomy import Anatomy, linear_types
from lit_memory.errors import UserError

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
    """

    rank: int = 8
    alpha: int = 16
    dropout: float = 0.1
    target_modules: Optional[list[str]] = None

    def check(self) -> "LoRA":
        """One line for a value peft would refuse mid-build or take silently (the module calls it: raised
        while jsonargparse parses, it would become that parser's union message)."""
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise UserError(f"model.lora.rank must be a whole number >= 1, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise UserError(f"model.lora.alpha must be a number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise UserError(f"model.lora.dropout must be in [0, 1), got {self.dropout!r}")
        return self


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


def apply_lora(model: nn.Module, lora: LoRA) -> nn.Module:
    """``model`` with LoRA adapters on `lora_targets`; the head parts a fine-tune initialises
    (`Anatomy.head`: classifier, DeBERTa's pooler, a decoder's score) train in full."""
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
    return get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    from peft import PeftModel  # deferred: peft is heavy; only LoRA runs need it

    return isinstance(model, PeftModel)
