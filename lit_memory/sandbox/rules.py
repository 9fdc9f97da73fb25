"""What a confined run may read, write and reach, and the values a sent recipe may not choose.

`Spec` is the confinement one run gets: read roots (the Python installation and its packages, system libraries
and the few files in ``/etc`` they read, ``/proc``, ``/sys`` and the GPU's device files, the caches, the recipe's
checked inputs), write roots (the run's folders, its private temporary folder and caches), TCP ports (none but a
distributed launch's own), bounds (memory, processes, file size, disk, preparation time), the child's ``sys.path``
(`child_path`) and its status pipe (`phase`). The parent makes it (`lit_memory.confine.launch`); the child applies
it to itself (`lit_memory.sandbox.child`; `enter`: limits and Landlock), before anything of the run is imported. The
child's environment holds no secret (`scrubbed`).

The value rules that judge what the kernel cannot (a run folder a recipe chooses, templates, free-form keyword
dictionaries, a file a recipe names outside its folder and the working folder) are the policy's (`lit_memory.policy`:
`writes`, `templates`, `reads`); their names here are the policy's own.
"""

from __future__ import annotations

import json
import os
import re
import resource
import site
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from lit_memory.errors import UserError  # noqa: F401
from lit_memory.policy.reads import READ_KEYS, check_input  # noqa: F401  (the policy's; callers name them here)
from lit_memory.policy.templates import (  # noqa: F401
    FREE_KWARGS,
    TEMPLATE_FIELD,
    TEMPLATE_KEYS,
    TEMPLATE_SPEC,
    check_free_kwargs,
    check_template,
    check_templates,
    leaves,
)
from lit_memory.policy.writes import (  # noqa: F401
    IN_RUN,
    ROOT_KEYS,
    WRITE_PATH,
    check_roots,
    check_write_paths,
    owned_folders,
)
from lit_memory.sandbox.landlock import Ruleset

ENV = "LIT_MEMORY_SANDBOX"  # the child's Spec, as JSON
GiB = 2**30
HINT = "pass --trust-recipe only if you trust its source"
# Files of /etc the runtime reads: the dynamic linker's cache, users and groups (getpass), time zone, name service.
ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
       "/etc/localtime", "/etc/timezone", "/etc/os-release", "/etc/mime.types", "/etc/hosts", "/etc/host.conf",
       "/etc/gai.conf", "/etc/ssl", "/etc/pki", "/etc/alternatives", "/etc/fonts", "/etc/matplotlibrc")
SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/opt", "/sys", "/usr/local/cuda")
# Of /proc, what the runtime reads: the machine's files and the confined process's own folder. Not /proc as a
# whole: another process's environ (the shell that started the run holds its tokens) would be readable there.
# (A run with a /proc of its own, where only its processes are, gets it whole: `child._thread_names`.)
PROC = ("/proc/self", "/proc/thread-self", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/loadavg",
        "/proc/uptime", "/proc/version", "/proc/filesystems", "/proc/sys", "/proc/driver", "/proc/pressure")
DEVICES_READ = ("/dev/null", "/dev/urandom", "/dev/random")
DEVICES_WRITE = ("/dev/null", "/dev/zero", "/dev/full", "/dev/shm")
# The GPU's device files, read, written and driven by ioctl (`landlock.Ruleset.devices`): NVIDIA's (nvidia0.. are
# added as found), AMD ROCm's (kfd, and dri's render nodes).
GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset", "/dev/nvidia-caps",
               "/dev/kfd", "/dev/dri")


SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|(^|_)KEY($|_)|APIKEY|PRIVATE)", re.IGNORECASE)
SECRET_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "GCP_", "GITHUB_", "GH_", "OPENAI_", "ANTHROPIC_", "WANDB_", "COMET_",
                   "NEPTUNE_", "MLFLOW_", "DATABRICKS_", "SSH_", "GPG_", "KRB5", "DOCKER_", "KUBE")
SECRET_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "NETRC", "HF_TOKEN_PATH")


def scrubbed(environ: dict[str, str]) -> dict[str, str]:
    """The environment without anything that looks like a secret (tokens, keys, cloud credentials, agents)."""
    return {k: v for k, v in environ.items()
            if k not in SECRET_NAMES and not k.startswith(SECRET_PREFIXES) and not SECRET.search(k)}


@dataclass
class Spec:
    """One confined run: what it may read and write, the ports it may use, its bounds, and how the child is set up
    (`lit_memory.sandbox.child`)."""

    read: list[str] = field(default_factory=list)
    write: list[str] = field(default_factory=list)
    connect: list[list[int]] = field(default_factory=list)  # port ranges [first, last], both included
    bind: list[list[int]] = field(default_factory=list)
    nproc: int = 0  # RLIMIT_NPROC (0: not set; the cgroup's pids bound holds instead)
    fsize: int = 0  # RLIMIT_FSIZE, bytes (0: not set)
    path: list[str] = field(default_factory=list)  # the child's sys.path: the parent's, without the working folder
    parent: int = 0  # the parent's pid: the child ends if it is gone before it could tie its life to it
    status_fd: int = -1  # the pipe the child writes its phases into (`phase`), inherited; never a path
    cgroups: list[str] = field(default_factory=list)  # the run's cgroup.procs files (`lit_memory.sandbox.cgroup`)
    no_cgroup: str = ""  # why there is none
    inet: bool = False  # IPv4/IPv6 sockets (a distributed launch's ranks), in its own loopback-only network namespace
    shm: int = 0  # bytes of the private /dev/shm
    view: str = ""  # an empty folder the view of the file system is built on (`lit_memory.sandbox.namespaces`)
    tmp: str = ""  # its private temporary folder (TMPDIR): sockets and FIFOs are made there (DataLoader workers)
    devices: list[str] = field(default_factory=list)  # GPU device files: read, written and driven by ioctl

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> "Spec":
        return cls(**json.loads(text))


def python_roots() -> list[str]:
    """The Python installation, its packages (every `child_path` entry's real location: a light virtual environment
    whose ``.pth`` names another one's packages included) and lit_memory itself: read (and run) only."""
    roots = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    roots += [p for p in child_path() if os.path.isdir(p)]
    roots += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    roots.append(package_root())
    return list(dict.fromkeys(os.path.realpath(r) for r in roots if r))


def package_root() -> str:
    """The folder lit_memory is imported from (this checkout, or the installed packages)."""
    return str(Path(__file__).resolve().parents[2])


def child_path() -> list[str]:
    """The child's ``sys.path``: this process's, without the working folder or anything relative to it (``''``,
    ``.``), and with the folder lit_memory came from last where that was the working folder itself (a checkout run in
    place): the stdlib and installed packages are found first, never a file of the folder someone sent."""
    work = os.path.realpath(os.getcwd())
    path = [p for p in sys.path if p and os.path.isabs(p) and os.path.realpath(p) != work]
    if package_root() not in (os.path.realpath(p) for p in path):
        path.append(package_root())
    return path


def system_roots() -> list[str]:
    return [*SYSTEM, *ETC, *PROC, *DEVICES_READ]


def device_write_roots() -> list[str]:
    return list(DEVICES_WRITE)


def gpu_devices() -> list[str]:
    """This machine's GPU device files (`GPU_DEVICES` and every ``/dev/nvidiaN``) that exist."""
    numbered = sorted(f"/dev/{n}" for n in _listdir("/dev") if re.fullmatch(r"nvidia\d+", n))
    return [p for p in (*GPU_DEVICES, *numbered) if os.path.lexists(p)]


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# -- the child: the confinement applied to itself ---------------------------------------------------------


def enter(spec: Spec, threads: Sequence[str] = (), sockets: Sequence[str] = (), writes: Sequence[str] = ()) -> None:
    """Apply ``spec`` to this process: resource limits, then Landlock (``threads``: folders of /proc it may also
    write, `landlock.Ruleset.threads`; ``sockets``: its temporary folder, written and where it makes sockets and
    FIFOs; ``writes``: more write roots, its own /tmp); nothing can lift it afterwards."""
    if spec.nproc:
        _limit(resource.RLIMIT_NPROC, spec.nproc)
    if spec.fsize:
        _limit(resource.RLIMIT_FSIZE, spec.fsize)
    def ports(ranges: list[list[int]]) -> list[int]:
        return [port for first, last in ranges for port in range(first, last + 1)]

    Ruleset(
        read=spec.read,
        write=[*spec.write, *writes],
        devices=spec.devices,
        threads=list(threads),
        sockets=list(sockets),
        connect=ports(spec.connect),
        bind=ports(spec.bind),
    ).enforce()


def _limit(which: int, value: int) -> None:
    soft, hard = resource.getrlimit(which)
    cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (cap, hard))


_status_fd: Optional[int] = None  # the confined run's pipe to its parent, in the process that confined itself


def set_status(fd: int) -> None:
    """This process writes its phases into ``fd`` (the child, once confined: `lit_memory.sandbox.child`). Processes it
    forks inherit both; a process it starts afresh (a rank) has neither, and says nothing."""
    global _status_fd
    _status_fd = fd if fd >= 0 else None


def phase(name: str) -> None:
    """Tell the parent what the confined run is doing (its watchdog bounds preparation's wall-clock time): one line
    on the status pipe. Nothing outside a confined run."""
    if _status_fd is None:
        return
    try:
        os.write(_status_fd, (name.replace("\n", " ")[:200] + "\n").encode())
    except OSError:
        pass  # the parent stopped reading: it is ending the run



