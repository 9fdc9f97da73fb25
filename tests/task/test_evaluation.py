"""The per-class report and the warning for a validation whose predictions do not depend on the input
(`lit_memory.task.evaluation`)."""

from __future__ import annotations

import torch

from lit_memory.task import kind_of
from lit_memory.task.evaluation import NAME_WIDTH, one_sided, report

SINGLE, MULTI = kind_of("single_label_classification"), kind_of("multi_label_classification")  # the kinds passed


def test_the_report_shows_class_names_whole_up_to_a_cap_in_aligned_columns():
    """A name as long as "entertainment" is shown whole in the per-class rows and the confusion matrix (it was cut at
    12 characters); one beyond `NAME_WIDTH` ends with an ellipsis; the numbers stay in their columns."""
    long = "a_class_name_much_longer_than_any_column_should_be"
    names = ["sport", "entertainment", long]
    shown = report("val", torch.tensor([[5, 1, 0], [2, 3, 1], [0, 0, 40]]), names, SINGLE).splitlines()
    cut = long[: NAME_WIDTH - 1] + "\u2026"
    header, *rows = shown[:4]
    assert [row.split()[0] for row in rows] == ["sport", "entertainment", cut]
    assert {len(line) for line in shown[:4]} == {len(header)}  # every row as wide as the header: aligned
    matrix = shown[shown.index("confusion matrix (rows: true class, columns: predicted):") + 1:]
    assert matrix[0].split() == ["sport", "entertainment", cut]
    assert [row.split()[0] for row in matrix[1:]] == ["sport", "entertainment", cut]
    assert len({len(line) for line in matrix}) == 1
    for row, counts in zip(matrix[1:], ([5, 1, 0], [2, 3, 1], [0, 0, 40])):  # each count under its column's name
        for name, count in zip(matrix[0].split(), counts):
            assert row[matrix[0].index(name) + len(name) - len(str(count)):][: len(str(count))] == str(count)
    labels = report("val", torch.tensor([[[5, 1], [0, 2]], [[2, 3], [1, 1]]]), ["x", "entertainment"], MULTI)
    assert [line.split()[0] for line in labels.splitlines()[1:]] == ["x", "entertainment"]


def label_counts(predicted: list[list[int]], truth: list[list[int]]) -> torch.Tensor:
    """Per label [[tn, fp], [fn, tp]] of 0/1 predictions (rows x labels) against the truth."""
    p, t = torch.tensor(predicted), torch.tensor(truth)
    return torch.stack(
        [
            torch.tensor(
                [
                    [int(((p[:, j] == 0) & (t[:, j] == 0)).sum()), int(((p[:, j] == 1) & (t[:, j] == 0)).sum())],
                    [int(((p[:, j] == 0) & (t[:, j] == 1)).sum()), int(((p[:, j] == 1) & (t[:, j] == 1)).sum())],
                ]
            )
            for j in range(p.shape[1])
        ]
    )


def test_a_multi_label_validation_that_predicts_the_same_labels_for_every_row_is_one_warning():
    truth = [[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]]
    names = ["happy", "sad", "angry"]

    def said(predicted):
        return one_sided(label_counts(predicted, truth), names, MULTI)

    assert said([[1, 1, 1]] * 4) == (
        "warning: the validation predicts every label for every row (every probability at or above its threshold): the "
        "model has not learned the task yet; try more epochs (--trainer.max_epochs), a higher learning rate "
        "(--model.optimizer.init_args.lr 5e-5) or --model.class_weights balanced for rare labels")
    assert said([[0, 0, 0]] * 4).startswith("warning: the validation predicts no label for any row")
    assert said([[1, 0, 1]] * 4).startswith("warning: the validation predicts the same labels for every row (happy, "
                                           "angry; no other): the model has not learned the task yet")
    assert said([[1, 0, 1], [0, 1, 0], [1, 1, 0], [1, 0, 1]]) is None  # predictions that follow the input
    assert said([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]]) is None  # one label differs between rows


def test_a_single_label_validation_that_predicts_one_class_is_one_warning():
    assert one_sided(torch.tensor([[3, 0], [2, 0]]), ["neg", "pos"], SINGLE).startswith(
        "warning: every validation prediction is 'neg': the model has not learned the task yet")
    assert one_sided(torch.tensor([[3, 0], [1, 1]]), ["neg", "pos"], SINGLE) is None
