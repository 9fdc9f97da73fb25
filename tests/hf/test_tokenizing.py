"""The tokenizer a run pads with, and a batch of texts encoded with it."""

from __future__ import annotations

from lit_memory.hf.tokenizing import encode_texts, load_tokenizer, pad_token_id


def test_the_tokenizer_pads_on_the_right_with_its_pad_token():
    tokenizer = load_tokenizer("bundled:minilm")
    assert tokenizer.padding_side == "right" and tokenizer.pad_token is not None
    assert pad_token_id("bundled:minilm") == tokenizer.pad_token_id


def test_encoded_texts_are_truncated_and_say_so():
    tokenizer = load_tokenizer("bundled:minilm")
    rows = {"text": ["short", "word " * 50]}
    encoded = encode_texts(rows, tokenizer, ("text",), max_length=8, cap=None)
    assert [len(ids) <= 8 for ids in encoded["input_ids"]] == [True, True]
    assert encoded["truncated"] == [False, True]
    capped = encode_texts(rows, tokenizer, ("text",), max_length=64, cap=10)  # each text cut to 10 characters first
    assert capped["truncated"] == [False, False] and len(capped["input_ids"][1]) < 10


def test_a_pair_is_encoded_together_longest_first():
    tokenizer = load_tokenizer("bundled:minilm")
    rows = {"premise": ["a b c d e f g h i j k l"], "hypothesis": ["x y"]}
    encoded = encode_texts(rows, tokenizer, ("premise", "hypothesis"), max_length=10, cap=None)
    assert len(encoded["input_ids"][0]) == 10 and encoded["truncated"] == [True]
    assert "token_type_ids" not in encoded or 1 in encoded["token_type_ids"][0]  # the hypothesis kept its tokens
