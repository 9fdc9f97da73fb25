"""The command line's definitions: the parser (one-line errors, the options a user sets first in ``--help``), the
blocks and links every command adds, and the files an argv names."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Optional

from lightning.pytorch.cli import LightningArgumentParser

from lit_memory.config import short_help, trust
from lit_memory.console import LogProgress
from lit_memory.errors import UserError
from lit_memory.memory.settings import MemorySettings
from lit_memory.optim.configure import DEFAULT_OPTIMIZER
from lit_memory.run.best import EarlyStop
from lit_memory.run.predict_file import PredictionWriter

# One source of truth: the model decides the classes and the tokenizer, the data follows (the parser's links, as
# (source, target, compute_fn); a target is never typed: `LitMemoryCLI.typed_settings` leaves it out).
LINKS = (
    ("model.num_labels", "data.num_labels", None),
    ("model.problem_type", "data.problem_type", None),
    ("model.class_weights", "data.class_weights", None),  # the data: line shows them with their counts
    (("model.tokenizer_name_or_path", "model.model_name_or_path"), "data.tokenizer_name_or_path",
     lambda tokenizer, model: tokenizer or model),
)

# A command's own links: ``predict --output`` is where its `PredictionWriter` writes (one option for it).
COMMAND_LINKS = {"predict": (("output", "predictions.output", None),)}


class Parser(LightningArgumentParser):
    """A parse error is one line: a refused import names the path and the key, a config named by URL is
    refused; other errors as jsonargparse words them.

    ``toplevel`` marks the parsers LightningCLI makes (main and subcommands): jsonargparse nests
    parsers of the same class and folds their errors into the enclosing key's message.
    """

    toplevel = False
    # set on this run's parsers while they parse the command line alone (`lit_memory.cli.LitMemoryCLI`'s probe)
    probing = False

    def error(self, message: str, ex: Optional[Exception] = None):
        if not self.toplevel:
            return super().error(message, ex)
        if self.probing:  # a parse of the command line alone (`trust.typed_values`): fail quietly
            raise ProbeFailed(message)
        if bound := trust.bound_error():  # a config beyond the bounds an untrusted run reads
            raise bound
        if denied := trust.denied_imports(message):
            raise ImportRefused(denied)
        if url := trust.remote_config(message):
            raise UserError(trust.remote_config_refusal(url))
        raise UserError(" ".join(message.split()))

    def format_help(self) -> str:
        """A command's full help (``COMMAND --help all``): the options a user of this project sets first, as
        ``COMMAND --help`` shows them (`lit_memory.config.short_help`), then every option (Lightning's too)."""
        full = super().format_help()
        command = self.prog.split()[-1]
        if not self.toplevel or command not in ("fit", "validate", "test", "predict"):
            return full
        helps = {option: a.help or "" for a in self._actions for option in a.option_strings}
        lines = short_help.section(command, helps, "the options you set first (every option follows):")
        return "\n".join(lines) + "\n\n" + full


class ProbeFailed(Exception):
    pass


class ImportRefused(UserError):
    def __init__(self, denied: list[tuple[str, str, str]]) -> None:
        first = trust.import_refusal(*denied[0][:2])
        more = f" (and {', '.join(path for path, _, _ in denied[1:])})" if len(denied) > 1 else ""
        super().__init__(first + more)
        self.denied = denied


def named_files(argv: list[str]) -> list[str]:
    """The existing files an argv names (``--config FILE``, ``--key FILE``, ``--key=FILE``, ``file://`` URLs too:
    jsonargparse reads them as files)."""
    found = []
    for token in argv:
        value = token.split("=", 1)[1] if token.startswith("--") and "=" in token else token
        value = re.sub(r"^file:///?", "/", value)
        try:
            if value and not value.startswith("-") and Path(value).exists():
                found.append(value)
        except (OSError, ValueError):
            continue
    return found


def stubs_without_a_subprocess() -> None:
    """jsonargparse reads signatures from typeshed stubs through typeshed_client, whose search path, unless given one,
    comes from a ``python -c "import sys, json; ..."`` it starts in the working folder, with that folder first on its
    path: a ``json.py`` in a folder someone sent ran there while `recipes check` said ok. The resolver is made here
    once, with this process's own path (without the working folder), so the parse starts no Python at all
    (`lit_memory.run.environment.safe_path` covers the rest). jsonargparse caches it in its private module with no
    setter; tests/config/test_trust.py checks the names this uses still exist."""
    try:
        from jsonargparse import _stubs_resolver as stubs
        from jsonargparse._common import get_parsing_setting
    except ImportError:
        return
    if stubs.stubs_resolver is not None or not stubs.typeshed_client_support:
        return
    work = os.path.realpath(os.getcwd())
    path = [Path(p) for p in sys.path if p and os.path.isabs(p) and os.path.realpath(p) != work]
    context = stubs.tc.get_search_context(
        search_path=path, allow_py_files=get_parsing_setting("stubs_resolver_allow_py_files")
    )
    stubs.stubs_resolver = stubs.StubsResolver(search_context=context)


def config_files(argv: list[str]) -> list[str]:
    """The files ``--config`` names in an argv (``--config FILE``, ``--config=FILE``), in order."""
    found = []
    for i, token in enumerate(argv):
        if token in ("--config", "-c") and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif token.startswith(("--config=", "-c=")):
            found.append(token.split("=", 1)[1])
    return found


def add_arguments(parser: LightningArgumentParser) -> None:
    """What every command's parser adds to Lightning's: the default optimizer, the ``memory:``, ``progress:`` and
    ``early_stopping:`` blocks, `LINKS`, and ``--cpu_bf16_fallback``."""
    parser.set_defaults({"model.optimizer": DEFAULT_OPTIMIZER})
    # Memory is measured in every run: its `memory:` block, whose callbacks every run gets (`_instantiate_trainer`;
    # unlike a default in `trainer.callbacks`, a user's list does not replace them).
    parser.add_class_arguments(MemorySettings, "memory", fail_untyped=False, instantiate=False, sub_configs=True)
    # Progress lines where the output is not a terminal (a log); on a terminal Lightning's rich bar (see
    # `_instantiate_trainer`). Its `progress:` block sets how often.
    parser.add_lightning_class_args(LogProgress, "progress")
    # Early stopping on the best checkpoint's metric: ``--early_stopping.patience N`` (off unless set).
    parser.add_lightning_class_args(EarlyStop, "early_stopping")
    for source, target, compute_fn in LINKS:
        parser.link_arguments(source, target, compute_fn=compute_fn)
    parser.add_argument(
        "--cpu_bf16_fallback",
        type=bool,
        default=True,
        help="On a CPU without native bf16 (AVX512-BF16/AMX), train bf16 recipes in 32-true, with a warning.",
    )


def add_command_arguments(parser: LightningArgumentParser, command: str) -> None:
    """A command's own: checkpoints loaded weights-only; predict's ``predictions:`` block."""
    # Load checkpoints with weights_only=True (tensors and plain data only, no pickled code);
    # Lightning's own default, None, defers to torch's default, which an environment variable can turn off.
    parser.set_defaults(weights_only=True)
    if command == "predict":
        # Predictions go to a file batch by batch (`predictions:`), so Lightning need not keep them all in memory.
        parser.set_defaults(return_predictions=False)
        parser.add_lightning_class_args(PredictionWriter, "predictions")
        parser.add_argument(
            "--output",
            type=Optional[str],
            default=None,
            help="the predictions' file (.csv, .tsv, .jsonl: the format) or a folder for predictions.<format>; "
            "default: "
            "beside the model, RUN/predictions.csv in its checkpoint's or hf_model's run folder (the next call "
            "replaces it, and says so).",
        )
    for source, target, compute_fn in COMMAND_LINKS.get(command, ()):
        parser.link_arguments(source, target, compute_fn=compute_fn)
