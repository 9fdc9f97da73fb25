from __future__ import annotations

import pytest
import yaml

from conftest import CONFIGS, RECIPES
from lit_memory.cli import LitMemoryCLI, main

ALL_RECIPES = sorted(p.stem for p in RECIPES.glob("*.yaml"))
TINY_BERT = '--model.config_overrides={"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}'


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_recipe_parses_and_trains_two_steps(recipe, fast_args):
    cli = LitMemoryCLI(args=["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *fast_args])
    assert cli.trainer.global_step == 2
    run_dir = cli.trainer.log_dir
    assert (RECIPES / f"{recipe}.yaml").exists()
    saved = yaml.safe_load(open(f"{run_dir}/config.yaml"))
    assert saved["trainer"]["max_steps"] == 2  # the resolved config is kept with the run
    assert cli.model.model.config.num_labels == cli.datamodule.num_labels == 2  # linked, not repeated
    assert "num_labels" not in saved["data"]


def test_layered_configs_switch_model(fast_args):
    cli = LitMemoryCLI(
        args=["fit", "--config", str(RECIPES / "baseline.yaml"), "--config", str(CONFIGS / "bert-large.yaml"), TINY_BERT, *fast_args]
    )
    assert cli.model.hparams.pretrained is False
    assert cli.model.model.config.num_hidden_layers == 2
    assert cli.datamodule.tokenizer_name_or_path == "bundled:bert-large"  # the tokenizer follows the model


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
    csv.write_text("text,label\nhello,0\nworld,1\n")
    root = tmp_path / "runs"
    with pytest.raises(SystemExit):
        main(["fit", f"--data.source={csv}", f"--trainer.default_root_dir={root}"])
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: column 'review' not found in")
    assert not root.exists()
