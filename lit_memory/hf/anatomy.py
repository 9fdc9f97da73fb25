"""What a Hugging Face sequence classifier is made of, read from the model itself: `Anatomy.of(model)`.

Everything that acts on a part of the model goes through this one description instead of guessing
with BERT's attribute names: the fused step's ``layer`` buckets (`parameter_units`), ``freeze``,
gradient checkpointing and compilation (the layer list), LoRA's targets and the head parts that
train in full (`lit_memory.hf.lora`), bitsandbytes' 32-bit embedding state (`lit_memory.optim.eightbit`),
and FSDP2's sharding units. Families differ in names (``encoder.layer``, ``transformer.h``,
``model.layers``; ``word_embeddings``, ``wte``, ``embed_tokens``; ``classifier``, ``score``), so the
parts are found by what they are: the stack of `GradientCheckpointingLayer` blocks (or the
``ModuleList`` as long as ``num_hidden_layers``), every `nn.Embedding`, the children outside the
base model. The per-layer sizes and kinds an activation model needs (`LayerShape`, `Dropout`) are
read from the config under each family's own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

from lit_memory.errors import UserError

# What a layer's attention computes: BERT-style full attention over absolute positions; DeBERTa's
# disentangled content/relative-position terms; ModernBERT's alternating global and sliding-window
# layers (rotary); a decoder's causal attention (some layers may also be sliding-window: Gemma3).
AttentionKind = Literal["bidirectional", "disentangled", "global_local", "causal"]
# ``dense``: two matrices with an activation between (BERT, GPT-2); ``gated``: an activation of one
# projection times another (SwiGLU, GeGLU: Llama, Qwen3, Gemma3, ModernBERT's fused Wi).
MlpKind = Literal["dense", "gated"]
NormKind = Literal["layernorm", "rmsnorm"]
# Which token's hidden state the head reads: the first ([CLS]), or the last that is not padding.
Pooling = Literal["first", "last"]

# Config names each quantity goes by, first match wins (families name the same thing differently).
FFN_NAMES = ("intermediate_size", "n_inner", "hidden_dim", "ffn_dim")
ACTIVATION_NAMES = ("hidden_act", "hidden_activation", "activation_function", "activation")
HIDDEN_DROPOUT_NAMES = ("hidden_dropout_prob", "resid_pdrop", "mlp_dropout", "hidden_dropout", "dropout")
ATTENTION_DROPOUT_NAMES = ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
EMBEDDING_DROPOUT_NAMES = ("embd_pdrop", "embedding_dropout")
CLASSIFIER_DROPOUT_NAMES = ("classifier_dropout", "cls_dropout", "seq_classif_dropout")


def linear_types() -> tuple[type, ...]:
    """The module types that are a layer's matrices: `nn.Linear`, and GPT-2's transformers `Conv1D`
    (a linear layer with its weight transposed), which peft adapts too."""
    try:  # deferred: heavy; this module works on any nn.Module
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - every supported transformers has it
        return (nn.Linear,)
    return (nn.Linear, Conv1D)


def in_out(module: nn.Module) -> tuple[int, int]:
    """(input, output) features of a linear module (`Conv1D` stores its weight as input x output)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


@dataclass(frozen=True)
class Dropout:
    """Dropout probabilities, read under the family's own config names (0 where it has none)."""

    hidden: float  # on the residual stream (attention output, MLP output)
    attention: float  # on the attention probabilities
    embedding: float  # after the embeddings
    classifier: float  # in the head


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer as an activation model sees it."""

    hidden: int
    ffn: int  # the MLP's inner width (a gated MLP has two projections of this width)
    heads: int
    kv_heads: int  # fewer than ``heads`` with grouped-query attention
    head_dim: int  # q/k/v may be wider or narrower than hidden (heads x head_dim)
    mlp: MlpKind
    activation: str
    norm: NormKind
    attention: AttentionKind
    window: Optional[int]  # a sliding-window layer's window (tokens each side / behind), None: global


@dataclass(frozen=True, eq=False)
class Anatomy:
    """The parts of one Hugging Face sequence classifier (inside a peft wrapper, if any).

    ``layers``: the transformer blocks, in order. ``embeddings``: every embedding matrix (word,
    position, token type, relative position; one entry per matrix where some are tied).
    ``embedding_modules``: what ``freeze: embeddings`` freezes (the base model's ``embeddings``
    block where it has one, and every embedding outside it). ``head``: the model's children outside
    the base model that hold parameters (classifier, DeBERTa's and DistilBERT's pooler, ModernBERT's
    prediction head, a decoder's ``score``): a fine-tune initialises them, so they train in full
    even where the rest is frozen or adapted. ``linear_names``: the distinct names of the model's
    linear modules (what LoRA can target).
    """

    model: nn.Module  # the Hugging Face model itself (a peft wrapper unwrapped)
    family: str  # config.model_type
    layers: nn.ModuleList
    embeddings: tuple[nn.Embedding, ...]
    embedding_modules: tuple[nn.Module, ...]
    head: tuple[tuple[str, nn.Module], ...]
    linear_names: tuple[str, ...]
    attention_implementation: str  # eager / sdpa / flash_attention_2 ..., as configured
    attention: AttentionKind
    pooling: Pooling
    shapes: tuple[LayerShape, ...]  # one per layer
    dropout: Dropout
    vocab_size: int
    pad_token_id: Optional[int]

    @classmethod
    def of(cls, model: nn.Module) -> "Anatomy":
        """The anatomy of a Hugging Face model, or of the one a peft model wraps."""
        model = unwrap(model)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        base = model.base_model
        layers = find_layers(model)
        embeddings = _unique_embeddings(model)
        in_layers = {id(m) for m in layers.modules()}
        block = getattr(base, "embeddings", None)
        block = block if isinstance(block, nn.Module) else None
        in_block = {id(m) for m in block.modules()} if block is not None else set()
        head = tuple(
            (name, child)
            for name, child in model.named_children()
            if child is not base and any(True for _ in child.parameters())
        )
        in_head = {id(m) for _, child in head for m in child.modules()}
        elsewhere = in_block | in_layers | in_head
        loose = tuple(e for e in embeddings if id(e) not in elsewhere)
        kind = _attention_kind(layers[0], config)
        return cls(
            model=model,
            family=str(getattr(config, "model_type", type(model).__name__)),
            layers=layers,
            embeddings=embeddings,
            embedding_modules=((block,) if block is not None else ()) + loose,
            head=head,
            linear_names=_linear_names(model),
            attention_implementation=str(getattr(config, "_attn_implementation", None) or "eager"),
            attention=kind,
            pooling="last" if kind == "causal" else "first",
            shapes=tuple(_layer_shape(layer, i, config, kind) for i, layer in enumerate(layers)),
            # a decoder's score reads the last state as it is
            dropout=config_dropouts(config, head_dropout=kind != "causal"),
            vocab_size=int(config.vocab_size),
            pad_token_id=getattr(config, "pad_token_id", None),
        )

    @property
    def word_embeddings(self) -> nn.Module:
        """The input (token) embedding."""
        return self.model.get_input_embeddings()

    @property
    def head_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.head)

    def layer_of(self) -> dict[int, int]:
        """id(parameter) -> the index of the layer holding it, for the parameters in layers."""
        return {id(p): i for i, layer in enumerate(self.layers) for p in layer.parameters()}


def unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a peft wrapper (``get_base_model``), else the model."""
    from transformers import PreTrainedModel  # deferred: heavy; this module works on any nn.Module

    if isinstance(model, PreTrainedModel) or not callable(getattr(model, "get_base_model", None)):
        return model
    return model.get_base_model()


def hugging_face_models(module: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models in ``module`` (itself, or ones it holds: a LightningModule's,
    a peft wrapper's)."""
    from transformers import PreTrainedModel  # deferred: heavy; this module works on any nn.Module

    models: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, PreTrainedModel) and id(sub) not in inside:
            models.append(sub)
            inside.update(id(m) for m in sub.modules())
    return models


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks: the longest ``ModuleList`` of transformers'
    `GradientCheckpointingLayer` blocks, else the one as long as ``num_hidden_layers``."""
    try:  # deferred: heavy; this module works on any nn.Module
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers before 4.52: no common base class for layers
        GradientCheckpointingLayer = None
    lists = [m for m in model.base_model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if GradientCheckpointingLayer is not None:
        blocks = [m for m in lists if all(isinstance(layer, GradientCheckpointingLayer) for layer in m)]
        if blocks:
            return max(blocks, key=len)
    n = getattr(model.config, "num_hidden_layers", None)
    for found in lists:
        if len(found) == n:
            return found
    if n and any(len(m) < n for m in lists):  # ALBERT: one layer module run num_hidden_layers times
        raise UserError(
            f"{type(model).__name__} shares its layers ({n} layers run fewer layer modules), which lit_memory does not "
            "support: its memory model, checkpointing plans and fused buckets are per layer module (docs/guide.md, "
            "Models)"
        )
    raise UserError(f"cannot find the transformer layers of {type(model).__name__}: no stack of {n} layers in it")


def parameter_units(module: nn.Module) -> list[list[torch.Tensor]]:
    """``module``'s parameters in units that step together under the fused step's ``layer`` buckets,
    in the module's parameter order: each transformer layer of every Hugging Face model it holds
    (`Anatomy.layers`), and every other module's own parameters (each embedding, norm, pooler,
    classifier, or a plain module's). What `lit_memory.fused.group_parameters` is given."""
    key: dict[int, int] = {}
    for model in hugging_face_models(module):
        try:
            layers = find_layers(model)
        except UserError:  # no stack of layers: its modules are the units
            continue
        for layer in layers:
            key.update((id(p), id(layer)) for p in layer.parameters())
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            key.setdefault(id(p), id(sub))
    units: dict[int, list[torch.Tensor]] = {}
    for p in module.parameters():
        units.setdefault(key[id(p)], []).append(p)
    return list(units.values())


# -- reading the parts ------------------------------------------------------------------------------


def _unique_embeddings(model: nn.Module) -> tuple[nn.Embedding, ...]:
    seen: set[int] = set()
    found = []
    for module in model.modules():
        if isinstance(module, nn.Embedding) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            found.append(module)
    return tuple(found)


_PEFT_INNER = ("base_layer", "original_module")  # where peft's wrappers keep the module they wrap


def _linear_names(model: nn.Module) -> tuple[str, ...]:
    names = set()
    for name, module in model.named_modules():
        if not name or not isinstance(module, linear_types()):
            continue
        path = [part for part in name.split(".") if part not in _PEFT_INNER]
        if any(part.startswith("lora_") or part == "modules_to_save" for part in path):
            continue  # peft's adapters and its trained copies of modules_to_save
        names.add(path[-1])
    return tuple(sorted(names))


def config_value(config, names: tuple[str, ...], default=None):
    """The value of the first of ``names`` the config sets (families name one quantity differently), else
    ``default``."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _attention_kind(layer: nn.Module, config) -> AttentionKind:
    if any(getattr(m, "is_causal", False) is True for m in layer.modules()):
        return "causal"
    if getattr(config, "relative_attention", False) and getattr(config, "pos_att_type", None):
        return "disentangled"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "global_local"
    return "bidirectional"


def _layer_shape(layer: nn.Module, index: int, config, kind: AttentionKind) -> LayerShape:
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    ffn = int(config_value(config, FFN_NAMES, 4 * hidden))
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = index < len(layer_types) and layer_types[index] == "sliding_attention"
    return LayerShape(
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        mlp=mlp_kind(layer, hidden, ffn),
        activation=str(config_value(config, ACTIVATION_NAMES, "gelu")),
        norm="rmsnorm" if any("rmsnorm" in type(m).__name__.lower() for m in layer.modules()) else "layernorm",
        attention=kind,
        window=getattr(config, "sliding_window", None) if sliding else None,
    )


def mlp_kind(layer: nn.Module, hidden: int, ffn: int) -> MlpKind:
    """Gated when the layer projects the hidden state up twice (gate and up), or once to twice the
    inner width (a fused gate+up, ModernBERT's Wi); a dense MLP projects up once."""
    ups = [in_out(m) for m in layer.modules() if isinstance(m, linear_types())]
    up = sum(1 for i, o in ups if i == hidden and o == ffn)
    fused = any(i == hidden and o == 2 * ffn for i, o in ups)
    return "gated" if up >= 2 or fused else "dense"


def config_dropouts(config, head_dropout: bool) -> Dropout:
    """The dropout probabilities the config sets, under each family's names; the classifier's only with
    ``head_dropout``."""
    hidden = float(config_value(config, HIDDEN_DROPOUT_NAMES, 0.0))
    return Dropout(
        hidden=hidden,
        attention=float(config_value(config, ATTENTION_DROPOUT_NAMES, 0.0)),
        embedding=float(config_value(config, EMBEDDING_DROPOUT_NAMES, hidden)),
        classifier=float(config_value(config, CLASSIFIER_DROPOUT_NAMES, hidden)) if head_dropout else 0.0,
    )


def skeleton(config) -> Anatomy:
    """The anatomy of the sequence classifier ``config`` describes, built on the ``meta`` device
    (no memory, no weights: tens of milliseconds), to check settings against the model's parts
    before anything is built or written."""
    from transformers import AutoModelForSequenceClassification  # deferred: heavy; this module works on any nn.Module

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return Anatomy.of(model)
