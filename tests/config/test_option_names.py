"""`lit_memory.config.option_names` and the light start of ``python -m lit_memory``: the help, ``recipes list`` and a
mistyped command, recipe, config or option answer without importing torch, Lightning, transformers or datasets, and the
option names read from the sources are the real parser's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

from lit_memory.config import option_names
from lit_memory.errors import UserError

HEAVY = ("torch", "lightning", "transformers", "datasets", "jsonargparse")


def imported_by(argv: list[str]) -> tuple[int, str, list[str]]:
    """(exit status, stderr, the heavy libraries imported) of ``python -m lit_memory ARGV`` in a fresh process."""
    code = (
        "import json, sys\n"
        "from lit_memory.__main__ import main\n"
        "status = 0\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    status = e.code or 0\n"
        f"print(json.dumps([status, [m for m in {HEAVY!r} if m in sys.modules]]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    status, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    return status, done.stderr, heavy


@pytest.mark.parametrize(
    "argv, status, error",
    [
        (["--help"], 0, None),
        (["recipes", "list"], 0, None),
        (
            ["fti"],
            2,
            "error: unknown command 'fti'; choose one of: fit, validate, test, predict, bench, estimate, plan, "
            "cards, recipes",
        ),
        (["fit", "--recipe", "3gb"], 2, "error: unknown recipe '3gb'; choose one of: 2gb, 4gb,"),
        (["fit", "--config", "no/such.yaml"], 2, "error: config file not found: no/such.yaml"),
        (
            ["fit", "--recipe", "4gb", "--data.sourcex", "a.csv"],
            2,
            "error: unknown option --data.sourcex for fit (did you mean --data.source?); every option: python -m "
            "lit_memory fit --help all",
        ),
        (
            ["predict", "--model.treshold=0.3"],
            2,
            "error: unknown option --model.treshold for predict (did you mean --model.threshold?)",
        ),
        (
            ["validate", "--trainer.max_epoch", "1", "--modle.threshold", "0.3"],
            2,
            "error: unknown option --modle.threshold",
        ),
        *(
            ([command, "--help"], 0, None)
            for command in ("fit", "validate", "test", "estimate", "plan", "cards", "bench")
        ),
        (["predict", "-h"], 0, None),
        (["recipes", "check", "--help"], 0, None),
        (["fit", "--recipe", "4gb", "--data.source", "no/such.csv"], 2, "error: data file not found: no/such.csv"),
    ],
)
def test_help_listing_and_argument_errors_import_nothing_heavy(argv, status, error):
    code, stderr, heavy = imported_by(argv)
    assert (code, heavy) == (status, [])
    if error:
        assert stderr.strip().splitlines() == [stderr.strip()] and stderr.startswith(error), stderr


def test_options_that_exist_pass_the_quick_check_and_reach_the_full_parse():
    for argv in (
        ["--data.sour", "x.csv"],  # a prefix, as argparse takes it
        ["--trainer.callbacks+=lit_memory.run.resume.ResumeCheckpoint", "--trainer.callbacks.every_n_train_steps=100"],
        [
            "--model.optimizer.init_args.lr=1e-3",
            "--model.lora.r",
            "8",
            "--print_config=skip_null",
            "--memory.tier",
            "4GiB",
        ],
        ["--model", "model.yaml", "--ckpt_path", "x.ckpt", "--weights_only", "true", "-c", "a.yaml"],
    ):
        option_names.check("fit", argv)
    option_names.check("predict", ["--predictions.format", "jsonl", "--return_predictions", "false"])
    option_names.check("test", ["--verbose", "false"])
    with pytest.raises(UserError, match=r"^unknown option --return_predictions for fit"):
        option_names.check("fit", ["--return_predictions", "false"])
    with pytest.raises(UserError, match=r"^unknown option --model.lroa.r for fit"):
        option_names.check("fit", ["--model.lroa.r", "8"])  # deeper keys: their parent exactly


def test_the_keys_an_option_sets_are_written_out_and_a_group_typed_as_a_mapping_sets_its_leaves(tmp_path):
    model_file = tmp_path / "model.yaml"
    model_file.write_text("threshold: 0.3\n")
    argv = [
        "--model.warmup_r", "0.3", '--model={"compile": false, "optimizer": {"init_args": {"lr": 0.01}}}',
        "--data", '{"batch_size": 8}', "--model", str(model_file), "--trainer.callbacks+=X", "--config", "a.yaml",
        "--print_config", "--ckpt_path=x.ckpt",
    ]
    assert option_names.typed_keys("validate", argv) == [
        "model.warmup_ratio",
        "model.compile",
        "model.optimizer.init_args.lr",
        "data.batch_size",
        "trainer.callbacks",
        "ckpt_path",
    ]  # a group given as a file, a --config and --print_config set no one setting


@pytest.mark.parametrize("command", ["fit", "validate", "test", "predict"])
def test_the_names_read_from_the_sources_are_the_parsers(command):
    from lit_memory.cli import resolve

    parser = resolve(["fit"]).parser._subcommands_action._name_parser_map[command]
    real = {o[2:].removesuffix("+") for a in parser._actions for o in a.option_strings
            if o.startswith("--") and not o.endswith(".help")}
    read = option_names.options(command)
    ours = {*(f"{g}.{n}" for g, names in read.items() if g for n in names), *(n for n in read[""] if len(n) > 1)}
    # the data module's linked settings follow the model's (`LitMemoryCLI.add_arguments_to_parser`): no options
    from lit_memory.config.arguments import COMMAND_LINKS, LINKS

    linked = {target for _, target, _ in (*LINKS, *COMMAND_LINKS.get(command, ()))}
    assert real == ours - linked
