"""A classifier end to end: fit (its log, its label names, its memory table), then predict files of texts with its
checkpoint or its exported model folder, streamed in and written out whole."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST, write_csv, write_jsonl

from lit_memory.__main__ import main
from lit_memory.cli import resolve
from lit_memory.data import FILE_FORMATS
from lit_memory.errors import UserError
from lit_memory.hf.tokenizing import load_tokenizer
from lit_memory.memory.measure import records
from lit_memory.run import predict_file as predictions
from lit_memory.task import kind_of

ROWS = [
    {"id": "a1", "text": "great hotel, friendly staff", "label": "positive"},
    {"id": "b2", "text": "dirty room and rude staff", "label": "negative"},
    {"id": "c3", "text": "", "label": "negative"},  # an empty text still gets its row
    {"id": "d4", "text": "NA", "label": "positive"},  # a text pandas would read as missing
    {"id": "e5", "text": "would stay again, superb view", "label": "neutral"},  # a label the model does not know
    {"id": "f6", "text": 'a "quoted", line\nwith a newline', "label": ""},  # no label
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    """A 2-step fit of the bundled model, its output going to a log (not a terminal), with a checkpoint."""
    root = tmp_path_factory.mktemp("fit")
    out = io.StringIO()
    args = ["--trainer.enable_checkpointing=true", "--trainer.enable_progress_bar=true", "--progress.interval=1e-6",
            "--trainer.log_every_n_steps=1"]  # the loss is read on the steps the loggers write
    with contextlib.redirect_stdout(out):
        main(["fit", *FAST, *args, f"--trainer.default_root_dir={root}"])
    return root / "lightning_logs" / "version_0", out.getvalue()


def test_a_fit_logs_progress_lines_when_its_output_is_not_a_terminal(run):
    _, out = run
    lines = [line for line in out.splitlines() if line.startswith("train step ")]
    first, last = lines[0], lines[-1]
    for part in ("train step 1/2 (50%)", "epoch 1/1", "loss ", " samples/s", "peak RSS "):
        assert part in first, (part, first)
    assert "ETA " not in first  # the time left is measured over the steps after the first (warm-up)
    assert any(line.startswith("train step 2/2 (100%)") and "ETA " in line for line in lines[1:-1])
    assert last.startswith("train step 2/2 (100%)") and " took " in last
    assert float(last.split("loss ")[1].split()[0]) > 0
    assert any(line.startswith("validation at step 2 (epoch 1): val_acc=") for line in out.splitlines())
    assert "━" not in out  # no rich bar in a log


def test_the_memory_table_compares_the_tracked_batches_with_predictions_for_their_shape(run):
    run_dir, out = run
    memory = records.read_memory(run_dir)
    assert memory["batch_shape"] == [32, 128] and memory["padding"] == "longest"
    rows, tokens = memory["longest_batch"]["tracked"]
    assert rows == 32 and tokens < 100  # dynamic padding: the bundled tweets are short
    worst = memory["predicted"]["analytic"]["peak_bytes"]
    at_longest = memory["predicted_at_longest"]["tracked"]["analytic"]["peak_bytes"]
    assert at_longest < 0.8 * worst
    # Like with like: the prediction for the batch that reached the tracked peak is within 10 % of it (the one for
    # 32 x 128 was 2.3x it).
    at_peak = (memory["predicted_at_longest"].get("tracked_peak") or memory["predicted_at_longest"]["tracked"])[
        "analytic"
    ]
    assert at_peak["peak_bytes"] == pytest.approx(memory["measured"]["tracked"]["peak_bytes"], rel=0.10)
    table = out[out.index("memory on cpu"):].splitlines()
    assert table[0].startswith(f"memory on cpu, batch 32 x {tokens} tokens (the longest tracked batch)")
    assert any(line.startswith("  shorter batches: dynamic padding (data.padding: longest)") for line in table)
    fits = next(
        line
        for line in table
        if line.startswith("  fits (worst case: every batch 32 x 128, padded to max_length): analytic")
    )
    assert records.format_bytes(worst) in fits


def test_label_names_travel_with_the_checkpoint_and_the_exported_model(run):
    run_dir, _ = run
    config = json.loads((run_dir / "hf_model" / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert checkpoint["id2label"] == {0: "negative", 1: "positive"}


def test_the_model_card_is_in_the_hubs_layout_with_the_metrics_the_run_logged_at_the_exported_step(run, capsys):
    from huggingface_hub import ModelCard

    run_dir, out = run
    card = ModelCard.load(run_dir / "hf_model" / "README.md")
    assert (card.data.library_name, card.data.pipeline_tag) == ("transformers", "text-classification")
    (line,) = [line for line in out.splitlines() if line.startswith("validation at step 2 (epoch 1): ")]
    logged = {k.removeprefix("val_"): float(v) for k, v in (p.split("=") for p in line.split(": ", 1)[1].split())}
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == logged  # the hub's model-index
    assert "Validation at step 2, the step exported" in card.text
    for name, value in logged.items():
        assert f"| {name} | {value:.4f} |" in card.text
    for part in ("train 64 of 18,512 · validation 16", "single_label_classification: 2 classes (negative, positive)",
                 "2 optimizer steps", "measured peak memory: ", "tracked tensors", "on CPU"):
        assert part in card.text, part
    # its code loads the model with transformers' pipeline and labels texts
    code = (
        card.text.split("```python\n", 1)[1].split("```", 1)[0].replace("path/to/hf_model", str(run_dir / "hf_model"))
    )
    capsys.readouterr()
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.split()
    assert len(printed) == 2 and set(printed) <= {"negative", "positive"}


def predict(argv: list[str], capsys) -> tuple[Path, str]:
    cli = resolve(["predict", *argv])
    cli.launch()
    assert cli.trainer.predict_loop.return_predictions is False  # written per batch, never all kept
    captured = capsys.readouterr()
    (line,) = [line for line in captured.out.splitlines() if line.startswith("predictions: ")]
    return Path(
        line.rsplit(" written to ", 1)[1].removesuffix(" (replacing the file there)")
    ), captured.out + captured.err


def reference_probs(model_dir: Path, texts: list[str]) -> torch.Tensor:
    """Plain transformers on the exported folder."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = load_tokenizer(str(model_dir))
    with torch.no_grad():
        batch = tokenizer(texts, truncation=True, max_length=128, padding=True, return_tensors="pt")
        return model(**batch).logits.softmax(-1)


def test_predict_from_the_checkpoint_writes_a_row_per_input_and_the_metrics(run, tmp_path, capsys):
    run_dir, _ = run
    texts = write_csv(tmp_path / "texts.csv", ROWS)
    root = tmp_path / "predict"
    command = ["--config", str(run_dir / "config.yaml"), "--ckpt_path", str(run_dir / "checkpoints" / "last.ckpt"),
               "--data.predict_path", str(texts), f"--trainer.default_root_dir={root}"]
    before = sorted(p.name for p in run_dir.iterdir())
    path, out = predict(command, capsys)
    # beside the model: in its checkpoint's run folder, and nothing else written (no run folder of its own)
    assert path == run_dir / "predictions.csv" and "replacing" not in out
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([*before, "predictions.csv"]) and not root.exists()
    first = path.read_bytes()
    again, out_again = predict(command, capsys)  # the same call again: the same file, replaced, and said so
    assert again == path and path.read_bytes() == first and "(replacing the file there)" in out_again
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([*before, "predictions.csv"]) and not root.exists()
    with open(path, newline="", encoding="utf-8") as f:
        written = list(csv.DictReader(f))
    assert list(written[0]) == ["id", "label", "prob_negative", "prob_positive", "given_label"]
    assert [r["id"] for r in written] == [r["id"] for r in ROWS]
    probs = torch.tensor([[float(r["prob_negative"]), float(r["prob_positive"])] for r in written])
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(ROWS)), atol=1e-5, rtol=0)
    assert [r["label"] for r in written] == [["negative", "positive"][i] for i in probs.argmax(-1).tolist()]
    assert [r["given_label"] for r in written] == [r["label"] for r in ROWS]
    # The checkpoint's weights, exactly as plain transformers computes with the exported folder.
    expected = reference_probs(run_dir / "hf_model", [r["text"] for r in ROWS])
    torch.testing.assert_close(probs, expected, atol=2e-6, rtol=0)
    # Metrics over the rows whose label the model knows (4 of 6).
    known = [
        (i, ["negative", "positive"].index(r["label"]))
        for i, r in enumerate(ROWS)
        if r["label"] in ("negative", "positive")
    ]
    accuracy = sum(int(probs[i].argmax()) == y for i, y in known) / len(known)
    loss = -sum(math.log(expected[i, y]) for i, y in known) / len(known)
    (line,) = [line for line in out.splitlines() if line.startswith("predict: ")]
    values = dict(part.split("=") for part in line[len("predict: "):].split())
    assert float(values["acc"]) == pytest.approx(accuracy, abs=1e-4)
    assert float(values["loss"]) == pytest.approx(loss, abs=1e-4)
    assert "note: 1 row(s) have a label the model does not know (its labels: negative, positive)" in out


def test_predict_from_the_exported_folder_without_labels_or_a_checkpoint(run, tmp_path, capsys):
    run_dir, _ = run
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": r["text"]} for r in ROWS])
    path, out = predict(
        ["--config", str(run_dir / "config.yaml"), "--model.model_name_or_path", str(run_dir / "hf_model"),
         "--data.predict_path", str(texts), "--output", str(tmp_path / "out" / "labelled.jsonl")],
        capsys,
    )
    written = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert path == tmp_path / "out" / "labelled.jsonl"  # the file named, in the format its suffix names
    assert [r["text"] for r in written] == [r["text"] for r in ROWS]
    assert list(written[0]) == ["text", "label", "prob_negative", "prob_positive"]  # the names came with the folder
    probs = torch.tensor([[r["prob_negative"], r["prob_positive"]] for r in written])
    torch.testing.assert_close(
        probs, reference_probs(run_dir / "hf_model", [r["text"] for r in ROWS]), atol=2e-6, rtol=0
    )
    assert "predict: " not in out  # no labels, no metrics


def test_bad_input_to_predict_is_one_line_and_writes_nothing(run, tmp_path, capsys):
    run_dir, _ = run
    no_text = write_csv(tmp_path / "no_text.csv", [{"body": "hello", "label": 1}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = {
        str(tmp_path / "missing.csv"): f"error: data.predict_path: file not found: {tmp_path / 'missing.csv'}",
        str(
            no_text
        ): f"error: no text column in {no_text}: its columns are ['body', 'label']; looked for text, sentence, review",
        str(empty): f"error: data.predict_path: {empty} is empty",
    }
    root = tmp_path / "runs"
    for source, expected in cases.items():
        with pytest.raises(SystemExit) as exit_:
            main(
                [
                    "predict",
                    "--config",
                    str(run_dir / "config.yaml"),
                    "--model.model_name_or_path",
                    str(run_dir / "hf_model"),
                    "--data.predict_path",
                    source,
                    f"--trainer.default_root_dir={root}",
                ]
            )
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(expected)
        assert not root.exists()


def test_predictions_go_to_the_output_named_else_beside_the_model(tmp_path):
    """``--output`` a file (its suffix the format) or a folder (``predictions.<format>`` inside); by default the run
    folder of the checkpoint or of the exported model folder, or beneath the root for a model from the Hub."""
    run = tmp_path / "lightning_logs" / "version_3"
    (run / "hf_model").mkdir(parents=True)
    (tmp_path / "existing").mkdir()
    where = predictions.destination
    assert where(None, None, str(run / "checkpoints" / "best-step=8.ckpt")) == (run / "predictions.csv", "csv")
    assert where(None, "tsv", str(run / "checkpoints" / "last.ckpt")) == (run / "predictions.tsv", "tsv")
    assert where(None, None, str(tmp_path / "model.ckpt")) == (tmp_path / "predictions.csv", "csv")  # no checkpoints/
    assert where(None, "jsonl", None, str(run / "hf_model")) == (run / "predictions.jsonl", "jsonl")
    assert where(None, None, None, "bundled:minilm", str(tmp_path)) == (
        tmp_path / "lightning_logs" / "predict" / "predictions.csv", "csv")
    assert where(None, None, None, "org/model", None) == (Path("lightning_logs/predict/predictions.csv"), "csv")
    assert where(str(tmp_path / "a.jsonl"), None) == (tmp_path / "a.jsonl", "jsonl")
    assert where(str(tmp_path / "a.txt"), "tsv") == (tmp_path / "a.txt", "tsv")
    assert where(str(tmp_path / "existing"), None) == (tmp_path / "existing" / "predictions.csv", "csv")
    assert where(str(tmp_path / "new") + "/", "jsonl") == (tmp_path / "new" / "predictions.jsonl", "jsonl")
    assert where(str(tmp_path / "results"), None) == (tmp_path / "results" / "predictions.csv", "csv")  # no suffix
    with pytest.raises(UserError, match=r"^--output .*a.csv is a .csv file and predictions.format is jsonl: name a "
                                         r"\.jsonl file, or leave predictions.format out$"):
        where(str(tmp_path / "a.csv"), "jsonl")
    with pytest.raises(UserError, match=r"^predictions.format must be one of csv, tsv, jsonl, got 'xml'$"):
        where(None, "xml", str(run / "checkpoints" / "last.ckpt"))


def test_predict_says_where_its_output_goes_in_its_help_and_refuses_to_replace_the_texts(tmp_path, capsys):
    texts = write_csv(tmp_path / "texts.csv", ROWS)
    main(["predict", "--help"])  # the short help, answered before torch (no exit)
    first = capsys.readouterr().out.split("\n\n")[1]  # the options set first
    assert "--output" in first and "beside the model" in first
    with pytest.raises(SystemExit) as exit_:
        main(["predict", "--data.predict_path", str(texts), "--output", str(texts)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: the predictions would replace {texts}, the file predicted: name another file with --output")


# -- reading: every format, streamed --------------------------------------------------------------


def test_every_format_reads_the_same_rows(tmp_path):
    data = [{"id": i, "text": f"text {i}", "label": i % 2} for i in range(5)]
    files = [
        write_csv(tmp_path / "t.csv", data),
        write_csv(tmp_path / "t.tsv", data, sep="\t"),
        write_jsonl(tmp_path / "t.jsonl", data),
        write_jsonl(tmp_path / "lines.json", data),  # JSON lines in a .json file
    ]
    (tmp_path / "t.json").write_text(json.dumps(data, indent=1))  # an array, decoded item by item
    for path in [*files, tmp_path / "t.json"]:
        rows = list(predictions.read_texts(path, FILE_FORMATS))
        assert [(r["id"], r["text"], r["label"]) for r in rows] == [(d["id"], d["text"], d["label"]) for d in data], (
            path
        )
    (tmp_path / "strings.json").write_text('["one", "two"]')
    assert list(predictions.read_texts(tmp_path / "strings.json", FILE_FORMATS)) == [{"text": "one"}, {"text": "two"}]


def test_columns_are_found_by_their_usual_names_or_as_set():
    """Texts to predict are read by the training data's rule (`lit_memory.task.find_columns`): labels optional."""
    from lit_memory.task import Columns, find_columns, id_column

    assert find_columns(["id", "sentence", "labels"], require_label=False) == Columns(("sentence",), ("labels",))
    assert id_column(["id", "sentence", "labels"], None, "f") == "id"
    assert find_columns(["body", "stars"], "body", "stars", require_label=False) == Columns(("body",), ("stars",))
    assert find_columns(["body"], "body", "stars", require_label=False) == Columns(("body",), ())  # labels optional
    # the training data's own columns (the bundled tweets': text, sentiment) come first
    found = find_columns(["text", "sentiment"], None, None, require_label=False, usual_label=("sentiment",))
    assert found == Columns(("text",), ("sentiment",))
    with pytest.raises(UserError, match=r"f has no column 'key'; its columns are \['body'\] \(set data.id_column\)"):
        id_column(["body"], "key", "f")


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux's per-process I/O counters")
@pytest.mark.parametrize("suffix", ["csv", "jsonl", "json"])
def test_a_large_file_is_read_as_it_is_consumed(tmp_path, suffix):
    """The first batch of a 24 MB file costs a fraction of reading it: it is streamed, never read whole."""
    path = tmp_path / f"big.{suffix}"
    row = "x" * 100
    with open(path, "w") as f:
        if suffix == "csv":
            f.write("id,text\n" + "".join(f"{i},{row}\n" for i in range(200_000)))
        elif suffix == "jsonl":
            f.write("".join(f'{{"id": {i}, "text": "{row}"}}\n' for i in range(200_000)))
        else:
            f.write("[" + ",".join(f'{{"id": {i}, "text": "{row}"}}' for i in range(200_000)) + "]")
    size = path.stat().st_size
    before = bytes_read()
    rows = iter(predictions.Rows(predictions.read_texts(path, FILE_FORMATS)))
    first = [next(rows) for _ in range(32)]
    assert [index for index, _ in first] == list(range(32))
    assert bytes_read() - before < size / 4, (bytes_read() - before, size)


def test_rows_are_dealt_over_the_ranks_and_padded_to_the_same_count():
    for total in (7, 8, 1):
        for world_size in (2, 3):
            shares = [list(predictions.Rows(range(total), rank, world_size)) for rank in range(world_size)]
            assert len({len(share) for share in shares}) == 1  # the same number of batches everywhere
            real = sorted(index for share in shares for index, _ in share if index >= 0)
            assert real == list(range(total))
            assert all(row is None for share in shares for index, row in share if index < 0)


def test_the_writer_gathers_every_ranks_rows_in_input_order(tmp_path, monkeypatch):
    """Two ranks: rank 0 writes both ranks' rows of each batch, in input order; padding rows are dropped."""
    tokenizer = load_tokenizer("bundled:minilm")
    texts = [{"text": f"text {i}", "label": ["negative", "positive"][i % 2]} for i in range(5)]
    from lit_memory.task import Columns

    collate = predictions.Collate(
        tokenizer, 16, "longest", Columns(("text",), ("label",)), None, ["negative", "positive"]
    )
    batches = {
        rank: [collate(list(predictions.Rows(texts, rank, 2))[i:i + 2]) for i in (0, 2)] for rank in (0, 1)
    }
    assert [b["rows"]["index"] for b in batches[0]] == [[0, 2], [4]]
    assert [b["rows"]["index"] for b in batches[1]] == [[1, 3], [-1]]  # padded to rank 0's count
    step = {"n": 0}

    def all_gather_object(out, mine):  # what rank 1 sends for the same batch
        other = batches[1][step["n"]]
        probs = torch.tensor([[0.25, 0.75]] * len(other["rows"]["index"]))
        out[0], out[1] = mine, [
            row for row in zip(other["rows"]["index"], other["rows"]["key"], probs.tolist(), other["known"].tolist(),
                               other["rows"]["given"]) if row[0] >= 0
        ]

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    writer = predictions.PredictionWriter("csv")
    trainer = SimpleNamespace(log_dir=str(tmp_path), default_root_dir=str(tmp_path), world_size=2, is_global_zero=True)
    module = SimpleNamespace(label_names=["negative", "positive"], predict_step=lambda batch, batch_idx: None,
                             kind=kind_of("single_label_classification"))
    writer.setup(trainer, module, "predict")
    writer.on_predict_start(trainer, module)
    for n, batch in enumerate(batches[0]):
        step["n"] = n
        probs = torch.tensor([[0.9, 0.1]] * len(batch["rows"]["index"]))
        writer.write_on_batch_end(trainer, module, {"outputs": probs}, None, batch, n, 0)
    writer.on_predict_end(trainer, module)
    with open(tmp_path / "predictions.csv", newline="") as f:
        written = list(csv.DictReader(f))
    assert [r["text"] for r in written] == [t["text"] for t in texts]
    assert [r["label"] for r in written] == ["negative", "positive", "negative", "positive", "negative"]
    assert [r["given_label"] for r in written] == [t["label"] for t in texts]
