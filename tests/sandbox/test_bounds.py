"""Bounded reading (`lit_memory.sandbox.bounds`): each bomb a recipe or a folder sent with it can hold is refused
before the expensive step, in time and memory far below what reading it would cost, and nothing real is."""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from types import SimpleNamespace

import pytest
import torch
from conftest import CONFIGS, RECIPES, REPO, deflate_bomb

from lit_memory.sandbox import bounds

LAUGHS = 'a: &a ["x","x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(9)
)  # ~600 bytes: 10^10 values once expanded


def within(seconds: float, megabytes: float, fn, *args):
    """``fn(*args)``'s exception, checked to come within the time and (Python) memory given."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(bounds.BoundExceeded) as err:
            fn(*args)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - start < seconds and peak < megabytes * bounds.MiB, (time.perf_counter() - start, peak)
    return str(err.value)


def test_yaml_aliases_nesting_and_size_are_bounded_before_anything_is_built():
    assert "once its aliases are expanded" in within(2, 20, bounds.check_yaml, LAUGHS)
    assert "nested deeper than 64 levels" in within(5, 50, bounds.check_yaml, "x: " + "[" * 100_000 + "]" * 100_000)
    assert "more than the 1 MiB bound" in within(1, 20, bounds.check_yaml, "x: " + "y" * (4 << 20))


def test_every_shipped_recipe_and_config_is_within_the_yaml_bounds():
    for path in [*RECIPES.glob("*.yaml"), *CONFIGS.glob("*.yaml")]:
        bounds.check_yaml(path.read_text(), str(path))


def test_reads_are_of_regular_files_within_a_size(tmp_path):
    fifo = tmp_path / "memory.json"
    os.mkfifo(fifo)
    (tmp_path / ".metadata").symlink_to("/dev/zero")
    (tmp_path / "big.json").write_bytes(b"0" * (bounds.JSON_BYTES + 1))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "it is a FIFO" in within(1, 5, bounds.read_bytes, fifo, bounds.JSON_BYTES)  # not blocked on it
    assert "a device or socket" in within(1, 5, bounds.read_bytes, tmp_path / ".metadata", bounds.METADATA_BYTES)
    assert "more than the 16 MiB bound" in within(1, 5, bounds.read_bytes, tmp_path / "big.json", bounds.JSON_BYTES)
    assert "nested too deeply" in within(5, 200, bounds.read_json, tmp_path / "deep.json")
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert bounds.read_json(tmp_path / "ok.json") == {"a": 1}


def test_a_decompression_bomb_in_weights_is_refused_from_the_zip_directory(tmp_path):
    bomb = deflate_bomb(tmp_path / "pytorch_model.bin")
    assert bomb.stat().st_size < 1 << 20
    line = within(1, 10, bounds.unsafe_globals, bomb)
    assert "expands from" in line and "decompression bomb" in line
    torch.save({"w": torch.ones(3)}, tmp_path / "fine.bin")  # torch stores its records: fine
    assert bounds.zip_problem(tmp_path / "fine.bin") is None and bounds.unsafe_globals(tmp_path / "fine.bin") == []


def replace_chain(stages: int, factor: int = 10) -> dict:
    return {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": "a"}, "content": "a" * factor} for _ in range(stages)]}


def test_a_tokenizer_whose_normalizers_multiply_texts_is_refused(tmp_path):
    assert "multiply a text's length 100000 times" in bounds.normalizer_problem(replace_chain(5))
    assert bounds.normalizer_problem({"type": "BertNormalizer", "lowercase": True}) is None
    shipped = REPO / "lit_memory" / "assets" / "bert-large-uncased" / "tokenizer.json"
    assert bounds.tokenizer_problem(shipped) is None
    evil = json.loads(shipped.read_text())
    evil["normalizer"] = replace_chain(5)
    (tmp_path / "tokenizer.json").write_text(json.dumps(evil))
    assert "normalizers can multiply" in bounds.tokenizer_problem(tmp_path / "tokenizer.json")


def test_a_model_config_too_large_to_build_is_refused():
    from transformers import BertConfig

    assert "num_hidden_layers=20000" in bounds.model_size_problem(BertConfig(num_hidden_layers=20000))
    assert bounds.model_size_problem(BertConfig(num_hidden_layers=20000), exempt=("num_hidden_layers",)) is None
    assert bounds.model_size_problem(BertConfig()) is None
    nested = SimpleNamespace(sub_configs={"text_config": None}, text_config=BertConfig(hidden_size=1 << 20))
    assert "hidden_size" in bounds.model_size_problem(nested)
