"""Bounded reading of the files a recipe points at: regular files within a size, YAML whose aliases
and nesting are bounded, zip records that do not expand without end, tokenizers whose normalizers do
not multiply the text, model configs of a size a machine can build.

Every limit is checked before the expensive step (the read, the YAML construction, the
decompression, the tokenizer, the model's modules), so a file built to exhaust memory or time is
one `error:` line. The limits are far above anything real (stated in docs/sharing.md, "Bounds").
"""

from __future__ import annotations

import json
import os
import stat
import zipfile
from pathlib import Path
from typing import Any, Optional

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError as RoundTripYAMLError

from lit_memory.errors import UserError

MiB = 1 << 20
CONFIG_BYTES = 1 * MiB  # a recipe or config YAML (the shipped ones are 2-4 KiB)
YAML_NODES = 100_000  # values in one YAML document once its aliases are expanded
YAML_DEPTH = 64  # nesting of lists and mappings
JSON_BYTES = 16 * MiB  # config.json, tokenizer_config.json, memory.json, ...
TOKENIZER_BYTES = 256 * MiB  # tokenizer.json (the largest hub tokenizers are ~35 MB)
METADATA_BYTES = 256 * MiB  # a distributed checkpoint's .metadata
PICKLE_BYTES = 256 * MiB  # the pickle record (data.pkl) of a torch zip file: what is unpickled
EXPANSION = 100  # a compressed zip record may expand at most this many times
TEXT_GROWTH = 16  # how many times a tokenizer's normalizers may multiply a text's length
NORMALIZERS = 64  # normalizers in one tokenizer
CHARS_PER_TOKEN = 64  # characters of a text kept for tokenising, per token of max_length


class BoundExceeded(UserError):
    """A file or value beyond the bounds an untrusted run reads."""


def regular(path: Any, what: str = "file", limit: Optional[int] = None) -> Path:
    """``path`` if it is a regular file (a link to one is fine), not a FIFO, socket or device, of at most
    ``limit`` bytes."""
    path = Path(path)
    try:
        info = os.stat(path)
    except OSError as err:
        raise UserError(f"cannot read {what} {path}: {err.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = (
            "a folder"
            if stat.S_ISDIR(info.st_mode)
            else "a FIFO"
            if stat.S_ISFIFO(info.st_mode)
            else "a device or socket"
        )
        raise BoundExceeded(f"refusing to read {what} {path}: it is {kind}, not a regular file")
    if limit is not None and info.st_size > limit:
        raise BoundExceeded(
            f"refusing to read {what} {path}: {info.st_size} bytes, more than the {limit // MiB} MiB bound"
        )
    return path


def read_bytes(path: Any, limit: int, what: str = "file") -> bytes:
    """A regular file's content, refused beyond ``limit`` bytes, without blocking on a FIFO or reading a
    device (opened non-blocking, judged by the open file's own status: a link swapped meanwhile is seen)."""
    path = regular(path, what, limit)  # judged before opening: opening a FIFO can block
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise UserError(f"cannot read {what} {path}: {err.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = (
                "a folder"
                if stat.S_ISDIR(info.st_mode)
                else "a FIFO"
                if stat.S_ISFIFO(info.st_mode)
                else "a device or socket"
            )
            raise BoundExceeded(f"refusing to read {what} {path}: it is {kind}, not a regular file")
        if info.st_size > limit:
            raise BoundExceeded(
                f"refusing to read {what} {path}: {info.st_size} bytes, more than the {limit // MiB} MiB bound"
            )
        data = f.read(limit + 1)
    if len(data) > limit:
        raise BoundExceeded(f"refusing to read {what} {path}: more than the {limit // MiB} MiB bound")
    return data


def read_text(path: Any, limit: int, what: str = "file") -> str:
    return read_bytes(path, limit, what).decode("utf-8")


def read_json(path: Any, limit: int = JSON_BYTES, what: str = "file") -> Any:
    """A JSON file within ``limit`` bytes; nesting too deep for the parser is one line, not a traceback."""
    data = read_bytes(path, limit, what)
    try:
        return json.loads(data)
    except RecursionError:
        raise BoundExceeded(f"refusing to read {what} {path}: nested too deeply") from None


# -- YAML ----------------------------------------------------------------------------------------


def check_yaml(text: str, where: str = "YAML") -> None:
    """Refuse YAML whose expansion would exhaust memory or the parser's recursion: more than
    `CONFIG_BYTES`, more than `YAML_NODES` values once every alias is expanded (anchors that
    reference anchors grow exponentially: a 600-byte "billion laughs"), or nesting deeper than
    `YAML_DEPTH`. PyYAML's event parser is iterative, so this reads the events without building
    anything (a 100,000-deep list would overflow the recursive constructor)."""
    if len(text) > CONFIG_BYTES or len(text.encode("utf-8", "surrogatepass")) > CONFIG_BYTES:
        raise BoundExceeded(f"refusing {where}: more than the {CONFIG_BYTES // MiB} MiB bound for a recipe or config")
    sizes: dict[str, int] = {}
    stack: list[list[Any]] = [[0, None]]  # [values so far, anchor] of each open collection; [0] the document
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                stack.append([1, event.anchor])
                if len(stack) - 1 > YAML_DEPTH:
                    raise BoundExceeded(f"refusing {where}: nested deeper than {YAML_DEPTH} levels")
                continue
            if isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                count, anchor = stack.pop()
            elif isinstance(event, yaml.ScalarEvent):
                count, anchor = 1, event.anchor
            elif isinstance(event, yaml.AliasEvent):
                count, anchor = sizes.get(event.anchor, 1), None
            else:
                continue
            if anchor is not None:
                sizes[anchor] = count
            stack[-1][0] += count
            if stack[0][0] + sum(s[0] for s in stack[1:]) > YAML_NODES:
                raise BoundExceeded(f"refusing {where}: more than {YAML_NODES} values once its aliases are expanded "
                                    "(anchors that repeat anchors)")
    except yaml.YAMLError:
        return  # not valid YAML: the loader says so in its own words


def read_yaml(path: Any, what: str = "recipe", round_trip: bool = False) -> Any:
    """A YAML file (a recipe, a config) as data, read within the bounds a run reads a stranger's config with: a
    regular file of at most `CONFIG_BYTES` whose aliases and nesting are bounded (`check_yaml`), checked before
    anything is built. Plain data (PyYAML's safe loader: no tags, no objects) by default; ``round_trip``: ruamel's
    round-trip maps, which keep each setting's comment (for the tools that write recipes). Not valid YAML: one
    `UserError` line. The one way lit_memory reads a YAML file itself (the CLI's configs are jsonargparse's)."""
    text = read_text(path, CONFIG_BYTES, what)
    check_yaml(text, str(path))
    if round_trip:  # plain YAML 1.2 with comments kept; no Python objects are made
        load, invalid = YAML().load, RoundTripYAMLError
    else:
        load, invalid = yaml.safe_load, yaml.YAMLError
    try:
        return load(text) or {}
    except invalid as err:
        raise UserError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None


# -- zip files (torch's format) ---------------------------------------------------------------------


def zip_problem(path: Any) -> Optional[str]:
    """Why a torch zip file's records would not be read within the bounds, or None (also for a file that
    is not a zip: torch's legacy format is a plain pickle, bounded by its size). Reads the central
    directory only: each record's declared size, which the zip reader holds it to."""
    try:
        with zipfile.ZipFile(regular(path, "checkpoint")) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > EXPANSION * max(info.compress_size, 1):
            return (f"its record {info.filename} expands from {info.compress_size} to {info.file_size} bytes "
                    f"(more than {EXPANSION}x: a decompression bomb; torch stores records uncompressed)")
        if info.filename.endswith(".pkl") and info.file_size > PICKLE_BYTES:
            return (
                f"its pickle {info.filename} is {info.file_size} bytes, more than the {PICKLE_BYTES // MiB} MiB bound"
            )
    return None


def unsafe_globals(path: Any) -> list[str]:
    """torch's static scan of a checkpoint's pickle for what weights-only loading would refuse
    (`torch.serialization.get_unsafe_globals_in_checkpoint`), after `zip_problem`'s bounds."""
    import torch  # deferred: torch takes seconds to import; this base module otherwise needs only YAML

    if problem := zip_problem(path):
        raise BoundExceeded(problem)
    return torch.serialization.get_unsafe_globals_in_checkpoint(str(path))


# -- tokenizers ----------------------------------------------------------------------------------


def tokenizer_problem(path: Any) -> Optional[str]:
    """Why tokenizer.json at ``path`` would make tokenising exhaust memory, or None: its normalizers (a
    chain of Replace rules each longer than its pattern multiplies every text) may grow a text at most
    `TEXT_GROWTH` times, and there are at most `NORMALIZERS` of them."""
    try:
        data = json.loads(read_bytes(path, TOKENIZER_BYTES, "tokenizer"))
    except RecursionError:
        return "it is nested too deeply"
    except ValueError as err:
        return f"it is not JSON ({err})"
    return normalizer_problem(data.get("normalizer") if isinstance(data, dict) else None)


def normalizer_problem(normalizer: Any) -> Optional[str]:
    """`tokenizer_problem` of a normalizer as tokenizers serialises it (``normalizer.__getstate__()``)."""
    growth, count = _growth(normalizer, 0)
    if count > NORMALIZERS:
        return f"it chains {count} normalizers, more than {NORMALIZERS}"
    if growth > TEXT_GROWTH:
        return f"its normalizers can multiply a text's length {growth:g} times (more than {TEXT_GROWTH})"
    return None


def _growth(node: Any, depth: int) -> tuple[float, int]:
    """(the factor a normalizer can multiply a text's length by, how many normalizers it holds)."""
    if not isinstance(node, dict) or depth > 8:
        return (1.0, 0) if not isinstance(node, dict) else (float("inf"), 1)
    kind = node.get("type")
    if kind == "Sequence":
        growth, count = 1.0, 0
        for child in node.get("normalizers") or []:
            g, c = _growth(child, depth + 1)
            growth, count = growth * g, count + c
        return growth, count
    if kind == "Replace":
        pattern = node.get("pattern") or {}
        source = pattern.get("String", pattern.get("Regex", "")) if isinstance(pattern, dict) else str(pattern)
        content = str(node.get("content") or "")
        # A regex can match a single character (or nothing): its content may replace each one.
        width = len(source) if isinstance(pattern, dict) and "String" in pattern else 1
        return max(1.0, len(content) / max(width, 1)), 1
    if kind == "Prepend":
        return 1.0 + len(str(node.get("prepend") or "")), 1  # each word-piece start: per character at worst
    if kind in ("NFKC", "NFKD"):
        return 18.0, 1  # Unicode's largest compatibility decomposition (U+FDFA)
    if kind in ("NFC", "NFD"):
        return 3.0, 1
    if kind == "BertNormalizer":
        return 3.0, 1  # spaces around CJK characters
    return 1.0, 1  # Lowercase, Strip, StripAccents, Nmt, Precompiled (SentencePiece's, bounded in practice)


# -- model configs ---------------------------------------------------------------------------------

# Attributes of a Hugging Face config that size the model a machine builds (modules, even on the meta
# device or under fake tensors, are Python objects: 20,000 layers are gigabytes of them).
MODEL_BOUNDS = {
    "num_hidden_layers": 1024, "n_layer": 1024, "num_layers": 1024,
    "hidden_size": 65536, "n_embd": 65536, "d_model": 65536,
    "intermediate_size": 262144, "n_inner": 262144,
    "num_attention_heads": 4096, "n_head": 4096, "num_key_value_heads": 4096,
    "vocab_size": 4_194_304, "max_position_embeddings": 4_194_304, "n_positions": 4_194_304,
    "num_labels": 1_000_000,
}


def model_size_problem(config: Any, exempt: tuple[str, ...] = ()) -> Optional[str]:
    """Why a Hugging Face config (or any of its sub-configs) names a model too large to build, or None.
    ``exempt``: attributes the user typed."""
    configs = [config]
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and sub is not config:
            configs.append(sub)
    for cfg in configs:
        for name, bound in MODEL_BOUNDS.items():
            value = getattr(cfg, name, None) if name != "num_labels" else getattr(cfg, "num_labels", None)
            if name in exempt or isinstance(value, bool) or not isinstance(value, int):
                continue
            if value > bound:
                return f"{name}={value}, more than {bound} (a model of that size cannot be built on a machine)"
    return None
