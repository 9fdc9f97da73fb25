"""Which attention kernel a training step runs, and what it keeps for backward.

transformers computes attention one of two ways (``config._attn_implementation``): ``eager`` (matmul,
softmax, dropout, matmul, written out in Python) or ``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``),
its default wherever the model supports it (``_supports_sdpa``); ``model.config_overrides.attn_implementation``
picks one. SDPA then runs one of torch's kernels, chosen at run time (``sdp_utils.cpp``, "SDPA Runtime
Dispatch"), in priority order, the first whose constraints hold:

- **flash** (FlashAttention-2): CUDA sm80-sm121, fp16/bf16 inputs, head dim <= 256 (and not (192, 224], nor
  (224, 256] with dropout, when training on sm86/sm89/sm120), no ``attn_mask``;
- **efficient** (memory-efficient, CUTLASS): CUDA sm50-sm121, fp32/fp16, bf16 only from sm80
  (``can_use_mem_efficient_attention``: below sm80 its dtypes are {fp16, fp32}), head dim a multiple of the
  GEMM alignment (8 for 16-bit inputs on tensor cores, 4 for fp32 from sm80), takes a mask;
- **math**: anything else (fp64, odd head dims, older GPUs, bf16 below sm80: a bf16 recipe on a T4 or V100);
  it computes 16-bit inputs in fp32 (torch >= 2.5, ``allow_fp16_bf16_reduction_math_sdp`` off by default).

cuDNN attention, first on sm90/sm100 with recent cuDNN builds, keeps what flash keeps. transformers passes
no mask when no token is padded (`Kernel.of` assumes padding, the common case and the larger).

On the CPU, SDPA runs a fused kernel without dropout and the math kernel with it (the CPU prediction and the
simulation: ``--device cpu``).

What each keeps for backward, per token of one layer (h hidden, a heads, s the sequence length, c the
inputs' bytes, L = s rounded up as the kernel pads it):

| kernel | saved | backward adds |
|---|---|---|
| flash / efficient / cuDNN | q, k, v, the output: ``4h*c``; a fp32 log-sum-exp per head: ``4a``; efficient with a
padding mask: the mask as a ``c``-byte bias, ``L*c`` | dq, dk, dv ``3h*c``; flash a fp32 dq accumulator ``4h`` |
| math (CUDA) | fp32 scaled q, k and fp32 v ``12h``; fp32 probabilities ``4as``; with dropout its 1-byte mask and the
fp32 dropped probabilities ``5as`` | two fp32 ``a*s`` gradients |
| eager | q, k, v ``3h*c``; the softmax output (fp32 under autocast) ``as*sm``; with dropout its mask ``as`` and the
dropped probabilities as the second matmul saves them (a 16-bit copy under autocast); before torch 1.11 the softmax
input too | two ``a*s`` gradients |

The fused kernels (CPU's too) return their output laid out (batch, length, heads, dim), as their inputs are
(torch's meta kernels: ``empty_like(query)``), so transformers' ``transpose(1, 2).contiguous()`` costs nothing and the
output projection keeps the kernel's own output; eager and math outputs are copied there (``h*c``, counted with the
linear inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FUSED = ("flash", "efficient", "cudnn")
KERNELS = (*FUSED, "math", "eager", "cpu-fused", "cpu-math")


@dataclass(frozen=True)
class Kernel:
    """The attention kernel of a step and the bytes per value of the tensors it keeps."""

    name: str  # one of KERNELS
    reason: str  # why this one, in words

    @property
    def fused(self) -> bool:
        return self.name in FUSED or self.name == "cpu-fused"

    @classmethod
    def of(
        cls,
        implementation: str,
        cuda: bool,
        capability: tuple[int, int],
        dtype: torch.dtype,
        head_dim: int,
        dropout: bool,
        training: bool = True,
        masked: bool = True,
    ) -> "Kernel":
        """The kernel torch runs for these inputs (``implementation``: transformers' ``_attn_implementation``;
        ``dtype``: q, k and v's, a step's compute dtype: `lit_memory.settings.Precision.compute`)."""
        if implementation != "sdpa":
            why = "eager" if implementation == "eager" else f"{implementation!r} is predicted as eager"
            return cls("eager", why)
        dropout = dropout and training
        if not cuda:
            if dropout:
                return cls("cpu-math", "the CPU runs its math kernel for attention dropout")
            return cls("cpu-fused", "the CPU's fused kernel (no dropout)")
        half = dtype.itemsize == 2
        reasons = []
        if capability >= (8, 0) and half and head_dim <= 256 and head_dim % 8 == 0 and not masked:
            if training and (capability[:1] == (12,) or (8, 6) <= capability <= (8, 9)) and (
                192 < head_dim <= 224 or (head_dim > 224 and dropout)
            ):
                reasons.append("flash cannot train this head dim on this GPU")
            else:
                return cls("flash", "flash: 16-bit inputs on sm80+, no padding mask")
        elif not half:
            reasons.append("flash needs fp16/bf16")
        elif masked:
            reasons.append("flash takes no padding mask")
        elif capability < (8, 0):
            reasons.append("flash needs sm80+")
        alignment = _gemm_alignment(capability, half)
        if dtype == torch.bfloat16 and capability < (8, 0):
            reasons.append("memory-efficient takes bf16 only from sm80")
        elif capability >= (5, 0) and dtype.itemsize in (2, 4) and head_dim % alignment == 0:
            return cls("efficient", "memory-efficient: " + ("; ".join(reasons) or "preferred here"))
        return cls(
            "math", "math: no fused kernel takes these inputs (" + ", ".join(reasons or ["dtype/head dim"]) + ")"
        )


def _gemm_alignment(capability: tuple[int, int], half: bool) -> int:
    """``minimum_gemm_alignment`` in sdp_utils.cpp."""
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    alignment = 4 if capability >= (8, 0) else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


@dataclass(frozen=True)
class AttentionBytes:
    """Per token of one layer: what the attention keeps for backward, what its backward adds."""

    saved: int
    output_copied: bool  # transformers copies the output before the output projection (kept there)
    backward: int


def attention_tensors(
    kernel: Kernel,
    h: int,
    heads: int,
    s: int,
    c: int,
    dropout: bool,
    autocast: bool,
    masked: bool = True,
    softmax_keeps_input: bool = False,
    kv: Optional[int] = None,
    mask_b: int = 1,
) -> list[tuple[str, int, bool]]:
    """The attention's tensors per token of one layer, in the order it makes them, from q, k and v (the
    projections' outputs) to the output the next projection reads: (name, bytes, kept for backward).
    See the table in the module docstring. ``c``: bytes of q/k/v. ``softmax_keeps_input``: torch before
    1.11 kept softmax's input for backward too (pytorch#64000, fixed by pytorch#65242). ``h`` is the
    width of q and of the output (heads x head dim); ``kv`` that of k and v as the kernel receives them
    (narrower with grouped-query attention, unless transformers repeats them to every head: default ``h``).
    ``mask_b``: bytes per value of eager attention's dropout mask (1 on CUDA, the noise's ``c`` on the CPU)."""
    kv = h if kv is None else kv
    probs = heads * s  # values of the attention matrix per token
    qkv = [("q", h * c, True), ("k", kv * c, True), ("v", kv * c, True)]
    if kernel.fused:
        padded = -(-s // 32) * 32 if kernel.name == "efficient" else s  # efficient pads the log-sum-exp rows
        out = qkv[:]
        if kernel.name == "efficient" and masked:  # the bool padding mask becomes a c-byte bias, per call
            out.append(("bias", (-(-s // 16) * 16) * c, True))
        return out + [("output", h * c, True), ("logsumexp", 4 * heads * padded // s, True)]
    if kernel.name in ("math", "cpu-math"):
        f32 = 4 if kernel.name == "math" else max(c, 4)
        out = [("q", h * c, False), ("k", kv * c, False), ("v", kv * c, f32 == c)]
        if f32 != c:  # 16-bit inputs computed in fp32
            out += [("q_f32", h * f32, False), ("k_f32", kv * f32, False), ("v_f32", kv * f32, True)]
        out += [("q_scaled", h * f32, True), ("k_scaled", kv * f32, True), ("scores", probs * f32, False)]
        out.append(("probabilities", probs * f32, True))
        if dropout:  # CPU dropout keeps a noise tensor as wide as the probabilities; CUDA a 1-byte mask
            out += [
                ("dropout_mask", probs * (1 if kernel.name == "math" else f32), True),
                ("dropped", probs * f32, True),
            ]
        return out + [("output_f32", h * f32, False), ("output", h * c, False), ("output_copy", h * c, True)]
    # eager: softmax is on autocast's fp32 list; the second matmul keeps its own (16-bit under autocast) copy
    softmax = 4 if autocast else c
    out = qkv + [("scores", probs * c, False), ("scaled", probs * c, softmax_keeps_input and not masked)]
    if masked:  # + the additive mask, in the model's dtype (fp32 under autocast: the sum is promoted)
        out.append(("masked", probs * softmax, softmax_keeps_input))
    out.append(("probabilities", probs * softmax, True))
    if dropout:
        out += [("dropout_mask", probs * mask_b, True), ("dropped", probs * softmax, not autocast)]
    if autocast:
        out.append(("probabilities_16", probs * 2, True))
    return out + [("output", h * c, False), ("output_copy", h * c, True)]


def attention_bytes(
    kernel: Kernel,
    h: int,
    heads: int,
    s: int,
    c: int,
    dropout: bool,
    autocast: bool,
    masked: bool = True,
    softmax_keeps_input: bool = False,
    kv: Optional[int] = None,
    mask_b: int = 1,
) -> AttentionBytes:
    """`attention_tensors` summed: what is kept (q, k, v included), and what backward adds."""
    tensors = attention_tensors(kernel, h, heads, s, c, dropout, autocast, masked, softmax_keeps_input, kv, mask_b)
    saved = sum(b for _, b, kept in tensors if kept)
    probs = heads * s
    if kernel.fused:
        backward = 3 * h * c + (4 * h if kernel.name == "flash" else 0) + 4 * heads
        return AttentionBytes(saved, False, backward)
    largest = max(b for _, b, _ in tensors)  # the gradient of the probabilities, and of the scores
    return AttentionBytes(saved, True, 2 * max(largest, probs * 4 if kernel.name == "math" else largest))
