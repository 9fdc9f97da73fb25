"""A file someone sent must not make us import, unpickle or run anything unless --trust-recipe is given.

Every case plants a marker file if its code runs. Untrusted, `fit` and `recipes check` refuse it
with one line per refusal, the marker never appears and no run folder is written; trusted (in a
process of its own: the import policy is decided once per process), the code runs as it would
without lit_memory's checks, which proves the refusals stopped real code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import REPO
from jsonargparse import Namespace

from lit_memory import guard, trust
from lit_memory.__main__ import main

TINY = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
FAST = [
    "--trainer.max_steps=1", "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--data.limit_train_samples=8", "--data.limit_eval_samples=4", "--data.batch_size=4",
]


def run_main(argv, capsys):
    """`python -m lit_memory ARGV` in this process: (exit status, stdout, stderr)."""
    try:
        main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def run_trusted(argv, cwd: Path, pythonpath: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), str(REPO)])}
    return subprocess.run(
        [sys.executable, "-m", "lit_memory", *argv, trust.TRUST_FLAG], cwd=cwd, env=env, capture_output=True, text=True
    )


@pytest.fixture
def boom(tmp_path, monkeypatch):
    """A module on sys.path that leaves a marker file behind when imported or called."""
    name = f"boom_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "RAN"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(f"""
            import pathlib
            from lightning.pytorch.callbacks import Callback
            pathlib.Path({str(marker)!r}).write_text("import-time side effect")

            class Boom(Callback):
                pass

            def make(*args, **kwargs):
                pathlib.Path({str(marker)!r}).write_text("called")
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield SimpleNamespace(name=name, marker=marker, runs=tmp_path / "runs", dir=tmp_path)
    sys.modules.pop(name, None)


def refused(err: str) -> list[str]:
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("error: refusing ") for line in lines), err
    return lines


# -- imports: jsonargparse's own allowlist, during the one parse ---------------------------------

UNTRUSTED_RECIPES = {  # recipe text, the refused import path, the key it is reported at
    "class_path": ("model:\n  optimizer:\n    class_path: os.system\n", "os.system", "model.optimizer"),
    "callable_as_string": ("model:\n  optimizer: os.system\n", "os.system", "model.optimizer"),
    "callback": ("trainer:\n  callbacks:\n    - class_path: MOD.Boom\n", "MOD.Boom", "trainer.callbacks"),
    "nested_init_args": (
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.LambdaCallback\n"
        "      init_args:\n        on_fit_start: MOD.make\n",
        "MOD.make",
        "trainer.callbacks.on_fit_start",
    ),
    "logger": ("trainer:\n  logger:\n    class_path: MOD.Boom\n", "MOD.Boom", "trainer.logger"),
    "plugin": ("trainer:\n  plugins: [MOD.Boom]\n", "MOD.Boom", "trainer.plugins"),
    "re_export": (  # os.system, reached through an allowed module that imports os
        "model:\n  optimizer: lightning.pytorch.trainer.trainer.os.system\n", "posix.system", "model.optimizer"
    ),
    "entry_point": (  # allowed package, but a class that would parse a nested command line of its own
        "trainer:\n  callbacks:\n    - class_path: lit_memory.cli.SaveRecipe\n", "lit_memory.cli.SaveRecipe",
        "trainer.callbacks",
    ),
}


@pytest.mark.parametrize("case", UNTRUSTED_RECIPES)
def test_fit_and_check_refuse_a_recipe_importing_code_outside_the_allowlist(case, boom, capsys):
    text, path, key = (s.replace("MOD", boom.name) for s in UNTRUSTED_RECIPES[case])
    recipe = boom.dir / "shared.yaml"
    recipe.write_text(text)
    code, _, err = run_main(["fit", "--config", str(recipe), f"--trainer.default_root_dir={boom.runs}"], capsys)
    assert code == 2
    [line] = refused(err)
    assert line.startswith(f"error: refusing to import {path} ({key}): outside the recipe allowlist (")
    code, out, err = run_main(["recipes", "check", str(recipe)], capsys)
    assert code == 2
    assert f"REFUSED  import {path}  ({key})" in out
    assert err.strip() == f"error: {recipe}: 1 refused; pass {trust.TRUST_FLAG} only if you trust its source"
    assert not boom.marker.exists() and not boom.runs.exists()


def test_command_line_overrides_are_parsed_under_the_same_allowlist(boom, capsys):
    code, _, err = run_main(["fit", f"--trainer.callbacks+={boom.name}.Boom", f"--trainer.default_root_dir={boom.runs}"], capsys)
    assert code == 2
    assert refused(err)[0].startswith(f"error: refusing to import {boom.name}.Boom (trainer.callbacks)")
    assert not boom.marker.exists() and not boom.runs.exists()


def test_check_reports_every_refused_import_not_only_the_first(boom, capsys):
    recipe = boom.dir / "shared.yaml"
    recipe.write_text(
        f"trainer:\n  logger:\n    class_path: {boom.name}.Boom\n"
        f"  callbacks:\n    - class_path: lightning.pytorch.callbacks.LambdaCallback\n"
        f"      init_args:\n        on_fit_start: {boom.name}.make\n"
        "model:\n  optimizer:\n    class_path: transformers.Adafactor\n"
    )
    code, out, err = run_main(["recipes", "check", str(recipe)], capsys)
    assert code == 2
    assert f"REFUSED  import {boom.name}.Boom  (trainer.logger)" in out
    assert f"REFUSED  import {boom.name}.make  (trainer.callbacks.on_fit_start)" in out
    assert "model.optimizer: transformers.Adafactor" in out  # what it does import, and where
    assert err.strip() == f"error: {recipe}: 2 refused; pass {trust.TRUST_FLAG} only if you trust its source"
    assert not boom.marker.exists()


def test_a_class_spec_in_a_free_form_dict_stays_data(boom, tmp_path, capsys):
    # config_overrides is a dict of anything: jsonargparse would otherwise instantiate class specs in it
    overrides = json.dumps({"x": {"class_path": f"{boom.name}.Boom"}})
    argv = ["fit", f"--model.config_overrides={overrides}", "--print_config"]
    code, out, _ = run_main(argv, capsys)
    assert code == 0
    assert yaml.safe_load(out)["model"]["config_overrides"] == {"x": {"class_path": f"{boom.name}.Boom"}}
    assert not boom.marker.exists()


def test_trust_recipe_lets_the_parser_import_it(boom):
    result = run_trusted(["fit", f"--trainer.callbacks+={boom.name}.Boom", "--print_config"], boom.dir, boom.dir)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["trainer"]["callbacks"] == [{"class_path": f"{boom.name}.Boom"}]
    assert boom.marker.read_text() == "import-time side effect"  # so the refusals above did stop real code


def test_trust_cannot_be_granted_after_the_policy_is_enforced_in_this_process(capsys):
    run_main(["fit", "--print_config"], capsys)  # enforces the policy in this process
    code, _, err = run_main(["fit", "--print_config", trust.TRUST_FLAG], capsys)
    assert code == 2
    assert err.strip().startswith(f"error: {trust.TRUST_FLAG} cannot lift the import allowlist in a process")


# -- values: settings that run code from elsewhere ----------------------------------------------


@pytest.fixture
def remote_code_model(tmp_path):
    """A model folder whose config.json names Python shipped beside it (transformers' auto_map)."""
    folder = tmp_path / "model"
    shutil.copytree(REPO / "lit_memory" / "assets" / "bert-large-uncased", folder)
    config = {**json.loads((folder / "config.json").read_text()), **TINY}
    config["auto_map"] = {"AutoConfig": "remote.RemoteConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "RAN"
    (folder / "remote.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import BertConfig\nclass RemoteConfig(BertConfig):\n    model_type = 'bert'\n"
    )
    return SimpleNamespace(folder=folder, marker=marker, runs=tmp_path / "runs", dir=tmp_path)


def test_trust_remote_code_in_a_recipe_is_refused(remote_code_model, capsys):
    m = remote_code_model
    recipe = m.dir / "shared.yaml"
    recipe.write_text(
        f"model:\n  model_name_or_path: {m.folder}\n  pretrained: false\n  config_overrides:\n    trust_remote_code: true\n"
    )
    code, _, err = run_main(["fit", "--config", str(recipe), f"--trainer.default_root_dir={m.runs}"], capsys)
    assert code == 2
    [line] = refused(err)
    assert line.startswith("error: refusing model.config_overrides.trust_remote_code=True: it runs Python files")
    code, out, _ = run_main(["recipes", "check", str(recipe)], capsys)
    assert code == 2 and "REFUSED  model.config_overrides.trust_remote_code=True" in out
    assert not m.marker.exists() and not m.runs.exists()

    result = run_trusted(["fit", "--config", str(recipe), f"--trainer.default_root_dir={m.runs}", *FAST], m.dir)
    assert m.marker.read_text() == "ran", result.stderr  # transformers ran the folder's code


class Payload:
    """Unpickling it creates a file: the marker of a pickle that ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def pickled_checkpoint(tmp_path):
    marker = tmp_path / "UNPICKLED"
    torch.save({"state_dict": {}, "hyper_parameters": {}, "payload": Payload(marker)}, tmp_path / "sent.ckpt")
    return SimpleNamespace(path=tmp_path / "sent.ckpt", marker=marker, runs=tmp_path / "runs", dir=tmp_path)


def test_weights_only_false_in_a_recipe_is_refused(pickled_checkpoint, capsys):
    c = pickled_checkpoint
    recipe = c.dir / "shared.yaml"
    recipe.write_text(f"weights_only: false\nckpt_path: {c.path}\n")
    code, _, err = run_main(["validate", "--config", str(recipe), f"--trainer.default_root_dir={c.runs}"], capsys)
    assert code == 2
    [line] = refused(err)
    assert line.startswith("error: refusing weights_only=False: unpickling a checkpoint runs any code it names;")
    code, out, _ = run_main(["recipes", "check", str(recipe)], capsys)
    assert code == 2 and "REFUSED  weights_only=False" in out
    assert not c.marker.exists() and not c.runs.exists()
    # Trusted, a local file still meets LightningCLI's own weights_only read of its hyper-parameters;
    # the next test shows the same setting unpickling a checkpoint that LightningCLI does not read first.


def test_weights_only_false_typed_on_the_command_line_is_the_users_choice(capsys):
    config = yaml.safe_load(run_main(["fit", "--weights_only=false", "--print_config"], capsys)[1])
    assert config["weights_only"] is False
    settings = Namespace(weights_only=False)
    assert trust.Decision(trusted=False, typed=Namespace(weights_only=False)).refusals(settings) == []
    assert [r.key for r in trust.Decision(trusted=False).refusals(settings)] == ["weights_only"]


@pytest.mark.parametrize("url", ["file://{path}", "https://example.com/x.ckpt", "s3://bucket/x.ckpt", "registry:x"])
def test_a_checkpoint_that_is_not_a_local_path_is_refused(url, pickled_checkpoint, capsys):
    c = pickled_checkpoint
    ckpt = url.format(path=c.path)
    code, _, err = run_main(["fit", f"--ckpt_path={ckpt}", f"--trainer.default_root_dir={c.runs}"], capsys)
    assert code == 2
    [line] = refused(err)
    assert line.startswith(f"error: refusing ckpt_path={ckpt!r}: it ")
    assert not c.marker.exists() and not c.runs.exists()


def test_a_file_url_with_weights_only_false_runs_its_pickle_only_when_trusted(pickled_checkpoint):
    c = pickled_checkpoint
    argv = ["validate", f"--ckpt_path=file://{c.path}", "--weights_only=false", f"--trainer.default_root_dir={c.runs}"]
    run_trusted([*argv, *FAST], c.dir)
    assert c.marker.exists()  # Lightning fetched it through fsspec and unpickled it


def test_a_relative_checkpoint_path_is_read_from_the_working_folder_as_lightning_does(
    pickled_checkpoint, tmp_path, monkeypatch, capsys
):
    c = pickled_checkpoint
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    recipe = elsewhere / "shared.yaml"
    recipe.write_text("ckpt_path: sent.ckpt\n")  # beside the checkpoint? No: Lightning reads it from the cwd
    monkeypatch.chdir(c.dir)
    code, _, err = run_main(["fit", "--config", str(recipe), f"--trainer.default_root_dir={c.runs}"], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "error: cannot load checkpoint sent.ckpt with weights_only=True: "
        + err.strip().split("weights_only=True: ", 1)[1]
    ]
    assert not c.marker.exists() and not c.runs.exists()
    monkeypatch.chdir(elsewhere)
    code, _, err = run_main(["fit", "--config", str(recipe), f"--trainer.default_root_dir={c.runs}"], capsys)
    assert err.strip().splitlines() == [f"error: checkpoint not found: sent.ckpt (a relative path is read from {elsewhere})"]


def distributed_checkpoint(folder: Path, payload=None) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(folder), no_dist=True)
    if payload is not None:  # a .metadata that runs code when torch unpickles it
        import pickle

        (folder / ".metadata").write_bytes(pickle.dumps(payload))
    return folder


def test_a_distributed_checkpoint_whose_metadata_runs_code_is_refused(tmp_path, capsys):
    marker = tmp_path / "UNPICKLED"
    folder = distributed_checkpoint(tmp_path / "sent", Payload(marker))
    code, _, err = run_main(["fit", f"--ckpt_path={folder}", f"--trainer.default_root_dir={tmp_path / 'runs'}"], capsys)
    assert code == 2
    [line] = refused(err)
    assert line.startswith(f"error: refusing ckpt_path={str(folder)!r}: its .metadata names code to run when unpickled")
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_a_distributed_checkpoint_of_plain_metadata_is_accepted(tmp_path):
    assert guard.checkpoint_problem(distributed_checkpoint(tmp_path / "ours")) is None


def test_weights_pickled_in_a_model_folder_are_refused_by_weights_only(tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(REPO / "lit_memory" / "assets" / "bert-large-uncased", folder)
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **TINY}))
    marker = tmp_path / "UNPICKLED"
    torch.save({"bert.embeddings.word_embeddings.weight": Payload(marker)}, folder / "pytorch_model.bin")
    code, _, err = run_main(["fit", f"--model.model_name_or_path={folder}", *FAST,
                             f"--trainer.default_root_dir={tmp_path / 'runs'}"], capsys)
    assert code == 2
    [line] = err.strip().splitlines()[-1:]
    assert line.startswith(f"error: cannot load the weights of {str(folder)!r} with weights_only=True: Weights only load failed")
    assert not marker.exists()


def test_a_shared_recipe_never_carries_a_refused_value_onward(tmp_path, capsys):
    argv = ["fit", "--weights_only=false", "--model.config_overrides={trust_remote_code: true}", *FAST,
            "--trainer.enable_checkpointing=false", "--model.save_pretrained=false",
            f"--trainer.default_root_dir={tmp_path}"]
    code, _, err = run_main(argv, capsys)  # typed on the command line: the user's own choice
    assert code == 0, err
    [shared] = tmp_path.glob("lightning_logs/version_*/recipe.yaml")
    settings = yaml.safe_load(shared.read_text())
    assert settings["weights_only"] is True
    assert settings["model"]["config_overrides"] == {"trust_remote_code": False}
    code, out, _ = run_main(["recipes", "check", str(shared)], capsys)
    assert code == 0 and out.strip().splitlines()[-1].endswith(f"needs no {trust.TRUST_FLAG}")


def test_denied_imports_are_read_with_their_keys_from_a_nested_parse_error():
    message = textwrap.dedent("""\
        Parser key "trainer.callbacks":
          Errors:
            - Problem with given class_path 'lightning.pytorch.callbacks.LambdaCallback':
                Parser key "on_fit_start":
                  Errors:
                    - Type typing.Callable expects a function: Importing 'os.system' is not allowed, denied by ...
        """)
    assert trust.denied_imports(message) == [("os.system", "trainer.callbacks.on_fit_start", "trainer.callbacks")]
