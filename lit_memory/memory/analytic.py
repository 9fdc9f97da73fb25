"""The analytic model of a training step's memory, at three levels: tensors, the allocator, the device.

**Tensors** (what ``torch.cuda.max_memory_allocated`` counts): the reference post's accounting (bytes per
parameter by precision and optimizer) over the parameter shapes of the configured model, built on the
``meta`` device (nothing allocated, nothing downloaded), plus a per-layer activation model
(`lit_memory.memory.layers`: what a layer keeps, by its description and the attention kernel torch picks,
`lit_memory.memory.kernels`). It follows a training step in order: ``training_step`` (no gradient alive,
except the window's in the middle of an accumulation window, or where the loop keeps them), backward,
optimizer step (after which `SequenceClassifier.optimizer_step` frees the gradients), and gives the bytes
per category at the peak of each phase, with every transient the step makes: foreach and per-parameter
optimizer temporaries, Adafactor's and torchao's per-step buffers, autocast's weight copies (and its cache,
where the loop keeps it), gradients of activations in backward.

**Allocator** (``max_memory_reserved``): the step's allocations and frees in order (`lit_memory.memory.program`)
replayed through a model of PyTorch's caching allocator (`lit_memory.memory.allocator`); what it reserves
beyond the tensors it holds (segment rounding, blocks split and cached) is added to the tensors' peak.

**Device** (what ``nvidia-smi`` shows for the process): reserved plus the CUDA context and loaded kernels
(`lit_memory.memory.device`).

Milliseconds per setup for the tensors, tens of milliseconds with the replay (`device_total` caches it):
`lit_memory.tools.plan` predicts hundreds.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lit_memory.anatomy import _ACTIVATION, _FFN, _dropout, _first, _mlp_kind, in_out, linear_types, parameter_units
from lit_memory.fused import Bucketing, group_parameters
from lit_memory.memory import program
from lit_memory.memory.allocator import replay
from lit_memory.memory.device import add_levels
from lit_memory.memory.footprint import Footprint
from lit_memory.memory.kernels import Kernel
from lit_memory.memory.layers import (
    NORM_STATS,
    LayerSpec,
    Shape,
    Tensor,
    _norm,
    activation_saves,
    backward_temp_per_token,
    forward_temp_per_token,
    batch_bytes,
    kernel,
    layer_bytes_per_token,
    layer_tensors,
    selective_bytes_per_token,
    working_set_per_token,
)
from lit_memory.memory.step import Prediction, Step, build
from lit_memory.model import SequenceClassifier, transformer_layers
from lit_memory.optimizers import OptimizerTensors, optimizer_tensors


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


# -- the layers --------------------------------------------------------------------------------------


def shape_of(config, step: Step, masked: bool = True) -> Shape:
    return Shape(
        batch=step.batch_size,
        length=step.max_length,
        precision=step.precision,
        cuda=step.device == "cuda",
        token_types=bool(getattr(config, "type_vocab_size", 0)),
        masked=masked,
        softmax_keeps_input=step.device == "cuda" and step.target.softmax_keeps_input,
    )


def spec_of(model: nn.Module) -> LayerSpec:
    """The last layer's description (ModernBERT's first layer has no norm before attention; the rest
    do). A model with a norm after its last layer (a direct child of the base model: GPT-2's ``ln_f``,
    Llama's ``norm``, ModernBERT's ``final_norm``) normalises before each block: pre-norm."""
    return layer_spec(transformer_layers(model)[-1], model.config, pre_norm=_final_norm(model) is not None)



def layer_spec(layer: nn.Module, config, pre_norm: bool = False) -> LayerSpec:
    """Read from the Hugging Face config and the layer's modules: how many dropouts with p > 0 the
    residual branches have, how many norms over the hidden state and whether q/k have their own, the FFN's
    kind, width and activation, q/k/v widths (grouped-query attention) and whether they are one matrix,
    rotary or DeBERTa's relative attention. ``pre_norm``: the model normalises before each block (it
    has a final norm after the last layer: `lit_memory.memory.analytic.spec_of`)."""
    h = config.hidden_size
    heads = config.num_attention_heads
    ffn = int(_first(config, _FFN, 4 * h))
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    q_width = heads * head_dim
    kv_width = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    attention_p = _dropout(config, head_dropout=False).attention
    dropouts = sum(1 for m in layer.modules() if isinstance(m, nn.Dropout) and m.p > 0 and not _in_lora(layer, m))
    norms = [m for m in layer.modules() if "norm" in type(m).__name__.lower() and not _in_lora(layer, m)]
    widths = [getattr(m, "weight", None) for m in norms]
    head_norms = [m for m, w in zip(norms, widths) if w is not None and w.shape[-1] == head_dim != h]
    hidden_norms = [m for m in norms if not any(m is n for n in head_norms)]
    linears = [
        in_out(m) for name, m in layer.named_modules() if isinstance(m, linear_types()) and "lora_" not in name
    ]
    relative: tuple[str, ...] = ()
    span = 0
    if getattr(config, "relative_attention", False):
        types = getattr(config, "pos_att_type", None) or ()
        relative = tuple(t for t in (types.split("|") if isinstance(types, str) else types) if t in ("c2p", "p2c"))
        span = getattr(config, "position_buckets", -1)
        if span is None or span <= 0:
            span = getattr(config, "max_relative_positions", -1)
            if span is None or span < 1:
                span = config.max_position_embeddings
    return LayerSpec(
        hidden=h,
        ffn=ffn,
        heads=heads,
        ffn_kind="gated" if _mlp_kind(layer, h, ffn) == "gated" else "mlp",
        norm="rmsnorm" if hidden_norms and all("rms" in type(m).__name__.lower() for m in hidden_norms)
        else "layernorm",
        norms=len(hidden_norms) or 2,
        hidden_dropouts=max(dropouts - (1 if attention_p > 0 else 0), 0),
        attention_dropout=attention_p > 0,
        implementation=getattr(config, "_attn_implementation", None) or "sdpa",
        # one projection as wide as q, k and v together, where no two separate ones read the hidden state
        qkv_fused=any(o == q_width + 2 * kv_width for _, o in linears)
        and sum(1 for i, o in linears if i == h and o in (q_width, kv_width)) < 2,
        q_width=0 if q_width == h else q_width,
        kv_width=0 if kv_width == q_width else kv_width,
        activation_saves=activation_saves(_activation(layer, config)),
        pre_norm=pre_norm,
        head_norms=bool(head_norms),
        rotary=any("rope" in key for key in config.to_dict()),
        relative=relative,
        relative_span=2 * span if relative else 0,
        window=any(getattr(m, "sliding_window", None) for m in layer.modules()),
    )


def _activation(layer: nn.Module, config):
    """The FFN's activation: the layer's activation module (transformers' or torch's), else the config's."""
    for m in layer.modules():
        if type(m).__module__ in ("transformers.activations", "torch.nn.modules.activation"):
            return m
    from transformers.activations import ACT2FN

    name = _first(config, _ACTIVATION, "gelu")
    return ACT2FN[name] if isinstance(name, str) and name in ACT2FN else ACT2FN["gelu"]


def _in_lora(layer: nn.Module, module: nn.Module) -> bool:
    return any(m is module for name, m in layer.named_modules() if "lora_" in name)

def _final_norm(model: nn.Module) -> Optional[nn.Module]:
    base = getattr(model, "base_model", model)
    return next((m for _, m in base.named_children() if "norm" in type(m).__name__.lower()), None)


def _embedding_tensors(model: nn.Module, spec: LayerSpec, x: Shape) -> list[Tensor]:
    """What the embeddings keep per token when they train: their norm's input and statistics, where they have
    a norm (BERT's family, DeBERTa, ModernBERT; not GPT-2 nor the decoders), and their dropout's mask."""
    from lit_memory.anatomy import _dropout

    kept = []
    block = getattr(model.base_model, "embeddings", None)
    if isinstance(block, nn.Module) and any("norm" in type(m).__name__.lower() for m in block.modules()):
        kept += [Tensor("norm_in", spec.hidden * x.param_b), Tensor("stats", NORM_STATS["layernorm"])]
    if _dropout(model.config, head_dropout=False).embedding > 0:
        kept.append(Tensor("dropout", spec.hidden * x.mask_b))
    return kept


def _after_layers_per_token(model: nn.Module, spec: LayerSpec, x: Shape) -> int:
    """What is kept per token outside the layers once they train, besides the head's: a pre-norm model's final
    norm, DeBERTa-v2's convolution beside the first layer (its input, dropout noise, the residual sum into its
    LayerNorm and that norm's statistics, the mask it multiplies by)."""
    kept = 0
    if _final_norm(model) is not None:
        kept += sum(t.bytes for t in _norm("final_norm", spec, x))
    if getattr(model.config, "conv_kernel_size", 0):
        h = spec.hidden
        kept += 2 * h * x.param_b + h * x.mask_b + h * x.compute_b + NORM_STATS["layernorm"] + 4
    return kept


def _outside_layers_per_token(
    model: nn.Module, spec: LayerSpec, x: Shape, embeddings_train: bool, layers_train: bool
) -> int:
    """Bytes per token kept outside the layers, besides the head's."""
    kept = sum(t.bytes for t in _embedding_tensors(model, spec, x)) if embeddings_train else 0
    return kept + (_after_layers_per_token(model, spec, x) if layers_train else 0)


def _linear_params(modules, trainable_only: bool = False) -> list[torch.Tensor]:
    """Weights and biases of the linear layers in ``modules``: what autocast casts to 16 bits."""
    found = []
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                found += [p for p in sub.parameters(recurse=False) if p.requires_grad or not trainable_only]
    return found


def _linear_bytes(modules, compute_b: int, trainable_only: bool = False) -> int:
    """The 16-bit copies autocast makes of linear weights and biases. Lightning runs autocast without
    its cache, so a copy lives only while backward needs it (it is saved with the layer's input)."""
    return sum(p.numel() for p in _linear_params(modules, trainable_only)) * compute_b


@dataclass
class _Activations:
    forward: int  # live at the end of the forward pass
    backward: int  # live at the start of backward (checkpointing: plus one recomputed layer)
    transient: int  # forward temporaries on top of `forward` (inside the last layer)
    backward_temp: int  # gradients w.r.t. activations in flight early in backward


def _lora_adapters(layer: nn.Module) -> Optional[tuple[int, int]]:
    """(adapters, rank) of peft's LoRA adapters in a layer (``lora_A`` holds each adapter's down
    projection), or None."""
    downs = [m for name, m in layer.named_modules() if name.endswith("lora_A.default")]
    return (len(downs), downs[0].out_features) if downs else None


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _parts(model: nn.Module):
    """(layers, embeddings, pooler, head modules, index of the first layer with a backward)."""
    return _per_build(model, ("parts",), lambda: _read_parts(model))


def _read_parts(model: nn.Module):
    layers = list(transformer_layers(model))
    embeddings = getattr(model.base_model, "embeddings", None) or model.get_input_embeddings()
    # Backward starts at the first trained module (model.enable_gradient_checkpointing removes
    # transformers' hook that would make the frozen embeddings' output require grad).
    first = 0 if _trains(embeddings) else next((i for i, layer in enumerate(layers) if _trains(layer)), len(layers))
    pooler = getattr(model.base_model, "pooler", None)
    head = [m for name, m in model.named_children() if name != model.base_model_prefix] + ([pooler] if pooler else [])
    return layers, embeddings, pooler, head, first


def _activations(model: nn.Module, spec: LayerSpec, x: Shape, k: Kernel, step: Step) -> _Activations:
    """Activation bytes of a training step. Checkpointing (``"full"`` or ``"selective"``) keeps each layer's
    input and recomputes one layer at a time in backward; offloading keeps what autograd saves (with
    checkpointing, each layer's input and the tensors outside the layers) in host memory, and brings one
    layer's input back at a time in backward. Autocast's weight cache (`Loop.autocast_cache`) keeps every
    16-bit weight copy of the trained linear layers to the end of the forward pass."""
    offload = step.offloading
    layers, embeddings, pooler, head, first = _parts(model)
    modes = _modes(step, len(layers))
    active = layers[first:]
    layer_input = x.tokens * spec.hidden * x.param_b
    saved = 0
    saved += x.tokens * _outside_layers_per_token(model, spec, x, _trains(embeddings), bool(active))
    if active or (pooler is not None and _trains(pooler)):
        # the pooler keeps the last hidden state (without autocast its first-token view pins all of it); the loss
        # keeps its fp32 log-softmax (batch x labels, autocast's fp32 list)
        saved += 3 * x.batch * spec.hidden * x.compute_b + (x.batch * spec.hidden * x.compute_b if x.autocast else layer_input)
        saved += 4 * x.batch * model.config.num_labels
    if not active:  # frozen layers keep nothing for backward, but their forward still has a working set
        return _Activations(forward=saved, backward=saved, transient=working_set_per_token(spec, x, k) * x.tokens, backward_temp=0)
    lora = _lora_adapters(active[0])
    per_layer = layer_bytes_per_token(spec, x, k, lora) * x.tokens
    backward_temp = backward_temp_per_token(spec, x, k) * x.tokens
    cache = _linear_bytes(active + head, x.compute_b, trainable_only=True) if x.autocast and step.loop.autocast_cache else 0
    checkpointed = [layer for layer, mode in zip(layers[first:], modes[first:]) if mode]
    whole = [layer for layer, mode in zip(layers[first:], modes[first:]) if not mode]
    selective = sum(1 for mode in modes[first:] if mode == "selective")
    cached = selective_bytes_per_token(spec, x, k, lora) * x.tokens if selective else 0
    if not checkpointed:
        copies = _linear_bytes(active + head, x.compute_b) if x.autocast else 0
        forward = saved + len(active) * per_layer + copies
        return _Activations(
            forward=forward,
            backward=forward,
            transient=forward_temp_per_token(spec, x, k, lora) * x.tokens,
            backward_temp=backward_temp,
        )
    # Each checkpointed layer keeps its input (selective: also its matmul outputs); backward recomputes one
    # layer at a time (with its 16-bit weights), whose full set of saved tensors then exists. Layers left whole
    # (a per-layer plan's, nearest the output) keep everything, and their backward comes first.
    if offload:  # the layer inputs and the tensors outside the layers wait in host memory
        kept, back = selective * cached, layer_input
    else:
        kept, back = saved + len(checkpointed) * layer_input + selective * cached, 0
    one_layer_copies = _linear_bytes(checkpointed[:1], x.compute_b) if x.autocast else 0
    # without autocast the recomputed layer's set holds its input, which `kept` (or `back`) counts already
    own_input = layer_input if any(t.name == "input" for t in layer_tensors(spec, x, k, lora)) else 0
    # the first layer to recompute is the checkpointed one nearest the output (selective, if any is)
    top = "selective" if selective else "full"
    recomputing = kept + back + per_layer - own_input - (cached if top == "selective" else 0) + one_layer_copies
    if not whole:
        return _Activations(
            forward=kept + cache,
            backward=recomputing,
            transient=working_set_per_token(spec, x, k) * x.tokens,
            backward_temp=backward_temp,
        )
    # the whole layers' tensors (their 16-bit weight copies among them) are alive at the end of forward and
    # at the start of backward; they are gone before the first checkpointed layer recomputes
    # (offloading needs every layer checkpointed: `SequenceClassifier` refuses it with layers left whole)
    whole_bytes = len(whole) * per_layer + (_linear_bytes(whole + head, x.compute_b) if x.autocast else 0)
    checkpointed_cache = _linear_bytes(checkpointed, x.compute_b, trainable_only=True) if x.autocast and step.loop.autocast_cache else 0
    return _Activations(
        forward=kept + whole_bytes + checkpointed_cache,
        backward=max(kept + whole_bytes, recomputing),
        transient=forward_temp_per_token(spec, x, k, lora) * x.tokens,
        backward_temp=backward_temp,
    )


def _modes(step: Step, layers: int) -> list[Optional[str]]:
    """Each layer's checkpointing mode (input side first), from the step's plan."""
    plan = step.checkpointing
    return plan.modes(layers) if plan is not None else [None] * layers


def _inference(spec: LayerSpec, x: Shape, k: Kernel, weights: int) -> int:
    """Weights + batch + one layer's working set without autograd (eval: no dropout)."""
    live = x.tokens * (spec.hidden * x.param_b + working_set_per_token(spec, x, k, training=False))
    return weights + batch_bytes(x) + live


# -- the optimizer -----------------------------------------------------------------------------------
# What an optimizer keeps and allocates is measured by `lit_memory.optimizers.optimizer_tensors` (a probe step on
# meta tensors), the one place that knows optimizers.


# torch's GradScaler (16-mixed): its scale (fp32) and growth tracker (int32) live through the run. Unscaling is in
# place on the gradients (one foreach kernel, or per bucket fused); it adds the found-inf flag and the inverse
# scale, made through fp64 (the scale as a double, its reciprocal, the float): four scalars at most at once.
# On CUDA each scalar is a 512-byte block of the caching allocator (its smallest), within the small pool's
# segments the weights' biases already reserve; on the CPU its own bytes.
SCALER_STATE = (4, 4)
UNSCALE_TEMPORARIES = (4, 8, 8, 4)
CUDA_BLOCK = 512


def scaler_bytes(step: Step) -> tuple[int, int]:
    """(GradScaler's state, what unscaling adds while it runs) for ``step``: 0 without loss scaling."""
    if not step.scaled:
        return 0, 0
    size = (lambda b: -(-b // CUDA_BLOCK) * CUDA_BLOCK) if step.device == "cuda" else (lambda b: b)
    return sum(map(size, SCALER_STATE)), sum(map(size, UNSCALE_TEMPORARIES))


def _total(categories: dict[str, int]) -> int:
    return sum(categories.values())


# The last meta-device builds: `plan` predicts hundreds of setups that share a handful of models.
_META_BUILDS: OrderedDict[str, tuple[SequenceClassifier, torch.optim.Optimizer]] = OrderedDict()
META_BUILDS_KEPT = 128  # plan cycles through ~100 builds; a meta BERT-large build is ~1 MiB of Python objects


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
    def of(cls, model: nn.Module, step: Step) -> Optional["Sharding"]:
        if not step.sharded or step.world_size < 2:
            return None
        layers = transformer_layers(model)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_layers]
        layer_bytes = [sum(_nbytes(p) for p in layer.parameters()) for layer in layers]
        layer_grads = [sum(_nbytes(p) for p in layer.parameters() if p.requires_grad) for layer in layers]
        root_grads = sum(_nbytes(p) for p in root if p.requires_grad)
        return cls(
            ranks=step.world_size,
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
    module: SequenceClassifier, optimizer: torch.optim.Optimizer, bucket: Bucketing
) -> list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]:
    """The fused step's buckets of the trainable parameters (`lit_memory.fused.group_parameters`), each
    with its parameters split by group, as its optimizer steps them (one foreach call per group)."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"] if p.requires_grad}
    buckets = group_parameters([p for p in module.parameters() if id(p) in group_of], parameter_units(module), bucket)
    return [(b, [[p for p in b if group_of[id(p)] == g] for g in sorted({group_of[id(p)] for p in b})]) for b in buckets]


# What a meta build's model and optimizer give whatever the step's checkpointing plan: `resolve` predicts
# hundreds of plans over one build (`_meta_build`), and reading them again was most of each prediction.
_PER_BUILD: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _per_build(owner: Any, key: tuple, make):
    """``make()``, once per ``owner`` (a meta build's model or optimizer) and ``key``."""
    found = _PER_BUILD.setdefault(owner, {})
    if key not in found:
        found[key] = make()
    return found[key]


def _bucket_tensors(optimizer: torch.optim.Optimizer, device: str, by_group: list[list[torch.Tensor]]) -> "OptimizerTensors":
    key = ("bucket", device, tuple(id(p) for group in by_group for p in group))
    return _per_build(optimizer, key, lambda: optimizer_tensors(optimizer, device, by_group))


def _meta_build(step: Step) -> tuple[SequenceClassifier, torch.optim.Optimizer]:
    # One build serves every checkpointing plan: the model reads the plan from the step, not from the module.
    key = step.build_key
    if key in _META_BUILDS:
        _META_BUILDS.move_to_end(key)
    else:
        module, optimizer = build(step, torch.device("meta"))
        module.optimizer_factory = None  # what it references is not needed once the optimizer exists
        _META_BUILDS[key] = module, optimizer
        if len(_META_BUILDS) > META_BUILDS_KEPT:
            _META_BUILDS.popitem(last=False)
    return _META_BUILDS[key]


def analytic(step: Step, levels: bool = True) -> Prediction:
    """The analytic prediction of ``step``; ``levels=False`` skips the allocator's replay (the tensors alone,
    milliseconds: what a search ranks hundreds of setups by)."""
    start = time.perf_counter()
    module, optimizer = _meta_build(step)
    model = module.model
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weights = sum(_nbytes(p) for p in params) + sum(_nbytes(b) for b in model.buffers())
    grads = sum(_nbytes(p) for p in trainable)
    largest_grad = max((_nbytes(p) for p in trainable), default=0)
    opt = _per_build(optimizer, ("state", step.device), lambda: optimizer_tensors(optimizer, step.device))
    state, step_temp, notes = opt.state_bytes, opt.temp_bytes, list(opt.notes)
    shape = shape_of(model.config, step)
    spec = _per_build(model, ("spec",), lambda: spec_of(model))
    capability = step.target.gpu.capability
    k = kernel(spec, shape, capability)
    act = _activations(model, spec, shape, k, step)
    scaler_state, unscaling = scaler_bytes(step)
    batch = batch_bytes(shape) + scaler_state  # "other": the batch, and GradScaler's state for the whole run
    sharding = Sharding.of(model, step)
    loop = step.loop

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
    accumulating = step.accumulate_grad_batches > 1
    buckets = _per_build(optimizer, ("buckets", step.bucket), lambda: _buckets(module, optimizer, step.bucket)) if step.fused else []
    if step.fused:
        # Each bucket's gradients are applied by one optimizer step and freed as soon as the last of
        # them is accumulated: early in backward the activations dominate, later the bucket whose
        # gradients and step temporaries are largest is stepped. Under FSDP a bucket's gradients exist
        # unsharded until reduced, then as the rank's shard.
        footprint.add("forward", phase(activations=act.forward + act.transient))
        early = phase(activations=act.backward, other=batch + unscaling + act.backward_temp)
        late = max(
            (
                phase(
                    gradients=(size := sum(_nbytes(p) for p in bucket)),
                    optimizer=state + _bucket_tensors(optimizer, step.device, by_group).temp_bytes,
                    other=batch + unscaling,
                    unsharded=size if sharding else 0,
                )
                for bucket, by_group in buckets
            ),
            key=_total,
            default=phase(),
        )
        measuring = phase()
        if step.measures:
            # Clipping by norm or loss scaling: a first backward only measures (the norm; whether a gradient
            # overflowed, each unscaled in place) and keeps the graph for the fused one, so every saved activation
            # stays to its end, where the largest gradient (the word embeddings') comes; each gradient lives only
            # until it is measured (under FSDP, a unit's unsharded ones until reduced). Inside the layers it is
            # as the fused backward: `early`.
            measuring = phase(
                gradients=largest_grad,
                activations=act.forward,
                other=batch + unscaling + act.backward_temp,
                unsharded=sharding.reducing if sharding else 0,
            )
        footprint.add("backward", max(early, late, measuring, key=_total))
        footprint.add("step", phase())  # Lightning's step after backward finds every gradient gone
    else:
        # SequenceClassifier.optimizer_step frees the gradients after the step; mid-window micro-batches
        # of an accumulation run their forward with the window's gradients alive, as do loops that release
        # them only before backward or zero them in place (`Loop.gradients`).
        forward_grads = grads if accumulating or loop.gradients != "after_step" else 0
        backward_grads = grads if accumulating or loop.gradients == "zeroed" else 0
        footprint.add("forward", phase(gradients=forward_grads, activations=act.forward + act.transient))
        early = phase(gradients=backward_grads, activations=act.backward, other=batch + act.backward_temp)
        if backward_grads:  # gradients accumulate into the existing ones, through a temporary
            late = phase(gradients=grads, other=batch + largest_grad)
        else:
            late = phase(gradients=grads, unsharded=sharding.reducing if sharding else 0)
        footprint.add("backward", max(early, late, key=_total))
        footprint.add("step", phase(gradients=grads, optimizer=state + step_temp, other=batch + unscaling))
    if sharding:
        notes.append(sharding.describe())
    eval_kernel = kernel(spec, shape, capability, training=False)
    prediction = Prediction(
        method="analytic",
        device=step.device,
        footprint=footprint,
        inference=_inference(spec, shape, eval_kernel, weights),
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in trainable),
        notes=notes,
        attention=f"{spec.implementation} attention, {k.reason}",
    )
    if step.device == "cuda" and levels:
        model_ = _step_model(module, optimizer, opt, buckets, spec, shape, k, step, act)
        # the allocator's reserve beyond what it holds, over the tensors' peak (its replay, not the model's sum)
        found = replay(program.events(model_), step.target.allocator)
        reserve = footprint.peak + max(found.peak_reserved - found.peak_allocated, 0)
        add_levels(footprint, reserve, found.peak_phase, step.target)
    prediction.seconds = time.perf_counter() - start
    return prediction


# -- the allocator and the device ----------------------------------------------------------------------


def _step_model(module, optimizer, opt: OptimizerTensors, buckets, spec, shape, k, step: Step, act) -> program.StepModel:
    """The analytic model's step as `lit_memory.memory.program` writes it out for the allocator."""
    model = module.model
    layers, embeddings, pooler, head, first = _parts(model)
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    head_ids = {id(p) for m in head for p in m.parameters()}
    autocast_copy = {id(p) for p in _linear_params(layers + head)} if shape.autocast else set()
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    stage = _ffn_stages(layers, spec)
    entries = [
        program.Param(
            bytes=_nbytes(p),
            trainable=p.requires_grad,
            layer=layer_of.get(id(p)),
            head=id(p) in head_ids,
            copy=p.numel() * shape.compute_b if id(p) in autocast_copy else 0,
            made_at=stage.get(id(p)),
        )
        for p in params
    ]
    lora = _lora_adapters(layers[first]) if first < len(layers) else None
    tensors = layer_tensors(spec, shape, k, lora)
    modes = _modes(step, len(layers))
    runs = [
        program.LayerRun(
            tensors, trains=i >= first, input_kept=any(t.name == "input" for t in tensors), checkpoint=modes[i]
        )
        for i in range(len(layers))
    ]
    emb_trains = _trains(embeddings)
    emb = [Tensor(t.name, t.bytes, emb_trains) for t in _embedding_tensors(model, spec, shape)]
    head_kept = []
    if first < len(layers) or (pooler is not None and _trains(pooler)):
        head_kept = [shape.batch * spec.hidden * shape.compute_b] * 3
    if first < len(layers) and (after := _after_layers_per_token(model, spec, shape)):
        head_kept.append(after * shape.tokens)
    selective = selective_bytes_per_token(spec, shape, k, lora) if "selective" in modes else 0
    return program.StepModel(
        params=entries,
        buffers=sum(_nbytes(b) for b in model.buffers()),
        batch=batch_bytes(shape),
        tokens=shape.tokens,
        hidden_bytes=spec.hidden * shape.param_b,
        layers=runs,
        states=[opt.state.get(id(p), []) for p in params],
        step_temps=opt.temps,
        buckets=[[index[id(p)] for p in bucket] for bucket, _ in buckets],
        bucket_temps=[_bucket_tensors(optimizer, step.device, by_group).temps for _, by_group in buckets],
        embeddings=emb,
        head=head_kept,
        selective=selective,
        offload=step.offloading,
        fused=step.fused,
        measures=step.measures,
        accumulate=step.accumulate_grad_batches,
        gradients=step.loop.gradients,
        autocast_cache=step.loop.autocast_cache,
        backward_temp=backward_temp_per_token(spec, shape, k),
        workspace=step.target.cublas_workspace,
        shards=step.world_size if step.sharded else 1,
    )


def _ffn_stages(layers, spec: LayerSpec) -> dict[int, str]:
    """`program.Param.made_at` of each FFN weight and bias, read from the linear modules' shapes (any family):
    "down" for a projection from the FFN's width, "up" for one into it (gate and up, or a fused gate+up)."""
    stages = {}
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, linear_types()):
                into, out = in_out(module)
                stage = "down" if into == spec.ffn else "up" if into == spec.hidden and out in (spec.ffn, 2 * spec.ffn) else None
                if stage:
                    stages.update({id(p): stage for p in module.parameters(recurse=False)})
    return stages


def device_total(step: Step) -> int:
    """What ``nvidia-smi`` would show for this step's process at its peak, predicted analytically: tensors,
    the allocator's reserve and the CUDA context (bytes). Cached per step; cheap enough for a search
    over hundreds of setups."""
    key = step.key()
    if key not in _TOTALS:
        prediction = analytic(step)
        _TOTALS[key] = prediction.footprint.device if prediction.footprint.device is not None else prediction.footprint.peak
        if len(_TOTALS) > 4096:
            _TOTALS.pop(next(iter(_TOTALS)))
    return _TOTALS[key]


_TOTALS: dict[str, int] = {}
