"""From a command line to one checked run: `resolve` and the LightningCLI it drives.

Every entry point (``fit``/``validate``/``test``/``predict``, ``estimate``, ``plan``, ``bench``,
the peer, ``recipes check``) turns its arguments into a run the same way: `resolve(argv)` expands
``--recipe NAME``, parses the layered configs, dotted overrides and a resumed checkpoint's
hyper-parameters with LightningCLI, and checks the result (`lit_memory.trust`) before anything is
built, loaded or written. The returned `LitMemoryCLI` holds the settings (`settings`); `build()`
instantiates the module, data (and Trainer), `launch()` runs the subcommand.
"""

from __future__ import annotations

import logging
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.trainer.states import TrainerFn

from lit_memory import lowbit, recipes, resume, trust
from lit_memory.data import TextClassificationData
from lit_memory.errors import UserError
from lit_memory.fused import parse_bucket
from lit_memory.monitor import Advise, MemoryMonitor, Predict
from lit_memory.model import DEFAULT_OPTIMIZER, SequenceClassifier
from lit_memory.precision import cpu_fallback, runs_on_cpu

RECIPE_FLAG = "--recipe"
HELP = (
    f"{RECIPE_FLAG} NAME: use a shipped recipe, as --config <its file> at that place (list them: python -m "
    f"lit_memory recipes). Recipes naming code outside the allowlist ({', '.join(trust.ALLOWLIST)}), or values that "
    f"run code (trust_remote_code, weights_only false, remote or pickled checkpoints), are refused; "
    f"{trust.TRUST_FLAG} lifts that, only for recipes from sources you trust."
)
# Settings that decide what a checkpoint's state means: resuming with other values is refused.
# Strategy is not among them (fused and unfused state have one format); how long to train is not either.
RESUME_KEYS = (
    "model.model_name_or_path", "model.num_labels", "model.pretrained", "model.config_overrides",
    "model.freeze", "model.lora", "model.embedding_optimizer_state", "model.optimizer.class_path",
    "trainer.precision", "trainer.accumulate_grad_batches",
    "data.source", "data.text_column", "data.label_column", "data.label_names", "data.max_length",
    "data.batch_size", "data.limit_train_samples", "data.seed",
)
RESUME_STATE = "lit_memory_settings"  # the checkpoint key holding them
_NOT_FLAGS = ("--config", "-c", "--print_config", "--help", "-h", trust.TRUST_FLAG)


class SaveRecipe(SaveConfigCallback):
    """Lightning's ``config.yaml``, plus ``recipe.yaml`` after a fit: the same settings with a
    header (command, machine, versions, measured peak), the run's own paths blanked and any value
    that would need ``--trust-recipe`` made safe. Checkpoints carry the settings a resume must match."""

    def __init__(self, *args: Any, command: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.command = command

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.run_dir = Path(trainer.log_dir)  # a collective: every rank asks, rank 0 writes
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._write(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            self._write(trainer)  # again, now that the run has measured its memory

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint[RESUME_STATE] = resume_settings(self.config.as_dict())

    def _write(self, trainer) -> None:
        settings = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for key in recipes.RUN_SPECIFIC:
            if key in self.config:
                _assign(settings, key, None)
        text = recipes.shared_recipe(
            yaml.safe_dump(trust.sanitize(settings), sort_keys=False), self.command,
            recipes.describe_machine(trainer), self.run_dir,
        )
        (self.run_dir / recipes.SHARED_RECIPE).write_text(text, encoding="utf-8")


class _Parser(LightningArgumentParser):
    """A refused import is one line naming the path and the key; other parse errors as jsonargparse prints them.

    Only the CLI's own parsers (``toplevel``) do this: jsonargparse parses a class's arguments with
    parsers of the same class and folds their errors into the enclosing key's message.
    """

    toplevel = False

    def error(self, message: str, ex: Optional[Exception] = None):
        denied = trust.denied_imports(message) if self.toplevel else []
        if denied:
            raise ImportRefused(denied)
        return super().error(message, ex)


class ImportRefused(UserError):
    def __init__(self, denied: list[tuple[str, str, str]]) -> None:
        super().__init__("\n".join(trust.import_refusal(path, key) for path, key, _ in denied))
        self.denied = denied


class _DropTips(logging.Filter):
    """Lightning's advertisements for its cloud products, among its info lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


# Known noise, matched by message so every other warning stays visible: Lightning's notice that
# tensorboardX is optional (the CSV logger it picks instead is what we want), its use of a pytree API
# torch deprecated, the model summary's note that it sizes bf16 weights as fp32, and torch's note, at
# the first compile of torchao's step, that its state tensors cannot key the AOT autograd cache.
NOISE = (
    r"Starting from v1\.9\.0, `tensorboardX` has been removed",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Precision .* is not supported by the model summary",
    r"OptimState\w+ does not implement _stable_hash_for_caching",  # torchao's state: compiles, is not cached
)


def quiet_known_noise() -> None:
    lightning_info = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropTips) for f in lightning_info.filters):
        lightning_info.addFilter(_DropTips())
    for message in NOISE:
        warnings.filterwarnings("ignore", message=message)


class LitMemoryCLI(LightningCLI):
    """LightningCLI for the project's module and data, with ``--recipe NAME``, the trust checks and
    the memory monitor. ``defer=True`` stops after parsing and checking (see `resolve`);
    ``collect=True`` keeps refused values in ``refusals`` and raises parse errors (``recipes check``).
    ``predict`` and ``advise`` are the memory monitor's hooks (`lit_memory.monitor`); by default the run's
    own `step` predicts (`lit_memory.memory.predict.run_hooks`), and advises from the shipped recipes."""

    def __init__(
        self,
        args: Union[list[str], dict, Namespace, None] = None,
        run: bool = True,
        defer: bool = False,
        collect: bool = False,
        predict: Optional[Predict] = None,
        advise: Optional[Advise] = None,
        **kwargs: Any,
    ) -> None:
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, (dict, Namespace)):  # LightningCLI also takes the config as an object: a file, not typed
            self.command, self.trusted, self.typed = "LitMemoryCLI(args=<a config object>)", False, frozenset()
        else:
            self.command = shlex.join(["python", "-m", "lit_memory", *map(str, argv)])
            self.trusted = trust.TRUST_FLAG in argv
            argv = expand_recipes([a for a in map(str, argv) if a != trust.TRUST_FLAG])
            self.typed = typed_keys(argv)
        if not self.trusted:
            trust.enforce_import_policy()
        elif trust.import_policy_enforced():
            raise UserError(
                f"{trust.TRUST_FLAG} cannot lift the import allowlist in a process that has already enforced it: "
                "run the trusted command in a process of its own"
            )
        quiet_known_noise()
        self._deferred = defer
        self._collect = collect
        self._memory_hooks = {"predict": predict, "advise": advise}
        self.refusals: list[trust.Refusal] = []
        self.problems: list[str] = []  # collect=True: what would stop the run, other than refusals
        if collect:  # parse errors raise (ArgumentError) instead of exiting
            kwargs["parser_kwargs"] = {"exit_on_error": False, **{s: {"exit_on_error": False} for s in self.subcommands()}}
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("save_config_callback", SaveRecipe)
        kwargs.setdefault("parser_class", _Parser)
        if kwargs["save_config_callback"] is SaveRecipe:
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
        self._check_values(self.config.get(self.config.get("subcommand") or "", self.config))
        if self.config.get("subcommand"):
            settings = self.config[self.config.subcommand]
            try:  # before LightningCLI merges the checkpoint's hyper-parameters into these settings
                check_resume(settings, compare=self.config.subcommand == "fit")
            except UserError as err:
                if not self._collect:
                    raise
                self.problems.append(str(err))
                settings.ckpt_path = None  # reported; not to be read again

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        # Load checkpoints with weights_only=True (tensors and plain data only, no pickled code);
        # Lightning's own default, None, defers to torch's default, which an environment variable can turn off.
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        parser.set_defaults(weights_only=True)
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model.optimizer": DEFAULT_OPTIMIZER})
        # Memory is measured in every run: a forced callback (always present, unlike a default in
        # `trainer.callbacks`, which a user's list would replace) with its own `memory:` config block.
        parser.add_lightning_class_args(MemoryMonitor, "memory")
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

    def step(self, target: Any = None) -> Any:
        """This run's training step as the memory model describes it (`lit_memory.memory.step.Step`), built
        from the resolved settings; ``target``: the device to predict for (default: the documented CUDA GPU)."""
        from lit_memory.memory.step import Step

        return Step.from_settings(self.settings.as_dict(), target)

    @property
    def settings(self) -> Namespace:
        """This run's resolved settings (the subcommand's part of the config)."""
        return self.config[self.subcommand] if self.subcommand else self.config

    def _check_values(self, settings: Namespace) -> None:
        if self.trusted:
            return
        self.refusals = trust.refused_values(settings.as_dict(), self.typed)
        if self.refusals and not self._collect:
            raise UserError("\n".join(map(str, self.refusals)))

    def before_instantiate_classes(self) -> None:
        settings = self.settings
        self._check_values(settings)  # again: a resumed checkpoint's hyper-parameters are merged in by now
        # As configured, before the CPU fallback below may change the precision.
        lowbit.check_settings(settings.model.optimizer, settings.trainer.precision, not runs_on_cpu(settings.trainer.accelerator))
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
            super().instantiate_classes()

    def _run_subcommand(self, subcommand: str) -> None:
        if not self._deferred:
            super()._run_subcommand(subcommand)

    def after_instantiate_classes(self) -> None:
        if self._deferred:
            return
        monitor = self.config_init[self.subcommand]["memory"] if self.subcommand else self.config_init["memory"]
        hooks = dict(self._memory_hooks)
        if None in hooks.values():
            from lit_memory.memory.predict import run_hooks

            try:
                defaults = dict(zip(("predict", "advise"), run_hooks(self.step(), recipes.shipped_settings)))
            except UserError as err:  # settings the memory model does not cover: measure only
                print(f"warning: no memory predictions for this run: {err}", file=sys.stderr)
                defaults = {}
            hooks = {name: hook if hook is not None else defaults.get(name) for name, hook in hooks.items()}
        for name, hook in hooks.items():
            if hook is not None:
                setattr(monitor, name, hook)

    def build(self, trainer: bool = True) -> "LitMemoryCLI":
        """Instantiate the module and data module (and the Trainer): ``self.model``, ``self.datamodule``."""
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

    def _check_checkpoint(self) -> None:
        """A special ``ckpt_path`` (``last``, ``hpc``) names a file only Lightning can find: find it with
        Lightning's own rules, before anything is set up, and check it like any other path."""
        ckpt_path = self.settings.get("ckpt_path")
        if self.trusted or ckpt_path not in trust.SPECIAL_CKPT:
            return
        # Private, and on purpose: the check must see exactly the path Lightning will load.
        found = self.trainer._checkpoint_connector._select_ckpt_path(
            TrainerFn(self.subcommand), ckpt_path, model_provided=True, model_connected=False
        )
        trust.check_resolved_checkpoint(found)

    def before_fit(self) -> None:
        self._check_checkpoint()

    def before_validate(self) -> None:
        self._check_checkpoint()

    def before_test(self) -> None:
        self._check_checkpoint()

    def before_predict(self) -> None:
        self._check_checkpoint()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        if self.subcommand == "fit":  # exact resume, and a checkpoint every few hundred steps unless configured
            trainer = self._get(self.config_init, "trainer", default={})
            kwargs["callbacks"] = resume.fit_callbacks(trainer.get("callbacks"), trainer.get("enable_checkpointing"))
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        self._print_metrics("val")

    def after_validate(self) -> None:
        self._print_metrics("val")

    def after_test(self) -> None:
        self._print_metrics("test")

    def _print_metrics(self, stage: str) -> None:
        if not self.trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith(f"{stage}_")}
        if metrics:
            print(f"{stage}: " + "  ".join(f"{k[len(stage) + 1:]}={v:.4f}" for k, v in sorted(metrics.items())))


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


# -- the command line ------------------------------------------------------------------------


def expand_recipes(argv: list[str]) -> list[str]:
    """``--recipe NAME`` becomes ``--config <its file>`` where it stands, so it layers with the other
    ``--config`` files and overrides in order (later sources win)."""
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == RECIPE_FLAG:
            name = next(tokens, None)
            if name is None:
                raise UserError(f"{RECIPE_FLAG} needs a recipe name; choose one of: {', '.join(recipes.names())}")
            out += ["--config", str(recipes.recipe_path(name))]
        elif token.startswith(RECIPE_FLAG + "="):
            out += ["--config", str(recipes.recipe_path(token.split("=", 1)[1]))]
        else:
            out.append(token)
    return out


def typed_keys(argv: list[str]) -> frozenset[str]:
    """The dotted keys a command line sets itself (``--model.optimizer.lr=1e-4``, ``--weights_only false``):
    the user's own values, trusted. A key given a file (``--model model.yaml``) is a file's values."""
    keys = set()
    for i, token in enumerate(argv):
        if not token.startswith("--") or token.startswith(_NOT_FLAGS):
            continue
        key, eq, value = token[2:].partition("=")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        if not _is_file(value):
            keys.add(key.rstrip("+"))
    return frozenset(keys)


def _is_file(value: str) -> bool:
    try:
        return bool(value) and Path(value).expanduser().is_file()
    except (OSError, ValueError):  # too long or too odd to be a path
        return False


def resume_settings(config: dict) -> dict[str, Any]:
    """The `RESUME_KEYS` of a config (plain dict)."""
    out = {}
    for key in RESUME_KEYS:
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    return out


def check_resume(settings: Namespace, compare: bool = True) -> None:
    """Refuse a checkpoint that cannot be read with ``weights_only=True`` and, when ``compare``, one made
    with other settings, with one line naming the differences."""
    ckpt_path = settings.get("ckpt_path")
    if ckpt_path is None or ckpt_path in trust.SPECIAL_CKPT or trust.checkpoint_refusals(str(ckpt_path)):
        return  # nothing to compare now; refused paths are reported by the trust check
    saved = saved_settings(Path(ckpt_path))
    if saved is None or not compare:
        return  # a checkpoint from elsewhere, without our record: Lightning checks what it can
    mine = resume_settings(settings.as_dict())
    differ = [k for k in RESUME_KEYS if k in saved and _canonical(saved[k]) != _canonical(mine[k])]
    if differ:
        details = "; ".join(f"{k}: {saved[k]!r} in the checkpoint, {mine[k]!r} here" for k in differ)
        raise UserError(
            f"checkpoint {ckpt_path} was made with other settings ({details}): resume with the settings it was "
            "made with (its run folder's recipe.yaml) or start a new run without ckpt_path"
        )


def saved_settings(path: Path) -> Optional[dict[str, Any]]:
    """The settings a checkpoint was made with, read with ``weights_only=True`` (a distributed
    checkpoint folder keeps them in Lightning's ``meta.pt``)."""
    file = path / "meta.pt" if path.is_dir() else path
    if not file.is_file():
        return None
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=not path.is_dir())
    except Exception as err:
        reason = (str(err).strip() or type(err).__name__).splitlines()[0]
        raise UserError(f"cannot load checkpoint {path} with weights_only=True: {reason}") from None
    return checkpoint.get(RESUME_STATE)


def _canonical(value: Any) -> Any:
    return yaml.safe_dump(value, sort_keys=True)


def _assign(tree: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree[part]
    tree[last] = value
