from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import COMPILED, CONFIGS, FAST, RECIPES, the_error

from lit_memory.__main__ import main
from lit_memory.cli import LitMemoryCLI
from lit_memory.config import shared_recipe
from lit_memory.memory.measure import records

# those: tests/run/test_compiling.py
ALL_RECIPES = sorted(p.stem for p in RECIPES.glob("*.yaml") if p.stem not in COMPILED)
TINY_BERT = (
    '--model.config_overrides={"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, '
    '"intermediate_size": 128}'
)


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_recipe_parses_and_trains_two_steps(recipe, fast_args):
    cli = LitMemoryCLI(args=["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *fast_args])
    assert cli.trainer.global_step == 2
    run_dir = cli.trainer.log_dir
    assert (RECIPES / f"{recipe}.yaml").exists()
    saved = yaml.safe_load(open(f"{run_dir}/config.yaml"))
    assert saved["trainer"]["max_steps"] == 2  # the resolved config is kept with the run
    assert cli.model.model.config.num_labels == cli.datamodule.hparams.num_labels == 2  # linked, not repeated
    assert "num_labels" not in saved["data"]


def test_layered_configs_switch_model(fast_args):
    cli = LitMemoryCLI(
        args=[
            "fit",
            "--config",
            str(RECIPES / "baseline.yaml"),
            "--config",
            str(CONFIGS / "bert-large.yaml"),
            TINY_BERT,
            *fast_args,
        ]
    )
    assert cli.model.hparams.pretrained is False
    assert cli.model.model.config.num_hidden_layers == 2
    assert cli.datamodule.hparams.tokenizer_name_or_path == "bundled:bert-large"  # the tokenizer follows the model


def test_print_config_shows_the_seed_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--print_config"])
    assert exit_.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["optimizer"]["class_path"] == "torch.optim.AdamW"
    assert config["model"]["optimizer"]["init_args"]["lr"] == 2e-5
    assert config["model"]["optimizer"]["init_args"]["weight_decay"] == 0.01
    assert config["seed_everything"] == 42


def test_unknown_recipe_key_is_rejected_by_the_parser(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((RECIPES / "baseline.yaml").read_text() + "  batchsize: 4\n")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(bad), f"--trainer.default_root_dir={tmp_path}"])
    assert exit_.value.code == 2
    assert "batchsize" in capsys.readouterr().err


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--data.source=missing/reviews.csv", f"--trainer.default_root_dir={tmp_path}"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: data file not found: missing/reviews.csv"]
    assert list(tmp_path.iterdir()) == []


def test_data_errors_stop_before_the_run_folder_exists(tmp_path, capsys):
    csv = tmp_path / "d.csv"
    csv.write_text("body,label\nhello,0\nworld,1\n")
    root = tmp_path / "runs"
    with pytest.raises(SystemExit):
        main(["fit", f"--data.source={csv}", f"--trainer.default_root_dir={root}"])
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: no text column in {csv}: its columns")
    assert not root.exists()


def print_config(argv, capsys) -> dict:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *argv, "--print_config"])
    assert exit_.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_recipe_name_stands_for_its_file_where_it_is_given(capsys):
    # later sources win: the recipe overrides what comes before it, and is overridden by what follows
    bert_large = str(CONFIGS / "bert-large.yaml")
    config = print_config(["--data.batch_size=8", "--recipe", "accumulate", "--config", bert_large], capsys)
    assert config["data"]["batch_size"] == 1 and config["trainer"]["accumulate_grad_batches"] == 32
    assert config["model"]["model_name_or_path"] == "bundled:bert-large"
    config = print_config(["--recipe=accumulate", "--data.batch_size=8"], capsys)
    assert config["data"]["batch_size"] == 8 and config["trainer"]["accumulate_grad_batches"] == 32
    assert config == print_config(["--config", str(RECIPES / "accumulate.yaml"), "--data.batch_size=8"], capsys)


def test_checkpoints_load_with_weights_only_by_default(capsys):
    assert print_config([], capsys)["weights_only"] is True


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """A 2-step fit of a tiny random BERT with the Adafactor recipe: its run folder."""
    root = tmp_path_factory.mktemp("first")
    args = ["fit", "--recipe", "adafactor", "--config", str(CONFIGS / "bert-large.yaml"), TINY_BERT, *FAST]
    extra = ["--trainer.accumulate_grad_batches=1", "--data.batch_size=4", "--trainer.enable_checkpointing=true"]
    cli = LitMemoryCLI(args=[*args, *extra, f"--trainer.default_root_dir={root}"])
    return Path(cli.trainer.log_dir)


def resolved(run_dir: Path) -> dict:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["trainer"].pop("default_root_dir")  # the one run-specific path
    return config


def test_a_fit_writes_a_shareable_recipe_that_reproduces_its_settings(shared_run, tmp_path):
    text = (shared_run / shared_recipe.SHARED_RECIPE).read_text()
    header = dict(line[2:].split(": ", 1) for line in text.splitlines() if line.startswith("# ") and ": " in line)
    assert header["command"].startswith("python -m lit_memory fit --recipe adafactor --config ")
    assert header["machine"].startswith("1 node(s) x 1 cpu device(s);")
    for package in ("lit_memory", "torch", "lightning", "transformers"):
        version = __import__(package).__version__
        assert f"{package} {version}" in header["versions"]
    assert header["measured peak memory"] == records.peak_summary(shared_run)
    assert header["measured peak memory"].endswith(" process RSS growth (cpu)")
    settings = yaml.safe_load(text)
    assert settings["trainer"]["default_root_dir"] is None and settings["ckpt_path"] is None
    assert settings["model"]["optimizer"]["class_path"] == "transformers.Adafactor"

    # someone else runs it as is, from their own folder
    shared = str(shared_run / shared_recipe.SHARED_RECIPE)
    rerun = LitMemoryCLI(args=["fit", "--config", shared, f"--trainer.default_root_dir={tmp_path}"])
    assert rerun.trainer.global_step == 2
    assert resolved(Path(rerun.trainer.log_dir)) == resolved(shared_run)


def test_resume_restores_optimizer_and_loop_state_with_weights_only(shared_run, tmp_path):
    [ckpt] = (shared_run / "checkpoints").glob("*.ckpt")
    state = torch.load(ckpt, weights_only=True)  # tensors and plain data only: no pickled code needed
    assert state["optimizer_states"][0]["state"] and state["global_step"] == 2
    cli = LitMemoryCLI(
        args=[
            "fit",
            "--config", str(shared_run / shared_recipe.SHARED_RECIPE),
            f"--ckpt_path={ckpt}",
            "--trainer.max_steps=4",
            "--trainer.max_epochs=2",  # the checkpoint was taken at the end of epoch 0
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )
    assert cli.config.fit.weights_only is True
    assert cli.trainer.global_step == 4
    assert cli.trainer.optimizers[0].state_dict()["state"][0]["step"] == 4  # Adafactor's count went on from 2


def test_resuming_with_other_settings_is_one_line_naming_them(shared_run, tmp_path, capsys):
    [ckpt] = (shared_run / "checkpoints").glob("*.ckpt")
    argv = ["fit", "--config", str(shared_run / shared_recipe.SHARED_RECIPE), f"--ckpt_path={ckpt}",
            "--model.optimizer=torch.optim.AdamW", "--data.batch_size=8", f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: checkpoint {ckpt} was made with other settings (")
    assert "model.optimizer.class_path: 'transformers.Adafactor' in the checkpoint, 'torch.optim.AdamW' here" in line
    assert "data.batch_size: 4 in the checkpoint, 8 here" in line
    assert list(tmp_path.iterdir()) == []


def test_a_last_checkpoint_is_found_by_lightnings_rules_and_checked_before_anything_runs(tmp_path, capsys):
    import pickle

    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ckpts" / "last.ckpt"  # a distributed checkpoint whose metadata runs code
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    marker = tmp_path / "UNPICKLED"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    callback = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": str(tmp_path / "ckpts"), "save_last": True}}
    argv = ["fit", "--ckpt_path=last", f"--trainer.callbacks+={json.dumps(callback)}",
            f"--trainer.default_root_dir={tmp_path / 'runs'}"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    line = the_error(capsys.readouterr().err)
    assert line.startswith(f"error: refusing ckpt_path={str(folder)!r}: its .metadata names code to run when unpickled")
    assert not marker.exists() and not (tmp_path / "runs").exists()


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_runs_switches_hold_for_the_run_only(tmp_path):
    """What a run switches in this process holds inside its scope and is as it was after it: the trust decision
    (jsonargparse's import policy, torch's weights-only switch, the guard's sinks), the seed's variables, and on
    CUDA the recipe's allocator settings, in the variable torch reads first and in torch's runtime settings. So
    `plan --measure`'s candidates, each a run of its own in one process, each get their own allocator settings."""
    import os

    import jsonargparse
    import sklearn  # noqa: F401  (its import sets KMP_DUPLICATE_LIB_OK for good: imported before the snapshot)

    from lit_memory.cli import resolve
    from lit_memory.config import trust
    from lit_memory.memory.hardware.allocator import AllocatorConfig, env_names, environment_conf
    from lit_memory.sandbox import guard

    policy, environment = dict(jsonargparse._common.parsing_settings), dict(os.environ)
    runtime = AllocatorConfig.parse(torch._C._accelerator_getAllocatorSettings())
    assert environment_conf() is None  # (this test needs an environment that sets no allocator settings)
    sent = tmp_path / "sent.yaml"  # a recipe nobody trusted: its run switches the confined run's policy on
    sent.write_text("seed_everything: 42\n")
    for conf in ("expandable_segments:True", "max_split_size_mb:64"):  # two candidates in turn
        run = resolve(
            [
                "fit",
                "--config",
                str(sent),
                "--model.pretrained=false",
                "--trainer.accelerator=cuda",
                f"--memory.allocator={conf}",
                f"--trainer.default_root_dir={tmp_path}",
            ]
        )
        assert dict(os.environ) == environment  # parsing alone switches nothing that outlives it
        with run.scope():
            run.build(trainer=False)
            assert os.environ[env_names()[0]] == conf and torch._C._accelerator_getAllocatorSettings() == conf
            assert trust.import_policy_enforced() and guard.restricted() and os.environ[guard.FORCE_WEIGHTS_ONLY] == "1"
            assert os.environ["PL_GLOBAL_SEED"] == "42"
        assert dict(os.environ) == environment and dict(jsonargparse._common.parsing_settings) == policy
        assert not trust.import_policy_enforced() and not guard.restricted()
        assert AllocatorConfig.parse(torch._C._accelerator_getAllocatorSettings()) == runtime


# -- a setting the user types wins over a checkpoint's (issue 53) ----------------------------------------


@pytest.fixture(scope="module")
def multi_label_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint whose saved hyper-parameters are a multi-label model's at threshold 0.7 (what Lightning lays
    over the settings of ``validate/test/predict --ckpt_path``), as `SequenceClassifier` saves them."""
    from lit_memory.model import SequenceClassifier

    module = SequenceClassifier(num_labels=3, problem_type="multi_label_classification", threshold=0.7)
    path = tmp_path_factory.mktemp("ckpt") / "best-step=4.ckpt"
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": {}}, path)
    return path


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
def test_a_typed_setting_wins_over_the_checkpoints_saved_one(command, multi_label_checkpoint, tmp_path, capsys):
    from lit_memory.cli import resolve

    # a config file, not typed: the checkpoint's threshold wins over it, said in one line
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  threshold: 0.3\n")
    base = [
        command,
        "--config",
        str(config),
        f"--ckpt_path={multi_label_checkpoint}",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    run = resolve(base)
    assert run.settings.model.threshold == 0.7 and "model.threshold" not in run.typed_settings
    assert run.notes == [
        f"model.threshold=0.7 from checkpoint {multi_label_checkpoint}, not 0.3 from {config} (type "
        "--model.threshold 0.3 to use it)"
    ]
    # typed (model.thresh: ambiguous with threshold_metric)
    run = resolve([*base, "--model.threshold", "0.25", "--model.compile=false"])
    assert run.settings.model.threshold == 0.25 and run.typed_settings["model.threshold"] == 0.25
    assert capsys.readouterr().err.strip() == ""  # said by the process that runs, once (a confined run is parsed twice)
    model = run.build(trainer=False).model
    assert capsys.readouterr().err.strip().splitlines() == [
        f"model.threshold=0.25 as typed, over 0.7 saved in checkpoint {multi_label_checkpoint}"
    ]
    assert model.hparams.threshold == 0.25 and model.val_metrics["val_f1_micro"].threshold == 0.25


def test_a_typed_threshold_names_the_tuned_thresholds_it_wins_over(tmp_path):
    """A checkpoint of a fit that tuned its thresholds holds no model.threshold (None) and the tuned ones beside the
    weights: the line says those, not None."""
    from lit_memory.cli import resolve
    from lit_memory.model import SequenceClassifier

    module = SequenceClassifier(num_labels=3, problem_type="multi_label_classification")
    path = tmp_path / "best-step=8.ckpt"
    origin = "tuned on validation at step 8 for each label's F1"
    torch.save({"hyper_parameters": dict(module.hparams), "state_dict": {},
                "thresholds": {"values": [0.21, 0.4, 0.33], "origin": origin}}, path)
    run = resolve(
        ["validate", f"--ckpt_path={path}", "--model.threshold", "0.3", f"--trainer.default_root_dir={tmp_path}"]
    )
    assert run.notes == [
        f"model.threshold=0.3 as typed, over the thresholds 0.21-0.4 ({origin}) saved in checkpoint {path}"
    ]


@pytest.mark.parametrize("spelling, typed, threshold", [
    (["--model", '{"threshold": 0.25}'], {"model.threshold": 0.25}, 0.25),  # the group as a mapping
    (['--model={"threshold": 0.5}'], {"model.threshold": 0.5}, 0.5),  # equal to the default: typed all the same
    (["--model.threshold=0.25", "--config", "CONFIG"], {}, 0.7),  # a later file set it again: not typed
    (["--config", "CONFIG", "--model.threshold", "0.25", "--model.tokenizer_name_or_path=bundled:minilm"],
     {"model.threshold": 0.25, "model.tokenizer_name_or_path": "bundled:minilm"}, 0.25),  # the model's own tokenizer
])
def test_what_the_user_typed_is_read_from_the_command_line_alone(
    spelling, typed, threshold, multi_label_checkpoint, tmp_path
):
    from lit_memory.cli import resolve

    config = tmp_path / "mine.yaml"
    config.write_text("model:\n  threshold: 0.3\n")
    spelling = [str(config) if token == "CONFIG" else token for token in spelling]
    run = resolve(
        ["validate", f"--ckpt_path={multi_label_checkpoint}", f"--trainer.default_root_dir={tmp_path}", *spelling]
    )
    model_keys = {k: v for k, v in run.typed_settings.items() if k.startswith(("model.", "data."))}
    assert model_keys == typed and str(run.typed_settings["ckpt_path"]) == str(multi_label_checkpoint)
    assert run.settings.model.threshold == threshold and run.settings.data.tokenizer_name_or_path == "bundled:minilm"
    if not typed:
        assert run.notes == [
            f"model.threshold=0.7 from checkpoint {multi_label_checkpoint}, not 0.3 from {config} "
            "(--model.threshold 0.25 was typed before that file: type it after to use it)"
        ]


@pytest.mark.parametrize(
    "typed, saved",
    [
        (["--model.num_labels", "4"], "model.num_labels=3"),
        (["--model.problem_type", "single_label_classification"], "model.problem_type='multi_label_classification'"),
        (['--model.config_overrides={"num_hidden_layers": 2}'], "model.config_overrides=None"),
        (["--model.model_name_or_path", "bundled:bert-large"], "model.model_name_or_path='bundled:minilm'"),
        (
            ["--model.tokenizer_name_or_path=bundled:bert-large"],
            "model.tokenizer_name_or_path=None (the model's, 'bundled:minilm')",
        ),
    ],
)
def test_a_typed_setting_the_weights_depend_on_is_refused_in_one_line(
    typed, saved, multi_label_checkpoint, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "validate",
                "--trust-recipe",
                f"--ckpt_path={multi_label_checkpoint}",
                f"--trainer.default_root_dir={tmp_path}",
                *typed,
            ]
        )
    assert exit_.value.code == 2
    error = the_error(capsys.readouterr().err)
    key = typed[0].split("=")[0]
    assert (
        error.startswith(f"error: {key} ")
        and f"checkpoint {multi_label_checkpoint} holds weights made with {saved}" in error
    )
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> Path:
    from conftest import write_csv

    path = tmp_path_factory.mktemp("small") / "small.csv"
    return write_csv(path, [{"text": f"row {i} {'good' if i % 2 else 'bad'}", "label": i % 2} for i in range(600)])


@pytest.mark.parametrize("more, epochs", [
    ([], 20),  # 480 training rows at batch 32: 15 steps an epoch, 20 epochs for 300
    (["--model.num_labels=2", "--model.problem_type=single_label_classification"], 20),  # the task set: read for this
    (["--trainer.max_epochs=1"], 1),  # typed: the user's
    (["--trainer.max_steps=5"], 1),
    (["--config", "{own}"], 2),  # a config file of the user's own
    (["--data.source=bundled"], 1),  # the bundled demo keeps its recipe's epoch
])
def test_a_small_file_of_ones_own_trains_the_floors_steps_unless_the_user_set_its_length(
    small_file, tmp_path, more, epochs
):
    from lit_memory.cli import resolve

    own = tmp_path / "own.yaml"
    own.write_text("trainer:\n  max_epochs: 2\n")
    args = ["fit", "--recipe", "4gb", f"--data.source={small_file}", "--model.pretrained=false", TINY_BERT,
            f"--trainer.default_root_dir={tmp_path}", *(a.format(own=own) for a in more)]
    cli = resolve(args)
    with cli.scope():
        cli.build(trainer=False)
    assert cli.settings.trainer.max_epochs == epochs
    assert (cli.model.hparams.problem_type, cli.model.hparams.num_labels) == ("single_label_classification", 2)
