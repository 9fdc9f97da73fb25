"""`lit_memory.sandbox`: a sent recipe's run in a child the kernel confines, one test per class of hole.

Each kernel test runs the same operation twice: confined (Landlock, as an untrusted run's child is) it is refused;
unconfined it succeeds, so the test fails without the confinement. The command-line tests run `python -m lit_memory`
without ``--trust-recipe`` and read its one ``error:`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, RECIPES, rows, write_csv
from lit_memory.sandbox import landlock, launch, rules, stage

pytestmark = pytest.mark.skipif(landlock.abi() < 4, reason="needs Landlock ABI 4 (Linux 6.7) or later")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run_python(code: str, spec: rules.Spec | None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python that imports lit_memory first: confined by ``spec`` where given."""
    environ = {**os.environ, **ENV, **(env or {})}
    environ.pop(rules.ENV, None)
    if spec is not None:
        environ[rules.ENV] = spec.to_env()
        environ["TMPDIR"] = spec.write[0]  # as the run's private temporary folder (`launch.make_plan`)
    return subprocess.run([sys.executable, "-c", "import lit_memory\n" + textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=300)


def spec_for(tmp_path: Path, *reads: Path) -> rules.Spec:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return rules.Spec(read=[*rules.python_roots(), *rules.system_roots(), *map(str, reads)],
                      write=[str(run), *rules.device_write_roots()])


# -- the kernel's boundary -----------------------------------------------------------------------------------


def test_native_writers_cannot_write_outside_the_run_folders(tmp_path):
    """torch.save's C++ zip writer and safetensors' Rust writer open files without Python's I/O: the kernel refuses
    them outside the run's folders, and lets them write inside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    code = f"""
        import torch
        from safetensors.torch import save_file
        for name, write in (("torch", lambda p: torch.save(torch.ones(2), p)),
                            ("safetensors", lambda p: save_file({{"w": torch.ones(2)}}, p))):
            for place in ({str(outside)!r}, {str(tmp_path / 'run')!r}):
                try:
                    write(place + "/" + name + ".bin")
                    print(name, "wrote", place)
                except Exception as err:
                    print(name, "refused", place, type(err).__name__)
    """
    confined = run_python(code, spec_for(tmp_path))
    assert confined.returncode == 0, confined.stderr[-3000:]
    for name in ("torch", "safetensors"):
        assert f"{name} refused {outside}" in confined.stdout and f"{name} wrote {tmp_path / 'run'}" in confined.stdout
    assert not list(outside.iterdir())
    free = run_python(code, None)
    assert f"torch wrote {outside}" in free.stdout and f"safetensors wrote {outside}" in free.stdout


def test_reads_outside_the_roots_are_refused_through_a_link_and_proc(tmp_path):
    """A private file, a link inside a readable folder pointing at it, and the environment of the process that
    started the run (its secrets): all refused to the confined child; the child's own environment holds none
    (`launch.scrubbed`). Unconfined, each read succeeds."""
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "chat_template.jinja").symlink_to(secret)
    code = f"""
        import os
        for path in ({str(secret)!r}, {str(shared / 'chat_template.jinja')!r}, f"/proc/{{os.getppid()}}/environ"):
            try:
                with open(path, "rb") as f:
                    print("read", path, len(f.read()))
            except OSError as err:
                print("refused", path, type(err).__name__)
    """
    confined = run_python(code, spec_for(tmp_path, shared), env={"HF_TOKEN": "hf_secret"})
    outcome = [line.split()[0] for line in confined.stdout.splitlines()]
    assert outcome == ["refused"] * 3, confined.stdout + confined.stderr[-2000:]
    free = run_python(code, None)
    assert [line.split()[0] for line in free.stdout.splitlines()] == ["read"] * 3, free.stdout
    assert "HF_TOKEN" not in launch.scrubbed({"HF_TOKEN": "x", "AWS_SECRET_ACCESS_KEY": "y", "MY_API_KEY": "z", "PATH": "p"})
    assert launch.scrubbed({"HF_TOKEN": "x", "AWS_PROFILE": "y", "PATH": "p", "CUDA_VISIBLE_DEVICES": "0"}) == {
        "PATH": "p", "CUDA_VISIBLE_DEVICES": "0"}


def test_no_tcp_connection_leaves_a_confined_run(tmp_path):
    """No TCP connect but a distributed launch's own ports (none here); unconfined, the connection is made."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=5); print("connected")
        except OSError as err:
            print("refused", type(err).__name__)
    """
    try:
        assert "refused" in run_python(code, spec_for(tmp_path)).stdout
        assert "connected" in run_python(code, None).stdout
    finally:
        server.close()


# -- what a sent folder may hold ------------------------------------------------------------------------------


def model_folder(path: Path) -> Path:
    shutil.copytree(REPO / "lit_memory" / "assets" / "bert-large-uncased", path)
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    (path / "config.json").write_text(json.dumps(config))
    return path


def lit_memory_command(tmp_path: Path, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    environ = {**os.environ, **ENV, **(env or {})}
    environ.pop(rules.ENV, None)
    return subprocess.run([sys.executable, "-m", "lit_memory", *args], cwd=tmp_path, env=environ, capture_output=True,
                          text=True, timeout=timeout)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_a_fifo_an_index_names_is_refused_before_the_run_reads_it(tmp_path):
    """A sharded model's index naming a FIFO one folder down: safetensors' reader would block on it forever. Every
    file an index names must be a regular file beneath the folder (`stage.check`), said in one line."""
    folder = model_folder(tmp_path / "model")
    (folder / "shards").mkdir()
    os.mkfifo(folder / "shards" / "model-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "shards/model-00001.safetensors"}}))
    with pytest.raises(Exception, match=r"model-00001.safetensors is not a regular file"):
        stage.check(folder, "model")
    result = lit_memory_command(tmp_path, "fit", f"--model.model_name_or_path={folder}", "--trainer.max_steps=1",
                                timeout=120)
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stderr[-3000:]
    assert "shards/model-00001.safetensors is not a regular file" in error_lines(result)[0]


def test_a_backtracking_tokenizer_is_stopped_by_the_preparation_limit(tmp_path):
    """A tokenizer whose Split pattern backtracks catastrophically (about a tenth of a second per word here, minutes
    per row): the watchdog ends the run when preparing takes longer than its bound, with one line naming the phase."""
    folder = model_folder(tmp_path / "model")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(\\w+\\s?)+$"}, "behavior": "Isolated", "invert": False}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((folder / "tokenizer_config.json").read_text())  # its tokenizer.json, not a BERT rebuilt from vocab.txt
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    data = write_csv(tmp_path / "data.csv", [{"text": ("a" * 21 + "! ") * 80, "label": i % 2} for i in range(40)])
    result = lit_memory_command(
        tmp_path, "fit", f"--model.model_name_or_path={folder}", "--model.pretrained=false", f"--data.source={data}",
        "--trainer.max_steps=1", env={launch.LIMIT_VARIABLES["prepare"]: "15"}, timeout=400,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_lines(result)[-1].startswith("error: stopped: preparing: tokenising took longer than 15 s"), result.stderr[-2000:]


def test_memory_growth_is_stopped_by_the_watchdog(tmp_path):
    """The run's processes together held past their bound (here set low by the user's environment): stopped, one line."""
    result = lit_memory_command(tmp_path, "fit", "--trainer.max_steps=2", "--data.limit_train_samples=16",
                                env={launch.LIMIT_VARIABLES["rss"]: str(200 * 2**20)}, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_lines(result)[-1].startswith("error: stopped: the run's processes held"), result.stderr[-2000:]
    assert f"set by {launch.LIMIT_VARIABLES['rss']}" in error_lines(result)[-1]


# -- what a recipe may choose ---------------------------------------------------------------------------------


def recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_run_folder_in_an_autoloaded_folder_is_refused(tmp_path):
    """``default_root_dir: ~/.bashrc.d`` with no logger: a shell sources every file there at its next start. A run
    folder a recipe chooses must be new, under the working folder: one line, and the folder is not made."""
    home = tmp_path / "home"
    home.mkdir()
    sent = recipe(tmp_path, "trainer:\n  default_root_dir: ~/.bashrc.d\n  logger: false\n")
    (tmp_path / "work").mkdir()
    result = lit_memory_command(tmp_path / "work", "fit", "--config", str(sent), env={"HOME": str(home)}, timeout=120)
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stderr[-3000:]
    assert "refusing trainer.default_root_dir=" in error_lines(result)[0] and "a run folder a recipe chooses" in error_lines(result)[0]
    assert not (home / ".bashrc.d").exists()
    with pytest.raises(Exception, match=r"it is inside .*\.cache, a folder of yours"):
        rules.check_roots([("trainer.default_root_dir", str(home / ".cache" / "x"))], str(home), [str(home / ".cache")])


def test_a_format_field_walk_is_refused(tmp_path):
    """A checkpoint file name walking from a metric to os.environ through Python's format fields."""
    walk = "{epoch].__reduce_ex__.__globals__[torch].os.environ[HF_TOKEN}"
    sent = recipe(tmp_path, f"""\
        trainer:
          callbacks:
            - class_path: lightning.pytorch.callbacks.ModelCheckpoint
              init_args: {{filename: "{walk}"}}
        """)
    result = lit_memory_command(tmp_path, "fit", "--config", str(sent), env={"HF_TOKEN": "hf_secret"}, timeout=120)
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stderr[-3000:]
    assert "refusing trainer.callbacks.0.init_args.filename=" in error_lines(result)[0] and "not a plain {metric}" in error_lines(result)[0]
    rules.check_template("filename", "best-{step}-{val_f1_macro:.4f}")  # plain fields pass
    with pytest.raises(Exception, match=r"is not a plain"):
        rules.check_template("filename", "{epoch.__class__}")


def test_free_form_keyword_dictionaries_are_refused(tmp_path):
    """A profiler's ``dict_kwargs`` (``profile_memory``, ``with_stack``, no schedule: gigabytes in a few steps)."""
    sent = recipe(tmp_path, """\
        trainer:
          profiler:
            class_path: lightning.pytorch.profilers.PyTorchProfiler
            dict_kwargs: {profile_memory: true, with_stack: true}
        """)
    result = lit_memory_command(tmp_path, "fit", "--config", str(sent), timeout=120)
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stderr[-3000:]
    assert "trainer.profiler.dict_kwargs" in error_lines(result)[0] and "free-form keyword arguments" in error_lines(result)[0]


# -- the same run, confined or not ----------------------------------------------------------------------------


@pytest.mark.fit
def test_an_untrusted_run_trains_the_same_weights_as_a_trusted_one(tmp_path):
    """The confined child trains exactly what the same command trains in-process with --trust-recipe."""
    from safetensors.torch import load_file

    data = write_csv(tmp_path / "reviews.csv", rows(40))
    args = ["fit", "--config", str(RECIPES / "fused.yaml"), f"--data.source={data}", "--data.batch_size=4",
            "--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]
    weights = {}
    for name, more in (("untrusted", []), ("trusted", ["--trust-recipe"])):
        result = lit_memory_command(tmp_path, *args, f"--trainer.default_root_dir={tmp_path / name}", *more)
        assert result.returncode == 0, result.stderr[-3000:]
        weights[name] = load_file(next((tmp_path / name).rglob("model.safetensors")))
    assert weights["untrusted"].keys() == weights["trusted"].keys()
    assert all((weights["untrusted"][k] == weights["trusted"][k]).all() for k in weights["trusted"])


def test_only_an_untrusted_training_or_evaluation_runs_confined(monkeypatch):
    from lit_memory.__main__ import confined

    monkeypatch.delenv(rules.ENV, raising=False)
    assert confined(["fit"]) and confined(["predict", "--data.predict_path", "x.csv"])
    assert not confined(["fit", "--trust-recipe"]) and not confined(["estimate"])
    monkeypatch.setenv(rules.ENV, "{}")  # the child itself: it runs the command
    assert not confined(["fit"])


def test_without_landlock_an_untrusted_run_stops_with_one_line(tmp_path, monkeypatch, capsys):
    from lit_memory.__main__ import main

    monkeypatch.delenv(rules.ENV, raising=False)
    monkeypatch.setattr(landlock, "abi", lambda: 0)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--trainer.max_steps=1"])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: an untrusted run is confined by the kernel (Landlock") and "--trust-recipe" in line
    assert list(tmp_path.iterdir()) == []
