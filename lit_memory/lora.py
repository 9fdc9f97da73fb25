"""LoRA adapters through peft: the encoder is frozen, low-rank adapters and the head train.

Memory (per the seed's accounting, K frozen + N trainable parameters): weights K+N, gradients N,
AdamW state 2N. The adapters are merged into the weights before saving, so the exported model is
a plain transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class LoRA:
    """LoRA settings (`model.lora` in YAML).

    Args:
        rank: rank of each adapter's two matrices.
        alpha: scaling; the update is multiplied by alpha / rank.
        dropout: dropout on the adapter's input.
        target_modules: names of the linear layers that get adapters (BERT: query, key, value, dense).
    """

    rank: int = 8
    alpha: int = 16
    dropout: float = 0.1
    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])


def apply_lora(model: nn.Module, lora: LoRA) -> nn.Module:
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,  # peft then also trains the classifier head in full (modules_to_save)
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
    )
    return get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)
