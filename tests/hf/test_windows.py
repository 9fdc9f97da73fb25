"""`lit_memory.hf.windows`: texts longer than the window cut into overlapping windows that cover them, evaluation
batches of whole texts, logits aggregated per text, and settings no window can have as one line."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import write_csv

from lit_memory.data import TextClassificationData
from lit_memory.errors import UserError
from lit_memory.hf import windows
from lit_memory.hf.tokenizing import load_tokenizer
from lit_memory.task import KINDS, MULTI, REGRESSION, SINGLE

SINGLE, MULTI, REGRESSION = (KINDS[name] for name in (SINGLE, MULTI, REGRESSION))  # the kinds, as passed


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("bundled:minilm")


def test_windows_cover_each_text_and_share_stride_tokens(tokenizer):
    texts = [" ".join(f"w{i}" for i in range(n)) for n in (3, 40, 17)]
    rows = {"text": texts, "labels": [0, 1, 0]}
    out = windows.encode(rows, [7, 8, 9], tokenizer, ("text",), max_length=12, stride=3, cap=None)
    assert sorted(set(out["doc"])) == [7, 8, 9] and out["doc"] == sorted(out["doc"])  # each text's windows together
    assert [label for label in out["labels"]] == [{7: 0, 8: 1, 9: 0}[d] for d in out["doc"]]
    assert [s for s, d in zip(out["split"], out["doc"]) if d == 7] == [False]  # a short text: one window, not split
    for doc, text in zip((7, 8, 9), texts):
        ids = [w[1:-1] for w, d in zip(out["input_ids"], out["doc"]) if d == doc]  # without [CLS] ... [SEP]
        assert all(len(w) <= 10 for w in ids)
        whole = ids[0]
        for before, after in zip(ids, ids[1:]):
            assert before[-3:] == after[:3]  # consecutive windows share stride tokens
            whole = whole + after[3:]
        assert whole == tokenizer(text, add_special_tokens=False)["input_ids"]  # together they are the whole text


def test_a_pair_keeps_its_first_text_in_every_window(tokenizer):
    rows = {"q": ["a short question", " ".join(["long"] * 30)], "p": [" ".join(f"p{i}" for i in range(30)), "x"],
            "labels": [1, 0]}
    out = windows.encode(rows, [0, 1], tokenizer, ("q", "p"), max_length=16, stride=2, cap=None)
    first = [tokenizer.decode(w).split("[SEP]")[0] for w, d in zip(out["input_ids"], out["doc"]) if d == 0]
    assert len(first) > 2 and set(first) == {"[CLS] a short question "}
    long_first = [w for w, d in zip(out["input_ids"], out["doc"]) if d == 1]
    assert len(long_first) == 1 and len(long_first[0]) <= 16  # a first text longer than half the window is cut


def test_evaluation_batches_hold_whole_texts_within_the_batch_size():
    doc = [0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 4]
    ranges = windows.groups(doc, 4)
    assert ranges == [(0, 2), (2, 6), (6, 11), (11, 12)]  # the 5-window text alone
    assert [i for start, end in ranges for i in range(start, end)] == list(range(len(doc)))


def test_logits_are_averaged_per_text_or_their_maximum_for_multi_label():
    logits = torch.tensor([[1.0, -2.0], [3.0, 0.0], [0.5, 0.5], [-1.0, 4.0]])
    doc = torch.tensor([0, 0, 1, 1])
    torch.testing.assert_close(windows.aggregate(logits, doc, SINGLE), torch.tensor([[2.0, -1.0], [-0.25, 2.25]]))
    torch.testing.assert_close(windows.aggregate(logits[:, :1], doc, REGRESSION), torch.tensor([[2.0], [-0.25]]))
    torch.testing.assert_close(windows.aggregate(logits, doc, MULTI), torch.tensor([[3.0, 0.0], [0.5, 4.0]]))


def late_rows(n: int = 24) -> list[dict]:
    rng = random.Random(0)
    return [{"text": " ".join(rng.choices(["the", "old", "tree", "river"], k=30) + [animal]), "label": animal}
            for animal in ["cat", "dog"] * (n // 2)]


def test_a_signal_after_max_length_is_in_a_window_with_chunk_and_in_no_input_with_truncate(tmp_path, tokenizer):
    data = write_csv(tmp_path / "late.csv", late_rows())
    signal = {tokenizer.convert_tokens_to_ids(a) for a in ("cat", "dog")}
    seen = {}
    for how in ("truncate", "chunk"):
        module = TextClassificationData(source=str(data), max_length=16, long_texts=how, stride=4, batch_size=4,
                                        eval_batch_size=5)
        module.prepare_data()
        train = module.splits["train"]
        seen[how] = any(signal & set(ids.tolist()) for ids in train["input_ids"])
        if how == "chunk":
            assert "cut into windows of max_length 16 sharing 4 tokens" in module.summary
            assert len(train) > 2 * 19  # every training text cut into several windows, each a row
            batches = list(module._loader("validation", 5, shuffle=False))
            for batch in batches:
                docs = int(batch["doc"].max()) + 1
                assert batch["labels"].shape == (docs,) and (batch["input_ids"].shape[0] <= 5 or docs == 1)
                for d in range(docs):  # every validation text's windows end with its class word
                    assert signal & set(batch["input_ids"][batch["doc"] == d].flatten().tolist())
            assert sum(int(b["doc"].max()) + 1 for b in batches) == len(
                set(module.splits["validation"]["doc"][:].tolist())
            )
        else:
            assert "truncated at max_length 16" in module.summary
    assert seen == {"truncate": False, "chunk": True}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"long_texts": "chunk", "stride": 16},
            r"^data.stride 16: the tokens consecutive windows share must be >= 0 and less than max_length \(16\)",
        ),
        ({"long_texts": "slide"}, r"^data.long_texts 'slide' is not one of: truncate, chunk$"),
    ],
)
def test_settings_no_window_can_have_are_one_line(kwargs, message):
    with pytest.raises(UserError, match=message):
        TextClassificationData(source="bundled", max_length=16, **kwargs)


def test_a_stride_the_window_cannot_hold_is_one_line_naming_what_it_holds(tokenizer):
    with pytest.raises(UserError, match=r"^data.stride 14: a window of max_length 16 holds 14 tokens of text"):
        windows.check_tokenizer(tokenizer, 14, 16, pair=False)
    with pytest.raises(UserError, match=r"^data.stride 7: a window of max_length 16 holds 7 tokens of the second text"):
        windows.check_tokenizer(tokenizer, 7, 16, pair=True)
    windows.check_tokenizer(tokenizer, 6, 16, pair=True)
