"""Exact resume: a fit killed part-way and resumed from a checkpoint ends with the weights of the
run that was never interrupted.

Lightning's checkpoints already hold the weights, the optimizer and LR-scheduler states and the
loops' progress (global step, epoch, batch index). What they lack, and this module adds:

- the data order: `ResumableSampler` shuffles as a function of (seed, epoch) only, like torch's
  `DistributedSampler` (it is one, so under DDP/FSDP it also shards, and Lightning calls its
  ``set_epoch``); `ResumableDataLoader` reports how far into the epoch it is, and Lightning saves
  that in the checkpoint and hands it back on resume (its stateful-dataloader interface);
- the random-number state: `ExactResume` saves the torch (CPU and CUDA), numpy and Python states
  of every rank in the checkpoint and restores each rank's own when training restarts, so dropout
  draws the masks the uninterrupted run drew (with fewer or more visible GPUs than when saved, the
  process's own GPU's, with one warning line: `CudaRandom`);
- checkpoints often enough to matter: `ResumeCheckpoint`, the checkpoint ``fit`` keeps by default
  (every `EVERY_N_TRAIN_STEPS` steps, ``last.ckpt`` linked to the newest), and
  ``--ckpt_path last`` finds the newest ``last.ckpt`` of the earlier runs in the same log folder;
- the validation of the step a checkpoint is written at: Lightning writes a step's checkpoint before that step's
  validation runs and, resumed from it, goes on without running it, so the best-model record
  (`lit_memory.run.best.BestCheckpoint`) would miss it and the resumed run export another step than the uninterrupted
  one. `ResumeCheckpoint` writes such a step's checkpoint before its validation, as Lightning does, marked as owing
  it, and again after it (the same file, now holding the validation in the record); a run resumed from the first
  (killed during the validation) runs the validation before training goes on. Either way the run resumes at the
  step the checkpoint was written at and its record ends as the uninterrupted run's.

Exactness holds while nothing between the checkpoint and the next training step draws from the
global random generators: the data module's loaders draw from generators of their own.

Everything saved is tensors and plain data, so a run resumes from its own checkpoints under the
untrusted rules (`lit_memory.sandbox.guard`). `check_resume` refuses, with one line, resuming with settings
other than the ones a checkpoint was made with (`RESUME_KEYS`, stored in it by the recipe callback).
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union

import torch
import torch.distributed as dist
from jsonargparse import Namespace
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit_memory.errors import UserError
from lit_memory.optim.precision import trains_with
from lit_memory.run.best import BestCheckpoint, ValidationStep
from lit_memory.sandbox import checkpoint_reading, guard
from lit_memory.sandbox.rules import phase
from lit_memory.settings import Precision, key_of

# The default checkpoint interval, in optimizer steps: 16,000 samples at the recipes' batch of 32, so
# long runs are saved several times an epoch and short ones (the bundled 4,000 samples) at their end.
EVERY_N_TRAIN_STEPS = 500


class ResumableSampler(DistributedSampler):
    """Shuffle as a function of (seed, epoch) only, shard over ``num_replicas``, and, once after a
    resume, start the epoch part-way.

    torch's `DistributedSampler` already shuffles by (seed, epoch) and Lightning calls its
    ``set_epoch`` before every epoch; this adds the start. Being a `DistributedSampler`, it is kept
    as it is under DDP/FSDP (Lightning injects its own only in place of other samplers), so build it
    with the trainer's ``distributed_sampler_kwargs``.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.start = 0  # the sample of this rank's share the pass in progress began at
        self._resume: Optional[tuple[int, int]] = None

    def resume(self, epoch: int, start: int) -> None:
        """Begin the next pass at sample ``start`` of this rank's share, if it is epoch ``epoch``."""
        self._resume = (epoch, start)

    def __iter__(self) -> Iterator[int]:
        # A generator: the order is drawn at the first index taken, after Lightning's set_epoch,
        # not when the DataLoader makes its iterator (Lightning makes one before restoring).
        resume, self._resume = self._resume, None
        # Lightning decides the epoch: a checkpoint written after an epoch's last batch, or at the
        # end of a fit that stopped part-way, goes on with a new epoch from its first sample.
        self.start = resume[1] if resume is not None and resume[0] == self.epoch else 0
        yield from itertools.islice(super().__iter__(), self.start, None)


class ResumableDataLoader(DataLoader):
    """A training DataLoader over a `ResumableSampler` whose position inside the epoch is saved in
    checkpoints: Lightning saves ``state_dict()`` of any training loader that has one and hands it
    back to ``load_state_dict()`` on resume, and the loader then goes on from there.
    """

    _epoch = 0
    _handed_out = 0  # batches of the pass in progress handed out so far

    def __iter__(self) -> Iterator[Any]:
        # Also a generator, so this runs when the pass really begins, with the sampler's.
        self._epoch, self._handed_out = self.sampler.epoch, 0
        for batch in super().__iter__():
            self._handed_out += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batches": self.sampler.start // self.batch_size + self._handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.resume(state["epoch"], state["batches"] * self.batch_size)


class ExactResume(Callback):
    """Save every rank's random-number state in checkpoints; on resume, restore each rank's own
    just before training restarts, and restore the training loader's position where Lightning
    did not (see `_restore_loader_states`).

    The states are gathered from all ranks into the checkpoint's trainer state (for FSDP's sharded
    checkpoints that is the ``meta.pt`` rank 0 writes), a few KiB per rank. ``cuda``: the CUDA random
    states (`CudaRandom`; a test gives a fake).
    """

    def __init__(self, cuda: Optional["CudaRandom"] = None) -> None:
        self._states: Optional[list[dict[str, Any]]] = None
        self.cuda = cuda or CudaRandom()

    def state_dict(self) -> dict[str, Any]:
        # Called on every rank while a checkpoint is written, right after the step it follows.
        return {"rng": _all_gather(_rng_states(self.cuda))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._states = state["rng"]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _restore_loader_states(trainer)
        if self._states is None:
            return
        states, self._states = self._states, None
        if len(states) != trainer.world_size:
            _warn(
                f"the checkpoint was written by {len(states)} processes and this run has {trainer.world_size}: "
                "training goes on resharded (weights and optimizer state), with other data shards and random states, "
                "so not bit-exact with the interrupted run"
            )
            return
        mine = _from_checkpoint(states[trainer.global_rank])
        _set_rng_states({k: v for k, v in mine.items() if k not in ("torch.cuda", CUDA_DEVICE)})
        self.cuda.restore(mine.get("torch.cuda", []), mine.get(CUDA_DEVICE))


CUDA_DEVICE = "torch.cuda.device"  # beside Lightning's "torch.cuda" list: the index of the process's own GPU in it


class CudaRandom:
    """The CUDA random states of the visible GPUs (torch's: one state per visible device, by index) and the
    process's own GPU, behind a handle that a test replaces by a fake.

    A checkpoint holds one state per GPU its process saw; a resumed run may see fewer or more (another machine,
    another ``CUDA_VISIBLE_DEVICES``), where restoring by index (Lightning's ``_set_rng_states``) fails with an
    IndexError. Then the process's own GPU gets the state its GPU had when saved, the others keep theirs, with one
    warning line: that GPU's draws (dropout) go on as the interrupted run's."""

    def __init__(self, cuda: Any = torch.cuda) -> None:
        self.cuda = cuda

    def states(self) -> dict[str, Any]:
        if not self.cuda.is_available():
            return {"torch.cuda": []}
        return {"torch.cuda": self.cuda.get_rng_state_all(), CUDA_DEVICE: self.cuda.current_device()}

    def restore(self, states: list[torch.Tensor], device: Optional[int]) -> None:
        visible = self.cuda.device_count() if self.cuda.is_available() else 0
        if len(states) == visible:
            if states:
                self.cuda.set_rng_state_all(states)
            return
        own = self.cuda.current_device() if visible else None
        restored = own is not None and device is not None and device < len(states)
        if restored:
            self.cuda.set_rng_state(states[device], own)
        kept = f"its own GPU's restored (saved as cuda:{device}, now cuda:{own})" if restored else "them as they are"
        others = ", the other GPUs' as they are" if restored and visible > 1 else ""
        _warn(
            f"the checkpoint holds the CUDA random states of {len(states)} visible GPUs and this process sees "
            f"{visible}: training goes on with {kept}{others}"
        )


@rank_zero_only
def _warn(message: str) -> None:
    """One warning line, from rank 0 (as the CLI's other warnings)."""
    print(f"warning: {message}", file=sys.stderr)


def _restore_loader_states(trainer: Trainer) -> None:
    """Hand the training loaders their saved states where Lightning has not.

    Lightning loads them when it first builds the training loaders after a restore, but a
    ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` (for the LR
    schedule's length) builds them before the restore, and they then never get their states
    (Lightning-AI/pytorch-lightning#20550, open in 2.6). Done here, just before the first batch is fetched, with
    Lightning's own methods; a no-op once Lightning has loaded them itself.
    """
    loop = trainer.fit_loop
    if not loop._combined_loader_states_to_load or loop._data_fetcher is None:
        return
    loop._load_combined_loader_states()
    iter(loop._data_fetcher)  # the loaders' iterators were made before the states were loaded


def _rng_states(cuda: CudaRandom) -> dict[str, Any]:
    states = {**_collect_rng_states(include_cuda=False), **cuda.states()}
    if "numpy" in states:  # its key array as a tensor: checkpoints load with weights_only=True
        kind, keys, *rest = states["numpy"]
        states["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), *rest)
    return states


def _from_checkpoint(states: dict[str, Any]) -> dict[str, Any]:
    if "numpy" in states:
        kind, keys, *rest = states["numpy"]
        states = {**states, "numpy": (kind, keys.numpy().astype("uint32"), *rest)}
    return states


def _all_gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


class ResumeCheckpoint(ModelCheckpoint):
    """Lightning's `ModelCheckpoint` with defaults for long runs, the checkpoint ``fit`` keeps when
    none is configured: one every ``every_n_train_steps`` optimizer steps (the previous one removed)
    and ``last.ckpt`` linked to it, so ``--ckpt_path last`` resumes from the newest.

    Each run logs into a new ``version_N`` folder; ``ckpt_path="last"`` here also looks in the
    earlier ones, so a run killed in ``version_0`` resumes from ``version_0/checkpoints/last.ckpt``.
    """

    def __init__(
        self,
        every_n_train_steps: int = EVERY_N_TRAIN_STEPS,
        save_last: Optional[Union[bool, Literal["link"]]] = "link",
        **kwargs: Any,
    ) -> None:
        super().__init__(every_n_train_steps=every_n_train_steps, save_last=save_last, **kwargs)
        self._in_run_folder = kwargs.get("dirpath") is None
        self._owed: Optional[int] = None  # the step whose checkpoint was written before the step's validation ran

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # The best-model record updates itself at on_validation_end before this writes it into a checkpoint. A new
        # list: Lightning is going through the old one, calling each callback's setup.
        callbacks = trainer.callbacks
        best = [c for c in callbacks if isinstance(c, BestCheckpoint)]
        if best and callbacks.index(self) < max(callbacks.index(b) for b in best):
            rest = [c for c in callbacks if c is not self]
            rest.insert(max(rest.index(b) for b in best) + 1, self)
            trainer.callbacks = rest

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "validation_owed": self._owed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._owed = state_dict.get("validation_owed")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Written now, as Lightning does (a kill during the validation that follows loses no steps), saying that the
        # step's validation is owed; written again once it is in the best-model record (`on_validation_end`).
        step = trainer.global_step
        due = self._every_n_train_steps >= 1 and step % self._every_n_train_steps == 0 and step > 0
        self._owed = step if due and validates_next(trainer) else None
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._last_global_step_saved != step:
            self._owed = None  # not written at this step

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Resumed from a checkpoint written before its step's validation (killed during it): Lightning takes a
        # checkpoint written at a batch's end as validated and goes on, so the validation runs now, as it would have.
        if self._owed is not None and self._owed == trainer.global_step:
            validate_now(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._owed is not None and self._owed == trainer.global_step and not trainer.sanity_checking:
            self._owed = None  # the step's checkpoint again, now holding its validation (same file, replaced)
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)

    def _find_last_checkpoints(self, trainer: Trainer) -> set[str]:
        # Lightning's "last" looks only in this run's own folder (private API, checked by tests/run/test_resume.py).
        found = super()._find_last_checkpoints(trainer)
        if self._in_run_folder and trainer.loggers:
            logger = trainer.loggers[0]
            runs = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name)
            last = re.compile(rf"{self.CHECKPOINT_NAME_LAST}(-v\d+)?{re.escape(self.FILE_EXTENSION)}")
            for link in runs.glob("*/checkpoints/*"):
                if not last.fullmatch(link.name):
                    continue
                if link.exists():
                    found.add(str(link))
                elif link.is_symlink():
                    # Killed after the previous checkpoint was removed and before last.ckpt was relinked
                    # to the new one, which is whole: Lightning then takes the newest of the run's.
                    found |= {str(p) for p in link.parent.glob(f"*{self.FILE_EXTENSION}") if p.exists()}
        return found


def validates_next(trainer: Trainer) -> bool:
    """Whether the fit loop validates right after the batch that just ended: Lightning's own decision, asked of its
    training epoch loop (private in 2.6; tests/run/test_resume.py checks it against the validations that run)."""
    loop = trainer.fit_loop.epoch_loop
    # The validation loop skips a validation set without a batch ([]: not counted yet, before its first validation).
    batches = trainer.num_val_batches
    batches = batches if isinstance(batches, list) else [batches]
    return loop._should_check_val_fx(trainer.fit_loop._data_fetcher) and (not batches or sum(batches) > 0)


def validate_now(trainer: Trainer) -> None:
    """Run the fit's validation between two training batches, as Lightning's training epoch loop does after a batch
    (its ``on_advance_end``)."""
    phase("training")  # not a confined run's preparation, which its watchdog bounds in time
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    val_loop.restarting = False  # a fresh validation, not the rest of one restored from the checkpoint
    trainer.validating = True
    val_loop.run()
    trainer.training = True


def fit_callbacks(callbacks: Optional[list[Callback]], enable_checkpointing: Optional[bool]) -> list[Callback]:
    """The configured callbacks plus what exact resume needs: `ExactResume`, and `ResumeCheckpoint`
    unless checkpointing is off (``enable_checkpointing: false``) or a `ModelCheckpoint` is configured; the
    best validated checkpoint (`lit_memory.run.best.BestCheckpoint`) unless checkpointing is off or one is configured;
    and one step numbering in the logs (`lit_memory.run.best.ValidationStep`)."""
    callbacks = list(callbacks or [])
    if not any(isinstance(c, ExactResume) for c in callbacks):
        callbacks.append(ExactResume())
    if not any(isinstance(c, ValidationStep) for c in callbacks):
        callbacks.append(ValidationStep())
    if enable_checkpointing is not False:
        if not any(isinstance(c, BestCheckpoint) for c in callbacks):
            callbacks.append(BestCheckpoint())  # the best validated weights, which hf_model/ is exported from
        if not any(isinstance(c, ModelCheckpoint) and not isinstance(c, BestCheckpoint) for c in callbacks):
            callbacks.append(ResumeCheckpoint())  # after the best-model record: it writes the record's state
    return callbacks


# -- resuming with the settings the checkpoint was made with ----------------------------------

# Settings that decide what a checkpoint's state means: resuming with other values is refused.
# Strategy is not among them (fused and unfused state have one format); how long to train is not either.
RESUME_KEYS = (
    "model.model_name_or_path", "model.num_labels", "model.problem_type", "model.pretrained", "model.config_overrides",
    "model.freeze", "model.lora", "model.embedding_optimizer_state", "model.optimizer.class_path",
    "trainer.precision", "trainer.accumulate_grad_batches",
    "data.source", "data.subset", "data.train_split", "data.text_column", "data.label_column", "data.label_names",
    "data.max_length",
    "data.batch_size", "data.limit_train_samples", "data.seed", "data.long_texts", "data.stride",
)
RESUME_STATE = "lit_memory_settings"  # the checkpoint key holding them


def resume_settings(settings: Namespace) -> dict[str, Any]:
    """The `RESUME_KEYS` of one subcommand's settings, as plain data (checkpoints load weights-only). The
    precision is the one the run trains with: a checkpoint holds it after the CLI's CPU bf16 fallback, and
    resuming compares settings before that fallback runs (`lit_memory.optim.precision.trains_with`)."""
    out = {}
    for key in RESUME_KEYS:
        value = settings.get(key)
        out[key] = value.as_dict() if isinstance(value, Namespace) else value
    out["trainer.precision"] = trains_with(
        out["trainer.precision"],
        settings.get("trainer.accelerator"),
        settings.get("cpu_bf16_fallback", True) is not False,
    )
    return out


def check_resume(settings: Namespace, compare: bool = True) -> None:
    """Refuse a checkpoint that cannot be read with ``weights_only=True`` and, when ``compare``, one made
    with other settings, with one line naming the differences. Paths the trust checks refuse (remote,
    Lightning's special names) are theirs to report."""
    ckpt_path = settings.get("ckpt_path")
    if ckpt_path is None or ckpt_path in guard.SPECIAL_CKPT or guard.is_remote(str(ckpt_path)):
        return
    path = Path(ckpt_path).expanduser()
    if not path.exists():
        return
    saved = saved_settings(path)
    if saved is None or not compare:
        return  # a checkpoint from elsewhere, without our record: Lightning checks what it can
    mine = resume_settings(settings)
    for key in INFERRED:  # left to the data here: the checkpoint's are what its data showed, and are taken
        if mine.get(key) is None and saved.get(key) is not None:
            _set(settings, key, saved[key])
            mine[key] = saved[key]
    differ = [k for k in RESUME_KEYS if k in saved and _canonical(k, saved[k]) != _canonical(k, mine[k])]
    if differ:
        details = "; ".join(f"{k}: {saved[k]!r} in the checkpoint, {mine[k]!r} here" for k in differ)
        raise UserError(
            f"checkpoint {ckpt_path} was made with other settings ({details}): resume with the settings it was "
            "made with (its run folder's recipe.yaml) or start a new run without ckpt_path"
        )


# Settings a fit reads from the data's labels where they are not set (`lit_memory.fine_tune.read_data`).
INFERRED = ("model.num_labels", "model.problem_type", "data.label_names")


def _set(settings: Namespace, key: str, value: Any) -> None:
    settings[key] = value
    if key.startswith("model."):  # the data module follows the model (linked)
        linked = "data." + key.split(".", 1)[1]
        if linked in settings:
            settings[linked] = value


def saved_settings(path: Path) -> Optional[dict[str, Any]]:
    """The settings a checkpoint was made with, read with ``weights_only=True`` (a distributed
    checkpoint folder keeps them in Lightning's ``meta.pt``)."""
    return saved_entry(path, RESUME_STATE)


def saved_entry(path: Path, key: str) -> Any:
    """One top-level entry of a checkpoint (None where it has none), read with ``weights_only=True``; a distributed
    checkpoint folder keeps everything but the weights and optimizer state in Lightning's ``meta.pt``."""
    file = path / "meta.pt" if path.is_dir() else path
    if not file.is_file():
        return None
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=not path.is_dir())
    except Exception as err:
        raise UserError(
            f"cannot load checkpoint {path} with weights_only=True: {checkpoint_reading.load_error(err)}"
        ) from None
    return checkpoint.get(key) if isinstance(checkpoint, dict) else None


def _canonical(key: str, value: Any) -> str:
    """What two values of ``key`` are compared by: a precision by Lightning's name for it (``bf16`` is
    ``bf16-mixed``), anything else by its plain data (`lit_memory.settings.key_of`)."""
    if key == "trainer.precision" and (precision := Precision.known(value)) is not None:
        value = precision.name
    return key_of(value)
