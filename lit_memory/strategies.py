"""Trainer strategies: the fused backward + optimizer step (`lit_memory.fused`) and FSDP2 sharding.

From YAML::

    trainer:
      strategy:
        class_path: lit_memory.FusedSingleDeviceStrategy   # or lit_memory.FusedFSDPStrategy

Fabric's fused strategies are in `lit_memory.fabric`.

The Trainer strategies take ``fused`` (step inside backward or not) and ``bucket`` (`lit_memory.fused.parse_bucket`:
``layer``, ``param`` or ``"N MiB"``) under the same names, so a config that switches the strategy keeps the
recipe's choice: jsonargparse carries over the init args the new class also takes. ``configs/fsdp.yaml``
names `FSDP2Strategy` alone: layered after ``recipes/fused.yaml`` (`FusedSingleDeviceStrategy`, fused by
default) it shards fused; after ``recipes/baseline.yaml`` (Lightning's default strategy) it shards unfused.
Other code detects fusion with ``getattr(trainer.strategy, "fused_step", False)``.

Fused, ``trainer.gradient_clip_val`` clips inside backward (`lit_memory.fused.Clipping`) with the results of
Lightning's clipping after an unfused backward: by value at no cost, by norm (the default algorithm) at the
cost of one more backward per step, which only measures the norm. ``16-mixed`` (fp16 with torch's GradScaler)
is unscaled and checked inside backward too (`lit_memory.fused.LossScaling`): the same backward that measures
the norm, one more when not clipping by norm; an overflow skips the step as GradScaler skips it.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint, _load_checkpoint
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.optim import Optimizer

from lit_memory import fused
from lit_memory.errors import UserError
from lit_memory.fused import DEFAULT_BUCKET, Bucketing, Clipping, OptimizerInBackward, parse_bucket
from lit_memory.hf.anatomy import find_layers, parameter_units
from lit_memory.hf.anatomy import hugging_face_models as _hugging_face_models
from lit_memory.memory.hardware import nccl
from lit_memory.optim import eightbit_shards
from lit_memory.optim.optimizers import library_of


class AcceleratorDevice:
    """Without an explicit ``device``, train on the first device the Trainer or Fabric selected.

    Lightning's single-device strategies default to ``"cpu"`` when built by the user; Lightning
    hands its device selection (from ``accelerator`` and ``devices``) to any strategy that has a
    ``parallel_devices`` attribute, so this one uses it: YAML needs no device, CPU and CUDA alike.
    """

    parallel_devices: Optional[list[torch.device]] = None
    _device_given = False

    @property
    def root_device(self) -> torch.device:
        if self._device_given or not self.parallel_devices:
            return self._root_device
        return torch.device(self.parallel_devices[0])


class FusedStep:
    """What every fused strategy does, Trainer's and Fabric's alike: the ``bucket`` setting parsed once,
    the one optimizer fused over the module's parameter units (`lit_memory.hf.anatomy.parameter_units`:
    its transformer layers, found from the model), backward run as clipping needs, the refusals of
    `lit_memory.fused`, and unfusing at teardown. Subclasses connect it to their framework's hooks."""

    fused_step = True
    bucket: Bucketing = parse_bucket(DEFAULT_BUCKET)
    total_norm: Optional[torch.Tensor] = None  # the last backward's gradient norm before clipping (by norm)
    _fused: Optional[OptimizerInBackward] = None
    _scaled: Any = None  # the precision plugin whose GradScaler the fused step stands in for

    def _set_fusion(self, fused_step: bool, bucket: Any) -> None:
        self.fused_step, self.bucket = fused_step, parse_bucket(bucket)  # a bad setting is one line when built

    def _fuse(
        self, optimizer: Optimizer, module: Optional[nn.Module], clipping: Optional[Clipping], precision: Any
    ) -> None:
        units = parameter_units(module) if module is not None else None
        self._fused = OptimizerInBackward(
            optimizer, units, self.bucket, clipping, scaler=getattr(precision, "scaler", None)
        )
        if self._fused.scaler is not None:  # the plugin's unscale/step/update see what the fused backward did
            self._scaled, precision.scaler = precision, self._fused.scaler

    def _fused_backward(self, run: Any, **kwargs: Any) -> None:
        """``run(**kwargs)`` is the framework's backward; the fused optimizer steps inside it."""
        self._fused.refresh()  # parameters unfrozen or added since (BaseFinetuning) get their hooks
        self.total_norm = self._fused.backward(run, **kwargs)

    def _unfuse(self) -> None:
        if self._scaled is not None:
            self._scaled.scaler, self._scaled = self._fused.scaling.scaler, None
        if self._fused is not None:
            self._fused.remove()
            self._fused = None


class _FusedTrainerStep(FusedStep):
    """For a Trainer strategy, when ``fused``: refuse what fusion cannot honour, then fuse the one optimizer."""

    def connect(self, model: LightningModule) -> None:
        super().connect(model)
        if self.fused_step and model.trainer.state.fn == TrainerFn.FITTING:  # before data, run folder or model exist
            _check_trainer(model.trainer, model)

    def setup_optimizers(self, trainer: Trainer) -> None:
        try:
            super().setup_optimizers(trainer)
        except RuntimeError as err:  # Lightning refuses several optimizers first, pointing at manual optimization
            if "multiple optimizers" not in str(err) or not self.fused_step:
                raise
            raise UserError(fused.SEVERAL) from None
        if not self.fused_step:
            return
        _check_trainer(trainer, self.lightning_module)  # callbacks the module added since
        self._unfuse()
        self._fuse(self.optimizers[0], self.lightning_module, _clipping(trainer), self.precision_plugin)
        # Lightning clips after backward too (Precision._after_closure), when the gradients are clipped, applied
        # and gone: nothing to do, and torch's clip_grad_value_ fails on no gradients. Skipped until `_unfuse`.
        self.precision_plugin._clip_gradients = _clipped_in_backward

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self._fused is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # Lightning's Strategy.backward, with the fused backward run as the clipping needs (by norm: a first
        # backward that measures it) inside the on_before_backward/on_after_backward hooks, which run once.
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        module = self.lightning_module
        run = self.precision_plugin.backward
        self._fused_backward(lambda **kw: run(closure_loss, module, optimizer, *args, **kw), **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def teardown(self) -> None:
        self._unfuse()  # a later fit (or a plain backward) must not step through stale hooks
        super().teardown()

    def _unfuse(self) -> None:
        super()._unfuse()
        vars(self.precision_plugin).pop("_clip_gradients", None)


def _clipped_in_backward(*args: Any, **kwargs: Any) -> None:
    """The precision plugin's clipping after backward, for a fused strategy: done inside backward."""


def _clipping(trainer: Trainer) -> Optional[Clipping]:
    """``trainer.gradient_clip_val`` and ``gradient_clip_algorithm`` (norm by default), as Lightning clips."""
    if not trainer.gradient_clip_val or trainer.gradient_clip_val <= 0:  # as Lightning: no clipping
        return None
    if (trainer.gradient_clip_algorithm or "norm") == "value":
        return Clipping(value=trainer.gradient_clip_val)
    return Clipping(max_norm=trainer.gradient_clip_val)  # Lightning's clip_grad_by_norm: the 2-norm


def _check_trainer(trainer: Trainer, model: LightningModule) -> None:
    if not model.automatic_optimization:
        raise UserError(fused.MANUAL)
    if trainer.accumulate_grad_batches > 1:
        raise UserError(fused.ACCUMULATION)
    if any(
        isinstance(c, GradientAccumulationScheduler) and c.going_to_accumulate_grad_batches() for c in trainer.callbacks
    ):
        raise UserError(fused.ACCUMULATION_SCHEDULE)
    if type(model).configure_gradient_clipping is not LightningModule.configure_gradient_clipping:
        raise UserError(fused.CLIPPING_HOOK)


class FusedSingleDeviceStrategy(_FusedTrainerStep, AcceleratorDevice, SingleDeviceStrategy):
    """One device (CPU or GPU), with the fused backward + optimizer step.

    Args:
        fused: step inside backward (``false``: Lightning's single-device strategy, for comparisons).
        bucket: parameters stepped by one optimizer call: ``layer`` (each transformer layer),
            ``"N MiB"`` or ``param`` (see `lit_memory.fused`).
        device: defaults to the device the Trainer selects from ``accelerator`` and ``devices``.
    """

    def __init__(
        self,
        fused: bool = True,
        bucket: str = DEFAULT_BUCKET,
        device: Optional[_DEVICE] = None,
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        self._set_fusion(fused, bucket)
        super().__init__(device or "cpu", accelerator, checkpoint_io, precision_plugin)
        self._device_given = device is not None

    # Optimizer state in checkpoints is keyed by parameter name, as ModelParallelStrategy does.
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return get_optimizer_state_dict(self.lightning_module, optimizer)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        # The optimizer's own load_state_dict maps the saved groups' parameter keys (names here, positions
        # from an unfused run) onto its groups by position, as torch's set_optimizer_state_dict does in
        # the end; that function first creates the state with a zero gradient for every parameter and a
        # full step, a full set of gradients on exactly the setups that cannot afford one.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)


class FSDP2Mesh:
    """FSDP2's process setup, shared by the Trainer's and Fabric's strategies (`FSDP2Strategy`,
    `lit_memory.fabric.FusedFabricFSDPStrategy`), placed before Lightning's ``ModelParallelStrategy`` in their bases:
    one data-parallel dimension over every process, and no NCCL on one rank."""

    def setup_environment(self) -> None:
        # One data-parallel dimension over all processes (ModelParallelStrategy's default is one per node).
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def _get_process_group_backend(self) -> str:
        # One rank needs no NCCL communicator (FSDP2 then neither gathers nor reduces), whose memory the plan would
        # have to leave room for (`lit_memory.memory.hardware.nccl`): gloo for the rendezvous and small objects.
        return self._process_group_backend or nccl.backend(self.world_size) or super()._get_process_group_backend()


def shard_hugging_face(module: nn.Module, mesh: Any, strategy: str) -> None:
    """FSDP2 on each Hugging Face model ``module`` holds (`hugging_face_models`), layer by layer (`shard`)."""
    for model in hugging_face_models(module, strategy):
        shard(model, mesh)


class FSDP2Strategy(_FusedTrainerStep, FSDP2Mesh, ModelParallelStrategy):
    """FSDP2 on every device: ``fully_shard`` on each transformer layer, then the model, with the fused
    step on each rank's shards when ``fused`` (bitsandbytes' state kept sharded: `lit_memory.optim.eightbit_shards`).

    Args:
        fused: step inside backward (``configs/fsdp.yaml`` keeps a recipe's choice).
        bucket: parameters stepped by one optimizer call: ``layer``, ``"N MiB"`` or ``param`` (`lit_memory.fused`).
        save_distributed_checkpoint: each rank writes its shard; ``false`` gathers a single file on rank 0.
    """

    fused_step = False

    def __init__(
        self,
        fused: bool = False,
        bucket: str = DEFAULT_BUCKET,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        self._set_fusion(fused, bucket)
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def setup(self, trainer: Trainer) -> None:
        shard_hugging_face(self.lightning_module, self.device_mesh["data_parallel"], type(self).__name__)
        super().setup(trainer)

    def connect(self, model: LightningModule) -> None:
        super().connect(model)
        if getattr(getattr(model, "lora", None), "quantised", False):
            raise UserError(
                f"model.lora.base nf4 (QLoRA) runs on one device: bitsandbytes' 4-bit weights are not sharded by "
                f"{type(self).__name__} here; train it without configs/fsdp.yaml, or with model.lora.base bf16"
            )
        # Before anything is built where the module says its optimizer (lit_memory's); else in setup_optimizers.
        factory = getattr(model, "optimizer_factory", None)
        if self.fused_step and not self._save_distributed_checkpoint and callable(factory):
            if library_of(factory([nn.Parameter(torch.zeros(1))])).steps_local_shards:
                raise UserError(eightbit_shards.ONE_FILE)

    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._fused is not None and self._fused.steps_shards and not self._save_distributed_checkpoint:
            raise UserError(eightbit_shards.ONE_FILE)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._fused is not None and self._fused.steps_shards:
            return eightbit_shards.state_dict(_unwrapped(optimizer), self.lightning_module)
        return super().optimizer_state(optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if self._fused is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # Lightning loads into existing optimizer state (torch would create it with all gradients at once).
        self._fused.initialize_state()
        if not self._fused.steps_shards:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            raise UserError(eightbit_shards.NOT_SHARDED.format(path=path))
        # Lightning's load of the weights and the trainer state; bitsandbytes' state is loaded here.
        metadata = _load_checkpoint(
            path, {"state_dict": self.model}, strict=self.lightning_module.strict_loading, weights_only=weights_only
        )
        eightbit_shards.load_state_dict(self._fused.optimizer, self.lightning_module, path, "optimizer_0")
        return metadata


def _unwrapped(optimizer: Optimizer) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def shard(model: nn.Module, mesh: Any) -> None:
    """FSDP2: each transformer layer (`lit_memory.hf.anatomy.find_layers`), then the root (once; a second
    fit finds it sharded)."""
    if isinstance(model, FSDPModule):
        return
    for layer in find_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def hugging_face_models(module: nn.Module, strategy: str) -> list[nn.Module]:
    """The outermost Hugging Face models in ``module`` (itself, or ones it holds), which ``strategy`` shards.
    A peft model wraps the Hugging Face one (its adapters live inside the layers sharded with them)."""
    models = _hugging_face_models(module)
    if not models:
        raise UserError(f"{strategy} shards the Hugging Face models a module holds; {type(module).__name__} holds none")
    return models


class FusedFSDPStrategy(FSDP2Strategy):
    """`FSDP2Strategy` with the fused step on by default (``fused=True``)."""

    fused_step = True

    def __init__(self, fused: bool = True, **kwargs: Any) -> None:
        super().__init__(fused=fused, **kwargs)
