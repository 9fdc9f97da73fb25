"""What an untrusted run meets on this machine's GPU, each probe in a child confined exactly as an untrusted run's is
(issue 57, item 7), plus README's main job (a shipped recipe: no sandbox) and one untrusted tiny fit (confined).

Each probe goes through the project's own launch path: ``python -m lit_memory fit --config SENT`` (SENT: a copy of
recipes/4gb.yaml with a comment line, so nobody trusted it) enters `lit_memory.__main__.main`, which judges it,
builds the confinement (`lit_memory.confine.launch.make_plan`: the spec, the scrubbed environment, the private
temporary folder and caches, the cgroup) and watches the child (`lit_memory.sandbox.watchdog`). The one thing
changed is the child's command (`lit_memory.sandbox.child.command`): the child still runs `child.main`, confines
itself in full and says which layers are missing, and then runs the probe where it would have run the fit. The
two-rank probe's plan is that of ``--trainer.devices 2`` (the rendezvous and ephemeral ports a launch of two ranks
is granted). Probes (`PROBES`):

- ``cuda``: the earlier probe's steps: CUDA starts, a matmul, NVML, transformers' PreTrainedModel, lit_memory.model;
- ``compile``: ``torch.compile`` of a small function (inductor: Triton kernels on CUDA, C++ on a CPU, both built
  with the machine's C compiler, in the run's private caches), checked against eager;
- ``bnb``: one step of bitsandbytes' ``AdamW8bit`` on a Linear (its 8-bit state checked);
- ``group``: two processes in one process group (NCCL where there is a GPU per rank, else gloo) doing one
  ``all_reduce`` over the loopback, as Lightning's own launcher's ranks meet inside one sandbox;
- ``profiler``: ``torch.profiler`` around a few ops (CUPTI on CUDA), its Chrome trace written to the private folder.

Each is bounded by the watchdog's preparation bound (``--seconds``, 45 by default: the child never reaches a training
phase) and prints one line (``probe NAME: ok|fail|skipped|not run SECONDS s: detail or the error's last line``); the
record (`RECORD`, in ``--out``, default ``$OUT`` or the working folder) is rewritten after every probe and fit.
Without CUDA every probe is skipped ("no CUDA") unless ``--rehearse`` (or ``REHEARSE=1``): the same probes, confined
the same way, on their CPU equivalents (inductor's C++ path, gloo, the CPU profiler, bitsandbytes' CPU step where it
imports), which proves the plumbing on a machine without a GPU.

    python examples/gpu_sandbox_probe.py --fits --deadline 200      # a lent GPU's call (examples/gpu_speed.sh)
    REHEARSE=1 python examples/gpu_sandbox_probe.py --probes compile,bnb,group,profiler --fits   # on a CPU
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBES = ("cuda", "compile", "bnb", "group", "profiler")
SECONDS = 45.0  # each probe, from the child's start (after the machine's first CUDA use: gpu_speed.sh's machine.txt)
FIT_SECONDS = {"main job": 150.0, "confined fit": 120.0}
RECORD = "sandbox-probe.json"
RESULT = "probe-result "  # the child's one result line: RESULT + JSON
CONFINED = "sandbox: running confined"  # the line an untrusted run prints first (`lit_memory.config.trusted`)
SHIPPED = "4gb.yaml"  # README's main job's recipe; its copy with a comment line is the untrusted one
REHEARSAL_FIT = ["--trainer.max_steps=2", "--data.limit_train_samples=64", "--trainer.limit_val_batches=2",
                 "--trainer.limit_test_batches=2"]
TINY_FIT = ["--trainer.max_steps=2", "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2"]

# The probes, run in the confined child where `child.main` would run ``python -m lit_memory`` (`_child_command`).
CHILD = r'''
import json, os, sys, time, traceback

name, device = sys.argv[1], sys.argv[2]


def cuda():  # the earlier probe's steps, a line each (`lit_memory.tools.proof.probe_steps` reads them)
    import torch
    failed = []

    def step(label, fn):
        try:
            print(label, "ok", fn(), flush=True)
        except BaseException:
            failed.append(label)
            print(label, "FAILED", flush=True)
            traceback.print_exc(file=sys.stdout)

    if device == "cuda":
        step("cuda", lambda: (torch.cuda.is_available(), torch.cuda.device_count()))

        def nvml():
            import pynvml
            pynvml.nvmlInit()
            return pynvml.nvmlDeviceGetCount()

        step("matmul", lambda: float((torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")).sum()))
        step("nvml", nvml)
    else:
        step("matmul", lambda: float((torch.ones(64, 64) @ torch.ones(64, 64)).sum()))
    step("transformers", lambda: __import__("transformers").PreTrainedModel.__name__)
    step("lit_memory.model", lambda: __import__("lit_memory.model", fromlist=["x"]).SequenceClassifier.__name__)
    if failed:
        raise RuntimeError("failed: " + ", ".join(failed))
    return "every step ok"


def compiled():
    import torch

    def f(x, y):
        return torch.nn.functional.gelu(x @ y) * torch.sigmoid(y).sum(dim=0)

    x, y = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
    out = torch.compile(f)(x, y)  # inductor: Triton on CUDA, C++ on a CPU; built in the run's private caches
    torch.testing.assert_close(out, f(x, y), rtol=1e-3, atol=1e-3)
    caches = {k: sum(len(files) for _, _, files in os.walk(os.environ[k]))
              for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if os.environ.get(k)}
    return f"inductor on {device}, matches eager; files in the private caches: {caches}"


def bnb():
    import torch
    try:
        import bitsandbytes
    except Exception as err:  # noqa: BLE001  one line: what is missing, not a failure of the sandbox
        return "skipped: bitsandbytes does not import (" + (str(err).splitlines() or [type(err).__name__])[0] + ")"
    layer = torch.nn.Linear(256, 256, device=device)
    step = bitsandbytes.optim.AdamW8bit(layer.parameters(), lr=1e-3, min_8bit_size=0)  # 0: this small weight too
    before = layer.weight.detach().clone()
    layer(torch.randn(8, 256, device=device)).square().mean().backward()
    step.step()
    state = step.state[layer.weight]["state1"]
    assert state.dtype == torch.uint8, state.dtype
    assert not torch.equal(before, layer.weight.detach()), "the step changed nothing"
    return f"bitsandbytes {bitsandbytes.__version__} AdamW8bit step on {device}, 8-bit state"


RANK = """
import datetime, sys, torch, torch.distributed as dist
backend, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group(backend, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
where = f"cuda:{rank}" if backend == "nccl" else "cpu"
value = torch.full((4,), float(rank + 1), device=where)
dist.all_reduce(value)
assert value.tolist() == [3.0] * 4, value
dist.destroy_process_group()
"""


def group():
    import subprocess
    import torch
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    backend = "nccl" if gpus >= 2 else "gloo"  # NCCL refuses two ranks on one GPU
    # as Lightning's launcher starts its ranks: a fresh Python each, the run's environment (MASTER_ADDR/PORT)
    env = dict(os.environ)  # a one-rank run's plan sets no rendezvous: the ranks then try a port of their own
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29533")
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, backend, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]
    ends = time.monotonic() + 30
    while time.monotonic() < ends and any(r.poll() is None for r in ranks):
        if any(r.poll() for r in ranks):  # one rank failed: the other would wait for it until its timeout
            break
        time.sleep(0.1)
    for r in ranks:
        if r.poll() is None:
            r.kill()
    out = [r.communicate()[0] for r in ranks]
    codes = [r.returncode for r in ranks]
    if any(codes):
        print("".join(out), flush=True)
        said = [[line for line in o.splitlines() if "Error" in line] or o.strip().splitlines()[-1:] for o in out]
        raise RuntimeError(f"ranks ended {codes}: " + " | ".join(lines[-1].strip() for lines in said if lines))
    why = "" if backend == "nccl" else f" ({gpus} GPU: NCCL needs one per rank)" if device == "cuda" else ""
    return f"2 ranks, {backend}{why}, all_reduce over {env['MASTER_ADDR']}:{env['MASTER_PORT']}"


def profiled():
    import torch
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    x = torch.randn(256, 256, device=device)
    with profile(activities=activities) as prof:
        for _ in range(3):
            x = (x @ x).relu()
            x = x / x.norm()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    timed = [e for e in events if getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) > 0]
    if device == "cuda" and not timed:
        raise RuntimeError("no operator has device time: CUPTI recorded no kernel")
    trace = os.path.join(os.environ.get("TMPDIR", "/tmp"), "probe.trace.json")
    prof.export_chrome_trace(trace)
    return f"{len(events)} operators, {len(timed)} with device time; Chrome trace {os.path.getsize(trace)} bytes"


started = time.monotonic()
try:
    detail = {"cuda": cuda, "compile": compiled, "bnb": bnb, "group": group, "profiler": profiled}[name]()
    status = "skipped" if str(detail).startswith("skipped: ") else "ok"
    error = None
except BaseException as err:  # noqa: BLE001
    traceback.print_exc(file=sys.stdout)
    status, detail = "fail", None
    error = (traceback.format_exception_only(type(err), err)[-1].strip())[:500]
print("probe-result " + json.dumps({"probe": name, "status": status, "detail": detail, "error": error,
                                    "child_s": round(time.monotonic() - started, 1)}), flush=True)
sys.stdout.flush()
os._exit(0 if status != "fail" else 1)  # no interpreter teardown to wait on (CUDA, compile workers)
'''
# The child's boot: `child.main` as every confined run's (`lit_memory.sandbox.child.BOOT`), its last step (running
# ``python -m lit_memory``) replaced by the probe.
PRELUDE = ("import runpy\n"
           "runpy.run_module = lambda *a, **k: exec(compile({code!r}, '<probe>', 'exec'),"
           " {{'__name__': '__probe__'}})\n")


class Tee:
    """A stream that writes through and keeps a copy (the watchdog relays the child's output to sys.stdout/stderr)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.parts = stream, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def text(self) -> str:
        return "".join(self.parts)


@contextlib.contextmanager
def captured() -> Iterator[Tee]:
    out, err = Tee(sys.stdout), Tee(sys.stderr)
    err.parts = out.parts  # one transcript, in the order written
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        yield out
    finally:
        sys.stdout, sys.stderr = saved


def _child_command(name: str, device: str):
    from lit_memory.sandbox import child
    from lit_memory.sandbox.rules import ENV

    def command(args: list[str]) -> list[str]:
        return [sys.executable, "-I", "-B", "-c", PRELUDE.format(code=CHILD) + child.BOOT.format(env=ENV),
                name, device]

    return command


def sent_recipe(work: Path) -> Path:
    """A shipped recipe as someone would send it: the same text with a comment line, so nobody trusted it."""
    path = work / "sent" / "sent.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# sent by someone: not byte-identical to a shipped recipe, so it runs confined\n"
                    + (ROOT / "recipes" / SHIPPED).read_text(encoding="utf-8"), encoding="utf-8")
    return path


def probe_args(name: str, sent: Path, device: str, gpus: int) -> list[str]:
    """The untrusted command whose confinement the probe gets: the sent recipe's fit; for the two ranks, with
    ``--trainer.devices 2`` (on CPU ranks where the machine has no GPU per rank, as the probe's gloo group is)."""
    args = ["fit", "--config", str(sent.relative_to(sent.parents[1]))]
    if name == "group":
        args.append("--trainer.devices=2")
        if device != "cuda" or gpus < 2:
            args.append("--trainer.accelerator=cpu")
    elif device != "cuda":
        args.append("--trainer.accelerator=cpu")
    return args


def run_probe(name: str, args: list[str], device: str, seconds: float) -> dict[str, Any]:
    """One probe in a child launched by ``python -m lit_memory ARGS``'s own path, the child's command replaced."""
    from lit_memory import __main__ as entry
    from lit_memory.sandbox import child
    from lit_memory.sandbox.watchdog import LIMIT_VARIABLES

    started = time.monotonic()
    code: Any = 0
    with mock.patch.dict(os.environ, {LIMIT_VARIABLES["prepare"]: f"{seconds:.0f}"}), \
            mock.patch.object(child, "command", _child_command(name, device)), captured() as transcript:
        try:
            entry.main(args)
        except SystemExit as exit_:
            code = exit_.code
        except Exception as err:  # noqa: BLE001  the launch path itself failed: the record says how
            print(f"error: the launch raised {type(err).__name__}: {err}", file=sys.stderr)
            code = 1
    return judge(name, transcript.text(), code, time.monotonic() - started)


def judge(name: str, text: str, code: Any, seconds: float) -> dict[str, Any]:
    """A probe's row from its transcript: the child's result line, whether the run said it was confined, the layers
    the child said were missing, and where there is no result, the last error line (the watchdog's bound, the
    launch's refusal) or the transcript's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    result = next((json.loads(line[len(RESULT):]) for line in reversed(lines) if line.startswith(RESULT)), None)
    row: dict[str, Any] = {
        "probe": name, "seconds": round(seconds, 1), "exit": code,
        "confined": any(line.startswith(CONFINED) for line in lines),
        "missing_layers": sorted({m.group(1) for line in lines
                                  if (m := re.match(r"warning: sandbox: no (\S+) layer here", line))}),
    }
    if result is None:
        errors = [line for line in lines if line.startswith("error:")]
        last = errors[-1] if errors else lines[-1] if lines else f"no output (exit status {code})"
        row.update(status="fail", error=last[:500], detail=None)
    else:
        row.update(status=result["status"], detail=result["detail"], error=result["error"], child_s=result["child_s"])
    if row["status"] != "fail" and not row["confined"]:
        row.update(status="fail", error="the child was not confined: no 'sandbox: running confined' line")
    return row


def line_of(row: dict[str, Any]) -> str:
    seconds = f" {row['seconds']:.1f} s" if row.get("seconds") is not None else ""
    tail = row.get("error") if row["status"] == "fail" else row.get("detail")
    return f"{row.get('probe') or row.get('fit')}: {row['status']}{seconds}" + (f": {tail}" if tail else "")


def readme_main_job() -> list[str]:
    """README's main job: the ``python -m lit_memory`` part of its first code block's command."""
    block = re.search(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    if block is None:
        raise SystemExit("error: README.md has no bash code block")
    for part in block.group(1).split("&&"):
        words = shlex.split(part)
        if words[:3] == ["python", "-m", "lit_memory"]:
            return words[3:]
    raise SystemExit("error: README.md's first code block runs no `python -m lit_memory` command")


def run_fit(name: str, args: list[str], cwd: Path, seconds: float, confined: bool) -> dict[str, Any]:
    """``python -m lit_memory ARGS`` in a fresh process, bounded: it trains (exit status 0, a model exported) and is
    confined or not as ``confined`` says (the first line an untrusted run prints)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("LIT_MEMORY_SANDBOX", None)
    command = [sys.executable, "-m", "lit_memory", *args]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=seconds)
        text, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as err:
        text = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        code = f"stopped after {seconds:.0f} s"
    took = time.monotonic() - started
    sys.stdout.write(text[-20000:])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = any(line.startswith(CONFINED) for line in lines)
    exported = next((line for line in lines if line.startswith("hf_model:")), None)
    row: dict[str, Any] = {"fit": name, "command": shlex.join(["python", "-m", "lit_memory", *args]), "cwd": str(cwd),
                           "seconds": round(took, 1), "exit": code, "confined": said,
                           "val": next((line for line in lines if line.startswith("val:")), None)}
    errors = [line for line in lines if line.startswith("error:")]
    last = (errors or lines or [f"exit status {code}"])[-1][:500]
    if confined and launch_unsupported():  # without Landlock the untrusted fit must be refused in one line
        refusal = "error: an untrusted run is confined by the kernel"
        if code == 2 and len(errors) == 1 and errors[0].startswith(refusal):
            row.update(status="ok", detail="refused: " + errors[0][:300])
        else:
            row.update(status="fail", error=last)
    elif code != 0 or exported is None:
        row.update(status="fail", error=last)
    elif said != confined:
        row.update(status="fail", error=f"expected {'a' if confined else 'no'} '{CONFINED}' line")
    else:
        row.update(status="ok", detail=f"{'confined' if said else 'not confined'}; {exported[:200]}")
    return row


class Record:
    """The JSON record, rewritten after every probe and fit (a call cut short keeps what it ran)."""

    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        self.path, self.data = path, {**info, "probes": [], "fits": []}
        self.save()

    def add(self, kind: str, row: dict[str, Any]) -> None:
        self.data[kind].append(row)
        print(("probe " if kind == "probes" else "fit ") + line_of(row), flush=True)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.path)


def launch_unsupported() -> Optional[str]:
    """Why this machine cannot confine an untrusted run (`lit_memory.confine.launch.unsupported`), or None."""
    from lit_memory.confine import launch

    return launch.unsupported()


def machine(device: str) -> dict[str, Any]:
    import torch

    from lit_memory.sandbox import landlock, rules

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "landlock_abi": landlock.abi(),
            "gpu_devices": rules.gpu_devices(), "c_compiler": os.environ.get("CC") or shutil.which("cc")
            or shutil.which("gcc")}
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count())
    return info


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rehearse", action="store_true", default=bool(os.environ.get("REHEARSE")),
                        help="without CUDA, run the probes on their CPU equivalents (also REHEARSE=1)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."), help="where the record goes")
    parser.add_argument("--probes", default=",".join(PROBES), help=f"comma-separated, of {', '.join(PROBES)}")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="each probe's bound, from its child's start")
    parser.add_argument("--fits", action="store_true",
                        help="then README's main job (shipped: unconfined) and a 2-step fit of its sent copy "
                        "(confined)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for all of it: a step gets at most what is left, and none starts with under 10")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.probes.split(",") if n.strip()]
    if unknown := [n for n in names if n not in PROBES]:
        parser.error(f"unknown probe {', '.join(unknown)}; choose from {', '.join(PROBES)}")
    start = time.monotonic()

    def left(bound: float) -> float:
        return bound if args.deadline is None else min(bound, args.deadline - (time.monotonic() - start))

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = "gpu" if device == "cuda" else "rehearsal" if args.rehearse else "no CUDA"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    record = Record(args.out / RECORD, {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "mode": mode,
        "command": shlex.join(["python", "examples/gpu_sandbox_probe.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "seconds_per_probe": args.seconds, "machine": machine(device)})
    print(f"sandbox probe: {mode}; landlock abi {record.data['machine']['landlock_abi']}, "
          f"GPU devices {record.data['machine']['gpu_devices']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="lit_memory-probe-"))
    here = os.getcwd()
    try:
        sent = sent_recipe(work)
        unconfinable = launch_unsupported()  # no Landlock: an untrusted run is refused in one line, none probed
        for name in names:
            if mode == "no CUDA" or unconfinable:
                why = "no CUDA" if mode == "no CUDA" else unconfinable
                record.add("probes", {"probe": name, "status": "skipped", "detail": f"skipped: {why}"})
                continue
            bound = left(args.seconds)
            if bound < 10:
                record.add("probes", {"probe": name, "status": "not run", "detail": f"{max(bound, 0):.0f} s left"})
                continue
            os.chdir(work)  # the run's folders (lightning_logs) are made beneath the working folder
            try:
                record.add("probes", run_probe(name, probe_args(name, sent, device, gpus), device, bound))
            finally:
                os.chdir(here)
        if args.fits:
            # the confined fit first: a GPU run of ours confined is what no lent machine has shown yet
            fits = [("confined fit", ["fit", "--config", "sent/sent.yaml", *TINY_FIT,
                                      *([] if mode == "gpu" else REHEARSAL_FIT[1:2])], work, True),
                    ("main job", readme_main_job() + ([] if mode == "gpu" else [
                        *REHEARSAL_FIT, f"--trainer.default_root_dir={work / 'main'}"]), ROOT, False)]
            for name, fit_args, cwd, confined in fits:
                bound = left(FIT_SECONDS[name])
                if mode == "no CUDA" or bound < 10:
                    why = "skipped: no CUDA" if mode == "no CUDA" else f"{max(bound, 0):.0f} s left"
                    record.add("fits", {"fit": name, "status": "skipped" if mode == "no CUDA" else "not run",
                                        "detail": why})
                    continue
                record.add("fits", run_fit(name, fit_args, cwd, bound, confined))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record.data["seconds"] = round(time.monotonic() - start, 1)
    record.save()
    rows = record.data["probes"] + record.data["fits"]
    print(f"sandbox probe: {sum(r['status'] == 'ok' for r in rows)} ok, {sum(r['status'] == 'fail' for r in rows)} "
          f"failed of {len(rows)}, {time.monotonic() - start:.0f} s; record {record.path}", flush=True)
    return 1 if any(r["status"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
