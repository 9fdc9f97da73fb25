"""Shared fixtures: tiny data files and fast CLI runs on the bundled model."""

from __future__ import annotations

import csv
import json
import os
import tempfile
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The trust store (`lit_memory.config.trusted`): the tests' own, never the user's ~/.config.
os.environ["LIT_MEMORY_CONFIG_DIR"] = tempfile.mkdtemp(prefix="lit_memory-config-")


# Under pytest-xdist each worker takes its share of the cores for torch's intra-op threads, and the processes its
# tests start take as many (OMP_NUM_THREADS): two workers of two threads each on two cores oversubscribed them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
CONFIGS = REPO / "configs"
# Recipes whose layers compile (model.compile): inductor's C++ code generation takes minutes on a CPU, so the tests
# that fit every recipe leave them to tests/run/test_compiling.py (the same recipes, trained with dynamo on a cheap
# backend).
COMPILED = frozenset(p.stem for p in RECIPES.glob("*.yaml") if "\n  compile: " in p.read_text())

# The test files that take longest on the 2-core CPU (`pytest --durations`), longest first.
# They are collected first, so that xdist's file scheduling (README: ``--dist loadfile --no-loadscope-reorder``)
# starts each worker on one of them and fills in with the short files: with the long files last, one worker
# ran them alone for the last half of the run. (xdist's own reordering sorts files by how many tests they hold.)
LONGEST_FIRST = (
    "confine/test_launchers.py", "run/test_checks.py", "test_strategies.py", "config/test_trust.py",
    "run/test_resume.py", "run/test_monitor.py",
    "hf/test_anatomy.py", "tools/test_plan.py", "test_task.py", "test_cli.py", "test_sandbox.py",
    "tools/test_recipe_headers.py", "tools/test_bench.py", "optim/test_lowbit.py", "sandbox/test_guard.py",
    "tools/test_proof.py", "test_fabric.py", "run/test_predict_file.py", "planning/prediction/test_analytic.py",
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A test leaves no launcher's variables behind (it checks, restores nothing): Lightning's launchers set them
    in the process that builds a Trainer and leave them there, and a later test's 2-process run inheriting
    ``LOCAL_RANK`` starts no second rank and waits for it (`lit_memory.run.environment`). A test that builds a
    Trainer outside ``LitMemoryCLI.scope()`` holds ``environment.restored()``."""
    from lit_memory.run.environment import LAUNCHER_VARIABLES

    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    outcome = yield
    left = {name: value for name in LAUNCHER_VARIABLES if (value := os.environ.get(name)) != before[name]}
    if left and outcome.excinfo is None:
        raise AssertionError(f"this test left {left} in the environment: hold lit_memory.run.environment.restored()")


def pytest_collection_modifyitems(items: list) -> None:
    order = {name: rank for rank, name in enumerate(LONGEST_FIRST)}

    def rank(item) -> int:
        return order.get(Path(str(item.fspath)).relative_to(REPO / "tests").as_posix(), len(order))

    items.sort(key=rank)  # stable: each file's own order is kept


POSITIVE = [
    "great hotel, friendly staff",
    "lovely clean room",
    "excellent breakfast",
    "would stay again",
    "superb view",
]
NEGATIVE = ["dirty room and rude staff", "terrible noise all night", "awful breakfast", "never again", "broken shower"]


def rows(n: int = 40, text: str = "review", label: str = "label", as_names: bool = False) -> list[dict]:
    out = []
    for i in range(n):
        positive = i % 2 == 0
        pool = POSITIVE if positive else NEGATIVE
        value = ("positive" if positive else "negative") if as_names else int(positive)
        out.append({text: f"{pool[i % len(pool)]} #{i}", label: value})
    return out


def write_csv(path: Path, data: list[dict], sep: str = ",") -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(data[0]), delimiter=sep)
        writer.writeheader()
        writer.writerows(data)
    return path


def write_jsonl(path: Path, data: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in data) + "\n", encoding="utf-8")
    return path


# Overrides that make any recipe a seconds-long smoke run on the bundled model.
FAST = [
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=2",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false",
    "--data.limit_train_samples=64",
    "--data.limit_eval_samples=16",
]


@pytest.fixture
def fast_args(tmp_path):
    return FAST + [f"--trainer.default_root_dir={tmp_path}"]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


class StepLog:
    """The lr and weight decay of every step applied to each parameter, by parameter identity.

    A global optimizer hook sees every step: the original optimizer's (a no-op when fused: its
    gradients are gone) and each per-parameter optimizer's inside backward.
    """

    def __init__(self) -> None:
        self.steps: dict[int, list[tuple[float, float]]] = defaultdict(list)

    def __enter__(self) -> "StepLog":
        self.handle = register_optimizer_step_post_hook(self._record)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def _record(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:  # this step applied to it
                    self.steps[id(param)].append((group["lr"], group["weight_decay"]))

    def by_name(self, module: torch.nn.Module) -> dict[str, list[tuple[float, float]]]:
        return {name: self.steps[id(param)] for name, param in module.named_parameters()}


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of small models: faster than two on the two shared cores (and the
    cores are left to the worker processes some of these tests start)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def the_error(stderr: str) -> str:
    """A refused command's one ``error:`` line, its last: a run confined in a child (`lit_memory.sandbox`) relays
    the lines Lightning logs before the refusal (``Seed set to 42``, the accelerators), which an in-process run
    also prints, to its logging handler."""
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    assert not any(line.startswith("Traceback") for line in lines), lines
    return errors[0]


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (``.item()``, ``bool()``, ``tolist()``: ``_local_scalar_dense``),
    each a device synchronisation on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


# -- helpers tests in several folders share -------------------------------------------------------


def flatten(tree: dict) -> dict[str, object]:
    """Dotted keys down to the values a recipe writes (a list is one value)."""
    from lit_memory.settings import dotted_leaves

    return dict(dotted_leaves(tree, lists=False))


def deflate_bomb(path: Path, size: int = 300 << 20) -> Path:
    """A torch-looking zip whose pickle record is a few hundred KiB deflated and `size` bytes inflated."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        with archive.open("archive/data.pkl", "w", force_zip64=True) as f:
            chunk = b"\0" * (1 << 20)
            for _ in range(size >> 20):
                f.write(chunk)
        archive.writestr("archive/version", "3\n")
    return path
