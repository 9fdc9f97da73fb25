"""The bundled architectures of other families: published configs with a byte-level stand-in tokenizer that
loads offline, pads with the family's pad token and wraps texts in its special tokens at their real ids."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from lit_memory import bundled
from lit_memory.model import SequenceClassifier
from lit_memory.tokenizing import load_tokenizer

# name -> (parameters of the sequence classifier, word embedding rows, first and last special id of a text)
PUBLISHED = {
    "modernbert-large": (395.8e6, 50368, (50281, 50282)),
    "deberta-v3-large": (435.1e6, 128100, (1, 2)),
    "xlm-roberta-large": (559.9e6, 250002, (0, 2)),
    "qwen3-0.6b": (596.1e6, 151936, None),  # a decoder: no special tokens around a text
}


@pytest.mark.parametrize("name", bundled.FAMILY_ASSETS)
def test_a_bundled_family_is_its_published_architecture_with_a_tiny_offline_tokenizer(name):
    folder = bundled.ASSETS / name
    assert sum(f.stat().st_size for f in folder.iterdir()) < 20_000  # no multi-MB vocabulary
    params, rows, wrap = PUBLISHED[name]
    config = AutoConfig.from_pretrained(bundled.resolve_model(f"bundled:{name}"), num_labels=2)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=1e-3)
    assert model.get_input_embeddings().num_embeddings == rows
    tokenizer = load_tokenizer(f"bundled:{name}")
    ids = tokenizer(["héllo wörld", "hi"], padding=True)["input_ids"]
    assert all(0 <= i < rows for row in ids for i in row)
    assert ids[1][-1] == tokenizer.pad_token_id  # padded on the right
    if wrap is not None:
        assert (ids[0][0], ids[0][-1]) == wrap
    assert len(ids[0]) == len("héllo wörld".encode()) + (2 if wrap else 0)  # a token per UTF-8 byte
    # the model's pad token is the tokenizer's (Qwen3's config has none: <|endoftext|> from its tokenizer)
    module = SequenceClassifier(model_name_or_path=f"bundled:{name}", pretrained=False)
    assert module.hf_config.pad_token_id == tokenizer.pad_token_id
