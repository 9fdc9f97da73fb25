"""A file someone sent must not make us import, unpickle or run anything unless --trust-recipe is given.

Every case plants a marker file if its code runs. Untrusted, `fit` and `recipes check` refuse it
with one line per refusal, the marker never appears and no run folder is written; trusted (in a
process of its own, as a user runs it), the code runs as it would without lit_memory's checks, which
proves the refusals stopped real code.
"""

from __future__ import annotations

import http.server
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import REPO
from jsonargparse import Namespace

from lit_memory.__main__ import main
from lit_memory.config import trust
from lit_memory.run import environment
from lit_memory.sandbox import checkpoint_reading, guard

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


def clean_environment(**more: str) -> dict[str, str]:
    """This process's environment for a command of its own: without torch's weights-only switch, which the
    environment running the tests may set (an untrusted run sets it only while it runs)."""
    env = {k: v for k, v in environment.for_new_job().items() if k != guard.FORCE_WEIGHTS_ONLY}
    return {**env, **more}


def run_trusted(argv, cwd: Path, pythonpath: Path = REPO) -> subprocess.CompletedProcess:
    env = clean_environment(PYTHONPATH=os.pathsep.join([str(pythonpath), str(REPO)]))
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
    """In the run of a recipe nobody trusted, what is typed over it is parsed under its allowlist too (a command line
    with no config, or a trusted one, is the user's own: it imports what they name, as Lightning does)."""
    recipe = boom.dir / "shared.yaml"
    recipe.write_text("trainer:\n  max_steps: 1\n")
    code, _, err = run_main(["fit", "--config", str(recipe), f"--trainer.callbacks+={boom.name}.Boom",
                             f"--trainer.default_root_dir={boom.runs}"], capsys)
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
    """config_overrides is a dict of anything: a class spec in it is a model setting, never built (jsonargparse would
    otherwise instantiate it), whoever wrote it; from a recipe nobody trusted, its module is not even imported."""
    overrides = {"x": {"class_path": f"{boom.name}.Boom"}}
    recipe = boom.dir / "shared.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"config_overrides": overrides}}))
    code, out, _ = run_main(["fit", "--config", str(recipe), "--print_config"], capsys)
    assert code == 0 and yaml.safe_load(out)["model"]["config_overrides"] == overrides
    assert not boom.marker.exists()
    # the user's own: as data too
    typed = ["fit", f"--model.config_overrides={json.dumps(overrides)}", "--print_config"]
    code, out, _ = run_main(typed, capsys)
    assert code == 0 and yaml.safe_load(out)["model"]["config_overrides"] == overrides


def test_trust_recipe_lets_the_parser_import_it(boom):
    result = run_trusted(["fit", f"--trainer.callbacks+={boom.name}.Boom", "--print_config"], boom.dir, boom.dir)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["trainer"]["callbacks"] == [{"class_path": f"{boom.name}.Boom"}]
    assert boom.marker.read_text() == "import-time side effect"  # so the refusals above did stop real code


def test_an_untrusted_runs_rules_end_with_it_and_cannot_be_lifted_inside_it(boom, capsys):
    """The decision holds for one run: jsonargparse's import policy (its settings table, saved and put back: the
    entries still exist in the installed version), torch's weights-only switch and the guard's sinks are as they
    were after an untrusted command, so a trusted one in the same process imports what it names; inside an
    untrusted run, trust is refused."""
    import jsonargparse

    assert set(trust.POLICY_SETTINGS) <= set(jsonargparse._common.parsing_settings)
    policy, environment = dict(jsonargparse._common.parsing_settings), dict(os.environ)
    run_main(["fit", "--print_config"], capsys)  # untrusted: the policy held while it ran
    assert dict(jsonargparse._common.parsing_settings) == policy and dict(os.environ) == environment
    assert not trust.import_policy_enforced() and not guard.restricted()
    code, out, err = run_main(
        ["fit", f"--trainer.callbacks+={boom.name}.Boom", "--print_config", trust.TRUST_FLAG], capsys
    )
    assert code == 0, err
    assert boom.marker.read_text() == "import-time side effect"
    with trust.Decision(trusted=False).applied():
        assert guard.restricted() and os.environ[guard.FORCE_WEIGHTS_ONLY] == "1"
        code, _, err = run_main(["fit", "--print_config", trust.TRUST_FLAG], capsys)
    assert code == 2
    assert err.strip().startswith(f"error: {trust.TRUST_FLAG} cannot lift the import allowlist inside an untrusted run")
    assert dict(os.environ) == environment


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
        f"model:\n  model_name_or_path: {m.folder}\n  pretrained: false\n  config_overrides:\n    "
        "trust_remote_code: true\n"
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
    assert err.strip().splitlines() == [
        f"error: checkpoint not found: sent.ckpt (a relative path is read from {elsewhere})"
    ]


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
    assert checkpoint_reading.checkpoint_problem(distributed_checkpoint(tmp_path / "ours")) is None


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
    assert line.startswith(
        f"error: cannot load the weights of {str(folder)!r} with weights_only=True: Weights only load failed"
    )
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
    *_, verdict, judged = out.strip().splitlines()
    assert code == 0 and verdict.endswith(f"needs no {trust.TRUST_FLAG}")
    assert judged.startswith(f"trust: a run of {shared} is confined: it is not a shipped recipe and nobody trusted it")


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


# -- every attack class, end to end: hostile files as someone would send them -----------------------
#
# Two subprocesses run every case (`cli_batch.py`: each case is one `python -m lit_memory ARGV`), one
# untrusted, one with --trust-recipe, to compare the two. Untrusted, each case must
# end with exactly one `error:` line, its payload's marker must not appear, and nothing may be written
# anywhere under the hostile folder; trusted, the payloads run (where running them is legitimate),
# which proves the refusals stopped real code.

BATCH = REPO / "tests" / "cli_batch.py"
ORIGINAL = "the victim's own content\n"


def run_batch(cases: dict, folder: Path, trusted: bool) -> dict:
    if trusted:
        cases = {name: {**case, "argv": [*case["argv"], trust.TRUST_FLAG]} for name, case in cases.items()}
    spec, results = folder / f"cases-{trusted}.json", folder / f"results-{trusted}.json"
    spec.write_text(json.dumps(cases))
    env = clean_environment(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(BATCH), str(spec), str(results)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(results.read_text())


class Recorder(http.server.BaseHTTPRequestHandler):
    """A server a recipe names: every request it gets is recorded (the marker of a fetch)."""

    requests: list[str] = []

    def do_GET(self):  # noqa: N802
        Recorder.requests.append(self.path)
        body = b"trainer:\n  max_steps: 1\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_POST = do_HEAD = do_GET

    def log_message(self, *args):
        pass


def snapshot(folder: Path) -> dict[str, tuple]:
    return {str(p.relative_to(folder)): (p.is_symlink(), p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def evil_model(folder: Path, marker: Path, model_type: str) -> Path:
    """A model folder whose config.json names Python shipped beside it (auto_map) that drops a marker."""
    shutil.copytree(REPO / "lit_memory" / "assets" / "bert-large-uncased", folder)
    config = {**json.loads((folder / "config.json").read_text()), **TINY, "model_type": model_type}
    config["auto_map"] = {"AutoConfig": "remote.RemoteConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "remote.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import BertConfig\nclass RemoteConfig(BertConfig):\n    model_type = 'bert'\n"
    )
    return folder


def planted(folder: Path, victim: Path, names: list[str]) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).symlink_to(victim)
    return folder


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    side = tmp_path_factory.mktemp("outside")  # what the batches themselves write: specs, results, legitimate runs
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    markers: dict[str, Path] = {}

    def marker(name: str) -> str:
        markers[name] = root / f"RAN-{name}"
        return str(markers[name])

    def recipe(name: str, text: str) -> str:
        (root / f"{name}.yaml").write_text(textwrap.dedent(text))
        return str(root / f"{name}.yaml")

    victim = root / "victim.txt"
    victim.write_text(ORIGINAL)
    fast = [*FAST, "--trainer.enable_checkpointing=false", "--model.save_pretrained=false"]
    # Auto-resume: an OnExceptionCheckpoint's file and SLURM's hpc checkpoint, both pickles that run code.
    torch.save(
        {"state_dict": {}, "payload": Payload(marker("onexc"))},
        (root / "shipped").mkdir() or root / "shipped" / "on_exception.ckpt",
    )
    torch.save(
        {"state_dict": {}, "payload": Payload(marker("hpc"))},
        (root / "hpc_root").mkdir() or root / "hpc_root" / "hpc_ckpt_1.ckpt",
    )
    torch.save(
        {"state_dict": {}, "payload": Payload(marker("last"))}, (root / "lasts").mkdir() or root / "lasts" / "last.ckpt"
    )
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_JOB_ID": "1"}
    onexc = recipe("onexc", f"""\
        trainer:
          default_root_dir: {root / 'runs-onexc'}
          callbacks:
            - class_path: lightning.pytorch.callbacks.OnExceptionCheckpoint
              init_args: {{dirpath: {root / 'shipped'}}}
        """)
    hpc = recipe("hpc", f"trainer:\n  default_root_dir: {root / 'hpc_root'}\n")
    last = recipe("last", f"""\
        ckpt_path: last
        trainer:
          default_root_dir: {root / 'runs-last'}
          callbacks:
            - class_path: lightning.pytorch.callbacks.ModelCheckpoint
              init_args: {{dirpath: {root / 'lasts'}, save_last: true}}
        """)
    hpc_name = recipe("hpc_name", f"ckpt_path: hpc\ntrainer:\n  default_root_dir: {root / 'hpc_root'}\n")
    # Distributed checkpoints: a non-tensor item that unpickles code; a rank-local metadata file that does.
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"model": {"w": torch.ones(2)}, "extra": Payload(marker("dcp_item"))},
        checkpoint_id=str(root / "dcp_item"),
        no_dist=True,
    )
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(root / "dcp_rank"), no_dist=True)
    (root / "dcp_rank" / ".metadata").unlink()
    (root / "dcp_rank" / "__0.metadata").write_bytes(pickle.dumps(Payload(marker("dcp_rank"))))
    dcp_item = recipe("dcp_item", f"ckpt_path: {root / 'dcp_item'}\n")
    dcp_rank = recipe("dcp_rank", f"ckpt_path: {root / 'dcp_rank'}\n")
    # "Typed by the user": values merged in under a key the user typed are not.
    bert = evil_model(root / "bert_code", Path(marker("typed")), "bert")  # runs its code only when trusted
    typed = recipe("typed", f"""\
        model:
          model_name_or_path: {bert}
          pretrained: false
          config_overrides: {{trust_remote_code: true}}
        """)
    model_file = recipe(
        "model_part", f"model_name_or_path: {bert}\npretrained: false\nconfig_overrides: {{trust_remote_code: true}}\n"
    )
    torch.save(
        {
            "state_dict": {},
            "hyper_parameters": {
                "model_name_or_path": str(bert),
                "pretrained": False,
                "config_overrides": {"trust_remote_code": True},
            },
        },
        root / "hparams.ckpt",
    )
    overrides = "--model.config_overrides={num_hidden_layers: 1}"
    # Writes through links planted in a run folder a recipe names, and a hard link.
    planted(root / "run_links", victim, ["recipe.yaml", "hparams.yaml", "metrics.csv", "config.yaml"])
    planted(root / "run_root", victim, ["memory.json", "checkpoints/last-v1.ckpt"])
    (root / "run_hard").mkdir()
    os.link(victim, root / "run_hard" / "hparams.yaml")
    csv_logger = (
        "{{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: {}, name: '', version: ''}}}}"
    )
    links = recipe("links", f"trainer:\n  logger: {csv_logger.format(root / 'run_links')}\n")
    links_root = recipe("links_root", f"trainer:\n  logger: false\n  default_root_dir: {root / 'run_root'}\n")
    hard = recipe("hard", f"trainer:\n  logger: {csv_logger.format(root / 'run_hard')}\n")
    # The network: nested configs named by URL or fsspec chain, and remote values.
    net = recipe("net", f"model: {url}/model.yaml\n")
    chain = recipe("chain", f"trainer: simplecache::{url}/trainer.yaml\n")
    source = recipe("source", f"data:\n  source: {url}/reviews.csv\n")
    logger = recipe("net_logger", f"trainer:\n  logger: {csv_logger.format(url + '/logs')}\n")
    # Values that take the machine down.
    cpus = os.cpu_count() or 1
    workers = recipe("workers", "data:\n  num_workers: 100000\n")
    workers_mild = recipe("workers_mild", f"data:\n  num_workers: {cpus + 1}\n")
    devices = recipe("devices", "trainer:\n  accelerator: cpu\n  devices: 4096\n  strategy: ddp\n")
    checkpoint = (
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      "
        "init_args: {{{}}}\n"
    )
    cadence = recipe("cadence", checkpoint.format("every_n_train_steps: 1"))
    keep = recipe("keep", checkpoint.format("save_top_k: -1, every_n_train_steps: 100"))
    # transformers: code shipped with a model of a type it does not know (it cannot load without running
    # it), a Hugging Face loading option among config overrides.
    unknown = evil_model(root / "unknown_code", Path(marker("unknown")), "evil-bert")
    remote_model = recipe("remote_model", f"model:\n  model_name_or_path: {unknown}\n  pretrained: false\n")
    hf_option = recipe("hf_option", f"model:\n  config_overrides: {{cache_dir: {root / 'cache'}}}\n")

    def fit(config: str, *more: str, runs: str = "runs") -> list[str]:
        return ["fit", "--config", config, *fast, *more, f"--trainer.default_root_dir={root / runs}"]

    def fit_keeping_root(config: str, *more: str) -> list[str]:  # the recipe chooses the run folder
        return ["fit", "--config", config, *FAST, "--model.save_pretrained=false", *more]

    untrusted = {
        "auto_resume/on_exception": {"argv": fit_keeping_root(onexc)},
        "auto_resume/slurm": {"argv": fit_keeping_root(hpc), "env": slurm},
        "auto_resume/ckpt_path_last": {"argv": fit_keeping_root(last)},
        "auto_resume/ckpt_path_hpc": {"argv": fit_keeping_root(hpc_name), "env": slurm},
        "dcp/byte_item": {"argv": fit(dcp_item)},
        "dcp/byte_item_typed": {
            "argv": ["fit", *fast, f"--ckpt_path={root / 'dcp_item'}", f"--trainer.default_root_dir={root / 'runs'}"]
        },
        "dcp/rank_local_metadata": {"argv": fit(dcp_rank)},
        "typed/recipe_merged_under_a_typed_key": {"argv": ["fit", overrides, *fit(typed)[1:]]},
        "typed/file_given_to_a_typed_key": {"argv": ["fit", f"--model={model_file}", *fit(typed)[3:]]},
        "typed/file_url_given_to_a_typed_key": {"argv": ["fit", f"--model=file://{model_file}", *fit(typed)[3:]]},
        "typed/checkpoint_hyper_parameters": {
            "argv": ["fit", overrides, f"--ckpt_path={root / 'hparams.ckpt'}", *fit(typed)[3:]]
        },
        "links/logger_folder": {"argv": fit_keeping_root(links)},
        "links/run_folder": {"argv": fit_keeping_root(links_root)},
        "links/hard_link": {"argv": fit_keeping_root(hard)},
        "network/nested_config_fit": {"argv": fit(net)},
        "network/nested_config_estimate": {"argv": ["estimate", "--config", net]},
        "network/nested_config_plan": {"argv": ["plan", "--budget", "4GiB", "--config", net]},
        "network/fsspec_chain": {"argv": fit(chain)},
        "network/data_source": {"argv": fit(source)},
        "network/logger": {"argv": fit(logger)},
        "bounds/num_workers": {"argv": fit(workers)},
        "bounds/num_workers_mild": {"argv": fit(workers_mild)},
        "bounds/devices": {"argv": fit(devices)},
        "bounds/checkpoint_cadence": {"argv": fit(cadence)},
        "bounds/checkpoints_kept": {"argv": fit(keep)},
        "transformers/unknown_model_code": {"argv": fit(remote_model)},
        "transformers/loading_option": {"argv": fit(hf_option)},
    }
    checked = {"auto_resume": [onexc, hpc, last, hpc_name], "dcp": [dcp_item, dcp_rank], "typed": [typed],
               "links": [links, links_root, hard], "network": [net, chain, source, logger],
               "bounds": [workers, devices, cadence, keep], "transformers": [remote_model, hf_option]}
    # -- the box (issue 32): allowed classes that write where a recipe says, bounds they get around, bombs ------
    outside = root / "outside"  # a folder of the receiver's, outside any run folder
    outside.mkdir()
    (outside / "precious.txt").write_text(ORIGINAL)

    def shared_folder(name: str) -> Path:  # a folder sent along, holding what the receiver must keep
        folder = root / name
        folder.mkdir(parents=True)
        return folder

    callback = "      - class_path: lightning.pytorch.callbacks.{}\n        init_args: {{{}}}\n"
    spike = recipe("spike", "trainer:\n  callbacks:\n" + callback.format(
        "SpikeDetection", f"exclude_batches_path: {outside / 'skip_batches.json'}"))
    spike_shared = shared_folder("shared_spike")
    (spike_shared / "skip_batches.json").symlink_to(victim)
    spike_link = recipe("spike_link", f"trainer:\n  default_root_dir: {spike_shared}\n  callbacks:\n" + callback.format(
        "SpikeDetection", f"exclude_batches_path: {spike_shared / 'skip_batches.json'}"))
    last_shared = shared_folder("shared_last")
    (last_shared / "ckpts" / "last.ckpt").mkdir(parents=True)
    (last_shared / "ckpts" / "last.ckpt" / "precious.txt").write_text(ORIGINAL)  # rmtree'd by save_last: link
    last_link = recipe("last_link", f"trainer:\n  default_root_dir: {last_shared}\n  callbacks:\n" + callback.format(
        "ModelCheckpoint", f"dirpath: {last_shared / 'ckpts'}, save_last: link, enable_version_counter: false"))
    profiler = recipe("profiler", "trainer:\n  profiler:\n    class_path: lightning.pytorch.profilers.SimpleProfiler\n"
                                  f"    init_args: {{dirpath: {outside}, filename: precious}}\n")
    export_shared = shared_folder("shared_export")
    (export_shared / "hf_model").mkdir()
    (export_shared / "hf_model" / "precious.txt").write_text(ORIGINAL)
    export = recipe(
        "export", f"trainer:\n  default_root_dir: {export_shared}\n  logger: false\nmodel:\n  save_pretrained: true\n"
    )
    nest_shared = shared_folder("shared_nest")
    (nest_shared / "a" / "b").mkdir(parents=True)
    (nest_shared / "a" / "b" / "c").symlink_to(outside)  # three folders down
    nested = recipe("nested", f"trainer:\n  default_root_dir: {nest_shared}\n  callbacks:\n" + callback.format(
        "ModelCheckpoint", f"dirpath: {nest_shared / 'a' / 'b' / 'c' / 'ckpts'}"))
    fifo_shared = shared_folder("shared_fifo")
    os.mkfifo(fifo_shared / "memory.json")
    fifo_run = recipe(
        "fifo_run", f"trainer:\n  default_root_dir: {fifo_shared}\n  logger: {csv_logger.format(fifo_shared)}\n"
    )
    finder = recipe("finder", "trainer:\n  callbacks:\n" + callback.format(
        "BatchSizeFinder", f"batch_arg_name: num_workers, init_val: {cpus + 1}, max_trials: 2"))
    many_kept = recipe("many_kept", "trainer:\n  callbacks:\n" + "".join(callback.format(
        "ModelCheckpoint", f"monitor: train_loss, save_top_k: 10, every_n_train_steps: {100 + i}") for i in range(5)))
    every_step = recipe(
        "every_step",
        "trainer:\n  limit_train_batches: 1\n  max_steps: 20\n  limit_val_batches: 0\n"
        "  callbacks:\n"
        + "".join(
            callback.format("ModelCheckpoint", f"every_n_epochs: {i + 1}, filename: 'c{i}-{{step}}'") for i in range(5)
        ),
    )
    # Resource bombs in files.
    laughs = "".join(f"    {chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(9))
    yaml_bomb = recipe("yaml_bomb", "model:\n  config_overrides:\n    a: &a [x, x, x, x, x, x, x, x, x, x]\n" + laughs)
    deep = recipe("deep", "model:\n  config_overrides:\n    x: " + "[" * 100_000 + "]" * 100_000 + "\n")
    big = recipe("big", "# " + "x" * (4 << 20) + "\ntrainer:\n  max_steps: 1\n")
    for name, target in (("zero_ckpt", "/dev/zero"), ("fifo_ckpt", None)):
        folder = distributed_checkpoint(root / name)
        (folder / ".metadata").unlink()
        os.symlink(target, folder / ".metadata") if target else os.mkfifo(folder / ".metadata")
    zero_ckpt = recipe("zero_ckpt", f"ckpt_path: {root / 'zero_ckpt'}\n")
    fifo_ckpt = recipe("fifo_ckpt", f"ckpt_path: {root / 'fifo_ckpt'}\n")

    def model_folder(name: str, **config: object) -> Path:
        folder = root / name
        shutil.copytree(REPO / "lit_memory" / "assets" / "bert-large-uncased", folder)
        (folder / "config.json").write_text(
            json.dumps({**json.loads((folder / "config.json").read_text()), **TINY, **config})
        )
        return folder

    chain = model_folder("replace_chain")
    tokenizer = json.loads((chain / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": "e"}, "content": "e" * 10} for _ in range(6)]}
    (chain / "tokenizer.json").write_text(json.dumps(tokenizer))
    normalizers = recipe("normalizers", f"model:\n  model_name_or_path: {chain}\n  pretrained: false\n")
    bomb_folder = model_folder("deflate")
    from conftest import deflate_bomb

    deflate_bomb(bomb_folder / "pytorch_model.bin")
    deflate = recipe("deflate", f"model:\n  model_name_or_path: {bomb_folder}\n")
    layers = recipe("layers", "model:\n  config_overrides: {num_hidden_layers: 20000}\n")
    kernel = recipe("kernel", "model:\n  config_overrides: {attn_implementation: kernels-community/flash-attn}\n")
    kernel_folder = model_folder("kernel_folder", attn_implementation="kernels-community/flash-attn")
    kernel_file = recipe("kernel_file", f"model:\n  model_name_or_path: {kernel_folder}\n  pretrained: false\n")
    quantized = recipe(
        "quantized",
        "model:\n  config_overrides:\n    quantization_config: {quant_method: bitsandbytes, load_in_8bit: true}\n",
    )
    no_checkpoints = [
        "--trainer.max_steps=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--data.limit_train_samples=8",
        "--data.limit_eval_samples=4",
        "--data.batch_size=4",
        "--model.save_pretrained=false",
    ]

    def fit_with_callbacks(config: str, runs: str, *more: str) -> list[str]:  # checkpointing on: the recipe's callbacks
        return ["fit", "--config", config, *no_checkpoints, *more, f"--trainer.default_root_dir={runs}"]

    untrusted.update(
        {
            "box/spike_detection": {"argv": fit(spike)},
            "box/spike_detection_link": {"argv": fit_keeping_root(spike_link)},
            "box/save_last_link_rmtree": {"argv": fit_with_callbacks(last_link, str(last_shared))[:-1]},
            "box/profiler": {"argv": fit(profiler)},
            "box/save_pretrained_replaces": {"argv": ["fit", "--config", export, *FAST]},
            "box/nested_link": {"argv": fit_with_callbacks(nested, str(nest_shared))[:-1]},
            "box/fifo_memory_json": {"argv": fit_keeping_root(fifo_run)},
            "bounds/batch_size_finder_workers": {"argv": fit(finder, runs=str(side / "finder"))},
            "bounds/checkpoints_kept_over_callbacks": {"argv": fit_with_callbacks(many_kept, str(side / "kept"))},
            "bounds/checkpoint_cadence_over_callbacks": {
                "argv": [
                    "fit",
                    "--config",
                    every_step,
                    "--trainer.num_sanity_val_steps=0",
                    "--trainer.enable_progress_bar=false",
                    "--data.limit_train_samples=8",
                    "--data.batch_size=4",
                    "--model.save_pretrained=false",
                    f"--trainer.default_root_dir={side / 'every'}",
                ]
            },
            "bombs/yaml_aliases": {"argv": fit(yaml_bomb)},
            "bombs/deep_nesting": {"argv": fit(deep)},
            "bombs/large_recipe": {"argv": fit(big)},
            "bombs/metadata_dev_zero": {"argv": fit(zero_ckpt)},
            "bombs/metadata_fifo": {"argv": fit(fifo_ckpt)},
            "bombs/tokenizer_normalizers": {"argv": fit(normalizers)},
            "bombs/deflated_weights": {"argv": fit(deflate)},
            "bombs/estimate_layers": {"argv": ["estimate", "--config", layers, "--no-simulate"]},
            "code/kernel_override": {"argv": fit(kernel)},
            "code/kernel_in_config_json": {"argv": fit(kernel_file)},
            "code/quantization_config": {"argv": fit(quantized)},
        }
    )
    checked.update({"box": [spike, spike_link, last_link, profiler, export, nested, fifo_run],
                    "bounds_runtime": [finder],
                    "bombs": [yaml_bomb, deep, big, zero_ckpt, fifo_ckpt, normalizers, deflate],
                    "code": [kernel, kernel_file, quantized]})
    for group, files_ in checked.items():
        for i, file in enumerate(files_):
            untrusted[f"{group}/check/{i}"] = {"argv": ["recipes", "check", file]}
    trusted = {  # legitimate when the source is trusted: each payload runs, or a value is honoured
        "auto_resume/on_exception": {"argv": fit_keeping_root(onexc, "--weights_only=false")},
        "auto_resume/slurm": {"argv": fit_keeping_root(hpc, "--weights_only=false"), "env": slurm},
        "typed/recipe_merged_under_a_typed_key": {
            "argv": ["fit", overrides, *fit(typed, runs=str(side / "typed"))[1:]]
        },
        "transformers/unknown_model_code": {
            "argv": fit(remote_model, "--model.config_overrides={trust_remote_code: true}", runs=str(side / "unknown"))
        },
        "links/run_folder": {"argv": fit_keeping_root(links_root)},
        "network/nested_config_fit": {"argv": fit(net, runs=str(side / "net"))},
        "bounds/num_workers_mild": {"argv": fit(workers_mild, runs=str(side / "workers"))},
        "box/save_pretrained_replaces": {"argv": ["fit", "--config", export, *FAST]},  # trusted: replaced, as asked
    }
    before = snapshot(root)
    results = run_batch(untrusted, side, trusted=False)
    after = snapshot(root)
    requests_untrusted = list(Recorder.requests)
    trusted_results = run_batch(trusted, side, trusted=True)
    server.shutdown()
    yield SimpleNamespace(root=root, side=side, untrusted=results, trusted=trusted_results, markers=markers,
                          written=sorted(set(after.items()) ^ set(before.items())), requests=requests_untrusted,
                          victim=victim, url=url, cpus=cpus)


def refused_once(result: dict, *fragments: str) -> str:
    """Exactly one `error:` line, a refusal, naming each fragment."""
    lines = [line for line in result["err"].splitlines() if line.startswith("error:")]
    assert result["code"] == 2 and len(lines) == 1, result["err"][-3000:]
    assert lines[0].startswith("error: refusing "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def flagged_by_check(hostile, group: str) -> None:
    for name, result in hostile.untrusted.items():
        if name.startswith(f"{group}/check/"):
            assert result["code"] == 2 and "  REFUSED  " in result["out"], (name, result["out"], result["err"][-2000:])
            assert result["err"].strip().endswith(f"pass {trust.TRUST_FLAG} only if you trust its source"), result[
                "err"
            ]


def test_nothing_untrusted_wrote_or_fetched_anything(hostile):
    assert hostile.written == []
    assert hostile.requests == []
    assert hostile.victim.read_text() == ORIGINAL


ROOT_RULE = "a run folder a recipe chooses must be"  # new (or empty) and under the working folder: lit_memory.sandbox


def test_a_checkpoint_lightning_would_pick_by_itself_is_refused(hostile):
    """A recipe cannot choose a run folder that holds a checkpoint Lightning would resume from by itself: a run
    folder it chooses is new, under the working folder (`lit_memory.sandbox.rules.check_roots`)."""
    for case in ("on_exception", "slurm"):
        refused_once(hostile.untrusted[f"auto_resume/{case}"], "trainer.default_root_dir", ROOT_RULE, trust.TRUST_FLAG)
    for case in ("ckpt_path_last", "ckpt_path_hpc"):
        refused_once(
            hostile.untrusted[f"auto_resume/{case}"], "Lightning would pick the checkpoint itself", "--ckpt_path"
        )
    flagged_by_check(hostile, "auto_resume")
    assert not any(hostile.markers[m].exists() for m in ("last",))
    for case in ("on_exception", "slurm"):  # trusted, Lightning resumes from it, and its pickle runs
        assert hostile.markers["onexc" if case == "on_exception" else "hpc"].exists(), hostile.trusted[
            f"auto_resume/{case}"
        ]["err"][-2000:]


def test_a_distributed_checkpoint_is_read_only_through_the_restricted_readers(hostile):
    refused_once(hostile.untrusted["dcp/byte_item"], "its item 'extra'", "weights_only=True")
    refused_once(hostile.untrusted["dcp/byte_item_typed"], "its item 'extra'")  # what a path points at is never typed
    refused_once(hostile.untrusted["dcp/rank_local_metadata"], "its __0.metadata names code to run when unpickled")
    flagged_by_check(hostile, "dcp")
    assert not hostile.markers["dcp_item"].exists() and not hostile.markers["dcp_rank"].exists()


def test_only_values_the_command_line_itself_sets_are_the_users(hostile):
    for case in ("recipe_merged_under_a_typed_key", "file_given_to_a_typed_key", "file_url_given_to_a_typed_key",
                 "checkpoint_hyper_parameters"):
        refused_once(hostile.untrusted[f"typed/{case}"], "model.config_overrides.trust_remote_code=True")
    flagged_by_check(hostile, "typed")
    result = hostile.trusted["typed/recipe_merged_under_a_typed_key"]
    assert hostile.markers["typed"].read_text() == "ran", result["err"][-2000:]  # trusted, transformers ran it


def test_no_run_writes_through_a_link_planted_in_its_folders(hostile):
    """A folder a recipe chooses to write into is new: nothing can be planted in it (and the kernel refuses a write
    through a link out of the run's folders anyway: tests/test_sandbox.py)."""
    for case in ("logger_folder", "run_folder", "hard_link"):
        refused_once(hostile.untrusted[f"links/{case}"], ROOT_RULE)
    flagged_by_check(hostile, "links")
    # trusted, Lightning's writers are the user's choice, but lit_memory's own files still never follow a link
    result = hostile.trusted["links/run_folder"]
    lines = [line for line in result["err"].splitlines() if line.startswith("error:")]
    assert result["code"] == 2 and len(lines) == 1 and "memory.json: it is a symbolic link" in lines[0], result["err"][
        -2000:
    ]
    assert hostile.victim.read_text() == ORIGINAL


def test_nothing_is_fetched_for_a_config_or_sent_where_a_recipe_says(hostile):
    for case in ("nested_config_fit", "nested_config_estimate", "nested_config_plan", "fsspec_chain"):
        refused_once(hostile.untrusted[f"network/{case}"], "refusing to read the config", "nothing is fetched")
    refused_once(hostile.untrusted["network/data_source"], "data.source", "remote location")
    refused_once(hostile.untrusted["network/logger"], "trainer.logger.init_args.save_dir", "remote location")
    flagged_by_check(hostile, "network")
    refused_once(hostile.trusted["network/nested_config_fit"], "refusing to read the config")  # trusted: off too
    assert hostile.requests == []


def test_values_that_take_the_machine_down_are_refused(hostile):
    refused_once(hostile.untrusted["bounds/num_workers"], "data.num_workers=100000", f"{hostile.cpus} CPU cores")
    refused_once(hostile.untrusted["bounds/devices"], "trainer.devices=4096")
    refused_once(hostile.untrusted["bounds/checkpoint_cadence"], "every_n_train_steps=1", "every 50 optimizer steps")
    refused_once(hostile.untrusted["bounds/checkpoints_kept"], "save_top_k=-1")
    flagged_by_check(hostile, "bounds")
    refused_once(hostile.untrusted["bounds/num_workers_mild"], f"data.num_workers={hostile.cpus + 1}")
    result = hostile.trusted["bounds/num_workers_mild"]  # trusted: honoured
    assert result["code"] == 0, result["err"][-2000:]


def test_model_code_runs_only_when_trusted(hostile):
    refused_once(hostile.untrusted["transformers/unknown_model_code"], "trust_remote_code")
    refused_once(hostile.untrusted["transformers/loading_option"], "config_overrides.cache_dir", "loading option")
    flagged_by_check(hostile, "transformers")
    result = hostile.trusted["transformers/unknown_model_code"]
    assert hostile.markers["unknown"].read_text() == "ran", result["err"][-2000:]


# -- the box: whatever class writes, the process writes only in its run folder (issue 32) ----------------


def test_allowed_classes_write_only_in_the_run_folder(hostile):
    """Lightning classes on the allowlist that take paths, and lit_memory's export, each refused before the run
    writes anything, the setting that asked named: a place outside the run's folders, or a run folder the recipe
    chose that exists (it holds the receiver's files: a link, a checkpoint folder, an export, a FIFO). Only the run's
    folders are writable at all (the kernel: tests/test_sandbox.py)."""
    refused_once(hostile.untrusted["box/spike_detection"], "skip_batches.json",
                 "trainer.callbacks.0.init_args.exclude_batches_path", "outside the run's folders")
    for case in ("spike_detection_link", "save_last_link_rmtree", "save_pretrained_replaces", "nested_link",
                 "fifo_memory_json"):
        refused_once(hostile.untrusted[f"box/{case}"], "trainer.default_root_dir", ROOT_RULE)  # and no hang
    refused_once(hostile.untrusted["box/profiler"], "trainer.profiler.init_args.dirpath", ROOT_RULE)
    flagged_by_check(hostile, "box")
    assert (hostile.root / "outside" / "precious.txt").read_text() == ORIGINAL
    assert sorted(p.name for p in (hostile.root / "outside").iterdir()) == ["precious.txt"]
    result = hostile.trusted["box/save_pretrained_replaces"]  # trusted: the export replaces, as it always did
    assert result["code"] == 0, result["err"][-2000:]
    assert sorted(p.name for p in (hostile.root / "shared_export" / "hf_model").iterdir()) != ["precious.txt"]


def test_bounds_hold_for_the_whole_run(hostile):
    """A batch-size finder scaling the worker count, checkpoint callbacks that each pass their own bounds but
    together save every step (every_n_epochs with one batch an epoch) or keep 50: stopped with one line once the run
    knows (its data loaded), before a checkpoint is written (`lit_memory.sandbox.guard.RunBounds`)."""
    refused_once(hostile.untrusted["bounds/batch_size_finder_workers"], f"data.num_workers={hostile.cpus + 1}",
                 "changed during the run")
    refused_once(hostile.untrusted["bounds/checkpoints_kept_over_callbacks"], "keep 50 checkpoints, more than 10")
    refused_once(
        hostile.untrusted["bounds/checkpoint_cadence_over_callbacks"],
        "every 0.4 optimizer steps",
        "45 times in 20 steps",
    )
    flagged_by_check(hostile, "bounds_runtime")
    assert not list((hostile.side / "every").rglob("*.ckpt")) and not list((hostile.side / "kept").rglob("*.ckpt"))


def test_files_built_to_exhaust_memory_or_time_are_refused_before_the_expensive_step(hostile):
    refused_once(hostile.untrusted["bombs/yaml_aliases"], "yaml_bomb.yaml", "once its aliases are expanded")
    refused_once(hostile.untrusted["bombs/deep_nesting"], "nested deeper than 64 levels")
    refused_once(hostile.untrusted["bombs/large_recipe"], "big.yaml", "more than the 1 MiB bound")
    refused_once(hostile.untrusted["bombs/metadata_dev_zero"], "its .metadata", "not a regular file")
    refused_once(hostile.untrusted["bombs/metadata_fifo"], "its .metadata", "a FIFO")
    refused_once(hostile.untrusted["bombs/tokenizer_normalizers"], "tokenizer.json", "normalizers can multiply")
    refused_once(hostile.untrusted["bombs/deflated_weights"], "pytorch_model.bin", "decompression bomb")
    refused_once(hostile.untrusted["bombs/estimate_layers"], "num_hidden_layers=20000")
    flagged_by_check(hostile, "bombs")


def test_transformers_settings_that_fetch_or_run_code_are_refused_wherever_they_are(hostile):
    refused_once(hostile.untrusted["code/kernel_override"], "model.config_overrides.attn_implementation",
                 "kernel on the Hugging Face Hub")
    refused_once(hostile.untrusted["code/kernel_in_config_json"], "config.json: attn_implementation", "kernel on the")
    refused_once(
        hostile.untrusted["code/quantization_config"], "model.config_overrides.quantization_config", "quantizer"
    )
    flagged_by_check(hostile, "code")


def test_options_typed_count_when_the_whole_line_needs_a_file_to_parse():
    """An override of a strategy only a recipe names does not parse without it; the user's other options (a run
    folder) are still theirs: each option is parsed alone, and those that parse are typed."""
    defaults = {"trainer.default_root_dir": None, "trainer.max_steps": -1}

    def parse(tokens: list[str]) -> Namespace:
        if any(t.startswith("--trainer.strategy.init_args") for t in tokens):
            raise ValueError("trainer.strategy.init_args given without a class_path")
        values = dict(defaults)
        for option in tokens[1:]:
            key, _, value = option[2:].partition("=")
            values[key] = value
        out = Namespace()
        for key, value in values.items():
            out[f"fit.{key}"] = value
        return Namespace(fit=out["fit"], subcommand="fit")

    argv = ["fit", "--config", "recipe.yaml", "--trainer.strategy.init_args.fused=false",
            "--trainer.default_root_dir=/runs/mine"]
    typed = trust.typed_values(argv, parse, "fit")
    decision = trust.Decision(trusted=False, typed=typed)
    assert decision.is_typed("trainer.default_root_dir", "/runs/mine")
    assert not decision.is_typed("trainer.strategy.init_args.fused", "false")
    assert not decision.is_typed("trainer.default_root_dir", "/elsewhere")
