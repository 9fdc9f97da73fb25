"""The trust guard at the sinks: where a run unpickles, imports model code or picks a checkpoint.

`lit_memory.config.trust` decides, once per run, whether the files a run was given (recipes, configs,
checkpoints, model folders, run folders) are trusted (``--trust-recipe``), and the run holds `enforced` for its
length. Checks on
parsed values cannot see what is loaded later by paths they never saw (a checkpoint Lightning finds by
itself, a rank-local metadata file, a pickled item inside a checkpoint folder), so untrusted, the rules
hold where the loading happens:

- **every** ``torch.load`` in the process is weights-only (tensors and plain data) while the run lasts: torch's
  own switch, ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, which overrides ``weights_only=False`` at every call site (Lightning's
  ``meta.pt``, the non-tensor items torch's distributed-checkpoint planner loads, transformers' ``.bin`` weights);
- the two unpicklers that bypass ``torch.load`` are restricted: torch's distributed-checkpoint reader
  reads ``.metadata`` and rank-local ``__N.metadata`` with plain `pickle.load`, and Lightning's FSDP
  strategy reads single-file checkpoints with an unpickler of its own (`harden`);
- every strategy's checkpoint IO (Lightning's built-in ones a recipe may name included) goes through
  `GuardedCheckpointIO`: local paths only, weights-only loads, saves that never follow a link;
- before a run starts, `preflight` refuses a checkpoint Lightning would pick by itself (SLURM's
  ``hpc_ckpt_N.ckpt``, an ``OnExceptionCheckpoint``'s file) and checks the one it will load with the
  restricted readers;
- checkpoint cadence and count over all of a run's checkpoint callbacks (`RunBounds`): at most
  `MAX_KEPT_CHECKPOINTS` kept together and on average at least `MIN_CHECKPOINT_STEPS` optimizer steps apart, judged
  once the training data is loaded (an epoch's length decides an every-N-epochs cadence) and counted again at every
  save, whatever callback asks (one ``error:`` line: N callbacks saving every epoch of one batch kept 28 checkpoints
  in 24 steps);
- Hugging Face loaders get ``trust_remote_code=False`` unless the user typed otherwise
  (`pretrained_kwargs`); a local model folder is checked before transformers reads it (files within
  their bounds, no Hub kernel or quantizer in its config.json, a tokenizer that does not multiply
  texts: `check_model_folder`), and the loaded config and tokenizer again whatever their source
  (`check_config`, `check_normalizer`).

Where an untrusted run reads and writes, what it reaches and how much memory, disk and time it takes, the kernel
and the sandbox's watchdog enforce (`lit_memory.sandbox`): nothing here judges a path the run writes.

Checkpoints are read within bounds (`lit_memory.sandbox.bounds`): metadata files are regular and of bounded
size, zip records do not expand past a ratio, before anything is unpickled or inflated.

lit_memory's own checkpoints (a single file; FSDP2 folders with RNG and sampler state) are tensors and
plain data, so resuming one's own run never needs ``--trust-recipe``. Without a decision (lit_memory
used as a library, by the caller's own code) nothing here restricts anything.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities import load as lightning_load
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.states import TrainerFn
from torch import _weights_only_unpickler as unpickler
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.metadata import StorageMeta
from transformers import CONFIG_MAPPING

from lit_memory import files
from lit_memory.errors import UserError
from lit_memory.policy import phases
from lit_memory.policy.checkpoints import (  # noqa: F401  (the policy's; callers name them here)
    MAX_KEPT_CHECKPOINTS,
    MIN_CHECKPOINT_STEPS,
    SPECIAL_CKPT,
    checkpoint_load,
    save_budget,
)
from lit_memory.policy.code import (  # noqa: F401
    CODE_SETTINGS,
    KERNEL_PATTERN,
    KERNEL_SETTINGS,
    code_setting,
    config_code_problems,
)
from lit_memory.policy.reads import is_remote
from lit_memory.policy.refusal import HINT, Context
from lit_memory.sandbox import TRUST_FLAG, bounds
from lit_memory.sandbox.checkpoint_reading import checkpoint_problem, load_metadata

FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.serialization reads it at every torch.load
NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"

_trusted: Optional[bool] = None  # None: no run's decision holds now (library use)
_own_folders: list[Path] = []  # folders the user typed: what Lightning finds there by itself is theirs


@contextlib.contextmanager
def enforced(trusted: bool, approved: Mapping[str, str] = {}) -> Iterator[None]:
    """Apply a run's trust decision to every sink in this process for the length of the block (`lit_memory.config.trust`
    makes sure a trusted decision never lifts an untrusted one inside it). Untrusted, torch's weights-only switch
    is set for every ``torch.load`` (children started meanwhile inherit it); at the end the switch, the decision
    and what the run recorded here (the folders and settings the user typed) are as they were before it.
    ``approved``: real paths of files whose content the user approved with a trusted config (`approved`)."""
    global _trusted, _typed, _approved
    harden()
    global _typed_values
    saved = (_trusted, list(_own_folders), _typed, _typed_values, _approved)
    switches = {name: os.environ.get(name) for name in (FORCE_WEIGHTS_ONLY, NO_WEIGHTS_ONLY)}
    _trusted = trusted
    _approved = frozenset(approved)
    if not trusted:
        os.environ[FORCE_WEIGHTS_ONLY] = "1"
        os.environ.pop(NO_WEIGHTS_ONLY, None)  # torch refuses both set
    try:
        yield
    finally:
        _trusted, own, _typed, _typed_values, _approved = saved
        _own_folders[:] = own
        for name, value in switches.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def restricted() -> bool:
    """Whether the untrusted rules hold in this process."""
    return _trusted is False


_approved: frozenset[str] = frozenset()  # files the user approved by content with a trusted config (`enforced`)


def approved(path: Any) -> bool:
    """Whether the user approved ``path``'s content with a config they trusted (a file, or a folder all of whose files
    they approved): what it holds is theirs, read as theirs."""
    if not _approved:
        return False
    real = Path(os.path.realpath(path))
    if real.is_dir():
        found = [str(p) for p in real.rglob("*") if p.is_file()]
        return bool(found) and all(f in _approved for f in found)
    return str(real) in _approved


# -- paths -------------------------------------------------------------------------------------

# -- the unpicklers that bypass torch.load ---------------------------------------------------

_hardened = False


def harden() -> None:
    """Route the two unpicklers that bypass ``torch.load`` through the restricted ones while `restricted`.

    Both are replaced on their classes, once per process, because Lightning builds them inside its
    strategies where no argument reaches them; each replacement behaves as the original when trusted.
    tests/sandbox/test_guard.py checks that both targets still exist in the installed versions.
    """
    global _hardened
    if _hardened:
        return
    read_metadata = filesystem.FileSystemReader.read_metadata

    def guarded_read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not restricted():
            return read_metadata(self, *args, **kwargs)
        # torch's own method, with the restricted unpickler in place of pickle.load
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = load_metadata(io.BytesIO(bounds.read_bytes(path, bounds.METADATA_BYTES, "checkpoint metadata")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    filesystem.FileSystemReader.read_metadata = guarded_read_metadata

    find_class = lightning_load._LazyLoadingUnpickler.find_class

    def guarded_find_class(self: Any, module: str, name: str) -> Any:
        if restricted() and f"{module}.{name}" not in _weights_only_globals():
            raise pickle.UnpicklingError(
                f"{module}.{name} is not allowed by weights_only=True loading; {TRUST_FLAG} lifts this"
            )
        return find_class(self, module, name)

    lightning_load._LazyLoadingUnpickler.find_class = guarded_find_class
    _hardened = True


def _weights_only_globals() -> set[str]:
    """What torch's weights-only unpickler allows: its defaults plus `torch.serialization.add_safe_globals`."""
    return set(unpickler._get_allowed_globals()) | set(unpickler._get_user_allowed_globals())


# -- Lightning's checkpoint IO ---------------------------------------------------------------


class GuardedCheckpointIO(CheckpointIO):
    """Any strategy's checkpoint IO under the guard. Always: a save never writes through a link
    (`lit_memory.files`). While `restricted`: loads of local paths only, weights-only. (Where an untrusted run
    writes is the kernel's to enforce: `lit_memory.sandbox`.)"""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if type(self.inner) is not TorchCheckpointIO or is_remote(str(path)) or storage_options is not None:
            files.refuse_link(path)
            return self.inner.save_checkpoint(checkpoint, path, storage_options)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()  # as TorchCheckpointIO: serialise first, then write the file at once
        torch.save(checkpoint, buffer)
        files.write_bytes(path, buffer.getvalue())

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        if restricted():
            if is_remote(str(path)):
                raise UserError(f"refusing to load checkpoint {path}: it is not a local file; {HINT}")
            weights_only = True
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        if os.path.islink(path):
            os.unlink(path)  # the link, not what it points at
            return
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()



def install(trainer: Any) -> None:
    """Put a trainer under the guard: its strategy's checkpoint IO (whichever strategy a recipe named),
    and the one place Lightning decides which checkpoint a run loads (``_select_ckpt_path``, private: the
    check must see exactly the path Lightning picks, including the ones it picks by itself)."""
    strategy = trainer.strategy
    if not isinstance(strategy.checkpoint_io, GuardedCheckpointIO):
        strategy.checkpoint_io = GuardedCheckpointIO(strategy.checkpoint_io)
    connector = trainer._checkpoint_connector
    if getattr(connector, "_lit_memory_guarded", False):
        return
    select = connector._select_ckpt_path

    def guarded_select(state_fn: Any, ckpt_path: Any, model_provided: bool, model_connected: bool) -> Any:
        found = select(state_fn, ckpt_path, model_provided=model_provided, model_connected=model_connected)
        if restricted():
            check_selected(connector, ckpt_path, found)
        return found

    connector._select_ckpt_path = guarded_select
    connector._lit_memory_guarded = True


class RunBounds(Callback):
    """The bounds that hold for a fit's whole length, untrusted: checkpoints over all callbacks, judged once the
    training data is loaded (`checkpoint_load`) and counted at every save the strategy makes, whichever callback asks
    (`save_budget`: an every-N-epochs cadence or a validation every step is seen here whatever its settings said).
    ``exempt``: the callbacks the user typed and lit_memory's own, whose saves are not counted."""

    def __init__(self, exempt: Callable[[Any], bool] = lambda c: False) -> None:
        self.exempt = exempt

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if restricted() and stage == "fit":
            self._count_saves(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if restricted():  # the run phase's rules of the policy, over the running trainer
            phases.refuse_first(phases.refusals("run", Context(trainer=trainer, exempt=self.exempt)))

    def _count_saves(self, trainer: Any) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "_lit_memory_counted", False):
            return
        save, saves, inside = strategy.save_checkpoint, [], [0]
        for callback in trainer.checkpoint_callbacks:
            if self.exempt(callback):  # what it saves is not counted
                callback._save_checkpoint = _not_counted(callback._save_checkpoint, inside)
        counted = sum(1 for c in trainer.checkpoint_callbacks if not self.exempt(c))

        def counted_save(checkpoint: dict[str, Any], filepath: Any, *args: Any, **kwargs: Any) -> Any:
            if restricted() and not inside[0]:
                saves.append(trainer.global_step)
                if len(saves) > save_budget(trainer.global_step, counted):
                    raise UserError(
                        f"refusing to save {filepath}: checkpoint {len(saves)} by step {trainer.global_step}, more "
                        "than "
                        f"one per {MIN_CHECKPOINT_STEPS} optimizer steps over all checkpoint callbacks; {HINT}"
                    )
            return save(checkpoint, filepath, *args, **kwargs)

        strategy.save_checkpoint = counted_save
        strategy._lit_memory_counted = True


def _not_counted(method: Callable[..., Any], inside: list[int]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        inside[0] += 1
        try:
            return method(*args, **kwargs)
        finally:
            inside[0] -= 1

    return call


# -- before a run starts ---------------------------------------------------------------------


def preflight(
    trainer: Any, subcommand: str, ckpt_path: Optional[str], own_folders: tuple[Any, ...] = (), model: Any = None
) -> None:
    """Untrusted: refuse, before anything is read, the checkpoint Lightning will pick when the run would load it
    unsafely (asked exactly as ``Trainer.<subcommand>`` will ask, through `install`'s check). ``own_folders``:
    folders the user typed (``--trainer.default_root_dir``, a callback's ``dirpath``): a checkpoint Lightning picks
    by itself there (SLURM's requeued job resuming) is theirs, and still read with the restricted readers."""
    if not restricted():
        return
    _own_folders[:] = [Path(os.path.realpath(f)) for f in own_folders if f and not is_remote(str(f))]
    state = trainer.state
    fn, state.fn = state.fn, TrainerFn(subcommand)  # Lightning resumes by itself only while fitting
    try:
        trainer._checkpoint_connector._select_ckpt_path(state.fn, ckpt_path, model_provided=True, model_connected=False)
    except UserError:
        raise
    except ValueError:
        pass  # e.g. "best" without a checkpoint callback: Lightning says so when it runs
    finally:
        state.fn = fn


def check_selected(connector: Any, ckpt_path: Any, found: Any) -> None:
    """Refuse a checkpoint Lightning picked by itself (``ckpt_path`` unset: SLURM's ``hpc_ckpt_N.ckpt`` in
    the run's root folder, an ``OnExceptionCheckpoint``'s file), a remote one, or one the restricted
    readers cannot read."""
    if found is None:
        return
    if ckpt_path is None and Path(os.path.realpath(os.path.dirname(os.path.abspath(found)))) not in _own_folders:
        why = (
            "SLURM's hpc checkpoint in trainer.default_root_dir"
            if SLURMEnvironment.detect() and str(found) == str(connector._hpc_resume_path)
            else "an OnExceptionCheckpoint's file, resumed automatically"
        )
        raise UserError(
            f"refusing to resume from {found}: Lightning picked it by itself ({why}) in a folder the recipe chose; "
            f"resume from it with --ckpt_path {found}, or pass {TRUST_FLAG} only if you trust its source"
        )
    if is_remote(str(found)):
        raise UserError(
            f"refusing ckpt_path={str(found)!r} (found for {ckpt_path!r}): it is not a local file or folder; {HINT}"
        )
    if problem := checkpoint_problem(found):
        raise UserError(f"refusing ckpt_path={str(found)!r}: {problem}; {HINT}")


def pretrained_kwargs(**kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for a Hugging Face ``from_pretrained``: untrusted, ``trust_remote_code=False``
    unless given (only a value the user typed gets here: `lit_memory.config.trust` refuses it from files), so
    transformers neither imports a model folder's ``auto_map`` code nor asks at the terminal."""
    if restricted():
        kwargs.setdefault("trust_remote_code", False)
    return kwargs


def hugging_face_error(err: Exception) -> Optional[str]:
    """The first line of transformers' refusal to run custom code, or None for other errors."""
    text = str(err)
    if "trust_remote_code" in text or "custom code" in text:
        return (
            "it needs the Python code shipped with it (transformers' trust_remote_code): "
            f"{text.strip().splitlines()[0]}"
        )
    return None


WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


_typed: frozenset[str] = frozenset()  # dotted keys the user typed (`set_typed`)
_typed_values: frozenset[str] = frozenset()  # the values they typed for them (a repository named on the command line)
_local_only = 0  # inside `local_only`: Hugging Face loads read the caches, never the Hub


def set_typed(keys: Any) -> None:
    """The settings the user typed (a dict of key to value, or the keys), for the checks made after parsing (a typed
    config override is theirs; a repository typed is loaded with their token)."""
    global _typed, _typed_values
    _typed = frozenset(keys)
    _typed_values = frozenset(str(v) for v in keys.values()) if isinstance(keys, dict) else frozenset()


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    """For the length of the block, Hugging Face loads through `call` read local files and the caches only: what the
    parent of a confined run estimates for a recipe reaches no server (`lit_memory.confine.hub` fetches, bounded)."""
    global _local_only
    _local_only += 1
    try:
        yield
    finally:
        _local_only -= 1


def check_config(config: Any, overrides: Optional[dict[str, Any]] = None) -> None:
    """Untrusted: refuse a loaded Hugging Face config (its file, the Hub's or a folder's, with the overrides)
    that would fetch or run code when the model is built, or name a model too large to build. An override
    the user typed is theirs."""
    if not restricted():
        return
    phases.refuse_first(phases.refusals("run", Context(config=config, typed_keys=tuple(_typed))))
    typed = {k.rsplit(".", 1)[-1] for k in _typed if k.startswith("model.config_overrides.")}
    if problem := bounds.model_size_problem(config, exempt=tuple(typed)):
        raise UserError(f"refusing the model config: {problem}; {HINT}")


def check_normalizer(tokenizer: Any, what: str) -> None:
    """Untrusted: refuse a loaded tokenizer whose normalizers would multiply every text (`bounds`)."""
    if not restricted():
        return
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None)
    if normalizer is None:
        return
    if problem := bounds.normalizer_problem(json.loads(normalizer.__getstate__())):
        raise UserError(f"refusing {what}: {problem}; {HINT}")


WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TEXT_SUFFIXES = {".json": bounds.JSON_BYTES, ".txt": bounds.TOKENIZER_BYTES, ".model": bounds.TOKENIZER_BYTES}


def model_folder_problems(folder: Path, loaders_refuse: bool = True) -> list[str]:
    """What loading a local Hugging Face model folder would refuse untrusted, found without loading it:
    files that are not regular (a FIFO, a device) or beyond their size bound (`bounds`), settings in
    its config.json that fetch or run code (`code_setting`), Python code it names (``auto_map``) for a
    model type transformers does not know (so it cannot load without running that code), a tokenizer
    whose normalizers multiply texts, and pickled weights that expand without bound or name anything
    weights-only loading refuses (torch's static scan of the pickle,
    `torch.serialization.get_unsafe_globals_in_checkpoint`). ``loaders_refuse=False`` leaves out what the
    loaders refuse by themselves when they get there (``auto_map`` code, pickles: `call`, weights-only loads)."""
    problems = []
    entries = sorted(folder.iterdir())
    for entry in entries:
        if entry.is_dir():
            continue
        limit = bounds.TOKENIZER_BYTES if entry.name == "tokenizer.json" else TEXT_SUFFIXES.get(entry.suffix)
        try:
            bounds.regular(entry, "model file", limit)
        except UserError as err:
            problems.append(str(err).removeprefix("refusing to read ").removeprefix("cannot read "))
    for name in ("config.json", "tokenizer_config.json"):
        if not os.path.lexists(folder / name):
            continue
        try:
            config = bounds.read_json(folder / name, what="model file")
        except UserError as err:
            problems.append(str(err).removeprefix("refusing to read "))
            continue
        except ValueError:
            continue  # not JSON: transformers says so
        if (
            loaders_refuse
            and isinstance(config, dict)
            and config.get("auto_map")
            and config.get("model_type") not in CONFIG_MAPPING
        ):
            problems.append(f"{folder / name} names Python code to load it with (auto_map) for a model type "
                            f"transformers does not know ({config.get('model_type')!r})")
        if name == "config.json" and isinstance(config, dict):
            problems += config_code_problems(config, str(folder / name))
    for index in (p for p in entries if p.name.endswith(".index.json") and p.is_file()):
        problems += _shard_problems(folder, index)
    if os.path.lexists(folder / "tokenizer.json") and (problem := bounds.tokenizer_problem(folder / "tokenizer.json")):
        problems.append(f"{folder / 'tokenizer.json'}: {problem}")
    for file in (p for p in entries if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        try:
            unsafe = bounds.unsafe_globals(file) if loaders_refuse else _zip_bounds(file)
        except bounds.BoundExceeded as err:
            problems.append(f"{file}: {err}")
            continue
        except Exception as err:  # noqa: BLE001  not a torch zip file: weights-only loading reads no more of it
            unsafe = [f"unreadable as a torch file ({str(err).splitlines()[0] if str(err) else type(err).__name__})"]
        if unsafe and loaders_refuse:
            problems.append(
                f"{file} is a pickle naming {', '.join(sorted(unsafe)[:3])}: weights-only loading refuses it"
            )
    return problems


def _shard_problems(folder: Path, index: Path) -> list[str]:
    """The shards a sharded model's index names that are not regular files (a FIFO blocks safetensors' reader
    forever, a device never ends) or lie outside the folder."""
    try:
        weight_map = bounds.read_json(index, what="model file").get("weight_map") or {}
    except (UserError, ValueError, AttributeError):
        return []  # not an index transformers can read: it says so
    problems = []
    for shard in dict.fromkeys(str(v) for v in weight_map.values()):
        relative = os.path.normpath(shard)
        if os.path.isabs(relative) or relative.split(os.sep)[0] == os.pardir:  # (a link inside may lead out: a cache's)
            problems.append(f"{index} names {shard}, outside the folder")
            continue
        try:
            bounds.regular(folder / relative, "model file")
        except UserError as err:
            problems.append(str(err).removeprefix("refusing to read ").removeprefix("cannot read "))
    return problems[:1]


def _zip_bounds(file: Path) -> list[str]:
    if problem := bounds.zip_problem(file):
        raise bounds.BoundExceeded(problem)
    return []


_checked_folders: dict[str, list[str]] = {}


def check_model_folder(name_or_path: Any, what: str) -> None:
    """Untrusted: refuse a local model or tokenizer folder with any of `model_folder_problems`, before
    transformers reads it (checked once per folder and process)."""
    if not restricted() or not isinstance(name_or_path, (str, os.PathLike)):
        return
    folder = Path(name_or_path)
    if not folder.is_dir() or approved(folder):
        return
    key = os.path.realpath(folder)
    if key not in _checked_folders:
        _checked_folders[key] = model_folder_problems(folder, loaders_refuse=False)
    if _checked_folders[key]:
        raise UserError(f"refusing {what}: {_checked_folders[key][0]}; {HINT}")


def call(load: Callable[..., Any], what: str, *args: Any, **kwargs: Any) -> Any:
    """``load(*args, **kwargs)`` with a refusal to run shipped code as one line. Untrusted, a repository the user did
    not type is loaded without their token (a recipe's choice of repository must not receive it: a private one of
    theirs, or a server that logs it); inside `local_only`, from the caches only."""
    if restricted() and args and str(args[0]) not in _typed_values:
        kwargs.setdefault("token", False)
    if _local_only:
        kwargs["local_files_only"] = True
    try:
        return load(*args, **pretrained_kwargs(**kwargs))
    except UserError:
        raise
    except ValueError as err:  # transformers' word for a folder it cannot load as asked
        if (reason := hugging_face_error(err)) is None:
            raise UserError(
                f"cannot load {what}: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}"
            ) from None
        raise UserError(f"refusing to load {what}: {reason}; pass {TRUST_FLAG} only if you trust its source") from None
