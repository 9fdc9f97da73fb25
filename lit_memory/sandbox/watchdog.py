"""The parent's watch over a confined run: start it, relay its output, bound it, and leave nothing of it behind.

- The child's standard input is ``/dev/null`` and its output two pipes relayed here with control characters removed
  (no escape sequence reaches the user's terminal); it runs in a session of its own, with no terminal.
- Its phases come over a pipe it inherits (`lit_memory.sandbox.rules.phase`), read without blocking and within a
  bound: nothing is read by path in a folder the child can write (a status file replaced by a link to ``/dev/zero``
  was read until memory ran out). The disk walk opens every folder relative to the one above it without following a
  link (``os.fwalk``), and stops at `MAX_ENTRIES`.
- Bounds, each ending the run with one ``error:`` line: the processes' resident memory (and, where the run has a
  cgroup, what the kernel's memory controller killed for: tmpfs and memfd pages too), the run folders' disk use and
  the time spent preparing (tokenizer, data, model). Disk is counted in allocated blocks (`usage`: space held at
  size 0 with ``fallocate`` counts), with the files its processes hold open after unlinking them; a folder the walk
  cannot enter stops the run (fails closed), and what a run left over its budget once it ended is said too (its
  folders are then freed: `lit_memory.confine.launch.run`).
- Every way out of `watch` (the run's end, a bound, Ctrl-C, SIGTERM or SIGHUP to this process, an exception) kills the
  whole run: its cgroup, its process group, and with them its process namespace; and the child dies with this process
  however this one ends (SIGKILL included: the child's parent-death signal, `lit_memory.sandbox.child`).

Light on purpose (standard library only): a parent that only watches imports nothing of the run.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from lit_memory.errors import CONTROL, shown  # what a terminal acts on: removed from the child's output
from lit_memory.sandbox.cgroup import Group
from lit_memory.sandbox.rules import ENV, Spec

GiB = 2**30
# Overrides of the bounds, for the user (and the tests): the environment is theirs, never a recipe's.
LIMIT_VARIABLES = {"rss": "LIT_MEMORY_SANDBOX_RSS_BYTES", "disk": "LIT_MEMORY_SANDBOX_DISK_BYTES",
                   "prepare": "LIT_MEMORY_SANDBOX_PREPARE_SECONDS"}
MAX_ENTRIES = 200_000  # files and folders in a run's folders (a run writes hundreds)
MAX_DEPTH = 64  # folders below a run folder (a run's are a few deep); deeper, the walk itself would run out of files
STATUS_BYTES = 4096  # of the status pipe kept at once; a phase is one short line
GRACE_SECONDS = 30.0  # after Ctrl-C, for the run to stop on its own before it is killed
TRAINING = "training"  # the phase after which preparation's bound no longer holds (`lit_memory.model`)


@dataclass
class Bounds:
    rss: int  # bytes: the run's processes together
    disk: int  # bytes: its run folders and private folder together
    prepare: float  # seconds before the first step
    why_rss: str = ""


class Stopped(Exception):
    """This process was asked to stop (SIGTERM, SIGHUP) while it watched."""


class Status:
    """The child's phases, read from a pipe without blocking; only the last `STATUS_BYTES` are ever held."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.pending = b""
        self.last = ""

    def poll(self) -> str:
        """The last complete line so far (the current phase)."""
        for _ in range(256):  # at most 16 MiB a poll: a child writing without end cannot hold the watch here
            try:
                chunk = os.read(self.fd, 65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if not chunk:
                break
            lines = (self.pending + chunk).split(b"\n")
            self.pending = lines[-1][-STATUS_BYTES:]
            complete = [line for line in lines[:-1] if line.strip()]
            if complete:
                self.last = CONTROL.sub("", complete[-1][:200].decode("utf-8", errors="replace")).strip()
        return self.last

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _relay(fd: int, out: Any) -> None:
    """Copy the child's output to ``out`` as it comes, in chunks (a line without end is not held whole), without the
    control characters of terminal escape sequences."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        text = CONTROL.sub("", decoder.decode(chunk))
        if text:
            with contextlib.suppress(ValueError, OSError):
                out.write(text)
                out.flush()
    with contextlib.suppress(OSError):
        os.close(fd)


def _children(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError):
                    stack += [int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
    return found


def rss(pid: int, group: Optional[Group] = None, shared_once: bool = False) -> int:
    """The resident memory of ``pid``'s process tree and of every process in ``group`` (a process that left the tree
    by starting a session of its own is still in the group), in bytes. ``shared_once``: each process's proportional
    share (PSS), so pages the ranks and workers share (CUDA's and torch's libraries, a fork's copy-on-write pages)
    count once; the kernel walks the page tables for it, so the watch asks only where the resident sum is over."""
    processes = set(_children(pid)) | (group.members() if group is not None else set())
    return sum(_resident(process, shared_once) for process in processes)


def _resident(pid: int, shared_once: bool) -> int:
    if shared_once:
        with contextlib.suppress(OSError, ValueError, StopIteration):
            with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
                return int(next(line for line in f if line.startswith("Pss:")).split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def processes(pid: int, group: Optional[Group] = None) -> set[int]:
    """``pid``'s process tree and every process in ``group`` (one that started a session of its own is still there)."""
    return set(_children(pid)) | (group.members() if group is not None else set())


@dataclass
class Usage:
    """What a run's folders hold on disk."""

    bytes: int = 0  # allocated blocks, not apparent sizes
    entries: int = 0  # files and folders
    why: str = ""  # why it could not be counted whole (a folder it cannot enter): the run is stopped then


def usage(folders: list[str], pids: Iterable[int] = ()) -> Usage:
    """The disk ``folders`` take, counted in allocated blocks (``st_blocks``: space held with
    ``fallocate(FALLOC_FL_KEEP_SIZE)`` at size 0 counts, a sparse file's holes do not), plus files the processes
    ``pids`` hold open after unlinking them on the same file systems (``/proc/<pid>/fd``). Walked by file descriptor
    without following a link (``os.fwalk`` checks each folder it opens is the one it listed). Fails closed: a folder
    or file it cannot enter or stat (``chmod 000``) is `Usage.why`, never counted as empty; past `MAX_ENTRIES`
    entries or `MAX_DEPTH` folders deep it stops (``entries`` more than `MAX_ENTRIES`)."""
    found, seen, devices = Usage(), set(), set()
    for folder in folders:
        failed: list[OSError] = []
        with contextlib.suppress(FileNotFoundError):
            devices.add(os.stat(folder).st_dev)
        try:
            for path, dirs, names, fd in os.fwalk(folder, follow_symlinks=False, onerror=failed.append):
                found.entries += len(dirs) + len(names)
                if found.entries > MAX_ENTRIES or path[len(folder):].count(os.sep) > MAX_DEPTH:
                    found.entries = MAX_ENTRIES + 1
                    return found
                for name in (*dirs, *names):
                    try:
                        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except OSError as err:
                        failed.append(OSError(err.errno, err.strerror, os.path.join(path, name)))
                        continue
                    found.bytes += _allocated(info, seen)
        except OSError as err:  # the folder itself (a missing one holds nothing)
            failed.append(err)
        if why := _unwalked(failed, folder):
            found.why = why
            return found
    held, found.why = _unlinked(pids, devices, seen)
    found.bytes += held
    return found


def _allocated(info: os.stat_result, seen: set) -> int:
    """A file's allocated bytes, once per inode (a hard link is not counted twice)."""
    if info.st_nlink > 1:
        if (info.st_dev, info.st_ino) in seen:
            return 0
        seen.add((info.st_dev, info.st_ino))
    return info.st_blocks * 512


def _unwalked(failed: list[OSError], top: str) -> str:
    """Why the walk below ``top`` missed something (one line), or "": a file or folder removed while walked (or a run
    folder not made yet) holds nothing, any other error could hide what it holds."""
    for err in failed:
        if err.errno != errno.ENOENT:
            return f"{err.filename or top}: {err.strerror or err}"
    return ""


def _unlinked(pids: Iterable[int], devices: set, seen: set) -> tuple[int, str]:
    """(bytes of regular files the processes ``pids`` hold open with no name left, on the file systems of ``devices``
    (the run's folders'; tmpfs and memfd pages are memory, bounded by the run's cgroup); why a process's open files
    could not be listed, or "")."""
    total = 0
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended
        except OSError as err:
            return total, f"the open files of process {pid}: {err.strerror}"
        for fd in fds:
            with contextlib.suppress(OSError):  # closed meanwhile
                info = os.stat(f"/proc/{pid}/fd/{fd}")  # the open file itself, its name gone or not
                key = (info.st_dev, info.st_ino)
                if stat.S_ISREG(info.st_mode) and info.st_nlink == 0 and info.st_dev in devices and key not in seen:
                    seen.add(key)
                    total += info.st_blocks * 512
    return total, ""


def disk(folders: list[str]) -> tuple[int, int]:
    """(bytes allocated, entries) below ``folders`` (`usage`); entries more than `MAX_ENTRIES` where they could not
    be counted whole."""
    found = usage(folders)
    return found.bytes, MAX_ENTRIES + 1 if found.why else found.entries


def remove(path: str) -> None:
    """Remove ``path`` and all below it, no link followed, a folder the run made unreadable (``chmod 000``) included:
    the parent owns what the run wrote, and gives itself back the right to enter it."""
    def retry(function: Any, failed: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            parent = os.path.dirname(failed) if function in (os.unlink, os.rmdir) else failed
            if not os.path.islink(parent):
                os.chmod(parent, 0o700)
            if function in (os.unlink, os.rmdir):
                function(failed)
            else:
                shutil.rmtree(failed, onerror=lambda *_: None)

    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    shutil.rmtree(path, onerror=retry)


def _kill(child: subprocess.Popen, group: Optional[Group], sig: int = signal.SIGKILL) -> None:
    if child.poll() is None:  # its process group (and with its first process, its process namespace)
        with contextlib.suppress(OSError):
            os.killpg(child.pid, sig)
    if sig == signal.SIGKILL and group is not None:
        group.kill()


@contextlib.contextmanager
def _stop_on_signals() -> Any:
    """SIGTERM and SIGHUP to this process end the watch through its clean-up (the run killed), not on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        raise Stopped(signal.Signals(signum).name)

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def watch(command: list[str], env: dict[str, str], spec: Spec, bounds: Bounds, watched: list[str],
          group: Optional[Group] = None, cwd: Optional[str] = None) -> int:
    """Start ``command`` (the child) with ``spec`` in its environment, relay its output, stop it where a bound is
    passed (one ``error:`` line); its exit status. Nothing of the run is left running when this returns or raises."""
    status_r, status_w = os.pipe()
    spec.status_fd, spec.parent = status_w, os.getpid()
    env = {**env, ENV: spec.to_env()}
    with _stop_on_signals():
        try:
            child = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True)
        finally:
            os.close(status_w)
        status = Status(status_r)
        threads = [threading.Thread(target=_relay, args=(os.dup(stream.fileno()), out), daemon=True)
                   for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
        for stream in (child.stdout, child.stderr):
            stream.close()
        for thread in threads:
            thread.start()
        stopped: Optional[str] = None
        interrupted: Optional[BaseException] = None
        try:
            stopped, interrupted = _watch(child, status, bounds, watched, group)
        except BaseException:
            _kill(child, group)
            raise
        finally:
            if stopped or interrupted:
                _kill(child, group)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=60)
            _kill(child, group)  # what the run left behind (a process in a session of its own)
            for thread in threads:
                thread.join(timeout=5)
            status.close()
    if not stopped and not interrupted:  # what it left: written between two counts, or just before it ended
        stopped = over_disk(usage(watched), bounds, left=True)
    if group is not None and group.oom_kills() and not stopped:
        stopped = (
            f"stopped: the run's processes and their memory files (tmpfs, memfd) reached {group.peak() / GiB:.2f} "
            f"GiB, its bound of {group.memory / GiB:.2f} GiB, and the kernel killed them "
            f"({bounds.why_rss or 'the run memory bound'})"
        )
    if stopped:
        print(f"error: {shown(stopped)}; pass --trust-recipe only if you trust the recipe's source", file=sys.stderr)
        return 2
    if interrupted is not None:
        raise interrupted
    return child.returncode


def over_disk(found: Usage, bounds: Bounds, left: bool = False) -> str:
    """Why the run is stopped for its disk use (``left``: what it left once it ended), or ""."""
    if found.entries > MAX_ENTRIES:
        return (f"stopped: the run made more than {MAX_ENTRIES} files and folders in its folders, or folders more "
                f"than {MAX_DEPTH} deep (its disk use could not be counted)")
    if found.why:
        return (f"stopped: the run's disk use could not be counted whole ({found.why}); what cannot be counted is "
                "not bounded")
    if found.bytes > bounds.disk:
        return (f"stopped: the run {'left' if left else 'held'} {found.bytes / GiB:.2f} GiB on disk (allocated "
                f"blocks), over its disk budget of {bounds.disk / GiB:.2f} GiB ({LIMIT_VARIABLES['disk']} sets it)")
    return ""


def _watch(child: subprocess.Popen, status: Status, bounds: Bounds, watched: list[str],
           group: Optional[Group]) -> tuple[Optional[str], Optional[BaseException]]:
    """Watch until the child ends; (why it was stopped, the interrupt that asked it to stop)."""
    phase, since, last_disk = "", time.monotonic(), 0.0
    grace: Optional[float] = None
    interrupted: Optional[BaseException] = None
    while child.poll() is None:
        try:
            time.sleep(0.2)
            now = time.monotonic()
            if grace is not None and now > grace:
                return None, interrupted
            current = status.poll()
            if current != phase:
                phase, since = current, now
            if phase != TRAINING and now - since > bounds.prepare:  # anything else is still preparing
                return (f"stopped: {phase or 'starting'} took longer than {bounds.prepare:.0f} s, the bound on "
                        f"preparing a run (tokenizer, data, model; {LIMIT_VARIABLES['prepare']} sets it)"), None
            held = rss(child.pid, group)
            if held > bounds.rss:  # over, counting shared pages once per process: once in all
                held = rss(child.pid, group, shared_once=True)
            if held > bounds.rss:
                return (f"stopped: the run's processes held {held / GiB:.2f} GiB of host memory, over its bound of "
                        f"{bounds.rss / GiB:.2f} GiB ({bounds.why_rss})"), None
            if now - last_disk > 5:
                last_disk = now
                if why := over_disk(usage(watched, processes(child.pid, group)), bounds):
                    return why, None
        except KeyboardInterrupt as err:
            if grace is not None:  # a second Ctrl-C: now
                return None, err
            interrupted, grace = err, time.monotonic() + GRACE_SECONDS
            _kill(child, None, signal.SIGINT)  # the run stops as Lightning stops on Ctrl-C
        except Stopped as err:
            return f"stopped: this command was asked to stop ({err}), and the run with it", None
    return None, interrupted
