"""What a training step's activations take, layer by layer: `activations(step, model)` reads each layer's
description (`lit_memory.memory.model.layers.LayerSpec`) from the model built on the ``meta`` device and the
attention kernel torch picks (`lit_memory.memory.hardware.kernels`), and gives what the step keeps for backward
and makes while it computes, per checkpointing mode, with the embeddings and what runs after the layers, a
forward without autograd, and the figures the allocator's replay writes out (`Activations`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Optional

import torch
from torch import nn
from transformers.activations import ACT2FN

from lit_memory.hf.anatomy import (
    ACTIVATION_NAMES,
    FFN_NAMES,
    config_dropouts,
    config_value,
    in_out,
    linear_types,
    mlp_kind,
)
from lit_memory.hf.qlora import is_quantised, largest_quantised
from lit_memory.memory.hardware.kernels import Kernel
from lit_memory.memory.model.layers import (
    NORM_STATS,
    LayerSpec,
    Shape,
    Tensor,
    activation_saves,
    backward_temp_per_token,
    batch_bytes,
    forward_temp_per_token,
    kernel,
    layer_bytes_per_token,
    layer_tensors,
    norm_tensors,
    selective_bytes_per_token,
    working_set_per_token,
)
from lit_memory.model import transformer_layers
from lit_memory.planning.prediction.state_model import per_build
from lit_memory.planning.prediction.step import Step

# -- the layers --------------------------------------------------------------------------------------


def shape_of(config, step: Step, masked: bool = True) -> Shape:
    """How ``step`` runs the layers of a model with ``config`` (a padding mask, unless ``masked`` is False)."""
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
    has a final norm after the last layer: `spec_of`)."""
    h = config.hidden_size
    heads = config.num_attention_heads
    ffn = int(config_value(config, FFN_NAMES, 4 * h))
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    q_width = heads * head_dim
    kv_width = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    attention_p = config_dropouts(config, head_dropout=False).attention
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
        ffn_kind="gated" if mlp_kind(layer, h, ffn) == "gated" else "mlp",
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
    name = config_value(config, ACTIVATION_NAMES, "gelu")
    return ACT2FN[name] if isinstance(name, str) and name in ACT2FN else ACT2FN["gelu"]


def _in_lora(layer: nn.Module, module: nn.Module) -> bool:
    return any(m is module for name, m in layer.named_modules() if "lora_" in name)


def _final_norm(model: nn.Module) -> Optional[nn.Module]:
    base = getattr(model, "base_model", model)
    return next((m for _, m in base.named_children() if "norm" in type(m).__name__.lower()), None)


def _embedding_tensors(model: nn.Module, spec: LayerSpec, x: Shape) -> list[Tensor]:
    """What the embeddings keep per token when they train: their norm's input and statistics, where they have
    a norm (BERT's family, DeBERTa, ModernBERT; not GPT-2 nor the decoders), and their dropout's mask."""
    kept = []
    block = getattr(model.base_model, "embeddings", None)
    if isinstance(block, nn.Module) and any("norm" in type(m).__name__.lower() for m in block.modules()):
        kept += [Tensor("norm_in", spec.hidden * x.param_b), Tensor("stats", NORM_STATS["layernorm"])]
    if config_dropouts(model.config, head_dropout=False).embedding > 0:
        kept.append(Tensor("dropout", spec.hidden * x.mask_b))
    return kept


def _after_layers_per_token(model: nn.Module, spec: LayerSpec, x: Shape) -> int:
    """What is kept per token outside the layers once they train, besides the head's: a pre-norm model's final
    norm, DeBERTa-v2's convolution beside the first layer (its input, dropout noise, the residual sum into its
    LayerNorm and that norm's statistics, the mask it multiplies by)."""
    kept = 0
    if _final_norm(model) is not None:
        kept += sum(t.bytes for t in norm_tensors("final_norm", spec, x))
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
    """Weights and biases of the linear layers in ``modules``: what autocast casts to 16 bits (not a 4-bit weight:
    bitsandbytes dequantises it into the compute dtype itself, keeping nothing for backward)."""
    found = []
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                found += [
                    p
                    for p in sub.parameters(recurse=False)
                    if (p.requires_grad or not trainable_only) and not is_quantised(p)
                ]
    return found


def _linear_bytes(modules, compute_b: int, trainable_only: bool = False) -> int:
    """The 16-bit copies autocast makes of linear weights and biases. Lightning runs autocast without
    its cache, so a copy lives only while backward needs it (it is saved with the layer's input)."""
    return sum(p.numel() for p in _linear_params(modules, trainable_only)) * compute_b


@dataclass(frozen=True)
class _Totals:
    """`Activations`' bytes of the step's phases (the same fields)."""

    forward: int
    backward: int
    transient: int
    backward_temp: int


def _lora_adapters(layer: nn.Module) -> Optional[tuple[int, int]]:
    """(adapters, rank) of peft's LoRA adapters in a layer (``lora_A`` holds each adapter's down
    projection), or None."""
    downs = [m for name, m in layer.named_modules() if name.endswith("lora_A.default")]
    return (len(downs), downs[0].out_features) if downs else None


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _parts(model: nn.Module):
    """(layers, embeddings, pooler, head modules, index of the first layer with a backward)."""
    return per_build(model, ("parts",), lambda: _read_parts(model))


def _read_parts(model: nn.Module):
    layers = list(transformer_layers(model))
    embeddings = getattr(model.base_model, "embeddings", None) or model.get_input_embeddings()
    # Backward starts at the first trained module (checkpointing.enable_gradient_checkpointing removes
    # transformers' hook that would make the frozen embeddings' output require grad).
    first = 0 if _trains(embeddings) else next((i for i, layer in enumerate(layers) if _trains(layer)), len(layers))
    pooler = getattr(model.base_model, "pooler", None)
    head = [m for name, m in model.named_children() if name != model.base_model_prefix] + ([pooler] if pooler else [])
    return layers, embeddings, pooler, head, first


def _totals(model: nn.Module, spec: LayerSpec, x: Shape, k: Kernel, step: Step) -> _Totals:
    """Activation bytes of a training step's phases. Checkpointing (``"full"`` or ``"selective"``) keeps each layer's
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
        saved += 3 * x.batch * spec.hidden * x.compute_b + (
            x.batch * spec.hidden * x.compute_b if x.autocast else layer_input
        )
        saved += 4 * x.batch * model.config.num_labels
    if not active:  # frozen layers keep nothing for backward, but their forward still has a working set
        return _Totals(
            forward=saved, backward=saved, transient=working_set_per_token(spec, x, k) * x.tokens, backward_temp=0
        )
    lora = _lora_adapters(active[0])
    per_layer = layer_bytes_per_token(spec, x, k, lora) * x.tokens
    backward_temp = backward_temp_per_token(spec, x, k) * x.tokens
    cache = (
        _linear_bytes(active + head, x.compute_b, trainable_only=True) if x.autocast and step.loop.autocast_cache else 0
    )
    checkpointed = [layer for layer, mode in zip(layers[first:], modes[first:]) if mode]
    whole = [layer for layer, mode in zip(layers[first:], modes[first:]) if not mode]
    selective = sum(1 for mode in modes[first:] if mode == "selective")
    cached = selective_bytes_per_token(spec, x, k, lora) * x.tokens if selective else 0
    if not checkpointed:
        copies = _linear_bytes(active + head, x.compute_b) if x.autocast else 0
        forward = saved + len(active) * per_layer + copies
        return _Totals(
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
        return _Totals(
            forward=kept + cache,
            backward=recomputing,
            transient=working_set_per_token(spec, x, k) * x.tokens,
            backward_temp=backward_temp,
        )
    # the whole layers' tensors (their 16-bit weight copies among them) are alive at the end of forward and
    # at the start of backward; they are gone before the first checkpointed layer recomputes
    # (offloading needs every layer checkpointed: `SequenceClassifier` refuses it with layers left whole)
    whole_bytes = len(whole) * per_layer + (_linear_bytes(whole + head, x.compute_b) if x.autocast else 0)
    checkpointed_cache = (
        _linear_bytes(checkpointed, x.compute_b, trainable_only=True) if x.autocast and step.loop.autocast_cache else 0
    )
    return _Totals(
        forward=kept + whole_bytes + checkpointed_cache,
        backward=max(kept + whole_bytes, recomputing),
        transient=forward_temp_per_token(spec, x, k, lora) * x.tokens,
        backward_temp=backward_temp,
    )


def _modes(step: Step, layers: int) -> list[Optional[str]]:
    """Each layer's checkpointing mode (input side first), from the step's plan."""
    plan = step.checkpointing
    return plan.modes(layers) if plan is not None else [None] * layers


def _inference(spec: LayerSpec, x: Shape, k: Kernel) -> int:
    """The batch and one layer's working set without autograd (eval: no dropout); the weights come on top."""
    live = x.tokens * (spec.hidden * x.param_b + working_set_per_token(spec, x, k, training=False))
    return batch_bytes(x) + live


def _ffn_stages(layers, spec: LayerSpec) -> dict[int, str]:
    """`program.Param.made_at` of each FFN weight and bias, read from the linear modules' shapes (any family):
    "down" for a projection from the FFN's width, "up" for one into it (gate and up, or a fused gate+up)."""
    stages = {}
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, linear_types()):
                into, out = in_out(module)
                stage = (
                    "down"
                    if into == spec.ffn
                    else "up"
                    if into == spec.hidden and out in (spec.ffn, 2 * spec.ffn)
                    else None
                )
                if stage:
                    stages.update({id(p): stage for p in module.parameters(recurse=False)})
    return stages


@dataclass(frozen=True)
class _Roles:
    """Where each parameter of a build sits, by ``id``: the figures the allocator's replay needs per parameter."""

    layer_of: Mapping[int, int]  # transformer layer index
    head: frozenset[int]  # outside the layers, after them (pooler, classifier)
    linear: frozenset[int]  # the layers' and head's linear weights and biases: what autocast copies
    made_at: Mapping[int, str]  # `_ffn_stages`


def _roles(model: nn.Module, spec: LayerSpec) -> _Roles:
    layers, _, _, head, _ = _parts(model)
    return _Roles(
        layer_of={id(p): i for i, layer in enumerate(layers) for p in layer.parameters()},
        head=frozenset(id(p) for m in head for p in m.parameters()),
        linear=frozenset(id(p) for p in _linear_params(layers + head)),
        made_at=_ffn_stages(layers, spec),
    )


@dataclass(frozen=True)
class Activations:
    """What a training step's activations take (bytes), and how its layers run, for one device."""

    spec: LayerSpec  # the layers' description (the last layer's)
    shape: Shape  # how they run
    kernel: Kernel  # the attention kernel torch picks in training
    forward: int  # live at the end of the forward pass
    backward: int  # live at the start of backward (checkpointing: plus one recomputed layer)
    transient: int  # forward temporaries on top of `forward` (inside the last layer)
    backward_temp: int  # gradients w.r.t. activations in flight early in backward
    batch: int  # the batch's tensors
    inference: int  # a forward pass without autograd: the batch and one layer's working set (weights excluded)
    # The step layer by layer, as the allocator's replay writes it out (`lit_memory.memory.model.program`):
    first: int  # the first layer with a backward (the number of layers where none has)
    modes: tuple[Optional[str], ...]  # each layer's checkpointing mode, input side first
    layer_tensors: tuple[Tensor, ...]  # per token, what a trained layer makes in forward order
    embeddings: tuple[Tensor, ...]  # per token, what the embeddings keep (``kept``: when they train)
    head: tuple[int, ...]  # whole tensors kept outside the layers after them (pooler, classifier, final norm)
    selective: int  # per token per selective layer: its kept matmul outputs
    backward_temp_per_token: int
    layer_of: Mapping[int, int]  # by parameter ``id``: its transformer layer
    head_params: frozenset[int]  # parameter ``id``s outside the layers, after them
    autocast_copies: frozenset[int]  # parameter ``id``s autocast copies to 16 bits (none without autocast)
    made_at: Mapping[int, str]  # by parameter ``id``: where in its layer's backward its gradient is made


def _windowed(layers: list) -> list[Optional[bool]]:
    """Per layer: None where its attention has no sliding window, else whether the window is bidirectional
    (ModernBERT's local attention: ``is_causal`` False) rather than causal (Gemma 3's sliding)."""
    found = [[m for m in layer.modules() if getattr(m, "sliding_window", None)] for layer in layers]
    return [any(getattr(m, "is_causal", True) is False for m in ms) if ms else None for ms in found]


def _cpu_window_masks(model: nn.Module, first: int, modes: list, x: Shape, k: Kernel) -> Optional[tuple[int, int, int]]:
    """The sliding-window mask on the CPU, O(L^2) though the window is linear: (kept, alive, building) bytes.

    transformers builds one bool (batch, 1, L, L) mask per forward for the windowed layers
    (`masking_utils.sdpa_mask`), alive through the forward pass (alive). SDPA's CPU fused kernel converts it
    to the query's dtype, a new (batch, 1, L, L) tensor per call, and keeps it for backward (kept: per
    trained windowed layer left whole); the math kernel (dropout) adds it to the scores and frees it. A
    bidirectional window is built from ``abs(q_idx - kv_idx)``: two int64 (L, L) tensors at once (building);
    a causal one from bool comparisons, less than the forward keeps later. Unwindowed layers of the unpadded
    batch `lit_memory.planning.prediction.simulate.measure` runs get no mask (``is_causal``, or none).
    None where no layer is windowed, or on a GPU (the memory-efficient kernel's bias is a per-layer tensor
    of `lit_memory.memory.hardware.kernels`)."""
    if not k.name.startswith("cpu-"):
        return None
    windowed = per_build(model, ("windowed",), lambda: _windowed(_parts(model)[0]))
    if all(w is None for w in windowed):
        return None
    square = x.length * x.length
    keeping = sum(1 for w, mode in zip(windowed[first:], modes[first:]) if w is not None and not mode) if k.fused else 0
    building = 2 * 8 * square if any(windowed) else 0
    return keeping * x.batch * square * x.compute_b, x.batch * square, building


def activations(step: Step, model: nn.Module) -> Activations:
    """The activations of ``step`` on ``model``, its build on the ``meta`` device."""
    x = shape_of(model.config, step)
    spec = per_build(model, ("spec",), lambda: spec_of(model))
    capability = step.target.gpu.capability
    k = kernel(spec, x, capability)
    totals = _totals(model, spec, x, k, step)
    if dequantised := per_build(model, ("dequantised",), lambda: largest_quantised(model)) * x.compute_b:
        # a 4-bit base: each matmul's weight dequantised while it runs, in forward and again in backward
        totals = replace(
            totals, transient=totals.transient + dequantised, backward_temp=totals.backward_temp + dequantised
        )
    layers, embeddings, pooler, _, first = _parts(model)
    if masks := _cpu_window_masks(model, first, _modes(step, len(layers)), x, k):
        kept, alive, building = masks
        forward = totals.forward + kept
        # the forward's peak: at its end (with the bool mask), or while the mask is built, before the layers
        outside = x.tokens * _outside_layers_per_token(model, spec, x, _trains(embeddings), first < len(layers))
        transient = max(totals.transient + alive, outside + building - forward)
        totals = replace(totals, forward=forward, backward=totals.backward + kept, transient=transient)
    roles = per_build(model, ("roles",), lambda: _roles(model, spec))
    trained = first < len(layers)
    lora = _lora_adapters(layers[first]) if trained else None
    modes = _modes(step, len(layers))
    embeddings_train = _trains(embeddings)
    head = []
    if trained or (pooler is not None and _trains(pooler)):
        head = [x.batch * spec.hidden * x.compute_b] * 3
    if trained and (after := _after_layers_per_token(model, spec, x)):
        head.append(after * x.tokens)
    return Activations(
        spec=spec,
        shape=x,
        kernel=k,
        forward=totals.forward,
        backward=totals.backward,
        transient=totals.transient,
        backward_temp=totals.backward_temp,
        batch=batch_bytes(x),
        inference=_inference(spec, x, kernel(spec, x, capability, training=False)),
        first=first,
        modes=tuple(modes),
        layer_tensors=tuple(layer_tensors(spec, x, k, lora)),
        embeddings=tuple(Tensor(t.name, t.bytes, embeddings_train) for t in _embedding_tensors(model, spec, x)),
        head=tuple(head),
        selective=selective_bytes_per_token(spec, x, k, lora) if "selective" in modes else 0,
        backward_temp_per_token=backward_temp_per_token(spec, x, k),
        layer_of=roles.layer_of,
        head_params=roles.head,
        autocast_copies=roles.linear if x.autocast else frozenset(),
        made_at=roles.made_at,
    )
