"""`lit_memory.task.kind`: every registered kind's pieces agree with one another and with Hugging Face's heads."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from lit_memory.errors import UserError
from lit_memory.task import KINDS, PROBLEM_TYPES, Columns, head_kind, infer, kind_of


@pytest.mark.parametrize("name", list(KINDS))
def test_each_kind_s_fake_labels_its_dtype_its_loss_and_hugging_face_s_head_agree(name):
    kind, rows, labels = kind_of(name), 4, 3
    num_labels = kind.fixed_outputs() or labels
    fake = kind.fake_labels(rows, num_labels)
    assert fake.dtype == kind.target_dtype
    torch.manual_seed(0)
    head = BertForSequenceClassification(BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
        num_labels=num_labels, problem_type=name)).eval()
    out = head(input_ids=torch.randint(0, 32, (rows, 5)), labels=fake)
    torch.testing.assert_close(kind.loss(out.logits, fake), out.loss)  # HF's loss for this problem type
    assert kind.loss(out.logits, fake, reduction="none").shape == (rows,)  # per row
    assert kind.written(out.logits).shape[0] == rows and len(kind.header(["a", "b", "c"][:num_labels])) >= 1


@pytest.mark.parametrize("labels, expected", [
    ([["a", "b"], ["b"]], "multi_label_classification"),
    ([0.5, 1.25], "regression"),
    ([0, 1, 1], "single_label_classification"),
    (["pos", "neg"], "single_label_classification"),
])
def test_exactly_one_kind_claims_any_labels_and_infer_picks_it(labels, expected):
    claims = [name for name, kind in KINDS.items() if kind.claims(labels, False)]
    assert claims == [expected]
    task = infer([{"label": v} for v in labels], Columns(("text",), ("label",)))
    assert task.problem_type == expected and task.main_metric == kind_of(expected).main_metric


def test_an_unknown_problem_type_is_one_error_line_naming_every_kind():
    with pytest.raises(UserError, match="model.problem_type 'ranking' is not one of: " + ", ".join(PROBLEM_TYPES)):
        kind_of("ranking")
    assert PROBLEM_TYPES == ("single_label_classification", "multi_label_classification", "regression")


def test_a_config_s_own_problem_type_is_kept_only_where_its_head_fits():
    assert head_kind(None, "regression", 1).name == "regression"
    assert head_kind(None, "regression", 3).name == "single_label_classification"  # a resized head
    assert head_kind(None, "multi_label_classification", 1).name == "regression"
    assert head_kind(kind_of("multi_label_classification"), None, 4).name == "multi_label_classification"
