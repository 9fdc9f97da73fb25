"""What a run names on the Hugging Face Hub, fetched by the parent for its confined (offline) child, within bounds.

The parent runs unconfined, so what it does for a recipe is bounded here, before and while it does it:

- **sized first**: the files a fetch would download are listed from the Hub's metadata (``snapshot_download`` with
  ``dry_run=True``: one tree listing, nothing downloaded) and their size held against the run's disk budget; over it,
  one ``error:`` line and nothing is fetched (a recipe-named repository of 166 MiB against a 32 MiB budget was
  fetched whole into the user's cache);
- **into the run's private folder**, never the user's cache (a model complete there already is read from there,
  nothing fetched), where the disk budget counts it and the run's end removes it;
- **within the time bound** on preparing a run: the fetch runs in a process of its own (isolated Python, like the
  child), killed when the bound is passed, or when what it wrote passes the budget;
- **the user's token only for a repository the user typed**: for one a recipe names, no token is sent (``token=False``
  for the listing; the fetch's environment holds no ``HF_TOKEN`` and points the token file at nothing), so a recipe
  cannot make the user's credentials reach a repository of its choice (or read their private ones).

Models: the files a classifier needs (weights, config, tokenizer; `PATTERNS`), nothing that runs code. Datasets: the
repository's data files (those of the named configuration, where their paths name it), saved with ``save_to_disk``
into the private folder, which the child reads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from huggingface_hub import constants, snapshot_download

from lit_memory.errors import UserError
from lit_memory.sandbox.rules import HINT, child_path, scrubbed
from lit_memory.sandbox.watchdog import LIMIT_VARIABLES, disk

MiB = 2**20
PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*", "*.tiktoken"]
FETCH_ENV = "LIT_MEMORY_FETCH"
BOOT = ("import json, os, sys; sys.path[:] = json.loads(os.environ[{env!r}])['path']; "
        "from lit_memory.confine.hub import fetch_main; fetch_main()")


@dataclass
class Fetch:
    """One repository the run reads: ``key`` names the setting, ``typed`` whether the user typed it."""

    key: str
    name: str
    kind: str  # "model" or "dataset"
    typed: bool
    subset: Optional[str] = None

    @property
    def token(self) -> Optional[bool]:
        """What the Hub calls are given: the user's own (None: huggingface_hub finds it) only for a typed repository."""
        return None if self.typed else False


def listing(fetch: Fetch) -> list[Any]:
    """The files fetching ``fetch`` downloads, with their sizes and whether the user's cache holds them (the Hub's
    metadata, nothing downloaded): the seam a test replaces."""
    return snapshot_download(
        fetch.name,
        repo_type=fetch.kind,
        allow_patterns=PATTERNS if fetch.kind == "model" else None,
        token=fetch.token,
        dry_run=True,
    )


def _wanted(fetch: Fetch, files: list[Any]) -> list[Any]:
    if fetch.kind == "dataset" and fetch.subset:
        named = [f for f in files if fetch.subset in Path(f.filename).parts or Path(f.filename).stem == fetch.subset]
        return named or files
    return files


@dataclass
class Sized:
    fetch: Fetch
    size: Optional[int]  # bytes it downloads into the private folder (0: complete in the user's cache; None: unknown)
    weights: int = 0  # bytes of a model's weights files (its size where no config is at hand to estimate it)


def offline(env: dict[str, str]) -> bool:
    return env.get("HF_HUB_OFFLINE") == "1" or env.get("HF_DATASETS_OFFLINE") == "1"


def size(fetches: list[Fetch]) -> list[Sized]:
    """Each fetch's download size from the Hub's metadata (nothing downloaded). A repository the Hub does not answer
    for (not there, offline, gated) is not fetched: a model is then left to the run, which says why in its own words;
    a dataset is read by the fetch from the user's cache, or not at all (its error)."""
    sized = []
    for fetch in fetches:
        try:
            files = _wanted(fetch, list(listing(fetch)))
        except Exception:  # noqa: BLE001  not on the Hub, offline, gated
            sized.append(Sized(fetch, None))
            continue
        complete = fetch.kind == "model" and files and all(getattr(f, "is_cached", False) for f in files)
        weights = sum(int(getattr(f, "file_size", 0) or 0) for f in files if f.filename.endswith(".safetensors"))
        need = 0 if complete else sum(int(getattr(f, "file_size", 0) or 0) for f in files)
        sized.append(Sized(fetch, need, weights if fetch.kind == "model" else 0))
    return sized


def check(sized: list[Sized], budget: int) -> None:
    """One error line where the fetches together pass the run's disk ``budget``, naming the first that does."""
    total = 0
    for s in sized:
        total += s.size or 0
        if total > budget:
            raise UserError(
                f"refusing {s.fetch.key}={s.fetch.name}: its files on the Hugging Face Hub are "
                f"{(s.size or 0) / MiB:.1f} "
                f"MiB ({total / MiB:.1f} MiB with the run's other fetches), over the run's disk budget of "
                f"{budget / MiB:.1f} MiB ({LIMIT_VARIABLES['disk']} sets it); {HINT}"
            )


def environment(env: dict[str, str], private: Path, typed: bool) -> dict[str, str]:
    """The fetch process's environment: caches in the private folder (offline, the user's: nothing is downloaded,
    a dataset is read from where they have it); the user's token only for a typed repository."""
    out = dict(env) if typed else {**scrubbed(env), "HF_TOKEN_PATH": str(private / "no-token")}
    if not offline(env):
        out.update({"HF_HUB_CACHE": str(private / "hub"), "HF_DATASETS_CACHE": str(private / "fetch-datasets")})
    out.update({"HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONSAFEPATH": "1"})
    return out


def fetch(sized: list[Sized], private: Path, env: dict[str, str], budget: int, seconds: float) -> dict[str, str]:
    """Fetch what ``sized`` needs into ``private``; the child's environment for reading it (its hub cache, the saved
    dataset). One error line where the fetch fails, takes longer than ``seconds`` or writes more than ``budget``."""
    hub = private / "hub"
    hub.mkdir(exist_ok=True)
    out: dict[str, str] = {}
    fetched = [s for s in sized if s.fetch.kind == "dataset" or s.size]
    for s in fetched:
        run_fetch(s.fetch, private, environment(env, private, s.fetch.typed), budget, seconds)
    if any(s.fetch.kind == "model" for s in fetched):  # the child reads the private cache, links to the user's
        for s in sized:
            folder = f"models--{s.fetch.name.replace('/', '--')}"
            source = Path(constants.HF_HUB_CACHE) / folder
            if s.fetch.kind == "model" and not (hub / folder).exists() and source.is_dir():
                (hub / folder).symlink_to(source)
        out["HF_HUB_CACHE"] = str(hub)
    if (private / "dataset").exists():
        out["LIT_MEMORY_STAGED_DATASET"] = str(private / "dataset")
    return out


def run_fetch(one: Fetch, private: Path, env: dict[str, str], budget: int, seconds: float) -> None:
    """One fetch in a process of its own, watched for time and disk."""
    env = {**env, FETCH_ENV: json.dumps({"path": child_path(), "fetch": asdict(one), "private": str(private)})}
    command = [sys.executable, "-I", "-B", "-c", BOOT.format(env=FETCH_ENV)]
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, start_new_session=True)
    deadline, why = time.monotonic() + seconds, ""
    try:
        while process.poll() is None:
            time.sleep(0.2)
            if time.monotonic() > deadline:
                why = (f"it took longer than {seconds:.0f} s, the bound on preparing a run "
                       f"({LIMIT_VARIABLES['prepare']} sets it)")
            elif disk([str(private)])[0] > budget:
                why = (f"it wrote more than the run's disk budget of {budget / MiB:.1f} MiB "
                       f"({LIMIT_VARIABLES['disk']} sets it)")
            if why:
                break
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    err = process.stderr.read(65536).decode("utf-8", errors="replace") if process.stderr else ""
    if not why and process.returncode != 0:
        why = (err.strip().splitlines() or [f"exit status {process.returncode}"])[-1]
    if why:
        shutil.rmtree(private / "hub" / f"{one.kind}s--{one.name.replace('/', '--')}", ignore_errors=True)
        raise UserError(f"cannot fetch {one.key}={one.name} from the Hugging Face Hub for the run: {why}")


def fetch_main() -> None:
    """The fetch process: one model snapshot or one dataset, into the run's private folder (environment: caches
    there, a token only for a typed repository)."""
    spec = json.loads(os.environ[FETCH_ENV])
    one, private = Fetch(**spec["fetch"]), Path(spec["private"])
    try:
        if one.kind == "model":
            snapshot_download(one.name, allow_patterns=PATTERNS, token=one.token)
        else:
            from lit_memory.data import load_hub_dataset

            load_hub_dataset(one.name, one.subset).save_to_disk(str(private / "dataset"))
    except Exception as err:  # noqa: BLE001  one line for the parent's error
        print(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", file=sys.stderr)
        sys.exit(2)
