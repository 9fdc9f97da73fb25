"""The Hugging Face config as a run loads it: head size, problem type, class names, pad token, loading messages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from lit_memory.errors import UserError
from lit_memory.hf.config import (
    config_label_names,
    label_names_or_default,
    load_config,
    quiet_transformers,
    report_loading,
    set_pad_token,
)
from lit_memory.hf.tokenizing import pad_token_id
from lit_memory.task import kind_of

TINY_BERT = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


def test_the_head_size_and_problem_type_follow_what_is_given_else_transformers_rule():
    assert load_config("bundled:minilm", 3).problem_type == "single_label_classification"
    one = load_config("bundled:minilm", 1)
    assert (one.num_labels, one.problem_type) == (1, "regression")
    regression = load_config("bundled:minilm", None, kind=kind_of("regression"))
    assert regression.num_labels == 1  # regression predicts one value
    multi = load_config("bundled:minilm", 4, kind=kind_of("multi_label_classification"))
    assert (multi.num_labels, multi.problem_type) == (4, "multi_label_classification")
    assert load_config("bundled:bert-large", 2, TINY_BERT).num_hidden_layers == 1  # overrides


def test_a_model_that_cannot_be_found_is_one_line():
    with pytest.raises(UserError, match="unknown bundled model 'bundled:gpt'"):
        load_config("bundled:gpt", 2)
    with pytest.raises(UserError, match="^cannot load model config 'no/such-model-here'") as error:
        load_config("no/such-model-here", 2)
    assert "\n" not in str(error.value)


def test_class_names_are_the_configs_own_unless_transformers_defaults():
    config = load_config("bundled:minilm", 2)
    assert config_label_names(config) is None  # LABEL_0, LABEL_1
    config.id2label = {0: "negative", 1: "positive"}
    assert config_label_names(config) == ["negative", "positive"]
    assert config_label_names(SimpleNamespace(num_labels=3, id2label={0: "a", 1: "b"})) is None  # another count
    assert label_names_or_default(["a"], 3) == ["a", "LABEL_1", "LABEL_2"]
    assert label_names_or_default(None, 2) == ["LABEL_0", "LABEL_1"]


def test_a_config_without_a_pad_token_takes_the_tokenizers():
    config = load_config("bundled:minilm", 2)
    config.pad_token_id = None
    set_pad_token(config, "bundled:minilm")
    assert config.pad_token_id == pad_token_id("bundled:minilm") is not None
    config.pad_token_id = 7
    set_pad_token(config, "bundled:minilm")
    assert config.pad_token_id == 7  # its own is kept


def test_quiet_transformers_restores_the_verbosity():
    before = hf_logging.get_verbosity()
    with quiet_transformers():
        assert hf_logging.get_verbosity() == hf_logging.ERROR
    assert hf_logging.get_verbosity() == before


def test_the_new_head_is_one_line_and_anything_else_a_warning():
    model = AutoModelForSequenceClassification.from_config(load_config("bundled:bert-large", 2, TINY_BERT))
    loading = {"missing_keys": ["classifier.weight", "classifier.bias"], "unexpected_keys": ["cls.predictions.bias"],
               "mismatched_keys": []}
    with pytest.warns(UserWarning, match=r"^1 weight\(s\) in the checkpoint but not in the model, ignored: cls"):
        report_loading(model, loading)


def test_the_saved_dtype_is_the_configs_else_the_safetensors_headers_else_none(tmp_path):
    import torch
    from transformers import BertConfig

    from lit_memory.hf.config import saved_dtype

    config = BertConfig(vocab_size=50, **TINY_BERT)
    model = AutoModelForSequenceClassification.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "named")
    assert saved_dtype(load_config(str(tmp_path / "named"), 2), str(tmp_path / "named")) == torch.bfloat16
    nameless = load_config(str(tmp_path / "named"), 2)
    nameless.dtype = None  # an older file naming none: the weights' header says
    assert saved_dtype(nameless, str(tmp_path / "named")) == torch.bfloat16
    # (save_pretrained wrote on `config`)
    BertConfig(vocab_size=50, **TINY_BERT).save_pretrained(tmp_path / "config-only")
    assert saved_dtype(load_config(str(tmp_path / "config-only"), 2), str(tmp_path / "config-only")) is None
