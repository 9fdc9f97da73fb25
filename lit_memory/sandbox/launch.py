"""The parent's side: judge a sent recipe, get what it needs, run it in a child the kernel confines, watch it.

``python -m lit_memory fit|validate|test|predict`` without ``--trust-recipe`` comes here (`lit_memory.__main__`):

1. the command is parsed and its values judged in this process, as every run is (`lit_memory.trust`: the import
   allowlist, code-running values, bounds), plus the rules only a confined run needs (`lit_memory.sandbox.rules`:
   run folders a recipe chooses, templates, free-form keyword dictionaries);
2. what the child will read is fixed here: every file a recipe names is checked beneath its folder, regular files
   only (`lit_memory.sandbox.stage`); what it names on the Hugging Face Hub is fetched here, before confinement;
3. the child is started with the environment scrubbed of secrets, offline, with a private temporary folder and
   caches, confined first thing by Landlock (`lit_memory.sandbox.child`): reads below the Python installation,
   system libraries, the caches and its inputs; writes below its run folders and private folder; no TCP but a
   distributed launch's own;
4. a watchdog bounds what the kernel does not: the processes' memory (from the run's host-memory estimate), the
   run folders' disk use and the time spent preparing (tokenizer, data), each ending with one ``error:`` line.

The child's output is the command's output. Where Landlock is missing the command stops with one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from huggingface_hub import constants, snapshot_download

from lit_memory import trust
from lit_memory.data import TextClassificationData, load_hub_dataset
from lit_memory.errors import UserError
from lit_memory.memory.hardware.gpus import target
from lit_memory.memory.prediction.analytic import analytic
from lit_memory.precision import runs_on_cpu
from lit_memory.sandbox import landlock, rules, stage
from lit_memory.settings import leaves

GiB = 2**30
PREPARE_SECONDS = 900.0  # tokenizer load, data read and tokenisation, before the first step
SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|(^|_)KEY($|_)|APIKEY|PRIVATE)", re.IGNORECASE)
SECRET_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_", "GCP_", "GITHUB_", "GH_", "OPENAI_", "ANTHROPIC_", "WANDB_", "COMET_",
                   "NEPTUNE_", "MLFLOW_", "DATABRICKS_", "SSH_", "GPG_", "KRB5", "DOCKER_", "KUBE")
SECRET_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "NETRC", "HF_TOKEN_PATH")
# Settings that name files a run reads.
INPUTS = ("model.model_name_or_path", "model.tokenizer_name_or_path", "data.source", "data.predict_path", "ckpt_path")
# Overrides of the bounds, for the user (and the tests): the environment is theirs, never a recipe's.
LIMIT_VARIABLES = {"rss": "LIT_MEMORY_SANDBOX_RSS_BYTES", "disk": "LIT_MEMORY_SANDBOX_DISK_BYTES",
                   "prepare": "LIT_MEMORY_SANDBOX_PREPARE_SECONDS"}


def unsupported() -> Optional[str]:
    """Why this machine cannot confine an untrusted run (one line), or None."""
    if landlock.abi() < 1:
        return ("an untrusted run is confined by the kernel (Landlock: Linux 5.13 or later, not disabled by the "
                "container), and this machine has none, so it does not start; pass --trust-recipe only if you trust "
                "the recipe's source (docs/sharing.md)")
    return None


@dataclass
class Limits:
    rss: int  # bytes: the run's processes together
    disk: int  # bytes: its run folders and private folder together
    prepare: float  # seconds before the first step
    why_rss: str = ""


@dataclass
class Plan:
    spec: rules.Spec
    env: dict[str, str]
    limits: Limits
    private: Path  # the run's temporary folder and caches, removed at the end
    watched: list[str] = field(default_factory=list)  # folders whose size the disk budget covers
    made: list[str] = field(default_factory=list)  # run folders made here (removed at the end where still empty)


def scrubbed(environ: dict[str, str]) -> dict[str, str]:
    """The environment without anything that looks like a secret (tokens, keys, cloud credentials, agents)."""
    return {k: v for k, v in environ.items()
            if k not in SECRET_NAMES and not k.startswith(SECRET_PREFIXES) and not SECRET.search(k)}


def run(args: list[str], run: Any) -> int:
    """Run the command ``args`` (parsed and judged here as ``run``, a `lit_memory.cli.LitMemoryCLI`) in a confined
    child; its exit status."""
    why = unsupported()
    if why:
        raise UserError(why)
    plan = make_plan(run)
    try:
        return watch([sys.executable, "-m", "lit_memory", *args], plan)
    finally:
        shutil.rmtree(plan.private, ignore_errors=True)
        for folder in reversed(plan.made):  # made here for the run and left empty (it stopped before writing)
            _remove_empty(Path(folder))


# -- what the child may read and write --------------------------------------------------------------------


def make_plan(run: Any) -> Plan:
    """Judge what only a confined run needs judged, then fix what it reads and writes; nothing is made on disk
    before every check has passed."""
    settings = run.settings
    typed = run.decision  # which values the user typed (`lit_memory.trust.Decision.is_typed`)
    chosen = {k: v for k, v in leaves(settings) if not typed.is_typed(k, v)}  # what the recipe chose
    rules.check_templates(chosen)
    rules.check_free_kwargs(chosen)
    reads = [*rules.python_roots(), *rules.system_roots(), *_hub_cache()]
    for path in sorted(trust.files_read()):  # the configs the command names, as its parse read them
        if os.path.lexists(path):
            reads.append(str(stage.check(Path(path), "a config")))
    hub_data, hub_models = None, []
    for key in INPUTS:
        value = settings.get(key)
        if key == "data.source" and isinstance(value, str) and value:
            TextClassificationData.local_file(value)  # the data module's rule: a file suffix names a local file
        local = stage.local_path(value) if isinstance(value, str) and value not in ("last", "hpc", "best") else None
        if local is not None:
            reads.append(str(stage.check(local, f"{key}={value}")))
        elif key == "data.source" and isinstance(value, str) and value and value != "bundled":
            hub_data = value
        elif key.startswith("model.") and isinstance(value, str) and value and not value.startswith("bundled:"):
            hub_models.append(value)
    folders = run_folders(settings, typed)
    rules.check_write_paths(chosen, folders)
    env = scrubbed(dict(os.environ))
    connect, bind = _ports(settings, env)
    size = _state_bytes(run)
    bounds = limits(run, size)
    # Every check passed: fetch what the child cannot, and make its folders.
    for name in hub_models:
        _fetch_model(name)
    private = Path(tempfile.mkdtemp(prefix="lit_memory-run-"))
    for name in ("tmp", "datasets", "inductor", "triton", "matplotlib"):
        (private / name).mkdir()
    status = private / "status"
    status.touch()
    if hub_data is not None:
        try:
            env["LIT_MEMORY_STAGED_DATASET"] = str(_fetch_dataset(hub_data, settings.get("data.subset"), private))
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
        reads.append(env["LIT_MEMORY_STAGED_DATASET"])
    made = make_folders(folders)
    writes = [*folders, str(private), *rules.device_write_roots()]
    env.update({
        "TMPDIR": str(private / "tmp"), "HF_DATASETS_CACHE": str(private / "datasets"),
        "TORCHINDUCTOR_CACHE_DIR": str(private / "inductor"), "TRITON_CACHE_DIR": str(private / "triton"),
        "MPLCONFIGDIR": str(private / "matplotlib"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONDONTWRITEBYTECODE": "1",
    })
    spec = rules.Spec(read=reads, write=writes, connect=connect, bind=bind, nproc=_nproc(), fsize=max(8 * GiB, 3 * size),
                      status=str(status))
    env[rules.ENV] = spec.to_env()
    return Plan(spec, env, bounds, private, [*folders, str(private)], made)


def run_folders(settings: Any, decision: Any) -> list[str]:
    """The folders the run writes below (and whose size counts), and those made here: its default root (the working
    folder's ``lightning_logs`` when none is set), loggers' and checkpoints' folders. One a recipe chose (not typed)
    is judged by `rules.check_roots`; the user's own are theirs."""
    work = os.getcwd()
    chosen: list[tuple[str, str]] = []
    writes: list[str] = []
    root = settings.get("trainer.default_root_dir")
    if root is None:
        writes.append(os.path.join(work, "lightning_logs"))
        if settings.get("trainer.logger") is False:  # checkpoints then go straight into the root
            writes.append(os.path.join(work, "checkpoints"))
    elif decision.is_typed("trainer.default_root_dir", root):
        writes.append(str(root))
    else:
        chosen.append(("trainer.default_root_dir", str(root)))
    for key, value in leaves(settings):
        if key.rsplit(".", 1)[-1] in ("save_dir", "dirpath", "log_dir", "output_dir") and isinstance(value, str) and value:
            (writes.append(value) if decision.is_typed(key, value) else chosen.append((key, value)))
    rules.check_roots(chosen, work, rules.owned_folders())
    writes += [path for _, path in chosen]
    return list(dict.fromkeys(os.path.realpath(os.path.expanduser(w)) for w in writes))


def make_folders(folders: list[str]) -> list[str]:
    """Make the run's folders (the kernel needs them to exist to grant them); returns those made here."""
    made = []
    for folder in folders:
        missing = []
        probe = Path(folder)
        while not probe.exists():
            missing.append(str(probe))
            probe = probe.parent
        os.makedirs(folder, exist_ok=True)
        made += reversed(missing)
    return made


def _remove_empty(folder: Path) -> None:
    """``folder`` and the empty folders below it, where nothing but empty folders is there."""
    if not folder.is_dir() or folder.is_symlink():
        return
    for child in folder.iterdir():
        _remove_empty(child)
    with contextlib.suppress(OSError):
        folder.rmdir()


def _hub_cache() -> list[str]:
    return [constants.HF_HUB_CACHE]


def _fetch_model(name: str) -> None:
    """The model or tokenizer a recipe names on the Hub, fetched here (the child runs offline). Fixed code: the
    weights, config and tokenizer files a classifier needs, nothing that runs code."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return
    with contextlib.suppress(Exception):  # not on the Hub, no network: the child says so in its own words
        snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*", "*.tiktoken"])


def _fetch_dataset(name: str, subset: Optional[str], private: Path) -> Path:
    """A hub dataset, read here and saved into the run's private folder, which the child reads (offline)."""
    target = private / "dataset"
    try:
        load_hub_dataset(name, subset).save_to_disk(str(target))
    except Exception as err:  # noqa: BLE001
        raise UserError(f"cannot load dataset {name!r}{f' ({subset})' if subset else ''}: {str(err).splitlines()[0]}") from None
    return target


def _ports(settings: Any, env: dict[str, str]) -> tuple[list[list[int]], list[list[int]]]:
    """TCP for a distributed launch alone: its rendezvous port (the user's ``MASTER_PORT``, else one chosen here)
    and the ephemeral ports its process group connects on; none for one process."""
    devices, nodes = settings.get("trainer.devices"), settings.get("trainer.num_nodes") or 1
    many = nodes > 1 or (isinstance(devices, int) and devices > 1) or (isinstance(devices, (list, str)) and
                                                                      str(devices) not in ("1", "auto", "[0]"))
    strategy = str(settings.get("trainer.strategy") or "")
    if not many and not re.search(r"ddp|fsdp|deepspeed", strategy, re.IGNORECASE):
        return [], []
    port = int(env.get("MASTER_PORT") or _free_port())
    env.setdefault("MASTER_PORT", str(port))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    low, high = _ephemeral()
    ranges = [[port, port], [low, high]]
    return ranges, [[0, 0], *ranges]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _nproc() -> int:
    """The processes this user may have: as many as now, plus room for workers and ranks."""
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
    return count + max(256, 16 * (os.cpu_count() or 1))


def _state_bytes(run: Any) -> int:
    """The model's weights and optimizer state (analytic, on meta tensors), or a gigabyte where it cannot say."""
    try:
        categories = analytic(run.step(target("cpu")), levels=False).footprint.phases["step"]
        return int(categories["weights"] + categories["optimizer"])
    except Exception:  # noqa: BLE001
        return GiB


def limits(run: Any, size: int) -> Limits:
    """The watchdog's bounds: memory from the run's host-memory estimate (on a CPU its predicted peak, on a GPU the
    weights it loads) with a margin; disk from its checkpoints; preparation time. The environment's overrides win."""
    total = _mem_total()
    try:
        on_cpu = runs_on_cpu(run.settings.trainer.accelerator)
        peak = analytic(run.step(target("cpu")), levels=False).footprint.peak if on_cpu else 2 * size
    except Exception:  # noqa: BLE001
        peak = 2 * size
    rss = min(int(0.9 * total), 3 * peak + 6 * GiB)
    why = f"3 x its host-memory estimate ({peak / GiB:.2f} GiB) + 6 GiB for the runtime, at most 90 % of this machine's"
    disk = max(20 * GiB, 12 * size)
    env = os.environ
    return Limits(
        rss=int(env.get(LIMIT_VARIABLES["rss"], rss)), disk=int(env.get(LIMIT_VARIABLES["disk"], disk)),
        prepare=float(env.get(LIMIT_VARIABLES["prepare"], PREPARE_SECONDS)),
        why_rss="set by " + LIMIT_VARIABLES["rss"] if LIMIT_VARIABLES["rss"] in env else why,
    )


def _mem_total() -> int:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal:"))
        return int(line.split()[1]) * 1024
    return 16 * GiB


# -- the child, watched ---------------------------------------------------------------------------------


def watch(command: list[str], plan: Plan) -> int:
    """Start the child, relay its output, stop it where a bound is passed (one ``error:`` line); its exit status."""
    relay = not _is_terminal()
    pipe = subprocess.PIPE if relay else None
    child = subprocess.Popen(command, env=plan.env, stdout=pipe, stderr=pipe, start_new_session=True)
    threads = [threading.Thread(target=_relay, args=(stream, out), daemon=True)
               for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)) if stream is not None]
    for thread in threads:
        thread.start()
    stopped: Optional[str] = None
    started, phase, since, last_disk = time.monotonic(), "", time.monotonic(), 0.0
    try:
        while child.poll() is None:
            time.sleep(0.2)
            now = time.monotonic()
            current = _last_phase(plan.spec.status)
            if current != phase:
                phase, since = current, now
            if (phase.startswith("preparing") or not phase) and now - since > plan.limits.prepare:
                stopped = (f"stopped: {phase or 'starting'} took longer than {plan.limits.prepare:.0f} s, the bound on "
                           f"preparing a run (tokenizer, data, model; {LIMIT_VARIABLES['prepare']} sets it)")
                break
            rss = _tree_rss(child.pid)
            if rss > plan.limits.rss:
                stopped = (f"stopped: the run's processes held {rss / GiB:.2f} GiB of host memory, over its bound of "
                           f"{plan.limits.rss / GiB:.2f} GiB ({plan.limits.why_rss})")
                break
            if now - last_disk > 5:
                last_disk = now
                used = sum(_size(folder) for folder in plan.watched)
                if used > plan.limits.disk:
                    stopped = (f"stopped: the run wrote {used / GiB:.2f} GiB, over its disk budget of "
                               f"{plan.limits.disk / GiB:.2f} GiB ({LIMIT_VARIABLES['disk']} sets it)")
                    break
    except KeyboardInterrupt:
        _kill(child, signal.SIGINT)
        raise
    if stopped:
        _kill(child, signal.SIGKILL)
    child.wait()
    for thread in threads:
        thread.join(timeout=5)
    del started
    if stopped:
        print(f"error: {stopped}; pass --trust-recipe only if you trust the recipe's source", file=sys.stderr)
        return 2
    return child.returncode


def _is_terminal() -> bool:
    try:
        return sys.stdout.isatty() and sys.stdout.fileno() == 1 and sys.stderr.fileno() == 2
    except (AttributeError, ValueError, OSError):
        return False


def _relay(stream: Any, out: Any) -> None:
    for line in iter(stream.readline, b""):
        out.write(line.decode("utf-8", errors="replace"))
        out.flush()


def _last_phase(path: str) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


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


def _tree_rss(pid: int) -> int:
    total = 0
    for process in _children(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{process}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total


def _size(folder: str) -> int:
    total = 0
    for base, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(base, name)).st_size
    return total


def _kill(child: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(child.pid, sig)
