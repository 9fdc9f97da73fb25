"""The bundled architectures of other families: published configs with a byte-level stand-in tokenizer that
loads offline, pads with the family's pad token and wraps texts in its special tokens at their real ids."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from lit_memory.hf import bundled
from lit_memory.hf.tokenizing import load_tokenizer
from lit_memory.model import SequenceClassifier

# name -> (parameters of the sequence classifier, word embedding rows, first and last special id of a text, the
# checkpoint's dtype its published config names). Parameters as the model cards give them: Qwen3 0.6B / 1.7B / 4.0B
# (0.44 / 1.4 / 3.6B without embeddings), Llama 3.2 1.23B / 3.21B, Gemma 3 1B 1.00B (999,885,952: keras-hub's preset).
PUBLISHED = {
    "modernbert-large": (395.8e6, 50368, (50281, 50282), torch.float32),
    "deberta-v3-large": (435.1e6, 128100, (1, 2), None),
    "xlm-roberta-large": (559.9e6, 250002, (0, 2), None),
    "qwen3-0.6b": (596.1e6, 151936, None, torch.bfloat16),  # a decoder: no special tokens around a text
    "qwen3-1.7b": (1720.6e6, 151936, None, torch.bfloat16),
    "qwen3-4b": (4022.5e6, 151936, None, torch.bfloat16),
    "llama-3.2-1b": (1235.8e6, 128256, (128000, None), torch.bfloat16),  # <|begin_of_text|> first, nothing after
    "llama-3.2-3b": (3212.8e6, 128256, (128000, None), torch.bfloat16),
    "gemma-3-1b": (999.9e6, 262144, (2, None), torch.bfloat16),  # <bos> first
}


@pytest.mark.parametrize("name", bundled.FAMILY_ASSETS)
def test_a_bundled_family_is_its_published_architecture_with_a_tiny_offline_tokenizer(name):
    folder = bundled.ASSETS / name
    assert sum(f.stat().st_size for f in folder.iterdir()) < 20_000  # no multi-MB vocabulary
    params, rows, wrap, dtype = PUBLISHED[name]
    config = AutoConfig.from_pretrained(bundled.resolve_model(f"bundled:{name}"), num_labels=2)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=1e-3)
    assert model.get_input_embeddings().num_embeddings == rows
    tokenizer = load_tokenizer(f"bundled:{name}")
    ids = tokenizer(["héllo wörld", "hi"], padding=True)["input_ids"]
    assert all(0 <= i < rows for row in ids for i in row)
    assert ids[1][-1] == tokenizer.pad_token_id  # padded on the right
    added = 0
    if wrap is not None:
        assert ids[0][0] == wrap[0] and (wrap[1] is None or ids[0][-1] == wrap[1])
        added = sum(w is not None for w in wrap)
    assert len(ids[0]) == len("héllo wörld".encode()) + added  # a token per UTF-8 byte
    assert config.dtype == dtype  # what transformers would load the checkpoint in (lit_memory: the recipe's dtype)
    # the model's pad token is the tokenizer's (Qwen3's config has none: <|endoftext|> from its tokenizer)
    module = SequenceClassifier(model_name_or_path=f"bundled:{name}", pretrained=False)
    assert module.hf_config.pad_token_id == tokenizer.pad_token_id
