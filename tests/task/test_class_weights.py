"""`lit_memory.task.class_weights`: balanced weights as scikit-learn computes them, the weighted losses as torch's, a
minority class learned better with them, and a setting the task cannot take as one line."""

from __future__ import annotations

import pytest
import torch

from lit_memory.errors import UserError
from lit_memory.task import KINDS, MULTI, REGRESSION, SINGLE
from lit_memory.task import class_weights as weights
from lit_memory.task.evaluation import report

SINGLE, MULTI, REGRESSION = (KINDS[name] for name in (SINGLE, MULTI, REGRESSION))  # the kinds, as passed


def test_balanced_single_label_weights_are_scikit_learns():
    sklearn = pytest.importorskip("sklearn.utils.class_weight")
    labels = torch.tensor([0] * 90 + [1] * 7 + [2] * 3)
    counts = weights.count(labels, SINGLE, 3)
    assert counts == weights.LabelCounts(100, (90, 7, 3))
    found = weights.resolve("balanced", counts, SINGLE, 3)
    expected = sklearn.compute_class_weight("balanced", classes=torch.arange(3).numpy(), y=labels.numpy())
    torch.testing.assert_close(found, torch.tensor(expected, dtype=torch.float32))


def test_balanced_multi_label_pos_weight_is_negatives_over_positives():
    labels = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    counts = weights.count(labels, MULTI, 3)
    assert counts == weights.LabelCounts(4, (2, 1, 0))
    # 2 of 4 positive: 1; 1 of 4: 3; none: unweighted
    assert weights.resolve("balanced", counts, MULTI, 3).tolist() == [1.0, 3.0, 1.0]
    assert weights.resolve([0.5, 2, 1], counts, MULTI, 3).tolist() == [0.5, 2.0, 1.0]
    assert weights.resolve("none", counts, MULTI, 3) is None


def test_weighted_losses_are_torchs():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(8, 3, generator=g), torch.randint(0, 3, (8,), generator=g)
    w = torch.tensor([0.2, 1.0, 5.0])
    torch.testing.assert_close(
        weights.loss(logits, labels, SINGLE, w), torch.nn.CrossEntropyLoss(weight=w)(logits, labels)
    )
    torch.testing.assert_close(weights.loss(logits, labels, SINGLE), torch.nn.CrossEntropyLoss()(logits, labels))
    hot = torch.randint(0, 2, (8, 3), generator=g).float()
    torch.testing.assert_close(
        weights.loss(logits, hot, MULTI, w), torch.nn.BCEWithLogitsLoss(pos_weight=w)(logits, hot)
    )


def fit_linear(x: torch.Tensor, y: torch.Tensor, w) -> torch.Tensor:
    """A logistic regression (two logits) trained by full-batch Adam on the weighted loss; its predictions on ``x``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(200):
        opt.zero_grad()
        weights.loss(model(x), y, SINGLE, w).backward()
        opt.step()
    return model(x).argmax(-1)


def f1(predicted: torch.Tensor, y: torch.Tensor) -> float:
    tp = int(((predicted == 1) & (y == 1)).sum())
    fp, fn = int(((predicted == 1) & (y == 0)).sum()), int(((predicted == 0) & (y == 1)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def test_balanced_raises_the_minority_classs_f1_on_a_5_percent_positive_task(one_thread):
    g = torch.Generator().manual_seed(0)
    y = (torch.arange(2000) % 20 == 0).long()  # 5 % positive
    # One feature, the classes one standard deviation apart: the plain loss puts the boundary where almost no row is
    # positive (the prior wins), the balanced one where the classes cross.
    x = torch.randn(2000, 1, generator=g) + y.unsqueeze(-1).float()
    counts = weights.count(y, SINGLE, 2)
    plain = f1(fit_linear(x, y, None), y)
    balanced = f1(fit_linear(x, y, weights.resolve("balanced", counts, SINGLE, 2)), y)
    assert balanced > plain + 0.1, (plain, balanced)


@pytest.mark.parametrize("setting, problem, message", [
    ([1.0, 2.0], SINGLE, r"^model.class_weights has 2 weight\(s\) for 3 classes: one per class, in id order$"),
    ([1.0, 2.0], MULTI, r"^model.class_weights has 2 weight\(s\) for 3 labels: one per label"),
    ([1.0, -2.0, 1.0], SINGLE, r"weights are finite numbers >= 0, not all 0"),
    ("balanced", REGRESSION, r"^model.class_weights: a regression predicts a value, there are no classes to weigh"),
    ("heavy", SINGLE, r"^model.class_weights 'heavy' is not one of: none, balanced"),
])
def test_a_weight_setting_the_task_cannot_take_is_one_line(setting, problem, message):
    with pytest.raises(UserError, match=message):
        weights.check(setting, problem, 3)


def test_the_data_line_shows_each_weight_with_its_count_and_the_report_a_weight_column():
    counts = weights.LabelCounts(100, (95, 5))
    found = weights.resolve("balanced", counts, SINGLE, 2)
    line = weights.describe("balanced", found, counts, ["neg", "pos"], SINGLE)
    assert line == "class weights balanced (of 100 training rows; their rows in brackets): neg 0.526 (95), pos 10 (5)"
    shown = report("val", torch.tensor([[90, 5], [1, 4]]), ["neg", "pos"], SINGLE, weights=found.tolist())
    header, neg, pos = shown.splitlines()[:3]
    assert header.split()[-1] == "weight" and neg.split()[-1] == "0.526" and pos.split()[-1] == "10"
