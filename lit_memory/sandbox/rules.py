"""What a confined run may read, write and reach, and the values a sent recipe may not choose.

`Spec` is the confinement one run gets: read roots (the Python installation and its packages, system libraries
and the few files in ``/etc`` they read, ``/proc``, ``/sys`` and the GPU's device files, the caches, the recipe's
checked inputs), write roots (the run's folders, its private temporary folder and caches), TCP ports (none but a
distributed launch's own), bounds (memory, processes, file size, disk, preparation time), the child's ``sys.path``
(`child_path`) and its status pipe (`phase`). The parent makes it (`lit_memory.confine.launch`); the child applies
it to itself (`lit_memory.sandbox.child`; `enter`: limits and Landlock), before anything of the run is imported. The
child's environment holds no secret (`scrubbed`).

The value rules judge what the kernel cannot: a run folder a recipe chooses (`check_roots`), templates that
Python formats (`check_templates`: a checkpoint's file name), free-form keyword dictionaries (`check_free_kwargs`),
a file a recipe names outside its folder and the working folder (`check_input`).
"""

from __future__ import annotations

import json
import os
import re
import resource
import site
import string
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

from lit_memory.errors import UserError
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

    Ruleset(read=spec.read, write=[*spec.write, *writes], devices=spec.devices, threads=list(threads), sockets=list(sockets),
            connect=ports(spec.connect), bind=ports(spec.bind)).enforce()


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


# -- what a recipe may choose ---------------------------------------------------------------------------


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def check_roots(chosen: Iterable[tuple[str, str]], work: str, owned: Iterable[str]) -> None:
    """Run folders a recipe chose (``(setting, path)``): each a new or empty folder under the working folder
    ``work``, neither holding nor inside a folder the user owns (``owned``: the caches, the home folder's
    configuration), nor holding another run folder. One error line naming the setting otherwise."""
    chosen = [(key, os.path.realpath(os.path.expanduser(str(path)))) for key, path in chosen]
    owned = [os.path.realpath(os.path.expanduser(p)) for p in owned]
    work = os.path.realpath(work)
    for key, path in chosen:
        where = f"{key}={path}"
        if not _under(path, work) or path == work:
            raise UserError(f"refusing {where}: a run folder a recipe chooses must be a new folder under the working "
                            f"folder {work}; {HINT}")
        for folder in owned:
            if _under(path, folder) or _under(folder, path):
                raise UserError(f"refusing {where}: it {'is inside' if _under(path, folder) else 'holds'} {folder}, "
                                f"a folder of yours a run does not write; {HINT}")
        if os.path.lexists(path) and (not os.path.isdir(path) or os.path.islink(path) or os.listdir(path)):
            raise UserError(f"refusing {where}: a run folder a recipe chooses must be new or empty, and it holds "
                            f"files; {HINT}")
    for key, path in chosen:
        for other_key, other in chosen:
            if other != path and _under(other, path) and key != other_key and os.path.lexists(other):
                raise UserError(f"refusing {key}={path}: it holds {other_key}'s folder; {HINT}")


# Settings naming a folder a run writes into (its roots), and any other setting that names a place to write.
ROOT_KEYS = ("default_root_dir", "save_dir", "dirpath", "log_dir", "output_dir", "root_dir")
WRITE_PATH = re.compile(r"(_dir|_path|filepath|dirpath|snapshot)$")
IN_RUN = ("memory.snapshot",)  # a relative value is in the run's own folder
READ_KEYS = ("model.model_name_or_path", "model.tokenizer_name_or_path", "data.source", "data.predict_path", "ckpt_path",
             "tokenizer_name_or_path")


def check_write_paths(chosen: dict[str, Any], roots: list[str]) -> None:
    """Places a recipe names for writing that are not a run root (a callback's ``exclude_batches_path``, a
    profiler's file): each must lie below the run's folders, which are all a confined run may write; said before
    the run starts, not when the kernel refuses the write mid-run."""
    real = [os.path.realpath(r) for r in roots]
    for key, value in chosen.items():
        name = key.rsplit(".", 1)[-1]
        if name in ROOT_KEYS or name == "class_path" or key in READ_KEYS or name in READ_KEYS or not WRITE_PATH.search(name):
            continue
        if not isinstance(value, str) or not value or "://" in value:
            continue
        if key in IN_RUN and not os.path.isabs(os.path.expanduser(value)):
            if os.path.normpath(value).split(os.sep)[0] != os.pardir:
                continue
        path = os.path.realpath(os.path.expanduser(value))
        if not any(_under(path, r) for r in real):
            raise UserError(f"refusing {key}={value}: it is outside the run's folders ({', '.join(real)}), where a "
                            f"sent recipe's run writes; {HINT}")


TEMPLATE_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_/-]{0,63}")
TEMPLATE_SPEC = re.compile(r"[<>^=]?[+ -]?0?\d{0,2}(\.\d{1,2})?[dfegs%]?")


def check_template(key: str, value: str) -> None:
    """A value Python formats with the run's metrics (a checkpoint's ``filename``): plain ``{metric}`` or
    ``{metric:spec}`` fields with bounded widths; no attribute or item walk (``{epoch.__class__...}``)."""
    try:
        parts = list(string.Formatter().parse(value))
    except ValueError as err:
        raise UserError(f"refusing {key}={value!r}: it is not a plain {{metric}} or {{metric:spec}} template ({err}); "
                        f"{HINT}") from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if not TEMPLATE_FIELD.fullmatch(name) or conversion or not TEMPLATE_SPEC.fullmatch(spec or ""):
            raise UserError(
                f"refusing {key}={value!r}: its field {{{name}{'!' + conversion if conversion else ''}"
                f"{':' + spec if spec else ''}}} is not a plain {{metric}} or {{metric:spec}}; {HINT}"
            )


TEMPLATE_KEYS = ("filename", "name", "version", "sub_dir", "prefix", "log_model_name")


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from leaves(value, f"{prefix}[{i}]")
    else:
        yield prefix, tree


def check_templates(settings: dict[str, Any]) -> None:
    for key, value in leaves(settings):
        if isinstance(value, str) and "{" in value and key.rsplit(".", 1)[-1] in TEMPLATE_KEYS:
            check_template(key, value)


FREE_KWARGS = re.compile(r"(^|\.)(dict_kwargs|kwargs|\w+_kwargs)(\.|\[|$)")


def check_free_kwargs(settings: dict[str, Any]) -> None:
    """Free-form keyword dictionaries of allowlisted classes (jsonargparse's ``dict_kwargs``, a profiler's
    ``**kwargs``): refused from a sent recipe, whose values they pass on unchecked."""
    for key, value in leaves(settings):
        if FREE_KWARGS.search(key) and value not in (None, {}, []):
            raise UserError(f"refusing {key.split('.dict_kwargs')[0]}.dict_kwargs: free-form keyword arguments from a "
                            f"recipe reach the class unchecked ({key}={value!r}); {HINT}")


def owned_folders() -> list[str]:
    """The user's folders no run folder may hold or sit in: the caches and the home folder's configuration."""
    home = os.path.expanduser("~")
    found = [os.path.join(home, name) for name in (".cache", ".config", ".local", ".ssh", ".bashrc.d", ".gnupg")]
    for variable in ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME",
                     "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        if os.environ.get(variable):
            found.append(os.environ[variable])
    return found


def check_input(key: str, value: str, path: Any, folders: Iterable[str]) -> None:
    """A file a recipe names for the run to read (data, the texts to predict, a model or tokenizer folder, a
    checkpoint): it lies beneath one of ``folders`` (the recipe's own folders and the working folder), judged by where
    it really is. A file of the user's elsewhere (``~/.config/gcloud/...json`` as the texts to predict) is read only
    when the user types it. One error line naming the key otherwise."""
    real = os.path.realpath(os.path.expanduser(str(path)))
    places = list(dict.fromkeys(os.path.realpath(f) for f in folders))
    if not any(_under(real, folder) for folder in places):
        raise UserError(
            f"refusing {key}={value}: a file a recipe names is read only from beneath the recipe's folder or the working "
            f"folder ({', '.join(places)}), and it is {real}; type --{key} {value} on the command line if you mean it, "
            f"or {HINT}")
