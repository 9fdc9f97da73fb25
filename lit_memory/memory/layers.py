"""What one transformer layer keeps for backward: a function of a small description of the layer.

`LayerSpec` says what a layer is (sizes, the feed-forward and norm kinds, its dropouts, how attention is
computed); `Shape` says how it runs (batch, length, the bytes of each precision, autocast, the device);
`Kernel` (`lit_memory.memory.kernels`) which attention kernel torch picks. From the three, `layer_tensors`
lists, per token and in the order the forward pass makes them, the tensors a layer keeps for backward and
the temporaries it frees on the way. The analytic model sums them (`layer_bytes_per_token`); the allocator
replay (`lit_memory.memory.program`) allocates and frees them in order. A model family adds its own
`LayerSpec.of` reading, or a ``ffn``/``norm`` kind, here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from torch import nn

from lit_memory.memory.kernels import AttentionBytes, Kernel, attention_bytes, attention_tensors

FFN_KINDS = ("mlp", "gated")  # in -> activation -> out; gate and up -> activation(gate) * up -> down
NORM_KINDS = ("layernorm", "rmsnorm")
NORM_STATS = {"layernorm": 8, "rmsnorm": 4}  # fp32 mean and rstd per token, or rstd alone


@dataclass(frozen=True)
class LayerSpec:
    """One transformer layer as far as its saved tensors go (post-norm, BERT-style by default)."""

    hidden: int
    ffn: int
    heads: int
    ffn_kind: str = "mlp"
    norm: str = "layernorm"
    norms: int = 2
    hidden_dropouts: int = 2  # dropouts on the residual branches (BERT: after attention and after the FFN)
    attention_dropout: bool = True
    implementation: str = "sdpa"  # transformers' attn_implementation
    qkv_fused: bool = False  # q, k and v from one projection

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def of(cls, layer: nn.Module, config) -> "LayerSpec":
        """Read from the Hugging Face config and the layer's modules: how many dropouts with p > 0 the
        residual branches have, how many norms, whether the FFN is gated, whether q/k/v are one matrix."""
        h = config.hidden_size
        attention_p = float(getattr(config, "attention_probs_dropout_prob", getattr(config, "attention_dropout", 0)) or 0)
        dropouts = sum(1 for m in layer.modules() if isinstance(m, nn.Dropout) and m.p > 0 and not _in_lora(layer, m))
        norms = [m for m in layer.modules() if "norm" in type(m).__name__.lower()]
        linears = [m for name, m in layer.named_modules() if isinstance(m, nn.Linear) and "lora_" not in name]
        outputs = {m.out_features for m in linears}
        return cls(
            hidden=h,
            ffn=getattr(config, "intermediate_size", None) or 4 * h,
            heads=config.num_attention_heads,
            ffn_kind="gated" if len(linears) >= 7 else "mlp",
            norm="rmsnorm" if norms and all("rms" in type(m).__name__.lower() for m in norms) else "layernorm",
            norms=len(norms) or 2,
            hidden_dropouts=max(dropouts - (1 if attention_p > 0 else 0), 0),
            attention_dropout=attention_p > 0,
            implementation=getattr(config, "_attn_implementation", None) or "sdpa",
            qkv_fused=3 * h in outputs,
        )


def _in_lora(layer: nn.Module, module: nn.Module) -> bool:
    return any(m is module for name, m in layer.named_modules() if "lora_" in name)


@dataclass(frozen=True)
class Shape:
    """How a layer runs: batch, sequence length, precision bytes, device."""

    batch: int
    length: int
    param_b: int  # bytes of weights, gradients, the residual stream and LayerNorm inputs
    compute_b: int  # bytes of linear outputs: 2 under autocast or with 16-bit weights
    autocast: bool
    cuda: bool
    token_types: bool = True
    masked: bool = True  # a padding mask reaches attention (some token padded)
    softmax_keeps_input: bool = False  # torch < 1.11 (`lit_memory.memory.kernels.attention_tensors`)

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    @property
    def mask_b(self) -> int:
        """Dropout keeps a 1-byte mask on CUDA, a noise tensor as wide as its input on CPU."""
        return 1 if self.cuda else self.compute_b


def batch_bytes(shape: Shape) -> int:
    """input_ids, attention_mask (and token_type_ids) as int64, plus the labels."""
    inputs = 3 if shape.token_types else 2
    return 8 * shape.batch * (inputs * shape.length + 1)


def kernel(spec: LayerSpec, shape: Shape, capability: tuple[int, int], training: bool = True) -> Kernel:
    return Kernel.of(
        spec.implementation, shape.cuda, capability, shape.compute_b, spec.head_dim, spec.attention_dropout,
        training, shape.masked,
    )


def attention(spec: LayerSpec, shape: Shape, k: Kernel, training: bool = True) -> AttentionBytes:
    return attention_bytes(
        k, spec.hidden, spec.heads, shape.length, shape.compute_b, spec.attention_dropout and training,
        shape.autocast, shape.masked, shape.softmax_keeps_input,
    )


@dataclass(frozen=True)
class Tensor:
    """A tensor of a layer's forward pass, per token: ``kept`` for backward, else freed once used."""

    name: str
    bytes: int
    kept: bool = True


def layer_tensors(spec: LayerSpec, x: Shape, k: Kernel, lora: Optional[tuple[int, int]] = None) -> list[Tensor]:
    """A layer's forward pass, per token, in order (see the module docstring). The layer's input is the
    previous layer's output: listed (``input``) only where the layer keeps it (no autocast)."""
    h, f, c, p, m = spec.hidden, spec.ffn, x.compute_b, x.param_b, x.mask_b
    trains = lora is None  # frozen projections (LoRA's base) keep no input for a weight gradient
    out: list[Tensor] = []
    # q, k, v projections: under autocast each casts the layer input (one copy per projection); without, they keep it.
    if not trains:
        adapters, rank = lora
        out.append(Tensor("lora", adapters * (h * (c + m) + rank * c)))
    elif x.autocast:
        out += [Tensor(f"{n}_in", h * c) for n in (("qkv",) if spec.qkv_fused else ("q", "k", "v"))]
    else:
        out.append(Tensor("input", h * p))
    for name, size, kept in attention_tensors(
        k, h, spec.heads, x.length, c, spec.attention_dropout, x.autocast, x.masked, x.softmax_keeps_input
    ):  # q, k, v and what the kernel makes; a copy of the output feeds the output projection (eager, math)
        out.append(Tensor(name, size, kept=kept and (trains or name != "output_copy")))
    out.append(Tensor("attention_dense", h * c, kept=False))
    if spec.hidden_dropouts >= 2:
        out += [Tensor("dropout_1", h * m), Tensor("dropped_1", h * c, kept=False)]
    out += [Tensor("norm_1_in", h * p), Tensor("norm_1_stats", NORM_STATS[spec.norm])]
    # the FFN: its input (cast under autocast), intermediate(s), activation output (the down projection's input)
    out.append(Tensor("ffn_in", h * (c if x.autocast else p), kept=trains))
    if spec.ffn_kind == "gated":
        out += [Tensor("gate", f * c), Tensor("up", f * c), Tensor("act", f * c), Tensor("ffn_hidden", f * c, kept=trains)]
    else:
        out += [Tensor("ffn_hidden", f * c), Tensor("act", f * c, kept=trains)]
    out.append(Tensor("ffn_out", h * c, kept=False))
    if spec.hidden_dropouts >= 1:
        out += [Tensor("dropout_2", h * m), Tensor("dropped_2", h * c, kept=False)]
    if spec.norms >= 2:
        out += [Tensor("norm_2_in", h * p), Tensor("norm_2_stats", NORM_STATS[spec.norm])]
    return out


def layer_bytes_per_token(spec: LayerSpec, x: Shape, k: Kernel, lora: Optional[tuple[int, int]] = None) -> int:
    """Bytes one layer keeps for backward, per token: `layer_tensors` summed.

    With h hidden, f FFN size, c compute bytes (2 under autocast), p parameter bytes, m dropout-mask bytes
    (1 on CUDA, c on CPU), for BERT with a fused SDPA kernel: three cast copies of the input under autocast
    (``3h*c``; without autocast the input itself, ``h*p``), q/k/v and the kernel's output ``4h*c`` plus its
    log-sum-exp and mask bias (`lit_memory.memory.kernels`), two dropout masks ``2h*m``, two LayerNorm inputs
    ``2h*p`` and their statistics, the FFN's input ``h*c`` (``h*p`` without autocast), intermediate and GELU
    output ``2f*c``. With LoRA (``lora = (adapters per layer, rank)``) the frozen projections keep no input for
    a weight gradient: each adapter keeps its dropped-out input, its dropout noise and its rank-wide output."""
    return sum(t.bytes for t in layer_tensors(spec, x, k, lora) if t.kept)


def selective_bytes_per_token(spec: LayerSpec, x: Shape, k: Kernel, lora: Optional[tuple[int, int]] = None) -> int:
    """Bytes selective checkpointing keeps per layer per token besides the layer's input
    (`lit_memory.activations.selective_policy`): the outputs of the six linear layers (Q, K, V,
    attention output, FFN in and out), ``(5h + f) * c`` (gated FFN: one more ``f*c``), and, where a fused
    attention kernel runs without dropout, its output and log-sum-exp. An attention kernel with dropout is
    recomputed (it draws random numbers), as is eager or math attention. With LoRA each adapter also keeps
    its two matmul outputs, ``adapters * (r + h) * c``."""
    h, f, c = spec.hidden, spec.ffn, x.compute_b
    saved = (5 * h + f * (2 if spec.ffn_kind == "gated" else 1)) * c
    if k.fused and not spec.attention_dropout:
        saved += h * c + 4 * spec.heads
    if lora is not None:
        adapters, rank = lora
        saved += adapters * (rank + h) * c
    return saved


def working_set_per_token(spec: LayerSpec, x: Shape, k: Kernel, training: bool = True) -> int:
    """Bytes per token a layer holds at once when it saves nothing (a checkpointed forward, inference):
    the attention block (q, k, v and what the kernel makes) or the FFN (its input, the intermediate and its
    activation), whichever is larger."""
    attention_block = attention(spec, x, k, training).saved
    ffn = (2 * spec.ffn * (2 if spec.ffn_kind == "gated" else 1) + spec.hidden) * x.compute_b
    return max(attention_block, ffn)


def backward_temp_per_token(spec: LayerSpec, x: Shape, k: Kernel) -> int:
    """Gradients w.r.t. activations in flight in a layer's backward, beyond its saved tensors: at its start
    the FFN intermediate's and two hidden-size ones; at its attention, the kernel's backward, by when the
    FFN's saved tensors (made after the first LayerNorm) are released. The larger of the two."""
    tensors = layer_tensors(spec, x, k)
    after = next(i for i, t in enumerate(tensors) if t.name == "norm_1_stats") + 1
    ffn_saved = sum(t.bytes for t in tensors[after:] if t.kept)
    att = attention(spec, x, k)
    return max((spec.ffn + 2 * spec.hidden) * x.compute_b, att.backward + spec.hidden * x.compute_b - ffn_saved)


def with_implementation(spec: LayerSpec, implementation: str) -> LayerSpec:
    return replace(spec, implementation=implementation)
