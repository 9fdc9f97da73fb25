"""From a command line to one checked run: `resolve` and the LightningCLI it drives.

Every entry point (``fit``/``validate``/``test``/``predict``, ``estimate``, ``plan``, ``bench``,
the peer, ``recipes check``) turns its arguments into a run the same way: `resolve(argv)` expands
``--recipe NAME`` (`lit_memory.recipes`), makes the run's trust decision (`lit_memory.trust`), parses
the layered configs, dotted overrides and a resumed checkpoint's hyper-parameters with LightningCLI,
and checks the result (the trust decision's refusals, `lit_memory.resume.check_resume`) before anything
is built, loaded or written. The returned `LitMemoryCLI` holds the settings (`settings`); `build()`
instantiates the module, data (and Trainer, its checkpoint IO under `lit_memory.guard`), `launch()`
runs the subcommand after the guard's `preflight`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Union

from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only

from lit_memory import box, checks, guard, optimizers, precision, recipes, resume, trust
from lit_memory.activations import is_auto
from lit_memory.console import LogProgress, ModelSummary, interactive
from lit_memory.data import TextClassificationData
from lit_memory.errors import UserError
from lit_memory.fused import parse_bucket
from lit_memory.model import DEFAULT_OPTIMIZER, SequenceClassifier
from lit_memory.monitor import Advise, MemoryMonitor, Predict
from lit_memory.noise import quiet_evaluation_noise, quiet_known_noise
from lit_memory.precision import changes_on, cpu_fallback, on_gpu, runs_on_cpu
from lit_memory.predictions import PredictionWriter

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
    probing = False  # a parse of the command line alone (`trust.typed_values`): fail quietly

    def error(self, message: str, ex: Optional[Exception] = None):
        if not self.toplevel:
            return super().error(message, ex)
        if _Parser.probing:
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
    """LightningCLI for the project's module and data, with ``--recipe NAME``, the trust decision and
    the memory monitor. ``defer=True`` stops after parsing and checking (see `resolve`);
    ``collect=True`` keeps refused values in ``refusals`` and other problems in ``problems``
    (``recipes check``). ``predict`` and ``advise`` are the memory monitor's hooks (`lit_memory.monitor`);
    by default the run's own `step` predicts (`lit_memory.memory.predict.run_hooks`), and advises from the
    shipped recipes. ``gpu``: the `lit_memory.memory.device.Gpu` the run is for, whose bf16 support decides
    the precision (`lit_memory.precision.on_gpu`): by default the one it trains on, None for none
    (``estimate``/``plan`` give their target's)."""

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
        self.decision.enforce(typed_files=[] if self.argv is None else named_files(self.argv))
        quiet_known_noise()
        self._deferred = defer
        self._collect = collect
        self._memory_hooks = {"predict": predict, "advise": advise}
        self.refusals: list[trust.Refusal] = []
        self.problems: list[str] = []  # collect=True: what would stop the run, other than refusals
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("save_config_callback", recipes.SaveRecipe)
        kwargs.setdefault("parser_class", _Parser)
        if kwargs["save_config_callback"] is recipes.SaveRecipe:
            kwargs["save_config_kwargs"] = {"command": self.command, **(kwargs.get("save_config_kwargs") or {})}
        super().__init__(
            SequenceClassifier,
            TextClassificationData,
            args=argv,
            run=run,
            auto_configure_optimizers=False,  # the module takes the optimizer (it builds decay groups)
            **kwargs,
        )

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
        try:  # before resuming compares the precision a checkpoint was made with
            self._follow_device()
        except UserError as err:
            if not self._collect:
                raise
            self.problems.append(str(err))
        self._confine()
        if subcommand:
            try:  # before LightningCLI merges the checkpoint's hyper-parameters into these settings
                resume.check_resume(self.settings_of(self.config), compare=subcommand == "fit")
            except UserError as err:
                if not self._collect:
                    raise
                self.problems.append(str(err))
                self.config[subcommand].ckpt_path = None  # reported; not to be read again

    def _follow_device(self) -> None:
        """A recipe's bf16 on a GPU without bf16 (`lit_memory.precision.on_gpu`), unless the user typed it."""
        trainer = self.settings.trainer
        gpu = precision.training_gpu(trainer.accelerator) if self._gpu is THIS_GPU else self._gpu
        if changes_on(trainer.precision, gpu) and not self._typed("trainer.precision", trainer.precision):
            trainer.precision = on_gpu(trainer.precision, gpu)

    def _typed(self, key: str, value: Any) -> bool:
        """Whether the user typed ``key`` as ``value`` on the command line (a file did not set it after)."""
        if self.argv is None:
            return False
        decision = self.decision
        if decision.trusted:  # the trust decision reads them only for untrusted runs
            typed = trust.typed_values(self.argv, self._parse_alone, self.config.get("subcommand"))
            decision = dataclasses.replace(decision, typed=typed)
        return decision.is_typed(key, value)

    def _confine(self) -> None:
        """Tell this process's box (`lit_memory.box`, held by ``python -m lit_memory`` for an untrusted
        command) where this run writes: its run folder (``trainer.default_root_dir``, the working folder by
        default: create-only, since its parent chose it or nobody did; the user's own when typed), the
        folders the user typed, and which setting names which path (for the refusal lines)."""
        typed = dict(trust.leaves(self.decision.typed))
        guard.set_typed(typed)
        held = box.active()
        if held is None or self.decision.trusted:
            return
        settings = self.settings
        root = settings.get("trainer.default_root_dir")
        own = root is not None and self.decision.is_typed("trainer.default_root_dir", root)
        label = "trainer.default_root_dir" if root else "the working folder: trainer.default_root_dir's default"
        held.allow(os.path.expanduser(str(root)) if root else os.getcwd(), label, owned=own)
        for key, value in typed.items():
            if key.rsplit(".", 1)[-1] in guard.WRITE_KEYS and isinstance(value, str) and value and not guard.is_remote(value):
                held.allow(value, key, owned=True)
        held.name_settings(trust.leaves(settings))
        workers = settings.get("data.num_workers")
        held.max_children = 2 * max(os.cpu_count() or 1, workers if isinstance(workers, int) else 0) + 4
        box.publish()

    def _parse_alone(self, argv: list[str]) -> Namespace:
        _Parser.probing = True
        try:
            return self.parser.parse_args(argv)
        finally:
            _Parser.probing = False

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
        # Memory is measured in every run: a forced callback (always present, unlike a default in
        # `trainer.callbacks`, which a user's list would replace) with its own `memory:` config block.
        parser.add_lightning_class_args(MemoryMonitor, "memory")
        # Progress lines where the output is not a terminal (a log); on a terminal Lightning's rich bar (see
        # `_instantiate_trainer`). Its `progress:` block sets how often.
        parser.add_lightning_class_args(LogProgress, "progress")
        # One source of truth: the model decides the classes and the tokenizer, the data follows.
        parser.link_arguments("model.num_labels", "data.num_labels")
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
        """This run's training step as the memory model describes it (`lit_memory.memory.step.Step`), built
        from the resolved settings; ``target``: the device to predict for (default: the documented CUDA GPU)."""
        from lit_memory.memory.step import Step

        return Step.from_settings(self.settings.as_dict(), target)

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
        # The fused strategies refuse a bad bucket when built, but jsonargparse would wrap that line into
        # its error for the Trainer's `strategy` union: check it first, as one line.
        bucket = getattr(getattr(settings.trainer.strategy, "init_args", None), "bucket", None)
        if bucket is not None:
            parse_bucket(bucket)

    # -- building and running ------------------------------------------------------------------

    def instantiate_classes(self) -> None:
        if not self._deferred:
            self._use_allocator_settings()
            self._plan_checkpointing()
            super().instantiate_classes()

    def _use_allocator_settings(self) -> None:
        """The recipe's ``memory.allocator``, for a run on CUDA, before anything allocates there (and before
        the checkpointing plan, which predicts with them). A CPU run leaves the environment alone."""
        from lit_memory.memory.allocator import use_recipe_conf

        if not runs_on_cpu(self.settings.trainer.accelerator):
            warning = use_recipe_conf(self.settings.memory.allocator)
            if warning:
                say(warning)

    def _plan_checkpointing(self) -> None:
        """``model.gradient_checkpointing: auto`` becomes the plan with the fewest FLOPs predicted to fit this
        run's device budget (`lit_memory.memory.recompute`), for the device it runs on, before the module is
        built; the config (and the recipe the run saves) then holds that plan. On CUDA the budget is the smaller
        of ``memory.budget``/``memory.tier`` and what the run's card has free at start (`read_card`, matched to
        the catalogue by name for its speeds); one line says which applied, one what was chosen."""
        settings = self.settings
        training = self.config.get("subcommand") in (None, "fit")
        if not training and is_auto(settings.model.gradient_checkpointing):
            settings.model.gradient_checkpointing = False  # no backward to plan for: nothing is recomputed
        if not is_auto(settings.model.gradient_checkpointing):
            if is_auto(settings.model.offload_activations):  # weighed only against a plan being chosen
                settings.model.offload_activations = False
            return
        from dataclasses import replace

        from lit_memory.data import check_shape
        from lit_memory.memory.device import planning_limit, target
        from lit_memory.memory.recompute import planned
        from lit_memory.memory.step import budget_name, budget_of

        check_shape(settings.data.batch_size, settings.data.max_length)  # the shape the plan is sized for
        device = "cpu" if runs_on_cpu(settings.trainer.accelerator) else "cuda"  # (its allocator: set just before)
        found = target(device)
        as_dict = settings.as_dict()
        budget, where = budget_of(as_dict), budget_name(as_dict) or ""
        card = self._card() if device == "cuda" else None
        if card is not None:
            found = replace(found, gpu=card.gpu)
        budget, where, line = planning_limit(budget, where, card)
        if line:
            print(line, file=sys.stderr)
        step = planned(self.step(found), budget, where)
        settings.model.gradient_checkpointing = step.model["gradient_checkpointing"]
        settings.model.offload_activations = step.model["offload_activations"]
        say(step.planned)

    def _card(self) -> Any:
        """The run's card at start (`lit_memory.memory.device.read_card`, the seam a test replaces), or None
        where reading it here would break the launch: a strategy that forks or spawns its processes must find
        CUDA uninitialised in this one."""
        strategy = self.settings.trainer.strategy
        name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "") or ""
        if "spawn" in name or "fork" in name:
            print(f"memory: the card is not read before {name} starts its processes: auto plans for the budget alone",
                  file=sys.stderr)
            return None
        return self.read_card()

    @staticmethod
    def read_card() -> Any:
        from lit_memory.memory.device import read_card

        return read_card()

    def _run_subcommand(self, subcommand: str) -> None:
        if not self._deferred:
            super()._run_subcommand(subcommand)

    def after_instantiate_classes(self) -> None:
        if self._deferred:
            return
        monitor = self.config_init[self.subcommand]["memory"] if self.subcommand else self.config_init["memory"]
        hooks = dict(self._memory_hooks)
        if None in hooks.values() and self.subcommand in (None, "fit"):  # the monitor predicts for training only
            from lit_memory.memory.predict import run_hooks

            try:
                defaults = dict(zip(("predict", "advise"), run_hooks(self.step(), recipes.shipped_settings)))
            except UserError as err:  # settings the memory model does not cover: measure only
                say(f"warning: no memory predictions for this run: {err}")
                defaults = {}
            hooks = {name: hook if hook is not None else defaults.get(name) for name, hook in hooks.items()}
        for name, hook in hooks.items():
            if hook is not None:
                setattr(monitor, name, hook)

    def build(self, trainer: bool = True) -> "LitMemoryCLI":
        """Instantiate the module and data module (and the Trainer): ``self.model``, ``self.datamodule``."""
        self._use_allocator_settings()
        self._plan_checkpointing()
        if trainer:
            LightningCLI.instantiate_classes(self)
            self.after_instantiate_classes()
        else:
            self.config_init = self.parser.instantiate_classes(self.config)
            self.datamodule = self._get(self.config_init, "data")
            self.model = self._get(self.config_init, "model")
        return self

    def launch(self) -> None:
        """Build and run the subcommand of a deferred run."""
        self._deferred = False
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = self._get(self.config_init, "trainer", default={})
        if self.subcommand == "fit":  # exact resume, and a checkpoint every few hundred steps unless configured
            kwargs["callbacks"] = resume.fit_callbacks(trainer.get("callbacks"), trainer.get("enable_checkpointing"))
            if not self.decision.trusted:  # checkpoint cadence and count over all callbacks, for the whole run
                typed = self._typed_callbacks(trainer.get("callbacks") or [])
                kwargs["callbacks"].append(guard.RunBounds(typed=lambda c: id(c) in typed))
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
        """The Trainer with the forced callbacks, where they apply: progress lines only off a terminal, with the
        progress bar on and none of the user's own; the model summary (`lit_memory.console.ModelSummary`) unless
        turned off or the user configured one."""
        given = config.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        progress = [c for c in callbacks if isinstance(c, LogProgress)]
        callbacks = [c for c in callbacks if not isinstance(c, LogProgress)]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            if not interactive():
                callbacks += progress
        if config.get("enable_model_summary") is not False and not any(isinstance(c, LightningModelSummary) for c in given):
            callbacks.append(ModelSummary())
            config["enable_model_summary"] = False  # Lightning's own default summary: ours stands in for it
        return super()._instantiate_trainer(config, callbacks)

    def _typed_callbacks(self, callbacks: list[Any]) -> set[int]:
        """Ids of the callbacks whose class spec the user typed on the command line (theirs, bounds and all)."""
        specs = self.settings.get("trainer.callbacks") or []
        typed = self.decision.typed.get("trainer.callbacks") or [] if isinstance(self.decision.typed, Namespace) else []
        return {id(c) for c, spec in zip(callbacks, specs) if any(spec == t for t in typed)}

    def _preflight(self) -> None:
        if self.subcommand != "fit":
            quiet_evaluation_noise()
        if self.settings.get("ckpt_path") is not None:
            self.model.report_new_head = False  # the checkpoint's head replaces the one built first
        typed = [v for k, v in trust.leaves(self.decision.typed) if k.rsplit(".", 1)[-1] in ("default_root_dir", "dirpath")]
        guard.preflight(self.trainer, self.subcommand, self.settings.get("ckpt_path"), tuple(typed))
        if guard.restricted() and self.subcommand == "fit" and getattr(self.model, "hparams", {}).get("save_pretrained"):
            run_dir = self.trainer.log_dir or self.trainer.default_root_dir  # where `SequenceClassifier.on_fit_end` exports
            guard.check_replace(Path(run_dir) / "hf_model", "model.save_pretrained")

    def before_fit(self) -> None:
        self._preflight()

    def before_validate(self) -> None:
        self._preflight()

    def before_test(self) -> None:
        self._preflight()

    def before_predict(self) -> None:
        self._preflight()

    def after_fit(self) -> None:
        self._print_metrics("val")

    def after_validate(self) -> None:
        self._print_metrics("val")

    def after_test(self) -> None:
        self._print_metrics("test")

    def after_predict(self) -> None:
        # Lightning keeps no metrics for predict: the module computed them where the inputs had labels.
        results = getattr(self.model, "predict_results", None)
        if results and self.trainer.is_global_zero:
            print("predict: " + "  ".join(f"{k.removeprefix('predict_')}={v:.4f}" for k, v in sorted(results.items())))

    def _print_metrics(self, stage: str) -> None:
        if not self.trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith(f"{stage}_")}
        if metrics:
            print(f"{stage}: " + "  ".join(f"{k[len(stage) + 1:]}={v:.4f}" for k, v in sorted(metrics.items())))


def say(line: str) -> None:
    """A line on stderr from the process of global rank 0 only: Lightning's launcher runs this command again for
    every other rank (``LOCAL_RANK``/``RANK`` set), which would repeat it once per process."""
    if rank_zero_only.rank == 0:
        print(line, file=sys.stderr)

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


def fp16_under_fsdp2(trainer: dict[str, Any]) -> dict[str, Any]:
    """Trainer arguments that run ``16-mixed`` under FSDP2 on CUDA (a GPU without bf16: `lit_memory.precision`).
    Lightning refuses the precision flag with ModelParallelStrategy (`lit_memory.FSDP2Strategy` is one), yet
    GradScaler works there: its unscale of the sharded gradients reduces the overflow flag over the ranks
    (torch's DTensor), and the fused step reduces its own. So the same precision comes as a plugin."""
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import ModelParallelStrategy

    if str(trainer.get("precision")) != "16-mixed" or not isinstance(trainer.get("strategy"), ModelParallelStrategy):
        return {}
    if runs_on_cpu(trainer.get("accelerator")):
        return {}  # Lightning's own answer on a CPU (it runs 16-mixed as bf16)
    plugins = trainer.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    return {"precision": None, "plugins": [*plugins, MixedPrecision("16-mixed", "cuda")]}


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
