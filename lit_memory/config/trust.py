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
  and device processes, checkpoint cadence and count, sequence length). A value a parse of the command line alone
  produces is the user's own and exempt (`typed_values`), not whole subtrees merged under a key they typed.
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
import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import jsonargparse
import yaml
from jsonargparse import Namespace, _common
from jsonargparse import Path as ConfigPath
from jsonargparse._optionals import _get_config_read_mode

from lit_memory.errors import UserError
from lit_memory.optim.optimizers import IMPORTABLE
from lit_memory.policy import imports, phases
from lit_memory.policy.checkpoints import SPECIAL_CKPT, checkpoint_refusals  # noqa: F401  (the policy's, named here)
from lit_memory.policy.code import code_refusals  # noqa: F401
from lit_memory.policy.refusal import HINT, TRUST_FLAG, Context, Refusal
from lit_memory.policy.typed import (  # noqa: F401  what the user typed (callers name them here)
    _is_file,
    _same,
    command_line_only,
    recipe_folders,
    typed_option,
    typed_values,
)
from lit_memory.policy.values import (  # noqa: F401
    BOUNDS,
    HF_LOADING_OPTIONS,
    MAX_KEPT_CHECKPOINTS,
    MAX_LENGTH,
    MIN_CHECKPOINT_SECONDS,
    MIN_CHECKPOINT_STEPS,
)
from lit_memory.sandbox import bounds, checkpoint_reading, guard
from lit_memory.settings import assign, dotted_leaves

# Import paths a recipe may name: optimizers (those of the libraries lit_memory knows: `lit_memory.optim.optimizers`)
# and the policy's packages (`lit_memory.policy.imports`); inside them, the policy's denylist.
ALLOWLIST = (*IMPORTABLE, *imports.PACKAGES)
DENYLIST = imports.DENYLIST

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
    does not cover: so the table's entries are saved and put back here (tests/config/test_trust.py checks they
    exist)."""
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
        context = Context(settings, typed=lambda key, value: key in typed and _same(typed[key], value),
                          approved=guard.approved, checkpoint_problem=_checkpoint_problem)
        return phases.refusals("parse", context)


def sanitize(settings: Namespace) -> Namespace:
    """A copy of one subcommand's settings with every refused value that has a safe one replaced by it:
    what a run writes into the recipe.yaml it shares."""
    out = settings.clone()
    for refusal in value_refusals(out):
        if refusal.safe is not None:
            assign(out, refusal.key, refusal.safe)
    return out


def _checkpoint_problem(path: Any) -> Optional[str]:
    return checkpoint_reading.checkpoint_problem(path, files_too=False)


def value_refusals(settings: Namespace) -> list[Refusal]:
    """Settings (one subcommand's) that need ``--trust-recipe`` whatever they point at: the parse phase's rules that
    judge values alone (`lit_memory.policy`), a value the user typed included."""
    return phases.refusals("parse", Context(settings), only=lambda rule: not rule.reads)
