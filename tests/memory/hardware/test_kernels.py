"""Which attention kernel torch runs (lit_memory.memory.hardware.kernels) and what each keeps, and what one layer keeps
(lit_memory.memory.model.layers) as a function of its description."""

from __future__ import annotations

import pytest
import torch

from lit_memory.hf.config import load_config
from lit_memory.memory.hardware.kernels import Kernel, attention_bytes, attention_tensors
from lit_memory.memory.model.layers import (
    LayerSpec,
    Shape,
    backward_temp_per_token,
    layer_bytes_per_token,
    layer_tensors,
)
from lit_memory.planning.prediction.activation_model import layer_spec
from lit_memory.settings import PRECISIONS

DTYPE = {2: torch.float16, 4: torch.float32, 8: torch.float64}  # the inputs' dtype by its bytes

A100, V100, L4 = (8, 0), (7, 0), (8, 9)


@pytest.mark.parametrize(
    "implementation, capability, bytes_, head_dim, masked, expected",
    [
        ("sdpa", A100, 2, 64, False, "flash"),  # 16-bit, sm80, no padding mask
        ("sdpa", A100, 2, 64, True, "efficient"),  # flash takes no mask
        ("sdpa", A100, 4, 64, False, "efficient"),  # flash needs 16-bit inputs
        ("sdpa", V100, 2, 64, False, "efficient"),  # flash needs sm80
        ("sdpa", A100, 2, 36, True, "math"),  # 16-bit inputs need a head dim divisible by 8
        ("sdpa", L4, 2, 200, False, "efficient"),  # flash cannot train head dims in (192, 224] on sm89
        ("sdpa", A100, 8, 64, False, "math"),  # fp64
        ("eager", A100, 2, 64, True, "eager"),
        ("flash_attention_2", A100, 2, 64, True, "eager"),  # not modelled: predicted as eager
    ],
)
def test_the_kernel_is_the_one_torch_dispatches_to(implementation, capability, bytes_, head_dim, masked, expected):
    kernel = Kernel.of(implementation, True, capability, DTYPE[bytes_], head_dim, dropout=True, masked=masked)
    assert kernel.name == expected, kernel.reason


T4, P100 = (7, 5), (6, 0)


@pytest.mark.parametrize(
    "capability, bf16, masked, expected",
    [
        (T4, True, True, "math"),  # memory-efficient takes bf16 only from sm80: a bf16 recipe on a T4
        (V100, True, False, "math"),  # and flash needs sm80 whatever the dtype
        (T4, False, True, "efficient"),  # fp16 below sm80: memory-efficient
        (P100, False, True, "efficient"),  # sm60: no tensor cores, alignment 1
        (A100, True, True, "efficient"),  # bf16 from sm80
        (A100, True, False, "flash"),
    ],
)
def test_bf16_attention_below_sm80_runs_the_math_kernel(capability, bf16, masked, expected):
    """torch's sdp_utils.cpp: can_use_mem_efficient_attention's dtypes are {fp16, fp32} below sm80 and add bf16
    from sm80; flash needs sm80+ (its dtypes fp16/bf16)."""
    kernel = Kernel.of(
        "sdpa", True, capability, torch.bfloat16 if bf16 else torch.float16, 64, dropout=True, masked=masked
    )
    assert kernel.name == expected, kernel.reason


def test_the_cpu_runs_its_math_kernel_for_attention_dropout_only():
    assert Kernel.of("sdpa", False, (0, 0), torch.float32, 64, dropout=True).name == "cpu-math"
    assert Kernel.of("sdpa", False, (0, 0), torch.float32, 64, dropout=True, training=False).name == "cpu-fused"


def test_fused_kernels_keep_no_attention_matrix_and_eager_keeps_it_at_autocast_widths():
    h, heads, s = 1024, 16, 512
    efficient = Kernel("efficient", "")
    fused = attention_bytes(efficient, h, heads, s, 2, dropout=True, autocast=True)
    assert fused.saved == 4 * h * 2 + 4 * heads + s * 2  # q, k, v, output; log-sum-exp; the mask's bias
    assert not fused.output_copied
    eager = Kernel("eager", "")
    probs = heads * s
    under_autocast = attention_bytes(eager, h, heads, s, 2, dropout=True, autocast=True)
    # fp32 softmax, mask, 16-bit copy; output copy
    assert under_autocast.saved == 3 * h * 2 + probs * (4 + 1 + 2) + h * 2
    fp32 = attention_bytes(eager, h, heads, s, 4, dropout=True, autocast=False)
    assert fp32.saved == 3 * h * 4 + probs * (4 + 1 + 4) + h * 4
    before_1_11 = attention_bytes(eager, h, heads, s, 4, dropout=True, autocast=False, softmax_keeps_input=True)
    assert before_1_11.saved - fp32.saved == probs * 4  # softmax kept its (masked) input too
    math = attention_bytes(Kernel("math", ""), h, heads, s, 2, dropout=True, autocast=True)
    assert math.saved > under_autocast.saved  # 16-bit inputs computed in fp32: everything at 4 bytes
    names = [name for name, _, _ in attention_tensors(efficient, h, heads, s, 2, True, True, masked=False)]
    assert names == ["q", "k", "v", "output", "logsumexp"]


def test_a_bert_layer_keeps_what_its_description_says():
    config = load_config("bundled:bert-large", 2)
    import torch
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    spec = layer_spec(model.bert.encoder.layer[0], model.config)
    assert spec == LayerSpec(1024, 4096, 16, hidden_dropouts=2, attention_dropout=True, implementation="sdpa")
    x = Shape(batch=32, length=128, precision=PRECISIONS["16-mixed"], cuda=True)  # fp32 weights, fp16 autocast
    kernel = Kernel.of("sdpa", True, A100, torch.float16, spec.head_dim, True)
    h, f = 1024, 4096
    # three cast inputs, q/k/v/output, lse and bias, two masks, two LayerNorm inputs + stats, FFN in/hidden/act
    expected = 3 * h * 2 + 4 * h * 2 + 4 * 16 * 128 // 128 + 128 * 2 + 2 * h + 2 * h * 4 + 16 + h * 2 + 2 * f * 2
    assert layer_bytes_per_token(spec, x, kernel) == expected
    # one dropout fewer on the residual branches (DistilBERT's layout), one FFN matrix more (gated)
    assert layer_bytes_per_token(LayerSpec(1024, 4096, 16, hidden_dropouts=1), x, kernel) == expected - h
    assert layer_bytes_per_token(LayerSpec(1024, 4096, 16, ffn_kind="gated"), x, kernel) == expected + 2 * f * 2
    # LoRA on two projections: the frozen projections keep no inputs, the adapters keep theirs
    lora = layer_bytes_per_token(spec, x, kernel, lora=(2, 8))
    assert lora == expected - 3 * h * 2 - h * 2 - f * 2 + 2 * (h * (2 + 1) + 8 * 2)
    # in backward the attention's gradients come after the FFN's saved tensors are released
    eager = Kernel("eager", "")
    assert backward_temp_per_token(spec, x, eager) < attention_bytes(eager, h, 16, 128, 2, True, True).backward


def test_distilbert_reads_as_one_residual_dropout_per_layer():
    import torch
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(load_config("bundled:distilbert", 2))
    spec = layer_spec(model.distilbert.transformer.layer[0], model.config)
    assert (spec.hidden, spec.ffn, spec.heads, spec.hidden_dropouts, spec.norms) == (768, 3072, 12, 1, 2)
    names = [t.name for t in layer_tensors(spec, Shape(1, 8, PRECISIONS["32-true"], True), Kernel("efficient", ""))]
    assert "dropout_1" not in names and "dropout_2" in names


def test_an_activation_keeps_what_autograd_saves_for_it():
    from transformers.activations import ACT2FN

    from lit_memory.memory.model.layers import activation_saves

    # fused kernels keep their input; GPT-2's tanh GELU, written out, its input, tanh's output, 0.5x and 1 + tanh
    assert {name: activation_saves(ACT2FN[name]) for name in ("gelu", "gelu_pytorch_tanh", "silu", "gelu_new")} == {
        "gelu": 1, "gelu_pytorch_tanh": 1, "silu": 1, "gelu_new": 4,
    }
