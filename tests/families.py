"""Tiny random sequence classifiers of every family lit_memory supports, built offline from small configs
(hidden 32, 2 layers, a 300-token vocabulary), and a folder per family (config + byte-level tokenizer)
for end-to-end runs. Shared by the tests of the modules that act on a model's parts."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from lit_memory.hf.bundled import write_byte_tokenizer

VOCAB = 300  # the byte tokenizer's 256 bytes and its special tokens fit
_ENCODER = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": VOCAB,
}
_CLS = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3}
_CLS_ROLES = {"pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]"}
_ROBERTA = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
_ROBERTA_ROLES = {
    "bos_token": "<s>",
    "pad_token": "<pad>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "cls_token": "<s>",
    "sep_token": "</s>",
}
_DEBERTA = {
    **_ENCODER, "max_position_embeddings": 64, "relative_attention": True, "pos_att_type": ["p2c", "c2p"],
    "position_biased_input": False, "position_buckets": 16, "max_relative_positions": -1, "share_att_key": True,
    "norm_rel_ebd": "layer_norm", "type_vocab_size": 0, "pad_token_id": 0,
}
# family -> (model_type, config, the tokenizer's special tokens and their roles, what wraps a sequence)
FAMILIES = {
    "bert": (
        "bert",
        {**_ENCODER, "max_position_embeddings": 64, "pad_token_id": 0},
        _CLS,
        _CLS_ROLES,
        ["[CLS]"],
        ["[SEP]"],
    ),
    "roberta": (
        "roberta",
        {**_ENCODER, "max_position_embeddings": 66, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
        _ROBERTA,
        _ROBERTA_ROLES,
        ["<s>"],
        ["</s>"],
    ),
    "xlm-roberta": (
        "xlm-roberta",
        {
            **_ENCODER,
            "max_position_embeddings": 66,
            "type_vocab_size": 1,
            "pad_token_id": 1,
            "bos_token_id": 0,
            "eos_token_id": 2,
        },
        _ROBERTA,
        _ROBERTA_ROLES,
        ["<s>"],
        ["</s>"],
    ),
    "electra": (
        "electra",
        {**_ENCODER, "embedding_size": 16, "max_position_embeddings": 64, "pad_token_id": 0},
        _CLS,
        _CLS_ROLES,
        ["[CLS]"],
        ["[SEP]"],
    ),
    "distilbert": (
        "distilbert",
        {
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "hidden_dim": 64,
            "vocab_size": VOCAB,
            "max_position_embeddings": 64,
            "pad_token_id": 0,
        },
        _CLS,
        _CLS_ROLES,
        ["[CLS]"],
        ["[SEP]"],
    ),
    # v2: relative attention with a convolution beside the first layer; v3: without it
    "deberta-v2": (
        "deberta-v2",
        {**_DEBERTA, "conv_kernel_size": 3, "conv_act": "gelu"},
        _CLS,
        _CLS_ROLES,
        ["[CLS]"],
        ["[SEP]"],
    ),
    "deberta-v3": ("deberta-v2", _DEBERTA, _CLS, _CLS_ROLES, ["[CLS]"], ["[SEP]"]),
    "modernbert": (
        "modernbert",
        {
            **_ENCODER,
            "max_position_embeddings": 64,
            "global_attn_every_n_layers": 2,
            "local_attention": 16,
            "pad_token_id": 0,
            "cls_token_id": 1,
            "sep_token_id": 2,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        _CLS,
        _CLS_ROLES,
        ["[CLS]"],
        ["[SEP]"],
    ),
    # as GPT-2: no pad token anywhere (lit_memory falls back to EOS)
    "gpt2": (
        "gpt2",
        {
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 64,
            "vocab_size": VOCAB,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
        {"<|endoftext|>": 0},
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
        [],
        [],
    ),
    # as Qwen3: the tokenizer has a pad token, the config none
    "qwen3": (
        "qwen3",
        {**_ENCODER, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64, "eos_token_id": 1},
        {"<|endoftext|>": 0, "<|im_end|>": 1},
        {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"},
        [],
        [],
    ),
    # as Llama: no pad token anywhere; the tokenizer adds BOS
    "llama": (
        "llama",
        {**_ENCODER, "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 1},
        {"<s>": 0, "</s>": 1},
        {"bos_token": "<s>", "eos_token": "</s>"},
        ["<s>"],
        [],
    ),
    # a scaled word embedding, sliding-window and global layers
    "gemma3": (
        "gemma3_text",
        {
            **_ENCODER,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 64,
            "sliding_window": 8,
            "pad_token_id": 0,
            "bos_token_id": 2,
            "eos_token_id": 1,
        },
        {"<pad>": 0, "<eos>": 1, "<bos>": 2},
        {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>"},
        ["<bos>"],
        [],
    ),
}
DECODERS = ["gpt2", "qwen3", "llama", "gemma3"]
ENCODERS = [f for f in FAMILIES if f not in DECODERS]


def config(family: str, num_labels: int = 2, **overrides):
    model_type, settings = FAMILIES[family][:2]
    return AutoConfig.for_model(model_type, **{**settings, "num_labels": num_labels, **overrides})


def model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config(family, **overrides)).train()


def folder(family: str, root: Path, **overrides) -> Path:
    """config.json and a byte-level tokenizer of the family, for ``--model.model_name_or_path``."""
    path = root / family
    config(family, **overrides).save_pretrained(path)
    _, _, specials, roles, prefix, suffix = FAMILIES[family]
    write_byte_tokenizer(path, specials, roles, prefix, suffix)
    return path


def batch(family: str, batch_size: int = 4, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids above the special tokens, no padding, with labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 250, (batch_size, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.arange(batch_size) % 2}
