"""Fabric with the fused backward + optimizer step (`lit_memory.fused`).

- `fsdp_overlap_step_with_backward(optimizers, fabric_module)`: the context manager Lightning 2.0
  shipped in ``lightning.fabric.strategies.fsdp`` and removed in 2.1, with the same arguments: inside
  it, backward (``loss.backward()`` or ``fabric.backward(loss)``) steps each of the user's optimizers
  as soon as the last of its parameters has its gradient, and frees those gradients. Fabric on one
  device, FSDP2 (``ModelParallelStrategy`` with the user's ``parallelize_fn``) and FSDP1
  (``FSDPStrategy`` with ``use_orig_params=True``, Lightning's default).
- `FusedFabricStrategy`: one device; `FusedFabricFSDPStrategy`: FSDP2 sharding of the Hugging Face
  layers, as the Trainer's `lit_memory.FSDP2Strategy` does. Both fuse the one optimizer set up with
  the module (`lit_memory.fused.OptimizerInBackward`): ``fabric.backward(loss)`` steps it.

Gradient clipping cannot come after backward (``fabric.clip_gradients`` finds no gradient): the
strategies and the context manager take ``max_norm`` / ``norm_type`` or ``clip_val`` instead, as
``fabric.clip_gradients`` would, and clip inside backward with its results (`lit_memory.fused.Clipping`).
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy, SingleDeviceStrategy
from lightning.fabric.strategies.fsdp import _METADATA_FILENAME, _distributed_checkpoint_save
from lightning.fabric.utilities.types import _DEVICE, _Stateful
from lightning.fabric.wrappers import _FabricModule, _FabricOptimizer
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lit_memory import fused
from lit_memory.errors import UserError
from lit_memory.fused import DEFAULT_BUCKET, FABRIC_CLIPPING, Bucket, BucketHooks, Clipping, LossScaling
from lit_memory.optim import eightbit_shards
from lit_memory.strategies import AcceleratorDevice, FSDP2Mesh, FusedStep, shard_hugging_face

UNOWNED = (
    "fsdp_overlap_step_with_backward: parameter {name} trains (requires_grad) but none of the optimizers holds it: "
    "add it to one, or set its requires_grad to False"
)
SHARED = (
    "fsdp_overlap_step_with_backward: parameter {name} is in two of the optimizers; give each parameter to exactly one"
)
FSDP1_FLAT = (
    "fsdp_overlap_step_with_backward under FSDPStrategy (FSDP1) needs FSDPStrategy(use_orig_params=True), "
    "Lightning's default: with flat parameters FSDP1 hands the gradients to the optimizers only after backward"
)
FSDP1_NORM = (
    "clipping by norm inside backward needs a second backward over the same forward, which FSDPStrategy (FSDP1) "
    "does not support (it removes its gradient hooks after the first): clip by value (clip_val), or use FSDP2 "
    "(ModelParallelStrategy, or lit_memory.FusedFabricFSDPStrategy)"
)
FSDP1_SCALER = (
    "fp16 loss scaling inside backward checks every gradient in a first backward over the same forward, which "
    "FSDPStrategy (FSDP1) does not support (it removes its gradient hooks after the first): use bf16-mixed, or FSDP2 "
    "(ModelParallelStrategy, or lit_memory.FusedFabricFSDPStrategy)"
)
STALE_OPTIMIZER = (
    "FusedFabricFSDPStrategy shards the model's parameters when it sets the model up, so this optimizer holds "
    "parameters the model no longer has: set the model up first (fabric.setup_module), then create the optimizer "
    "over its parameters and set that up (fabric.setup_optimizers)"
)


def _clipping(max_norm: Optional[float], norm_type: float, clip_val: Optional[float]) -> Optional[Clipping]:
    if max_norm is None and clip_val is None:
        return None
    return Clipping(max_norm=max_norm, norm_type=norm_type, value=clip_val)


# -- the context manager ---------------------------------------------------------------------------


class Overlap:
    """What `fsdp_overlap_step_with_backward` yields: ``total_norm`` is the norm of the gradients of
    the last backward before clipping (clipping by norm), as ``fabric.clip_gradients`` returns it."""

    total_norm: Optional[torch.Tensor] = None


@contextmanager
def fsdp_overlap_step_with_backward(
    optimizers: Union[Optimizer, Iterable[Optimizer]],
    fabric_module: nn.Module,
    max_norm: Optional[float] = None,
    norm_type: float = 2.0,
    clip_val: Optional[float] = None,
) -> Iterator[Overlap]:
    """Inside the block, backward steps every optimizer as soon as the last of its parameters has its
    gradient, and frees those gradients: a full set of gradients never exists (docs/fused.md).

    Lightning's ``fsdp_overlap_step_with_backward`` (2.0, removed in 2.1) as a drop-in::

        optimizers = [torch.optim.AdamW([p], lr=1e-4) for p in model.parameters()]
        with fsdp_overlap_step_with_backward(optimizers, model):
            loss.backward()   # or fabric.backward(loss)

    Every trainable parameter is in exactly one optimizer (one `lit_memory.fused.Bucket` each). On one device,
    FSDP2 (``ModelParallelStrategy``) or FSDP1 (``use_orig_params=True``). ``max_norm``/``norm_type`` or
    ``clip_val`` clip as ``fabric.clip_gradients`` would; by norm (and under ``16-mixed``) call ``fabric.backward``.
    """
    route = _Route(optimizers, fabric_module, _clipping(max_norm, norm_type, clip_val))
    try:
        yield route.overlap
    finally:
        route.remove()
    route.check_owned(after_backward=True)


class _Route:
    """The buckets of one `fsdp_overlap_step_with_backward` block and the way their gradients arrive."""

    def __init__(
        self, optimizers: Union[Optimizer, Iterable[Optimizer]], fabric_module: nn.Module, clipping: Optional[Clipping]
    ) -> None:
        wrapped = isinstance(fabric_module, _FabricModule)
        self.module = fabric_module.module if wrapped else fabric_module
        forward_module = fabric_module._forward_module if wrapped else fabric_module
        self.strategy = getattr(fabric_module, "_strategy", None)
        self.overlap = Overlap()
        fsdp1 = _FSDP1(forward_module) if _FSDP1.applies(forward_module) else None
        if fsdp1 is not None and clipping is not None and clipping.by_norm:
            raise UserError(FSDP1_NORM)
        self.precision = getattr(self.strategy, "precision", None)  # Fabric's 16-mixed: its GradScaler
        scaling = LossScaling.of(getattr(self.precision, "scaler", None))
        if fsdp1 is not None and scaling is not None:
            raise UserError(FSDP1_SCALER)
        optimizers = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
        optimizers = [o.optimizer if isinstance(o, _FabricOptimizer) else o for o in optimizers]
        names = {id(p): _name(name) for name, p in self.module.named_parameters()}
        self.owned: set[int] = set()  # ids of the optimizers' parameters
        buckets = []
        for optimizer in optimizers:
            params = []
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in self.owned:
                        raise UserError(SHARED.format(name=names.get(id(p), tuple(p.shape))))
                    self.owned.add(id(p))
                    # FSDP1 gives no gradient to a parameter without elements in this rank's shard
                    if p.requires_grad and not (fsdp1 is not None and fsdp1.elsewhere(p)):
                        params.append(p)
            if params:
                buckets.append(Bucket(optimizer, params))
        self.check_owned(after_backward=False)
        self.hooks = BucketHooks(buckets, clipping, scaling=scaling)
        if scaling is not None:  # optimizer.step() in the block (a no-op) calls the scaler: it sees what backward did
            self.precision.scaler = scaling.view
        self.fsdp1 = fsdp1.install(self.hooks) if fsdp1 is not None else None
        self._patched = (
            (clipping is not None and clipping.by_norm) or scaling is not None
        ) and self.strategy is not None
        if self._patched:
            self._measure_in(self.strategy)

    def check_owned(self, after_backward: bool) -> None:
        """One line for a trainable parameter that no optimizer holds.

        Between forward and backward FSDP2 keeps the root module's parameters gathered: those module
        attributes are then other tensors than the sharded parameters the optimizers hold, and are
        checked only after backward, when FSDP2 has put the sharded ones back.
        """
        fsdp2 = not after_backward and any(isinstance(m, FSDPModule) for m in self.module.modules())
        for name, p in self.module.named_parameters():
            if p.requires_grad and id(p) not in self.owned and not (fsdp2 and not isinstance(p, DTensor)):
                raise UserError(UNOWNED.format(name=_name(name)))

    def _measure_in(self, strategy: Any) -> None:
        # Clipping by norm and loss scaling need the loss, to run a measuring backward before the fused one; the
        # block sees it only where fabric.backward hands it to the strategy, so for the block's duration the
        # strategy's backward (an instance attribute, removed again in `remove`) runs both.
        run = strategy.backward

        def backward(tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
            self.overlap.total_norm = self.hooks.backward(lambda **kw: run(tensor, module, *args, **kw), **kwargs)

        strategy.backward = backward

    def remove(self) -> None:
        self.hooks.remove()
        if self.hooks.scaling is not None:
            self.precision.scaler = self.hooks.scaling.scaler
        if self.fsdp1 is not None:
            self.fsdp1.remove()
        if self._patched:
            del self.strategy.backward


def _name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


class _FSDP1:
    """FSDP1 (``use_orig_params=True``) hands the original parameters their gradients, views into each
    rank's shard of the flat gradient, only after reducing a flat parameter, inside its post-backward
    hook; the parameters' own gradient hooks never run. There it steps the optimizers a parameter lists
    in ``_in_backward_optimizers``: torch's own optimizer-in-backward support for FSDP1 (what
    `torch.distributed.optim._apply_optimizer_in_backward` registers). Each parameter lists one object
    here, whose ``step`` tells the bucket hooks that its gradient arrived.

    FSDP1 decides whether to take that path (``_has_optim_in_backward``) when it first runs forward,
    before a block around backward exists, so it is set here and reset on leaving; and as FSDP1
    frees a flat gradient only after that path's steps, a bucket completed later (by another flat
    parameter, or at the end of backward) frees its flat gradients itself.
    """

    @staticmethod
    def applies(module: nn.Module) -> bool:
        return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())

    def __init__(self, module: nn.Module) -> None:
        self.states = [(s, s._handle) for s in FullyShardedDataParallel.fsdp_modules(module) if s._handle is not None]
        if any(not handle._use_orig_params for _, handle in self.states):
            raise UserError(FSDP1_FLAT)
        self.handle_of = {id(p): handle for _, handle in self.states for p in handle.flat_param._params}
        self._elsewhere = {
            id(p)
            for _, handle in self.states
            for p, info in zip(handle.flat_param._params, handle.flat_param._shard_param_infos)
            if not info.in_shard
        }

    def elsewhere(self, param: torch.Tensor) -> bool:
        """Whether ``param`` has no elements on this rank (FSDP1 never gives it a gradient here)."""
        return id(param) in self._elsewhere

    def install(self, hooks: BucketHooks) -> "_FSDP1":
        stepped = {id(p) for bucket in hooks.buckets for p in bucket.params}
        for state, handle in self.states:
            for param in handle.flat_param._params:
                if id(param) in stepped:
                    param._in_backward_optimizers = [_Arrival(hooks, param)]
                    hooks.groups[id(param)] = state.process_group
            handle._has_optim_in_backward = True
        hooks.after_step.append(self._free_flat_gradients)
        return self

    def _free_flat_gradients(self, bucket: Bucket) -> None:
        handles = {id(h): h for p in bucket.params if (h := self.handle_of.get(id(p))) is not None}
        for handle in handles.values():
            handle._reset_flat_param_grad_info_if_needed()  # frees it once none of its parameters has a gradient

    def remove(self) -> None:
        for _, handle in self.states:
            handle._has_optim_in_backward = False
            for param in handle.flat_param._params:
                if hasattr(param, "_in_backward_optimizers"):
                    del param._in_backward_optimizers


class _Arrival:
    """What FSDP1 steps for a parameter: the report that its gradient is ready (`_FSDP1`)."""

    def __init__(self, hooks: BucketHooks, param: torch.Tensor) -> None:
        self.hooks, self.param = hooks, param

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        self.hooks.arrived(self.param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the bucket frees its gradients when it steps


# -- strategies ------------------------------------------------------------------------------------


class _FusedFabricStep(FusedStep):
    """For a Fabric strategy: the one optimizer set up with the module is stepped inside backward, and
    clipped there."""

    clipping: Optional[Clipping] = None
    _module: Optional[nn.Module] = None

    def _set_clipped_fusion(
        self, bucket: str, max_norm: Optional[float], norm_type: float, clip_val: Optional[float]
    ) -> None:
        self._set_fusion(True, bucket)
        self.clipping = _clipping(max_norm, norm_type, clip_val)

    def setup_module(self, module: nn.Module) -> nn.Module:
        self._module = module = super().setup_module(module)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._fused is not None:
            raise UserError(fused.SEVERAL)
        optimizer = super().setup_optimizer(optimizer)
        self._fuse(optimizer, self._module, self.clipping, self.precision)
        return optimizer

    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self._fused is None:
            return super().backward(tensor, module, *args, **kwargs)
        run = super().backward
        self._fused_backward(lambda **kw: run(tensor, module, *args, **kw), **kwargs)

    def clip_gradients_norm(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise UserError(FABRIC_CLIPPING)

    def clip_gradients_value(self, *args: Any, **kwargs: Any) -> None:
        raise UserError(FABRIC_CLIPPING)

    def teardown(self) -> None:
        self._unfuse()
        self._module = None
        super().teardown()


class FusedFabricStrategy(_FusedFabricStep, AcceleratorDevice, SingleDeviceStrategy):
    """Fabric on one device with the fused step: ``fabric.backward(loss)`` updates the parameters.

    ``optimizer.step()`` after it finds no gradient left; ``fabric.no_backward_sync`` cannot accumulate (docs/fused.md).

    Args:
        bucket: parameters stepped by one optimizer call: ``layer``, ``"N MiB"`` or ``param`` (`lit_memory.fused`).
        max_norm, norm_type: clip the gradients by their global norm inside backward (one more backward).
        clip_val: clip each gradient to ``[-clip_val, clip_val]`` inside backward (no extra cost).
        device: defaults to the device Fabric selects from ``accelerator`` and ``devices``.
    """

    def __init__(
        self,
        bucket: str = DEFAULT_BUCKET,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        clip_val: Optional[float] = None,
        device: Optional[_DEVICE] = None,
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
    ) -> None:
        self._set_clipped_fusion(bucket, max_norm, norm_type, clip_val)
        super().__init__(device or "cpu", accelerator, checkpoint_io, precision)
        self._device_given = device is not None


class FusedFabricFSDPStrategy(_FusedFabricStep, FSDP2Mesh, ModelParallelStrategy):
    """Fabric with FSDP2 on every device, sharding each transformer layer as `lit_memory.FSDP2Strategy` does,
    with the fused step on each rank's shards. Set up the module before creating its optimizer (docs/fused.md).

    Args:
        bucket, max_norm, norm_type, clip_val: as `FusedFabricStrategy`.
        save_distributed_checkpoint: each rank writes its shard; ``False`` gathers a single file on rank 0.
    """

    def __init__(
        self,
        bucket: str = DEFAULT_BUCKET,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        clip_val: Optional[float] = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        self._set_clipped_fusion(bucket, max_norm, norm_type, clip_val)
        super().__init__(
            parallelize_fn=_shard_hugging_face,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        held = {id(p) for p in self._module.parameters()} if self._module is not None else set()
        if any(id(p) not in held for group in optimizer.param_groups for p in group["params"]):
            # made before sharding (fabric.setup(model, optimizer)): it would train nothing
            raise UserError(STALE_OPTIMIZER)
        optimizer = super().setup_optimizer(optimizer)
        if self._fused.steps_shards and not self._save_distributed_checkpoint:
            raise UserError(eightbit_shards.ONE_FILE)
        return optimizer

    def save_checkpoint(self, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        key = self._fused_key(state)
        if key is None or not self._fused.steps_shards:
            return super().save_checkpoint(path, state, *args, **kwargs)
        # Lightning's saver, with bitsandbytes' state as DTensors where it puts torch's optimizer state dict (it
        # would send any other object to rank 0's meta.pt).
        path = Path(self.broadcast(path))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        converted, metadata = {}, {}
        for name, obj in state.items():
            if isinstance(obj, nn.Module):
                converted[name] = get_model_state_dict(obj)
            elif name == key:
                converted[name] = eightbit_shards.state_dict(self._fused.optimizer, self._module)
            elif isinstance(obj, Optimizer):
                converted[name] = get_optimizer_state_dict(self._module, obj)
            else:
                metadata[name] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        _distributed_checkpoint_save(converted, path)
        if self.global_rank == 0:
            torch.save(metadata, path / _METADATA_FILENAME)

    def load_checkpoint(self, path: Any, state: Any = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        key = self._fused_key(state)
        if key is None:
            return super().load_checkpoint(path, state, *args, **kwargs)
        self._fused.initialize_state()  # torch's loader fills existing state (else it creates it all at once)
        if not self._fused.steps_shards:
            return super().load_checkpoint(path, state, *args, **kwargs)
        path = Path(self.broadcast(path))
        rest = {k: v for k, v in state.items() if k != key}
        remainder = super().load_checkpoint(path, rest, *args, **kwargs)
        state.update(rest)  # what Fabric loaded into the dict it was given
        eightbit_shards.load_state_dict(self._fused.optimizer, self._module, path, key)
        return remainder

    def _fused_key(self, state: Any) -> Optional[str]:
        """The key under which ``state`` holds the fused optimizer, if it does."""
        if self._fused is None or not isinstance(state, dict):
            return None
        optimizer = self._fused.optimizer
        return next((k for k, v in state.items() if v is optimizer or getattr(v, "optimizer", None) is optimizer), None)


def _shard_hugging_face(module: nn.Module, device_mesh: Any) -> nn.Module:
    shard_hugging_face(module, device_mesh["data_parallel"], FusedFabricFSDPStrategy.__name__)
    return module
