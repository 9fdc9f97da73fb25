"""The analytic model of a training step's memory: bytes per parameter, an activation model.

The reference post's accounting (bytes per parameter by precision and optimizer) over the parameter
shapes of the configured model, built on the ``meta`` device (nothing allocated, nothing downloaded),
plus a per-layer activation model of a BERT-style encoder layer (`layer_bytes_per_token`). It follows
a training step in order: ``training_step`` (no gradient alive, except the window's in the middle of
an accumulation window), backward, optimizer step (after which `SequenceClassifier.optimizer_step`
frees the gradients), and gives the bytes per category at the peak of each phase. Milliseconds per
setup: `lit_memory.tools.plan` predicts hundreds.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lit_memory.anatomy import parameter_units
from lit_memory.fused import group_parameters
from lit_memory.memory.footprint import Footprint
from lit_memory.memory.setup import PRECISIONS, Prediction, Setup, build
from lit_memory.model import SequenceClassifier, transformer_layers

def file_gib(parameters: int, bytes_per_parameter: int) -> float:
    """The reference post's model-file size: parameters x bytes per parameter / 1024^3 (GiB)."""
    return parameters * bytes_per_parameter / 1024**3


def reference_bytes(frozen: int, trainable: int, bytes_per_value: int = 4, optimizer_values: int = 2) -> dict[str, int]:
    """The reference post's accounting for K frozen and N trainable parameters: weights K+N, gradients N, optimizer
    state 2N values (Adam's two moments). Full fine-tuning is K = 0: 4 values per parameter."""
    return {
        "weights": (frozen + trainable) * bytes_per_value,
        "gradients": trainable * bytes_per_value,
        "optimizer": optimizer_values * trainable * bytes_per_value,
    }


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


def selective_bytes_per_token(x: Shape, lora: Optional[tuple[int, int]] = None) -> int:
    """Bytes selective checkpointing keeps per layer per token besides the layer's input
    (`lit_memory.activations.selective_policy`): the outputs of the six linear layers (Q, K, V,
    attention output, FFN in and out), ``(5h + f) * c``, and, where a fused attention kernel runs
    without dropout, its output and log-sum-exp, ``h * c + 4a``. An attention kernel with dropout is
    recomputed (it draws random numbers), as is the math attention path. With LoRA each adapter
    also keeps its two matmul outputs, ``adapters * (r + h) * c``."""
    h, f, c = x.h, x.f, x.compute_b
    saved = (5 * h + f) * c
    if not x.math_attention() and not x.attention_dropout:
        saved += h * c + 4 * x.heads
    if lora is not None:
        adapters, rank = lora
        saved += adapters * (rank + h) * c
    return saved


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


def _activations(model: nn.Module, x: Shape, checkpointing: Optional[str], offload: bool = False) -> _Activations:
    """Activation bytes of a training step. ``checkpointing``: None, ``"full"`` or ``"selective"``;
    ``offload``: what autograd saves (with checkpointing, each layer's input and the tensors outside
    the layers) lives in host memory, and one layer's input is brought back at a time in backward."""
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
    lora = _lora_adapters(active[0])
    per_layer = layer_bytes_per_token(x, lora) * x.tokens
    backward_temp = backward_temp_per_token(x) * x.tokens
    if checkpointing:
        # Each layer keeps its input (selective: also its matmul outputs); backward recomputes one layer
        # at a time (with its 16-bit weights), whose full set of saved tensors then exists.
        cached = selective_bytes_per_token(x, lora) * x.tokens if checkpointing == "selective" else 0
        if offload:  # the layer inputs and the tensors outside the layers wait in host memory
            kept, back = len(active) * cached, layer_input
        else:
            kept, back = saved + len(active) * (layer_input + cached), 0
        one_layer_copies = _linear_bytes(active[:1], x.compute_b) if x.autocast else 0
        return _Activations(
            forward=kept,
            backward=kept + back + per_layer - cached + one_layer_copies,
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
    if module.startswith("torchao.optim"):
        state, temps = _torchao_bytes(optimizer, groups, stepped, device)
        if device == "cuda" and temps:
            notes.append(
                f"{name}: its compiled step's buffers are inductor's CPU kernels' ({temps / 2**20:.0f} MiB for the "
                "largest parameter); CUDA kernels may hold less (to be measured on a GPU)"
            )
        return state, temps, notes
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
    foreach = foreach_default(optimizer, device)
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


def foreach_default(optimizer: torch.optim.Optimizer, device: str) -> bool:
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


# torchao: the state its `_AdamBase._new_buffer` creates, the buffers its compiled update kernel allocates.
TORCHAO_MIN_QUANTIZED = 4096  # smaller tensors keep plain state, as bitsandbytes' min_8bit_size
TORCHAO_QMAP_VALUES = {"8bit": 256, "4bit": 16, "Fp8": 0}  # a fp32 lookup table per quantised state tensor
TORCHAO_CODE_BYTES = {"8bit": 1.0, "4bit": 0.5, "Fp8": 1.0}  # per value


def torchao_state_kind(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """``8bit``, ``4bit`` or ``Fp8`` (the suffix of torchao's class names and of its state subclasses,
    ``OptimState8bit`` ...), or None for its plain-state AdamW (``_AdamW``)."""
    name = type(optimizer).__name__
    return next((kind for kind in TORCHAO_CODE_BYTES if name.endswith(kind)), None)


def torchao_quantized(kind: Optional[str], numel: int, block: float) -> bool:
    return kind is not None and numel >= TORCHAO_MIN_QUANTIZED and numel % block == 0


def torchao_kernel_bytes(kind: Optional[str], numel: int, block: float) -> int:
    """Buffers torchao's compiled update kernel holds for one parameter with ``kind`` state, as inductor's
    CPU code allocates them (torch 2.13, read with ``TORCH_LOGS=output_code``): 8-bit keeps each moment in
    fp32 between the block scales' reduction and the quantisation (4 B per value each), 4-bit also unpacks
    its codes (1 B) and keeps int64 indices (8 B), FP8 recomputes and keeps only the new scales; plain state
    is updated in place. CUDA's Triton kernels may fuse more: an upper bound there, to be measured on a GPU."""
    if not torchao_quantized(kind, numel, block):
        return 0
    scales = 4 * math.ceil(numel / block)
    per_moment = {"8bit": 4 * numel, "4bit": (1 + 4 + 8) * numel, "Fp8": 0}[kind] + scales
    return 2 * per_moment


def _torchao_bytes(optimizer, groups, stepped, device: str) -> tuple[int, int]:
    """torchao's state (`lit_memory.lowbit`): per parameter two moments (three with amsgrad), quantised
    (codes, a fp32 scale per block, a fp32 lookup table) where `torchao_quantized`, else in the
    parameter's dtype; a fp32 step counter, on the CPU (off the device on CUDA). Its step updates one
    parameter at a time: the largest parameter's `torchao_kernel_bytes`."""
    kind, block = torchao_state_kind(optimizer), optimizer.block_size
    state = 0
    for group, params in zip(optimizer.param_groups, groups, strict=True):
        moments = 3 if group.get("amsgrad") else 2
        for p in params:
            n = p.numel()
            if torchao_quantized(kind, n, block):
                state += moments * (math.ceil(TORCHAO_CODE_BYTES[kind] * n) + 4 * n // block + 4 * TORCHAO_QMAP_VALUES[kind])
            else:
                state += moments * _nbytes(p)
            state += 4 if device == "cpu" else 0
    temps = max(torchao_kernel_bytes(kind, p.numel(), block) for g in stepped for p in g)
    return state, temps


def _total(categories: dict[str, int]) -> int:
    return sum(categories.values())


# The last meta-device builds: `plan` predicts hundreds of setups that share a handful of models.
_META_BUILDS: OrderedDict[tuple, tuple[SequenceClassifier, torch.optim.Optimizer]] = OrderedDict()
META_BUILDS_KEPT = 16


@dataclass(frozen=True)
class Sharding:
    """One rank's share under FSDP2 as lit_memory applies it (`fully_shard` on each transformer layer,
    then on the model): 1/N of the weights, gradients and optimizer state, plus what FSDP2 gathers.

    The root unit (embeddings, pooler, head) stays gathered from its forward to the end of backward
    (FSDP2 does not reshard the root after forward); a layer is gathered while it computes, and the
    next one is prefetched meanwhile: two layers at once. A unit's gradients exist unsharded until its
    reduce-scatter: the largest unit's at most.
    """

    ranks: int
    gathered: int  # unsharded parameters alive at once
    reducing: int  # unsharded gradients of the largest unit

    @classmethod
    def of(cls, model: nn.Module, setup: Setup) -> Optional["Sharding"]:
        if not setup.sharded or setup.world_size < 2:
            return None
        layers = transformer_layers(model)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_layers]
        layer_bytes = [sum(_nbytes(p) for p in layer.parameters()) for layer in layers]
        layer_grads = [sum(_nbytes(p) for p in layer.parameters() if p.requires_grad) for layer in layers]
        root_grads = sum(_nbytes(p) for p in root if p.requires_grad)
        return cls(
            ranks=setup.world_size,
            gathered=sum(_nbytes(p) for p in root) + 2 * max(layer_bytes, default=0),
            reducing=max([root_grads, *layer_grads]),
        )

    def per_rank(self, categories: dict[str, int], unsharded: int) -> dict[str, int]:
        n = self.ranks
        return {
            **categories,
            "weights": math.ceil(categories["weights"] / n) + self.gathered,
            "gradients": math.ceil(categories["gradients"] / n) + unsharded,
            "optimizer": math.ceil(categories["optimizer"] / n),
        }

    def describe(self) -> str:
        return (
            f"per rank of {self.ranks} (FSDP2): 1/{self.ranks} of weights, gradients and optimizer state, plus "
            f"{self.gathered / 2**20:.0f} MiB of gathered weights (the root unit and two layers) and up to "
            f"{self.reducing / 2**20:.0f} MiB of a unit's gradients before they are reduced"
        )


def _buckets(
    module: SequenceClassifier, optimizer: torch.optim.Optimizer, bucket: str
) -> list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]:
    """The fused step's buckets of the trainable parameters (`lit_memory.fused.group_parameters`), each
    with its parameters split by group, as its optimizer steps them (one foreach call per group)."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"] if p.requires_grad}
    buckets = group_parameters([p for p in module.parameters() if id(p) in group_of], parameter_units(module), bucket)
    return [(b, [[p for p in b if group_of[id(p)] == g] for g in sorted({group_of[id(p)] for p in b})]) for b in buckets]


def _meta_build(setup: Setup) -> tuple[SequenceClassifier, torch.optim.Optimizer]:
    key = (setup.module_class, json.dumps(setup.model, sort_keys=True, default=str), _factory_key(setup.optimizer), setup.precision)
    if key in _META_BUILDS:
        _META_BUILDS.move_to_end(key)
    else:
        module, optimizer = build(setup, torch.device("meta"))
        # The factory is not needed once the optimizer exists; kept, it would keep what it references alive
        # with the build (a CLI's factory: the CLI, its trainer and its trained model).
        module.optimizer_factory = None
        _META_BUILDS[key] = module, optimizer
        if len(_META_BUILDS) > META_BUILDS_KEPT:
            _META_BUILDS.popitem(last=False)
    return _META_BUILDS[key]


def _factory_key(factory: Any) -> Any:
    """What an optimizer factory builds, as a cache key that holds no reference to it: a partial (a
    parsed config's factory is jsonargparse's, whose arguments reference its parser and CLI) by its
    function, class arguments and keywords; anything else (a class, a function) by identity."""
    if isinstance(factory, functools.partial):
        classes = tuple(f"{a.__module__}.{a.__qualname__}" for a in factory.args if isinstance(a, type))
        function = f"{getattr(factory.func, '__module__', '')}.{getattr(factory.func, '__qualname__', factory.func)}"
        return function, classes, json.dumps(factory.keywords, sort_keys=True, default=str)
    return factory


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
    act = _activations(model, shape, setup.checkpointing, setup.offloading)
    batch = batch_bytes(shape)
    sharding = Sharding.of(model, setup)

    def phase(gradients=0, optimizer=state, activations=0, other=batch, unsharded=0) -> dict[str, int]:
        """One phase's bytes per category, for one rank. ``unsharded``: gradients alive unsharded under
        FSDP (a unit's, before its reduce-scatter); ``gradients`` is then what the rank keeps sharded."""
        categories = {
            "weights": weights,
            "gradients": gradients,
            "optimizer": optimizer,
            "activations": activations,
            "other": other,
        }
        return sharding.per_rank(categories, unsharded) if sharding else categories

    footprint = Footprint()
    accumulating = setup.accumulate_grad_batches > 1
    if setup.fused:
        # Each bucket's gradients are applied by one optimizer step and freed as soon as the last of
        # them is accumulated: early in backward the activations dominate, later the bucket whose
        # gradients and step temporaries are largest is stepped. Under FSDP a bucket's gradients exist
        # unsharded until reduced, then as the rank's shard.
        footprint.add("forward", phase(activations=act.forward + act.transient))
        early = phase(activations=act.backward, other=batch + act.backward_temp)
        late = max(
            (
                phase(
                    gradients=(size := sum(_nbytes(p) for p in bucket)),
                    optimizer=state + optimizer_bytes(optimizer, setup.device, by_group)[1],
                    unsharded=size if sharding else 0,
                )
                for bucket, by_group in _buckets(module, optimizer, setup.bucket)
            ),
            key=_total,
            default=phase(),
        )
        measuring = phase()
        if setup.clip_norm:
            # Clipping by norm: a first backward only measures the norm and keeps the graph for the fused one,
            # so every saved activation stays to its end, where the largest gradient (the word embeddings') comes;
            # each gradient lives only until its norm is taken (under FSDP, a unit's unsharded ones until reduced).
            # Inside the layers it is as the fused backward: `early`.
            measuring = phase(
                gradients=largest_grad,
                activations=act.forward,
                other=batch + act.backward_temp,
                unsharded=sharding.reducing if sharding else 0,
            )
        footprint.add("backward", max(early, late, measuring, key=_total))
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
            late = phase(gradients=grads, unsharded=sharding.reducing if sharding else 0)
        footprint.add("backward", max(early, late, key=_total))
        footprint.add("step", phase(gradients=grads, optimizer=state + step_temp))
    if sharding:
        notes.append(sharding.describe())
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


