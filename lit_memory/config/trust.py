"""The trust decision: what a run given files by someone else may make this process do.

A recipe, a config, a checkpoint or a run folder someone sent is not trusted; the command line the user
types is, and so are the configs they trusted by content (shipped ones, ``recipes trust``: `lit_memory.config.trusted`).
One `Decision` per run says which of them the run's settings came from and whether the user passed
``--trust-recipe``. With trusted configs the run is not confined and their values are the user's; what they did not
approve (a checkpoint, a model folder) is still judged at the sinks. Otherwise the decision is applied where things
happen, in these places:

- **imports**, while jsonargparse parses: its import-path policy (`import_policy`) refuses any
  class or callable outside `ALLOWLIST` (and where the object is really defined: a re-export such as
  ``lightning.pytorch.cli.os.system`` is ``os.system``); values typed ``Any`` stay plain data. Reading
  configs from URLs or fsspec chains is off in every run (`remote_configs_off`): a nested config is a
  local file or nothing.
- **values**, on the parsed settings (`Decision.refusals`), after parsing and again after LightningCLI
  merges a checkpoint's hyper-parameters: anything that would run code from elsewhere
  (``trust_remote_code``, ``weights_only`` other than true, Hugging Face loading options), name a
  remote location (a URL or fsspec chain anywhere), make transformers fetch or run code (a Hub kernel
  as attention implementation, a quantization config: `code_refusals`), leave the choice of checkpoint
  to Lightning (``ckpt_path: last/hpc/best`` from a file), or take the machine down (`BOUNDS`: worker
  and device processes, checkpoint cadence and count, sequence length). A value a parse of the command line alone produces is the
  user's own and exempt (`typed_values`), not whole subtrees merged under a key they typed.
- **sinks**, for everything loaded or written later by paths no parsed value shows: `lit_memory.sandbox.guard`
  (torch.load, torch's distributed-checkpoint reader, Lightning's checkpoint IO and the checkpoint it
  picks, Hugging Face loaders, the folders a run writes into), told the decision by `Decision.applied`.
- **configs read**, untrusted: every config file jsonargparse reads is a regular file within the size
  bound and its YAML's aliases and nesting are bounded before it is built (`bounded_config_reading`,
  `lit_memory.sandbox.bounds`).

Beyond all of these, ``python -m lit_memory`` runs an untrusted training or evaluation in a child process the
kernel confines (`lit_memory.sandbox`): what it reads, writes and reaches, whatever code asks.

``--trust-recipe`` lifts all of it. The decision holds for one run (`Decision.applied`: ``python -m lit_memory``
holds it from the command's first line to its last, the command line's run for each of its phases): jsonargparse's
settings, its config reading and torch's switch are process-wide, so they are set for the run and put back after
it. Inside an untrusted run nothing can be trusted; after it, the process is as it was.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import jsonargparse
import torch
import yaml
from jsonargparse import Namespace
from jsonargparse import Path as ConfigPath
from jsonargparse import _common
from jsonargparse._optionals import _get_config_read_mode

from lit_memory.sandbox import bounds, checkpoint_reading, guard
from lit_memory.optim.optimizers import IMPORTABLE
from lit_memory.errors import UserError
from lit_memory.settings import assign, dotted_leaves

TRUST_FLAG = guard.TRUST_FLAG
HINT = guard.HINT
# Import paths a recipe may name: optimizers (those of the libraries lit_memory knows: `lit_memory.optim.optimizers`),
# Lightning's own callbacks/loggers/strategies/plugins, this package and peft. An entry allows itself and everything
# under it.
ALLOWLIST = (
    *IMPORTABLE,
    "lightning",
    "lit_memory",
    "peft",
)
# Inside allowed packages: entry points that would parse a command line of their own (including the
# trust flag), and the guard's own machinery. The most specific entry decides.
DENYLIST = (
    "lightning.pytorch.cli",
    "lightning.fabric.cli",
    "lit_memory.cli", "lit_memory.config.arguments",
    "lit_memory.__main__",
    "lit_memory.config.trust",
    "lit_memory.config.shared_recipe.SaveRecipe",
    "lit_memory.sandbox.guard", "lit_memory.sandbox.checkpoint_reading",
    "lit_memory.files",
    "lit_memory.tools",
)
SPECIAL_CKPT = guard.SPECIAL_CKPT

# jsonargparse's settings the import policy changes (in its private `_common.parsing_settings`)
POLICY_SETTINGS = ("import_path_verdicts", "import_paths_enforced", "instantiate_subclass_spec_in_any")
_policy_depth = 0  # untrusted runs holding the import policy now (nested: a tool's run inside a command's)


@contextlib.contextmanager
def import_policy(extra: Sequence[str] = ()) -> Iterator[None]:
    """For the length of the block, jsonargparse refuses every import path outside `ALLOWLIST` (and ``extra``: the
    class paths a trusted config names) while parsing and while instantiating, and keeps values typed ``Any`` as data;
    then its settings are as they were.

    jsonargparse (4.53) keeps these settings in one process-wide table that its API only adds to
    (``set_parsing_settings``: a denied ``*`` cannot be taken back), has no public getter, and its ``parser_context``
    does not cover: so the table's entries are saved and put back here (tests/config/test_trust.py checks they exist)."""
    global _policy_depth

    saved = {key: _common.parsing_settings[key] for key in POLICY_SETTINGS}
    jsonargparse.set_parsing_settings(
        import_path_denylist=["*", *DENYLIST],
        import_path_allowlist=[*ALLOWLIST, *extra],
        instantiate_subclass_spec_in_any=False,
    )
    _policy_depth += 1
    try:
        yield
    finally:
        _policy_depth -= 1
        _common.parsing_settings.update(saved)


@contextlib.contextmanager
def plain_any_values() -> Iterator[None]:
    """For the length of the block, jsonargparse keeps a class spec inside a value typed ``Any`` as data (a key of
    ``model.config_overrides`` named ``class_path`` is a model setting, never a class to build), whoever wrote it."""
    saved = _common.parsing_settings["instantiate_subclass_spec_in_any"]
    jsonargparse.set_parsing_settings(instantiate_subclass_spec_in_any=False)
    try:
        yield
    finally:
        _common.parsing_settings["instantiate_subclass_spec_in_any"] = saved


def import_policy_enforced() -> bool:
    return _policy_depth > 0


_bound_error: Optional[UserError] = None  # the last bound a config broke (jsonargparse wraps errors in its own)
_typed_files: set[str] = set()  # files named on the command line: the user's, read as they are
_recipe_folders: set[str] = set()  # where a config a recipe names may lie (`recipe_folders`)
_reading: Optional[tuple[str, str]] = None  # (path, text) of the config just read, for the loader's refusal


@contextlib.contextmanager
def bounded_config_reading(typed_files: Iterator[str] = (), folders: Iterator[str] = ()) -> Iterator[None]:
    """Untrusted, for the length of the block: every config jsonargparse reads (``--config`` files, nested configs,
    a file given as a value) is a regular file within `bounds.CONFIG_BYTES` (a FIFO or /dev/zero is not read at all),
    and every YAML it loads has its aliases and nesting bounded (`bounds.check_yaml`), before it is built. A config
    a recipe names lies beneath ``folders`` (`recipe_folders`: its own folder, the working folder): a file of the
    user's elsewhere would become settings a run writes into its folder. Typed on the command line, a file is the
    user's and read as it is (``--config <(...)``). jsonargparse's YAML loader and its path reader are wrapped while
    the block lasts (its API sets a loader, `jsonargparse.set_loader`; the reader has none), and put back after."""
    typed = {os.path.realpath(f) for f in typed_files}
    load = jsonargparse.get_loader("yaml")
    read_text = ConfigPath.read_text
    global _bound_error
    saved_typed, saved_folders = set(_typed_files), set(_recipe_folders)
    _bound_error = None  # a refusal from an earlier command's parse is not this one's
    _typed_files.update(typed)
    _recipe_folders.update(os.path.realpath(f) for f in folders)

    def bounded_load(value: str) -> Any:
        global _reading
        if guard.restricted():
            where, _reading = (_reading[0] if _reading and _reading[1] == value else "a recipe or config"), None
            _check(bounds.check_yaml, value, where)
        return load(value)

    def bounded_read_text(self: Any) -> str:
        local = not (self._std_io or self._is_url or self._is_fsspec)
        global _reading
        real = os.path.realpath(self._absolute)
        typed_pipe = real in _typed_files and not os.path.isfile(self._absolute)
        if guard.restricted() and local and real not in _typed_files and _recipe_folders and not any(
                real == f or real.startswith(f.rstrip("/") + "/") for f in _recipe_folders):
            _check(_outside, str(self._absolute), real)
        if guard.restricted() and local and not typed_pipe:  # ``--config <(...)`` typed: the user's pipe
            text = _check(bounds.read_text, self._absolute, bounds.CONFIG_BYTES, "config")
        else:
            text = read_text(self)
        _reading = (str(self._absolute), text)  # the YAML loader names the file it refuses
        if local:
            _files_read.add(str(self._absolute))
        return text

    bounded = getattr(load, "bounded", False)  # an enclosing untrusted run's: it holds already
    if not bounded:
        bounded_load.bounded = True  # type: ignore[attr-defined]
        jsonargparse.set_loader("yaml", bounded_load, exceptions=(yaml.YAMLError,))
        ConfigPath.read_text = bounded_read_text
    try:
        yield
    finally:
        if not bounded:
            jsonargparse.set_loader("yaml", load, exceptions=(yaml.YAMLError,))
            ConfigPath.read_text = read_text
        _typed_files.clear()
        _typed_files.update(saved_typed)
        _recipe_folders.clear()
        _recipe_folders.update(saved_folders)


@contextlib.contextmanager
def pinned_config_reading(pinned: Mapping[str, str]) -> Iterator[None]:
    """For the length of the block, a config file the user trusted by content (``pinned``: real path -> sha256,
    `lit_memory.config.trusted.Verdict.pinned`) is read as bytes, checked against its digest and parsed from those
    same bytes: a file changed between the verdict and the parse is refused, not run."""
    read_text = ConfigPath.read_text

    def pinned_read_text(self: Any) -> str:
        local = not (self._std_io or self._is_url or self._is_fsspec)
        real = os.path.realpath(self._absolute) if local else ""
        if real not in pinned:
            text = read_text(self)
        else:
            data = bounds.read_bytes(self._absolute, bounds.CONFIG_BYTES, "config")
            if hashlib.sha256(data).hexdigest() != pinned[real]:
                raise UserError(f"refusing the config {self._absolute}: it changed while the run was starting; run "
                                "the command again")
            text = data.decode("utf-8")
        if local:
            _files_read.add(str(self._absolute))
        return text

    ConfigPath.read_text = pinned_read_text
    try:
        yield
    finally:
        ConfigPath.read_text = read_text


def _outside(path: str, real: str) -> None:
    raise bounds.BoundExceeded(
        f"refusing to read the config {path}: a config a recipe names is read only from beneath the recipe's folder or "
        f"the working folder ({', '.join(sorted(_recipe_folders))}), and it is {real}; name it with --config yourself "
        f"if you mean it, or {HINT}")


_files_read: set[str] = set()  # every local config file read so far (a confined child reads them again)


def files_read() -> set[str]:
    """The local config files this process's parses read (`lit_memory.confine.launch`: what a confined run may read)."""
    return set(_files_read)


def _check(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, remembering the bound it broke: jsonargparse reports a loader's error inside its own."""
    global _bound_error
    try:
        return fn(*args)
    except UserError as err:
        _bound_error = err
        raise


def bound_error() -> Optional[UserError]:
    """The bound a config broke during the parse that failed (and forget it)."""
    global _bound_error
    err, _bound_error = _bound_error, None
    return err


@contextlib.contextmanager
def remote_configs_off() -> Iterator[None]:
    """For the length of the block, jsonargparse reads no config given by URL or fsspec chain (LightningCLI turns
    fsspec on when imported): ``check``, ``fit``, ``estimate`` and ``plan`` never fetch a nested config. Then its
    reading modes are as they were."""
    mode = _get_config_read_mode()  # jsonargparse's own getter is deprecated; its setter is public
    jsonargparse.set_parsing_settings(config_read_mode_urls_enabled=False, config_read_mode_fsspec_enabled=False)
    try:
        yield
    finally:
        jsonargparse.set_parsing_settings(
            config_read_mode_urls_enabled="u" in mode, config_read_mode_fsspec_enabled="s" in mode
        )


# -- imports refused while parsing -------------------------------------------------------------

_DENIED = re.compile(r"Importing '([\w.]+)' is not allowed")
_KEY = re.compile(r'^(\s*)(?:- )?Parser key "([^"]+)"')
_REMOTE_CONFIG = re.compile(r"Unable to load config ['\"]([^'\"]+)['\"]")


def denied_imports(message: str) -> list[tuple[str, str, str]]:
    """(import path, key, outermost key) of each import jsonargparse refused, read from its nested
    parse error. The key joins the ``Parser key`` lines around the refusal: ``trainer.callbacks.on_fit_start``."""
    found: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    for line in message.splitlines():
        if match := _KEY.match(line):
            indent = len(match[1])
            stack = [(i, k) for i, k in stack if i < indent] + [(indent, match[2])]
        for path in _DENIED.findall(line):
            indent = len(line) - len(line.lstrip())
            keys = [k for i, k in stack if i < indent]
            entry = (path, ".".join(keys), keys[0] if keys else "")
            if entry not in found:
                found.append(entry)
    return found


def import_refusal(path: str, key: str) -> str:
    where = f" ({key})" if key else ""
    return f"refusing to import {path}{where}: outside the recipe allowlist ({', '.join(ALLOWLIST)}); {HINT}"


def remote_config(message: str) -> Optional[str]:
    """The URL or fsspec chain a parse error says could not be read as a config, if that is the error."""
    for url in _REMOTE_CONFIG.findall(message):
        if guard.is_remote(url):
            return url
    return None


def remote_config_refusal(url: str) -> str:
    return f"refusing to read the config {url}: configs are read from local files only (nothing is fetched); {HINT}"


# -- values ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """A value that would make us run or unpickle code from elsewhere, reach elsewhere, or overload the machine."""

    key: str
    value: Any
    reason: str
    safe: Any = None  # what a shared recipe.yaml writes instead (None: left as it is)

    def __str__(self) -> str:
        return f"refusing {self.key}={self.value!r}: {self.reason}; {HINT}"


# Hugging Face loading options that `model.config_overrides` would hand to `from_pretrained` along with
# the config's attributes: where to download from and to, what code to run.
HF_LOADING_OPTIONS = frozenset({
    "trust_remote_code", "cache_dir", "proxies", "token", "use_auth_token", "revision", "code_revision",
    "subfolder", "force_download", "local_files_only", "gguf_file", "user_agent",
})
MIN_CHECKPOINT_STEPS = guard.MIN_CHECKPOINT_STEPS  # a checkpoint every step of a large model fills a disk and starves training
MAX_KEPT_CHECKPOINTS = guard.MAX_KEPT_CHECKPOINTS
MIN_CHECKPOINT_SECONDS = 60
MAX_LENGTH = 131072  # tokens: the longest context of the families lit_memory knows


def _seconds(value: Any) -> Optional[float]:
    """A ``train_time_interval`` as jsonargparse leaves it (a timedelta, or its fields), in seconds."""
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (dict, Namespace)):
        try:
            return datetime.timedelta(**dict(value)).total_seconds()
        except TypeError:
            return None
    return None


def _cpus() -> int:
    return os.cpu_count() or 1


def _device_count(devices: Any) -> Optional[int]:
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int):
        return devices
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        return int(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    if isinstance(devices, (list, tuple)):
        return len(devices)
    return None  # "auto", -1: Lightning picks what the machine has


# (key's last part, refused when, reason): settings that can take the machine down however little
# the run trains. Checked wherever the key appears (a ModelCheckpoint's, a subclass's).
BOUNDS: tuple[tuple[str, Callable[[Any], bool], Callable[[Any], str]], ...] = (
    ("num_workers", lambda v: isinstance(v, int) and v > _cpus(),
     lambda v: f"more DataLoader worker processes than this machine's {_cpus()} CPU cores"),
    ("every_n_train_steps", lambda v: isinstance(v, int) and 0 < v < MIN_CHECKPOINT_STEPS,
     lambda v: f"a checkpoint more often than every {MIN_CHECKPOINT_STEPS} optimizer steps"),
    ("save_top_k", lambda v: isinstance(v, int) and (v < 0 or v > MAX_KEPT_CHECKPOINTS),
     lambda v: f"keeps {'every' if v < 0 else v} checkpoint{'s' if v != 1 else ''}, more than {MAX_KEPT_CHECKPOINTS}"),
    ("max_length", lambda v: isinstance(v, int) and v > MAX_LENGTH,
     lambda v: f"sequences of more than {MAX_LENGTH} tokens (memory while tokenising and padding grows with it)"),
    ("train_time_interval", lambda v: _seconds(v) is not None and _seconds(v) < MIN_CHECKPOINT_SECONDS,
     lambda v: f"a checkpoint more often than every {MIN_CHECKPOINT_SECONDS} seconds"),
)


def value_refusals(settings: Namespace) -> list[Refusal]:
    """Settings (one subcommand's) that need ``--trust-recipe`` whatever they point at."""
    code = code_refusals(settings.get("model.config_overrides") if isinstance(settings, Namespace) else None)
    refusals = list(code)
    for key, value in dotted_leaves(settings):
        name = key.rsplit(".", 1)[-1]
        parent = key.rsplit(".", 2)[-2] if key.count(".") else ""
        if name == "trust_remote_code" and value:
            refusals.append(Refusal(key, value, "it runs Python files shipped with the model or tokenizer", safe=False))
        elif key == "weights_only" and value is not True:
            refusals.append(Refusal(key, value, "unpickling a checkpoint runs any code it names", safe=True))
        elif parent == "config_overrides" and name == "auto_map":
            refusals.append(Refusal(key, value, "it names Python code to load the model with (for whoever loads its export)"))
        elif any(_under_key(key, r.key) for r in code):
            continue  # inside a refused config override (a quantization config's fields)
        elif parent == "config_overrides" and name != "trust_remote_code" and (name in HF_LOADING_OPTIONS or name[:1] == "_"):
            refusals.append(Refusal(key, value, "a Hugging Face loading option, not a model setting"))
        elif isinstance(value, str) and guard.is_remote(value) and key != "ckpt_path":
            refusals.append(Refusal(key, value, "it names a remote location: a recipe may name local files only "
                                                "(nothing is fetched from or sent to where it says)"))
        for bound, refused, reason in BOUNDS:
            if name == bound and refused(value):
                refusals.append(Refusal(key, value, reason(value)))
    devices = settings.get("trainer.devices")
    if (_device_count(devices) or 0) > _cpus() and _on_cpu(settings.get("trainer.accelerator")):
        refusals.append(Refusal("trainer.devices", devices, f"a process per CPU device, more than this machine's {_cpus()} cores"))
    return refusals


def code_refusals(overrides: Any, key: str = "model.config_overrides", depth: int = 0) -> list[Refusal]:
    """Config overrides that would make transformers fetch or run code (`guard.code_setting`): at the top or
    in a sub-config's dict (``text_config: {attn_implementation: org/kernel}``)."""
    if isinstance(overrides, Namespace):
        overrides = overrides.as_dict()
    if not isinstance(overrides, dict) or depth > 4:
        return []
    found = []
    for name, value in overrides.items():
        if reason := guard.code_setting(str(name), value):
            found.append(Refusal(f"{key}.{name}", value, reason))
        elif isinstance(value, dict):
            found += code_refusals(value, f"{key}.{name}", depth + 1)
    return found


def _under_key(key: str, parent: str) -> bool:
    return key == parent or key.startswith(parent + ".")


def _on_cpu(accelerator: Any) -> bool:
    """Whether Lightning would run on CPU processes (on GPUs it refuses more devices than exist)."""
    if isinstance(accelerator, str) and accelerator not in ("auto", "cpu"):
        return False
    if accelerator == "cpu":
        return True
    return not torch.cuda.is_available()


def checkpoint_refusals(ckpt_path: Any, typed: bool = False, approved: Mapping[str, str] = {}) -> list[Refusal]:
    """Refusals for a ``ckpt_path`` as Lightning resolves it: a path relative to the working folder,
    a URL or fsspec chain, a model registry name, or one of Lightning's special names. What a path
    points at is never the user's: checked wherever it was set, unless a config the user trusted named it (its content
    approved with the config: ``approved``). A single file is read by the resume check
    (`lit_memory.run.resume.check_resume`), weights-only."""
    if ckpt_path is None:
        return []
    ckpt_path = str(ckpt_path)
    if ckpt_path in SPECIAL_CKPT:
        if typed:
            return []  # the user's own choice: what Lightning finds is checked then (`guard.preflight`)
        return [Refusal("ckpt_path", ckpt_path, "Lightning would pick the checkpoint itself, in folders the recipe "
                        f"chose: name one with --ckpt_path PATH (or type --ckpt_path {ckpt_path} yourself)")]
    if ckpt_path.startswith("registry:"):
        return [Refusal("ckpt_path", ckpt_path, "it downloads a model from Lightning's model registry")]
    if guard.is_remote(ckpt_path):
        return [Refusal("ckpt_path", ckpt_path, "it is not a local file or folder: download it and pass the local path")]
    path = Path(ckpt_path).expanduser()
    if not path.exists():
        raise UserError(f"checkpoint not found: {ckpt_path} (a relative path is read from {Path.cwd()})")
    if guard.approved(path):  # named by a config the user trusted, whose content they approved with it
        return []
    if problem := checkpoint_reading.checkpoint_problem(path, files_too=False):
        return [Refusal("ckpt_path", ckpt_path, problem)]
    return []


@dataclass(frozen=True)
class Decision:
    """One run's trust decision: ``trusted`` (``--trust-recipe`` given: nothing is checked), ``configs_trusted`` (every
    config the run reads is shipped or trusted by the user by content, `lit_memory.config.trusted`: the run is not
    confined, its configs' values are the user's, and what they did not approve, a checkpoint or a model folder, is
    still read by the guard's rules) and ``typed``, the values that are the user's own (a parse of the command line
    alone; with trusted configs, every value they give too: `LitMemoryCLI.parse_arguments`). ``pinned``: real path ->
    sha256 of every file of the user's the verdict approved."""

    trusted: bool
    typed: Namespace = field(default_factory=Namespace)
    configs_trusted: bool = False
    pinned: Mapping[str, str] = field(default_factory=dict)
    why: str = ""  # the line an untrusted run's confinement starts with (`lit_memory.config.trusted.Verdict.line`)

    @classmethod
    def of(cls, argv: Sequence[str], trust_configs: bool = True) -> "Decision":
        """The decision for a command line (``--recipe NAME`` not yet expanded): trusted with ``--trust-recipe``;
        else its configs judged by content (`lit_memory.config.trusted.judge`), unless ``trust_configs`` is False
        (``recipes check`` judges a file as if nobody trusted it)."""
        from lit_memory.config import shipped, trusted  # light; here so that this module's import stays as it was

        argv = [str(a) for a in argv]
        if TRUST_FLAG in argv:
            return cls(trusted=True)
        if not trust_configs:
            return cls(trusted=False)
        verdict = trusted.judge(shipped.expand_recipes(argv))
        return cls(trusted=False, configs_trusted=verdict.trusted, pinned=verdict.pinned,
                   why="" if verdict.trusted else verdict.line())

    @property
    def confined(self) -> bool:
        """Whether a training or evaluation under this decision runs in the sandbox (`lit_memory.confine.launch`), its
        values judged as a stranger's: nobody trusted its configs."""
        return not (self.trusted or self.configs_trusted)

    @contextlib.contextmanager
    def applied(self, typed_files: Iterator[str] = (), folders: Iterator[str] = ()) -> Iterator["Decision"]:
        """Apply the decision to this process for the length of the block (a run): imports and configs read while
        parsing, and every sink (`lit_memory.sandbox.guard.enforced`); at the end all of it is as it was before.
        ``typed_files``: files named on the command line (the user's); ``folders``: where a config a recipe names may
        lie (`recipe_folders`). Inside an untrusted run, a trusted decision is refused: it would lift the rules the
        enclosing run holds. Trusted configs are read as approved (`pinned_config_reading`), and every sink keeps
        the untrusted rules for what they did not approve."""
        if self.trusted and import_policy_enforced():
            raise UserError(
                f"{TRUST_FLAG} cannot lift the import allowlist inside an untrusted run: run the trusted command in "
                "a process of its own"
            )
        with contextlib.ExitStack() as held:
            _files_read.clear()  # this command's configs from here on
            if self.confined:
                held.enter_context(import_policy())
                held.enter_context(bounded_config_reading(typed_files, folders))
            elif not self.trusted:
                held.enter_context(pinned_config_reading(self.pinned))
            held.enter_context(remote_configs_off())
            held.enter_context(plain_any_values())
            held.enter_context(guard.enforced(self.trusted, approved=self.pinned))
            yield self

    @contextlib.contextmanager
    def reading_a_checkpoint(self, settings: Namespace) -> Iterator[None]:
        """While LightningCLI lays a checkpoint's hyper-parameters over a run of trusted configs: the checkpoint is
        not theirs, so it may name no import outside the allowlist and the classes the configs name."""
        if self.trusted or self.confined:  # trusted: nothing; untrusted: the run's own policy holds already
            yield
            return
        named = [v for k, v in dotted_leaves(settings) if k.endswith("class_path") and isinstance(v, str)]
        with import_policy(extra=named):
            yield

    def confine(self, settings: Namespace) -> None:
        """Tell the guard which settings the user typed (theirs: a checkpoint Lightning finds in a folder they
        typed is theirs too)."""
        guard.set_typed(dict(dotted_leaves(self.typed)))

    def typed_callbacks(self, settings: Namespace, callbacks: list[Any]) -> set[int]:
        """Ids of ``callbacks`` (built from ``settings``' ``trainer.callbacks``) whose class spec the user typed on
        the command line: theirs, bounds and all."""
        specs = settings.get("trainer.callbacks") or []
        typed = self.typed.get("trainer.callbacks") or [] if isinstance(self.typed, Namespace) else []
        return {id(c) for c, spec in zip(callbacks, specs) if any(spec == t for t in typed)}

    def is_typed(self, key: str, value: Any) -> bool:
        """Whether the user typed ``value`` for ``key`` (a parse of the command line alone gives it)."""
        return _same(dict(dotted_leaves(self.typed)).get(key), value)

    def refusals(self, settings: Namespace) -> list[Refusal]:
        """Everything in ``settings`` that needs ``--trust-recipe`` and was not typed by the user."""
        if self.trusted:
            return []
        typed = dict(dotted_leaves(self.typed))
        refusals = [r for r in value_refusals(settings) if not (r.key in typed and _same(typed[r.key], r.value))]
        ckpt_path = settings.get("ckpt_path")
        typed_ckpt = _same(typed.get("ckpt_path"), ckpt_path)
        return refusals + checkpoint_refusals(ckpt_path, typed=typed_ckpt, approved=self.pinned)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def command_line_only(argv: list[str]) -> list[str]:
    """``argv`` without what reads files: ``--config FILE`` and any ``--key VALUE`` whose value is an
    existing file (jsonargparse loads it as that key's config). URLs stay: with remote reading off
    they are strings, or an error."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("--config", "-c"):
            i += 2
            continue
        if token.startswith(("--config=", "-c=", "--print_config")) or token in ("-h", "--help", TRUST_FLAG):
            i += 1
            continue
        if token.startswith("--"):
            _, eq, value = token.partition("=")
            width = 1
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, width = argv[i + 1], 2
            if not _is_file(value):
                out += argv[i : i + width]
            i += width
            continue
        out.append(token)  # the subcommand
        i += 1
    return out


def typed_values(argv: list[str], parse: Callable[[list[str]], Namespace], subcommand: Optional[str]) -> Namespace:
    """What a parse of the command line alone produces (`command_line_only`), for one subcommand: the
    user's own values. Where the whole line does not parse alone (an override of a strategy or callback whose
    class only a file names), each option is parsed on its own and those that parse count: the others are
    exempt from nothing."""
    line = command_line_only(argv)
    try:
        return _of(parse(line), subcommand)
    except Exception:  # noqa: BLE001  parsed option by option below
        pass
    try:
        base = _of(parse(line[:1]), subcommand)
    except Exception:  # noqa: BLE001  not even the subcommand alone: nothing typed is trusted
        return Namespace()
    merged, defaults = base.clone(), dict(base.items(branches=False))
    for option in _options(line[1:]):
        try:
            alone = _of(parse([*line[:1], *option]), subcommand)
        except Exception:  # noqa: BLE001  this option needs what a file names
            continue
        for key, value in alone.items(branches=False):  # jsonargparse's leaves: a dict value is one
            if not _same(defaults.get(key), value):
                merged[key] = value
    return merged


def _of(parsed: Namespace, subcommand: Optional[str]) -> Namespace:
    return parsed.get(subcommand, Namespace()) if subcommand else parsed


def _options(tokens: list[str]) -> list[list[str]]:
    """``--key=value`` / ``--key value`` / ``--flag`` tokens, one list per option."""
    options: list[list[str]] = []
    for token in tokens:
        if token.startswith("-") or not options:
            options.append([token])
        else:
            options[-1].append(token)
    return options


def typed_option(argv: list[str], key: str) -> Optional[str]:
    """The value the user typed for ``--KEY`` (the last one), or None. A file named on the command line is the user's,
    though the parse of the command line alone leaves it out (`command_line_only`: jsonargparse would read it as that
    key's config): what a run reads is judged by this."""
    value = None
    for i, token in enumerate(argv):
        if token == f"--{key}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(f"--{key}="):
            value = token.split("=", 1)[1]
    return value


def recipe_folders(argv: list[str]) -> list[str]:
    """The folders a recipe's own files may lie in: the working folder and the folders of the configs the user named
    (``--config FILE``, ``--recipe NAME`` once expanded). A file a recipe names elsewhere is the user's, read only when
    they type it (`lit_memory.sandbox.rules.check_input`, `bounded_config_reading`)."""
    folders = [os.getcwd()]
    for i, token in enumerate(argv):
        value = argv[i + 1] if token in ("--config", "-c") and i + 1 < len(argv) else None
        if token.startswith(("--config=", "-c=")):
            value = token.split("=", 1)[1]
        if value and _is_file(value):
            folders.append(os.path.dirname(os.path.realpath(os.path.expanduser(re.sub(r"^file:///?", "/", value)))))
    return list(dict.fromkeys(os.path.realpath(f) for f in folders))


def _is_file(value: str) -> bool:
    """Whether jsonargparse would read ``value`` as a file: a path, or a ``file://`` URL it strips itself."""
    value = re.sub(r"^file:///?", "/", value)
    try:
        return bool(value) and Path(value).expanduser().is_file()
    except (OSError, ValueError):  # too long or too odd to be a path
        return False


def sanitize(settings: Namespace) -> Namespace:
    """A copy of one subcommand's settings with every refused value that has a safe one replaced by it:
    what a run writes into the recipe.yaml it shares."""
    out = settings.clone()
    for refusal in value_refusals(out):
        if refusal.safe is not None:
            assign(out, refusal.key, refusal.safe)
    return out
