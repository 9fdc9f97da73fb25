"""The child's confinement (`lit_memory.sandbox.child.confine`), as a run's child applies it to itself: no setting
weakens it (class A) and a layer the kernel offers that cannot be built stops the run (class B). Each case is one
short confined Python (a second or two), not a training run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import REPO

from lit_memory.sandbox import landlock, namespaces, rules

pytestmark = pytest.mark.skipif(landlock.abi() < 4, reason="needs Landlock ABI 4 (Linux 6.7) or later")
# The child's boot (`child.BOOT`), then ``code``; a layer that cannot be built is one "refused" line.
PROBE = """
import json, os, sys
sys.path[:] = json.loads(os.environ["LIT_MEMORY_SANDBOX"])["path"]
from lit_memory.sandbox import child
try:
    held = child.confine()
except (OSError, RuntimeError) as err:
    print("refused", err, flush=True)
    sys.exit(3)
print("missing", json.dumps(held.missing), flush=True)
"""


def confined(code: str, spec: rules.Spec, cwd: Path) -> subprocess.CompletedProcess:
    spec.parent = os.getpid()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), rules.ENV: spec.to_env()}
    return subprocess.run([sys.executable, "-I", "-B", "-c", PROBE + textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def spec_for(tmp_path: Path, *reads: str, **kwargs) -> rules.Spec:
    (tmp_path / "run").mkdir(exist_ok=True)
    (tmp_path / "view").mkdir(exist_ok=True)
    return rules.Spec(read=[*rules.python_roots(), *rules.system_roots(), *reads],
                      write=[str(tmp_path / "run"), *rules.device_write_roots()], path=rules.child_path(),
                      view=str(tmp_path / "view"), shm=16 * 2**20, **kwargs)


def test_a_distributed_run_reaches_only_its_own_loopback(tmp_path):
    """Class A: a recipe asking for several nodes used to keep the host's network (IPv4/IPv6 and the ephemeral TCP
    ports allowed). Now no field of the confinement can ask for it, and a run allowed TCP (a distributed launch's
    ranks) connects on a loopback of its own: a listener of this machine's, on a port it may use, is not there."""
    assert "network" not in asdict(rules.Spec())  # nothing a recipe chooses keeps the host's network
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    code = f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
            print("reached")
        except OSError as err:
            print("not reached", type(err).__name__)
    """
    try:
        spec = spec_for(tmp_path, connect=[[port, port]], bind=[[0, 0], [port, port]], inet=True)
        result = confined(code, spec, tmp_path)
        if result.stdout.startswith("refused") and "network namespace" in result.stdout:
            pytest.skip("this kernel or container offers no network namespace (the run is refused, as it should)")
        assert "not reached ConnectionRefusedError" in result.stdout, result.stdout + result.stderr[-2000:]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # unconfined, the listener is there
    finally:
        listener.close()


def deep_folder(base: Path, length: int) -> Path:
    """A folder whose absolute path is about ``length`` characters (components of 200: legal names, legal path)."""
    fd, parts = os.open(base, os.O_RDONLY), []
    try:
        while (left := length - len(str(base)) - sum(len(p) + 1 for p in parts) - 1) > 0:
            name = "d" * min(200, left)
            os.mkdir(name, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
            parts.append(name)
    finally:
        os.close(fd)
    return base.joinpath(*parts)


def test_an_input_the_view_cannot_hold_stops_the_child(tmp_path):
    """Class B: an input of about 4,070 characters is a legal path, but ``<private>/view`` + it passes PATH_MAX. The
    child used to turn the mount error into "no mount layer" and run on, with the host's /dev/shm and UNIX sockets in
    reach. The parent refuses such a path first (`namespaces.unplaceable`, tests/confine/test_launch.py); the child,
    handed one anyway, does not run."""
    deep = deep_folder(tmp_path, 4070)
    assert len(str(deep)) < namespaces.PATH_MAX  # a path the host itself takes
    spec = spec_for(tmp_path, str(deep))
    assert namespaces.unplaceable(spec.view, spec.read) == str(deep)
    result = confined("print('ran on')", spec, tmp_path)
    assert result.returncode == 3 and result.stdout.startswith("refused"), result.stdout + result.stderr[-2000:]
    assert "ran on" not in result.stdout
    # The same child with what fits: every layer this kernel has holds, and it runs.
    fine = confined("print('ran on')", spec_for(tmp_path), tmp_path)
    assert "ran on" in fine.stdout, fine.stdout + fine.stderr[-2000:]
    missing = json.loads(fine.stdout.splitlines()[0].split(" ", 1)[1])
    assert "mount" not in missing or "unshare" in missing["mount"]  # missing only where the kernel lacks it


def test_a_run_has_what_a_python_ml_run_expects(tmp_path):
    """Issue 57 item 5: a writable /tmp of its own and TMPDIR, sockets and FIFOs in its temporary folder (DataLoader
    workers' resource sharer binds one; refused, the run hung), /dev/zero, /dev/full and /dev/urandom. An input that
    lies beneath the host's /tmp stays read only in the writable /tmp, and nothing reaches the host's /tmp."""
    private = tmp_path / "private-tmp"
    private.mkdir()
    data = tmp_path / "data.csv"
    data.write_text("text,label\n")
    spec = spec_for(tmp_path, str(data), tmp=str(private))
    spec.write.append(str(private))
    code = f"""
        import os, socket, tempfile
        def attempt(name, fn):
            try:
                fn()
                print(name, "ok")
            except OSError as err:
                print(name, "refused", type(err).__name__, err.errno)
        def bind(path):
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(path)
        attempt("tmp", lambda: open("/tmp/scratch", "w").write("x"))
        attempt("tmpdir", lambda: tempfile.mkdtemp(dir={str(private)!r}))
        attempt("socket", lambda: bind({str(private / 'listener')!r}))
        attempt("fifo", lambda: os.mkfifo({str(private / 'queue')!r}))
        attempt("tmp-socket", lambda: bind("/tmp/listener"))
        attempt("socket-elsewhere", lambda: bind({str(tmp_path / 'run' / 'listener')!r}))
        attempt("input", lambda: open({str(data)!r}, "a").write("planted"))
        attempt("zero", lambda: open("/dev/zero", "rb").read(4))
        attempt("urandom", lambda: open("/dev/urandom", "rb").read(4))
        attempt("full", lambda: open("/dev/full", "wb", buffering=0).write(b"x"))
    """
    result = confined(code, spec, tmp_path)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines()[1:])
    assert lines.get("tmp") == "ok", result.stdout + result.stderr[-2000:]
    for name in ("tmpdir", "socket", "fifo", "zero", "urandom"):
        assert lines[name] == "ok", (name, result.stdout)
    assert lines["full"].startswith("refused OSError 28")  # ENOSPC: /dev/full is there, and full
    assert lines["socket-elsewhere"].startswith("refused") and lines["tmp-socket"].startswith("refused")  # TMPDIR
    assert lines["input"].startswith("refused")  # read only, though beneath the writable /tmp
    assert data.read_text() == "text,label\n" and not Path("/tmp/scratch").exists()
    assert (private / "listener").exists() and (private / "queue").exists()
