"""Checkpoints read without running anything: the restricted readers the trust guard's sinks use
(`lit_memory.sandbox.guard`), and the checks a run makes with them before it starts."""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lit_memory.errors import UserError
from lit_memory.sandbox import bounds


def checkpoint_problem(path: Any, files_too: bool = True) -> Optional[str]:
    """Why loading a local checkpoint under the untrusted rules fails, or None. It is read only
    through the restricted readers the sinks use: nothing in it is imported or run. ``files_too=False``
    leaves a single file to the caller's own weights-only read."""
    path = Path(path)
    if path.is_file():
        return _file_problem(path) if files_too else None
    if path.is_dir():
        return _folder_problem(path)
    if path.exists():  # a device, a pipe: reading it may never end
        return "it is neither a regular file nor a folder"
    return None  # not there: the loader reports it


def _file_problem(path: Path, data: Optional[bytes] = None) -> Optional[str]:
    if data is None:
        try:
            bounds.regular(path, "checkpoint")
        except UserError as err:
            return str(err).split(": ", 1)[-1]
        if problem := bounds.zip_problem(path):  # before torch's reader decompresses a record whole
            return problem
    try:
        if data is not None:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        else:
            try:  # memory-mapped: the tensors' bytes are not read, only the pickle
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap" not in str(err):
                    raise
                torch.load(path, map_location="cpu", weights_only=True)  # torch's legacy format
    except Exception as err:  # every way it fails means: not loadable under the rules
        return f"it cannot be loaded with weights_only=True (tensors and plain data only): {load_error(err)}"
    return None


def load_error(err: Exception) -> str:
    """The line of a failed weights-only load that says what was refused (torch puts it after its advice)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).splitlines()]
    for line in lines:
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()
    return next((line for line in lines if line), type(err).__name__)


def _folder_problem(path: Path) -> Optional[str]:
    """A distributed checkpoint: every metadata file (global and rank-local), every non-tensor item
    they point at, and Lightning's ``meta.pt``."""
    metadata_files = sorted(
        p for p in path.iterdir() if p.name == ".metadata" or re.fullmatch(r"__\d+\.metadata", p.name)
    )
    for file in metadata_files:
        try:  # a regular file within its bound: a link to /dev/zero or a FIFO would never end
            data = bounds.read_bytes(file, bounds.METADATA_BYTES, "checkpoint metadata")
        except UserError as err:
            return f"its {file.name}: {str(err).split(': ', 1)[-1]}"
        try:
            metadata = load_metadata(io.BytesIO(data))
        except Exception as err:
            return f"its {file.name} names code to run when unpickled ({err})"
        for index, info in (metadata.storage_data or {}).items():
            if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                continue  # tensors: torch's reader loads them weights-only itself
            if getattr(info, "transform_descriptors", None):
                continue  # compressed: the forced weights-only load covers it when it is read
            if info.length > bounds.PICKLE_BYTES:
                return (
                    f"its item {index.fqn!r} ({info.relative_path}): {info.length} bytes of pickle, more than the bound"
                )
            try:
                item = bounds.regular(path / info.relative_path, "checkpoint item")
            except UserError as err:
                return f"its item {index.fqn!r}: {str(err).split(': ', 1)[-1]}"
            with open(item, "rb") as f:
                f.seek(info.offset)
                problem = _file_problem(path, f.read(info.length))
            if problem:
                return f"its item {index.fqn!r} ({info.relative_path}): {problem}"
    meta = path / "meta.pt"
    if (meta.exists() or meta.is_symlink()) and (problem := _file_problem(meta)):
        return f"its {meta.name}: {problem}"
    return None


def _metadata_globals() -> set[tuple[str, str]]:
    allowed = {
        (dcp_metadata.__name__, name)
        for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    }
    allowed |= {(filesystem.__name__, "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout")}
    allowed |= {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}  # checkpoint_id
    allowed |= {("collections", "OrderedDict")}
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Python's documented way to restrict unpickling (`find_class`): torch's weights-only unpickler
    cannot read the pickle protocol torch writes distributed-checkpoint metadata with (4: FRAME)."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _metadata_globals():
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def load_metadata(file: io.BufferedIOBase) -> Any:
    """A distributed checkpoint's metadata, unpickled with its own types alone allowed, whose items
    name files inside the checkpoint folder only."""
    metadata = _MetadataUnpickler(file).load()
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = str(getattr(info, "relative_path", ""))
        if not relative or Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise pickle.UnpicklingError(f"an item is stored outside the checkpoint folder ({relative!r})")
    return metadata
