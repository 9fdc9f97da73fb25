"""`lit_memory.sandbox`: a sent recipe's run in a child the kernel confines, one test per class of hole.

Each kernel test runs the same operation twice: confined (`child.confine`, as an untrusted run's child confines
itself: namespaces, the view, Landlock, no capabilities, seccomp) it is refused; unconfined it succeeds, so the test
fails without the confinement. A layer this kernel or container lacks is reported by the child and the test skips,
naming it. The watchdog tests run a small confined probe under `watchdog.watch`; the command-line tests run
`python -m lit_memory` without ``--trust-recipe`` in a folder built as someone would send it and read its one
``error:`` line. The classes A-F are issue 52's (docs/sharing.md, "The sandbox").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import RECIPES, REPO, rows, write_csv

from lit_memory.confine import launch
from lit_memory.sandbox import child, environment, landlock, rules, stage, watchdog

pytestmark = pytest.mark.skipif(landlock.abi() < 4, reason="needs Landlock ABI 4 (Linux 6.7) or later")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


PROBE = ("import json, os, sys; sys.path[:] = json.loads(os.environ['LIT_MEMORY_SANDBOX'])['path']\n"
         "from lit_memory.sandbox import child\n"
         "held = child.confine()\n"
         "print('missing', json.dumps(held.missing), flush=True)\n")


def probe_command(code: str) -> list[str]:
    """``code`` in the child's interpreter (isolated, the sandbox's path), confined first as a run's child is."""
    return [sys.executable, "-I", "-B", "-c", PROBE + textwrap.dedent(code)]


def run_python(code: str, spec: rules.Spec | None, env: dict | None = None, cwd: Path | None = None,
               stdin=None) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python: confined as a run's child is (`child.confine`) where ``spec`` is given, else
    free (the same code, nothing confined)."""
    environ = {**os.environ, **ENV, **(env or {})}
    environ.pop(rules.ENV, None)
    if spec is None:
        return subprocess.run([sys.executable, "-c", "import lit_memory\n" + textwrap.dedent(code)], env=environ,
                              capture_output=True, text=True, timeout=300, cwd=cwd, stdin=stdin)
    spec.parent = os.getpid()
    environ[rules.ENV] = spec.to_env()
    environ["TMPDIR"] = spec.write[0]  # as the run's private temporary folder (`launch.make_plan`)
    return subprocess.run(probe_command(code), env=environ, capture_output=True, text=True, timeout=300, cwd=cwd,
                          stdin=stdin)


def missing_layers(result: subprocess.CompletedProcess) -> dict:
    line = next((line for line in result.stdout.splitlines() if line.startswith("missing ")), None)
    assert line is not None, result.stdout + result.stderr[-3000:]
    return json.loads(line.split(" ", 1)[1])


_MISSING: dict = {}


def require(tmp_path_factory, *layers: str) -> None:
    """Skip, naming them, where this kernel or container lacks one of ``layers`` (asked once, of a confined probe)."""
    if not _MISSING:
        _MISSING["found"] = missing_layers(run_python("", spec_for(tmp_path_factory.mktemp("layers"))))
    absent = {layer: why for layer, why in _MISSING["found"].items() if layer in layers}
    if absent:
        pytest.skip(f"this kernel or container lacks {absent}")


def spec_for(tmp_path: Path, *reads: Path) -> rules.Spec:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (tmp_path / "view").mkdir(exist_ok=True)
    return rules.Spec(
        read=[*rules.python_roots(), *rules.system_roots(), *map(str, reads)],
        write=[str(run), *rules.device_write_roots()],
        path=rules.child_path(),
        view=str(tmp_path / "view"),
        shm=64 * 2**20,
    )


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


@pytest.mark.skipif(landlock.abi() < 5, reason="Landlock mediates ioctl on devices from ABI 5 (Linux 6.10)")
def test_a_gpus_device_files_can_be_driven_by_ioctl_and_no_other_device_can(tmp_path):
    """CUDA and NVML drive the GPU by ioctl on its device files; with ABI 5 Landlock refuses ioctl on every device no
    rule grants it on (CUDA then fails with error 304 and a confined run trained on the CPU or not at all, as the H200
    showed). A device in ``Spec.devices`` takes ioctl; one only written (``/dev/null`` as every run has it) does not.
    /dev/null stands in for a GPU here: its ioctl answers ENOTTY when let through, EACCES when Landlock refuses it."""
    code = """
        import errno, fcntl, os, termios
        fd = os.open("/dev/null", os.O_RDWR)
        try:
            fcntl.ioctl(fd, termios.TIOCGWINSZ, bytes(8))
            print("ioctl ran")
        except OSError as err:
            print("ioctl", errno.errorcode[err.errno])
    """
    written = run_python(code, spec_for(tmp_path))
    assert "ioctl EACCES" in written.stdout, written.stdout + written.stderr[-2000:]
    spec = spec_for(tmp_path)
    spec.devices = ["/dev/null"]
    driven = run_python(code, spec)
    assert "ioctl ENOTTY" in driven.stdout, driven.stdout + driven.stderr[-2000:]


THREAD_NAMES = """
    import ctypes, errno, os, subprocess, sys, threading
    libc = ctypes.CDLL(None, use_errno=True)
    def name_another_thread():  # what CUDA's cuInit does: glibc writes /proc/self/task/<tid>/comm
        done = threading.Event()
        worker = threading.Thread(target=done.wait)
        worker.start()
        code = libc.pthread_setname_np(ctypes.c_ulong(worker.ident), b"cuda-like")
        name = open(f"/proc/self/task/{worker.native_id}/comm").read().strip() if code == 0 else ""
        done.set()
        worker.join()
        return errno.errorcode.get(code, "ok"), name
    print("named", *name_another_thread(), flush=True)
    if len(sys.argv) < 2:  # a process it starts (a distributed launch's rank) names its threads too
        print(subprocess.run([sys.executable, "-c", CODE, "child"], capture_output=True,
                             text=True).stdout.replace("named", "child named"), end="")
    for path in ("/proc/sys/vm/drop_caches", "/proc/sysrq-trigger"):
        try:
            os.close(os.open(path, os.O_WRONLY))  # opened, never written
            print("opened", path)
        except OSError as err:
            print("refused", path, errno.errorcode[err.errno])
"""


def test_a_confined_run_names_its_threads_and_cannot_touch_the_kernels_settings(tmp_path, tmp_path_factory):
    """cuInit names the threads it starts through /proc/<pid>/task/<tid>/comm and fails with error 304 where
    Landlock refuses it (seen on an H200). A confined process and one it starts (a rank) may; the kernel's settings
    and the SysRq trigger in the run's /proc stay read only, though it runs as root."""
    require(tmp_path_factory, "pid", "mount")
    code = "CODE = " + repr(textwrap.dedent(THREAD_NAMES)) + "\nexec(CODE)\n"
    result = run_python(code, spec_for(tmp_path))
    assert "named ok cuda-like" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "child named ok cuda-like" in result.stdout, result.stdout + result.stderr[-2000:]
    for path in ("/proc/sys/vm/drop_caches", "/proc/sysrq-trigger"):
        assert f"refused {path}" in result.stdout, result.stdout


def test_a_runs_spec_lets_it_drive_the_machines_gpu(monkeypatch):
    """Every NVIDIA device file there is (``nvidiaN`` found by listing /dev), ROCm's, and no other device."""
    listing = ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null", "sda", "nvidia-caps", "nvme0n1"]
    monkeypatch.setattr(rules, "_listdir", lambda path: listing if path == "/dev" else [])
    present = {f"/dev/{n}" for n in listing} | {"/dev/dri"}
    monkeypatch.setattr(rules.os.path, "lexists", lambda p: p in present)
    assert rules.gpu_devices() == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-caps", "/dev/dri",
                                   "/dev/nvidia0", "/dev/nvidia1"]


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
    outcome = [line.split()[0] for line in confined.stdout.splitlines() if line.startswith(("read", "refused"))]
    assert outcome == ["refused"] * 3, confined.stdout + confined.stderr[-2000:]
    free = run_python(code, None)
    assert [line.split()[0] for line in free.stdout.splitlines()] == ["read"] * 3, free.stdout
    # the child's environment: an allowlist (`sandbox.environment`), so no secret reaches it by any name
    assert environment.allowed({"HF_TOKEN": "x", "AWS_SECRET_ACCESS_KEY": "y", "MY_API_KEY": "z", "PATH": "p"}) == {
        "PATH": "p"}
    assert environment.allowed({"HF_TOKEN": "x", "AWS_PROFILE": "y", "PATH": "p", "CUDA_VISIBLE_DEVICES": "0"}) == {
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


def test_the_child_is_held_by_more_than_paths(tmp_path):
    """Class F: Landlock mediates paths, TCP and two scopes; the rest a confined run could reach is held by other
    layers. UDP and a UNIX socket by path to listeners outside (the network namespace, the view), the session keyring
    and System V shared memory (seccomp, the IPC namespace), the host's /dev/shm (a private one), text pushed into a
    terminal with TIOCSTI (seccomp: EPERM, where /dev/null answers ENOTTY) and, as root, a raw socket and any
    capability left (all dropped). Unconfined, the same code reaches each."""
    import socket
    import uuid

    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    listener = tmp_path / "agent.sock"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(listener))
    unix.listen(4)
    shm = Path("/dev/shm") / f"lit_memory_test_{uuid.uuid4().hex}"
    shm.write_text("the host's")
    code = f"""
        import ctypes, errno, fcntl, os, socket
        libc = ctypes.CDLL(None, use_errno=True)
        def attempt(name, fn):
            try:
                fn()
                print(name, "reached")
            except OSError as err:
                print(name, "refused", errno.errorcode.get(err.errno, err.errno))
        def udp():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(b"from the run", ("127.0.0.1", {udp.getsockname()[1]}))
        def unix():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect({str(listener)!r})
        def keyring():  # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, create)
            if libc.syscall(250, 0, -3, 1) < 0:
                raise OSError(ctypes.get_errno(), "keyctl")
        def sysv():
            if libc.shmget(0, 4096, 0o600) < 0:
                raise OSError(ctypes.get_errno(), "shmget")
        def host_shm():
            open({str(shm)!r}).read()
        def tiocsti():
            fcntl.ioctl(0, 0x5412, b"x")
        def raw():
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close()
        for name, fn in (("udp", udp), ("unix", unix), ("keyring", keyring), ("sysv", sysv), ("host_shm", host_shm),
                         ("tiocsti", tiocsti), ("raw", raw)):
            attempt(name, fn)
        caps = dict(line.split(":") for line in open("/proc/self/status") if line.startswith("Cap"))
        print("capabilities", "none" if not int(caps["CapEff"], 16) | int(caps["CapBnd"], 16) else "held")
    """
    try:
        confined = run_python(code, spec_for(tmp_path), stdin=subprocess.DEVNULL)
        with pytest.raises(socket.timeout):
            udp.recvfrom(64)  # nothing arrived from the confined run
        free = run_python(code, None, stdin=subprocess.DEVNULL)
        assert udp.recvfrom(64)[0] == b"from the run"
    finally:
        unix.close()
        shm.unlink()
    missing = missing_layers(confined)
    outcome = dict(line.split(" ", 1) for line in confined.stdout.splitlines() if not line.startswith("missing "))
    reached = dict(line.split(" ", 1) for line in free.stdout.splitlines())
    root = os.geteuid() == 0
    # udp: the socket itself is refused by seccomp; without seccomp the network namespace still keeps its packets
    # from the host (nothing arrived, above)
    expected = {  # what must be refused, by the layer that refuses it
        "udp": "seccomp", "unix": "mount", "keyring": "seccomp", "sysv": "seccomp", "host_shm": "mount",
        "tiocsti": "seccomp", "raw": "seccomp", "capabilities": "capabilities"}
    for name, layer in expected.items():
        if layer in missing:
            continue  # said in one line by the child; docs/sharing.md: what is then left open
        assert outcome[name].startswith(("refused", "none")), (name, outcome, confined.stderr[-2000:])
    assert outcome["tiocsti"] == "refused EPERM" or "seccomp" in missing
    assert reached["udp"] == "reached" and reached["unix"] == "reached" and reached["host_shm"] == "reached"
    assert reached["tiocsti"] == "refused ENOTTY"  # /dev/null is no terminal: only the filter says EPERM
    if root:
        assert reached["raw"] == "reached" and reached["capabilities"] == "held"
    unchecked = sorted(name for name, layer in expected.items() if layer in missing)
    if unchecked:
        pytest.skip(f"not checked here: {', '.join(unchecked)} (this kernel or container lacks {missing})")


# -- the watchdog: what the parent reads, and what is left when it ends --------------------------------------


def with_marker(marker: str) -> str:
    """Code that starts a process of the run in a session of its own (named by ``marker``), which sleeps on."""
    return f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", {marker!r}], start_new_session=True,
                         stdin=subprocess.DEVNULL)
    """


def alive(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                # an argument: not code naming it
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry))
            except OSError:
                continue
    return found


def watch_probe(tmp_path: Path, code: str, bounds: watchdog.Bounds, group=None) -> tuple[int, str]:
    """``code`` as a confined run's child under the watchdog: (exit status, its stderr and the watchdog's)."""
    import contextlib
    import io

    spec = spec_for(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != rules.ENV}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = watchdog.watch(probe_command(code), {**env, **ENV, "TMPDIR": spec.write[0]}, spec, bounds,
                              [str(tmp_path / "run")], group)
    return code, err.getvalue()


def test_the_watchdog_reads_its_status_from_a_pipe_within_a_bound(tmp_path):
    """Class E: the child's phases come over a pipe, not a file in a folder it writes (a status file replaced by a link
    to /dev/zero was read until memory ran out): megabytes without a newline, then a phase, and the preparation bound
    still ends the run with one line naming that phase. The disk walk follows no link the run makes."""
    code = """
        import os, time
        from lit_memory.sandbox import rules
        os.write(rules._status_fd, b"x" * (8 << 20) + b"\\n")  # a line of 8 MiB: read in bounded pieces, never whole
        rules.phase("preparing: stuck")
        run = json.loads(os.environ["LIT_MEMORY_SANDBOX"])["write"][0]
        os.symlink("/", os.path.join(run, "everything"))
        os.symlink("/dev/zero", os.path.join(run, "status"))
        time.sleep(60)
    """
    # 8 s: the probe's start (imports, the 8 MiB line) stays inside the bound on a loaded machine
    code_, err = watch_probe(tmp_path, code, watchdog.Bounds(rss=8 * 2**30, disk=2**30, prepare=8))
    assert code_ == 2, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: stopped: preparing: stuck took longer than 8 s"), err[-2000:]
    used, entries = watchdog.disk([str(tmp_path / "run")])
    assert entries == 2 and used < 100  # two links, counted as links


def test_nothing_of_the_run_outlives_it(tmp_path, tmp_path_factory):
    """Class E: a process of the run that started a session of its own is killed when the run ends (its process
    namespace, its cgroup), and a file it left in /dev/shm was in its private one."""
    import uuid

    require(tmp_path_factory, "pid", "mount")
    marker, name = f"lit_memory_marker_{uuid.uuid4().hex}", f"lit_memory_test_{uuid.uuid4().hex}"
    code = with_marker(marker) + f"""
        open("/dev/shm/{name}", "w").write("left behind")
    """
    result, err = watch_probe(tmp_path, code, watchdog.Bounds(rss=8 * 2**30, disk=2**30, prepare=60))
    assert result == 0, err[-2000:]
    try:
        assert not alive(marker), err[-2000:]
        assert not (Path("/dev/shm") / name).exists()
    finally:
        for pid in alive(marker):
            os.kill(pid, 9)
        (Path("/dev/shm") / name).unlink(missing_ok=True)


def test_the_run_ends_with_its_parent_however_the_parent_ends(tmp_path, tmp_path_factory):
    """Class E: the parent killed with SIGKILL (a time limit's second signal): the child's parent-death signal and its
    process namespace end every process of the run, one in a session of its own included (an orphaned child kept
    tokenising for 18 minutes)."""
    import signal
    import time
    import uuid

    require(tmp_path_factory, "pid")
    marker = f"lit_memory_marker_{uuid.uuid4().hex}"
    spec = spec_for(tmp_path)
    parent = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from lit_memory.sandbox import rules, watchdog
        spec = rules.Spec(**{rules.asdict(spec)!r})
        code = {(textwrap.dedent(with_marker(marker)) + "import time; time.sleep(300)" + chr(10))!r}
        command = [sys.executable, "-I", "-B", "-c", {PROBE!r} + __import__("textwrap").dedent(code)]
        watchdog.watch(command, dict(__import__("os").environ), spec, watchdog.Bounds(8 << 30, 1 << 30, 600), [])
    """)
    environ = {k: v for k, v in os.environ.items() if k != rules.ENV}
    log = tmp_path / "helper.log"
    with log.open("wb") as out:
        helper = subprocess.Popen([sys.executable, "-c", parent], env={**environ, **ENV}, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180  # a loaded 2-core machine: the child's interpreter and confinement first
        while not alive(marker) and time.monotonic() < deadline and helper.poll() is None:
            time.sleep(0.2)
        assert alive(marker), (f"the run's process never started (the parent: exit status {helper.poll()}): "
                               + log.read_text(errors="replace")[-3000:])
        helper.send_signal(signal.SIGKILL)
        helper.wait()
        deadline = time.monotonic() + 10
        while alive(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(marker)
    finally:
        helper.kill()
        for pid in alive(marker):
            os.kill(pid, 9)


def test_memory_outside_processes_is_bounded_by_the_kernel(tmp_path):
    """Class E: memfd pages (and tmpfs files) are no process's resident memory, which is all the watchdog sees: the
    run's cgroup counts them, the kernel stops the run at its bound, and the parent says so in one line."""
    from lit_memory.sandbox import cgroup

    group, why = cgroup.make(memory=96 * 2**20, pids=512)
    if group is None:
        pytest.skip(f"no cgroup here: {why}")
    code = """
        import os
        fd = os.memfd_create("payload")
        for _ in range(256):
            os.write(fd, b"m" * (1 << 20))
        print("wrote 256 MiB", flush=True)
    """
    spec = spec_for(tmp_path)
    try:
        import contextlib
        import io

        spec.cgroups = group.procs()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            result = watchdog.watch(probe_command(code), {**os.environ, **ENV}, spec,
                                    watchdog.Bounds(rss=8 * 2**30, disk=2**30, prepare=60, why_rss="the test's"),
                                    [str(tmp_path / "run")], group)
    finally:
        group.remove()
    assert result == 2, err.getvalue()[-2000:]
    assert (
        err.getvalue().strip().splitlines()[-1].startswith("error: stopped: the run's processes and their memory files")
    )


def test_the_runs_output_reaches_the_terminal_without_control_sequences():
    """The child's output is relayed, never its own terminal: escape sequences (a terminal's title, its clipboard,
    a query whose answer the terminal types) are removed, text and newlines kept."""
    import io

    read, write = os.pipe()
    os.write(write, "step 1\x1b]52;c;ZWNobyBwd25lZA==\x07 done\x1b[2J\r\n\x9b6n ok\n".encode())
    os.close(write)
    out = io.StringIO()
    watchdog._relay(read, out)
    assert out.getvalue() == "step 1]52;c;ZWNobyBwd25lZA== done[2J\r\n6n ok\n"


# -- what a sent folder may hold ------------------------------------------------------------------------------


def model_folder(path: Path) -> Path:
    shutil.copytree(REPO / "lit_memory" / "assets" / "bert-large-uncased", path)
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    (path / "config.json").write_text(json.dumps(config))
    return path


def lit_memory_command(
    tmp_path: Path, *args: str, env: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    environ = {**os.environ, **ENV, **(env or {})}
    environ.pop(rules.ENV, None)
    return subprocess.run([sys.executable, "-m", "lit_memory", *args], cwd=tmp_path, env=environ, capture_output=True,
                          text=True, timeout=timeout)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def sent_recipe(folder: Path, text: str = "") -> Path:
    """A recipe as someone would send it, nobody trusted (so it runs confined): ``text``, or by default a shipped
    recipe with a line added."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sent.yaml"
    path.write_text("# sent by someone\n" + (textwrap.dedent(text) if text else (RECIPES / "fused.yaml").read_text()))
    return path


def test_a_fifo_an_index_names_is_refused_before_the_run_reads_it(tmp_path):
    """A sharded model's index naming a FIFO one folder down: safetensors' reader would block on it forever. Every
    file an index names must be a regular file beneath the folder (`stage.check`), said in one line."""
    folder = model_folder(tmp_path / "model")
    (folder / "shards").mkdir()
    os.mkfifo(folder / "shards" / "model-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "shards/model-00001.safetensors"}})
    )
    with pytest.raises(Exception, match=r"model-00001.safetensors is not a regular file"):
        stage.check(folder, "model")
    sent = sent_recipe(tmp_path, f"model:\n  model_name_or_path: {folder}\n")
    result = lit_memory_command(tmp_path, "fit", "--config", str(sent), "--trainer.max_steps=1", timeout=120)
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stderr[-3000:]
    assert "shards/model-00001.safetensors is not a regular file" in error_lines(result)[0]


def test_a_backtracking_tokenizer_is_stopped_by_the_preparation_limit(tmp_path):
    """A tokenizer whose Split pattern backtracks catastrophically (about a tenth of a second per word here, minutes
    per row): the watchdog ends the run when preparing takes longer than its bound, with one line naming the phase."""
    folder = model_folder(tmp_path / "model")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {
        "type": "Split",
        "pattern": {"Regex": "(\\w+\\s?)+$"},
        "behavior": "Isolated",
        "invert": False,
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    # its tokenizer.json, not a BERT rebuilt from vocab.txt
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    data = write_csv(tmp_path / "data.csv", [{"text": ("a" * 21 + "! ") * 80, "label": i % 2} for i in range(40)])
    sent = sent_recipe(
        tmp_path, f"model:\n  model_name_or_path: {folder}\n  pretrained: false\ndata:\n  source: {data}\n"
    )
    result = lit_memory_command(tmp_path, "fit", "--config", str(sent), "--trainer.max_steps=1",
                                env={launch.LIMIT_VARIABLES["prepare"]: "15"}, timeout=400)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_lines(result)[-1].startswith("error: stopped: preparing: tokenising took longer than 15 s"), (
        result.stderr[-2000:]
    )


def test_memory_growth_is_stopped_by_the_watchdog(tmp_path):
    """The run's processes together held past their bound (here set low by the user's environment): stopped, one
    line."""
    result = lit_memory_command(
        tmp_path,
        "fit",
        "--config",
        str(sent_recipe(tmp_path)),
        "--trainer.max_steps=2",
        "--data.limit_train_samples=16",
        env={launch.LIMIT_VARIABLES["rss"]: str(200 * 2**20)},
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_lines(result)[-1].startswith("error: stopped: the run's processes held"), result.stderr[-2000:]
    assert f"set by {launch.LIMIT_VARIABLES['rss']}" in error_lines(result)[-1]


# -- a sent folder as the working folder: nothing in it runs, no link in it is followed (classes A, B) ---------


def hostile_folder(path: Path) -> Path:
    """A folder as someone would send it: modules named like the ones Python and lit_memory import, each leaving a
    marker if imported anywhere, and ``lightning_logs`` linked to a folder a shell sources."""
    path.mkdir()
    for name in ("json", "lit_memory", "torch", "typing_extensions"):
        (path / f"{name}.py").write_text(f"open({str(path / ('RAN-' + name))!r}, 'w').write('imported')\n")
    (path / "recipe.yaml").write_text("trainer:\n  max_steps: 1\n")
    sourced = path.parent / "home" / ".bashrc.d"
    sourced.mkdir(parents=True)
    (path / "lightning_logs").symlink_to(sourced)
    return path


def markers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("RAN-*"))


def test_a_sent_folder_runs_nothing_and_its_links_are_not_followed(tmp_path):
    """Classes A and B, as a user runs a stranger's folder (the documented-safe ``python -P -m lit_memory``): while
    parsing, jsonargparse's typeshed_client would start ``python -c`` there with the folder first on its path (its
    json.py ran); the default run folder, ``lightning_logs``, nobody chose, links to a folder a shell sources. No
    marker, one error line naming the link, nothing written through it."""
    folder = hostile_folder(tmp_path / "sent")
    environ = {**os.environ, **ENV}
    environ.pop(rules.ENV, None)
    result = subprocess.run([sys.executable, "-P", "-m", "lit_memory", "fit", "--config", "recipe.yaml"], cwd=folder,
                            env=environ, capture_output=True, text=True, timeout=300)
    assert markers(folder) == [], result.stderr[-3000:]
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stderr[-3000:]
    line = error_lines(result)[0]
    assert "lightning_logs is a link to" in line and "trainer.default_root_dir" in line, line
    assert list((tmp_path / "home" / ".bashrc.d").iterdir()) == []


def test_no_python_started_for_a_run_imports_from_the_working_folder(tmp_path, monkeypatch):
    """Class A at its two seams: jsonargparse's stubs resolver is made with this process's path (no ``python -c``
    at all: `cli.stubs_without_a_subprocess`, on private names of jsonargparse checked here), and any Python started
    while a command runs gets PYTHONSAFEPATH (`environment.safe_path`, held by `__main__.main`). typeshed_client's own
    lookup in the sent folder shows what each prevents: without them its json.py runs."""
    import typeshed_client
    from jsonargparse import _stubs_resolver as stubs

    from lit_memory import cli
    from lit_memory.__main__ import TOOLS, main
    from lit_memory.run import environment

    folder = hostile_folder(tmp_path / "sent")
    monkeypatch.chdir(folder)
    monkeypatch.delenv(environment.SAFE_PATH, raising=False)
    monkeypatch.setattr(stubs, "stubs_resolver", None)
    cli.stubs_without_a_subprocess()
    assert isinstance(stubs.get_stubs_resolver(), stubs.StubsResolver) and markers(folder) == []
    with environment.safe_path():
        typeshed_client.get_search_context()
    assert markers(folder) == []
    seen = {}
    # programs by name from the folder
    monkeypatch.setenv("PATH", os.pathsep.join(["", ".", "bin", os.environ["PATH"]]))
    monkeypatch.setitem(TOOLS, "plan", lambda argv: seen.update(safe=os.environ.get(environment.SAFE_PATH),
                                                               path=os.environ["PATH"]))
    main(["plan"])
    assert seen["safe"] == "1" and all(os.path.isabs(p) for p in seen["path"].split(os.pathsep))
    assert environment.SAFE_PATH not in os.environ and os.environ["PATH"].startswith(os.pathsep + ".")
    with pytest.raises(subprocess.CalledProcessError):  # neither: the folder's json.py runs in the Python it starts
        typeshed_client.get_search_context()
    assert markers(folder) == ["RAN-json"]


def test_the_child_imports_nothing_from_the_working_folder(tmp_path):
    """Class A: the confined child is an isolated Python whose path is the parent's (`child.command`): a
    ``lit_memory.py``, ``json.py`` or ``torch.py`` beside the recipe is never imported, before confinement or after
    (the child was ``python -m lit_memory`` in the working folder, and confined itself inside the package it found
    there)."""
    folder = hostile_folder(tmp_path / "sent")
    spec = spec_for(tmp_path)
    import contextlib
    import io

    err, out = io.StringIO(), io.StringIO()
    environ = {k: v for k, v in os.environ.items() if k != rules.ENV}
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = watchdog.watch(child.command(["--help"]), {**environ, **ENV, "TMPDIR": spec.write[0],
                                                          "TORCHINDUCTOR_CACHE_DIR": spec.write[0]}, spec,
                              watchdog.Bounds(8 * 2**30, 2**30, 300), [], cwd=str(folder))
    assert markers(folder) == [], err.getvalue()[-3000:]
    assert code == 0 and "usage: python -m lit_memory COMMAND" in out.getvalue(), err.getvalue()[-3000:]
    assert "-I" in child.command([])


def test_a_run_folder_is_made_beneath_the_working_folder_without_following_a_link(tmp_path):
    """Class B, each way a root is named: a link anywhere on the way (the default root too) or a '..' is one line
    and nothing is made; a logger's name or version from a recipe is one path component; a new root is made."""
    from lit_memory.sandbox import roots

    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (work / "runs" / "linked").symlink_to(outside)
    (work / "lightning_logs").symlink_to(outside)
    for path in ("lightning_logs", "runs/linked/deeper", str(work / "runs" / "linked")):
        with pytest.raises(Exception, match=r"is a link to .*outside"):
            roots.make(path, str(work), "trainer.default_root_dir")
    with pytest.raises(Exception, match=r"without '\.\.'"):
        roots.make("runs/../../outside", str(work), "trainer.default_root_dir")
    assert list(outside.iterdir()) == []
    made = roots.Made()
    assert roots.make("runs/new/deeper", str(work), "x", made) == str(work / "runs" / "new" / "deeper")
    assert made.folders == [str(work / "runs" / "new"), str(work / "runs" / "new" / "deeper")]
    for key, value in (
        ("trainer.logger.init_args.name", "../lightning_logs"),
        ("trainer.logger.init_args.version", "a/b"),
        ("trainer.callbacks.0.init_args.filename", "../../x"),
    ):
        with pytest.raises(Exception, match=r"refusing trainer\.(logger|callbacks)"):
            roots.check_components([(key, value)])
    roots.check_components([("trainer.logger.init_args.name", "my_run"), ("trainer.logger.init_args.version", 3)])


def test_a_confined_predict_writes_its_file_beside_the_model_or_where_the_user_typed(tmp_path, capsys, monkeypatch):
    """predict's file is a write root of the confined run: beside the checkpoint the user typed (its run folder), or
    the folder of an ``--output`` they typed, also outside the working folder and when the file is there already
    (a second call). An output a recipe chooses outside the working folder is one line, nothing started."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    run = work / "lightning_logs" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    elsewhere.mkdir()
    torch.save({"state_dict": {}}, run / "checkpoints" / "last.ckpt")
    (work / "texts.csv").write_text("text\nhello\n")
    (elsewhere / "mine.csv").write_text("an earlier call's\n")
    seen = {}
    monkeypatch.setattr(watchdog, "watch", lambda command, env, spec, *a, **k: seen.update(write=spec.write) or 0)
    (work / "sent.yaml").write_text("seed_everything: 42\n")  # a recipe nobody trusted: the run is confined
    typed = ["predict", "--config", "sent.yaml", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"),
             "--data.predict_path", "texts.csv"]
    code, err = in_process(typed, capsys, monkeypatch, work)
    assert code == 0 and str(run) in seen["write"], err
    code, err = in_process([*typed, "--output", str(elsewhere / "mine.csv")], capsys, monkeypatch, work)
    assert code == 0 and str(elsewhere) in seen["write"] and str(run) not in seen["write"], err
    (work / "recipe.yaml").write_text(f"output: {elsewhere / 'theirs.csv'}\n")
    seen.clear()
    code, err = in_process([*typed, "--config", "recipe.yaml"], capsys, monkeypatch, work)
    assert code == 2 and not seen, err
    assert err.strip().splitlines()[-1].startswith(f"error: refusing output={elsewhere}: a run folder a recipe chooses")


# -- what a run reads: the recipe's files, and what the parent fetches for it (classes C, D) ----------------


def in_process(args: list[str], capsys, monkeypatch, cwd: Path) -> tuple[int, str]:
    """``python -m lit_memory ARGS`` in this process (refused before any child starts): (exit status, stderr)."""
    from lit_memory.__main__ import main

    monkeypatch.delenv(rules.ENV, raising=False)
    monkeypatch.chdir(cwd)
    try:
        main(args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def test_a_recipe_reads_only_files_beneath_its_folder_unless_typed(tmp_path, capsys, monkeypatch):
    """Class C: a file is judged by whose it is, not by its type. The texts to predict a recipe names outside its
    folder and the working folder (the user's cloud credentials, whose refresh token would go into predictions.csv),
    and a config it nests from there: one line each, nothing started. Typed on the command line, the same file is the
    user's and read."""
    home = tmp_path / "home" / ".config" / "gcloud"
    home.mkdir(parents=True)
    secret = home / "application_default_credentials.json"
    secret.write_text(json.dumps({"text": "x", "refresh_token": "1//secret"}) + "\n")
    sent = tmp_path / "sent"
    sent.mkdir()
    (sent / "recipe.yaml").write_text(f"data:\n  predict_path: {secret}\n  text_column: refresh_token\n")
    code, err = in_process(["predict", "--config", str(sent / "recipe.yaml")], capsys, monkeypatch, sent)
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: refusing data.predict_path={secret}"), err
    assert "beneath the recipe's folder or the working folder" in err
    (home / "data.yaml").write_text("batch_size: 4\n")
    (sent / "nested.yaml").write_text(f"data: {home / 'data.yaml'}\n")
    code, err = in_process(["fit", "--config", str(sent / "nested.yaml")], capsys, monkeypatch, sent)
    assert code == 2 and f"refusing to read the config {home / 'data.yaml'}" in err.strip().splitlines()[-1], err
    seen = {}
    monkeypatch.setattr(watchdog, "watch", lambda command, env, spec, *a, **k: seen.update(read=spec.read) or 0)
    code, err = in_process(["predict", "--config", str(sent / "recipe.yaml"), f"--data.predict_path={secret}"],
                           capsys, monkeypatch, sent)
    assert code == 0 and str(secret) in seen["read"], err


def test_the_hub_fetch_for_a_recipe_is_sized_first_and_sends_no_token(tmp_path, capsys, monkeypatch):
    """Class D: a repository a recipe names is listed from the Hub's metadata (`hub.listing`, faked here: no network),
    without the user's token, and refused in one line when it is larger than the run's disk budget: nothing fetched.
    A repository the user typed is listed and fetched with their token, into the run's private folder."""
    from lit_memory.confine import hub

    listed = []

    def listing(fetch):
        listed.append((fetch.name, fetch.token))
        mib = 166 if fetch.name == "org/big" else 1
        return [SimpleNamespace(filename="model.safetensors", file_size=mib * 2**20, is_cached=False)]

    import transformers.utils.hub as transformers_hub

    fetched, loads = [], []

    def hub_download(repo, filename, **kwargs):  # what the parent's own estimate would download from the Hub
        loads.append((repo, kwargs.get("token"), kwargs.get("local_files_only")))
        raise OSError("not in the cache")

    monkeypatch.setattr(transformers_hub, "hf_hub_download", hub_download)
    monkeypatch.setattr(hub, "listing", listing)
    run_fetch = hub.run_fetch
    monkeypatch.setattr(hub, "run_fetch", lambda one, private, env, *a: fetched.append((one.name, env)))
    monkeypatch.setattr(watchdog, "watch", lambda *a, **k: 0)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_the_users")
    monkeypatch.setenv(launch.LIMIT_VARIABLES["disk"], str(32 * 2**20))
    (tmp_path / "recipe.yaml").write_text("model:\n  model_name_or_path: org/big\n")
    code, err = in_process(["fit", "--config", "recipe.yaml"], capsys, monkeypatch, tmp_path)
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "error: refusing model.model_name_or_path=org/big: its files on the Hugging Face Hub are 166.0 MiB"
    ), err
    assert "over the run's disk budget of 32.0 MiB" in err and listed == [("org/big", False)] and fetched == []
    assert loads and all(load == ("org/big", False, True) for load in loads)  # no token, from the cache or nothing
    code, err = in_process(["fit", "--config", "recipe.yaml", "--model.model_name_or_path=org/small"], capsys,
                           monkeypatch, tmp_path)
    assert code == 0, err
    [(name, env)] = fetched
    assert name == "org/small" and env["HF_TOKEN"] == "hf_the_users" and "lit_memory-run-" in env["HF_HUB_CACHE"]
    recipe_env = hub.environment({"HF_TOKEN": "hf_the_users", "PATH": "/bin"}, tmp_path, typed=False)
    assert "HF_TOKEN" not in recipe_env and recipe_env["HF_TOKEN_PATH"] == str(tmp_path / "no-token")
    assert recipe_env["HF_HUB_CACHE"] == str(tmp_path / "hub")  # the run's private folder, never the user's cache
    offline = {**recipe_env, "HF_HUB_OFFLINE": "1", **ENV}  # the fetch process itself: isolated, one line when it fails
    with pytest.raises(Exception, match=r"cannot fetch model.model_name_or_path=org/absent from the Hugging Face Hub "
                                        r"for the run: \w+Error"):
        run_fetch(hub.Fetch("model.model_name_or_path", "org/absent", "model", False), tmp_path, offline, 2**30, 60)


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
    assert (
        "refusing trainer.default_root_dir=" in error_lines(result)[0]
        and "a run folder a recipe chooses" in error_lines(result)[0]
    )
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
    assert (
        "refusing trainer.callbacks.0.init_args.filename=" in error_lines(result)[0]
        and "not a plain {metric}" in error_lines(result)[0]
    )
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
    assert (
        "trainer.profiler.dict_kwargs" in error_lines(result)[0]
        and "free-form keyword arguments" in error_lines(result)[0]
    )


# -- the same run, confined or not ----------------------------------------------------------------------------


@pytest.mark.fit
def test_an_untrusted_run_trains_the_same_weights_as_a_trusted_one(tmp_path):
    """The confined child trains exactly what the same command trains in-process with --trust-recipe."""
    from safetensors.torch import load_file

    data = write_csv(tmp_path / "reviews.csv", rows(40))
    args = ["fit", "--config", str(sent_recipe(tmp_path / "sent")), f"--data.source={data}", "--data.batch_size=4",
            "--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false"]
    weights = {}
    for name, more in (("untrusted", []), ("trusted", ["--trust-recipe"])):
        result = lit_memory_command(tmp_path, *args, f"--trainer.default_root_dir={tmp_path / name}", *more)
        assert result.returncode == 0, result.stderr[-3000:]
        weights[name] = load_file(next((tmp_path / name).rglob("model.safetensors")))
    assert weights["untrusted"].keys() == weights["trusted"].keys()
    assert all((weights["untrusted"][k] == weights["trusted"][k]).all() for k in weights["trusted"])


def test_only_an_untrusted_training_or_evaluation_runs_confined(monkeypatch, tmp_path):
    """A config nobody trusted is confined; a shipped recipe, only typed values, --trust-recipe and the tools are not
    (`lit_memory.config.trusted`)."""
    from lit_memory.__main__ import confined

    sent = str(sent_recipe(tmp_path))
    monkeypatch.delenv(rules.ENV, raising=False)
    assert confined(["fit", "--config", sent]) and confined(
        ["predict", "--config", sent, "--data.predict_path", "x.csv"]
    )
    assert not confined(["fit", "--config", sent, "--trust-recipe"]) and not confined(["estimate", "--config", sent])
    assert not confined(["fit", "--recipe", "4gb"]) and not confined(["fit", "--data.source", "x.csv"])
    monkeypatch.setenv(rules.ENV, "{}")  # the child itself: it runs the command
    assert not confined(["fit", "--config", sent])


def test_without_landlock_an_untrusted_run_stops_with_one_line(tmp_path, monkeypatch, capsys):
    from lit_memory.__main__ import main

    monkeypatch.delenv(rules.ENV, raising=False)
    monkeypatch.setattr(landlock, "abi", lambda: 0)
    sent = sent_recipe(tmp_path / "sent")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(sent), "--trainer.max_steps=1"])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: an untrusted run is confined by the kernel (Landlock") and "--trust-recipe" in line
    assert [p.name for p in tmp_path.iterdir()] == ["sent"]
