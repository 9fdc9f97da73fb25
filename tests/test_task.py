"""`lit_memory.task`: the columns found by one rule, the problem type and labels read from the data, and every
problem type end to end: trained through the fused step on small learnable data made here, its ``val:`` line,
predict, and the export reloaded with plain transformers giving the same predictions."""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import RECIPES

from lit_memory.errors import UserError
from lit_memory.task import KINDS, MULTI, REGRESSION, SINGLE, Columns, find_columns, infer

# -- the columns ---------------------------------------------------------------------------------


def test_columns_are_found_by_one_rule_pairs_first():
    assert find_columns(["text", "label"]) == Columns(("text",), ("label",))
    assert find_columns(["idx", "sentence", "label"]) == Columns(("sentence",), ("label",))  # SST-2
    # QNLI
    assert find_columns(["question", "sentence", "label", "idx"]) == Columns(("question", "sentence"), ("label",))
    assert find_columns(["premise", "hypothesis", "label"]).pair
    assert find_columns(["sentence1", "sentence2", "score"]) == Columns(("sentence1", "sentence2"), ("score",))
    assert find_columns(["comment_text", "toxic", "insult"], label=["toxic", "insult"]).label == ("toxic", "insult")
    assert find_columns(["a", "b", "y"], text=["a", "b"], label="y") == Columns(("a", "b"), ("y",))
    assert find_columns(["text"], require_label=False) == Columns(("text",), ())
    # the training data's own names first: a predict file with both `review` and `text`
    assert find_columns(["text", "review"], usual_text=["review"], require_label=False).text == ("review",)


@pytest.mark.parametrize(
    "columns, kwargs, message",
    [
        (
            ["text", "label"],
            {"text": ["text", "other"]},
            r"^column 'other' not found in the data; its columns are \['text', 'label'\] \(set data.text_column\)",
        ),
        (
            ["body", "label"],
            {},
            r"^no text column in the data: its columns are \['body', 'label'\]; looked for text, sentence",
        ),
        (
            ["text", "y"],
            {},
            r"^no label column in the data: its columns are \['text', 'y'\]; looked for label, labels, score",
        ),
        (
            ["a", "b", "c", "y"],
            {"text": ["a", "b", "c"]},
            r"^data.text_column names 3 columns \['a', 'b', 'c'\]: one, or two",
        ),
    ],
)
def test_a_missing_column_is_one_line_naming_it(columns, kwargs, message):
    with pytest.raises(UserError, match=message):
        find_columns(columns, **kwargs)


# -- the problem type and the labels ---------------------------------------------------------------


def rows_of(values, column="label"):
    return [{column: v} for v in values]


def test_the_problem_type_and_labels_come_from_the_labels():
    single = infer(rows_of(["pos", "neg", "pos"]), Columns(("text",), ("label",)))
    assert (single.problem_type, single.num_labels, single.label_names) == (SINGLE, 2, ("neg", "pos"))
    ids = infer(rows_of([0, 3, 1]), Columns(("text",), ("label",)))
    # as the file has them
    assert (ids.problem_type, ids.num_labels, ids.label_names) == (SINGLE, 4, ("0", "1", "2", "3"))
    assert infer(rows_of([1.0, 2.0]), Columns(("t",), ("label",))).problem_type == SINGLE  # whole numbers: classes
    scores = infer(rows_of([0.5, 3.2, 5.0]), Columns(("a", "b"), ("label",)))
    assert (scores.problem_type, scores.num_labels, scores.main_metric) == (REGRESSION, 1, "pearson")
    tags = infer(rows_of([["b", "a"], [], ["c"]]), Columns(("t",), ("label",)))
    assert (tags.problem_type, tags.num_labels, tags.label_names, tags.main_metric) == (
        MULTI,
        3,
        ("a", "b", "c"),
        "f1_micro",
    )
    columns = Columns(("t",), ("toxic", "insult"))
    hot = infer([{"toxic": 1, "insult": 0}, {"toxic": 0, "insult": 0}], columns)
    assert (hot.problem_type, hot.label_names) == (MULTI, ("toxic", "insult"))
    assert infer(rows_of([1, 4]), Columns(("t",), ("label",)), kind=KINDS[REGRESSION]).num_labels == 1  # as set


@pytest.mark.parametrize("values, kwargs, message", [
    ([0.5, 1.0], {"kind": SINGLE},
     r"^label 0.5 in column 'label' of the data is not a class: problem_type single_label_classification expects"),
    (["x", "y"], {"kind": REGRESSION},
     r"^label 'x' in column 'label' of the data is not a number: problem_type regression"),
    ([["a"], ["z"]], {"label_names": ["a", "b"]},
     r"^a row of the data names label 'z' in column 'label', which data.label_names \['a', 'b'\] does not list"),
    (["a", "b"], {"kind": MULTI}, r"^label 'a' in column 'label' of the data is not a list: problem_type multi_label"),
    ([0, 5], {"num_labels": 3}, r"^label 5 in column 'label' of the data is outside num_labels=3 \(expected 0..2\)"),
])
def test_a_label_the_problem_type_cannot_take_is_one_line(values, kwargs, message):
    with pytest.raises(UserError, match=message):
        kind = {"kind": KINDS[kwargs["kind"]]} if "kind" in kwargs else {}
        infer(rows_of(values), Columns(("text",), ("label",)), **{**kwargs, **kind})


# -- every problem type, end to end ------------------------------------------------------------------

COLOURS = ["red", "blue", "green", "yellow"]
ANIMALS = ["cat", "dog", "bird", "fish"]
FILLER = ["the", "a", "small", "big", "old", "young", "happy", "quiet", "near", "house", "tree", "river"]


def _sentence(rng: random.Random, *words: str) -> str:
    tokens = rng.choices(FILLER, k=4) + list(words)
    rng.shuffle(tokens)
    return " ".join(tokens)


def single_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        animal = rng.choice(ANIMALS)
        rows.append({"text": _sentence(rng, animal), "label": "furry" if animal in ("cat", "dog") else "not furry"})
    return rows


def pair_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        animal = rng.choice(ANIMALS)
        other = animal if i % 2 else rng.choice([a for a in ANIMALS if a != animal])
        rows.append({"premise": _sentence(rng, animal), "hypothesis": _sentence(rng, other),
                     "label": "same" if animal == other else "different"})
    return rows


def regression_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        count = rng.randint(0, 3)
        rows.append({"text": _sentence(rng, *(["cat"] * count)), "score": float(count) + 0.5})
    return rows


def multi_label_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        present = [a for a in ANIMALS[:3] if rng.random() < 0.4]
        rows.append({"text": _sentence(rng, *present), "labels": present})
    return rows


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def label_column_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        present = [a for a in ANIMALS[:3] if rng.random() < 0.4]
        rows.append({"text": _sentence(rng, *present), **{a: int(a in present) for a in ANIMALS[:3]}})
    return rows


TASKS = {
    # name: (rows, file suffix, extra fit arguments, the val: metric and the value it must reach: each reached it in
    # its first epoch of 20 steps, of the 2 trained). Each trains through
    # the fused step in fp32 (the 4gb recipe's 8-bit AdamW from bitsandbytes is most of a step on a CPU: the
    # recipes each train in tests/test_cli.py and the 4gb one resumes in tests/run/test_resume.py).
    "single-label": (single_rows, ".csv", ["--model.optimizer.init_args.lr=1e-4"], "f1_macro", 0.9),
    "pairs": (pair_rows, ".csv", ["--model.optimizer.init_args.lr=1e-4"], "acc", 0.7),  # chance: 0.5
    "regression": (regression_rows, ".csv", [], "pearson", 0.8),
    "multi-label": (multi_label_rows, ".jsonl", [], "f1_micro", 0.8),
    "multi-label columns": (label_column_rows, ".csv", ["--data.label_column=[cat, dog, bird]"], "f1_micro", 0.8),
}


def fit(tmp_path: Path, data: Path, *more: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable, "-m", "lit_memory", "fit", "--config", str(RECIPES / "fused.yaml"), f"--data.source={data}",
        "--data.batch_size=16", "--data.max_length=32", "--trainer.max_epochs=2", "--model.optimizer.init_args.lr=3e-4",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false", *more,
    ]
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=900)


def val_line(output: str) -> dict[str, float]:
    line = next(line for line in output.splitlines() if line.startswith("val: "))
    return {k: float(v) for k, v in (item.split("=") for item in line[5:].split())}


@pytest.mark.fit
@pytest.mark.parametrize("name", TASKS)
def test_every_problem_type_trains_predicts_and_exports_what_transformers_reloads(name, tmp_path):
    """A learnable task of each type from a file made here, through the fused step: the task is read from the
    labels, the model learns it to the stated metric, predict writes one row per text in the type's form, and the
    exported hf_model, loaded by plain transformers, gives the same outputs (its config keeps the problem type)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    make, suffix, more, metric, bound = TASKS[name]
    rng = random.Random(0)
    data = write(tmp_path / f"train{suffix}", make(rng, 400))
    done = fit(tmp_path, data, *more)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "data: train 320 · validation 40 · test 40 rows of" in output  # all of it: no demo limit on a user's file
    scores = val_line(done.stdout)
    assert scores[metric] >= bound, (metric, scores)
    if "multi" in name:  # each label's F1 at its best threshold, beside the metrics at 0.5
        assert scores["f1_macro"] >= scores["f1_macro_at_0.5"], scores
    run = tmp_path / "lightning_logs" / "version_0"
    texts = make(random.Random(1), 12)
    for row in texts:  # predict reads the texts alone
        for key in ("label", "score", "labels", *ANIMALS):
            row.pop(key, None)
    inputs = write(tmp_path / f"predict{suffix}", texts)
    predicted = subprocess.run(
        [sys.executable, "-m", "lit_memory", "predict", "--config", str(run / "config.yaml"),
         f"--ckpt_path={next((run / 'checkpoints').glob('best-*.ckpt'))}", f"--data.predict_path={inputs}",
         f"--output={tmp_path / 'predict' / 'predictions.jsonl'}", f"--trainer.default_root_dir={tmp_path / 'predict'}",
         "--trainer.precision=32-true"],  # as transformers runs the reloaded model below
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    out = [json.loads(line) for line in (tmp_path / "predict" / "predictions.jsonl").read_text().splitlines()]
    assert len(out) == len(texts)
    model = AutoModelForSequenceClassification.from_pretrained(run / "hf_model").eval()
    tokenizer = AutoTokenizer.from_pretrained(run / "hf_model")
    problem = model.config.problem_type
    assert problem == {"pairs": SINGLE, "regression": REGRESSION}.get(name, MULTI if "multi" in name else SINGLE)
    columns = [[r[c] for r in texts] for c in (("premise", "hypothesis") if name == "pairs" else ("text",))]
    with torch.no_grad():
        logits = model(**tokenizer(*columns, truncation=True, max_length=32, padding=True, return_tensors="pt")).logits
    names = [model.config.id2label[i] for i in range(model.config.num_labels)]
    for row, reloaded in zip(out, logits):
        if problem == REGRESSION:
            assert row["value"] == pytest.approx(reloaded.item(), abs=1e-4)
        elif problem == MULTI:  # each label at its threshold tuned on validation, saved in config.json
            probs = reloaded.sigmoid().tolist()
            assert [row[f"prob_{n}"] for n in names] == pytest.approx(probs, abs=1e-4)
            limits = model.config.thresholds
            assert row["labels"] == [n for n in names if row[f"prob_{n}"] >= limits[n]]
        else:
            probs = reloaded.softmax(-1).tolist()
            assert [row[f"prob_{n}"] for n in names] == pytest.approx(probs, abs=1e-4)
            assert row["label"] == names[max(range(len(probs)), key=probs.__getitem__)]
