"""The one typed description of a training step (`Step`), built once from a run's parsed settings.

Every prediction starts here: ``estimate``, ``plan``, the memory monitor of a fit, the out-of-memory advice
and the published-measurement table all call `Step.from_settings` on the resolved config (a plain dict,
as ``LitMemoryCLI.settings.as_dict()`` gives it), and derive other setups from it with `Step.with_settings`
(the same settings with a recipe's values laid over them), never by rebuilding one another way. The
optimizer is kept as its config (`OptimizerSpec`: class path and init args), not as a factory to read back.

The settings are read once, into typed values: the module's and the data's sections hold every argument of
`SequenceClassifier` and `TextClassificationData` (read from their signatures, `SECTIONS`: no argument list is
copied here), the precision is a `lit_memory.settings.Precision`, the bucket a `lit_memory.fused.Bucketing`.
`Step.as_settings` writes a step back as the settings a run of it states, and `Step.key` is the one cache key of
whatever is computed from a step.

`build` makes the module and optimizer exactly as ``fit`` does, with tensors created under a context that
allocates nothing (the ``meta`` device, fake tensors).
"""

from __future__ import annotations

import contextlib
import functools
import json
import pkgutil
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping, Optional

import torch
from jsonargparse import ArgumentParser
from lightning.pytorch import Trainer
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, StrategyRegistry
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lit_memory.data import TextClassificationData
from lit_memory.errors import UserError
from lit_memory.fused import DEFAULT_BUCKET, Bucketing, parse_bucket
from lit_memory.memory.hardware import nccl
from lit_memory.memory.hardware.gpus import DEVICES, Target  # noqa: F401  (DEVICES: the tools' choices)
from lit_memory.memory.margin import DEFAULT_MARGIN
from lit_memory.memory.measure.footprint import Footprint
from lit_memory.memory.model.loops import Loop
from lit_memory.memory.settings import MemorySettings
from lit_memory.model import SequenceClassifier
from lit_memory.optim.configure import DEFAULT_OPTIMIZER
from lit_memory.optim.optimizers import Library, library_of
from lit_memory.optim.precision import trains_on
from lit_memory.run.activation_checkpointing import CheckpointPlan, is_auto
from lit_memory.settings import PRECISIONS, Precision, arguments, key_of, overlay, section, to_plain

# The sections of a run's settings a step reads, by the class LightningCLI builds from each: what they hold and
# their defaults are those classes' signatures (`lit_memory.settings.section`).
SECTIONS = {"model": SequenceClassifier, "data": TextClassificationData, "trainer": Trainer}


@dataclass(frozen=True)
class OptimizerSpec:
    """The configured optimizer: ``model.optimizer`` as the config states it."""

    class_path: str
    init_args: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, value: Any) -> "OptimizerSpec":
        if isinstance(value, OptimizerSpec):
            return value
        if isinstance(value, str):
            return cls(value)
        if not isinstance(value, Mapping) or "class_path" not in value:
            raise UserError(f"model.optimizer must be a class_path with init_args, got {value!r}")
        return cls(str(value["class_path"]), to_plain(value.get("init_args") or {}))

    @property
    def name(self) -> str:
        return self.class_path.rsplit(".", 1)[-1]

    @property
    def library(self) -> Library:
        """What lit_memory knows of the optimizer's library (`lit_memory.optim.optimizers.library_of`)."""
        return library_of(self.class_path)

    @property
    def stochastic_rounding(self) -> bool:
        """Whether the optimizer rounds bf16 weights stochastically (torchao's ``bf16_stochastic_round``)."""
        return self.library.stochastic_rounding(self.init_args)

    @property
    def key(self) -> str:
        """`lit_memory.settings.key_of` its config (JSON: `factory` reads it back)."""
        return key_of(self.to_dict())

    def factory(self) -> Callable:
        """The callable the CLI would give the module (params -> optimizer), made by jsonargparse from this
        spec, so the import goes through the same parser (and import policy, `lit_memory.config.trust`) as ``fit``."""
        return _factory(self.key)

    def to_dict(self) -> dict[str, Any]:
        return {"class_path": self.class_path, "init_args": dict(self.init_args)}


@functools.lru_cache(maxsize=64)
def _factory(key: str) -> Callable:

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--optimizer", type=OptimizerCallable)
    return parser.instantiate(parser.parse_object({"optimizer": json.loads(key)})).optimizer


@dataclass(frozen=True)
class Step:
    """Everything a training step's memory depends on, from one run's settings."""

    model: Mapping[str, Any]  # the module's init args but the optimizer, every one (plain data: `__post_init__`)
    optimizer: OptimizerSpec
    precision: Precision = PRECISIONS["32-true"]  # given as Lightning's value, parsed once (`__post_init__`)
    accumulate_grad_batches: int = 1
    batch_size: int = 32
    max_length: int = 128
    fused: bool = False
    bucket: Bucketing = Bucketing(DEFAULT_BUCKET)  # the fused strategy's setting, parsed once (as written: too)
    clip_norm: bool = False  # gradients clipped by norm; fused, a backward that only measures it comes first
    sharded: bool = False  # FSDP: parameters, gradients and optimizer state split over the ranks
    world_size: int = 1  # processes (devices x nodes): the numbers are per rank
    target: Target = field(default_factory=Target)
    loop: Loop = field(default_factory=Loop)
    margin: float = DEFAULT_MARGIN  # ``memory.margin``: the share of a limit every fit decision keeps free
    memory: MemorySettings = field(default_factory=MemorySettings, compare=False, repr=False)  # the ``memory:`` block
    settings: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # what it was built from
    planned: Optional[str] = field(default=None, compare=False)  # what `gradient_checkpointing: auto` chose, in words

    def __post_init__(self) -> None:
        # A step made in Python may give some of the module's arguments (the others are their defaults), Lightning's
        # precision value and the bucket as written: read here, once, into what a step holds.
        object.__setattr__(self, "model", _module_settings(self.model))
        object.__setattr__(self, "precision", Precision.of(self.precision))
        object.__setattr__(self, "bucket", parse_bucket(self.bucket))

    @classmethod
    def from_settings(
        cls, settings: Mapping[str, Any], target: Optional[Target] = None, loop: Optional[Loop] = None,
        memory: Optional[MemorySettings] = None,
    ) -> "Step":
        """The step a run's resolved settings (``model``, ``trainer``, ``data`` sections, plain data) trains;
        ``memory``: their ``memory`` block where a run has built it already (else built here)."""
        return cls._of_plain(to_plain(settings), target, loop, memory)

    @classmethod
    def _of_plain(
        cls,
        settings: dict[str, Any],
        target: Optional[Target],
        loop: Optional[Loop],
        memory: Optional[MemorySettings] = None,
    ) -> "Step":
        trainer, data = section(Trainer, settings.get("trainer")), section(TextClassificationData, settings.get("data"))
        given = settings.get("model") or {}
        optimizer = OptimizerSpec.of(given.get("optimizer") or DEFAULT_OPTIMIZER)
        model = _module_settings({k: v for k, v in given.items() if k != "optimizer"})
        strategy = trainer["strategy"]
        sharded = is_sharded(strategy)
        memory = memory if memory is not None else MemorySettings.of(settings)
        target = target if target is not None else Target()
        if memory.allocator and target.cuda_device and not target.allocator_given:  # as a run sets them
            target = replace(target, allocator=memory.allocator_config, allocator_given=True)
        world_size = ranks(trainer["devices"], target.devices) * int(trainer["num_nodes"] or 1) if sharded else 1
        if target.cuda_device and nccl.small(memory.limit, world_size):  # as a run sets them (`nccl.for_run`)
            target = replace(target, nccl=target.nccl.under(nccl.SMALL))
        step = cls(
            model=model,
            optimizer=optimizer,
            precision=Precision.of(trainer["precision"]),
            accumulate_grad_batches=int(trainer["accumulate_grad_batches"] or 1),
            batch_size=int(data["batch_size"]),
            max_length=int(data["max_length"]),
            fused=is_fused(strategy),
            bucket=parse_bucket(_init_args(strategy).get("bucket") or DEFAULT_BUCKET),
            clip_norm=clips_by_norm(trainer["gradient_clip_val"], trainer["gradient_clip_algorithm"]),
            sharded=sharded,
            world_size=world_size,
            target=target,
            loop=loop if loop is not None else Loop(),
            margin=memory.margin,
            memory=memory,
            settings=settings,
        )
        if is_auto(model.get("gradient_checkpointing")):
            return step  # resolved for a budget by `lit_memory.planning.recompute.planned`
        if is_auto(model.get("offload_activations")):  # weighed only against a plan being chosen (`planned`)
            model["offload_activations"] = False
            step = replace(step, model=model)
        step.checkpointing  # parsed once, here: one error line for a bad value
        return step

    def with_settings(self, values: Mapping[str, Any]) -> "Step":
        """This step with dotted settings laid over its own (``{"data.batch_size": 8, "model.optimizer": {...}}``,
        over `as_settings`). A precision among them is the one a run with it trains with on the target's GPU (a
        recipe's bf16 on a GPU without bf16: `lit_memory.optim.precision.trains_on`; bf16 weights there are one
        `UserError`)."""
        if values.get("trainer.precision") is not None and self.target.cuda_device:
            values = {**values, "trainer.precision": trains_on(values["trainer.precision"], self.target.gpu)}
        # the memory block is built again only where the values change it
        changed = any(key == "memory" or key.startswith("memory.") for key in values)
        memory = (
            None
            if changed
            else self.memory
            if self.memory.margin == self.margin
            else replace(self.memory, margin=self.margin)
        )
        return Step._of_plain(overlay(self._stated, values), self.target, self.loop, memory)  # overlay's are plain

    def as_settings(self) -> dict[str, Any]:
        """The settings a run of this step states, as plain data (`from_settings` reads them back to an equal step):
        the ones it was made from, with its own fields written over them, so a step made in Python, or one a field
        of was replaced, is laid over as it is. A strategy is written only where the one it was made with does not
        give its fusion, sharding or bucket."""
        return to_plain(self._stated)  # a copy: the cached one is never handed out

    @functools.cached_property  # a step is frozen; plan lays hundreds of combinations over one
    def _stated(self) -> dict[str, Any]:
        trainer = section(Trainer, self.settings.get("trainer"))
        values: dict[str, Any] = {
            "model": {**self.model, "optimizer": self.optimizer.to_dict()},
            "data.batch_size": self.batch_size,
            "data.max_length": self.max_length,
            "trainer.precision": self.precision.name,
            "trainer.accumulate_grad_batches": self.accumulate_grad_batches,
            "memory.margin": self.margin,
        }
        strategy = trainer["strategy"]
        bucket = _init_args(strategy).get("bucket") or DEFAULT_BUCKET
        if (is_fused(strategy), is_sharded(strategy), parse_bucket(bucket)) != (self.fused, self.sharded, self.bucket):
            values["trainer.strategy"] = _strategy_for(self.fused, self.sharded, self.bucket)
        if self.sharded and ranks(trainer["devices"]) * int(trainer["num_nodes"] or 1) != self.world_size:
            values.update({"trainer.devices": self.world_size, "trainer.num_nodes": 1})
        if clips_by_norm(trainer["gradient_clip_val"], trainer["gradient_clip_algorithm"]) != self.clip_norm:
            values.update(
                {
                    "trainer.gradient_clip_val": 1.0 if self.clip_norm else None,
                    "trainer.gradient_clip_algorithm": "norm",
                }
            )
        return overlay(self.settings, values)

    def on(self, target: Target) -> "Step":
        return replace(self, target=target)

    # -- derived ---------------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self.target.type

    @functools.cached_property
    def communicators(self) -> nccl.NcclMemory:
        """NCCL's memory on each rank's GPU (`lit_memory.memory.hardware.nccl`): the communicators this step's run
        creates, FSDP2 on Lightning's (data_parallel, tensor_parallel) mesh of (world, 1), with its NCCL settings."""
        if not self.target.cuda_device or not self.sharded:
            return nccl.NcclMemory(settings=self.target.nccl)
        found = nccl.communicators(self.world_size, (self.world_size, 1), ("data_parallel", "tensor_parallel"))
        return nccl.nccl_memory(found, self.target.nccl, self.target.gpu.key, self.target.gpu.capability)

    @property
    def outside_allocator(self) -> int:
        """What the device holds beyond the allocator's segments: the CUDA context and NCCL's communicators."""
        return self.target.context_bytes + self.communicators.total if self.target.cuda_device else 0

    @functools.cached_property
    def checkpointing(self) -> Optional[CheckpointPlan]:
        """What each layer recomputes (None: nothing)."""
        return CheckpointPlan.parse(self.model.get("gradient_checkpointing"))

    @property
    def offloading(self) -> bool:
        """Whether saved activations leave the device (offloading is a no-op on a CPU run)."""
        return self.model.get("offload_activations") is True and self.device == "cuda"

    @property
    def optimizer_name(self) -> str:
        return self.optimizer.name

    @property
    def stochastic_rounding(self) -> bool:
        return self.optimizer.stochastic_rounding

    @property
    def scaled(self) -> bool:
        """fp16 autocast with torch's GradScaler (``16-mixed``: Lightning gives it one)."""
        return self.precision.scaled

    @property
    def measures(self) -> bool:
        """The fused step runs a backward that only measures before the one that steps: for clipping by norm
        (the norm) and loss scaling (whether a gradient overflowed), one pass for both (`lit_memory.fused`)."""
        return self.fused and (self.clip_norm or self.scaled)

    @property
    def loses_small_updates(self) -> bool:
        """16-bit weights without fp32 master copies, updated by rounding to nearest: every update below half
        a unit in their last place is lost. Stochastic rounding keeps them on average."""
        weights = self.precision.param
        return weights.itemsize == 2 and not (weights == torch.bfloat16 and self.stochastic_rounding)

    def module(self) -> SequenceClassifier:
        # Always from the config: weights are never loaded to predict memory. Built for this step's precision (the
        # weights' dtype, a LoRA base's), as a Trainer of it would build it.
        module = SequenceClassifier(**{**self.model, "pretrained": False}, optimizer=self.optimizer.factory())
        module.built_for = self.precision
        return module

    @property
    def quantised_base(self) -> bool:
        """QLoRA: the frozen base's linear weights in 4 bits (``model.lora.base: nf4``)."""
        return (self.model.get("lora") or {}).get("base") == "nf4"

    def dense_equivalent(self) -> "Step":
        """This step with a dense frozen base in place of a 4-bit one: the same matmuls (a 4-bit matmul runs the
        dequantised weight's GEMM), for what counts FLOPs on fake tensors, which bitsandbytes' weights cannot be."""
        if not self.quantised_base:
            return self
        return replace(self, model={**self.model, "lora": {**self.model["lora"], "base": None}})

    def describe(self) -> str:
        hp = self.model
        parts = [
            f"batch {self.batch_size} x {self.max_length} tokens",
            self.precision.name,
            self.optimizer_name + (" with stochastic rounding" if self.stochastic_rounding else ""),
            f"accumulate {self.accumulate_grad_batches}",
        ]
        if self.checkpointing:
            parts.append(f"{self.checkpointing.describe()}".replace("checkpointing", "gradient checkpointing"))
        if hp.get("offload_activations"):
            parts.append("activations offloaded")
        if hp.get("freeze") is not None:
            parts.append(f"freeze {hp['freeze']}")
        if lora := hp.get("lora"):
            base = {"nf4": " on a 4-bit NF4 base (QLoRA)", "bf16": " on a bf16 base"}.get(lora.get("base"), "")
            parts.append(f"LoRA rank {lora.get('rank', 8)}{base}")
        if self.fused:
            parts.append(f"fused backward+step ({self.bucket} buckets)")
        if self.measures:
            why = " and ".join(
                w for w, on in (("clipping by norm", self.clip_norm), ("loss scaling", self.scaled)) if on
            )
            parts.append(f"{why} (a measuring backward first)")
        if self.sharded:
            parts.append(f"sharded over {self.world_size} rank{'s' if self.world_size > 1 else ''}")
        if self.loop.name != "lightning":
            parts.append(f"{self.loop.name} loop")
        return ", ".join(parts)

    def key(self, *names: str, **values: Any) -> str:
        """The one cache key of what is computed from this step: its fields ``names`` (default: every field a step
        compares by), ``values`` standing in for some of them (the part of the model's settings a result depends
        on), as `lit_memory.settings.key_of` writes them: plain strings, no reference to anything live."""
        names = names or _COMPARED
        return key_of({name: values[name] if name in values else getattr(self, name) for name in names})

    @property
    def cache_key(self) -> str:
        """What a meta build with its checkpointing plan depends on (model, optimizer, precision)."""
        return self.key("model", "optimizer", "precision")

    @property
    def build_key(self) -> str:
        """`cache_key` without the checkpointing plan: what the module's parameters and optimizer depend on."""
        model = {k: v for k, v in self.model.items() if k != "gradient_checkpointing"}
        kernels = "" if self.loop.fused_kernels else "|torch's default optimizer kernels"  # `build` sets them
        return self.key("model", "optimizer", "precision", model=model) + kernels


_COMPARED = tuple(f.name for f in fields(Step) if f.compare)


def _module_settings(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every argument of the module but the optimizer (`SECTIONS`), as given or its default; one `UserError` line
    for a key that is none of them."""
    if unknown := [k for k in given if k not in _MODULE_ARGUMENTS]:
        raise UserError(f"model: {', '.join(map(repr, unknown))}: not arguments of {SequenceClassifier.__name__} "
                        f"(those are: {', '.join(_MODULE_ARGUMENTS)})")
    return section(SequenceClassifier, given, without=("optimizer",))


_MODULE_ARGUMENTS = tuple(name for name in arguments(SequenceClassifier) if name != "optimizer")


def _strategy_for(fused: bool, sharded: bool, bucket: Bucketing) -> Any:
    """A strategy setting with this fusion, sharding and bucket (`Step.as_settings`)."""
    if sharded:
        return {"class_path": "lit_memory.FSDP2Strategy", "init_args": {"fused": fused, "bucket": str(bucket)}}
    if fused:
        return {"class_path": "lit_memory.FusedSingleDeviceStrategy", "init_args": {"bucket": str(bucket)}}
    return "auto"




@dataclass
class Prediction:
    method: str  # "analytic" or "simulated"
    device: str  # the device type the numbers are for
    footprint: Footprint  # tensors per category and phase, with the allocator's and the device's levels
    inference: int  # bytes held by a forward pass without autograd at the same batch shape
    parameters: int = 0
    trainable: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    attention: str = ""  # the attention kernel, in words
    # The steady-state step point by point (`lit_memory.memory.model.program.timeline`), where asked for.
    timeline: Optional[list[dict]] = None


# -- reading settings ------------------------------------------------------------------------------


def strategy_class(strategy: Any) -> Any:
    """The strategy a config names (a registry name, a class path, a class spec) or is: a class or an instance."""
    if isinstance(strategy, Mapping) or hasattr(strategy, "class_path"):  # a class spec, parsed or plain
        strategy = strategy.get("class_path", "")
    if isinstance(strategy, str):

        if strategy in StrategyRegistry:
            return StrategyRegistry[strategy]["strategy"]
        if "." in strategy:
            return pkgutil.resolve_name(strategy)
    return strategy


def _init_args(strategy: Any) -> Mapping[str, Any]:
    if isinstance(strategy, Mapping) or hasattr(strategy, "class_path"):
        return strategy.get("init_args") or {}
    return {}


def is_fused(strategy: Any) -> bool:
    """True for strategies that step parameters from their gradient hooks (``fused_step``), as configured."""
    init_args = _init_args(strategy)
    if init_args.get("fused") is not None:  # the strategies that take it as an argument
        return bool(init_args.get("fused"))
    return bool(getattr(strategy_class(strategy), "fused_step", False))


def clips_by_norm(gradient_clip_val: Any, gradient_clip_algorithm: Any) -> bool:
    """Whether the trainer's settings clip gradients by norm (Lightning's default algorithm)."""
    return bool(gradient_clip_val) and str(gradient_clip_algorithm or "norm").lower() == "norm"


def is_sharded(strategy: Any) -> bool:
    """True for FSDP strategies (Lightning's FSDPStrategy, ModelParallelStrategy and ours built on it)."""

    found = strategy_class(strategy)
    sharding = (FSDPStrategy, ModelParallelStrategy)
    return isinstance(found, sharding) or (isinstance(found, type) and issubclass(found, sharding))


def ranks(devices: Any, available: Optional[int] = None) -> int:
    """Devices per node as configured: a count, a list of indices, or "auto"/-1: every device of the machine, the
    ``available`` ones where the prediction is for this machine (a run's), else 1 (pass --trainer.devices N)."""
    if str(devices) in ("auto", "-1") and available:
        return available
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    try:
        return max(int(devices), 1)
    except (TypeError, ValueError):
        return 1


# -- building the configured module -------------------------------------------------------------


def build(step: Step, context: contextlib.AbstractContextManager) -> tuple[SequenceClassifier, torch.optim.Optimizer]:
    """The configured module and its optimizer, exactly as ``fit`` builds them, with tensors created
    under ``context`` (the ``meta`` device for the analytic model, fake tensors for the simulation)."""
    module = step.module()
    if module.lora is None:
        with context, _tensor_init_context(step.precision):
            module.configure_model()
    else:
        # peft must not meet fake tensors: it cannot create adapters under FakeTensorMode (its .to() goes
        # through torch's tensor swap, which fake tensors refuse), and applied to a model of fake tensors
        # outside the mode it corrupted the C heap (see `adopt`). So the model and its adapters are made on
        # the meta device (a 4-bit base by bitsandbytes' meta kernels: `lit_memory.hf.qlora`), and then made again in
        # ``context``.
        with torch.device("meta"), _tensor_init_context(step.precision):
            module.configure_model()
        adopt(module.model, context)
    # Outside the context: optimizers may build small lookup tensors from data (bitsandbytes' quantile maps).
    optimizer = module.build_optimizer()
    if not step.loop.fused_kernels:  # a loop that leaves torch's choice of kernel as it is
        for group in optimizer.param_groups:
            if group.get("fused", False) is None:
                group["fused"] = False
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
                    made[id(tensor)] = (
                        torch.nn.Parameter(new, tensor.requires_grad) if slots is sub._parameters else new
                    )
                slots[name] = made[id(tensor)]
    return len(made)


def _tensor_init_context(precision: Precision) -> contextlib.AbstractContextManager:
    """Lightning's "-true" precisions create the module's tensors in their dtype (its tensor_init_context)."""

    if precision.half_weights:
        return HalfPrecision(precision.name).tensor_init_context()
    if precision.param == torch.float64:
        return DoublePrecision().tensor_init_context()
    return contextlib.nullcontext()
