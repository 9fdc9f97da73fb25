from __future__ import annotations

import pytest
from conftest import rows, write_csv, write_jsonl

from lit_memory.data import FILE_FORMATS, TextClassificationData
from lit_memory.errors import UserError
from lit_memory.run.predict_file import read_texts


def make(source, **kwargs) -> TextClassificationData:
    kwargs.setdefault("limit_train_samples", None)
    return TextClassificationData(source=str(source), **kwargs)


def test_bundled_default_is_binary_tweets_with_requested_subset():
    dm = TextClassificationData(limit_train_samples=100, limit_eval_samples=50)
    dm.setup()
    assert [len(dm.splits[s]) for s in ("train", "validation", "test")] == [100, 50, 50]
    assert dm.resolved_label_names == ["negative", "positive"]
    labels = set(int(v) for v in dm.splits["train"]["labels"])
    assert labels == {0, 1}


def test_bundled_three_class_option():
    dm = TextClassificationData(num_labels=3, limit_train_samples=300, limit_eval_samples=10)
    dm.setup()
    assert dm.resolved_label_names == ["negative", "neutral", "positive"]
    assert set(int(v) for v in dm.splits["train"]["labels"]) == {0, 1, 2}


def test_csv_with_custom_columns_and_string_labels(tmp_path):
    path = write_csv(tmp_path / "d.csv", rows(40, text="comment", label="stars", as_names=True))
    dm = make(path, text_column="comment", label_column="stars")
    dm.setup()
    assert dm.resolved_label_names == ["negative", "positive"]  # sorted distinct names
    assert sum(len(dm.splits[s]) for s in ("train", "validation", "test")) == 40
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) >= {"input_ids", "attention_mask", "labels"}


def test_tsv_and_jsonl_with_custom_columns(tmp_path):
    tsv = write_csv(tmp_path / "d.tsv", rows(30, text="body", label="y"), sep="\t")
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows(30, text="body", label="y"))
    for path in (tsv, jsonl):
        dm = make(path, text_column="body", label_column="y")
        dm.setup()
        assert sum(len(dm.splits[s]) for s in ("train", "validation", "test")) == 30
        assert dm.resolved_label_names == ["0", "1"]  # integer labels are used as ids, named as the file writes them


def test_splits_are_stratified_and_reproducible(tmp_path):
    path = write_csv(tmp_path / "d.csv", rows(100))
    a, b = make(path, seed=1), make(path, seed=1)
    a.setup(), b.setup()
    assert a.splits["validation"][0]["input_ids"].tolist() == b.splits["validation"][0]["input_ids"].tolist()
    assert sorted(int(v) for v in a.splits["validation"]["labels"]) == [0] * 5 + [1] * 5


@pytest.mark.parametrize("padding", ["longest", "max_length"])
def test_padding_shapes(tmp_path, padding):
    dm = make(write_csv(tmp_path / "d.csv", rows(40)), padding=padding, max_length=48, batch_size=8)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    lengths = batch["attention_mask"].sum(-1)
    if padding == "max_length":
        assert batch["input_ids"].shape == (8, 48)
    else:  # padded to the longest sequence in this batch only
        assert batch["input_ids"].shape == (8, int(lengths.max()))
        assert batch["input_ids"].shape[1] < 48


def test_truncation_to_max_length(tmp_path):
    data = [{"review": "word " * 200, "label": i % 2} for i in range(20)]
    dm = make(write_csv(tmp_path / "d.csv", data), max_length=16)
    dm.setup()
    assert next(iter(dm.train_dataloader()))["input_ids"].shape[1] == 16


# -- errors: one clear line, raised before any training --------------------------------------


def test_missing_file():
    with pytest.raises(UserError, match="data file not found: nowhere/reviews.csv"):
        make("nowhere/reviews.csv")


def test_missing_column(tmp_path):
    data = write_csv(tmp_path / "d.csv", rows(20, text="body"))
    with pytest.raises(
        UserError, match=r"^no text column in .*d\.csv: its columns are \['body', 'label'\]; looked for text"
    ):
        make(data).prepare_data()
    with pytest.raises(UserError, match=r"^column 'review' not found in .*d\.csv; its columns are \['body', 'label'\]"):
        make(data, text_column="review").prepare_data()
    pairs = write_csv(tmp_path / "p.csv", [{"premise": "a b", "label": 0}, {"premise": "c d", "label": 1}] * 5)
    with pytest.raises(
        UserError, match=r"^column 'hypothesis' not found in .*p\.csv; its columns are \['premise', 'label'\]"
    ):
        make(pairs, text_column=["premise", "hypothesis"]).prepare_data()


def test_labels_outside_num_labels(tmp_path):
    data = rows(20)
    data[3]["label"] = 5
    dm = make(write_csv(tmp_path / "d.csv", data), num_labels=2)
    with pytest.raises(UserError, match=r"label 5 in column 'label' of .*d\.csv is outside num_labels=2"):
        dm.prepare_data()
    dm = make(write_csv(tmp_path / "d.csv", data))  # num_labels not set: the labels say 6 classes
    dm.prepare_data()
    assert dm.task.num_labels == 6 and dm.task.problem_type == "single_label_classification"


def test_too_many_string_labels(tmp_path):
    data = [{"review": f"text {i}", "label": f"c{i % 3}"} for i in range(30)]
    dm = make(write_csv(tmp_path / "d.csv", data), num_labels=2)
    with pytest.raises(UserError, match=r"3 label names .* but num_labels=2"):
        dm.prepare_data()


def test_empty_split_after_filtering(tmp_path):
    dm = make(write_csv(tmp_path / "d.csv", rows(20, as_names=True)), label_names=["bad", "worse"])
    with pytest.raises(UserError, match=r"the train split of .*d\.csv is empty after filtering: no row has a text"):
        dm.prepare_data()


def test_source_too_small_to_split(tmp_path):
    dm = make(write_csv(tmp_path / "d.csv", rows(2)))
    with pytest.raises(UserError, match=r"only 1 usable row\(s\) left: too few to split"):
        dm.prepare_data()


def test_zero_sample_limit_is_an_empty_split():
    with pytest.raises(UserError, match=r"the validation/test split would be empty: its sample limit is 0"):
        TextClassificationData(limit_eval_samples=0)


def test_bad_fractions():
    with pytest.raises(UserError, match="must leave data to train on"):
        TextClassificationData(val_fraction=0.6, test_fraction=0.5)


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"x")
    with pytest.raises(UserError, match="unsupported data file"):
        make(path)


def test_a_local_file_is_read_without_a_network_request(tmp_path, monkeypatch):
    """datasets reports each load of a builder to its S3 bucket (a HEAD request) unless told not to: reading the
    user's own file sends nothing (the box refused that lookup at the end of every untrusted fit)."""
    import datasets.load

    asked = []

    class Session:
        def head(self, url, **kwargs):
            asked.append(url)

    monkeypatch.setattr(datasets.load, "get_session", lambda: Session())
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    path = write_csv(tmp_path / "d.csv", rows(40))
    dm = TextClassificationData(source=str(path), text_column="review", label_column="label")
    dm.prepare_data()
    dm.setup("fit")
    rows_ = list(read_texts(path, FILE_FORMATS))  # the texts to predict: the same read, streamed
    assert len(rows_) == 40
    assert asked == [] and datasets.config.HF_UPDATE_DOWNLOAD_COUNTS is True  # nothing sent; the switch put back
    datasets.load.increase_load_count("csv")  # the same request outside the read: it would have been sent
    assert asked and "csv" in asked[0]


def test_a_users_file_trains_on_all_its_rows_and_the_line_says_where_they_went(tmp_path):
    """No demo limit on a user's data (the bundled tweets keep their CPU-sized subset, and say so); one line gives
    each split's size, where it came from, what was dropped, and the share of texts cut at max_length."""
    data = rows(100)
    data[5]["review"] = ""  # an empty text: dropped, counted
    data[7]["review"] = " ".join(["word"] * 50)  # longer than max_length 16: truncated, counted
    dm = make(write_csv(tmp_path / "mine.csv", data), limit_train_samples="auto", max_length=16)
    dm.prepare_data()
    assert [len(dm.splits[s]) for s in ("train", "validation", "test")] == [79, 10, 10]  # 99 usable rows, 80/10/10
    assert dm.summary.startswith(
        f"data: train 79 · validation 10 · test 10 rows of {tmp_path / 'mine.csv'} "
        "(single_label_classification: 2 classes (0, 1); text review, label label); validation "
        "and test carved out of train 10 % / 10 %; 1 row dropped: 1 with an empty text or "
        "no label"
    )
    share = 100 * sum(1 for r in data if len(r["review"].split()) > 10) / 79  # in train or not: at most this share
    assert (
        dm.summary.endswith("of training texts truncated at max_length 16")
        and float(dm.summary.split("; ")[-1].split()[0]) <= share
    )
    demo = TextClassificationData(limit_eval_samples=20)  # `auto`: the bundled demo keeps 4,000
    demo.prepare_data()
    assert len(demo.splits["train"]) == 4000
    assert (
        "training on data.limit_train_samples=4000 (the bundled demo's CPU-sized subset); null trains on all"
        in demo.summary
    )
    # the rows the demo leaves out, said as what they are: the neutral tweets
    assert (
        "15,018 rows dropped: labelled neutral (15,018), not in data.label_names (negative, positive)" in demo.summary
    )


def test_the_data_line_says_what_share_of_the_tokens_the_tokenizer_does_not_know_when_it_is_large(tmp_path):
    """Kaomoji the MiniLM tokenizer reads as its unknown token: the share of the training split's text tokens that
    are [UNK] (special tokens left out), counted, on the data: line from 5 %; a file of plain words: no word of it."""
    from lit_memory.hf.tokenizing import unknown_share

    faces = ["(╯°□°)╯︵ ┻━┻", "ʕ•ᴥ•ʔ", "(｡◕‿◕｡)", "¯\\_(ツ)_/¯"]
    data = [{"review": f"{faces[i % 4]} {'nice' if i % 2 else 'bad'} day", "label": i % 2} for i in range(60)]
    dm = make(write_csv(tmp_path / "faces.csv", data))
    dm.prepare_data()
    tokenizer, train = dm.tokenizer, dm.splits["train"]
    unk, special = tokenizer.unk_token_id, set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}
    tokens = [t for ids in train["input_ids"] for t in ids.tolist() if t not in special]
    share = sum(t == unk for t in tokens) / len(tokens)
    assert share > 0.05 and unknown_share(train.with_format(None), tokenizer) == pytest.approx(share)
    assert (f"; {100 * share:.1f} % of the training tokens are the tokenizer's unknown token [UNK] (characters it "
            "does not know: emoji, kaomoji, another script)") in dm.summary
    plain = make(write_csv(tmp_path / "plain.csv", rows(60)))
    plain.prepare_data()
    assert unknown_share(plain.splits["train"].with_format(None), plain.tokenizer) < 0.05
    assert "unknown token" not in plain.summary


def test_a_hub_dataset_is_named_with_its_configuration_and_its_own_splits(tmp_path, monkeypatch):
    """``--data.source nyu-mll/glue --data.subset mnli --data.validation_split validation_matched``: the configuration
    reaches the loader (the one place that downloads: replaced here by local files), the splits are taken by their
    names, the ClassLabel names become the classes, and a test split without labels (GLUE's -1) is replaced by
    validation. A split the dataset lacks is one line."""
    import datasets

    names = ["entailment", "neutral", "contradiction"]
    features = datasets.Features({"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=names)})

    def split(n, labelled=True):
        return datasets.Dataset.from_list(
            [{"premise": f"a {i}", "hypothesis": f"b {i}", "label": i % 3 if labelled else -1} for i in range(n)],
            features=features)

    asked = []

    def load(name, subset):
        asked.append((name, subset))
        return datasets.DatasetDict(train=split(30), validation_matched=split(9), validation_mismatched=split(6),
                                    test_matched=split(5, labelled=False))

    monkeypatch.setattr("lit_memory.data.load_hub_dataset", load)
    dm = make("nyu-mll/glue", subset="mnli", validation_split="validation_matched", test_split="test_matched")
    dm.prepare_data()
    assert asked == [("nyu-mll/glue", "mnli")]
    assert dm.task.columns.text == ("premise", "hypothesis") and dm.task.label_names == tuple(names)
    assert [len(dm.splits[s]) for s in ("train", "validation", "test")] == [30, 9, 9]
    assert ("rows of nyu-mll/glue (mnli) (single_label_classification: 3 classes (entailment, neutral, contradiction); "
            "text premise + hypothesis (a pair), label label); its test split has no labels: testing on validation"
            in dm.summary)
    with pytest.raises(
        UserError,
        match=r"^split 'validation' not found in nyu-mll/glue \(mnli\); its splits are "
        r"\['test_matched', 'train', 'validation_matched', 'validation_mismatched'\] \(data.validation_split\)",
    ):
        make("nyu-mll/glue", subset="mnli", validation_split="validation").prepare_data()
