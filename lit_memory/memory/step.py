"""The one typed description of a training step (`Step`), built once from a run's parsed settings.

Every prediction starts here: ``estimate``, ``plan``, the memory monitor of a fit, the out-of-memory advice
and the published-measurement table all call `Step.from_settings` on the resolved config (a plain dict,
as ``LitMemoryCLI.settings.as_dict()`` gives it), and derive other setups from it with `Step.with_settings`
(the same settings with a recipe's values laid over them), never by rebuilding one another way. The
optimizer is kept as its config (`OptimizerSpec`: class path and init args), not as a factory to read back.

`build` makes the module and optimizer exactly as ``fit`` does, with tensors created under a context that
allocates nothing (the ``meta`` device, fake tensors).
"""

from __future__ import annotations

import contextlib
import functools
import json
import pkgutil
import warnings
from collections import abc
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional

import torch

from lit_memory.errors import UserError
from lit_memory.lora import apply_lora
from lit_memory.memory.device import Target
from lit_memory.memory.footprint import Footprint
from lit_memory.memory.margin import DEFAULT_MARGIN, check_margin
from lit_memory.activations import CheckpointPlan, is_auto
from lit_memory.model import DEFAULT_OPTIMIZER, SequenceClassifier
from lit_memory.optimizers import Library, library_of
from lit_memory.precision import trains_on

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
        return cls(str(value["class_path"]), _plain(value.get("init_args") or {}))

    @property
    def name(self) -> str:
        return self.class_path.rsplit(".", 1)[-1]

    @property
    def library(self) -> Library:
        """What lit_memory knows of the optimizer's library (`lit_memory.optimizers.library_of`)."""
        return library_of(self.class_path)

    @property
    def stochastic_rounding(self) -> bool:
        """Whether the optimizer rounds bf16 weights stochastically (torchao's ``bf16_stochastic_round``)."""
        return self.library.stochastic_rounding(self.init_args)

    @property
    def key(self) -> str:
        return json.dumps({"class_path": self.class_path, "init_args": self.init_args}, sort_keys=True, default=str)

    def factory(self) -> Callable:
        """The callable the CLI would give the module (params -> optimizer), made by jsonargparse from this
        spec, so the import goes through the same parser (and import policy, `lit_memory.trust`) as ``fit``."""
        return _factory(self.key)

    def to_dict(self) -> dict[str, Any]:
        return {"class_path": self.class_path, "init_args": dict(self.init_args)}


@functools.lru_cache(maxsize=64)
def _factory(key: str) -> Callable:
    from jsonargparse import ArgumentParser
    from lightning.pytorch.cli import OptimizerCallable

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--optimizer", type=OptimizerCallable)
    return parser.instantiate(parser.parse_object({"optimizer": json.loads(key)})).optimizer


@dataclass(frozen=True)
class Loop:
    """The training loop around the step, where it changes memory: whether autocast caches its 16-bit
    weight copies for the whole forward pass, and when the previous step's gradients are released.

    lit_memory's fit (Lightning's Trainer) runs autocast without its cache and frees the gradients right
    after each optimizer step (`SequenceClassifier.optimizer_step`). Other loops differ: Lightning Fabric and
    the HF Trainer (through accelerate) keep torch's default cache; torch 1.x's ``zero_grad()`` zeroed the
    gradients in place (they stay allocated through the next forward); a loop that calls ``zero_grad()``
    after the forward pass keeps them through it."""

    name: str = "lightning"
    autocast_cache: bool = False
    gradients: str = "after_step"  # "after_step" | "before_backward" | "zeroed"

    def __post_init__(self) -> None:
        if self.gradients not in ("after_step", "before_backward", "zeroed"):
            raise UserError(f"unknown gradient release {self.gradients!r}")


LOOPS = {
    "lightning": Loop(),
    "fabric": Loop("fabric", autocast_cache=True),
    "hf-trainer": Loop("hf-trainer", autocast_cache=True),
    # transformers' Trainer with torch 1.x: model.zero_grad() zeroed in place (set_to_none=False then).
    "hf-trainer-torch1": Loop("hf-trainer-torch1", autocast_cache=True, gradients="zeroed"),
}


def loop(name: str) -> Loop:
    if name not in LOOPS:
        raise UserError(f"unknown training loop {name!r}; choose one of: {', '.join(LOOPS)}")
    return LOOPS[name]


@dataclass(frozen=True)
class Step:
    """Everything a training step's memory depends on, from one run's settings."""

    model: Mapping[str, Any]  # the module's init args, optimizer excluded (plain data)
    optimizer: OptimizerSpec
    precision: str = "32-true"
    accumulate_grad_batches: int = 1
    batch_size: int = 32
    max_length: int = 128
    fused: bool = False
    bucket: str = "layer"  # the fused strategy's bucket setting (lit_memory.fused.parse_bucket)
    clip_norm: bool = False  # gradients clipped by norm; fused, a backward that only measures it comes first
    sharded: bool = False  # FSDP: parameters, gradients and optimizer state split over the ranks
    world_size: int = 1  # processes (devices x nodes): the numbers are per rank
    target: Target = field(default_factory=Target)
    loop: Loop = field(default_factory=Loop)
    margin: float = DEFAULT_MARGIN  # ``memory.margin``: the share of a limit every fit decision keeps free
    settings: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)  # what it was built from
    planned: Optional[str] = field(default=None, compare=False)  # what `gradient_checkpointing: auto` chose, in words

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], target: Optional[Target] = None, loop: Optional[Loop] = None) -> "Step":
        """The step a run's resolved settings (``model``, ``trainer``, ``data`` sections, plain data) trains."""
        return cls._of_plain(_plain(settings), target, loop)

    @classmethod
    def _of_plain(cls, settings: dict[str, Any], target: Optional[Target], loop: Optional[Loop]) -> "Step":
        trainer, data = settings.get("trainer") or {}, settings.get("data") or {}
        model = dict(settings.get("model") or {})
        optimizer = OptimizerSpec.of(model.pop("optimizer", None) or DEFAULT_OPTIMIZER)
        model = {k: v for k, v in model.items() if k in _MODEL_ARGS}
        strategy = trainer.get("strategy", "auto")
        sharded = is_sharded(strategy)
        step = cls(
            model=model,
            optimizer=optimizer,
            precision=normalize_precision(trainer.get("precision")),
            accumulate_grad_batches=int(trainer.get("accumulate_grad_batches") or 1),
            batch_size=int(data.get("batch_size", 32)),
            max_length=int(data.get("max_length", 128)),
            fused=is_fused(strategy),
            bucket=_init_args(strategy).get("bucket") or "layer",
            clip_norm=clips_by_norm(trainer.get("gradient_clip_val"), trainer.get("gradient_clip_algorithm")),
            sharded=sharded,
            world_size=ranks(trainer.get("devices", 1)) * int(trainer.get("num_nodes") or 1) if sharded else 1,
            target=_with_recipe_allocator(target if target is not None else Target(), settings),
            loop=loop if loop is not None else Loop(),
            margin=margin_of(settings),
            settings=settings,
        )
        if is_auto(model.get("gradient_checkpointing")):
            return step  # resolved for a budget by `lit_memory.memory.recompute.planned`
        if is_auto(model.get("offload_activations")):  # weighed only against a plan being chosen (`planned`)
            model["offload_activations"] = False
            step = replace(step, model=model)
        CheckpointPlan.parse(model.get("gradient_checkpointing"))  # one error line for a bad value
        return step

    def with_settings(self, values: Mapping[str, Any]) -> "Step":
        """This step with dotted settings laid over its own (``{"data.batch_size": 8, "model.optimizer": {...}}``).
        A precision among them is the one a run with it trains with on the target's GPU (a recipe's bf16 on a GPU
        without bf16: `lit_memory.precision.trains_on`; bf16 weights there are one `UserError`)."""
        if values.get("trainer.precision") is not None and self.target.cuda_device:
            values = {**values, "trainer.precision": trains_on(values["trainer.precision"], self.target.gpu)}
        return Step._of_plain(overlay(self.settings, values), self.target, self.loop)  # overlay's are plain

    def on(self, target: Target) -> "Step":
        return replace(self, target=target)

    # -- derived ---------------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self.target.type

    @property
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
    def attn_implementation(self) -> Optional[str]:
        """The one the config asks for (``model.config_overrides.attn_implementation``), else None (the model's default)."""
        return (self.model.get("config_overrides") or {}).get("attn_implementation")

    @property
    def scaled(self) -> bool:
        """fp16 autocast with torch's GradScaler (``16-mixed``: Lightning gives it one)."""
        return self.precision == "16-mixed"

    @property
    def measures(self) -> bool:
        """The fused step runs a backward that only measures before the one that steps: for clipping by norm
        (the norm) and loss scaling (whether a gradient overflowed), one pass for both (`lit_memory.fused`)."""
        return self.fused and (self.clip_norm or self.scaled)

    @property
    def loses_small_updates(self) -> bool:
        """16-bit weights without fp32 master copies, updated by rounding to nearest: every update below half
        a unit in their last place is lost. Stochastic rounding keeps them on average."""
        weights = PRECISIONS[self.precision][0]
        return weights.itemsize == 2 and not (weights == torch.bfloat16 and self.stochastic_rounding)

    def module(self) -> SequenceClassifier:
        # Always from the config: weights are never loaded to predict memory.
        return SequenceClassifier(**{**self.model, "pretrained": False}, optimizer=self.optimizer.factory())

    def describe(self) -> str:
        hp = self.model
        parts = [
            f"batch {self.batch_size} x {self.max_length} tokens",
            self.precision,
            self.optimizer_name + (" with stochastic rounding" if self.stochastic_rounding else ""),
            f"accumulate {self.accumulate_grad_batches}",
        ]
        if self.checkpointing:
            parts.append(f"{self.checkpointing.describe()}".replace("checkpointing", "gradient checkpointing"))
        if hp.get("offload_activations"):
            parts.append("activations offloaded")
        if hp.get("freeze") is not None:
            parts.append(f"freeze {hp['freeze']}")
        if self.fused:
            parts.append(f"fused backward+step ({self.bucket} buckets)")
        if self.measures:
            why = " and ".join(w for w, on in (("clipping by norm", self.clip_norm), ("loss scaling", self.scaled)) if on)
            parts.append(f"{why} (a measuring backward first)")
        if self.sharded:
            parts.append(f"sharded over {self.world_size} ranks")
        if self.loop.name != "lightning":
            parts.append(f"{self.loop.name} loop")
        return ", ".join(parts)

    @property
    def cache_key(self) -> tuple:
        """What a meta build depends on (model, optimizer, precision): no reference to anything live."""
        return (json.dumps(dict(self.model), sort_keys=True, default=str), self.optimizer.key, self.precision)

    @property
    def build_key(self) -> tuple:
        """`cache_key` without the checkpointing plan: what the module's parameters and optimizer depend on."""
        model = {k: v for k, v in self.model.items() if k != "gradient_checkpointing"}
        return (json.dumps(model, sort_keys=True, default=str), self.optimizer.key, self.precision)


def _with_recipe_allocator(target: Target, settings: Mapping[str, Any]) -> Target:
    """The recipe's ``memory.allocator`` for a CUDA target whose allocator settings nobody gave (as a run sets
    them: `lit_memory.memory.allocator.use_recipe_conf`)."""
    from lit_memory.memory.allocator import AllocatorConfig, check_recipe_conf

    conf = (settings.get("memory") or {}).get("allocator")
    if not conf or not target.cuda_device or target.allocator_given:
        return target
    return replace(target, allocator=AllocatorConfig.parse(check_recipe_conf(conf)), allocator_given=True)


def budget_of(settings: Mapping[str, Any]) -> Optional[int]:
    """The device budget a run plans for: ``memory.budget`` (enforced), else the recipe's ``memory.tier``
    (a size, or a card: `lit_memory.memory.device.capacity`)."""
    from lit_memory.memory.device import capacity

    memory = settings.get("memory") or {}
    value = memory.get("budget") or memory.get("tier")
    return capacity(value) if value else None


def budget_name(settings: Mapping[str, Any]) -> Optional[str]:
    """The budget in words, for the decisions' lines: ``memory.tier rtx3050-4gb (3.81 GiB)``."""
    from lit_memory.memory.device import capacity, is_gpu_name
    from lit_memory.memory.footprint import format_bytes

    memory = settings.get("memory") or {}
    key = "budget" if memory.get("budget") else "tier" if memory.get("tier") else None
    if key is None:
        return None
    value = memory[key]
    size = format_bytes(capacity(value))
    return f"memory.{key} {value} ({size})" if is_gpu_name(value) else f"memory.{key} {size}"


def margin_of(settings: Mapping[str, Any]) -> float:
    """``memory.margin`` (default `lit_memory.memory.margin.DEFAULT_MARGIN`), checked."""
    value = (settings.get("memory") or {}).get("margin")
    return DEFAULT_MARGIN if value is None else check_margin(value)


_MODEL_ARGS = {
    "model_name_or_path", "num_labels", "pretrained", "config_overrides", "tokenizer_name_or_path",
    "gradient_checkpointing", "offload_activations", "freeze", "embedding_optimizer_state", "lora",
    "lr_scheduler_type", "warmup_ratio", "save_pretrained", "compile",
}


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


# -- reading settings ------------------------------------------------------------------------------


_SCALARS = (str, int, float, bool, type(None))


def overlay(settings: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with dotted values laid over it (a value that is a dict replaces the whole key, as a
    recipe's block does: ``model.optimizer`` names the optimizer and all its arguments)."""
    out = _plain(settings)  # new containers all the way down: the caller's stay as they are
    for key, value in values.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    """Plain dicts, lists and scalars (jsonargparse namespaces and ruamel maps included), in new containers."""
    if isinstance(value, _SCALARS):  # most leaves: no typing-ABC checks (plan reads settings thousands of times)
        return value
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, (dict, abc.Mapping)):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def normalize_precision(precision: Any) -> str:
    from lightning.fabric.connector import _convert_precision_to_unified_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "bf16 is supported for historical reasons"
        try:
            unified = str(_convert_precision_to_unified_args(precision or "32-true"))
        except ValueError:
            unified = str(precision)
    if unified not in PRECISIONS:
        raise UserError(f"precision {precision!r} is not modelled; choose one of: {', '.join(PRECISIONS)}")
    return unified


def strategy_class(strategy: Any) -> Any:
    """The strategy a config names (a registry name, a class path, a class spec) or is: a class or an instance."""
    if isinstance(strategy, Mapping) or hasattr(strategy, "class_path"):  # a class spec, parsed or plain
        strategy = strategy.get("class_path", "")
    if isinstance(strategy, str):
        from lightning.pytorch.strategies import StrategyRegistry

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
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    found = strategy_class(strategy)
    sharding = (FSDPStrategy, ModelParallelStrategy)
    return isinstance(found, sharding) or (isinstance(found, type) and issubclass(found, sharding))


def ranks(devices: Any) -> int:
    """Devices per node as configured: a count, a list of indices, or "auto"/-1 (every device this machine
    has, which is not the machine a prediction is for: then 1; pass --trainer.devices N)."""
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
    lora, module.lora = module.lora, None
    if lora is None:
        with context, _tensor_init_context(step.precision):
            module.configure_model()
    else:
        # peft must not meet fake tensors: it cannot create adapters under FakeTensorMode (its .to() goes
        # through torch's tensor swap, which fake tensors refuse), and applied to a model of fake tensors
        # outside the mode it corrupted the C heap (see `adopt`). So the model and its adapters are made on
        # the meta device, and then made again in ``context``.
        with torch.device("meta"), _tensor_init_context(step.precision):
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
