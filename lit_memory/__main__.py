"""`python -m lit_memory`: Lightning's subcommands (fit, validate, test, predict) and the project's tools,
all listed by ``python -m lit_memory --help``.

The top of the package: the one place that imports both the runtime (through `lit_memory.cli`) and
the tools. A run's memory predictions and out-of-memory advice come from `lit_memory.planning.prediction.predict`,
which the CLI hands to the run's memory callbacks itself. A command's trust decision holds from its first line
to its last: shipped recipes, files the user trusted and ``--trust-recipe`` run here, as Lightning runs them
(`lit_memory.config.trusted`); the training or evaluation of a config nobody trusted runs in a child process the
kernel confines (`lit_memory.sandbox`), or is refused where an outside launcher started it
(`lit_memory.confine.launchers`).
"""

from __future__ import annotations

# `python -m lit_memory` imports lit_memory/__init__.py first, which drops the working folder from sys.path
# before anything else is imported: this module then imports the installed packages, as the console script does.
import contextlib
import importlib
import os
import sys
from typing import Any, Iterator, Optional

# Light: every help, `recipes list` and a mistyped command, recipe, option or data file answer before anything heavy is
# imported; torch, Lightning and transformers come with `lit_memory.cli` and the tools, for the commands that run
# (`_run`).
from lit_memory.config import data_check, option_names, shipped, short_help
from lit_memory.errors import UserError, shown
from lit_memory.tools import arguments as tool_arguments


def _bench(argv: list[str]) -> None:
    """``bench``, or with ``--gpu-proof`` the GPU proof built on it (`lit_memory.tools.proof`)."""
    name = "proof" if "--gpu-proof" in argv else "bench"
    getattr(importlib.import_module(f"lit_memory.tools.{name}"), "cli" if name == "proof" else "main")(argv)


def _tool(name: str):
    """A tool's ``main``, imported when the tool runs (each imports torch and Lightning)."""
    return lambda argv: importlib.import_module(f"lit_memory.tools.{name}").main(argv)


TOOLS = {
    "bench": _bench,
    "estimate": _tool("estimate"),
    "plan": _tool("plan"),
    "cards": _tool("cards"),
    "recipes": _tool("recipes"),
}
# One line per command for `python -m lit_memory --help`; `COMMAND --help` has every option.
LIGHTNING_COMMANDS = {
    "fit": "train a model (python -m lit_memory fit --config recipes/4gb.yaml); the run folder gets config, "
    "checkpoints, hf_model, memory.json",
    "validate": "evaluate a checkpoint (--ckpt_path) or a saved model on the validation split",
    "test": "evaluate a checkpoint (--ckpt_path) or a saved model on the test split",
    "predict": "label a file of texts (--data.predict_path texts.csv) with a checkpoint or a saved hf_model; "
    "writes predictions.csv",
}
TOOL_COMMANDS = {
    "estimate": "a run's memory before running it: tensors, allocator and device, predicted two ways",
    "plan": "the fastest recipe predicted to fit a memory budget (--budget 4GiB)",
    "cards": "what fits your card: plan's choice (full, LoRA, QLoRA) for the models people fine-tune now, 4-24 GB",
    "bench": "train every recipe in a fresh process and tabulate measured memory and speed",
    "recipes": "list the shipped recipes, show one, check a recipe someone sent, trust your own (recipes trust FILE)",
}


def usage() -> str:
    width = max(map(len, [*LIGHTNING_COMMANDS, *TOOL_COMMANDS]))
    lines = [
        "usage: python -m lit_memory COMMAND [options]",
        "       python -m lit_memory COMMAND --help     (its options; fit, validate, test, predict: --help all for "
        "every one)",
        "",
        "Fine-tune Hugging Face sequence classifiers with PyTorch Lightning in as little GPU memory as possible.",
        "",
        "training and inference (LightningCLI: --config FILE, --recipe NAME, dotted overrides like "
        "--data.batch_size 8):",
        *(f"  {name:<{width}}  {line}" for name, line in LIGHTNING_COMMANDS.items()),
        "",
        "tools:",
        *(f"  {name:<{width}}  {line}" for name, line in TOOL_COMMANDS.items()),
        "",
        shipped.recipe_help(),
    ]
    return "\n".join(lines)


def confined(args: list[str], decision: Optional[Any] = None) -> bool:
    """Whether the command runs in a confined child: a training or evaluation (``fit``, ``validate``, ``test``,
    ``predict``) whose configs nobody trusted (``decision``, `lit_memory.config.trust.Decision.of`: shipped recipes,
    files trusted with ``recipes trust`` and ``--trust-recipe`` run in this process), not already inside one."""
    from lit_memory.config.trust import Decision
    from lit_memory.sandbox.rules import ENV as CONFINED  # the variable a confined child is started with

    if not args or args[0] not in LIGHTNING_COMMANDS or os.environ.get(CONFINED):
        return False
    return (decision or Decision.of(args[1:])).confined


@contextlib.contextmanager
def session(args: list[str]) -> Iterator[Any]:
    """One command's trust decision (`lit_memory.config.trust.Decision`: every run and tool inside it is judged by it;
    ``--trust-recipe``, or its configs judged by content), from its first line to its last. Files typed on the command
    line are the user's: read even when they are not regular files (``--config <(...)``)."""
    from lit_memory import cli  # deferred: the run's libraries (torch, Lightning, jsonargparse)
    from lit_memory.config import trust

    decision = trust.Decision.of(args[1:])
    with decision.applied(cli.named_files(args), trust.recipe_folders(args)) as decision:
        yield decision


def main(argv: Optional[list[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    _show_warnings()
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        sys.exit(0 if args else 2)
    try:
        answered = quick(args)
    except UserError as err:
        _fail(str(err))
    if not answered:
        _run(args)


def quick(args: list[str]) -> bool:
    """What is answered before anything heavy is imported: ``recipes`` and ``recipes list``, a command's help (True);
    a command, recipe name, config file, option or data file that does not exist, or a data file the run would refuse
    (a `UserError`). False: the command runs."""
    command = args[0]
    if command not in LIGHTNING_COMMANDS and command not in TOOLS:
        raise UserError(f"unknown command {command!r}; choose one of: {', '.join([*LIGHTNING_COMMANDS, *TOOLS])} "
                        "(python -m lit_memory --help)")
    if command == "recipes" and args[1:] in ([], ["list"]):
        print(shipped.listing())
        return True
    if {"-h", "--help"} & set(args):
        return _help(command, args)
    if command == "recipes" and args[1:2] in (["trust"], ["untrust"], ["trusted"]):
        from lit_memory.config import trusted  # light: the trust store is read and written without torch

        trusted.main(args[1:])
        return True
    if command in LIGHTNING_COMMANDS:
        expanded = shipped.expand_recipes([a for a in args[1:] if a != shipped.TRUST_FLAG])
        for i, token in enumerate(expanded):
            path = expanded[i + 1] if token in ("--config", "-c") and i + 1 < len(expanded) else None
            path = token.split("=", 1)[1] if token.startswith(("--config=", "-c=")) else path
            # a value that names a file (jsonargparse also takes a config's text, or a URL it then refuses)
            named = path is not None and "://" not in path and path.lower().endswith((".yaml", ".yml", ".json"))
            if named and not os.path.exists(path):
                raise UserError(f"config file not found: {path}")
        option_names.check(command, expanded)
        data_check.check(command, expanded, trusted=shipped.TRUST_FLAG in args)
    return False


def _help(command: str, args: list[str]) -> bool:
    """``COMMAND --help`` before anything heavy is imported (True): a training command's short help
    (`lit_memory.config.short_help`), a tool's parser's. False: the full parser prints it (``COMMAND --help all``,
    ``bench --gpu-proof --help``)."""
    at = next(i for i, a in enumerate(args) if a in ("-h", "--help"))
    if command in LIGHTNING_COMMANDS:
        if args[at + 1 : at + 2] == [short_help.ALL]:
            return False
        print(short_help.short_help(command))
        return True
    if command not in tool_arguments.PARSERS or "--gpu-proof" in args:
        return False
    tool_arguments.PARSERS[command]().parse_known_args(args[1:])  # prints the help and exits, as the tool would
    return False


def _run(args: list[str]) -> None:
    """The command, with the libraries it runs on."""
    import datasets
    import torch

    from lit_memory import cli
    from lit_memory.confine import launch, launchers
    from lit_memory.run import environment
    from lit_memory.sandbox.rules import ENV as CONFINED

    # Per-map progress bars of `datasets` (filter, cast, tokenise) drown the training log.
    datasets.disable_progress_bars()
    code = 0
    try:
        with environment.safe_path(), session(args) as decision:
            if args and args[0] in TOOLS:
                TOOLS[args[0]](args[1:])
            elif confined(args, decision):  # judged here, run in a child the kernel confines
                launchers.check(decision.why)  # before anything starts: a launcher's ranks are not one sandbox
                if why := launch.unsupported():  # no Landlock: one line, nothing parsed
                    raise UserError(why)
                run = cli.resolve(args)
                launchers.check(decision.why, run.settings.trainer.num_nodes)
                print(shown(decision.why), file=sys.stderr)
                code = launch.run(args, run)
            else:
                cli.resolve(args).launch()
    except launchers.LauncherRefused as err:
        if not err.first:
            sys.exit(2)
        _fail(str(err))
    except UserError as err:
        _fail(str(err))
    except RecursionError:
        _fail("refusing an input nested too deeply to read (a recipe, config or checkpoint value)")
    except torch.OutOfMemoryError as err:
        # The memory monitor has printed the breakdown at the failure and a recipe that fits.
        print(f"error: out of memory: {shown(str(err).splitlines()[0])}", file=sys.stderr)
        sys.exit(1)
    except (SystemExit, KeyboardInterrupt):
        raise
    except PermissionError as err:
        if os.environ.get(CONFINED):  # the kernel refused what a sent recipe's run tried (`lit_memory.sandbox`)
            _fail(f"refused by the sandbox: {err}; pass --trust-recipe only if you trust the recipe's source")
        raise
    except BaseException as err:  # torch's distributed checkpoint wraps errors in a BaseException of its own
        if (masked := _user_error_behind(err)) is not None:  # a library's cleanup failed while handling ours
            _fail(str(masked))
        raise
    if code:
        sys.exit(code)


def _user_error_behind(err: BaseException) -> Optional[UserError]:
    """The `UserError` an exception was raised while handling, if any (Lightning's batch-size finder restores
    its settings in a ``finally`` that can fail itself, hiding the refusal that stopped it)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, UserError):
            return err
        err = err.__cause__ or err.__context__
    return None


def _show_warnings() -> None:
    """Python's warnings (jsonargparse's, Lightning's, the guard's) may quote a recipe's value: their message is
    printed through `shown` too, once installed for the process."""
    import warnings

    original = warnings.formatwarning
    if getattr(original, "shows", False):
        return

    def formatted(message: Any, *args: Any, **kwargs: Any) -> str:
        return original(shown(str(message)), *args, **kwargs)

    formatted.shows = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatted


def _fail(message: str) -> None:
    """One ``error:`` line per line of ``message``, a recipe's escape sequences in it shown, never acted on."""
    for line in message.splitlines():
        print(f"error: {shown(line)}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
