"""Predict a training step's memory before running it, two ways, side by side.

* analytic: the seed's bytes per parameter (by precision and optimizer), the parameter shapes of
  the configured model (built on the ``meta`` device: nothing allocated, nothing downloaded), and
  a per-layer activation model of a BERT-style encoder layer (see `layer_bytes_per_token`);
* simulated: one real training step of the configured module (its optimizer, checkpointing,
  autocast) on fake tensors (``FakeTensorMode``), attributed by torch's ``MemTracker``. CUDA
  cannot be faked on the CPU build of torch, so the step runs CPU kernels.

Both follow a training step in order: ``training_step`` (no gradient alive, except the window's
in the middle of an accumulation window), backward, optimizer step (after which
`SequenceClassifier.optimizer_step` frees the gradients). Each gives the bytes per category at the peak of each phase; the peak is the
largest phase. ``python -m lit_memory estimate`` prints both; ``--json`` for machines.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from lit_memory.errors import UserError
from lit_memory.lora import apply_lora
from lit_memory.memory import CATEGORIES, Footprint, Tracker, format_bytes
from lit_memory.model import SequenceClassifier, transformer_layers

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
CUDA_NOTES = (
    "CUDA differs from the CPU simulation in: attention kernels (CUDA's memory-efficient/flash SDPA keeps "
    "no heads x length x length probabilities; CPU falls back to the math kernel when attention dropout is on), "
    "dropout masks (1 byte per value on CUDA, a full-width noise tensor on CPU), the caching allocator "
    "(rounds blocks to 512 B and reserves more than it allocates) and cuBLAS workspaces (a few MiB)."
)


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
    device: str = "cuda"  # the device type the analytic prediction is for
    module_class: type = SequenceClassifier

    @classmethod
    def from_run(cls, trainer, module) -> "Setup":
        """The setup of a running fit (raises AttributeError for modules/data without these settings)."""
        data = trainer.datamodule
        return cls(
            model=_init_args(type(module), module.hparams),
            optimizer=module.optimizer_factory,
            precision=normalize_precision(trainer.precision),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            batch_size=data.batch_size,
            max_length=data.max_length,
            fused=is_fused(trainer.strategy),
            bucket=getattr(trainer.strategy, "bucket", "layer"),
            device=trainer.strategy.root_device.type,
            module_class=type(module),
        )

    def module(self) -> SequenceClassifier:
        # Always from the config: weights are never loaded to predict memory.
        return self.module_class(**{**self.model, "pretrained": False}, optimizer=self.optimizer)

    @property
    def optimizer_name(self) -> str:
        func = getattr(self.optimizer, "args", ())
        cls = next((a for a in func if isinstance(a, type)), None) or self.optimizer
        return getattr(cls, "__name__", str(cls))

    def describe(self) -> str:
        hp = self.model
        parts = [
            f"batch {self.batch_size} x {self.max_length} tokens",
            self.precision,
            self.optimizer_name,
            f"accumulate {self.accumulate_grad_batches}",
        ]
        if hp.get("gradient_checkpointing"):
            parts.append("gradient checkpointing")
        if hp.get("freeze") is not None:
            parts.append(f"freeze {hp['freeze']}")
        if self.fused:
            parts.append(f"fused backward+step ({self.bucket} buckets)")
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


def _init_args(cls: type, hparams: Any) -> dict[str, Any]:
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


def is_fused(strategy: Any) -> bool:
    """True for strategies that step each parameter from its gradient hook (class attribute ``fused_step``)."""
    if isinstance(strategy, dict):
        strategy = strategy.get("class_path", "")
    if isinstance(strategy, str):
        from lightning.pytorch.strategies import StrategyRegistry

        if strategy in StrategyRegistry:
            strategy = StrategyRegistry[strategy]["strategy"]
        elif "." in strategy:
            import pkgutil

            strategy = pkgutil.resolve_name(strategy)
    return bool(getattr(strategy, "fused_step", False))


def file_gib(parameters: int, bytes_per_parameter: int) -> float:
    """The seed's model-file size: parameters x bytes per parameter / 1024^3 (GiB)."""
    return parameters * bytes_per_parameter / 1024**3


def seed_bytes(frozen: int, trainable: int, bytes_per_value: int = 4, optimizer_values: int = 2) -> dict[str, int]:
    """The seed's accounting for K frozen and N trainable parameters: weights K+N, gradients N, optimizer
    state 2N values (Adam's two moments). Full fine-tuning is K = 0: 4 values per parameter."""
    return {
        "weights": (frozen + trainable) * bytes_per_value,
        "gradients": trainable * bytes_per_value,
        "optimizer": optimizer_values * trainable * bytes_per_value,
    }


# -- building the configured module -------------------------------------------------------------


def build(setup: Setup, context: contextlib.AbstractContextManager) -> tuple[SequenceClassifier, torch.optim.Optimizer]:
    """The configured module and its optimizer, exactly as ``fit`` builds them, with tensors created
    under ``context`` (the ``meta`` device for the analytic model, fake tensors for the simulation)."""
    module = setup.module()
    # peft cannot create LoRA adapters under FakeTensorMode (its .to() goes through torch's tensor
    # swap, which fake tensors refuse): add them afterwards, as the few small real tensors they are.
    lora, module.lora = module.lora, None
    with context, _tensor_init_context(setup.precision):
        module.configure_model()
    if lora is not None:
        module.lora, module.model = lora, apply_lora(module.model, lora)
    # Outside the context: optimizers may build small lookup tensors from data (bitsandbytes' quantile maps).
    optimizer = module.build_optimizer()
    return module, optimizer


def _tensor_init_context(precision: str) -> contextlib.AbstractContextManager:
    """Lightning's "-true" precisions create the module's tensors in their dtype (its tensor_init_context)."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision

    if precision in ("bf16-true", "16-true"):
        return HalfPrecision(precision).tensor_init_context()
    if precision == "64-true":
        return DoublePrecision().tensor_init_context()
    return contextlib.nullcontext()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Shape:
    """What the activation model reads: one layer's sizes, the batch, the bytes of the precision."""

    h: int  # hidden size
    f: int  # FFN size
    heads: int
    batch: int
    length: int
    param_b: int  # bytes of weights, gradients, the residual stream and LayerNorm inputs
    compute_b: int  # bytes of linear/GELU outputs: 2 under autocast
    autocast: bool
    cuda: bool
    attention_dropout: bool
    hidden_dropout: bool
    eager: bool  # attention written out in Python (attn_implementation="eager") instead of SDPA
    token_types: bool

    @classmethod
    def of(cls, config, setup: Setup) -> "Shape":
        param, compute, autocast = PRECISIONS[setup.precision]
        h = config.hidden_size
        return cls(
            h=h,
            f=getattr(config, "intermediate_size", None) or 4 * h,
            heads=config.num_attention_heads,
            batch=setup.batch_size,
            length=setup.max_length,
            param_b=param.itemsize,
            compute_b=compute.itemsize,
            autocast=autocast,
            cuda=setup.device == "cuda",
            attention_dropout=bool(
                getattr(config, "attention_probs_dropout_prob", getattr(config, "attention_dropout", 0))
            ),
            hidden_dropout=bool(getattr(config, "hidden_dropout_prob", getattr(config, "dropout", 0))),
            eager=getattr(config, "_attn_implementation", "sdpa") == "eager",
            token_types=bool(getattr(config, "type_vocab_size", 0)),
        )

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    @property
    def mask_b(self) -> int:
        """Dropout keeps a 1-byte mask on CUDA, a noise tensor as wide as its input on CPU."""
        return 1 if self.cuda else self.compute_b

    def math_attention(self, training: bool = True) -> bool:
        """Whether attention keeps heads x length x length probabilities: the math kernel, which the
        CPU falls back to for attention dropout (training only), or eager attention."""
        return self.eager or (not self.cuda and training and self.attention_dropout)

    @property
    def attention_b(self) -> int:
        # The CPU's math kernel computes 16-bit inputs in fp32.
        return self.compute_b if self.cuda else max(self.param_b, 4)


def batch_bytes(shape: Shape) -> int:
    """input_ids, attention_mask (and token_type_ids) as int64, plus the labels."""
    inputs = 3 if shape.token_types else 2
    return 8 * shape.batch * (inputs * shape.length + 1)


# -- the analytic model -------------------------------------------------------------------------


def layer_bytes_per_token(x: Shape, lora: Optional[tuple[int, int]] = None) -> int:
    """Bytes one BERT-style encoder layer keeps for backward, per token (the stated per-layer model).

    With h = hidden size, f = FFN size, a = heads, s = sequence length, c = compute bytes
    (2 under autocast), p = parameter bytes (the residual stream and LayerNorm inputs), m = dropout
    mask bytes (1 on CUDA; the CPU keeps a noise tensor of width c):

    * linear inputs: Q/K/V share the layer input (autocast saves one 16-bit copy per projection),
      plus the attention output and the FFN input: ``(h * (3 if autocast else 1) + 2h + f) * c``;
    * attention: memory-efficient/flash kernels (CUDA; CPU without attention dropout) keep q, k, v
      and the output, ``4h * c + 4a``; the math kernel (CPU with attention dropout, or eager) keeps
      q, k, v, probabilities, dropout noise and dropped probabilities, ``(3h + 3as) * 4`` on CPU
      (where it computes in fp32);
    * GELU input ``f * c``; two hidden dropouts ``2h * m``; two LayerNorm inputs ``2h * p`` + stats.

    With LoRA (``lora = (adapters per layer, rank)``) the frozen projections keep no input for a
    weight gradient: each adapter keeps instead its dropped-out input, its dropout noise and its
    rank-wide activation, ``adapters * (h * (c + m) + r * c)``.
    """
    h, f, a, s, c = x.h, x.f, x.heads, x.length, x.compute_b
    if lora is None:
        linear_inputs = (h * (3 if x.autocast else 1) + 2 * h + f) * c
    else:
        adapters, rank = lora
        linear_inputs = adapters * (h * (c + x.mask_b) + rank * c)
    if x.math_attention():
        noise = a * s * (1 if x.cuda else x.attention_b) if x.attention_dropout else 0
        attention = (3 * h + 2 * a * s) * x.attention_b + noise
    else:
        attention = 4 * h * c + 4 * a
    dropout = 2 * h * x.mask_b if x.hidden_dropout else 0
    return linear_inputs + attention + f * c + dropout + 2 * h * x.param_b + 16


def working_set_per_token(x: Shape, training: bool = True) -> int:
    """Bytes per token a layer holds at once when it saves nothing (a checkpointed forward, inference):
    the attention block (q, k, v and the probabilities, or the fused kernel's output) or the FFN (its
    input, the intermediate and its activation), whichever is larger."""
    h, a, s = x.h, x.heads, x.length
    if x.math_attention(training):
        attention = (3 * h + (3 if training else 2) * a * s) * x.attention_b
    else:
        attention = 4 * h * x.compute_b
    return max(attention, (2 * x.f + h) * x.compute_b)


def backward_temp_per_token(x: Shape) -> int:
    """Gradients w.r.t. activations in flight early in backward: the FFN intermediate's and two
    hidden-size ones, while the layer's saved tensors are not yet released."""
    return (x.f + 2 * x.h) * x.compute_b


def _linear_bytes(modules, compute_b: int) -> int:
    """The 16-bit copies autocast makes of linear weights and biases. Lightning runs autocast without
    its cache, so a copy lives only while backward needs it (it is saved with the layer's input)."""
    total = 0
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                total += sum(p.numel() for p in sub.parameters(recurse=False))
    return total * compute_b


@dataclass
class _Activations:
    forward: int  # live at the end of the forward pass
    backward: int  # live at the start of backward (checkpointing: plus one recomputed layer)
    transient: int  # forward temporaries on top of `forward` (inside the last layer)
    backward_temp: int  # gradients w.r.t. activations in flight early in backward


def _activations(model: nn.Module, x: Shape, checkpointing: bool) -> _Activations:
    layers = list(transformer_layers(model))
    embeddings = getattr(model.base_model, "embeddings", None) or model.get_input_embeddings()

    def trains(module: nn.Module) -> bool:
        return any(p.requires_grad for p in module.parameters())

    # Backward starts at the first trained module (model.enable_gradient_checkpointing removes
    # transformers' hook that would make the frozen embeddings' output require grad).
    emb_trains = trains(embeddings)
    first = 0 if emb_trains else next((i for i, layer in enumerate(layers) if trains(layer)), len(layers))
    active = layers[first:]
    pooler = getattr(model.base_model, "pooler", None)
    head = [m for name, m in model.named_children() if name != model.base_model_prefix] + ([pooler] if pooler else [])

    layer_input = x.tokens * x.h * x.param_b
    saved = 0
    if emb_trains:  # LayerNorm input, its stats, dropout noise
        saved += x.tokens * (x.h * x.param_b + 8 + (x.h * (1 if x.cuda else x.param_b) if x.hidden_dropout else 0))
    if active or (pooler is not None and trains(pooler)):
        # the pooler keeps the last hidden state (without autocast its first-token view pins all of it)
        saved += 3 * x.batch * x.h * x.compute_b + (x.batch * x.h * x.compute_b if x.autocast else layer_input)
    if not active:  # frozen layers keep nothing for backward, but their forward still has a working set
        return _Activations(forward=saved, backward=saved, transient=working_set_per_token(x) * x.tokens, backward_temp=0)
    per_layer = layer_bytes_per_token(x, _lora_adapters(active[0])) * x.tokens
    backward_temp = backward_temp_per_token(x) * x.tokens
    if checkpointing:
        # Each layer keeps only its input; backward recomputes one layer at a time (with its 16-bit weights).
        kept = saved + len(active) * layer_input
        one_layer_copies = _linear_bytes(active[:1], x.compute_b) if x.autocast else 0
        return _Activations(
            forward=kept,
            backward=kept + per_layer + one_layer_copies,
            transient=working_set_per_token(x) * x.tokens,
            backward_temp=backward_temp,
        )
    forward = saved + len(active) * per_layer + (_linear_bytes(active + head, x.compute_b) if x.autocast else 0)
    return _Activations(
        forward=forward, backward=forward, transient=2 * x.h * x.compute_b * x.tokens, backward_temp=backward_temp
    )


def _lora_adapters(layer: nn.Module) -> Optional[tuple[int, int]]:
    """(adapters, rank) of peft's LoRA adapters in a layer (``lora_A`` holds each adapter's down
    projection), or None."""
    downs = [m for name, m in layer.named_modules() if name.endswith("lora_A.default")]
    return (len(downs), downs[0].out_features) if downs else None


def _inference(x: Shape, weights: int) -> int:
    """Weights + batch + one layer's working set without autograd (eval: no dropout)."""
    live = x.tokens * (x.h * x.param_b + working_set_per_token(x, training=False))
    return weights + batch_bytes(x) + live


def optimizer_bytes(
    optimizer: torch.optim.Optimizer, device: str, stepped: Optional[list[list[torch.Tensor]]] = None
) -> tuple[int, int, list[str]]:
    """(steady-state optimizer state, extra bytes the step allocates, notes) from the optimizer's class,
    its parameter groups and the parameter shapes. ``stepped``: the parameters one step updates, as
    the lists a foreach call covers at once (a fused step's bucket, split by group); by default all
    of them, by group."""
    cls = type(optimizer)
    module, name = cls.__module__, cls.__name__
    notes: list[str] = []
    groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    params = [p for g in groups for p in g]
    if not params:
        return 0, 0, notes
    stepped = stepped or groups
    largest = max(_nbytes(p) for g in stepped for p in g)
    if module.startswith("bitsandbytes"):
        return _bitsandbytes_bytes(optimizer, groups), 0, notes
    if name == "Adafactor":
        state = 0
        for group, g in zip(optimizer.param_groups, groups, strict=True):
            for p in g:
                factored = p.ndim >= 2
                values = p.numel() // p.shape[-1] + p.numel() // p.shape[-2] if factored else p.numel()
                values += p.numel() if group.get("beta1") is not None else 0
                state += 4 * values + 4  # fp32 statistics (+ the RMS scalar)
        # update = grad**2 + eps, its factored approximation and -update: two fp32 copies of the largest
        # parameter at a time, two more when the parameter and gradient are cast up from 16 bits.
        largest_numel = max(p.numel() for g in stepped for p in g)
        low = any(p.dtype != torch.float32 for g in stepped for p in g)
        return state, 4 * largest_numel * (2 + 2 * low), notes
    foreach = _foreach(optimizer, device)
    # foreach ops allocate one tensor per parameter of a group (of a bucket, fused) at once
    unit = max(sum(_nbytes(p) for p in g) for g in stepped) if foreach else largest
    defaults = optimizer.defaults
    if name == "SGD":
        momentum = defaults.get("momentum", 0) != 0
        state = sum(_nbytes(p) for p in params) if momentum else 0
        temps = (defaults.get("weight_decay", 0) != 0) + (defaults.get("nesterov", False))
        return state, unit * temps, notes
    if "betas" not in defaults:
        notes.append(
            f"{name}: optimizer state assumed Adam-like (two values per parameter); the simulation measures it"
        )
    moments = 2 + bool(defaults.get("amsgrad", False))
    steps = 4 * len(params) if device == "cpu" else 0  # Adam's step counters stay on the CPU unless capturable
    state = moments * sum(_nbytes(p) for p in params) + steps
    if defaults.get("fused"):
        return state, 0, notes
    # denom = exp_avg_sq.sqrt() / bias_correction: two temporaries per parameter (one per group for foreach)
    temps = 1 if foreach else 2
    if defaults.get("weight_decay", 0) and not defaults.get("decoupled_weight_decay", name == "AdamW"):
        temps += 1  # Adam's L2 penalty: grad + wd * param
    return state, unit * temps, notes


def _foreach(optimizer: torch.optim.Optimizer, device: str) -> bool:
    """torch's default: foreach kernels on CUDA, a loop over parameters on CPU."""
    foreach = optimizer.defaults.get("foreach")
    if foreach is None:
        return (
            device == "cuda"
            and not optimizer.defaults.get("fused")
            and type(optimizer).__module__.startswith("torch.optim")
        )
    return bool(foreach)


def _bitsandbytes_bytes(optimizer, groups) -> int:
    """8-bit states: 1 byte per value plus a fp32 absmax per 256-value block; 32-bit where bitsandbytes
    keeps them so (``optim_bits=32`` overrides such as embeddings, parameters below ``min_8bit_size``)."""
    from bitsandbytes.optim.optimizer import GlobalOptimManager, Optimizer2State

    manager = GlobalOptimManager.get_instance()
    # Overrides registered per module are matched to parameters at the first step (check_overrides);
    # read them without calling it, which would record these parameters' ids in the global manager.
    overrides = {id(getattr(m, attr)): config for m, attr, config in manager.module_weight_config_triple}
    states = 2 if isinstance(optimizer, Optimizer2State) else 1
    total = 0
    for gindex, group in enumerate(optimizer.param_groups):
        for pindex, p in enumerate(group["params"]):
            if not p.requires_grad:
                continue
            config = {**optimizer.get_config(gindex, pindex, group), **overrides.get(id(p), {})}
            if config["optim_bits"] == 32 or p.numel() < config["min_8bit_size"]:
                total += states * 4 * p.numel()
            else:
                total += states * (p.numel() + 4 * math.ceil(p.numel() / 256))
    return total


def _total(categories: dict[str, int]) -> int:
    return sum(categories.values())


# Meta-device builds by (hyper-parameters, optimizer factory, precision): `plan` predicts hundreds of
# setups that share a handful of models. The factory is kept in the value so its id stays unique.
_META_BUILDS: dict[tuple, tuple] = {}


def _meta_build(setup: Setup) -> tuple[SequenceClassifier, torch.optim.Optimizer]:
    key = (
        setup.module_class,
        json.dumps(setup.model, sort_keys=True, default=str),
        id(setup.optimizer),
        setup.precision,
    )
    if key not in _META_BUILDS:
        _META_BUILDS[key] = (*build(setup, torch.device("meta")), setup.optimizer)
    return _META_BUILDS[key][:2]


def analytic(setup: Setup) -> Prediction:
    start = time.perf_counter()
    module, optimizer = _meta_build(setup)
    model = module.model
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weights = sum(_nbytes(p) for p in params) + sum(_nbytes(b) for b in model.buffers())
    grads = sum(_nbytes(p) for p in trainable)
    largest_grad = max((_nbytes(p) for p in trainable), default=0)
    state, step_temp, notes = optimizer_bytes(optimizer, setup.device)
    shape = Shape.of(model.config, setup)
    act = _activations(model, shape, bool(setup.model.get("gradient_checkpointing")))
    batch = batch_bytes(shape)

    def phase(gradients=0, optimizer=state, activations=0, other=batch) -> dict[str, int]:
        return {
            "weights": weights,
            "gradients": gradients,
            "optimizer": optimizer,
            "activations": activations,
            "other": other,
        }

    footprint = Footprint()
    accumulating = setup.accumulate_grad_batches > 1
    if setup.fused:
        # Each bucket's gradients are applied by one optimizer step and freed as soon as the last of
        # them is accumulated: early in backward the activations dominate, later the bucket whose
        # gradients and step temporaries are largest is stepped.
        footprint.add("forward", phase(activations=act.forward + act.transient))
        early = phase(activations=act.backward, other=batch + act.backward_temp)
        late = max(
            (
                phase(gradients=sum(_nbytes(p) for p in b), optimizer=state + optimizer_bytes(optimizer, setup.device, by_group)[1])
                for b, by_group in _buckets(module, optimizer, setup.bucket)
            ),
            key=_total,
            default=phase(),
        )
        footprint.add("backward", max(early, late, key=_total))
        footprint.add("step", phase())  # Lightning's step after backward finds every gradient gone
    else:
        # SequenceClassifier.optimizer_step frees the gradients after the step; mid-window micro-batches
        # of an accumulation run their forward with the window's gradients alive.
        alive = grads if accumulating else 0
        footprint.add("forward", phase(gradients=alive, activations=act.forward + act.transient))
        if accumulating:  # mid-window: gradients accumulate into the existing ones, through a temporary
            early = phase(gradients=grads, activations=act.backward, other=batch + act.backward_temp)
            late = phase(gradients=grads, other=batch + largest_grad)
        else:
            early = phase(activations=act.backward, other=batch + act.backward_temp)
            late = phase(gradients=grads)
        footprint.add("backward", max(early, late, key=_total))
        footprint.add("step", phase(gradients=grads, optimizer=state + step_temp))
    return Prediction(
        method="analytic",
        device=setup.device,
        footprint=footprint,
        inference=_inference(shape, weights),
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in trainable),
        seconds=time.perf_counter() - start,
        notes=notes,
    )


# -- the simulation -----------------------------------------------------------------------------


def _buckets(
    module: SequenceClassifier, optimizer: torch.optim.Optimizer, bucket: str
) -> list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]:
    """The fused step's buckets of the trainable parameters (`lit_memory.fused.group_parameters`), each
    with its parameters split by group, as its optimizer steps them (one foreach call per group)."""
    from lit_memory.fused import group_parameters

    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"] if p.requires_grad}
    buckets = group_parameters([p for p in module.parameters() if id(p) in group_of], module, bucket)
    return [(b, [[p for p in b if group_of[id(p)] == g] for g in sorted({group_of[id(p)] for p in b})]) for b in buckets]


def _fake_batch(setup: Setup, config) -> dict[str, torch.Tensor]:
    # The worst case a run can see: every micro-batch full and padded to max_length.
    shape = (setup.batch_size, setup.max_length)
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, shape),
        "attention_mask": torch.ones(shape, dtype=torch.long),
        "labels": torch.zeros(setup.batch_size, dtype=torch.long),
    }
    if getattr(config, "type_vocab_size", 0):
        batch["token_type_ids"] = torch.zeros(shape, dtype=torch.long)
    return batch


def _use_device_defaults(optimizer: torch.optim.Optimizer, device: str) -> None:
    """Run the optimizer implementation torch picks on ``device``: on CUDA, foreach kernels (their
    temporaries are a whole parameter group at once) where the config leaves ``foreach`` unset."""
    if device == "cuda" and _foreach(optimizer, device):
        for group in optimizer.param_groups:
            if group.get("foreach", False) is None:
                group["foreach"] = True


@dataclass
class _Stepping:
    """How the simulated step updates the parameters."""

    optimizers: list  # whose state exists before the tracked step (tracked from its start)
    warm: Callable[[], None]  # one step on zero gradients, leaving behind what a previous step leaves
    after_backward: Callable[[], None]  # what runs after loss.backward()


def _stepping(module: SequenceClassifier, optimizer: torch.optim.Optimizer, setup: Setup) -> _Stepping:
    """Lightning's step: ``optimizer.step()`` after backward, then `SequenceClassifier.optimizer_step`
    frees the gradients. With the fused step the strategy's own core steps and frees each gradient
    inside backward instead.
    """
    trainable = [p for p in module.model.parameters() if p.requires_grad]

    def warm() -> None:
        for p in trainable:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # creates the state; fused copies share the original optimizer's state
        if setup.accumulate_grad_batches == 1:  # else: a mid-window micro-batch keeps the window's gradients
            optimizer.zero_grad()  # a step leaves no gradient behind (see above)

    if setup.fused:
        from lit_memory.fused import OptimizerInBackward

        OptimizerInBackward(optimizer, module, setup.bucket)  # hooks on the (throwaway, fake) model's parameters
        return _Stepping(optimizers=[optimizer], warm=warm, after_backward=lambda: None)
    return _Stepping(optimizers=[optimizer], warm=warm, after_backward=optimizer.step)


def simulate(setup: Setup) -> Prediction:
    """One training step of the configured module on fake tensors, tracked per phase on ``cpu``."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    autocast = PRECISIONS[setup.precision][2]
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the optimizer's own small real tensors
    module, optimizer = build(setup, fake)
    with fake, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log() without a trainer; MemTracker's hook notices
        _use_device_defaults(optimizer, setup.device)
        stepping = _stepping(module, optimizer, setup)
        stepping.warm()  # the steady state: the optimizer state exists
        batch = _fake_batch(setup, module.model.config)
        # Lightning's own autocast context (it disables autocast's weight cache); one per use.
        plugin = MixedPrecision(setup.precision, "cpu") if autocast else None

        def forward_context() -> contextlib.AbstractContextManager:
            return plugin.forward_context() if plugin else contextlib.nullcontext()

        tracker = Tracker("cpu")
        tracker.track_external(module, *stepping.optimizers, batch)
        with tracker:
            tracker.enter_phase("forward")
            with forward_context():
                loss = module.training_step(batch, 0)
            tracker.enter_phase("backward")
            loss.backward()
            tracker.enter_phase("step")
            stepping.after_backward()
        del loss

        optimizer.zero_grad()
        module.model.eval()
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        inference = Tracker("cpu")
        inference.track_external(module.model, inputs)
        with inference, torch.no_grad(), forward_context():
            inference.enter_phase("forward")
            module.model(**inputs)
    return Prediction(
        method="simulated",
        device="cpu",
        footprint=tracker.footprint,
        inference=inference.footprint.peak,
        parameters=sum(p.numel() for p in module.model.parameters()),
        trainable=sum(p.numel() for p in module.model.parameters() if p.requires_grad),
        seconds=time.perf_counter() - start,
    )


# -- the subcommand -----------------------------------------------------------------------------


def configured(args: list[str]):
    """The CLI as ``fit`` would set it up for these configs and overrides: resolved config, the
    module (its model not yet built) and the data module; no Trainer, no weights, no data read."""
    from lit_memory.cli import LitMemoryCLI

    class ConfigOnly(LitMemoryCLI):
        # Resolve exactly as `fit` does, but build no Trainer: it may name a GPU this machine lacks.
        def instantiate_trainer(self, **kwargs):
            return None

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # args come from our argv
        return ConfigOnly(args=args, run=False)


def resolve(args: list[str], device: str = "cuda") -> Setup:
    """The setup ``fit`` would train with these configs and overrides (nothing is built or loaded)."""
    cli = configured(args)
    trainer = cli.config.trainer
    return Setup(
        model=_init_args(SequenceClassifier, cli.model.hparams),
        optimizer=cli.model.optimizer_factory,
        precision=normalize_precision(trainer.precision),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        batch_size=cli.datamodule.batch_size,
        max_length=cli.datamodule.max_length,
        fused=is_fused(cli.config_init.trainer.strategy),
        bucket=getattr(cli.config_init.trainer.strategy, "bucket", "layer"),
        device=device,
    )


def report(setup: Setup, analytic_: Prediction, simulated: Optional[Prediction]) -> dict:
    """The --json object (memory.json uses the same keys for its predictions)."""
    both = {"analytic": analytic_, "simulated": simulated}
    params = analytic_.parameters
    notes = list(analytic_.notes)
    if simulated is not None:
        notes.append(f"simulated on CPU with fake tensors (nothing allocated) in {simulated.seconds:.1f} s")
        if setup.device == "cuda":
            notes.append(CUDA_NOTES)
    return {
        "model": {
            "name": setup.model.get("model_name_or_path"),
            "parameters": params,
            "trainable": analytic_.trainable,
            "file_bytes": {"fp32": 4 * params, "fp16": 2 * params, "int8": params},
        },
        "setup": {
            "batch_size": setup.batch_size,
            "max_length": setup.max_length,
            "precision": setup.precision,
            "optimizer": setup.optimizer_name,
            "accumulate_grad_batches": setup.accumulate_grad_batches,
            "gradient_checkpointing": bool(setup.model.get("gradient_checkpointing")),
            "freeze": setup.model.get("freeze"),
            "fused": setup.fused,
        },
        "device": {"analytic": setup.device, "simulated": "cpu"},
        "peak_bytes": {k: (p.footprint.peak if p else None) for k, p in both.items()},
        "peak_phase": {k: (p.footprint.peak_phase if p else None) for k, p in both.items()},
        "categories": {k: (p.footprint.categories if p else None) for k, p in both.items()},
        "phases": {k: (p.footprint.to_dict()["phases"] if p else None) for k, p in both.items()},
        "inference_bytes": {k: (p.inference if p else None) for k, p in both.items()},
        "notes": notes,
    }


LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "other": "other/temporary",
}


def format_report(data: dict) -> str:
    model = data["model"]
    cols = [k for k in ("analytic", "simulated") if data["peak_bytes"][k] is not None]
    heads = {"analytic": f"analytic ({data['device']['analytic']})", "simulated": "simulated (cpu)"}
    setup = data["setup"]
    lines = [
        f"{model['name']}: {model['parameters'] / 1e6:.1f} M parameters ({model['trainable'] / 1e6:.1f} M trainable); "
        f"batch {setup['batch_size']} x {setup['max_length']} tokens, {setup['precision']}, {setup['optimizer']}, "
        f"accumulate {setup['accumulate_grad_batches']}, "
        f"checkpointing {'on' if setup['gradient_checkpointing'] else 'off'}, "
        f"freeze {setup['freeze']}, fused step {'on' if setup['fused'] else 'off'}",
        "",
        f"{'training step, at the peak':<28}" + "".join(f"{heads[c]:>20}" for c in cols),
    ]
    for category in CATEGORIES:
        lines.append(
            f"  {LABELS[category]:<26}" + "".join(f"{format_bytes(data['categories'][c][category]):>20}" for c in cols)
        )
    lines.append(f"  {'peak total':<26}" + "".join(f"{format_bytes(data['peak_bytes'][c]):>20}" for c in cols))
    lines.append(f"  {'peak phase':<26}" + "".join(f"{data['peak_phase'][c]:>20}" for c in cols))
    lines.append(
        f"{'inference (no autograd)':<28}" + "".join(f"{format_bytes(data['inference_bytes'][c]):>20}" for c in cols)
    )
    sizes = ", ".join(
        f"{name} {file_gib(model['parameters'], n):.2f} GiB" for name, n in (("fp32", 4), ("fp16", 2), ("int8", 1))
    )
    lines.append(f"model file (parameters x bytes / 1024^3): {sizes}")
    lines += [f"note: {n}" for n in data["notes"]]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lit_memory estimate",
        description="Predict a training step's memory per category (analytic and simulated). "
        "Every other argument is a fit argument: --config FILE (repeatable), dotted overrides.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-simulate", action="store_true", help="analytic only (milliseconds instead of seconds)")
    parser.add_argument(
        "--device", choices=DEVICES, default="cuda", help="device the analytic model predicts for (default: cuda)"
    )
    ours, rest = parser.parse_known_args(argv)
    setup = resolve(rest, ours.device)
    predicted = analytic(setup)
    simulated = None if ours.no_simulate else simulate(setup)
    data = report(setup, predicted, simulated)
    print(json.dumps(data, indent=2) if ours.json else format_report(data))
