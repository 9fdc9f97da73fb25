"""The decisions a classifier's user makes, measured on small data made here through the 4gb recipe (issue 51).

Each case writes a file, trains the bundled MiniLM on it with ``python -m lit_memory fit --recipe 4gb`` (a fresh
process, as a user runs it), and reads the run's ``val:``/``test:`` lines, its ``hf_model/`` and its predictions:

- ``imbalance``: a binary task with 5 % positives whose words only hint at the class: ``model.class_weights`` none vs
  balanced, the minority class's F1 on the test split (``test`` subcommand, from the best checkpoint);
- ``thresholds``: a multi-label task whose labels hold for only a third of the rows that show their word (the best
  thresholds sit far below 0.5): micro-F1 at the tuned thresholds and at 0.5, and ``predict`` from ``hf_model/``
  applying the thresholds saved in its ``config.json``;
- ``defaults``: a 600-row pair file for regression with nothing but the file given (the floor of
  `lit_memory.run.training_length.MIN_STEPS` optimizer steps), and the same with the recipe's one epoch typed;
- ``long``: the class word after ``max_length`` tokens: ``data.long_texts`` chunk vs truncate;
- every run: ``hf_model/README.md`` exists and its validation metrics are the ones the run logged at that step.

    python examples/decisions.py --out /tmp/decisions                 # every case (9 minutes on a 2-core CPU)
    python examples/decisions.py --out /tmp/decisions --cases long    # one of them

Prints one line per run and a summary; ``results.json`` in ``--out`` keeps them.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

FILLER = ["the", "a", "small", "big", "old", "young", "happy", "quiet", "near", "house", "tree", "river", "blue",
          "green", "over", "under", "with", "from", "after", "before"]
ANIMALS = ["cat", "dog", "bird"]


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def sentence(rng: random.Random, words: list[str], filler: int = 6) -> str:
    tokens = rng.choices(FILLER, k=filler) + words
    rng.shuffle(tokens)
    return " ".join(tokens)


def imbalanced(rng: random.Random, n: int = 2000) -> list[dict]:
    """5 % positives; a positive shows "cat" 40 % of the time, a negative 3 %: the word hints, it does not decide.
    Even with "cat" a row is rare with probability 0.05 x 0.4 / (0.05 x 0.4 + 0.95 x 0.03) = 0.41, so the most
    likely class is always "common"; weighted to balance, "cat" makes "rare" the likelier."""
    rows = []
    for i in range(n):
        positive = i % 20 == 0
        cat = rng.random() < (0.4 if positive else 0.03)
        rows.append({"text": sentence(rng, ["cat"] if cat else [rng.choice(["dog", "bird"])]),
                     "label": "rare" if positive else "common"})
    return rows


def weak_labels(rng: random.Random, n: int = 600) -> list[dict]:
    """Each animal's word in half the rows; its label holds for a third of those (never without the word)."""
    rows = []
    for _ in range(n):
        words = [a for a in ANIMALS if rng.random() < 0.5]
        rows.append({"text": sentence(rng, words), "labels": [a for a in words if rng.random() < 0.33]})
    return rows


def pairs(rng: random.Random, n: int = 600) -> list[dict]:
    """How many "cat"s the two sentences share, as a score (STS-like, 0.5 .. 3.5)."""
    rows = []
    for _ in range(n):
        shared = rng.randint(0, 3)
        rows.append(
            {
                "sentence1": sentence(rng, ["cat"] * shared),
                "sentence2": sentence(rng, ["cat"] * shared + ["dog"]),
                "score": shared + 0.5,
            }
        )
    return rows


def late_signal(rng: random.Random, n: int = 600, filler: int = 40) -> list[dict]:
    """The class word after ``filler`` words: beyond a window of 32 tokens."""
    rows = []
    for _ in range(n):
        animal = rng.choice(["cat", "dog"])
        rows.append({"text": " ".join(rng.choices(FILLER, k=filler) + [animal]), "label": f"{animal} person"})
    return rows


def lines(output: str, prefix: str) -> dict[str, float]:
    found = [line for line in output.splitlines() if line.startswith(prefix)]
    if not found:
        return {}
    return {k: float(v) for k, v in (item.split("=") for item in found[-1][len(prefix):].split())}


def card_matches_log(run: Path, output: str) -> bool:
    """The card's validation table equals what the run logged at the exported step (its metrics.csv row)."""
    card = (run / "hf_model" / "README.md").read_text()
    step = int(re.search(r"Validation at step (\d+)", card)[1])
    table = dict(re.findall(r"^\| (\S+) \| ([0-9.\-]+) \|$", card, re.M))
    with open(run / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val_loss")]
    logged = {}
    for row in rows:  # the validation logged at the exported step (metrics.csv has counted steps from 0 or from 1)
        if int(row["step"]) in (step - 1, step):
            logged = {k.removeprefix("val_"): float(v) for k, v in row.items() if k.startswith("val_") and v}
    return bool(logged) and all(abs(float(table[k]) - v) < 5e-5 for k, v in logged.items())


def fit(out: Path, name: str, data: Path, *more: str) -> tuple[dict, Path, str, float]:
    root = out / name
    args = [sys.executable, "-m", "lit_memory", "fit", "--recipe", "4gb", f"--data.source={data}",
            f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false", *more]
    start = time.time()
    done = subprocess.run(args, capture_output=True, text=True)
    seconds = time.time() - start
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{output[-3000:]}")
    run = root / "lightning_logs" / "version_0"
    (root / "fit.log").write_text(output)
    return lines(done.stdout, "val: "), run, output, seconds


def evaluate(out: Path, run: Path, data: Path, subcommand: str = "test") -> dict:
    best = next((run / "checkpoints").glob("best-*.ckpt"))
    # The data typed again: a file a config names outside its folder and the working folder is read only when typed
    # (docs/sharing.md), and these runs live in --out.
    done = subprocess.run(
        [sys.executable, "-m", "lit_memory", subcommand, "--config", str(run / "config.yaml"), f"--ckpt_path={best}",
         f"--data.source={data}", f"--trainer.default_root_dir={out / 'eval'}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return lines(done.stdout, f"{subcommand}: ")


def data_line(output: str) -> str:
    return next((line for line in output.splitlines() if line.startswith("data: ")), "")


def case_imbalance(out: Path, results: dict) -> None:
    data = write(out / "imbalanced.csv", imbalanced(random.Random(0)))
    for weights in ("none", "balanced"):
        val, run, output, seconds = fit(out, f"imbalance-{weights}", data, f"--model.class_weights={weights}",
                                        "--data.max_length=32", "--trainer.max_epochs=3", "--data.val_fraction=0.2",
                                        "--data.test_fraction=0.2")
        test = evaluate(out, run, data)
        results[f"imbalance {weights}"] = {"val f1 (rare)": val.get("f1"), "test f1 (rare)": test.get("f1"),
                                           "test f1_macro": test.get("f1_macro"), "seconds": round(seconds),
                                           "card = log": card_matches_log(run, output)}


def case_thresholds(out: Path, results: dict) -> None:
    data = write(out / "weak.jsonl", weak_labels(random.Random(0)))
    val, run, output, seconds = fit(out, "thresholds", data, "--data.max_length=32", "--trainer.max_epochs=4")
    saved = json.loads((run / "hf_model" / "config.json").read_text())["thresholds"]
    texts = write(out / "weak-texts.jsonl", [{"text": r["text"]} for r in weak_labels(random.Random(1), 50)])
    done = subprocess.run(
        [sys.executable, "-m", "lit_memory", "predict", "--config", str(run / "config.yaml"), f"--data.source={data}",
         f"--model.model_name_or_path={run / 'hf_model'}", f"--data.predict_path={texts}",
         f"--output={out / 'predict' / 'predictions.jsonl'}", f"--trainer.default_root_dir={out / 'predict'}"],
        capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    predicted = [json.loads(line) for line in (out / "predict" / "predictions.jsonl").read_text().splitlines()]
    applied = all(row["labels"] == [a for a in sorted(saved) if row[f"prob_{a}"] >= saved[a]] for row in predicted)
    results["thresholds"] = {
        "val f1_micro (tuned)": val.get("f1_micro"), "val f1_micro at 0.5": val.get("f1_micro_at_0.5"),
        "thresholds": saved, "predict applies them": applied,
        "predict says so": "thresholds (saved in" in done.stderr, "seconds": round(seconds),
        "card = log": card_matches_log(run, output),
    }


def case_defaults(out: Path, results: dict) -> None:
    data = write(out / "pairs.csv", pairs(random.Random(0)))
    for name, more in (("defaults", []), ("one epoch", ["--trainer.max_epochs=1"])):
        val, run, output, seconds = fit(out, f"defaults-{name.replace(' ', '-')}", data, *more)
        results[f"600 pairs, {name}"] = {
            "val pearson": val.get("pearson"),
            "steps": data_line(output).rsplit("; ", 1)[-1],
            "seconds": round(seconds),
            "card = log": card_matches_log(run, output),
        }


def case_long(out: Path, results: dict) -> None:
    data = write(out / "late.csv", late_signal(random.Random(0)))
    for how in ("truncate", "chunk"):
        val, run, output, seconds = fit(out, f"long-{how}", data, f"--data.long_texts={how}", "--data.max_length=32",
                                        "--trainer.max_epochs=2")
        results[f"late signal, {how}"] = {"val acc": val.get("acc"), "val f1_macro": val.get("f1_macro"),
                                          "seconds": round(seconds), "card = log": card_matches_log(run, output)}


CASES = {"imbalance": case_imbalance, "thresholds": case_thresholds, "defaults": case_defaults, "long": case_long}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for name in args.cases:
        CASES[name](args.out, results)
        for key, value in results.items():
            print(f"{key}: {value}", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
