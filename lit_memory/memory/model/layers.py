"""What one transformer layer keeps for backward: a function of a small description of the layer.

`LayerSpec` says what a layer is (sizes, the feed-forward and norm kinds, its dropouts, how attention is
computed); `Shape` says how it runs (batch, length, the precision, the device);
`Kernel` (`lit_memory.memory.hardware.kernels`) which attention kernel torch picks. From the three, `layer_tensors`
lists, per token and in the order the forward pass makes them, the tensors a layer keeps for backward and
the temporaries it frees on the way; `layer_bytes_per_token` and its siblings sum them. A model family adds
its own ``ffn``/``norm`` kind here, and reads it from the model in
`lit_memory.planning.prediction.activation_model.layer_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from lit_memory.memory.hardware.kernels import AttentionBytes, Kernel, attention_bytes, attention_tensors
from lit_memory.settings import Precision

NORM_STATS = {"layernorm": 8, "rmsnorm": 4}  # fp32 mean and rstd per token, or rstd alone


@dataclass(frozen=True)
class LayerSpec:
    """One transformer layer as far as its saved tensors go (post-norm, BERT-style by default; the fields
    after ``qkv_fused`` describe the other families and default to BERT's)."""

    hidden: int
    ffn: int
    heads: int
    ffn_kind: Literal["mlp", "gated"] = "mlp"  # in -> activation -> out; or activation(gate) * up -> down
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norms: int = 2  # norms over the hidden state (Gemma3's sandwich: 4)
    hidden_dropouts: int = 2  # dropouts on the residual branches (BERT: after attention and after the FFN)
    attention_dropout: bool = True
    implementation: str = "sdpa"  # transformers' attn_implementation
    qkv_fused: bool = False  # q, k and v from one projection
    q_width: int = 0  # heads x head dim where it is not the hidden size (Qwen3); 0: hidden
    kv_width: int = 0  # k and v: kv heads x head dim, narrower with grouped-query attention; 0: q's width
    activation_saves: int = 1  # tensors as wide as its input the FFN activation keeps (exact GELU, SiLU: its input)
    pre_norm: bool = False  # a norm before attention and before the FFN, none after (GPT-2, Llama, ModernBERT)
    head_norms: bool = False  # q and k normalised per head before attention (Qwen3, Gemma3)
    rotary: bool = False  # q and k rotated (copies) before attention
    relative: tuple[str, ...] = ()  # DeBERTa's disentangled score terms ("c2p", "p2c")
    relative_span: int = 0  # the relative positions those terms cover (2 x the attention span)
    window: bool = False  # a sliding-window layer: attention always gets a mask

    @property
    def q_wide(self) -> int:
        return self.q_width or self.hidden

    @property
    def kv_wide(self) -> int:
        return self.kv_width or self.q_wide

    @property
    def head_dim(self) -> int:
        return self.q_wide // self.heads

    @property
    def kv_heads(self) -> int:
        return self.kv_wide // self.head_dim


def activation_saves(activation) -> int:
    """How many tensors as wide as its input ``activation`` keeps for backward (its input among them), read
    from autograd's saved tensors on a small input: 1 for a fused kernel (exact GELU, SiLU, torch's tanh
    GELU), 4 for GPT-2's tanh GELU written out in Python (its input, tanh's output, 0.5x and 1 + tanh)."""
    x = torch.randn(2, 8, requires_grad=True)
    kept: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == x.numel():
            kept.add(t.untyped_storage().data_ptr())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = activation(x)  # noqa: F841 - alive while the storages are counted
    except (TypeError, RuntimeError):  # not a one-tensor elementwise function: count it as a fused kernel
        return 1
    return max(len(kept), 1)


@dataclass(frozen=True)
class Shape:
    """How a layer runs: batch, sequence length, the precision (its dtypes' bytes below), device."""

    batch: int
    length: int
    precision: Precision
    cuda: bool
    token_types: bool = True
    masked: bool = True  # a padding mask reaches attention (some token padded)
    softmax_keeps_input: bool = False  # torch < 1.11 (`lit_memory.memory.hardware.kernels.attention_tensors`)

    @property
    def param_b(self) -> int:
        """Bytes of weights, gradients, the residual stream and LayerNorm inputs."""
        return self.precision.param.itemsize

    @property
    def compute_b(self) -> int:
        """Bytes of linear outputs: 2 under autocast or with 16-bit weights."""
        return self.precision.compute.itemsize

    @property
    def autocast(self) -> bool:
        return self.precision.autocast

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
        spec.implementation, shape.cuda, capability, shape.precision.compute, spec.head_dim, spec.attention_dropout,
        training, shape.masked,
    )


def attention(spec: LayerSpec, shape: Shape, k: Kernel, training: bool = True) -> AttentionBytes:
    return attention_bytes(
        k, spec.q_wide, spec.heads, shape.length, shape.compute_b, spec.attention_dropout and training,
        shape.autocast, shape.masked, shape.softmax_keeps_input, _kv_kept(spec, shape, k), shape.mask_b,
    )


def _kv_kept(spec: LayerSpec, x: Shape, k: Kernel) -> int:
    """The width of k and v as attention receives them: transformers repeats grouped-query k/v to every
    head for eager attention, and for SDPA wherever it passes a mask (padding, a sliding window:
    ``use_gqa_in_sdpa``). On the CPU only a window's mask counts: the CPU's prediction is of the unpadded
    batch `lit_memory.planning.prediction.simulate.measure` runs, where the other layers get no mask."""
    padded = x.masked and not k.name.startswith("cpu-")
    if spec.kv_wide < spec.q_wide and (k.name == "eager" or padded or spec.window):
        return spec.q_wide
    return spec.kv_wide


@dataclass(frozen=True)
class Tensor:
    """A tensor of a layer's forward pass, per token: ``kept`` for backward, else freed once used."""

    name: str
    bytes: int
    kept: bool = True


def norm_tensors(name: str, spec: LayerSpec, x: Shape, first: bool = False) -> list[Tensor]:
    """A norm over the hidden state: LayerNorm keeps its input and fp32 mean and rstd; transformers'
    RMSNorm (written out in Python) its fp32 input, the rstd and the normalised values the weight
    multiplies. ``first``: a pre-norm layer's first norm, whose input is the layer's input."""
    h, p = spec.hidden, x.param_b
    rms = spec.norm == "rmsnorm"
    out = [Tensor("input" if first else f"{name}_in", h * p)]
    if rms and p < 4:  # the fp32 copy it computes in
        out.append(Tensor(f"{name}_f32", h * 4))
    out.append(Tensor(f"{name}_stats", NORM_STATS[spec.norm]))
    if rms:
        out.append(Tensor(f"{name}_normed", h * p))
    return out


def _attention_tensors(spec: LayerSpec, x: Shape, k: Kernel, trains: bool) -> list[Tensor]:
    """q, k, v (after any per-head norms and rotation) and what the kernel makes, to the output the next
    projection reads."""
    c, m, qw, kvw = x.compute_b, x.mask_b, spec.q_wide, spec.kv_wide
    out: list[Tensor] = []
    if spec.head_norms:  # per-head RMSNorm of q and k: each keeps its (fp32) input, rstd and normalised values
        for n, width, heads in (("q", qw, spec.heads), ("k", kvw, spec.kv_heads)):
            out += [
                Tensor(f"{n}_proj", width * max(c, 4)),
                Tensor(f"{n}_norm_stats", 4 * heads),
                Tensor(f"{n}_normed", width * c),
            ]
    if spec.relative:
        return out + _relative_tensors(spec, x)
    tensors = attention_tensors(
        k, qw, spec.heads, x.length, c, spec.attention_dropout, x.autocast, x.masked, x.softmax_keeps_input,
        _kv_kept(spec, x, k), m,
    )
    for name, size, kept in tensors:
        if name == "v" and kept and k.fused and spec.qkv_fused and spec.rotary:
            # v, a view of the fused projection's output, keeps all of it (q and k are rotated copies)
            size = (qw + 2 * kvw) * c
        out.append(Tensor(name, size, kept=kept and (trains or name != "output_copy")))
    return out


def _relative_tensors(spec: LayerSpec, x: Shape) -> list[Tensor]:
    """DeBERTa's disentangled attention (eager): q and a scaled copy of k for the content scores; per
    relative term (c2p, p2c) the relative embeddings' projection repeated over the batch (``span x h`` per
    sequence), its scores against q or k before the gather (``heads x span`` per token) and the gather's
    int64 index (``length^2`` per layer); then softmax, dropout and the product with v as eager attention."""
    h, c, m, s, b = spec.hidden, x.compute_b, x.mask_b, x.length, x.batch
    probs = spec.heads * s
    out = [Tensor("q", h * c), Tensor("k", h * c, kept="p2c" in spec.relative), Tensor("k_scaled", h * c)]
    out.append(Tensor("v", h * c))
    out.append(Tensor("scores", probs * c, kept=False))
    for term in spec.relative:
        out += [
            Tensor(f"{term}_positions", -(-spec.relative_span * h * c // s)),
            Tensor(f"{term}_scores", spec.heads * spec.relative_span * c),
            Tensor(f"{term}_index_mask", -(-8 * s // b)),
            Tensor(f"{term}_gathered", probs * c, kept=False),
        ]
    out.append(Tensor("probabilities", probs * c))
    if spec.attention_dropout:
        out += [Tensor("dropout_mask", probs * m), Tensor("dropped", probs * c)]
    return out + [Tensor("output", h * c, kept=False), Tensor("output_copy", h * c)]


def layer_tensors(spec: LayerSpec, x: Shape, k: Kernel, lora: Optional[tuple[int, int]] = None) -> list[Tensor]:
    """A layer's forward pass, per token, in order (see the module docstring). The layer's input is the
    previous layer's output: listed (``input``) only where the layer keeps it (no autocast, or a pre-norm
    layer's first norm). A pre-norm layer names its norm before the FFN ``norm_1`` as a post-norm layer
    names its norm after attention: what follows it is the FFN's."""
    h, f, c, p, m = spec.hidden, spec.ffn, x.compute_b, x.param_b, x.mask_b
    trains = lora is None  # frozen projections (LoRA's base) keep no input for a weight gradient
    sandwich = spec.pre_norm and spec.norms >= 4  # norms after attention and the FFN too (Gemma3)
    out: list[Tensor] = []
    if spec.pre_norm:
        out += norm_tensors("norm_0", spec, x, first=True)
    # q, k, v projections: under autocast each casts its input (one copy per projection); without, they keep it.
    if not trains:
        adapters, rank = lora
        out.append(Tensor("lora", adapters * (h * (c + m) + rank * c)))
    elif x.autocast:
        out += [Tensor(f"{n}_in", h * c) for n in (("qkv",) if spec.qkv_fused else ("q", "k", "v"))]
    else:
        out.append(Tensor("qkv_in" if spec.pre_norm else "input", h * p))
    # q, k, v and what the kernel makes; a copy of the output feeds the output projection (eager, math)
    out += _attention_tensors(spec, x, k, trains)
    out.append(Tensor("attention_dense", h * c, kept=sandwich))
    if sandwich:
        out += norm_tensors("post_attention_norm", spec, x)[1:]
    if spec.hidden_dropouts >= 2:
        out += [Tensor("dropout_1", h * m), Tensor("dropped_1", h * c, kept=False)]
    out += norm_tensors("norm_1", spec, x)
    # the FFN: its input (cast under autocast), intermediate(s), activation output (the down projection's input)
    out.append(Tensor("ffn_in", h * (c if x.autocast else p), kept=trains))
    extra = [Tensor(f"activation_{i}", f * c) for i in range(1, spec.activation_saves)]  # a composite activation's
    if spec.ffn_kind == "gated":
        out += [Tensor("gate", f * c), *extra, Tensor("up", f * c), Tensor("act", f * c)]
        out.append(Tensor("ffn_hidden", f * c, kept=trains))
    else:
        out += [Tensor("ffn_hidden", f * c), *extra, Tensor("act", f * c, kept=trains)]
    out.append(Tensor("ffn_out", h * c, kept=sandwich))
    if sandwich:
        out += norm_tensors("post_ffn_norm", spec, x)[1:]
    if spec.hidden_dropouts >= 1:
        out += [Tensor("dropout_2", h * m), Tensor("dropped_2", h * c, kept=False)]
    if spec.norms >= 2 and not spec.pre_norm:
        out += norm_tensors("norm_2", spec, x)
    return out


def layer_bytes_per_token(spec: LayerSpec, x: Shape, k: Kernel, lora: Optional[tuple[int, int]] = None) -> int:
    """Bytes one layer keeps for backward, per token: `layer_tensors` summed.

    With h hidden, f FFN size, c compute bytes (2 under autocast), p parameter bytes, m dropout-mask bytes
    (1 on CUDA, c on CPU), for BERT with a fused SDPA kernel: three cast copies of the input under autocast
    (``3h*c``; without autocast the input itself, ``h*p``), q/k/v and the kernel's output ``4h*c`` plus its
    log-sum-exp and mask bias (`lit_memory.memory.hardware.kernels`), two dropout masks ``2h*m``, two LayerNorm inputs
    ``2h*p`` and their statistics, the FFN's input ``h*c`` (``h*p`` without autocast), intermediate and GELU
    output ``2f*c``. With LoRA (``lora = (adapters per layer, rank)``) the frozen projections keep no input for
    a weight gradient: each adapter keeps its dropped-out input, its dropout noise and its rank-wide output."""
    return sum(t.bytes for t in layer_tensors(spec, x, k, lora) if t.kept)


def selective_bytes_per_token(spec: LayerSpec, x: Shape, k: Kernel, lora: Optional[tuple[int, int]] = None) -> int:
    """Bytes selective checkpointing keeps per layer per token besides the layer's input
    (`lit_memory.run.activation_checkpointing.selective_policy`): the outputs of the six linear layers (Q, K, V,
    attention output, FFN in and out), ``(5h + f) * c`` for BERT (q, k, v at their widths; gated FFN: one
    more ``f*c``), and, where a fused attention kernel runs without dropout, its output and log-sum-exp. An
    attention kernel with dropout is recomputed (it draws random numbers), as is eager or math attention.
    With LoRA each adapter also keeps its two matmul outputs, ``adapters * (r + h) * c``."""
    h, f, c = spec.hidden, spec.ffn, x.compute_b
    # q, k and v as wide as their heads (grouped-query k/v narrower), the attention and FFN outputs
    saved = (spec.q_wide + 2 * spec.kv_wide + 2 * h + f * (2 if spec.ffn_kind == "gated" else 1)) * c
    if k.fused and not spec.attention_dropout:
        saved += spec.q_wide * c + 4 * spec.heads
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


def forward_temp_per_token(spec: LayerSpec, x: Shape, k: Kernel, lora: Optional[tuple[int, int]] = None) -> int:
    """Temporaries of a layer's forward on top of what it keeps, per token: two of the hidden size (a branch's
    output and its residual sum); with DeBERTa's relative attention, its content scores and a gathered
    relative term being added into them (each ``heads x length``), where larger."""
    if not spec.relative:
        return 2 * spec.hidden * x.compute_b
    sizes = {t.name: t.bytes for t in layer_tensors(spec, x, k, lora)}
    return max(2 * spec.hidden * x.compute_b, sizes["scores"] + sizes[f"{spec.relative[0]}_gathered"])


def backward_temp_per_token(spec: LayerSpec, x: Shape, k: Kernel) -> int:
    """Gradients w.r.t. activations in flight in a layer's backward, beyond its saved tensors: at its start
    the FFN intermediate's and two hidden-size ones; at its attention, the kernel's backward, by when the
    FFN's saved tensors (made after the first LayerNorm) are released. The larger of the two."""
    tensors = layer_tensors(spec, x, k)
    after = next(i for i, t in enumerate(tensors) if t.name == "norm_1_stats") + 1
    ffn_saved = sum(t.bytes for t in tensors[after:] if t.kept)
    att = attention(spec, x, k)
    return max((spec.ffn + 2 * spec.hidden) * x.compute_b, att.backward + spec.hidden * x.compute_b - ffn_saved)
