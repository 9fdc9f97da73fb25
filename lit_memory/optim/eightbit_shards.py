"""bitsandbytes' optimizer state under FSDP2: saved sharded, restored, resharded onto another number of ranks.

Under FSDP2 the fused step hands bitsandbytes each rank's local shard of a parameter (`lit_memory.fused`), and
bitsandbytes keeps that shard's state as plain tensors: 8-bit state as codes of the shard's shape (1 byte per value)
and an absmax per block of 256 of the shard's own values, 32-bit state as two fp32 tensors of the shard's shape.
torch's distributed checkpoint saves a DTensor as shards and a plain tensor once (as replicated), so the state goes
to it as DTensors over the parameter's mesh (`state_dict`):

- a tensor of the shard's shape (codes, or 32-bit moments) with the parameter's own placements, global shape and
  stride: saved, loaded and resharded element by element, like the parameter;
- the absmax of each shard, padded to the block count of the largest shard, as that shard's row of a
  ``(shards, blocks)`` DTensor;
- the quantisation maps (bitsandbytes' constants) and the step count as they are.

Resumed on as many shards (`load_state_dict`), every tensor comes back bit for bit. On another number, the codes come
back resharded and each rank dequantises its new rows with the absmax of the shard and block they were quantised
in, then quantises them again in blocks of its own shard (bitsandbytes' ``quantize_blockwise``): the moments are the
saved ones up to one more 8-bit rounding, not bit-exact. Whether a parameter's state is 8-bit is decided on the
whole parameter (`lit_memory.fused`), so resharding never changes it.

Why this and not torchao's DTensor-aware 8-bit AdamW: it keeps the optimizer the recipe names (4gb's bitsandbytes
AdamW8bit with its 32-bit embedding override, the same update as on one device), its CUDA kernels need no
``torch.compile`` per parameter shape, and it reshards onto any number of ranks: torchao quantises by the local
shard's size and reshards only at block boundaries (its ``aten.slice`` raises otherwise), so a 4096-value bias that
one rank quantised cannot be cut into 3 shards of 1366.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lit_memory.errors import UserError
from lit_memory.optim import eightbit

BLOCK = 256  # bitsandbytes' block size for optimizer state (`Optimizer2State.init_state`)
SHARDS = "bitsandbytes_shards"  # saved beside "state": how many shards of dim 0 the state was quantised in
SCRATCH = ("unorm_vec",)  # recomputed by every step before use (max_unorm): not saved

ONE_FILE = (
    "bitsandbytes' optimizer state under FSDP2 is quantised per shard and saved sharded: keep "
    "save_distributed_checkpoint true (the default), or use a torch or torchao optimizer"
)
NOT_SHARDED = (
    "checkpoint {path} is a single file: its optimizer state cannot be loaded into bitsandbytes' sharded state under "
    "FSDP2: resume it with the strategy that wrote it, or load its weights with ckpt_path in validate/test"
)
NOT_SAVED = (
    "checkpoint {path} holds no bitsandbytes optimizer state (lit_memory versions before this one left it out of FSDP "
    "checkpoints): it cannot resume training; load its weights with ckpt_path in validate/test, or export hf_model"
)


@dataclass(frozen=True)
class Layout:
    """How FSDP2 shards a parameter's dim 0 (as ``torch.chunk``): ``rows`` of ``width`` values each in ``shards``
    chunks of ``ceil(rows / shards)`` rows; the last chunks may be short or empty."""

    rows: int
    width: int
    shards: int

    @classmethod
    def of(cls, param: torch.Tensor, shards: int) -> "Layout":
        return cls(param.shape[0] if param.dim() else 1, math.prod(param.shape[1:]), shards)

    @property
    def chunk(self) -> int:
        return -(-self.rows // self.shards)

    def start(self, index: int) -> int:
        return min(index * self.chunk, self.rows)

    @property
    def blocks(self) -> int:
        """Absmax blocks of the largest shard."""
        return -(-self.chunk * self.width // BLOCK)


def shard_of(param: torch.Tensor) -> tuple[int, int]:
    """(shards, this rank's index) of a DTensor parameter sharded on dim 0 over one mesh dimension (FSDP2; HSDP
    replicates over another)."""
    dims = [d for d, place in enumerate(param.placements) if place.is_shard()]
    if len(dims) != 1 or param.placements[dims[0]].dim != 0:
        raise UserError(
            f"bitsandbytes' state can be saved sharded for parameters sharded on dim 0 over one mesh dimension (FSDP2, "
            f"HSDP); this one is placed {param.placements}"
        )
    return param.device_mesh.size(dims[0]), param.device_mesh.get_coordinate()[dims[0]]


def state_dict(optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """``optimizer``'s state (bitsandbytes, keyed by FSDP2's DTensor parameters, holding local-shard tensors) for
    torch's distributed checkpoint: keyed by parameter name like torch's, its tensors as DTensors (module docstring).
    Nothing is copied but each absmax, padded (1/64 of a byte per value)."""
    names = {id(p): name for name, p in module.named_parameters()}
    params = _params(optimizer)
    steps = _steps_anywhere(optimizer, params)
    state = {}
    for param, step in zip(params, steps):
        saved = optimizer.state.get(param)
        if not saved and step:  # an empty shard: never stepped here, while the ranks with rows hold state
            saved = _empty_shard_state(optimizer, param, step)
        if saved:  # none before its first gradient
            state[names[id(param)]] = {k: _sharded(k, v, param) for k, v in saved.items() if k not in SCRATCH}
    shards = shard_of(params[0])[0] if params else 1
    return {"state": state, "param_groups": _groups(optimizer, names), SHARDS: shards}


def load_state_dict(optimizer: Optimizer, module: nn.Module, path: Path, key: str) -> bool:
    """Load ``optimizer``'s state saved by `state_dict` under ``key`` of the distributed checkpoint at ``path``
    into its existing state (made first by `lit_memory.fused.OptimizerInBackward.initialize_state`), exactly on as
    many shards, requantised on another number (module docstring). Returns whether it was resharded."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(NOT_SHARDED.format(path=path))
    probe = {key: {SHARDS: 0}}
    try:
        dcp.load(probe, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    except Exception as err:  # a checkpoint from elsewhere or broken: DCP names what it lacks
        raise UserError(f"cannot read the optimizer state of checkpoint {path}: {str(err).splitlines()[0]}") from None
    saved_shards = probe[key][SHARDS]
    if not saved_shards:
        raise UserError(NOT_SAVED.format(path=path))

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata  # what each saved tensor is
    names = {id(p): name for name, p in module.named_parameters()}
    targets = {}
    for param in _params(optimizer):
        name = names[id(param)]
        if optimizer.state.get(param) and f"{key}.state.{name}.step" in saved:
            # (a state made here that the checkpoint lacks, of a parameter that never had a gradient, stays as made)
            targets[name] = _Target(param, optimizer.state[param], saved_shards)
            targets[name].check(saved, f"{key}.state.{name}.", path)
    loaded = {
        key: {
            "state": {name: target.destination for name, target in targets.items()},
            "param_groups": _groups(optimizer, names),
        }
    }
    dcp.load(loaded, checkpoint_id=path)
    for name, target in targets.items():
        target.restore(loaded[key]["state"][name])
    for group, hyper in zip(optimizer.param_groups, loaded[key]["param_groups"]):
        group.update((k, v) for k, v in hyper.items() if k != "params")
    return any(target.resharded for target in targets.values())


class _Target:
    """Where one parameter's saved state is loaded, and how it goes back into bitsandbytes' state."""

    def __init__(self, param: torch.Tensor, state: dict[str, Any], saved_shards: int) -> None:
        self.param, self.state = param, state
        self.shards, self.index = shard_of(param)
        self.saved = Layout.of(param, saved_shards)
        self.resharded = saved_shards != self.shards
        self.destination: dict[str, Any] = {}
        for name, value in state.items():
            if name in SCRATCH:
                continue
            if not isinstance(value, torch.Tensor):
                self.destination[name] = value
            elif name.startswith("qmap"):
                self.destination[name] = torch.empty_like(value)
            elif name.startswith("absmax"):
                if self.resharded:  # every saved shard's blocks: 4 bytes per 256 values of the parameter
                    self.destination[name] = value.new_zeros(saved_shards, self.saved.blocks)
                else:
                    self.destination[name] = _sharded(name, value, param)
            elif self.resharded and value.dtype == torch.uint8:  # codes of the saved layout, resharded by rows
                self.destination[name] = _as_dtensor(torch.empty_like(value), param)
            else:  # into the state itself (32-bit moments; codes on as many shards)
                self.destination[name] = _as_dtensor(value, param)

    def check(self, saved: dict[str, Any], prefix: str, path: Path) -> None:
        """One line if the checkpoint keeps this parameter's state in another kind (8-bit where it is 32-bit here)."""
        for name, value in self.destination.items():
            if isinstance(value, torch.Tensor) and name.startswith("state"):
                meta = saved.get(prefix + name)
                dtype = getattr(getattr(meta, "properties", None), "dtype", None)
                if dtype is not None and dtype != value.dtype:
                    raise UserError(
                        f"checkpoint {path} keeps {prefix.split('.state.', 1)[1].rstrip('.')}'s optimizer state as "
                        f"{dtype}, this run as {value.dtype}: resume with the optimizer settings it was made with"
                    )

    def restore(self, loaded: dict[str, Any]) -> None:
        for name, value in loaded.items():
            if not isinstance(value, (torch.Tensor, DTensor)):
                self.state[name] = value
        for name, value in self.state.items():
            if name.startswith("qmap") and not torch.equal(value, loaded[name].to(value.device)):
                self.state[name] = loaded[name].to(value.device)  # another bitsandbytes' map: decode with the saved one
        for name in [n for n in self.state if n.startswith("absmax")]:
            suffix = name[len("absmax"):]
            codes, absmax, qmap = (self.state[f"state{suffix}"], self.state[name], self.state[f"qmap{suffix}"])
            if not self.resharded:
                absmax.copy_(loaded[name].to_local()[0, : absmax.numel()])
                continue
            values = dequantise(
                loaded[f"state{suffix}"].to_local(), loaded[name].to(codes.device), qmap, self.saved,
                Layout.of(self.param, self.shards).start(self.index),
            )
            requantise(values, qmap, codes, absmax)


def dequantise(
    codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, saved: Layout, start: int
) -> torch.Tensor:
    """The fp32 values of ``codes``, rows ``start ...`` of a parameter whose state was quantised in ``saved``'s
    shards: each value is ``qmap[code]`` times the absmax of the block of its saved shard that held it
    (``absmax[shard, block]``; bitsandbytes' blockwise dequantisation), taken a few rows at a time."""
    shape, rows = codes.shape, codes.shape[0] if codes.dim() else 1
    codes = codes.reshape(rows, saved.width)
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    columns = torch.arange(saved.width, device=codes.device)
    step = max(1, 2**20 // max(1, saved.width))  # rows at a time: index tensors of ~8 MiB
    for first in range(0, rows, step):
        row = torch.arange(start + first, start + min(first + step, rows), device=codes.device)
        shard = row // saved.chunk
        offset = (row - shard * saved.chunk)[:, None] * saved.width + columns
        scale = absmax[shard[:, None], offset // BLOCK]
        out[first : first + len(row)] = qmap[codes[first : first + len(row)].long()] * scale
    return out.view(shape)


def requantise(values: torch.Tensor, qmap: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """``values`` quantised in bitsandbytes' blocks of this shard into ``codes`` and ``absmax``, in place."""
    import bitsandbytes.functional as F  # deferred: heavy (loads its native library); only resharding uses it

    quantised, quant_state = F.quantize_blockwise(values.reshape(-1), code=qmap, blocksize=BLOCK)
    codes.copy_(quantised.view(codes.shape))
    absmax.copy_(quant_state.absmax)


def _sharded(name: str, value: Any, param: torch.Tensor) -> Any:
    """One entry of a shard's bitsandbytes state as torch's distributed checkpoint should save it."""
    if not isinstance(value, torch.Tensor) or name.startswith("qmap"):
        return value  # the step count; bitsandbytes' quantisation maps (the same on every rank)
    if name.startswith("absmax"):
        shards, _ = shard_of(param)
        layout = Layout.of(param, shards)
        padded = value.new_zeros(1, layout.blocks)
        padded[0, : value.numel()] = value
        return DTensor.from_local(
            padded, param.device_mesh, param.placements, run_check=False,
            shape=(shards, layout.blocks), stride=(layout.blocks, 1),
        )
    if value.shape != param.to_local().shape:
        raise UserError(
            f"bitsandbytes' optimizer state {name!r} of shape {tuple(value.shape)} is not of its shard's shape "
            f"{tuple(param.to_local().shape)}: lit_memory cannot save it sharded"
        )
    return _as_dtensor(value, param)


def _as_dtensor(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (of the shard's shape) as a DTensor placed like ``param``, sharing its memory."""
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _steps_anywhere(optimizer: Optimizer, params: list[torch.Tensor]) -> list[int]:
    """Each parameter's step count on the ranks that hold its state (0: none has any yet): every rank must describe a
    saved DTensor, or torch's distributed checkpoint cannot cover its volume, and an empty shard's description carries
    its parameter's own count. One all-reduce of a count per parameter (saving is collective already)."""
    mine = [_step_of(optimizer.state.get(p)) for p in params]
    if not params or not dist.is_available() or not dist.is_initialized():
        return mine
    local = params[0].to_local() if hasattr(params[0], "to_local") else params[0]
    counts = torch.tensor(mine, dtype=torch.int64, device=local.device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return [int(c) for c in counts.tolist()]


def _step_of(state: Optional[dict[str, Any]]) -> int:
    """bitsandbytes' step count in a parameter's state (an int it counts up; a tensor in some versions), 0 without
    state; a state without a count counts as stepped once."""
    if not state:
        return 0
    step = state.get("step", 1)
    return int(step.item() if isinstance(step, torch.Tensor) else step) or 1


def _empty_shard_state(optimizer: Optimizer, param: torch.Tensor, step: int) -> dict[str, Any]:
    """The state an empty shard of ``param`` stands for in a checkpoint: each tensor of its kind (8-bit codes or
    32-bit moments, as bitsandbytes decides on the whole parameter: `lit_memory.optim.eightbit.config_of`) with no rows,
    no absmax blocks (saved as a row of zeros), the maps of a parameter of the same kind here, and ``step``: the
    parameter's own step count on the ranks that hold its rows (`_steps_anywhere`)."""
    g, i = next(
        (g, i) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"]) if p is param
    )
    config = eightbit.config_of(optimizer, g, i)
    bits = config.get("optim_bits", optimizer.args.optim_bits)
    quantised = bits == 8 and param.numel() >= config.get("min_8bit_size", optimizer.args.min_8bit_size)
    kind = torch.uint8 if quantised else torch.float32
    template = next(
        (optimizer.state[p] for group in optimizer.param_groups for p in group["params"]
         if optimizer.state.get(p) and optimizer.state[p].get("state1") is not None
         and optimizer.state[p]["state1"].dtype == kind),
        None,
    )
    if template is None:
        raise UserError(
            f"bitsandbytes' state of a parameter of shape {tuple(param.shape)} is held by other ranks only, and this "
            "rank holds no state of its kind to describe it by: save with fewer ranks than its rows"
        )
    local = param.to_local()
    empty: dict[str, Any] = {}
    for key, value in template.items():
        if key == "step":
            empty[key] = (
                torch.tensor(step, dtype=value.dtype, device=value.device) if isinstance(value, torch.Tensor) else step
            )
        elif not isinstance(value, torch.Tensor) or key.startswith("qmap"):
            empty[key] = value
        elif key.startswith("absmax"):
            empty[key] = value.new_zeros(0)
        elif key not in SCRATCH:
            empty[key] = torch.zeros(local.shape, dtype=value.dtype, device=local.device)
    return empty


def _params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _groups(optimizer: Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """The hyper-parameters of each group, with parameter names in place of the parameters (torch's format)."""
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
