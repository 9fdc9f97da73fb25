"""Class E of issue 58: a confined run's disk is counted in allocated blocks (`lit_memory.sandbox.watchdog.usage`),
files it holds open after unlinking them count, and a folder the parent cannot enter stops the run instead of
counting as empty; what a run left over its budget is freed."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
from conftest import REPO

from lit_memory.confine import launch
from lit_memory.sandbox import landlock, watchdog

MiB = 2**20
FALLOC_FL_KEEP_SIZE = 1


def keep_size_fallocate(fd: int, length: int) -> None:
    """``fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, length)``: blocks held, the file's size left at 0."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(length)) != 0:
        pytest.skip(f"fallocate: {os.strerror(ctypes.get_errno())}")


def test_space_held_at_size_zero_and_after_unlinking_is_counted(tmp_path):
    """64 MiB held with FALLOC_FL_KEEP_SIZE at size 0, and 64 MiB in a file unlinked while this process holds it:
    each counted against a 32 MiB budget, where apparent sizes counted nothing."""
    bounds = watchdog.Bounds(rss=2**30, disk=32 * MiB, prepare=60)
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "held.bin", "wb") as f:
        keep_size_fallocate(f.fileno(), 64 * MiB)
    assert os.stat(run / "held.bin").st_size == 0
    found = watchdog.usage([str(run)])
    assert found.bytes >= 64 * MiB and not found.why
    assert watchdog.over_disk(found, bounds, left=True).startswith("stopped: the run left 0.06 GiB on disk")
    (run / "held.bin").unlink()
    with open(run / "gone.bin", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 64 * MiB)
        os.unlink(run / "gone.bin")
        assert watchdog.usage([str(run)]).bytes < MiB  # the walk alone finds nothing
        held = watchdog.usage([str(run)], [os.getpid()])
        assert held.bytes >= 64 * MiB and "held 0.06 GiB" in watchdog.over_disk(held, bounds)


# Run as a user who is not root (as the parent of a confined run is): root enters any folder.
UNREADABLE = """
    import json, os, sys
    from lit_memory.sandbox import watchdog
    base = sys.argv[1]
    hidden = os.path.join(base, "run", "hidden")
    os.makedirs(hidden)
    with open(os.path.join(hidden, "data.bin"), "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 8 << 20)
    os.chmod(hidden, 0)
    found = watchdog.usage([os.path.join(base, "run")])
    watchdog.remove(os.path.join(base, "run"))
    print(json.dumps({"why": found.why, "bytes": found.bytes, "left": os.path.exists(os.path.join(base, "run"))}))
"""


def test_a_folder_the_parent_cannot_enter_stops_the_run_and_is_freed(tmp_path):
    """A ``chmod 000`` folder holding 8 MiB: the walk cannot enter it, and says so (the run is stopped: what cannot
    be counted is not bounded) instead of counting nothing; the parent still removes it at the end."""
    code = textwrap.dedent(UNREADABLE)
    if os.geteuid() != 0:
        command, base, drop = [sys.executable, "-c", code], str(tmp_path), None
    else:
        python = shutil.which("python3", path="/usr/bin:/bin")  # the user's own Python: root's may be unreadable
        if python is None:
            pytest.skip("no system python3 to run as a user who is not root")
        base = tempfile.mkdtemp(prefix="lit_memory-disk-", dir="/tmp")
        os.chmod(base, 0o777)
        command = [python, "-c", code]

        def drop() -> None:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
    try:
        result = subprocess.run([*command, base], capture_output=True, text=True, timeout=60, preexec_fn=drop,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        assert result.returncode == 0, result.stderr[-2000:]
        found = json.loads(result.stdout)
    finally:
        if base != str(tmp_path):
            shutil.rmtree(base, ignore_errors=True)
    assert found["why"].endswith("hidden: Permission denied") and not found["left"], found
    stopped = watchdog.over_disk(watchdog.Usage(why=found["why"]), watchdog.Bounds(2**30, 2**30, 60))
    assert stopped.startswith("stopped: the run's disk use could not be counted whole (") and "not bounded" in stopped


def test_only_the_folders_made_for_the_run_are_freed():
    assert launch._outermost(["/w/logs", "/w/logs/version_0", "/w/ckpt", "/w/logsx"]) == ["/w/logs", "/w/ckpt",
                                                                                          "/w/logsx"]


@pytest.mark.skipif(landlock.abi() < 4, reason="needs Landlock ABI 4 (Linux 6.7) or later")
def test_a_confined_run_holding_space_it_unlinked_is_stopped(tmp_path):
    """The confined child (its own namespaces, its view) holds 64 MiB in a file it unlinked in its run folder, against
    a 32 MiB budget: the watchdog stops it with one line, counted from the child's open files."""
    from test_sandbox import watch_probe

    code = """
        import os, time
        run = json.loads(os.environ["LIT_MEMORY_SANDBOX"])["write"][0]
        f = open(os.path.join(run, "gone.bin"), "wb")
        os.posix_fallocate(f.fileno(), 0, 64 << 20)
        os.unlink(os.path.join(run, "gone.bin"))
        time.sleep(60)
    """
    code_, err = watch_probe(tmp_path, code, watchdog.Bounds(rss=8 * 2**30, disk=32 * MiB, prepare=120))
    assert code_ == 2, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: stopped: the run held 0.06 GiB on disk"), err[-2000:]
    assert not list((tmp_path / "run").iterdir())


@pytest.mark.skipif(landlock.abi() < 4, reason="needs Landlock ABI 4 (Linux 6.7) or later")
def test_space_a_confined_run_left_at_size_zero_is_refused_and_freed(tmp_path, capsys, monkeypatch):
    """The hunt's case through ``fit --config sent.yaml``: the confined child holds 128 MiB with FALLOC_FL_KEEP_SIZE at
    size 0 in its run folder against a 32 MiB budget and ends at once. One ``error:`` line says what it held, and the
    run folder made for it is gone with the space."""
    from test_sandbox import probe_command

    from lit_memory.__main__ import main
    from lit_memory.sandbox import child, rules

    code = """
        import ctypes, os
        run = json.loads(os.environ["LIT_MEMORY_SANDBOX"])["write"][0]
        fd = os.open(os.path.join(run, "held.bin"), os.O_WRONLY | os.O_CREAT, 0o600)
        assert ctypes.CDLL(None).fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(128 << 20)) == 0
    """
    monkeypatch.setattr(child, "command", lambda args: probe_command(code))  # the run's child, as a recipe's code
    monkeypatch.setenv(launch.LIMIT_VARIABLES["disk"], str(32 * MiB))
    monkeypatch.delenv(rules.ENV, raising=False)
    (tmp_path / "sent.yaml").write_text("# sent by someone\nseed_everything: 7\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "sent.yaml", "--model.model_name_or_path", "bundled:minilm",
              "--trainer.accelerator", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err[-2000:]
    # counted while it ran, or once it ended (it may end before the watchdog's next count)
    last = err.strip().splitlines()[-1]
    assert re.match(r"error: stopped: the run (held|left) 0\.1\d GiB on disk", last), err[-2000:]
    assert not (tmp_path / "lightning_logs").exists()
