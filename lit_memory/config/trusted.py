"""Which configs the user trusts, by content: the shipped recipes, and the files they trusted once.

A run whose every config is trusted runs as Lightning runs it: in this process, on every launcher, no sandbox. A
config is trusted when it is

- **shipped**: byte-identical (sha256) to a recipe or config the installed package ships (``recipes/``,
  ``configs/``), wherever the copy lies;
- **trusted by the user** (`trust`, ``python -m lit_memory recipes trust FILE``): its path, its sha256 and those of the
  files beneath its folder that it names (data, a nested config, a model folder's files) are recorded in the user's
  config folder (`store_path`); a change to any of them makes it untrusted again, and the run says which file changed.
  This is direnv's ``allow``: the content is approved once, by the person who runs it;
- **a run's own** ``config.yaml``: recorded as trusted when a trusted run writes it (`record_run_config`), so
  ``predict --config RUN/config.yaml`` runs as the fit did.

A command line with no config at all is the user's own (what they typed and the defaults). A run with several
configs is trusted only when every one is (`judge`). Anything else runs confined (`lit_memory.confine.launch`), and
says so in one line with the command that trusts it (`Verdict.line`). ``--trust-recipe`` trusts one run, whatever
its configs. Files a trusted config does not name (a checkpoint or model folder the user types) are still read by the
guard's rules (`lit_memory.sandbox.guard`): trusting a recipe is not trusting every file a run loads.

Light: imported by ``python -m lit_memory`` before torch, to decide where a run goes.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from lit_memory import files
from lit_memory.config import shipped
from lit_memory.errors import UserError
from lit_memory.policy.writes import names_a_write
from lit_memory.sandbox import bounds

STORE_VARIABLE = "LIT_MEMORY_CONFIG_DIR"  # moves the user's lit_memory config folder (CI, tests, a shared account)
STORE_NAME = "trusted.json"
COMMAND = "python -m lit_memory recipes trust"
# Options whose value is a file a run reads as data, a model or a checkpoint (or writes), never as a config: a file
# named by any other option is read by jsonargparse as that option's config, so it must be trusted too.
NOT_CONFIGS = ("data.source", "data.predict_path", "ckpt_path", "model.model_name_or_path",
               "model.tokenizer_name_or_path", "trainer.default_root_dir", "output", "memory.snapshot")
MAX_NAMED_FILES = 10_000  # files recorded for one recipe (a model folder's files included)
NAMED_DEPTH = 4  # nested configs followed from a recipe


def store_path() -> Path:
    """The trust store: ``$LIT_MEMORY_CONFIG_DIR/trusted.json``, by default in the XDG config folder
    (``~/.config/lit_memory``)."""
    if folder := os.environ.get(STORE_VARIABLE):
        return Path(folder).expanduser() / STORE_NAME
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "lit_memory" / STORE_NAME


def digest(path: Any) -> str:
    """The sha256 of a regular file's bytes (read in blocks: a model folder's weights too)."""
    hashed = hashlib.sha256()
    with open(bounds.regular(path, "file"), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            hashed.update(block)
    return hashed.hexdigest()


def shipped_digests() -> dict[str, str]:
    """sha256 -> ``recipes/NAME.yaml`` or ``configs/NAME.yaml`` for every config the installed package ships."""
    found = {}
    for folder, label in ((shipped.recipes_dir(), "recipes"), (shipped.configs_dir(), "configs")):
        for path in sorted(folder.glob("*.yaml")) if folder is not None else []:
            found[digest(path)] = f"{label}/{path.name}"
    return found


# -- the configs a command line names -------------------------------------------------------------------------


def config_files(argv: list[str]) -> list[str]:
    """The files an argv (``--recipe`` expanded) has jsonargparse read as configs: ``--config FILE`` and every
    ``--KEY FILE`` whose key does not name data, a model or a checkpoint (`NOT_CONFIGS`)."""
    found: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        key, value, width = None, None, 1
        if token.startswith("--") and "=" in token:
            key, value = token[2:].split("=", 1)
        elif token.startswith("-") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value, width = token.lstrip("-"), argv[i + 1], 2
        elif token.startswith("-c="):
            key, value = "config", token[3:]
        i += width
        if key is None or value is None or key in NOT_CONFIGS:
            continue
        path = re.sub(r"^file:///?", "/", value)
        if key in ("config", "c") or _is_file(path):
            found.append(path)
    return found


def _is_file(value: str) -> bool:
    try:
        return bool(value) and Path(value).expanduser().is_file()
    except (OSError, ValueError):  # too long or too odd to be a path
        return False


# -- the verdict ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """Whether every config of a command is trusted; else which are not and why (one reason per file)."""

    configs: tuple[str, ...] = ()
    untrusted: tuple[tuple[str, str], ...] = ()  # (config as named, why it is not trusted)
    pinned: dict[str, str] = field(default_factory=dict)  # real path -> sha256 of every trusted file: read as approved

    @property
    def trusted(self) -> bool:
        return not self.untrusted

    def line(self) -> str:
        """The line a confined run starts with: which config is not trusted, why, and the command that trusts it."""
        path, why = self.untrusted[0]
        more = f" (and {len(self.untrusted) - 1} more config(s))" if len(self.untrusted) > 1 else ""
        return (f"sandbox: running confined, because {path} {why}{more}; if you trust its source: "
                f"{COMMAND} {path}   (or pass {shipped.TRUST_FLAG} for this run)")


def judge(argv: list[str]) -> Verdict:
    """The verdict on every config ``argv`` names (`config_files`; ``--recipe NAME`` expanded by the caller)."""
    configs = config_files(argv)
    untrusted: list[tuple[str, str]] = []
    pinned: dict[str, str] = {}
    shipped_ones: Optional[dict[str, str]] = None
    store: Optional[dict[str, Any]] = None
    for config in configs:
        real = os.path.realpath(os.path.expanduser(config))
        if not os.path.isfile(real):  # a pipe (``--config <(...)``), a folder: read as it is, never trusted content
            untrusted.append((config, "is not a regular file, so it cannot be trusted by content"))
            continue
        sha = digest(real)
        shipped_ones = shipped_digests() if shipped_ones is None else shipped_ones
        if sha in shipped_ones:
            pinned[real] = sha
            continue
        store = read_store() if store is None else store
        entry = store.get("configs", {}).get(real)
        if entry is None:
            untrusted.append((config, "is not a shipped recipe and nobody trusted it"))
        elif entry.get("sha256") != sha:
            untrusted.append((config, f"changed since it was trusted on {entry.get('trusted_at', '?')[:10]}"))
        elif changed := _changed_named(entry):
            untrusted.append((config, f"names {changed}, which changed since the recipe was trusted"))
        else:
            pinned[real] = sha
            pinned.update(entry.get("files", {}))
    return Verdict(tuple(configs), tuple(untrusted), pinned)


def _changed_named(entry: dict[str, Any]) -> Optional[str]:
    """The first file a trusted recipe named whose content is no longer what was trusted (or that is gone)."""
    for path, sha in entry.get("files", {}).items():
        try:
            if digest(path) != sha:
                return path
        except (OSError, UserError):
            return f"{path} (now missing or not a regular file)"
    return None


# -- the store ----------------------------------------------------------------------------------------------------


def read_store() -> dict[str, Any]:
    """The trust store's content (empty where there is none). A store another user could have written (not owned
    by this user, or writable by group or others) is refused: like ssh's keys or git's ``safe.directory``."""
    path = store_path()
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return {"configs": {}}
    except OSError as err:
        raise UserError(f"cannot read the trust store {path}: {err.strerror}") from None
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UserError(f"refusing the trust store {path}: it is not owned by you or others may write it "
                        f"(chmod 600 it, or move it with {STORE_VARIABLE})")
    try:
        data = json.loads(bounds.read_text(path, bounds.JSON_BYTES, "trust store"))
    except ValueError as err:
        raise UserError(
            f"the trust store {path} is not valid JSON ({err}); remove it and trust your recipes again"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("configs", {}), dict):
        raise UserError(
            f"the trust store {path} is not a lit_memory trust store; remove it and trust your recipes again"
        )
    data.setdefault("configs", {})
    return data


@contextlib.contextmanager
def _updating() -> Iterator[dict[str, Any]]:
    """The store, locked against other processes (ranks, parallel runs) while it is changed, written back whole."""
    path = store_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(path.parent / (STORE_NAME + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_store()
        yield data
        data["version"] = 1
        files.write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.chmod(path, 0o600)
    finally:
        os.close(lock)


def trust(config: Any, how: str = "recipes trust") -> list[str]:
    """Record ``config`` as trusted: its real path and sha256, and those of each file beneath its folder that it names
    (`named_files`). Returns the named files recorded."""
    real = os.path.realpath(os.path.expanduser(str(config)))
    sha = digest(real)  # a regular file, or one error line
    named = named_files(Path(real))
    entry = {"sha256": sha, "trusted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "how": how, "files": {path: digest(path) for path in named}}
    with _updating() as data:
        data["configs"][real] = entry
    return named


def untrust(config: Any) -> bool:
    """Forget ``config`` (by its real path, or the path it was recorded under if it is gone); whether it was there."""
    real = os.path.realpath(os.path.expanduser(str(config)))
    with _updating() as data:
        return data["configs"].pop(real, None) is not None


def record_run_config(path: Any) -> None:
    """A trusted run's ``config.yaml``, recorded as trusted as the run was (the run wrote it: it names what the run
    read, not files beneath its folder)."""
    real = os.path.realpath(str(path))
    entry = {"sha256": digest(real), "how": "written by a trusted run",
             "trusted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "files": {}}
    with _updating() as data:
        data["configs"][real] = entry


def listing() -> str:
    """``recipes trusted``: every recorded config, when and how it was trusted, and whether it is still as trusted."""
    data = read_store()
    if not data["configs"]:
        return f"no recipes trusted yet ({store_path()}); trust one: {COMMAND} FILE"
    lines = [f"trusted recipes ({store_path()}):"]
    for path, entry in sorted(data["configs"].items()):
        try:
            state = "ok" if digest(path) == entry.get("sha256") else "CHANGED since (runs confined)"
        except (OSError, UserError):
            state = "missing"
        if state == "ok" and (changed := _changed_named(entry)):
            state = f"CHANGED: {changed} (runs confined)"
        named = len(entry.get("files", {}))
        lines.append(f"  {path}  {entry.get('trusted_at', '?')[:19]}  {entry.get('how', '?')}"
                     f"{f', {named} named file(s)' if named else ''}  {state}")
    return "\n".join(lines)


# -- the files a recipe names -------------------------------------------------------------------------------------


def named_files(config: Path) -> list[str]:
    """Every regular file beneath ``config``'s folder that it names, by a path relative to that folder or absolute
    (a data file, a nested config and what that one names, every file of a model folder), run folders excluded
    (`lit_memory.policy.writes.names_a_write`): their content is part of what the user trusts."""
    folder = config.parent
    found: dict[str, None] = {}
    queue, seen = [(config, 0)], {str(config)}
    while queue:
        current, depth = queue.pop()
        try:
            tree = bounds.read_yaml(current, "recipe")
        except UserError:
            continue  # not YAML (a data file): its bytes are hashed, nothing inside is followed
        for key, value in _leaves(tree):
            if not isinstance(value, str) or not value or names_a_write(key) or "://" in value:
                continue
            target = (current.parent / os.path.expanduser(value)).resolve()
            if not _under(target, folder) or target == folder:
                continue
            for path in _regular_files(target):
                if path not in found and len(found) < MAX_NAMED_FILES:
                    found[path] = None
                    if path.endswith((".yaml", ".yml", ".json")) and path not in seen and depth < NAMED_DEPTH:
                        seen.add(path)
                        queue.append((Path(path), depth + 1))
    return sorted(found)


def _regular_files(target: Path) -> list[str]:
    try:
        if target.is_file():
            return [str(target)]
        if target.is_dir():
            return sorted(str(p) for p in target.rglob("*") if p.is_file() and not p.is_symlink())
    except OSError:
        pass
    return []


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list):
        for value in tree:
            yield from _leaves(value, prefix)
    else:
        yield prefix, tree


# -- ``python -m lit_memory recipes trust | untrust | trusted`` (answered before torch is imported) ---------------


def main(argv: list[str]) -> None:
    """``trust FILE...``, ``untrust FILE...`` or ``trusted``: each a line per file."""
    command, paths = argv[0], argv[1:]
    if command == "trusted":
        print(listing())
        return
    if not paths:
        raise UserError(f"recipes {command} needs a file: python -m lit_memory recipes {command} FILE")
    for path in paths:
        if command == "untrust":
            known = untrust(path)
            print(f"untrusted: {path}" if known else f"{path} was not trusted ({store_path()})")
            continue
        if not _is_file(path):
            raise UserError(f"recipe not found: {path}")
        named = trust(path)
        more = f", with {len(named)} file(s) beneath its folder that it names" if named else ""
        print(f"trusted: {os.path.realpath(path)}{more}, in {store_path()}; a run of it is not confined until it or "
              "one of them changes")

