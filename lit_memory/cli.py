"""From a command line to one checked run: `resolve` and the LightningCLI it drives.

`resolve(argv)` expands ``--recipe NAME``, makes the run's trust decision, parses the configs and overrides with
LightningCLI and checks the result before anything is built, loaded or written. The `LitMemoryCLI` it returns holds
the settings; `build()` instantiates, `launch()` runs the subcommand. The command line parses and composes; each
concern's own module decides (trust, resume, precision, checkpointing plan, memory callbacks, console lines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, _InstantiatorFn

from lit_memory import console, fine_tune
from lit_memory.config import arguments, option_names, shared_recipe, trust
from lit_memory.config.arguments import LINKS, config_files, named_files, stubs_without_a_subprocess
from lit_memory.config.shipped import TRUST_FLAG, expand_recipes, recipe_help
from lit_memory.console import say
from lit_memory.data import TextClassificationData
from lit_memory.errors import UserError
from lit_memory.memory.hardware import gpus
from lit_memory.memory.settings import MemorySettings
from lit_memory.model import SequenceClassifier
from lit_memory.optim import precision
from lit_memory.optim.precision import fp16_under_fsdp2
from lit_memory.planning.prediction.step import Step
from lit_memory.planning.run_predictions import run_hooks
from lit_memory.policy import checkpoints
from lit_memory.run import confined_logs, environment, resume
from lit_memory.run.memory_callbacks import Advise, Predict, memory_callbacks
from lit_memory.run.noise import quiet_evaluation_noise, quiet_known_noise
from lit_memory.sandbox import bounds, guard
from lit_memory.settings import assign, dotted_leaves, get_dotted, to_plain
from lit_memory.settings import key_of as settings_key_of

THIS_GPU = "this machine's"  # `LitMemoryCLI(gpu=...)`'s default: the GPU the run itself trains on

HELP = recipe_help(trust.ALLOWLIST)
class LitMemoryCLI(LightningCLI):
    """LightningCLI for the project's module and data, with ``--recipe NAME``, the trust decision and the memory
    callbacks.

    ``defer``: stop after parsing and checking; ``collect``: keep refusals and problems instead of raising;
    ``predict``/``advise``: the memory callbacks' hooks (default: the run's own step's); ``gpu``: the GPU whose bf16
    support decides the precision (default: the one it trains on; None: none). Each phase runs inside `scope`."""

    def __init__(
        self,
        args: Union[list[str], dict, Namespace, None] = None,
        run: bool = True,
        defer: bool = False,
        collect: bool = False,
        predict: Optional[Predict] = None,
        advise: Optional[Advise] = None,
        gpu: Any = THIS_GPU,
        trust_configs: bool = True,
        **kwargs: Any,
    ) -> None:
        self._gpu = gpu
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, (dict, Namespace)):  # LightningCLI also takes the config as an object: a file, not typed
            self.command, self.argv = "LitMemoryCLI(args=<a config object>)", None
            self.decision = trust.Decision(trusted=False)
        else:
            self.command = shlex.join(["python", "-m", "lit_memory", *map(str, argv)])
            self.decision = trust.Decision.of(argv, trust_configs)  # ``--trust-recipe``, or its configs by content
            argv = self.argv = expand_recipes([a for a in map(str, argv) if a != TRUST_FLAG])
        self._typed_files = [] if self.argv is None else named_files(self.argv)
        self._held: Optional[contextlib.ExitStack] = None
        self._data_read: Optional[TextClassificationData] = None  # the fit's data module, read (`fine_tune.read_data`)
        self._seeded = False
        quiet_known_noise()
        self._deferred = defer
        self._collect = collect
        self._memory_hooks = {"predict": predict, "advise": advise, "timeline": None}
        self.memory: Optional[MemorySettings] = None  # the `memory:` block, built once (`_parse_memory`)
        # The settings the user typed on the command line (dotted keys, one subcommand's) with their parsed values,
        # before a checkpoint's hyper-parameters are laid over them: what wins over the checkpoint's
        # (`_parse_ckpt_path`).
        self.typed_settings: dict[str, Any] = {}
        self._typed_alone = Namespace()  # the parse of the command line alone (`trust.typed_values`)
        self._typed_over: dict[str, Any] = {}  # typed, then set again by a later file (`_typed_settings`)
        # the command's defaults, parsed when asked (`_command_defaults`)
        self._defaults: Optional[dict[str, Any]] = None
        # lines said when the run is built (`_prepare`): only the process that runs says them
        self.notes: list[str] = []
        self.refusals: list[trust.Refusal] = []
        self.problems: list[str] = []  # collect=True: what would stop the run, other than refusals
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("save_config_callback", shared_recipe.SaveRecipe)
        kwargs.setdefault("parser_class", arguments.Parser)
        # a trusted run's config.yaml is as trusted as it
        if kwargs["save_config_callback"] is shared_recipe.SaveRecipe:
            kwargs["save_config_kwargs"] = {"command": self.command, "trusted": not self.decision.confined,
                                            **(kwargs.get("save_config_kwargs") or {})}
        stubs_without_a_subprocess()
        with self.scope():
            super().__init__(
                SequenceClassifier,
                TextClassificationData,
                args=argv,
                run=run,
                auto_configure_optimizers=False,  # the module takes the optimizer (it builds decay groups)
                **kwargs,
            )

    # -- the run's switches --------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator["LitMemoryCLI"]:
        """What this run switches in the process (the trust decision, Lightning's environment variables, the
        recipe's allocator settings), put back after the block. Re-entrant."""
        if self._held is not None:
            yield self
            return
        with contextlib.ExitStack() as held:
            held.enter_context(self.decision.applied(self._typed_files, trust.recipe_folders(self.argv or [])))
            held.enter_context(environment.restored())
            self._held = held
            try:
                yield self
            finally:
                self._held = None

    # -- parsing and checking ------------------------------------------------------------------

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("epilog", HELP)  # --recipe and --trust-recipe are taken out of argv before parsing
        kwargs.setdefault("prog", "python -m lit_memory")
        parser = super().init_parser(**kwargs)
        parser.toplevel = True
        return parser

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        # `args` is argv rewritten by __init__: parse it without LightningCLI's warning about
        # being given both args and a command line.
        self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)
        subcommand = self.config.get("subcommand")
        if self.argv is not None:
            self._typed_alone = trust.typed_values(self.argv, self._parse_alone, subcommand)
        self.typed_settings = self._typed_settings(subcommand)
        if self.argv is not None and self.decision.confined:
            self.decision = dataclasses.replace(self.decision, typed=self._typed_alone)
        # trusted configs: every value they give is the user's
        elif self.argv is not None and not self.decision.trusted:
            self.decision = dataclasses.replace(self.decision, typed=self.settings_of(self.config).clone())
        self.check_values()
        self._problem(self._parse_memory)
        self._problem(self._follow_device)  # before resuming compares the precision a checkpoint was made with
        self.decision.confine(self.settings)  # the settings the user typed, for the guard
        if subcommand:
            # before LightningCLI merges the checkpoint's hyper-parameters into these settings
            if not self._problem(resume.check_resume, self.settings_of(self.config), compare=subcommand == "fit"):
                self.config[subcommand].ckpt_path = None  # reported; not to be read again

    def _typed_settings(self, subcommand: Optional[str]) -> dict[str, Any]:
        """The settings the command line's options set, with their values: what a parse of the command line alone
        (`trust.typed_values`: jsonargparse's own reading, so ``--key=value``, abbreviations and a group typed as a
        mapping) gives other than the command's defaults, and every key an option names
        (`lit_memory.config.option_names.typed_keys`: a typed value equal to its default counts too). A key a later file
        set again (``--model.threshold 0.25 --config mine.yaml``) is not typed: the run has the file's value
        (kept in ``_typed_over`` to say so). Link targets (``data.tokenizer_name_or_path``) are not typed."""
        self._typed_over = {}
        if self.argv is None:
            return {}
        defaults = self._command_defaults(subcommand)
        alone = self._typed_alone
        named = list(option_names.typed_keys(subcommand or "fit", self.argv))
        # an option whose value is a file (``--ckpt_path X``, ``--data.source X``) is not in the parse alone: as parsed
        in_files = set(named) - set(option_names.typed_keys(subcommand or "fit", trust.command_line_only(self.argv)))
        keys = list(named)
        if defaults:
            keys += [
                k for k, v in alone.items(branches=False) if settings_key_of(v) != settings_key_of(defaults.get(k))
            ]
        linked = {target for _, target, _ in LINKS}
        keys = [k for k in dict.fromkeys(keys) if k not in linked and k not in ("config", "subcommand")]
        found = {}
        for key in keys:
            if any(key.startswith(other + ".") for other in keys):  # within a setting typed whole: it says the value
                continue
            try:
                if key in in_files:
                    raise KeyError(key)
                value = get_dotted(alone, key)
            except KeyError:  # a file named, or an option that needs what a file names to parse: as the run has it
                try:
                    value = get_dotted(self.settings, key)
                except KeyError:
                    continue
                found[key] = value
                continue
            try:
                now = get_dotted(self.settings, key)
            except KeyError:
                now = None
            if settings_key_of(now) == settings_key_of(value):
                found[key] = value
            else:
                self._typed_over[key] = value
        return found

    def _command_defaults(self, subcommand: Optional[str]) -> dict[str, Any]:
        """The command's defaults (a parse of the command alone), as jsonargparse's leaves; empty if it does not
        parse."""
        if self._defaults is None:
            try:
                parsed = self.settings_of(self._parse_alone([subcommand] if subcommand else []))
                self._defaults = dict(parsed.items(branches=False))
            except Exception:  # noqa: BLE001  not even the command alone parses: only the options named count
                self._defaults = {}
        return self._defaults

    def _parse_ckpt_path(self) -> None:
        """``--ckpt_path FILE``: Lightning lays the checkpoint's saved hyper-parameters over the settings; then what the
        user typed wins again (``validate --ckpt_path X --model.threshold 0.25`` validates at 0.25, said in one line),
        except a setting the saved weights depend on (`SequenceClassifier.FIXED_BY_WEIGHTS`), refused in one line. A
        setting a config file gave that the checkpoint's replaces is said in one line too."""
        subcommand = self.config.get("subcommand")
        before = self.settings.model.clone() if subcommand and self.settings.get("model") is not None else None
        with self.decision.reading_a_checkpoint(self.settings):  # not the user's, though their configs are trusted
            super()._parse_ckpt_path()
        if not subcommand or self.config[subcommand].get("ckpt_path") is None:
            return
        self.check_values()  # a checkpoint someone sent is refused for what it holds before it is compared
        ckpt_path = str(self.config[subcommand].ckpt_path)
        back: dict[str, Any] = {}
        for key, typed in self.typed_settings.items():
            if key.startswith("model."):
                self._problem(self._typed_wins, key, typed, ckpt_path, back)
        if back:  # as Lightning lays the checkpoint's: parsed again, so links (the data's tokenizer) follow them
            tree: dict[str, Any] = {}
            for key, typed in back.items():
                assign(tree, key, typed, create=True)
            self.config = self.parser.parse_object({subcommand: tree}, self.config)
        if before is not None:
            self._said_files_lose(before, ckpt_path)

    def _typed_wins(self, key: str, typed: Any, ckpt_path: str, back: dict[str, Any]) -> None:
        """``key`` as typed goes ``back`` over the checkpoint's (said in one line), unless the weights fix it."""
        try:
            saved = get_dotted(self.settings, key)
        except KeyError:  # the checkpoint's value has no such part (a dict where a value was typed inside)
            saved = None
        name = key.split(".")[1]
        meant = self._effective(name, saved)
        if settings_key_of(meant) == settings_key_of(self._effective(name, typed)):
            return
        if name in SequenceClassifier.FIXED_BY_WEIGHTS:
            made = repr(saved) if saved is not None or meant is None else f"None (the model's, {meant!r})"
            raise UserError(
                f"--{key} {typed!r}: checkpoint {ckpt_path} holds weights made with {key}={made}, which cannot be read "
                f"as {typed!r} (leave --{key} out to use the checkpoint's, or train a new model)"
            )
        back[key] = typed
        self.notes.append(f"{key}={typed!r} as typed, over {self._saved_words(name, saved, ckpt_path)} saved in "
                          f"checkpoint {ckpt_path}")

    @staticmethod
    def _saved_words(name: str, saved: Any, ckpt_path: str) -> str:
        """A checkpoint's value of a model setting, in words: no ``threshold`` set, the thresholds it saved beside
        the weights (tuned on validation), as ``0.21-0.40 (tuned on validation ...)``."""
        kept = resume.saved_entry(Path(ckpt_path), "thresholds") if name == "threshold" and saved is None else None
        if not kept or not kept.get("values"):
            return repr(saved)
        low, high = min(kept["values"]), max(kept["values"])
        values = f"{low:g}" if low == high else f"{low:g}-{high:g}"
        return f"the threshold{'s' if len(kept['values']) > 1 else ''} {values} ({kept.get('origin', 'saved')})"

    def _effective(self, name: str, value: Any) -> Any:
        """What a model setting means: no tokenizer is the model's own."""
        if name == "tokenizer_name_or_path" and value is None:
            return self.settings.model.model_name_or_path
        return value

    def _said_files_lose(self, before: Namespace, ckpt_path: str) -> None:
        """One line for each model setting a config file gave (other than the default and not typed) that the
        checkpoint's saved value replaced: the checkpoint's wins, typing it makes it the run's."""
        after = self.settings.model
        for name, value in before.items(branches=False):
            key = f"model.{name}"
            if any(key == t or key.startswith(t + ".") or t.startswith(key + ".") for t in self.typed_settings):
                continue
            try:
                saved = get_dotted(after, name)
            except KeyError:
                continue
            default = self._command_defaults(self.config.get("subcommand")).get(key)
            if value == "auto" or settings_key_of(value) in (settings_key_of(saved), settings_key_of(default)):
                # the checkpoint's, the default, or ``auto`` (a plan asked for; the checkpoint holds its run's)
                continue
            shown = json.dumps(to_plain(value)) if not isinstance(value, str) else value
            how = f"type --{key} {shlex.quote(shown)} to use it"
            if key in self._typed_over:
                how = f"--{key} {self._typed_over[key]!r} was typed before that file: type it after to use it"
            where = self._config_file_with(key, value) or "a config file"
            self.notes.append(f"{key}={saved!r} from checkpoint {ckpt_path}, not {value!r} from {where} ({how})")

    def _config_file_with(self, key: str, value: Any) -> Optional[str]:
        """The last ``--config`` file that sets ``key`` to ``value`` (itself or under its command), if one does."""
        for path in reversed(config_files(self.argv or [])):
            try:
                data = bounds.read_yaml(path, "config")
            except (UserError, OSError):
                continue
            for tree in (data, data.get(self.config.get("subcommand")) if isinstance(data, dict) else None):
                try:
                    if settings_key_of(get_dotted(tree, key)) == settings_key_of(value):
                        return path
                except (KeyError, TypeError):
                    continue
        return None

    def _problem(self, check: Any, *args: Any, **kwargs: Any) -> bool:
        """``check(*args)``; with ``collect=True`` its `UserError` is kept in ``problems`` (False), else raised."""
        try:
            check(*args, **kwargs)
        except UserError as err:
            if not self._collect:
                raise
            self.problems.append(str(err))
            return False
        return True

    def _parse_memory(self) -> None:
        """The ``memory:`` block as one typed value, built once, here."""
        self.memory = MemorySettings(**self.settings.memory.as_dict())

    def _follow_device(self) -> None:
        """A recipe's bf16 on a GPU without bf16 (`lit_memory.optim.precision.follow_device`), unless the user typed
        it."""
        trainer = self.settings.trainer
        gpu = precision.training_gpu(trainer.accelerator) if self._gpu is THIS_GPU else self._gpu
        precision.follow_device(trainer, gpu, self._typed)

    def _typed(self, key: str, value: Any) -> bool:
        """Whether the user typed ``key`` as ``value`` on the command line (a file did not set it after)."""
        if self.argv is None:
            return False
        return dataclasses.replace(self.decision, typed=self._typed_alone).is_typed(key, value)

    def _parse_alone(self, argv: list[str]) -> Namespace:
        with self._probing():
            return self.parser.parse_args(argv)

    @contextlib.contextmanager
    def _probing(self) -> Iterator[None]:
        """This run's parsers (the main one and each subcommand's) fail quietly while the command line is parsed
        alone (`trust.typed_values`)."""
        parsers = [self.parser, *getattr(self, "_subcommand_parsers", {}).values()]
        for parser in parsers:
            parser.probing = True
        try:
            yield
        finally:
            for parser in parsers:
                parser.probing = False

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        arguments.add_command_arguments(parser, subcommand)
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        arguments.add_arguments(parser)

    @staticmethod
    def settings_of(config: Namespace) -> Namespace:
        subcommand = config.get("subcommand")
        return config[subcommand] if subcommand else config

    def step(self, target: Any = None) -> Any:
        """This run's training step as the memory model describes it, for ``target`` (default: the documented GPU)."""
        return Step.from_settings(self.settings.as_dict(), target, memory=self.memory)

    @property
    def settings(self) -> Namespace:
        """This run's resolved settings (the subcommand's part of the config)."""
        return self.settings_of(self.config)

    def check_values(self) -> None:
        self.refusals = self.decision.refusals(self.settings)
        if self.refusals and not self._collect:
            first, rest = self.refusals[0], self.refusals[1:]
            more = f" (also refused: {', '.join(r.key for r in rest)})" if rest else ""
            raise UserError(f"{first}{more}")

    def before_instantiate_classes(self) -> None:
        fine_tune.check_settings(self)

    # -- building and running ------------------------------------------------------------------

    def _set_seed(self) -> None:
        """Seed once, when the run is built: a deferred run (`resolve`) seeds in `build`/`launch`, so that parsing
        alone (``estimate``, ``recipes check``) leaves the process's random state and environment as they were."""
        if self._deferred or self._seeded:
            return
        self._seeded = True
        super()._set_seed()

    def _prepare(self) -> None:
        """Before anything is instantiated: the process set up, the data read (``fit``), ``auto`` planned
        (`lit_memory.fine_tune`, steps 2 to 4)."""
        fine_tune.enter_run(self, self._held)
        training = self.config.get("subcommand") in (None, "fit")
        if training:
            self._data_read = fine_tune.read_data(self, self._build_data)
        fine_tune.plan(self, training)

    def _build_data(self, settings: Namespace) -> TextClassificationData:
        """The run's data module, made from the settings as Lightning makes it (its hyper-parameters the config's)."""
        made = _InstantiatorFn(self, "data")(TextClassificationData, applied_instantiation_links={},
                                             **settings.as_dict())
        self.__dict__.pop("config_dump", None)  # dumped again for the model: with what the data showed, and the plan
        return made

    def _add_instantiators(self) -> None:
        super()._add_instantiators()
        # The data module `read_data` built and read is the one the run gets: the data is not read a second time.
        self.parser.add_instantiator(self._data_module, TextClassificationData, subclasses=False, prepend=True)

    def _data_module(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        made, self._data_read = self._data_read, None
        if made is not None:
            return made
        return _InstantiatorFn(self, "data")(class_type, *args, applied_instantiation_links=applied_instantiation_links,
                                             **kwargs)

    def instantiate_classes(self) -> None:
        if not self._deferred:
            self._prepare()
            super().instantiate_classes()

    @staticmethod
    def read_card() -> Any:
        """The run's card at start (`lit_memory.memory.hardware.gpus.read_card`): the seam a test replaces."""
        return gpus.read_card()

    def _run_subcommand(self, subcommand: str) -> None:
        if not self._deferred:
            super()._run_subcommand(subcommand)

    def build(self, trainer: bool = True) -> "LitMemoryCLI":
        """Instantiate the module and data module (and the Trainer): ``self.model``, ``self.datamodule``. A caller
        that trains with them holds `scope` around this and its training."""
        with self.scope():
            self._deferred = False
            self._prepare()
            if trainer:
                LightningCLI.instantiate_classes(self)
            else:
                self.config_init = self.parser.instantiate_classes(self.config)
                self.datamodule = self._get(self.config_init, "data")
                self.model = self._get(self.config_init, "model")
        return self

    def launch(self) -> None:
        """Build and run the subcommand of a deferred run."""
        with self.scope():
            self._deferred = False
            self.instantiate_classes()
            if self.subcommand is not None:
                self._run_subcommand(self.subcommand)

    def _memory_hooks_for_run(self) -> dict[str, Any]:
        """The memory callbacks' hooks: those given, else, for fit, the run's own step's, advising from the shipped
        recipes."""
        hooks = dict(self._memory_hooks)
        if None in hooks.values() and self.subcommand in (None, "fit"):
            try:
                made = run_hooks(self.step(), shared_recipe.shipped_settings)
                defaults = dict(zip(("predict", "advise", "timeline"), made))
            except UserError as err:  # settings the memory model does not cover: measure only
                say(f"warning: no memory predictions for this run: {err}")
                defaults = {}
            hooks = {name: hook if hook is not None else defaults.get(name) for name, hook in hooks.items()}
        return hooks

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = self._get(self.config_init, "trainer", default={})
        if self.subcommand == "fit":  # exact resume, and a checkpoint every few hundred steps unless configured
            configured = list(trainer.get("callbacks") or [])
            kwargs["callbacks"] = resume.fit_callbacks(configured, trainer.get("enable_checkpointing"))
            if self.decision.confined:  # checkpoint cadence and count over all callbacks, for the whole run
                typed = self.decision.typed_callbacks(self.settings, configured)
                ours = {id(c) for c in kwargs["callbacks"]} - {id(c) for c in configured}  # lit_memory's own defaults
                kwargs["callbacks"].append(guard.RunBounds(exempt=lambda c: id(c) in typed or id(c) in ours))
        if self.subcommand == "predict" and trainer.get("logger") in (None, True):
            # Predictions are not a training run: one file where `predict_file.destination` says, no run folder
            # (a version_N per call) for a log or a config beside it.
            kwargs["logger"] = False
            self.save_config_kwargs = {**self.save_config_kwargs, "save_to_log_dir": False}
        kwargs.update(fp16_under_fsdp2(trainer), **confined_logs.logger_kwargs(trainer, self.subcommand))
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except UserError:
            raise
        # Lightning's words for settings it cannot run with
        except (MisconfigurationException, ValueError, TypeError) as err:
            raise UserError(" ".join(str(err).split())) from None
        guard.install(trainer)
        return trainer

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> Trainer:
        """The Trainer with every run's callbacks: its ``memory:`` block's, progress lines and model summary."""
        callbacks = [*callbacks, *memory_callbacks(self.memory, **self._memory_hooks_for_run())]
        return super()._instantiate_trainer(config, console.forced_callbacks(config, callbacks))

    def _preflight(self) -> None:
        if self.subcommand != "fit":
            quiet_evaluation_noise()
        if self.settings.get("ckpt_path") is not None:
            self.model.report_new_head = False  # the checkpoint's head replaces the one built first
        typed = [v for k, v in dotted_leaves(self.decision.typed) if k.rsplit(".", 1)[-1] in checkpoints.PICKED_FROM]
        guard.preflight(self.trainer, self.subcommand, self.settings.get("ckpt_path"), tuple(typed), self.model)

    def before_fit(self) -> None:
        self._preflight()

    def before_validate(self) -> None:
        self._preflight()

    def before_test(self) -> None:
        self._preflight()

    def before_predict(self) -> None:
        self._preflight()

    def after_fit(self) -> None:
        fine_tune.after_fit(self)

    def after_validate(self) -> None:
        console.print_metrics(self.trainer, "val")

    def after_test(self) -> None:
        console.print_metrics(self.trainer, "test")

    def after_predict(self) -> None:
        console.print_predict_metrics(self.trainer, self.model)


def resolve(argv: list[str], **kwargs: Any) -> LitMemoryCLI:
    """``argv`` (a subcommand and its arguments, ``--recipe``/``--trust-recipe`` included) as one
    parsed and checked run: nothing built, loaded or written. ``build()`` or ``launch()`` it."""
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)  # "Seed set to 42" on every resolve: the seed is in the settings
    try:
        return LitMemoryCLI(args=list(argv), defer=True, **kwargs)
    finally:
        seed_log.setLevel(level)
