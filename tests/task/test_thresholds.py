"""`lit_memory.task.thresholds`: the sweep counts what torchmetrics counts at every threshold, the chosen thresholds are
each label's best, the metrics at them are torchmetrics' own, they travel in config.json by label name, and a
threshold asked of a task without one is one line."""

from __future__ import annotations

import pytest
import torch
from torchmetrics.classification import BinaryStatScores, MultilabelStatScores
from torchmetrics.functional.classification import multilabel_f1_score

from lit_memory.errors import UserError
from lit_memory.task import KINDS, MULTI, REGRESSION, SINGLE, evaluation
from lit_memory.task import thresholds as th

SINGLE, MULTI, REGRESSION = (KINDS[name] for name in (SINGLE, MULTI, REGRESSION))  # the kinds, as passed


def multi_label_data(rows: int = 400):
    """Three labels whose probabilities run low: the best thresholds are far below 0.5."""
    g = torch.Generator().manual_seed(0)
    targets = (torch.rand(rows, 3, generator=g) < torch.tensor([0.3, 0.1, 0.5])).long()
    probs = (0.25 * targets + 0.3 * torch.rand(rows, 3, generator=g)).clamp(0, 1)
    return probs, targets


def test_the_sweep_counts_what_torchmetrics_counts_at_each_threshold():
    probs, targets = multi_label_data()
    sweep = th.Sweep(3)
    sweep.update(probs[:150], targets[:150])
    sweep.update(probs[150:], targets[150:])
    counts = sweep.compute()
    for i in (0, 20, 49, 70, 98):
        t = float(th.GRID[i])
        decided = (probs >= t).float()  # the project decides with >=; torchmetrics compares > its own threshold
        stats = MultilabelStatScores(3, average="none")(decided, targets)  # tp, fp, tn, fn, support per label
        assert counts[:, i].tolist() == [
            stats[:, 0].tolist(),
            stats[:, 1].tolist(),
            stats[:, 3].tolist(),
            stats[:, 2].tolist(),
        ]


def test_per_label_thresholds_are_each_labels_best_and_beat_one_half():
    probs, targets = multi_label_data()
    sweep = th.Sweep(3)
    sweep.update(probs, targets)
    counts = sweep.compute()
    index = th.choose(counts, "per_label", MULTI)
    chosen = th.at(counts, index)
    f1 = MULTI.per_label_f1(3)
    f1.update(*th.replay(chosen, MULTI))
    tuned = f1.compute()
    # the same F1 as torchmetrics computes from the probabilities at those thresholds, and the best of the grid
    direct = multilabel_f1_score((probs >= th.GRID[index]).float(), targets, 3, average="none")
    torch.testing.assert_close(tuned, direct)
    grid = torch.stack(
        [multilabel_f1_score((probs >= t).float(), targets, 3, average="none") for t in th.GRID.tolist()]
    )
    torch.testing.assert_close(tuned, grid.max(0).values)
    at_half = multilabel_f1_score((probs >= 0.5).float(), targets, 3, average="none")
    assert (th.GRID[index] < 0.45).all() and (tuned > at_half + 0.2).all()
    # one threshold for all: the best micro-F1 of the grid
    one = th.choose(counts, "global", MULTI)
    assert len(set(one.tolist())) == 1
    micro = [float(multilabel_f1_score((probs >= t).float(), targets, 3, average="micro")) for t in th.GRID.tolist()]
    assert micro[int(one[0])] == pytest.approx(max(micro))


def test_a_binary_threshold_maximises_the_metric_asked_for_and_ties_keep_the_default():
    g = torch.Generator().manual_seed(1)
    labels = (torch.rand(300, generator=g) < 0.2).long()
    logits = torch.stack([torch.zeros(300), torch.randn(300, generator=g) + 2.0 * labels - 1.5], -1)
    p1 = th.probabilities(logits, SINGLE)
    sweep = th.Sweep(1)
    sweep.update(p1, labels.unsqueeze(-1))
    counts = sweep.compute()
    for objective in ("f1", "mcc", "acc", "f1_macro"):
        index = th.choose(counts, "global", SINGLE, objective)
        scores = [float(th.binary_scores(*th.at(counts, torch.tensor([i])))[objective][0]) for i in range(len(th.GRID))]
        assert scores[int(index[0])] == pytest.approx(max(scores)), objective
    # the decision at the chosen threshold is class 1 where its probability reaches it
    t = th.GRID[th.choose(counts, "global", SINGLE, "f1")]
    decided = th.decide(logits, SINGLE, t)
    stats = BinaryStatScores()(decided, labels)
    assert th.at(counts, th.choose(counts, "global", SINGLE, "f1")).view(-1).tolist() == [
        int(stats[0]), int(stats[1]), int(stats[3]), int(stats[2])]
    # no signal at all: every threshold scores the same, and the default stays
    flat = th.Sweep(1)
    flat.update(torch.zeros(10, 1), torch.zeros(10, 1, dtype=torch.long))
    assert float(th.GRID[th.choose(flat.compute(), "per_label", MULTI)[0]]) == pytest.approx(0.5)
    assert th.decide(logits, SINGLE, None).tolist() == logits.argmax(-1).tolist()  # no threshold: the most probable


def test_the_metrics_at_the_tuned_thresholds_are_torchmetrics_own_degenerate_cases_included():
    # every prediction one class: torchmetrics' Matthews coefficient has its own value there, and replay keeps it
    counts = torch.tensor([[2], [18], [0], [0]])
    preds, targets = th.replay(counts, SINGLE)
    ours = evaluation.task_metrics(SINGLE, 2)
    ours.update(preds, targets)
    reference = evaluation.task_metrics(SINGLE, 2)
    reference.update(torch.ones(20, dtype=torch.long), torch.tensor([1, 1] + [0] * 18))
    assert {k: float(v) for k, v in ours.compute().items()} == {k: float(v) for k, v in reference.compute().items()}
    assert th.confusion(counts, SINGLE).tolist() == [[0, 18], [0, 2]]  # rows: true class


def test_thresholds_travel_in_the_config_by_label_name():
    found = th.Thresholds((0.31, 0.12), "tuned on validation at step 8 for each label's F1")
    saved = found.to_config(["joy", "anger"], MULTI)
    assert saved == {"joy": 0.31, "anger": 0.12}
    assert th.from_config({"anger": 0.12, "joy": 0.31}, ["joy", "anger"], MULTI, "x") == (0.31, 0.12)
    assert th.Thresholds((0.7,), "set").to_config(["neg", "pos"], SINGLE) == {"pos": 0.7}
    with pytest.warns(
        UserWarning, match=r"x: its 'thresholds' .* are not one threshold in \(0, 1\) for each of the model's labels"
    ):
        assert th.from_config({"joy": 0.3}, ["joy", "anger"], MULTI, "x") is None
    assert found.describe(["joy", "anger"], MULTI) == (
        "thresholds (tuned on validation at step 8 for each label's F1): joy 0.31, anger 0.12")


@pytest.mark.parametrize(
    "problem, labels, tune, threshold, message",
    [
        (
            REGRESSION,
            1,
            "per_label",
            None,
            r"^model.tune_threshold per_label: a regression predicts a value, there is no threshold",
        ),
        (REGRESSION, 1, "auto", 0.3, r"^model.threshold: a regression predicts a value"),
        (
            SINGLE,
            3,
            "global",
            None,
            r"^model.tune_threshold global: a single-label task with 3 classes predicts the most probable",
        ),
        (
            SINGLE,
            2,
            "per_label",
            None,
            r"^model.tune_threshold per_label: a binary task has one threshold \(use global\)",
        ),
        (
            MULTI,
            4,
            "per_label",
            0.3,
            r"^model.threshold 0.3 fixes the threshold and model.tune_threshold per_label tunes it",
        ),
        (MULTI, 4, "auto", 1.5, r"^model.threshold must be in \(0, 1\), got 1.5"),
    ],
)
def test_a_threshold_asked_of_a_task_without_one_is_one_line(problem, labels, tune, threshold, message):
    with pytest.raises(UserError, match=message):
        th.tuning(problem, labels, tune, threshold, "f1")


def test_what_is_tuned_by_default():
    assert th.tuning(MULTI, 4, "auto", None, "f1") == "per_label"
    assert th.tuning(MULTI, 4, "auto", 0.3, "f1") is None  # a threshold set is used as it is
    assert th.tuning(SINGLE, 2, "auto", None, "f1") is None  # binary: the most probable class unless asked
    assert th.tuning(SINGLE, 2, "global", None, "mcc") == "global"
    assert th.tuning(REGRESSION, 1, "auto", None, "f1") is None
