"""The parent's side: judge a sent recipe, get what it needs, run it in a child the kernel confines, watch it.

``python -m lit_memory fit|validate|test|predict`` without ``--trust-recipe`` comes here (`lit_memory.__main__`):

1. the command is parsed and its values judged in this process, as every run is (`lit_memory.config.trust`: the import
   allowlist, code-running values, bounds), plus the rules only a confined run needs, the policy's launch phase
   (`lit_memory.policy`: run folders a recipe chooses, write paths, templates, free-form keyword dictionaries, logger
   names that are one path component);
2. what the child will read is fixed here: every file a recipe names lies beneath the recipe's folder or the working
   folder unless the user typed it (`lit_memory.policy.reads.inputs`), and is checked as regular files beneath
   its folder (`lit_memory.sandbox.stage`); what it names on the Hugging Face Hub is sized and fetched here into the
   run's private folder (`lit_memory.confine.hub`);
3. every folder the run writes below (the default ``lightning_logs`` too) is made beneath the working folder without
   following a link (`lit_memory.sandbox.roots`), a cgroup bounds its memory and processes
   (`lit_memory.sandbox.cgroup`), and the child is started isolated from the working folder, with only the
   environment a run needs (`lit_memory.sandbox.environment`: an allowlist), offline, with a private temporary folder
   and caches; it confines itself first thing
   (`lit_memory.sandbox.child`: namespaces, a view of only its roots, Landlock, no capabilities, seccomp);
4. the watchdog (`lit_memory.sandbox.watchdog`) relays its output, bounds its memory, disk and preparation time,
   each ending with one ``error:`` line, and leaves none of its processes behind.

Where Landlock is missing the command stops with one line; each other missing layer is one warning line
(docs/sharing.md, "Per platform").
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from huggingface_hub import constants

from lit_memory.config import trust
from lit_memory.confine import gpu, hub
from lit_memory.data import TextClassificationData
from lit_memory.errors import UserError
from lit_memory.memory.hardware.gpus import target
from lit_memory.optim.precision import runs_on_cpu
from lit_memory.planning.prediction.analytic import analytic
from lit_memory.policy import phases
from lit_memory.policy.reads import INPUTS
from lit_memory.policy.refusal import Context
from lit_memory.policy.writes import is_root
from lit_memory.run import predict_file
from lit_memory.sandbox import cgroup, child, environment, guard, landlock, namespaces, roots, rules, stage, watchdog
from lit_memory.sandbox.watchdog import LIMIT_VARIABLES
from lit_memory.sandbox.watchdog import Bounds as Limits
from lit_memory.settings import dotted_leaves

GiB = 2**30
PREPARE_SECONDS = 900.0  # tokenizer load, data read and tokenisation, before the first step
# The child's own folders, in its private one (its temporary folder and caches).
PRIVATE = ("tmp", "datasets", "inductor", "triton", "cuda", "matplotlib", "hub", "cache")
DEFAULT_ROOT = "trainer.default_root_dir (unset: the working folder's lightning_logs)"


def unsupported() -> Optional[str]:
    """Why this machine cannot confine an untrusted run (one line), or None."""
    if landlock.abi() < 1:
        return ("an untrusted run is confined by the kernel (Landlock: Linux 5.13 or later, not disabled by the "
                "container), and this machine has none, so it does not start; pass --trust-recipe only if you trust "
                "the recipe's source (docs/sharing.md)")
    return None


@dataclass
class Plan:
    spec: rules.Spec
    env: dict[str, str]
    limits: Limits
    private: Path  # the run's temporary folder and caches, removed at the end
    watched: list[str] = field(default_factory=list)  # folders whose size the disk budget covers
    made: roots.Made = field(default_factory=roots.Made)  # run folders made here (removed at the end where left empty)
    own: list[str] = field(default_factory=list)  # the write roots made new for this run: its links are checked after


def run(args: list[str], run: Any) -> int:
    """Run the command ``args`` (parsed and judged here as ``run``, a `lit_memory.cli.LitMemoryCLI`) in a confined
    child; its exit status."""
    why = unsupported()
    if why:
        raise UserError(why)
    plan = make_plan(run)
    group = None
    try:
        group, plan.spec.no_cgroup = cgroup.make(memory=cgroup_bytes(plan.limits.rss), pids=_pids())
        if group is not None:
            plan.spec.cgroups = group.procs()
            if group.pids:
                plan.spec.nproc = 0  # the group bounds the run's processes (RLIMIT_NPROC counts all of the user's)
        code = watchdog.watch(child.command(args), plan.env, plan.spec, plan.limits, plan.watched, group)
        if watchdog.over_disk(watchdog.usage(plan.watched), plan.limits):  # stopped for it: space left is freed
            for folder in _outermost(plan.made.folders):
                watchdog.remove(folder)
        return code
    finally:
        if group is not None:
            group.remove()
        watchdog.remove(str(plan.private))  # a folder the run made unreadable too
        for folder in plan.own:  # no later command follows a link the run made out of its own folder
            if removed := roots.links_out(folder):
                print(f"warning: sandbox: removed {len(removed)} link(s) the run made out of its folder {folder} "
                      f"(first: {removed[0]})", file=sys.stderr)
        roots.remove_empty(plan.made.folders)


def _outermost(folders: list[str]) -> list[str]:
    """The folders of ``folders`` not inside another of them."""
    return [f for f in folders if not any(f != o and f.startswith(o.rstrip("/") + "/") for o in folders)]


def cgroup_bytes(rss: int) -> int:
    """The kernel's memory bound for the run's group: the watchdog's resident-memory bound and a margin (page cache,
    tmpfs and memfd count there too; the watchdog says it first where resident memory grows)."""
    return rss + max(256 * 2**20, rss // 8)


# -- what the child may read and write --------------------------------------------------------------------


def make_plan(run: Any) -> Plan:
    """Judge what only a confined run needs judged, then fix what it reads and writes; nothing is made on disk
    before every check has passed."""
    settings = run.settings
    typed = run.decision  # which values the user typed (`lit_memory.config.trust.Decision.is_typed`)
    argv = run.argv or []
    work = os.path.realpath(os.getcwd())
    # The launch phase of the policy (`lit_memory.policy`): run folders, write paths, templates, files read.
    context = Context(settings, typed=lambda key, value: users(typed, argv, key, value), work=work,
                      folders=trust.recipe_folders(argv), roots=run_folders(settings, typed, create=False, argv=argv),
                      walk=lambda path, key: roots.make(path, work, key, create=False))
    phases.refuse_first(phases.refusals("launch", context))
    reads, fetches = inputs(run)
    env = environment.allowed(os.environ)  # what a run needs, nothing else (class D: no secret by another name)
    check_one_machine(settings, os.environ, distributed=_many(settings))
    connect, bind = _ports(settings, env)
    sized = (
        hub.size(fetches) if fetches and not hub.offline(dict(os.environ)) else [hub.Sized(f, None) for f in fetches]
    )
    with guard.local_only():  # estimated from what is at hand: nothing reaches the Hub here but `hub`'s listing
        size, peak = footprint(run)
    size = size or max([GiB, *(s.weights for s in sized)])
    bounds = limits(run, size, peak)
    hub.check(sized, bounds.disk)
    # Every check passed: make the run's folders, fetch what the child cannot.
    private = Path(tempfile.mkdtemp(prefix="lit_memory-run-"))
    made = roots.Made()
    try:
        for name in (*PRIVATE, "view"):
            (private / name).mkdir()
        env.update(hub.fetch(sized, private, dict(os.environ), bounds.disk, bounds.prepare))
        written = run_folders(settings, typed, create=True, made=made, argv=run.argv or [])
        if made.version is not None:  # the child's logger takes the version folder made for it
            env[roots.VERSION_VARIABLE] = str(made.version)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        roots.remove_empty(made.folders)
        raise
    if "LIT_MEMORY_STAGED_DATASET" in env:
        reads.append(env["LIT_MEMORY_STAGED_DATASET"])
    writes = [*written, *(str(private / name) for name in PRIVATE), *rules.device_write_roots()]
    _check_placeable(str(private / "view"), [*reads, *writes, os.getcwd()], private, made)
    env = child_environment(env, private, distributed=bool(connect))
    if line := gpu.uvm():  # before the device files are listed: the child's view holds only those that exist
        print(line, file=sys.stderr)
    spec = rules.Spec(read=reads, write=writes, connect=connect, bind=bind, nproc=_nproc(),
                      fsize=max(8 * GiB, 3 * size), path=rules.child_path(), inet=bool(connect), shm=_shm_bytes(bounds),
                      view=str(private / "view"), tmp=str(private / "tmp"), devices=rules.gpu_devices())
    return Plan(spec, env, bounds, private, [*written, str(private)], made, [w for w in written if w in made.folders])


def _check_placeable(view: str, paths: list[str], private: Path, made: roots.Made) -> None:
    """Every path the child binds into its view fits there (`namespaces.unplaceable`), or one error line before the
    child starts (what was made for the run removed)."""
    if (path := namespaces.unplaceable(view, paths)) is None:
        return
    shutil.rmtree(private, ignore_errors=True)
    roots.remove_empty(made.folders)
    shown = path if len(path) <= 120 else f"{path[:60]}...{path[-40:]} ({len(path)} characters)"
    raise UserError(f"refusing to run confined with {shown}: its path is too long to be placed in the sandbox's view "
                    f"of the file system (the kernel's limit, {namespaces.PATH_MAX} bytes, less {len(view)} for the "
                    f"view's own folder); move it to a shorter path, or {rules.HINT}")


def inputs(run: Any) -> tuple[list[str], list[hub.Fetch]]:
    """What the child may read (the Python installation, system files, the Hugging Face cache, the configs the parse
    read and the files the settings name, each checked), and what it names on the Hub. A file the recipe names lies
    beneath the recipe's folder or the working folder unless the user typed it (`rules.check_input`)."""
    settings, typed, argv = run.settings, run.decision, run.argv or []
    reads = [*rules.python_roots(), *rules.system_roots(), constants.HF_HUB_CACHE]
    for path in sorted(trust.files_read()):  # the configs the command names, as its parse read them
        if os.path.lexists(path):
            reads.append(str(stage.check(Path(path), "a config")))
    fetches: list[hub.Fetch] = []
    for key in INPUTS:
        value = settings.get(key)
        if key == "data.source" and isinstance(value, str) and value:
            TextClassificationData.local_file(value)  # the data module's rule: a file suffix names a local file
        local = stage.local_path(value) if isinstance(value, str) and value not in ("last", "hpc", "best") else None
        if local is not None:  # beneath the recipe's folder or the working folder: the policy's `reads.inputs`
            reads.append(str(stage.check(local, f"{key}={value}")))
        elif key == "data.source" and isinstance(value, str) and value and value != "bundled":
            fetches.append(
                hub.Fetch(key, value, "dataset", users(typed, argv, key, value), settings.get("data.subset"))
            )
        elif key.startswith("model.") and isinstance(value, str) and value and not value.startswith("bundled:"):
            fetches.append(hub.Fetch(key, value, "model", users(typed, argv, key, value)))
    return reads, fetches


def users(decision: Any, argv: Sequence[str], key: str, value: Any) -> bool:
    """Whether the user typed ``value`` for ``key``: a parse of the command line alone gives it, or they named that
    file on it (`lit_memory.policy.typed`)."""
    return decision.is_typed(key, value) or (value is not None and trust.typed_option(list(argv), key) == str(value))


def child_environment(env: dict[str, str], private: Path, distributed: bool) -> dict[str, str]:
    """The child's environment (``env``: this one's allowlisted variables, `environment.allowed`): offline, its
    temporary folder and caches in ``private``, the user's Hugging Face cache read only unless a fetch made one
    there, every Python it starts without the working folder on its path; a distributed launch's ranks meet on the
    loopback."""
    env = dict(env)
    env.setdefault("HF_HUB_CACHE", constants.HF_HUB_CACHE)  # (`hub.fetch` sets the private one where it fetched)
    env.update({
        "HF_HOME": constants.HF_HOME, "XDG_CACHE_HOME": str(private / "cache"),  # fontconfig's cache, among others
        "TMPDIR": str(private / "tmp"), "HF_DATASETS_CACHE": str(private / "datasets"),
        "TORCHINDUCTOR_CACHE_DIR": str(private / "inductor"), "TRITON_CACHE_DIR": str(private / "triton"),
        "CUDA_CACHE_PATH": str(private / "cuda"),  # CUDA's ComputeCache (its JIT's kernels)
        "MPLCONFIGDIR": str(private / "matplotlib"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONSAFEPATH": "1", "PYTHONPATH": _python_path(os.environ.get("PYTHONPATH", "")),
    })
    if distributed:  # its own network namespace holds only the loopback: the ranks meet there
        env.update({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"})
    return env


def _python_path(value: str) -> str:
    """The user's ``PYTHONPATH`` for the processes the child starts (a distributed launch's ranks run ``python -m``),
    without entries relative to or naming the working folder, with the folder lit_memory came from where it is not
    an installed package."""
    work = os.path.realpath(os.getcwd())
    entries = [p for p in value.split(os.pathsep) if p and os.path.isabs(p) and os.path.realpath(p) != work]
    root = rules.package_root()
    if root not in (os.path.realpath(p) for p in entries) and "site-packages" not in root:
        entries.append(root)
    return os.pathsep.join(entries)


def _shm_bytes(bounds: Limits) -> int:
    """The private /dev/shm: as large as the run's memory bound (its pages count there), never more than half the
    machine's memory."""
    return int(min(bounds.rss, _mem_total() // 2))


def run_folders(
    settings: Any, decision: Any, create: bool, made: Optional[roots.Made] = None, argv: Sequence[str] = (),
) -> list[str]:
    """The folders the run writes below (and whose size counts): with Lightning's default logger its own new
    ``version_N`` folder in its root's ``lightning_logs`` (the root: the working folder when none is set; made empty
    for it, `roots.new_version`, ``made.version`` its number), else its default root; loggers' and checkpoints'
    folders, and predict's output folder. Each beneath the working folder is made (``create``) or judged there without
    following a link (`lit_memory.sandbox.roots`); one elsewhere is the user's where they typed it (``argv``: the
    command line), and a recipe's is refused (`rules.check_roots`). Returns their real paths."""
    work = os.path.realpath(os.getcwd())
    named: list[tuple[str, str, bool]] = []  # (setting, path, typed)
    root = settings.get("trainer.default_root_dir")
    predict = settings.get("predictions") is not None  # predict: no logger, its file alone (`cli.instantiate_trainer`)
    versioned = settings.get("trainer.logger") in (None, True) and not predict
    if root is None:
        if not predict:
            named.append((DEFAULT_ROOT, "lightning_logs", False))
        if settings.get("trainer.logger") is False:  # checkpoints then go straight into the root
            named.append((DEFAULT_ROOT.replace("lightning_logs", "checkpoints"), "checkpoints", False))
            _check_new(os.path.join(work, "checkpoints"))
    else:
        named.append(("trainer.default_root_dir", str(root), decision.is_typed("trainer.default_root_dir", root)))
    for key, value in dotted_leaves(settings):
        if is_root(key) and key != "trainer.default_root_dir" and isinstance(value, str) and value:
            named.append((key, value, decision.is_typed(key, value)))
    if predict:  # the folder its file goes into
        named.append(predictions_folder(settings, decision, list(argv)))
    chosen = [(key, path) for key, path, typed in named if not typed and key != DEFAULT_ROOT and "unset" not in key]
    out = []
    for key, path, typed in named:
        logs = versioned and key in (DEFAULT_ROOT, "trainer.default_root_dir")  # the default logger's root
        if logs and root is not None:
            path = os.path.join(os.path.expanduser(str(path)), "lightning_logs")
        if roots.relative_to_work(path, work) is not None:
            folder = roots.make(path, work, key, made, create=create)
        elif not typed:
            rules.check_roots([(key, path)], work, rules.owned_folders())  # outside the working folder: refused
            continue
        else:  # the user's own folder elsewhere, as they named it
            folder = roots.make_elsewhere(path, made) if create else os.path.realpath(os.path.expanduser(path))
        if logs and create and made is not None:  # its own version folder, not the other runs' (nor a link by them)
            folder = roots.new_version(folder, made)
        out.append(folder)
    if not create:  # judged once, before anything is made (made, a recipe's folders exist and one may hold another)
        rules.check_roots(chosen, work, rules.owned_folders())
    return list(dict.fromkeys(out))


def _check_new(folder: str) -> None:
    """A shared folder a run without a logger writes into is new or empty: never another run's checkpoints."""
    if os.path.isdir(folder) and not os.path.islink(folder) and os.listdir(folder):
        raise UserError(f"refusing to run confined with trainer.logger=false and no trainer.default_root_dir: its "
                        f"checkpoints would go into {folder}, which holds another run's files; name a new "
                        f"--trainer.default_root_dir, or {rules.HINT}")


def predictions_folder(settings: Any, decision: Any, argv: list[str]) -> tuple[str, str, bool]:
    """(the setting, the folder predict's file goes into, whether it is the user's): theirs where they typed
    ``--output``, or, beside the model, typed the checkpoint, the model folder or the root it is beside."""
    path, _ = predict_file.destination_of(settings)

    def typed(key: str) -> bool:
        value = settings.get(key)
        return value is not None and (decision.is_typed(key, value) or trust.typed_option(argv, key) == str(value))

    if settings.get("output"):
        return "output", str(path.parent), typed("output")
    root = settings.get("trainer.default_root_dir")
    if path.parent == predict_file.beside_the_model(None, None, root):  # a model from the Hub: beneath the root
        if root is None:  # the working folder's lightning_logs, as the run's default root
            return "output (unset: lightning_logs/predict)", str(path.parent), False
        return "output (beneath trainer.default_root_dir)", str(path.parent), typed("trainer.default_root_dir")
    # Beside a checkpoint or model folder: the user's where they typed it; a recipe's is judged as a folder it chose.
    source = "ckpt_path" if settings.get("ckpt_path") else "model.model_name_or_path"
    return f"output (beside {source})", str(path.parent), typed(source)


LOOPBACK = ("127.0.0.1", "localhost", "::1", "ip6-localhost")


def check_one_machine(settings: Any, environ: Any, distributed: bool) -> None:
    """A confined run is one process tree in a network namespace of its own that holds only the loopback, whatever it
    asks: what would need the host's network is refused in one line before anything starts, never a weaker sandbox.
    ``trainer.num_nodes`` > 1 (the command line's refusal comes first, `lit_memory.confine.launchers.check`; this one
    holds for any caller of `make_plan`) and a rendezvous address off this machine (``MASTER_ADDR``)."""
    nodes = settings.get("trainer.num_nodes") or 1
    if not isinstance(nodes, int) or nodes != 1:
        raise UserError(f"refusing trainer.num_nodes={nodes}: a confined run holds one machine's processes in a "
                        f"network namespace of its own (loopback only), and a launch over several nodes meets over "
                        f"the network; {rules.HINT}")
    address = environ.get("MASTER_ADDR")
    if distributed and address and address.lower() not in LOOPBACK and not address.startswith("127."):
        raise UserError(f"refusing MASTER_ADDR={address}: a confined run's ranks meet on its own loopback (127.0.0.1) "
                        f"and reach no other address; unset it, or {rules.HINT}")


def _ports(settings: Any, env: dict[str, str]) -> tuple[list[list[int]], list[list[int]]]:
    """TCP for a distributed launch alone: its rendezvous port (the user's ``MASTER_PORT``, else one chosen here)
    and the ephemeral ports its process group connects on; none for one process."""
    if not _many(settings):
        return [], []
    port = int(env.get("MASTER_PORT") or _free_port())
    env.setdefault("MASTER_PORT", str(port))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    low, high = _ephemeral()
    ranges = [[port, port], [low, high]]
    return ranges, [[0, 0], *ranges]


def _many(settings: Any) -> bool:
    """Whether the run starts several processes that meet over TCP (a distributed launch)."""
    devices, nodes = settings.get("trainer.devices"), settings.get("trainer.num_nodes") or 1
    many = nodes > 1 or (isinstance(devices, int) and devices > 1) or (isinstance(devices, (list, str)) and
                                                                      str(devices) not in ("1", "auto", "[0]"))
    strategy = str(settings.get("trainer.strategy") or "")
    return many or bool(re.search(r"ddp|fsdp|deepspeed", strategy, re.IGNORECASE))


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


def _pids() -> int:
    """The processes and threads the run may have at once (its cgroup's pids bound): workers, ranks, their threads."""
    return max(4096, 256 * (os.cpu_count() or 1))


def _nproc() -> int:
    """The processes this user may have: as many as now, plus room for workers and ranks."""
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
    return count + max(256, 16 * (os.cpu_count() or 1))


def footprint(run: Any) -> tuple[Optional[int], Optional[int]]:
    """The model's weights and optimizer state and its predicted host-memory peak (analytic, on meta tensors, once),
    or None where it cannot say (a config not at hand)."""
    try:
        found = analytic(run.step(target("cpu")), levels=False).footprint
    except Exception:  # noqa: BLE001
        return None, None
    categories = found.phases["step"]
    return int(categories["weights"] + categories["optimizer"]), int(found.peak)


def limits(run: Any, size: int, peak: Optional[int] = None) -> Limits:
    """The watchdog's bounds: memory from the run's host-memory estimate (on a CPU its predicted peak, on a GPU the
    weights it loads) with a margin; disk from its checkpoints; preparation time. The environment's overrides win."""
    total = _mem_total()
    on_cpu = runs_on_cpu(run.settings.trainer.accelerator)
    peak = peak if on_cpu and peak else 2 * size
    ranks = _ranks(run.settings)  # each rank holds its own copy; pages they share count once (`watchdog.rss`: PSS)
    rss = min(int(0.9 * total), ranks * (3 * peak + 2 * GiB) + 4 * GiB)
    why = (f"3 x its host-memory estimate ({peak / GiB:.2f} GiB) + 2 GiB per rank ({ranks}) + 4 GiB for the runtime, "
           "at most 90 % of this machine's")
    disk = max(20 * GiB, 12 * size)
    env = os.environ
    return Limits(
        rss=int(env.get(LIMIT_VARIABLES["rss"], rss)), disk=int(env.get(LIMIT_VARIABLES["disk"], disk)),
        prepare=float(env.get(LIMIT_VARIABLES["prepare"], PREPARE_SECONDS)),
        why_rss="set by " + LIMIT_VARIABLES["rss"] if LIMIT_VARIABLES["rss"] in env else why,
    )


def _ranks(settings: Any) -> int:
    """How many processes of the run train on this machine (Lightning's launcher starts one per device)."""
    devices = settings.get("trainer.devices")
    if isinstance(devices, str):
        devices = devices.strip().strip("[]")
        devices = [d for d in devices.split(",") if d.strip()] if "," in devices else devices
        devices = int(devices) if isinstance(devices, str) and devices.isdigit() else devices
    if isinstance(devices, (list, tuple)):
        return max(len(devices), 1)
    return devices if isinstance(devices, int) and devices > 1 else 1


def _mem_total() -> int:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal:"))
        return int(line.split()[1]) * 1024
    return 16 * GiB


