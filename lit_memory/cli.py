"""From a command line to one checked run: `resolve` and the LightningCLI it drives.

`resolve(argv)` expands ``--recipe NAME``, makes the run's trust decision, parses the configs and overrides with
LightningCLI and checks the result before anything is built, loaded or written. The `LitMemoryCLI` it returns holds
the settings; `build()` instantiates, `launch()` runs the subcommand. The command line parses and composes; each
concern's own module decides (trust, resume, precision, checkpointing plan, memory callbacks, console lines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_memory import checks, console, environment, guard, optimizers, precision, recipes, resume, trust
from lit_memory.console import LogProgress, say
from lit_memory.data import TextClassificationData, resolve_task
from lit_memory.errors import UserError
from lit_memory.memory.hardware.allocator import recipe_settings
from lit_memory.memory.hardware import gpus
from lit_memory.memory.hardware.budget import MemorySettings
from lit_memory.memory.planning.hooks import run_hooks
from lit_memory.memory.planning.recompute import plan_run
from lit_memory.memory.prediction.step import Step
from lit_memory.model import DEFAULT_OPTIMIZER, SequenceClassifier
from lit_memory.noise import quiet_evaluation_noise, quiet_known_noise
from lit_memory.precision import cpu_fallback, fp16_under_fsdp2, runs_on_cpu
from lit_memory.predict_file import PredictionWriter
from lit_memory.run_memory import Advise, Predict, memory_callbacks
from lit_memory.lora import LoRA
from lit_memory.settings import Precision, leaves, plain

THIS_GPU = "this machine's"  # `LitMemoryCLI(gpu=...)`'s default: the GPU the run itself trains on

HELP = (
    f"{recipes.RECIPE_FLAG} NAME: use a shipped recipe, as --config <its file> at that place (list them: python -m "
    f"lit_memory recipes). Recipes naming code outside the allowlist ({', '.join(trust.ALLOWLIST)}), or values that "
    f"run code (trust_remote_code, weights_only false, remote or pickled checkpoints), are refused; "
    f"{trust.TRUST_FLAG} lifts that, only for recipes from sources you trust."
)


class _Parser(LightningArgumentParser):
    """A parse error is one line: a refused import names the path and the key, a config named by URL is
    refused; other errors as jsonargparse words them.

    ``toplevel`` marks the parsers LightningCLI makes (main and subcommands): jsonargparse nests
    parsers of the same class and folds their errors into the enclosing key's message.
    """

    toplevel = False
    probing = False  # set on this run's parsers while they parse the command line alone (`LitMemoryCLI._probing`)

    def error(self, message: str, ex: Optional[Exception] = None):
        if not self.toplevel:
            return super().error(message, ex)
        if self.probing:  # a parse of the command line alone (`trust.typed_values`): fail quietly
            raise _ProbeFailed(message)
        if bound := trust.bound_error():  # a config beyond the bounds an untrusted run reads
            raise bound
        if denied := trust.denied_imports(message):
            raise ImportRefused(denied)
        if url := trust.remote_config(message):
            raise UserError(trust.remote_config_refusal(url))
        raise UserError(" ".join(message.split()))


class _ProbeFailed(Exception):
    pass


class ImportRefused(UserError):
    def __init__(self, denied: list[tuple[str, str, str]]) -> None:
        first = trust.import_refusal(*denied[0][:2])
        more = f" (and {', '.join(path for path, _, _ in denied[1:])})" if len(denied) > 1 else ""
        super().__init__(first + more)
        self.denied = denied


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
        **kwargs: Any,
    ) -> None:
        self._gpu = gpu
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, (dict, Namespace)):  # LightningCLI also takes the config as an object: a file, not typed
            self.command, self.argv = "LitMemoryCLI(args=<a config object>)", None
            self.decision = trust.Decision(trusted=False)
        else:
            self.command = shlex.join(["python", "-m", "lit_memory", *map(str, argv)])
            self.decision = trust.Decision(trusted=trust.TRUST_FLAG in argv)
            argv = self.argv = recipes.expand_recipes([a for a in map(str, argv) if a != trust.TRUST_FLAG])
        self._typed_files = [] if self.argv is None else named_files(self.argv)
        self._held: Optional[contextlib.ExitStack] = None
        self._seeded = False
        quiet_known_noise()
        self._deferred = defer
        self._collect = collect
        self._memory_hooks = {"predict": predict, "advise": advise, "timeline": None}
        self.memory: Optional[MemorySettings] = None  # the `memory:` block, built once (`_parse_memory`)
        self.refusals: list[trust.Refusal] = []
        self.problems: list[str] = []  # collect=True: what would stop the run, other than refusals
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("save_config_callback", recipes.SaveRecipe)
        kwargs.setdefault("parser_class", _Parser)
        if kwargs["save_config_callback"] is recipes.SaveRecipe:
            kwargs["save_config_kwargs"] = {"command": self.command, **(kwargs.get("save_config_kwargs") or {})}
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
            held.enter_context(self.decision.applied(self._typed_files))
            held.enter_context(environment.restored())
            self._held = held
            try:
                yield self
            finally:
                self._held = None

    # -- parsing and checking ------------------------------------------------------------------

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("epilog", HELP)  # --recipe and --trust-recipe are taken out of argv before parsing
        parser = super().init_parser(**kwargs)
        parser.toplevel = True
        return parser

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        # `args` is argv rewritten by __init__: parse it without LightningCLI's warning about
        # being given both args and a command line.
        self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)
        subcommand = self.config.get("subcommand")
        if self.argv is not None and not self.decision.trusted:
            typed = trust.typed_values(self.argv, self._parse_alone, subcommand)
            self.decision = dataclasses.replace(self.decision, typed=typed)
        self._check_values()
        self._problem(self._parse_memory)
        self._problem(self._follow_device)  # before resuming compares the precision a checkpoint was made with
        self.decision.confine(self.settings)  # the settings the user typed, for the guard
        if subcommand:
            # before LightningCLI merges the checkpoint's hyper-parameters into these settings
            if not self._problem(resume.check_resume, self.settings_of(self.config), compare=subcommand == "fit"):
                self.config[subcommand].ckpt_path = None  # reported; not to be read again

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
        """A recipe's bf16 on a GPU without bf16 (`lit_memory.precision.follow_device`), unless the user typed it."""
        trainer = self.settings.trainer
        gpu = precision.training_gpu(trainer.accelerator) if self._gpu is THIS_GPU else self._gpu
        precision.follow_device(trainer, gpu, self._typed)

    def _typed(self, key: str, value: Any) -> bool:
        """Whether the user typed ``key`` as ``value`` on the command line (a file did not set it after)."""
        if self.argv is None:
            return False
        decision = self.decision
        if decision.trusted:  # the trust decision reads them only for untrusted runs
            typed = trust.typed_values(self.argv, self._parse_alone, self.config.get("subcommand"))
            decision = dataclasses.replace(decision, typed=typed)
        return decision.is_typed(key, value)

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
        # Load checkpoints with weights_only=True (tensors and plain data only, no pickled code);
        # Lightning's own default, None, defers to torch's default, which an environment variable can turn off.
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        parser.set_defaults(weights_only=True)
        if subcommand == "predict":
            # Predictions go to a file batch by batch (`predictions:`), so Lightning need not keep them all in memory.
            parser.set_defaults(return_predictions=False)
            parser.add_lightning_class_args(PredictionWriter, "predictions")
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model.optimizer": DEFAULT_OPTIMIZER})
        # Memory is measured in every run: its `memory:` block, whose callbacks every run gets (`_instantiate_trainer`;
        # unlike a default in `trainer.callbacks`, a user's list does not replace them).
        parser.add_class_arguments(MemorySettings, "memory", fail_untyped=False, instantiate=False, sub_configs=True)
        # Progress lines where the output is not a terminal (a log); on a terminal Lightning's rich bar (see
        # `_instantiate_trainer`). Its `progress:` block sets how often.
        parser.add_lightning_class_args(LogProgress, "progress")
        # One source of truth: the model decides the classes and the tokenizer, the data follows.
        parser.link_arguments("model.num_labels", "data.num_labels")
        parser.link_arguments("model.problem_type", "data.problem_type")
        parser.link_arguments(
            ("model.tokenizer_name_or_path", "model.model_name_or_path"),
            "data.tokenizer_name_or_path",
            compute_fn=lambda tokenizer, model: tokenizer or model,
        )
        parser.add_argument(
            "--cpu_bf16_fallback",
            type=bool,
            default=True,
            help="On a CPU without native bf16 (AVX512-BF16/AMX), train bf16 recipes in 32-true, with a warning.",
        )

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

    def _check_values(self) -> None:
        self.refusals = self.decision.refusals(self.settings)
        if self.refusals and not self._collect:
            first, rest = self.refusals[0], self.refusals[1:]
            more = f" (also refused: {', '.join(r.key for r in rest)})" if rest else ""
            raise UserError(f"{first}{more}")

    def before_instantiate_classes(self) -> None:
        settings = self.settings
        self._check_values()  # again: a resumed checkpoint's hyper-parameters are merged in by now
        # As configured, before the CPU fallback below may change the precision.
        checks.check_trainer(settings.trainer)
        optimizers.check_settings(settings.model.optimizer, settings.trainer.precision, not runs_on_cpu(settings.trainer.accelerator))
        if settings.cpu_bf16_fallback:
            settings.trainer.precision = cpu_fallback(settings.trainer.precision, settings.trainer.accelerator)
        lora, trains_with = settings.model.get("lora"), Precision.known(settings.trainer.precision)
        if lora is not None and trains_with is not None:  # a LoRA base the precision cannot train, before anything is built
            LoRA(**plain(lora)).check_precision(trains_with)

    # -- building and running ------------------------------------------------------------------

    def _set_seed(self) -> None:
        """Seed once, when the run is built: a deferred run (`resolve`) seeds in `build`/`launch`, so that parsing
        alone (``estimate``, ``recipes check``) leaves the process's random state and environment as they were."""
        if self._deferred or self._seeded:
            return
        self._seeded = True
        super()._set_seed()

    def _prepare(self) -> None:
        """Before anything is instantiated: the seed, the recipe's allocator settings on CUDA (before anything
        allocates, and before the checkpointing plan predicts with them), the task, and ``auto`` planned."""
        self._set_seed()
        if not runs_on_cpu(self.settings.trainer.accelerator):
            warning = self._held.enter_context(recipe_settings(self.memory.allocator))
            if warning:
                say(warning)
        training = self.config.get("subcommand") in (None, "fit")
        if training:
            self._resolve_task()
        for key, value in plan_run(self.settings, self.memory, training, self.step, lambda: self.read_card()).items():
            self.settings[key] = value  # the plan in place of auto, so the saved config and checkpoints hold it

    def _resolve_task(self) -> None:
        """``fit`` with ``model.num_labels`` or ``model.problem_type`` unset: what the training labels show, written
        into the settings so that the saved config and every checkpoint hold it."""
        model, data = self.settings.model, self.settings.data
        if model.num_labels is not None and model.problem_type is not None:
            return
        found = resolve_task(data.as_dict(), model.num_labels, model.problem_type)
        model.num_labels = data.num_labels = found.num_labels
        model.problem_type = data.problem_type = found.problem_type
        if found.label_names and not data.label_names:
            data.label_names = list(found.label_names)

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
                defaults = dict(zip(("predict", "advise", "timeline"), run_hooks(self.step(), recipes.shipped_settings)))
            except UserError as err:  # settings the memory model does not cover: measure only
                say(f"warning: no memory predictions for this run: {err}")
                defaults = {}
            hooks = {name: hook if hook is not None else defaults.get(name) for name, hook in hooks.items()}
        return hooks

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = self._get(self.config_init, "trainer", default={})
        if self.subcommand == "fit":  # exact resume, and a checkpoint every few hundred steps unless configured
            kwargs["callbacks"] = resume.fit_callbacks(trainer.get("callbacks"), trainer.get("enable_checkpointing"))
        kwargs.update(fp16_under_fsdp2(trainer))
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except UserError:
            raise
        except (MisconfigurationException, ValueError, TypeError) as err:  # Lightning's words for settings it cannot run with
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
        typed = [v for k, v in leaves(self.decision.typed) if k.rsplit(".", 1)[-1] in ("default_root_dir", "dirpath")]
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
        console.print_metrics(self.trainer, "val")

    def after_validate(self) -> None:
        console.print_metrics(self.trainer, "val")

    def after_test(self) -> None:
        console.print_metrics(self.trainer, "test")

    def after_predict(self) -> None:
        console.print_predict_metrics(self.trainer, self.model)


def named_files(argv: list[str]) -> list[str]:
    """The existing files an argv names (``--config FILE``, ``--key FILE``, ``--key=FILE``)."""
    found = []
    for token in argv:
        value = token.split("=", 1)[1] if token.startswith("--") and "=" in token else token
        try:
            if value and not value.startswith("-") and Path(value).exists():
                found.append(value)
        except (OSError, ValueError):
            continue
    return found


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
