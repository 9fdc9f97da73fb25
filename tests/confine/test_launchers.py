"""`lit_memory.confine.launchers` and the launch matrix: every launch form of the mission, with a shipped recipe, a
trusted file and an untrusted one, either trains (rc 0, a model exported) or stops with one ``error:`` line. The time
limit on each case is the proof that none hangs: a confined rank that could not reach its launcher's store used to
wait until killed.

Trusted (shipped, or `recipes trust`) runs as Lightning runs them, on every launcher; untrusted runs confined where
one sandbox can hold the whole run (Lightning's own launcher for ``--trainer.devices 2``, DataLoader workers, a
compiled model) and is refused, before any rendezvous, where ranks come from an outside launcher or span nodes.
Cheap by construction: a 2-layer BERT of width 64 with random weights, 2 optimizer steps, no validation.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RECIPES, REPO, rows, write_csv

from lit_memory.config import trusted
from lit_memory.confine import launchers
from lit_memory.run import environment
from lit_memory.sandbox import landlock, rules

TINY = '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}'
SETTINGS = [
    "--model.model_name_or_path=bundled:bert-large", "--model.pretrained=false", f"--model.config_overrides={TINY}",
    "--data.batch_size=4", "--data.max_length=16", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--trainer.accelerator=cpu",
]
LIMIT = 420  # seconds a case may take on the 2-core CPU under CI's load: past it, it hung
DDP = ["--trainer.strategy=ddp"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


# (launch form, how many processes the command line is started as, the command's prefix, extra settings)
FORMS = {
    "devices2": lambda port: ([[sys.executable]], [*DDP, "--trainer.devices=2"], {}),
    "torchrun": lambda port: ([torchrun("--standalone", "--nproc-per-node", "2")], [*DDP, "--trainer.devices=2"], {}),
    "torchrun-2-nodes": lambda port: (
        [torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  f"127.0.0.1:{port}", "--rdzv-id", f"matrix{port}")] * 2,
        [*DDP, "--trainer.devices=1", "--trainer.num_nodes=2"], {}),
    "slurm-2-tasks": lambda port: ([[sys.executable]] * 2, [*DDP, "--trainer.devices=1", "--trainer.num_nodes=2"],
                                   {"MASTER_PORT": str(port)}),
    "workers2": lambda port: ([[sys.executable]], ["--data.num_workers=2"], {}),
    "compiled": lambda port: ([[sys.executable]], ["--model.compile=true"], {}),
}
OUTSIDE = {"torchrun", "torchrun-2-nodes", "slurm-2-tasks"}  # ranks another program starts: refused untrusted


def slurm_task(rank: int, job: int) -> dict[str, str]:
    """What ``srun --ntasks 2`` sets for task ``rank``, each task a "node" of its own on this machine."""
    return {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0",
            "SLURM_NODEID": str(rank), "SLURM_JOB_ID": str(job), "SLURM_JOB_NAME": "matrix",
            "SLURM_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "2"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_csv(tmp_path_factory.mktemp("data") / "reviews.csv", rows(40))


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> dict[str, Path]:
    """The three kinds of config: shipped, a changed copy the user trusted, a changed copy nobody trusted."""
    folder = tmp_path_factory.mktemp("recipes")
    found = {"shipped": RECIPES / "baseline.yaml"}
    for kind in ("trusted", "untrusted"):
        found[kind] = folder / f"{kind}.yaml"
        found[kind].write_text((RECIPES / "baseline.yaml").read_text() + f"# a copy: {kind}\n")
    trusted.trust(found["trusted"])
    return found


def launch(form: str, recipe: Path, data: Path, root: Path) -> list[subprocess.CompletedProcess]:
    port = free_port()
    prefixes, extra, env_extra = FORMS[form](port)
    args = ["-m", "lit_memory", "fit", "--config", str(recipe), *SETTINGS, *extra, f"--data.source={data}",
            f"--trainer.default_root_dir={root}"]
    env = {**environment.for_new_job(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env_extra}
    env.pop(rules.ENV, None)
    logs = [root.parent / f"{root.name}-{i}.log" for i in range(len(prefixes))]  # files: no process blocks on a pipe
    started = []
    for rank, (prefix, log) in enumerate(zip(prefixes, logs)):
        rank_env = {**env, **(slurm_task(rank, port) if form == "slurm-2-tasks" else {})}
        with open(log, "w") as out:
            started.append(subprocess.Popen([*prefix, *args], cwd=root.parent, env=rank_env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True))
    done = []
    for process, log in zip(started, logs):
        try:
            code = process.wait(LIMIT)
        except subprocess.TimeoutExpired:
            for other in started:
                os.killpg(other.pid, 9)
            pytest.fail(f"{form} with {recipe.name} hung past {LIMIT} s:\n{log.read_text()[-3000:]}")
        done.append(subprocess.CompletedProcess(process.args, code, log.read_text(), ""))
    return done


needs_landlock = pytest.mark.skipif(landlock.abi() < 4, reason="an untrusted run needs Landlock ABI 4 to be confined")


@pytest.mark.fit
@pytest.mark.parametrize("trust", ["shipped", "trusted", pytest.param("untrusted", marks=needs_landlock)])
@pytest.mark.parametrize("form", list(FORMS))
def test_every_launch_form_trains_or_is_refused_in_one_line(form, trust, recipes, data, tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    done = launch(form, recipes[trust], data, root)
    output = "\n".join(d.stdout for d in done)
    confined = [line for line in output.splitlines() if line.startswith("sandbox: running confined")]
    if trust == "untrusted" and form in OUTSIDE:
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, output[-3000:]
        assert (
            errors[0].startswith("error: refusing to run confined: it was started by") or "spans 2 nodes" in errors[0]
        )
        assert "recipes trust" in errors[0] and all(d.returncode != 0 for d in done)
        assert not list(root.rglob("model.safetensors")) and "Initializing distributed" not in output
        return
    assert all(d.returncode == 0 for d in done), output[-4000:]
    assert list(root.rglob("hf_model/model.safetensors")), output[-3000:]
    assert bool(confined) == (trust == "untrusted"), output[-3000:]  # only a recipe nobody trusted is confined
    if trust == "untrusted":
        assert confined == [trusted.judge(["--config", str(recipes[trust])]).line()]


def test_an_outside_launcher_is_detected_from_its_variables(monkeypatch):
    with monkeypatch.context() as env:  # undone before the test ends (conftest checks launcher variables after it)
        for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC", "LSB_", "JSM_"))]:
            env.delenv(name)
        assert launchers.outside_launcher() is None
        env.setenv("SLURM_NTASKS", "1")
        env.setenv("SLURM_JOB_NAME", "train")
        assert launchers.outside_launcher() is None  # one task: a single process, confined as one
        env.setenv("SLURM_NTASKS", "2")
        assert launchers.outside_launcher().startswith("SLURM's srun (SLURM_NTASKS=2")
        env.setenv("SLURM_JOB_NAME", "interactive")  # Lightning's own exception: an interactive allocation
        assert launchers.outside_launcher() is None
        env.setenv("TORCHELASTIC_RUN_ID", "x")
        env.setenv("WORLD_SIZE", "2")
        assert launchers.outside_launcher().startswith("torchrun (TORCHELASTIC_RUN_ID=x")


def test_only_the_first_rank_says_the_refusal(monkeypatch):
    with monkeypatch.context() as env:
        for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC"))]:
            env.delenv(name)
        env.setenv("TORCHELASTIC_RUN_ID", "x")
        for rank, first in (("0", True), ("1", False)):
            env.setenv("RANK", rank)
            with pytest.raises(launchers.LauncherRefused) as refused:
                launchers.check("sandbox: running confined, because x.yaml is not a shipped recipe and nobody trusted "
                                "it; if you trust its source: ...")
            assert refused.value.first is first
            assert "because x.yaml is not a shipped recipe and nobody trusted it." in str(refused.value)
        env.delenv("TORCHELASTIC_RUN_ID")
        env.delenv("RANK")
        with pytest.raises(launchers.LauncherRefused, match="spans 2 nodes"):
            launchers.check("sandbox: running confined, because x", num_nodes=2)
        launchers.check("sandbox: running confined, because x", num_nodes=1)  # one machine, no launcher: confined
