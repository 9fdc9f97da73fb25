"""The confined process's side: the child confines itself (`confine`) before anything of the run is imported.

The parent starts ``python -I -B -c BOOT ARGS`` (`command`): isolated mode puts neither the working folder nor the
user's site folder on ``sys.path`` and reads no ``PYTHON*`` variable, and BOOT sets ``sys.path`` to the parent's own
(`lit_memory.sandbox.rules.child_path`), so nothing in the folder someone sent is imported, not even before
confinement (a ``lit_memory.py`` or ``json.py`` beside the recipe). Then, in this order, each layer where the kernel
has it (each missing one said in one line, `MISSING`; one the kernel has and that cannot be built stops the run):

1. its life tied to the parent's (``PR_SET_PDEATHSIG``: killed when the parent ends, however it ends), and into the
   run's cgroup (`lit_memory.sandbox.cgroup`), so everything it starts is bounded and killed with it;
2. namespaces of its own (`lit_memory.sandbox.namespaces`): IPC, network (loopback only, brought up, whatever the
   recipe asks: a launch over several nodes is refused before, `lit_memory.confine.launchers`), mount, and
   process ids: it forks the namespace's first process, which runs the run; when that one ends the kernel kills every
   process left in the namespace, and it dies with the forking process (killed with the parent);
3. the view: only the run's roots, devices, a fresh ``/proc``, a private ``/dev/shm`` and a private ``/tmp`` visible;
4. resource limits and Landlock (`lit_memory.sandbox.rules.enter`): the one layer without which it does not run;
5. every capability dropped (`lit_memory.sandbox.privileges`), then the seccomp filter
   (`lit_memory.sandbox.seccomp`);
6. its phases go to the parent over the inherited pipe (`lit_memory.sandbox.rules.phase`), and the run starts
   (``python -m lit_memory ARGS`` in this process).

Its standard input is ``/dev/null`` and its output pipes the parent relays (`lit_memory.sandbox.watchdog`): it has
no terminal to write into.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
from dataclasses import dataclass, field
from typing import Optional

from lit_memory.sandbox import cgroup, namespaces, privileges, seccomp
from lit_memory.sandbox.rules import ENV, Spec, enter, set_status

PR_SET_PDEATHSIG = 1
BOOT = ("import json, os, sys; sys.path[:] = json.loads(os.environ[{env!r}])['path']; "
        "from lit_memory.sandbox.child import main; main(sys.argv[1:])")
# What is left open where a layer is missing (docs/sharing.md, "Per platform").
MISSING = {
    "cgroup": "memory outside processes (tmpfs, memfd) is not bounded and processes that left the run's session are "
              "killed only with its process namespace",
    "pid": "a process of the run that started a session of its own can outlive it",
    "network": "IPv4 and IPv6 sockets are refused by the seccomp filter alone, and a run of several processes does "
               "not start",
    "ipc": "System V IPC objects of other processes are refused by the seccomp filter alone",
    "mount": "UNIX sockets by path, other users' files and the host's /dev/shm stay reachable to what Landlock "
             "does not mediate",
    "capabilities": "the run keeps the capabilities of the user it runs as",
    "seccomp": "keyrings, System V IPC, raw and other sockets, TIOCSTI and new namespaces are not refused",
}


@dataclass
class Held:
    """The layers that hold in this process, and the missing ones with the reason."""

    layers: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)

    def line(self, layer: str) -> str:
        return (f"warning: sandbox: no {layer} layer here ({self.missing[layer]}): {MISSING.get(layer, '')} "
                "(docs/sharing.md, Per platform)")


def command(args: list[str]) -> list[str]:
    """The child's command line: isolated Python, no bytecode written, BOOT, then the run's arguments."""
    return [sys.executable, "-I", "-B", "-c", BOOT.format(env=ENV), *args]


def _die_with_parent(parent: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent and os.getppid() != parent:  # it ended before the line above: nobody would kill this process
        os._exit(1)


def _fork_init() -> None:
    """Fork the process namespace's first process and return in it; this process waits for it and ends as it did.
    Killed (the parent gone: SIGKILL), this process takes the namespace's first process with it, and the kernel the
    rest of the namespace."""
    alive_r, alive_w = os.pipe()  # closed when this process ends: the first process checks it once
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if select.select([alive_r], [], [], 0)[0]:  # end of file: the forking process died before the line above
            os._exit(1)
        os.close(alive_r)
        return
    os.close(alive_r)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C reaches the run itself (one process group)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


class Refused(RuntimeError):
    """A layer this kernel offers could not be built: the run does not start (fail closed)."""


def confine(spec: Optional[Spec] = None) -> Held:
    """Confine this process (single-threaded, nothing of the run imported yet) as ``spec`` (default: the
    environment's) says; returns in the confined process only. A layer the kernel (or its container) does not offer
    is one `Held.line`; one it offers and that cannot be built raises (`Refused`, OSError): never a run with a layer
    quietly left out, whatever its inputs (a path too long for the view turned the view off, and the run went on)."""
    spec = spec or Spec.from_env(os.environ[ENV])
    held = Held()
    _die_with_parent(spec.parent)
    if spec.cgroups:
        if why := cgroup.join(spec.cgroups):  # the parent made the group: the kernel offers it
            raise Refused(why)
    else:
        held.missing["cgroup"] = spec.no_cgroup or "none was made"
    missing = namespaces.enter()  # always its own network: no setting of a run keeps the host's
    held.missing.update(missing)
    if spec.inet and "network" in missing:  # a distributed launch's TCP would reach the host's network
        raise Refused(f"a launch of several processes meets over TCP, which only a network namespace of its own keeps "
                      f"to the run, and this kernel or container offers none ({missing['network']})")
    if "pid" not in missing:
        _fork_init()
    own_proc, tmp = False, 0
    if "mount" not in missing:
        if not spec.view:
            raise Refused("no folder for the view of the file system")
        devices = [p for p in spec.read + spec.write + spec.devices if p.startswith("/dev/")]
        tmp = spec.shm if spec.tmp and namespaces.tmp_allowed(spec.read, spec.write) else 0
        own_proc = namespaces.build_view(spec.view, [*spec.read, *spec.write], devices, spec.shm, os.getcwd(),
                                         writes=spec.write, tmp_bytes=tmp)
    if "network" not in missing and (why := namespaces.loopback_up()):
        raise Refused(why)
    # Resource limits, then Landlock (its own /tmp written; sockets and FIFOs made in TMPDIR): raises where refused.
    enter(spec, _thread_names(own_proc), sockets=[spec.tmp] if spec.tmp else [], writes=[namespaces.TMP] if tmp else [])
    if why := privileges.drop():
        raise Refused(why)
    if why := seccomp.unavailable():
        held.missing["seccomp"] = why
    else:
        seccomp.install(spec.inet)  # the kernel has seccomp: a filter it refuses stops the run
    held.missing = {k: v for k, v in held.missing.items() if v}
    held.layers = [name for name in ("cgroup", *namespaces.NAMESPACES, "capabilities", "seccomp")
                   if name not in held.missing]
    if "mount" in held.missing:
        _refuse_unix_sockets_outside(spec.write)
    set_status(spec.status_fd)
    return held


_PINNED: list[int] = []  # descriptors held open for the life of the process (`_thread_names`)


def _thread_names(own_proc: bool) -> list[str]:
    """Where the run may name its threads (CUDA's cuInit does, in ``/proc/<pid>/task/<tid>/comm``, and fails with
    error 304 where it cannot). In a ``/proc`` of its own (its process namespace, the machine's settings read only:
    `namespaces.View.proc`) every process of the run may, the ranks of a distributed launch too. Else only this
    process, beneath its own ``task`` folder: a Landlock rule holds an inode, and procfs makes a new one when a
    dentry is dropped, so a descriptor keeps that folder's dentry for the life of the process."""
    if own_proc:
        return ["/proc"]
    task = os.path.join(os.path.realpath("/proc/self"), "task")  # (the pid /proc knows it by, in any namespace)
    with contextlib.suppress(OSError):
        _PINNED.append(os.open(task, os.O_PATH | os.O_CLOEXEC))
    return [task]


def _refuse_unix_sockets_outside(roots: list[str]) -> None:
    """Without the view, a UNIX socket by path (a container engine's) is reachable, and Landlock does not mediate
    connecting to one: refused here from Python at least (an audit hook), outside the run's own folders."""
    import socket

    real = tuple(os.path.realpath(w) for w in roots)

    def hook(event: str, args: tuple) -> None:
        if event != "socket.connect":
            return
        sock, address = args[0], args[1]
        if getattr(sock, "family", None) != socket.AF_UNIX or not isinstance(address, (str, bytes)):
            return
        path = os.fsdecode(address)
        if not path or path.startswith("\0"):
            return  # abstract sockets: Landlock's scope (ABI 6) keeps them to this run's processes
        where = os.path.realpath(path)
        if not any(where == r or where.startswith(r.rstrip("/") + "/") for r in real):
            raise PermissionError(f"refused by the sandbox: connecting to the UNIX socket {path}")

    sys.addaudithook(hook)


def main(argv: list[str]) -> None:
    """Confine this process, say which layers are missing, and run ``python -m lit_memory ARGV`` in it."""
    import runpy

    try:
        held = confine()
    except (OSError, RuntimeError) as err:  # a layer this kernel offers could not be built: never run on
        print(f"error: the sandbox could not confine the run ({err}); pass --trust-recipe only if you trust the "
              "recipe's source", file=sys.stderr)
        sys.exit(2)
    for layer in held.missing:
        print(held.line(layer), file=sys.stderr)
    sys.argv = ["lit_memory", *argv]
    runpy.run_module("lit_memory", run_name="__main__", alter_sys=True)
