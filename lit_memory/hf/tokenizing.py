"""The tokenizer: loaded through `lit_memory.sandbox.guard`, what it pads with, and a batch of texts encoded with it."""

from __future__ import annotations

import functools
from typing import Any, Optional

from transformers import AutoTokenizer

from lit_memory.errors import UserError
from lit_memory.hf import bundled
from lit_memory.sandbox import guard


def load_tokenizer(name_or_path: str):
    """The tokenizer, padding on the right with its EOS token where it has no pad token (GPT-2's, Llama's):
    the one place that decides what batches are padded with (the model's config follows it: `pad_token_id`)."""
    path = bundled.resolve_model(name_or_path)
    if not str(name_or_path).startswith("bundled:"):
        guard.check_model_folder(path, f"tokenizer {name_or_path!r}")
    try:
        tokenizer = guard.call(AutoTokenizer.from_pretrained, f"tokenizer {name_or_path!r}", path)
    except OSError as err:
        raise UserError(f"cannot load tokenizer {name_or_path!r}: {str(err).splitlines()[0]}") from err
    guard.check_normalizer(tokenizer, f"tokenizer {name_or_path!r}")  # untrusted: no normalizer that multiplies texts
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(
                f"tokenizer {name_or_path!r} has neither a pad token nor an EOS token to pad batches with: "
                "give it one (its tokenizer_config.json: pad_token) or use model.tokenizer_name_or_path"
            )
        tokenizer.pad_token = tokenizer.eos_token
    # Right: every family's classifier reads the right token either way (a decoder's, the last that is not
    # padding), but left padding would shift absolute position embeddings (GPT-2's) without position ids.
    tokenizer.padding_side = "right"
    return tokenizer


@functools.lru_cache(maxsize=32)
def pad_token_id(name_or_path: str) -> int:
    """The id `load_tokenizer` pads with (cached: every module built for the same tokenizer asks)."""
    return load_tokenizer(name_or_path).pad_token_id


def encode_texts(rows: dict, tokenizer: Any, texts: tuple[str, ...], max_length: int, cap: Optional[int]) -> dict:
    """A batch of rows tokenised, truncated to ``max_length`` (a pair: the longer text first, ``longest_first``),
    and whether each lost tokens to it. ``cap``: each text first cut to this many characters."""
    columns = [[t[:cap] if isinstance(t, str) and cap is not None else t for t in rows[c]] for c in texts]
    encoded = tokenizer(*columns, truncation="longest_first" if len(columns) == 2 else True, max_length=max_length)
    full = tokenizer(*columns, truncation=False, return_attention_mask=False, return_token_type_ids=False,
                     verbose=False)["input_ids"]
    encoded["truncated"] = [len(ids) > max_length for ids in full]
    return encoded


UNKNOWN_SHARE = 0.05  # the data: line says what share of the tokens the tokenizer does not know from here on


def unknown_share(split: Any, tokenizer: Any) -> Optional[float]:
    """The share of a tokenised split's text tokens (its special tokens left out) that are the tokenizer's unknown
    token, counted over the whole ``input_ids`` column at once (Arrow); None for a tokenizer without one (a byte-level
    one never needs it) or a split without tokens."""
    import pyarrow as pa  # deferred: with `datasets`, which only reading data needs
    import pyarrow.compute as pc

    unk = tokenizer.unk_token_id
    if unk is None:
        return None
    ids = pc.list_flatten(split.with_format("arrow")["input_ids"])
    special = pa.array([i for i in tokenizer.all_special_ids if i != unk], type=ids.type)
    text = len(ids) - (pc.sum(pc.is_in(ids, value_set=special)).as_py() or 0)
    unknown = pc.sum(pc.equal(ids, unk)).as_py() or 0
    return unknown / text if text else None


def unknown_words(share: Optional[float], tokenizer: Any, where: str = "training") -> Optional[str]:
    """What the ``data:`` line says of a large share of unknown tokens (`UNKNOWN_SHARE` or more), else None."""
    if share is None or share < UNKNOWN_SHARE:
        return None
    return (f"{100 * share:.1f} % of the {where} tokens are the tokenizer's unknown token {tokenizer.unk_token} "
            "(characters it does not know: emoji, kaomoji, another script), which the model cannot tell apart: a "
            "model whose tokenizer knows them (a byte-level one, such as --model.model_name_or_path roberta-large) may "
            "learn more")
