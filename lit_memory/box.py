"""The box: what the process of an untrusted run may write, read, start and reach, whatever code asks.

Checks on settings and guards at known sinks (`lit_memory.trust`, `lit_memory.guard`) name the
dangerous values and classes one by one; each hunt found the next one (a callback that writes a path,
a save that follows a link three folders down). So while an untrusted run holds it (`confine`), a
`Box` judges every file-system change, every program start and every connection the process itself
makes, through Python's audit hooks (PEP 578: CPython raises an event before each such operation;
a hook that raises stops it). The hook is added once per process and cannot be removed, so it does
nothing unless a box is active.

What an active box allows:

- **writes** only below its roots: the run folder (`allow`; a recipe's choice of it makes it
  *create-only*), folders the user typed (theirs), the caches the libraries own (Hugging Face,
  datasets, torch hub/compile, triton) and the temporary folder (create-only). Never through a
  link below a root. In a create-only root, an existing file or folder is changed, replaced or
  removed only if this run made it (this process, or a process of the same run: created after the
  run started).
- **reads** of regular files and folders; not of FIFOs, sockets or devices (a FIFO blocks forever,
  ``/dev/zero`` never ends), except ``/dev/null``/``/dev/urandom`` and files typed on the command line.
- **processes**: forked children (DataLoader workers) up to a bound, multiprocessing's own helpers,
  lit_memory itself (which boxes itself: `inherit`), and the compilers torch's inductor and triton
  run. No other program.
- **network**: the Hugging Face Hub and the user's proxy; no other host, and local sockets only
  inside folders the run made.

Each refusal raises `Refused` (a `UserError` and a `PermissionError`, so a library that treats
"cannot write here" as a soft failure, like Python skipping a bytecode cache, still works) naming the
path and the setting that asked for it. A refusal a library swallows is kept (`Box.refused`) and
reported when the command ends.

What it cannot see: native code that writes or connects without Python's I/O (torch's C++ zip writer,
safetensors' Rust writer, tokenizers' Rust writer, torch.distributed's TCP store and gloo, hf_xet).
`seal_native_writers` makes the routes that matter raise the event before they write (``torch.save``
to a path, safetensors' ``save_file``); tokenizers are written only by lit_memory's export, into a
folder the run has just made.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from lit_memory.errors import UserError

ENV = "LIT_MEMORY_BOX"  # the active box, for the processes this one starts (`inherit`)
HINT = "pass --trust-recipe only if you trust its source"


class Refused(UserError, PermissionError):
    """What the box refused: one line for the CLI, a permission error for the library that asked."""


@dataclass(frozen=True)
class Root:
    path: str  # absolute, as named
    real: str  # with links above it resolved (where the user's layout puts it)
    label: str  # the setting or what it is, for messages
    owned: bool = False  # the user's: existing things in it may be changed
    links: bool = False  # links inside are fine if they stay inside (a cache's own layout)
    shallow: bool = False  # new things only directly in it or in what the run made there (the temporary folder)
    only: str = ""  # a single file in the folder: that name and `lit_memory.files`' temporaries for it


@dataclass
class Box:
    """One run's confinement. ``since``: when the run started (a process of the same run, started
    later, inherits it): what exists in a create-only root and is older was not made by the run."""

    roots: list[Root] = field(default_factory=list)
    since: float = field(default_factory=time.time)
    max_children: int = 2 * (os.cpu_count() or 1) + 2
    hosts: set[str] = field(default_factory=set)
    typed_files: set[str] = field(default_factory=set)
    settings: list[tuple[str, str, str]] = field(default_factory=list)  # (key, absolute, resolved path) of path values
    made: set[str] = field(default_factory=set)
    refused: list[Refused] = field(default_factory=list)
    resolved: set[str] = field(default_factory=set)  # addresses of allowed hosts, as looked up

    # -- configuring ---------------------------------------------------------------------------

    def allow(self, path: Any, label: str, owned: bool = False, links: bool = False, shallow: bool = False,
              file: bool = False) -> None:
        """Let the run write below ``path`` (``owned``: change what it did not make there too; ``file``: only
        the file ``path``, written whole through a temporary beside it)."""
        absolute = os.path.abspath(os.path.expanduser(os.fspath(path)))
        folder, only = (os.path.dirname(absolute), os.path.basename(absolute)) if file else (absolute, "")
        root = Root(folder, os.path.realpath(folder), label, owned, links, shallow, only)
        self.roots = [r for r in self.roots if (r.path, r.only) != (folder, only)] + [root]

    def root(self, path: Any) -> Optional[Root]:
        """The innermost root ``path`` lies in, or None."""
        absolute = os.path.abspath(os.fspath(path))
        real = os.path.realpath(absolute)
        found = [r for r in self.roots if (_under(absolute, r.path) or _under(real, r.real)) and _admits(r, absolute)]
        return max(found, key=lambda r: (len(r.path), bool(r.only)), default=None)

    def name_settings(self, leaves: Iterator[tuple[str, Any]]) -> None:
        """Remember which setting names which path, for the refusal lines."""
        for key, value in leaves:
            if isinstance(value, str) and value and ("/" in value or value.startswith((".", "~"))) and "://" not in value:
                absolute = os.path.abspath(os.path.expanduser(value))
                self.settings.append((key, absolute, os.path.realpath(absolute)))

    # -- judging -------------------------------------------------------------------------------

    def refuse(self, message: str, quiet: bool = False) -> None:
        err = Refused(message)
        if not quiet:
            self.refused.append(err)
        raise err



    def asker(self, path: str, fallback: Optional[str] = None) -> str:
        """The setting whose value is ``path`` or a folder above it (also once a library resolved its links:
        then the link is named), else ``fallback`` or the code that asked."""
        named = [(key, value, value) for key, value, _ in self.settings if _under(path, value)]
        resolved = [(key, value, real) for key, value, real in self.settings if real != value and _under(path, real)]
        if named:
            return max(named, key=lambda m: len(m[1]))[0]
        if resolved:
            key, value, _ = max(resolved, key=lambda m: len(m[2]))
            return f"{key}: {value}, through the link {_first_link(value, os.sep) or value}"
        return fallback or _caller()

    def _folders(self) -> str:
        return ", ".join(os.path.join(r.path, r.only) if r.only else r.path
                         for r in self.roots if not r.links and not r.shallow) or "none yet"

    def would_refuse(self, path: Any, op: str, verb: Optional[str] = None, asker: Optional[str] = None) -> Optional[str]:
        """Why `check_write` would refuse ``op`` on ``path``, without recording anything: checked before a
        run starts, so a refusal comes before anything is written. ``op="into"``: writing a new file in the
        folder ``path``. ``asker``: who would ask, when no setting names the path; ``"=KEY"``: KEY, whatever
        names it."""
        made, refused = set(self.made), len(self.refused)
        probe = os.path.join(os.fspath(path), PROBE) if op == "into" else os.fspath(path)
        try:
            self.check_write(probe, "write" if op == "into" else op, verb or ("write into" if op == "into" else None), asker)
        except Refused as err:
            return str(err).replace(os.sep + PROBE, "")
        finally:
            self.made, self.refused[:] = made, self.refused[:refused]
        return None

    def check_write(self, path: str, op: str, verb: Optional[str] = None, asker: Optional[str] = None) -> None:
        """``op``: write (open for writing), create, modify, remove, replace (a rename's target). ``asker``:
        who asks, when no setting names the path (the code that asked, by default)."""
        absolute = os.path.abspath(path)
        if absolute in DISCARDED:
            return
        quiet = "__pycache__" in absolute.split(os.sep)  # Python's bytecode cache: skipped quietly when refused

        def who() -> str:  # only when refusing: it may walk the stack
            return asker[1:] if asker and asker.startswith("=") else self.asker(absolute, asker)

        root = self.root(absolute)
        verb = verb or {"write": "write", "create": "create", "modify": "change", "remove": "remove", "replace": "replace"}[op]
        if op == "create" and not os.path.lexists(absolute) and self._on_the_way(absolute):
            self.made.add(absolute)  # a missing folder above a run folder (mkdir -p of save_dir): empty, new
            return
        if root is None:
            self.refuse(f"refusing to {verb} {absolute} ({who()}): it is outside the run's folders "
                        f"({self._folders()}) and caches; {HINT}", quiet)
        self._check_links(absolute, root, verb, op, quiet, who)
        exists = os.path.lexists(absolute)
        if op in ("create",) or (op in ("write", "replace") and not exists):
            if exists or root.owned:
                return
            parent = os.path.dirname(absolute)
            if root.shallow and parent not in (root.path, root.real) and not self._made(parent, root):
                self.refuse(f"refusing to {verb} {absolute} ({who()}): it is outside the run's folders "
                            f"({self._folders()}) and caches ({root.label}: only what the run made there); {HINT}", quiet)
            self.made.add(absolute)
            return
        if not exists:
            return  # the operation fails by itself
        if root.owned or self._made(absolute, root):
            if op == "replace":
                self.made.add(absolute)
            return
        self.refuse(f"refusing to {verb} {absolute} ({who()}): this run did not make it (an untrusted "
                    f"run changes and removes only what it made); {HINT}", quiet)

    def _on_the_way(self, absolute: str) -> bool:
        """``absolute`` is a folder above a run folder: creating it gives the run nothing its folder does not."""
        return any(_under(r.path, absolute) and r.path != absolute and not (r.only or r.links or r.shallow)
                   for r in self.roots)

    def _check_links(self, absolute: str, root: Root, verb: str, op: str, quiet: bool, who: Any) -> None:
        """No link between the root and ``absolute``; for a write, not at ``absolute`` either."""
        base = root.path if _under(absolute, root.path) else root.real
        if absolute == base:
            if op in ("write", "modify") and os.path.islink(absolute):
                self.refuse(f"refusing to {verb} {absolute} ({who()}): it is a link; {HINT}", quiet)
            return  # the root itself: what is above it is the user's layout
        parent = os.path.dirname(absolute)
        existing = parent
        while not os.path.lexists(existing) and _under(os.path.dirname(existing), base) and existing != base:
            existing = os.path.dirname(existing)
        real = os.path.realpath(existing)
        expected = os.path.normpath(os.path.join(root.real, os.path.relpath(existing, base)))
        leaf_link = op in ("write", "modify") and os.path.islink(absolute)
        if root.links:
            inside = _under(real, root.real) and (not leaf_link or _under(os.path.realpath(absolute), root.real))
            if inside:
                return
        elif real == expected and not leaf_link:
            return
        where = absolute if leaf_link else _first_link(existing, base) or existing
        self.refuse(f"refusing to {verb} {absolute} ({who()}): {where} is a link (an untrusted run never "
                    f"writes through one: a shared folder can plant one pointing at your files); {HINT}", quiet)

    def _made(self, absolute: str, root: Root) -> bool:
        """Made by this run: this process made it or a folder above it, or (a file another process of the
        run made) it was created after the run started."""
        node = absolute
        while _under(node, root.path) or _under(node, root.real):
            if node in self.made:
                return True
            if node in (root.path, root.real):
                break
            node = os.path.dirname(node)
        try:  # a folder's ctime moves whenever an entry is added: not evidence of who made it
            info = os.lstat(absolute)
        except OSError:
            return False
        return not stat.S_ISDIR(info.st_mode) and info.st_ctime >= self.since

    def check_read(self, path: str) -> None:
        try:
            info = os.stat(path)
        except (OSError, ValueError):
            return  # the open reports it
        if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode):
            return
        real = os.path.realpath(path)
        if real in ("/dev/null", "/dev/urandom", "/dev/random", "/dev/full") or real in self.typed_files:
            return
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else "a device"
        # Not kept for the end of the command: a reader that goes on without the file read nothing.
        self.refuse(f"refusing to read {path} ({self.asker(os.path.abspath(path))}): it is {kind}, not a regular file "
                    f"(reading it may block forever or never end); {HINT}", quiet=True)

    def check_command(self, executable: Any, args: Any) -> None:
        argv = [os.fsdecode(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
        if _is_lit_memory(executable, argv) or _compiler_asks():
            return
        self.refuse(f"refusing to run {' '.join(argv)[:200]} ({_caller()}): an untrusted run starts no programs "
                    f"(only DataLoader workers and lit_memory itself); {HINT}")

    def check_child(self) -> None:
        import multiprocessing

        running = len(multiprocessing.active_children())
        if running >= self.max_children:
            self.refuse(f"refusing to start another process ({_caller()}): {running} are running, the bound for this "
                        f"run is {self.max_children} (data.num_workers, this machine's {os.cpu_count()} CPU cores); {HINT}")

    def check_host(self, host: Any) -> None:
        """A name looked up: the Hub's (whose addresses are then allowed to connect to), this machine's, or
        an address (judged when connected to)."""
        if host is None:
            return
        import socket

        name = (os.fsdecode(host) if isinstance(host, bytes) else str(host)).lower().rstrip(".")
        if _allowed_host(name, self.hosts):
            if name not in self.resolved:
                self.resolved.add(name)
                with contextlib.suppress(OSError):
                    self.resolved |= {str(a[4][0]) for a in socket.getaddrinfo(name, None)}
            return
        if not name or _numeric(name) or name in ("localhost", socket.gethostname().lower()):
            return
        self.refuse(f"refusing to look up {name} ({_caller()}): an untrusted run reaches only the Hugging Face Hub "
                    f"({', '.join(sorted(self.hosts))}); {HINT}")

    def check_connect(self, sock: Any, address: Any) -> None:
        import socket

        family = getattr(sock, "family", None)
        if family == socket.AF_UNIX:
            path = os.fsdecode(address) if isinstance(address, (str, bytes)) else ""
            if path and not path.startswith("\0") and self._made(os.path.abspath(path), self.root(path) or _NOWHERE):
                return
            self.refuse(f"refusing to connect to the local socket {path!r} ({_caller()}): not one this run made; {HINT}")
        host = address[0] if isinstance(address, tuple) and address else address
        if isinstance(host, str) and (host in self.resolved or _allowed_host(host, self.hosts)):
            return
        self.refuse(f"refusing to connect to {address!r} ({_caller()}): an untrusted run reaches only the Hugging Face "
                    f"Hub ({', '.join(sorted(self.hosts))}); {HINT}")

    # -- children ------------------------------------------------------------------------------

    def to_env(self) -> str:
        return json.dumps({"roots": [dict(r.__dict__) for r in self.roots], "since": self.since,
                           "max_children": self.max_children, "hosts": sorted(self.hosts),
                           "typed_files": sorted(self.typed_files), "settings": self.settings})

    @classmethod
    def from_env(cls, text: str) -> "Box":
        data = json.loads(text)
        return cls(roots=[Root(**r) for r in data["roots"]], since=data["since"], max_children=data["max_children"],
                   hosts=set(data["hosts"]), typed_files=set(data["typed_files"]),
                   settings=[tuple(s) for s in data["settings"]])


PROBE = ".lit_memory-would-write-here"  # a name no run writes: `Box.would_refuse` asks about a new file in a folder
DISCARDED = ("/dev/null", "/dev/stdout", "/dev/stderr")  # written to without writing anything anywhere
_NOWHERE = Root("/nonexistent-root", "/nonexistent-root", "nowhere")


def _admits(root: Root, absolute: str) -> bool:
    """A file root admits its file and the temporaries `lit_memory.files` writes it through."""
    if not root.only:
        return True
    name = os.path.basename(absolute)
    return os.path.dirname(absolute) in (root.path, root.real) and (name == root.only or name.startswith(f".{root.only}."))


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _first_link(path: str, base: str) -> Optional[str]:
    """The outermost link between ``base`` and ``path``."""
    parts = os.path.relpath(path, base).split(os.sep)
    node = base
    for part in parts:
        node = os.path.join(node, part)
        if os.path.islink(node):
            return node
    return None


def _numeric(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.split("%")[0])
        return True
    except ValueError:
        return False


def _allowed_host(host: str, hosts: set[str]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == h or host.endswith("." + h) for h in hosts)


_OWN = ("lit_memory.box", "os", "posixpath", "genericpath", "shutil", "pathlib", "io", "_pyio", "tempfile", "codecs",
        "contextlib", "socket", "subprocess", "multiprocessing", "importlib", "fsspec", "torch.serialization",
        "safetensors", "threading", "json", "http", "urllib", "ssl", "lightning.fabric.utilities.cloud_io")


def _caller() -> str:
    """The first frame outside the standard library's plumbing and this module: who asked."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not any(name == m or name.startswith(m + ".") for m in _OWN):
            return f"asked by {name}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "asked by the process"


# What torch's inductor and triton run: the C++ compiler, ptxas, ldconfig, their own compile workers.
COMPILERS = ("torch._inductor", "torch.utils.cpp_extension", "triton")


def _compiler_asks() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if any(name == m or name.startswith(m + ".") for m in COMPILERS):
            return True
        frame = frame.f_back
    return False


# Programs the libraries a run uses start for answers about this interpreter: jsonargparse's stub resolver
# (typeshed_client) asks it for its sys.path. Run with PYTHONSAFEPATH (`confine`): nothing from the working folder.
INTERPRETER_QUERIES = (("-c", "import sys, json; print(json.dumps(sys.path))"),)
# Programs that only answer a question about this machine: the standard library's platform.processor() runs one.
MACHINE_QUERIES = (("uname", "-p"),)


def _is_lit_memory(executable: Any, argv: list[str]) -> bool:
    """``python [-P] -m lit_memory[.x] ...`` with this interpreter, or lit_memory's console script: it boxes
    itself (`inherit`), and never with --trust-recipe."""
    if not argv or "--trust-recipe" in argv:
        return False
    if (os.path.basename(argv[0]), *argv[1:]) in MACHINE_QUERIES:
        return True
    first = os.path.realpath(os.fsdecode(executable) if executable else argv[0])
    if first == os.path.realpath(sys.executable):
        if tuple(argv[1:]) in INTERPRETER_QUERIES:
            return True
        rest = argv[1:]
        while rest and rest[0] in ("-P", "-u", "-X", "faulthandler", "-B"):
            rest = rest[1:]
        if len(rest) >= 2 and rest[0] == "-m" and (rest[1] == "lit_memory" or rest[1].startswith("lit_memory.")):
            return True
        return len(rest) >= 1 and os.path.basename(rest[0]) == "lit-memory" and os.path.realpath(rest[0]) == os.path.realpath(sys.argv[0])
    return False


# -- the hook ----------------------------------------------------------------------------------

_active: Optional[Box] = None
_local = threading.local()
_installed = False
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _path(path: Any, dir_fd: Any = None) -> Optional[str]:
    if isinstance(path, int):
        return None  # an open file: judged when it was opened
    path = os.fsdecode(path)
    if dir_fd not in (None, -1) and not os.path.isabs(path):
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            return path
    return path


def _write(op: str, index: int = 0, fd_index: Optional[int] = None):
    def handle(box: Box, args: tuple) -> None:
        path = _path(args[index], args[fd_index] if fd_index is not None and len(args) > fd_index else None)
        if path is not None:
            box.check_write(path, op)

    return handle


def _open(box: Box, args: tuple) -> None:
    path, mode, flags = (args + (None, None))[:3]
    path = _path(path)
    if path is None:
        return
    writing = (flags or 0) & _WRITING if isinstance(flags, int) else any(c in (mode or "") for c in "wax+")
    if writing:
        box.check_write(path, "write")
    else:
        box.check_read(path)


def _rename(box: Box, args: tuple) -> None:
    src, dst, src_fd, dst_fd = (args + (None, None))[:4]
    source, target = _path(src, src_fd), _path(dst, dst_fd)
    if source is not None:
        box.check_write(source, "remove")
    if target is not None:
        was_made = source is not None and os.path.abspath(source) in box.made
        box.check_write(target, "replace")
        if was_made:
            box.made.add(os.path.abspath(target))


def _link(box: Box, args: tuple) -> None:
    src, dst = _path(args[0], args[2] if len(args) > 2 else None), _path(args[1], args[3] if len(args) > 3 else None)
    if dst is None:
        return
    box.check_write(dst, "create")
    if src is not None:  # a hard link to a file someone else owns would let a later write change it
        source = os.path.abspath(src)
        if not box._made(source, box.root(source) or _NOWHERE):
            box.refuse(f"refusing to link {dst} to {source} ({box.asker(os.path.abspath(dst))}): this run did not make it; {HINT}")


def _symlink(box: Box, args: tuple) -> None:
    target, link = os.fsdecode(args[0]), _path(args[1], args[2] if len(args) > 2 else None)
    if link is None:
        return
    box.check_write(link, "create")
    pointed = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(link)), target))
    root = box.root(link)
    if root is None or not (_under(pointed, root.path) or _under(pointed, root.real)):
        box.refuse(f"refusing to link {link} to {target} ({box.asker(os.path.abspath(link))}): the link would point "
                   f"outside the run's folder; {HINT}")


def _popen(box: Box, args: tuple) -> None:
    box.check_command(args[0], args[1])
    _local.popen = args[1]


def _spawn(box: Box, args: tuple) -> None:
    if getattr(_local, "popen", None) is not None and list(args[1]) == list(_local.popen):
        _local.popen = None  # subprocess.Popen starting the program it was allowed to
        return
    box.check_command(args[0], args[1])


def _system(box: Box, args: tuple) -> None:
    box.check_command(None, str(args[0]))


def _mp_spawn(box: Box, args: tuple) -> None:
    argv = [os.fsdecode(a) for a in args[1]]
    if any("resource_tracker" in a or "forkserver" in a for a in argv):
        return  # multiprocessing's own helpers
    box.check_child()


def _bind(box: Box, args: tuple) -> None:
    import socket

    sock, address = args[0], args[1]
    if getattr(sock, "family", None) == socket.AF_UNIX and isinstance(address, (str, bytes)) and address and not os.fsdecode(address).startswith("\0"):
        box.check_write(os.fsdecode(address), "create")


def _sendto(box: Box, args: tuple) -> None:
    if len(args) > 1 and args[1] is not None:
        box.check_connect(args[0], args[1])


def _refuse_always(what: str):
    def handle(box: Box, args: tuple) -> None:
        box.refuse(f"refusing {what} ({_caller()}): an untrusted run starts no programs and reaches only the Hugging "
                   f"Face Hub; {HINT}")

    return handle


def _url(box: Box, args: tuple) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(str(args[0]))
    if parts.scheme in ("file", ""):
        return
    box.check_host(parts.hostname)


_EVENTS = {
    "open": _open,
    "os.remove": _write("remove", 0, 1),
    "os.rmdir": _write("remove", 0, 1),
    "shutil.rmtree": _write("remove", 0, 1),
    "os.rename": _rename,
    "os.mkdir": _write("create", 0, 2),
    "os.symlink": _symlink,
    "os.link": _link,
    "os.truncate": _write("modify"),
    "os.chmod": _write("modify", 0, 2),
    "os.chown": _write("modify", 0, 3),
    "os.chflags": _write("modify"),
    "os.lchflags": _write("modify"),
    "os.lchmod": _write("modify"),
    "os.utime": _write("modify", 0, 3),
    "os.setxattr": _write("modify"),
    "os.removexattr": _write("modify"),
    "sqlite3.connect": lambda box, args: box.check_write(str(args[0]), "write") if str(args[0]) not in (":memory:", "") and not str(args[0]).startswith("file:") else None,
    "subprocess.Popen": _popen,
    "os.posix_spawn": _spawn,
    "os.spawn": lambda box, args: box.check_command(args[1], args[2]),
    "os.exec": lambda box, args: box.check_command(args[0], args[1]),
    "os.system": _system,
    "os.fork": lambda box, args: box.check_child(),
    "os.forkpty": _refuse_always("a pseudo-terminal child"),
    "lit_memory.spawn": _mp_spawn,
    "socket.getaddrinfo": lambda box, args: box.check_host(args[0]),
    "socket.gethostbyname": lambda box, args: box.check_host(args[0]),
    "socket.gethostbyname_ex": lambda box, args: box.check_host(args[0]),
    "socket.connect": lambda box, args: box.check_connect(args[0], args[1]),
    "socket.sendto": _sendto,
    "socket.sendmsg": _sendto,
    "socket.bind": _bind,
    "http.client.connect": lambda box, args: box.check_host(args[1]),
    "urllib.Request": _url,
    "ftplib.connect": _refuse_always("an FTP connection"),
    "smtplib.connect": _refuse_always("an SMTP connection"),
    "imaplib.open": _refuse_always("an IMAP connection"),
    "poplib.connect": _refuse_always("a POP connection"),
    "nntplib.connect": _refuse_always("an NNTP connection"),
    "webbrowser.open": _refuse_always("opening a browser"),
}


def _hook(event: str, args: tuple) -> None:
    handle = _EVENTS.get(event)
    if handle is None or _active is None or getattr(_local, "inside", False):
        return
    _local.inside = True  # the checks themselves stat, resolve and look up: not judged again
    try:
        handle(_active, args)
    finally:
        _local.inside = False


def install() -> None:
    """Add the hook to this process (once; it stays, inactive, when no box is held)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True


def active() -> Optional[Box]:
    return _active


@contextlib.contextmanager
def confine(box: Box) -> Iterator[Box]:
    """Hold ``box`` for this process (and pass it on to the processes it starts) until the block ends.
    A box already held (inherited from the process that started this one) is kept: ``box``'s roots join it."""
    global _active
    install()
    seal_native_writers()
    previous, saved = _active, {k: os.environ.get(k) for k in (ENV, "PYTHONSAFEPATH")}
    if previous is not None:
        previous.roots += [r for r in box.roots if r not in previous.roots]
        box = previous
    _active = box
    os.environ["PYTHONSAFEPATH"] = "1"  # a Python child never imports from its working folder
    _publish(box)
    try:
        yield box
    finally:
        _active = previous
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _publish(box: Box) -> None:
    os.environ[ENV] = box.to_env()


def publish() -> None:
    """After roots were added: the processes started from now on get them."""
    if _active is not None:
        _publish(_active)


def allow_output(path: Any, label: str, file: bool = False) -> None:
    """A tool's output the user named (or the tool's own default, in the user's working folder): theirs. A file
    (``file``) is that file alone, not the folder it is in."""
    if _active is not None:
        _active.allow(path, label, owned=True, file=file)
        publish()


def inherit() -> None:
    """Called when lit_memory is imported: a process started by a boxed one is boxed the same way (its
    own CLI may add roots, never lift it)."""
    global _active
    text = os.environ.get(ENV)
    if not text or _active is not None:
        return
    try:
        box = Box.from_env(text)
    except (ValueError, KeyError, TypeError):
        return
    install()
    _active = box


# -- routes the hook does not see ----------------------------------------------------------------

_sealed: set[str] = set()


def seal_native_writers() -> None:
    """Make the writers that write from native code raise the ``open`` event with their path first:
    ``torch.save`` to a path (torch's C++ zip writer opens the file itself: Lightning's sharded
    ``meta.pt``, transformers' ``.bin``), safetensors' ``save_file`` (Rust), and multiprocessing's
    spawn (a new interpreter, started without `subprocess`)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if "torch" not in _sealed and "torch" in sys.modules:
        _sealed.add("torch")
        import torch.serialization as serialization

        writer = serialization._open_zipfile_writer_file

        class AuditedZipWriter(writer):  # type: ignore[misc, valid-type]
            def __init__(self, name: str) -> None:
                sys.audit("open", os.fspath(name), "wb", flags)
                super().__init__(name)

        serialization._open_zipfile_writer_file = AuditedZipWriter
    if "safetensors" not in _sealed and "torch" in sys.modules and importlib.util.find_spec("safetensors"):
        _sealed.add("safetensors")
        import safetensors.torch as safetensors_torch

        serialize_file = safetensors_torch.serialize_file

        def audited_serialize_file(tensors: Any, filename: Any, *args: Any, **kwargs: Any) -> Any:
            sys.audit("open", os.fspath(filename), "wb", flags)
            return serialize_file(tensors, filename, *args, **kwargs)

        safetensors_torch.serialize_file = audited_serialize_file
    if "multiprocessing" in _sealed:
        return
    _sealed.add("multiprocessing")
    import multiprocessing.util as mp_util

    spawnv_passfds = mp_util.spawnv_passfds

    def audited_spawnv_passfds(path: Any, args: Any, passfds: Any) -> Any:
        sys.audit("lit_memory.spawn", path, list(args))
        return spawnv_passfds(path, args, passfds)

    mp_util.spawnv_passfds = audited_spawnv_passfds


# -- the roots every run has -----------------------------------------------------------------------


def caches() -> list[tuple[str, str]]:
    """(folder, name) of the caches the libraries a run uses write to, as they compute them."""
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    hf_home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    found = [(hf_home, "the Hugging Face cache")]
    for env in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "HF_MODULES_CACHE", "TRANSFORMERS_CACHE"):
        if os.environ.get(env):
            found.append((os.environ[env], env))
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants

        found += [(constants.HF_HOME, "the Hugging Face cache"), (constants.HF_HUB_CACHE, "the Hugging Face hub cache")]
    if "datasets" in sys.modules:
        config = sys.modules["datasets"].config
        found += [(config.HF_DATASETS_CACHE, "the datasets cache"), (config.HF_CACHE_HOME, "the datasets cache")]
    torch_home = os.environ.get("TORCH_HOME") or os.path.join(xdg, "torch")
    found += [(torch_home, "torch's hub cache"), (os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(xdg, "torch_extensions"), "torch's extensions")]
    user = _user()
    found.append((os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"), "torch.compile's cache"))
    triton_home = os.environ.get("TRITON_HOME") or home
    found.append((os.environ.get("TRITON_CACHE_DIR") or os.path.join(triton_home, ".triton"), "triton's cache"))
    found.append((os.environ.get("MPLCONFIGDIR") or os.path.join(xdg, "matplotlib"), "matplotlib's cache"))
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    found.append((os.path.join(config, "matplotlib"), "matplotlib's configuration cache"))
    return found


def _user() -> str:
    import getpass
    import re

    try:
        return re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except (KeyError, OSError):
        return "unknown"


def hub_hosts() -> set[str]:
    """The Hugging Face Hub (as huggingface_hub is configured) and the user's proxies."""
    from urllib.parse import urlsplit

    hosts = {"huggingface.co", "hf.co"}
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants

        hosts.add(urlsplit(constants.ENDPOINT).hostname or "huggingface.co")
    for env in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        if os.environ.get(env):
            host = urlsplit(os.environ[env] if "://" in os.environ[env] else "http://" + os.environ[env]).hostname
            if host:
                hosts.add(host)
    return {h.lower() for h in hosts}


def run_box(typed_files: Iterator[str] = ()) -> Box:
    """A box with what every untrusted run may use: the caches (its own), the temporary folder
    (create-only), /dev/shm's files it makes (shared memory of DataLoader workers)."""
    box = Box(hosts=hub_hosts())
    for folder, name in caches():
        box.allow(folder, name, owned=True, links=True)
    box.allow(tempfile.gettempdir(), "the temporary folder", shallow=True)
    if os.path.isdir("/dev/shm"):
        box.allow("/dev/shm", "shared memory", shallow=True)
    box.typed_files = {os.path.realpath(p) for p in typed_files}
    return box
