"""What a training step's memory depends on (`Setup`), and the configured module built from it.

A `Setup` is resolved from a run's settings (`lit_memory.tools.estimate.setup_of`) or from a
running Trainer (`Setup.from_run`); `build` makes the module and optimizer exactly as ``fit``
does, with tensors created under a context that allocates nothing (the ``meta`` device, fake
tensors). The analytic model (`analytic`) and the simulation (`simulate`) both start here.
"""

from __future__ import annotations

import contextlib
import inspect
import pkgutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from lit_memory.errors import UserError
from lit_memory.lora import apply_lora
from lit_memory.memory.footprint import Footprint
from lit_memory.model import SequenceClassifier, checkpoint_policy

# precision -> (parameter/gradient dtype, compute dtype of linear outputs, autocast?)
PRECISIONS = {
    "32-true": (torch.float32, torch.float32, False),
    "64-true": (torch.float64, torch.float64, False),
    "bf16-mixed": (torch.float32, torch.bfloat16, True),
    "16-mixed": (torch.float32, torch.float16, True),
    "bf16-true": (torch.bfloat16, torch.bfloat16, False),
    "16-true": (torch.float16, torch.float16, False),
}
DEVICES = ("cuda", "cpu")
@dataclass(frozen=True)
class Setup:
    """Everything a training step's memory depends on, resolved from configs or a running trainer."""

    model: dict[str, Any]  # the module's init args, optimizer excluded
    optimizer: Callable  # the module's optimizer factory (params -> Optimizer)
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    batch_size: int = 32
    max_length: int = 128
    fused: bool = False
    bucket: str = "layer"  # the fused strategy's bucket setting (lit_memory.fused.parse_bucket)
    clip_norm: bool = False  # gradients clipped by norm; fused, a backward that only measures it comes first
    device: str = "cuda"  # the device type the analytic prediction is for
    module_class: type = SequenceClassifier
    sharded: bool = False  # FSDP: parameters, gradients and optimizer state split over the ranks
    world_size: int = 1  # processes (devices x nodes): the numbers are per rank

    @classmethod
    def from_run(cls, trainer, module) -> "Setup":
        """The setup of a running fit (raises AttributeError for modules/data without these settings)."""
        data = trainer.datamodule
        return cls(
            model=init_args(type(module), module.hparams),
            optimizer=module.optimizer_factory,
            precision=normalize_precision(trainer.precision),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            batch_size=data.hparams.batch_size,
            max_length=data.hparams.max_length,
            fused=is_fused(trainer.strategy),
            bucket=getattr(trainer.strategy, "bucket", "layer"),
            clip_norm=clips_by_norm(trainer.gradient_clip_val, trainer.gradient_clip_algorithm),
            device=trainer.strategy.root_device.type,
            module_class=type(module),
            sharded=is_sharded(trainer.strategy),
            world_size=trainer.world_size,
        )

    def module(self) -> SequenceClassifier:
        # Always from the config: weights are never loaded to predict memory.
        return self.module_class(**{**self.model, "pretrained": False}, optimizer=self.optimizer)

    @property
    def checkpointing(self) -> Optional[str]:
        """``None``, ``"full"`` or ``"selective"``."""
        return checkpoint_policy(self.model.get("gradient_checkpointing"))

    @property
    def offloading(self) -> bool:
        """Whether saved activations leave the device (offloading is a no-op on a CPU run)."""
        return bool(self.model.get("offload_activations")) and self.device == "cuda"

    @property
    def optimizer_class(self) -> Any:
        """The optimizer's class (the factories are partials of it), or the factory itself."""
        return next((a for a in getattr(self.optimizer, "args", ()) if isinstance(a, type)), None) or self.optimizer

    @property
    def optimizer_name(self) -> str:
        return getattr(self.optimizer_class, "__name__", str(self.optimizer_class))

    @property
    def stochastic_rounding(self) -> bool:
        """Whether the optimizer rounds bf16 weights stochastically (torchao's ``bf16_stochastic_round``)."""
        # The CLI's factories, and tests' functools.partial, are partials holding the init args.
        return bool(getattr(self.optimizer, "keywords", {}).get("bf16_stochastic_round"))

    @property
    def loses_small_updates(self) -> bool:
        """16-bit weights without fp32 master copies, updated by rounding to nearest: every update below half
        a unit in their last place is lost. Stochastic rounding keeps them on average."""
        weights = PRECISIONS[self.precision][0]
        return weights.itemsize == 2 and not (weights == torch.bfloat16 and self.stochastic_rounding)

    def describe(self) -> str:
        hp = self.model
        parts = [
            f"batch {self.batch_size} x {self.max_length} tokens",
            self.precision,
            self.optimizer_name + (" with stochastic rounding" if self.stochastic_rounding else ""),
            f"accumulate {self.accumulate_grad_batches}",
        ]
        if self.checkpointing:
            parts.append(f"{self.checkpointing} gradient checkpointing")
        if hp.get("offload_activations"):
            parts.append("activations offloaded")
        if hp.get("freeze") is not None:
            parts.append(f"freeze {hp['freeze']}")
        if self.fused:
            parts.append(f"fused backward+step ({self.bucket} buckets)")
        if self.clip_norm and self.fused:
            parts.append("clipping by norm (a measuring backward first)")
        if self.sharded:
            parts.append(f"sharded over {self.world_size} ranks")
        return ", ".join(parts)


@dataclass
class Prediction:
    method: str  # "analytic" or "simulated"
    device: str  # the device type the numbers are for
    footprint: Footprint
    inference: int  # bytes held by a forward pass without autograd at the same batch shape
    parameters: int = 0
    trainable: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def init_args(cls: type, hparams: Any) -> dict[str, Any]:
    """A module's init args (its optimizer excluded) from its hyper-parameters."""
    names = [n for n in inspect.signature(cls).parameters if n != "optimizer"]
    return {n: hparams[n] for n in names if n in hparams}


def normalize_precision(precision: Any) -> str:
    from lightning.fabric.connector import _convert_precision_to_unified_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "bf16 is supported for historical reasons"
        unified = str(_convert_precision_to_unified_args(precision or "32-true"))
    if unified not in PRECISIONS:
        raise UserError(f"precision {precision!r} is not modelled; choose one of: {', '.join(PRECISIONS)}")
    return unified


def strategy_class(strategy: Any) -> Any:
    """The strategy a config names (a registry name, a class path, a class spec) or is: a class or an instance."""
    if isinstance(strategy, dict) or hasattr(strategy, "class_path"):  # a class spec, parsed or plain
        strategy = strategy.get("class_path", "")
    if isinstance(strategy, str):
        from lightning.pytorch.strategies import StrategyRegistry

        if strategy in StrategyRegistry:
            return StrategyRegistry[strategy]["strategy"]
        if "." in strategy:
            return pkgutil.resolve_name(strategy)
    return strategy


def is_fused(strategy: Any) -> bool:
    """True for strategies that step parameters from their gradient hooks (``fused_step``), as configured."""
    init_args = strategy.get("init_args") if isinstance(strategy, dict) or hasattr(strategy, "class_path") else None
    if init_args and init_args.get("fused") is not None:  # the strategies that take it as an argument
        return bool(init_args.get("fused"))
    return bool(getattr(strategy_class(strategy), "fused_step", False))


def clips_by_norm(gradient_clip_val: Any, gradient_clip_algorithm: Any) -> bool:
    """Whether the trainer's settings clip gradients by norm (Lightning's default algorithm)."""
    return bool(gradient_clip_val) and str(gradient_clip_algorithm or "norm").lower() == "norm"


def is_sharded(strategy: Any) -> bool:
    """True for FSDP strategies (Lightning's FSDPStrategy, ModelParallelStrategy and ours built on it)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    found = strategy_class(strategy)
    sharding = (FSDPStrategy, ModelParallelStrategy)
    return isinstance(found, sharding) or (isinstance(found, type) and issubclass(found, sharding))


# -- building the configured module -------------------------------------------------------------


def build(setup: Setup, context: contextlib.AbstractContextManager) -> tuple[SequenceClassifier, torch.optim.Optimizer]:
    """The configured module and its optimizer, exactly as ``fit`` builds them, with tensors created
    under ``context`` (the ``meta`` device for the analytic model, fake tensors for the simulation)."""
    module = setup.module()
    lora, module.lora = module.lora, None
    if lora is None:
        with context, _tensor_init_context(setup.precision):
            module.configure_model()
    else:
        # peft must not meet fake tensors: it cannot create adapters under FakeTensorMode (its .to() goes
        # through torch's tensor swap, which fake tensors refuse), and applied to a model of fake tensors
        # outside the mode it corrupted the C heap (see `adopt`). So the model and its adapters are made on
        # the meta device, and then made again in ``context``.
        with torch.device("meta"), _tensor_init_context(setup.precision):
            module.configure_model()
        module.lora, module.model = lora, apply_lora(module.model, lora)
        adopt(module.model, context)
    # Outside the context: optimizers may build small lookup tensors from data (bitsandbytes' quantile maps).
    optimizer = module.build_optimizer()
    return module, optimizer


def adopt(model: torch.nn.Module, context: Any) -> int:
    """Give every parameter and buffer of ``model`` that is not already one of ``context``'s tensors (a
    ``FakeTensorMode``, or the ``meta`` device) an empty one made in it, same shape, strides and dtype
    (values never matter there); returns how many were replaced. Tied tensors stay tied.

    Why LoRA models are built on ``meta`` and adopted, rather than built under FakeTensorMode and given
    real adapters afterwards (as until 2026-11): peft applied to a model of fake tensors, outside their
    mode, with real adapters stepped inside it, corrupted the C heap (torch 2.13, peft 0.21, transformers
    5.23): valgrind found ``StorageWeakRef.__del__`` releasing weak references to storages already freed
    (invalid read in ``THPStorage_freeWeakRef``), and the process crashed later, anywhere (``malloc_trim``,
    ``open()``), in every process that simulated two LoRA steps. See docs/memory.md, "A crash in the
    simulation".
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    fake = isinstance(context, FakeTensorMode)

    def owned(tensor: torch.Tensor) -> bool:
        return isinstance(tensor, FakeTensor) and tensor.fake_mode is context if fake else tensor.is_meta

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        with (context if fake else contextlib.nullcontext()):
            # the default device, as for the tensors the model made under ``context`` itself
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                       device=None if fake else "meta")

    made: dict[int, torch.Tensor] = {}  # by identity: tied tensors stay tied
    for sub in model.modules():
        for slots in (sub._parameters, sub._buffers):
            for name, tensor in list(slots.items()):
                if tensor is None or owned(tensor):
                    continue
                if id(tensor) not in made:
                    new = empty(tensor)
                    made[id(tensor)] = torch.nn.Parameter(new, tensor.requires_grad) if slots is sub._parameters else new
                slots[name] = made[id(tensor)]
    return len(made)


def _tensor_init_context(precision: str) -> contextlib.AbstractContextManager:
    """Lightning's "-true" precisions create the module's tensors in their dtype (its tensor_init_context)."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision

    if precision in ("bf16-true", "16-true"):
        return HalfPrecision(precision).tensor_init_context()
    if precision == "64-true":
        return DoublePrecision().tensor_init_context()
    return contextlib.nullcontext()
