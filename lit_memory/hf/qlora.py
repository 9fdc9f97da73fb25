"""QLoRA's frozen base: the transformer layers' linear weights in 4-bit NormalFloat with double quantisation.

`model.lora.base: nf4` loads the model through transformers' ``BitsAndBytesConfig`` (NF4, double quantisation: each
block of 64 weights has an 8-bit scale, each 256 scales an fp32 one; about 0.52 B per weight), prepares it with
peft's ``prepare_model_for_kbit_training`` (every parameter frozen, whatever is not 4-bit in the trained weights'
dtype), and `lit_memory.hf.lora.apply_lora` puts fp32 adapters on it with the head in ``modules_to_save``: the head and
the adapters train in full precision and are saved with the model. The 4-bit matmul dequantises each weight into
the compute dtype (``bnb_4bit_compute_dtype``: bf16 under ``bf16-mixed``, fp32 under ``32-true``) as it runs, keeps
nothing new for backward and dequantises again there.

`merged` folds the adapters into the dequantised weights for ``hf_model/``: a plain transformers model, saved in
``model.save_dtype`` like any other. The head and everything outside the transformer layers stay unquantised.

bitsandbytes 0.50 runs 4-bit NF4 on CUDA and on the CPU (its CPU backend: forward, backward and dequantisation;
the tests train QLoRA on the CPU). One CPU path is switched off: in eval mode without autograd, on a CPU with
AVX512-BF16, `Linear4bit` repacks its weight in place for a CPU kernel (``_convert_weight_packed_for_cpu``), which
refuses layers narrower than a block (``RuntimeError: shape '[64, 0]' is invalid``) and leaves the weight in a
layout the training step does not read: `keep_training_layout` turns it off.

For the memory model the base is built on the ``meta`` device with bitsandbytes' own quantisation (its meta
kernels), so the packed weights and their quantisation state have the bytes a real load has (`weight_bytes`).
The simulation on fake tensors cannot hold bitsandbytes' parameters (`Params4bit` refuses to wrap a fake
tensor): a QLoRA step is predicted analytically (`SIMULATION_DECLINED`), and its FLOPs are counted on the same
model with dense frozen weights (the 4-bit matmul runs the same GEMM on the dequantised weight).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch import nn

from lit_memory.errors import UserError
from lit_memory.hf.anatomy import Anatomy, linear_types

# Why a QLoRA step is not simulated (`lit_memory.planning.prediction.predict`).
SIMULATION_DECLINED = "a 4-bit base's weights (QLoRA: bitsandbytes' Params4bit)"
# The families' layers hold their matrices as these (`lit_memory.hf.anatomy.linear_types`); bitsandbytes replaces
# exactly these with `Linear4bit` (transformers' replace_with_bnb_linear).
NOT_QUANTISABLE = (
    "model.lora.base nf4 quantises the linear layers inside the transformer layers with bitsandbytes (nn.Linear, "
    "GPT-2's Conv1D), and {model}'s layers have none ({found}): bitsandbytes cannot quantise this family; "
    "model.lora.base null (LoRA on the full-precision base) or bf16 trains it"
)


def quantisation_config(compute: torch.dtype, skip: Sequence[str]) -> Any:
    """QLoRA's ``BitsAndBytesConfig``: NF4, double quantisation, computing in ``compute``; ``skip``: the modules
    kept unquantised (the head: it trains)."""
    from transformers import BitsAndBytesConfig  # deferred: imports bitsandbytes; only QLoRA runs need it

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
        llm_int8_skip_modules=list(skip),
    )


def layer_linears(anatomy: Anatomy) -> list[nn.Module]:
    """The linear modules inside the transformer layers: what the 4-bit base quantises."""
    return [m for layer in anatomy.layers for m in layer.modules() if isinstance(m, linear_types())]


def check_quantisable(anatomy: Anatomy) -> None:
    """One `UserError` line where the 4-bit base would quantise nothing of the layers, or bitsandbytes cannot run."""
    if not layer_linears(anatomy):
        found = sorted({type(m).__name__ for layer in anatomy.layers[:1] for m in layer.modules() if m is not layer})
        raise UserError(
            NOT_QUANTISABLE.format(model=type(anatomy.model).__name__, found=", ".join(found) or "no modules")
        )
    try:
        import bitsandbytes  # noqa: F401  # deferred: only QLoRA needs it
    except ImportError:
        raise UserError("model.lora.base nf4 needs bitsandbytes: pip install bitsandbytes") from None


def _device() -> torch.device:
    """Where the model is being built: the default device (Lightning's init context puts the run's device there)."""
    return torch.empty(0).device


def building_on_meta() -> bool:
    """The memory model's build (the ``meta`` device)."""
    return _device().type == "meta"


def loading_kwargs(compute: torch.dtype, skip: Sequence[str]) -> dict[str, Any]:
    """What ``from_pretrained`` is given to load the 4-bit base, quantised on the device the model is built on."""
    return {"quantization_config": quantisation_config(compute, skip), "device_map": {"": _device()}}


def random_weights(config: Any, dtype: torch.dtype, compute: torch.dtype, skip: Sequence[str]) -> nn.Module:
    """The classifier with random weights and a 4-bit base: made in full on the CPU, then quantised by the same
    loading path as a checkpoint (``from_pretrained`` of its state dict); on the ``meta`` device (the memory model's
    build), bitsandbytes' layers with meta weights quantised by its own meta kernels."""
    from transformers import AutoModelForSequenceClassification  # deferred: heavy

    if building_on_meta():
        return _on_meta(
            AutoModelForSequenceClassification.from_config(config, dtype=dtype), quantisation_config(compute, skip)
        )
    kwargs = loading_kwargs(compute, skip)
    with torch.device("cpu"):
        dense = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    return type(dense).from_pretrained(None, config=config, state_dict=dense.state_dict(), dtype=dtype, **kwargs)


def _on_meta(model: nn.Module, quantisation: Any) -> nn.Module:
    import bitsandbytes as bnb  # deferred: only QLoRA needs it
    from bitsandbytes import functional
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    # bitsandbytes caches its 8-bit code map on the device of the first tensor it quantises: made on the CPU here, or
    # the meta copy would be every later (real) quantisation's
    if "dynamic" not in functional.name2qmap:
        with torch.device("cpu"):
            functional.name2qmap["dynamic"] = functional.create_dynamic_map()
    model = replace_with_bnb_linear(model, modules_to_not_convert=quantisation.llm_int8_skip_modules,
                                    quantization_config=quantisation)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = torch.empty(
                module.out_features, module.in_features, device="meta", dtype=quantisation.bnb_4bit_compute_dtype
            )
            module.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, quant_type="nf4", compress_statistics=True,
            )._quantize("meta")
    return model


def prepare(model: nn.Module) -> nn.Module:
    """peft's preparation of a k-bit model (every parameter frozen, the unquantised ones in fp32 where they were 16-bit;
    our own checkpointing, not its), and the 4-bit layers made to behave as linear layers do
    (`keep_training_layout`)."""
    from peft import prepare_model_for_kbit_training  # deferred: peft is heavy

    keep_training_layout(model)
    if getattr(model, "is_loaded_in_4bit", False):
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model.requires_grad_(False)  # the memory model's meta build: what prepare does, the weights already in their dtype
    return model


def keep_training_layout(model: nn.Module) -> None:
    """bitsandbytes' CPU inference repacking off (module docstring), and each 4-bit layer's output in autocast's dtype
    under autocast, as `nn.Linear`'s is: `Linear4bit` returns its input's dtype (fp32 from an fp32 residual stream),
    and families that mix the two meet a mismatch (DeBERTa fills bf16 attention scores with its fp32 query's minimum:
    "value cannot be converted to type c10::BFloat16 without overflow")."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            module.register_forward_hook(_as_autocast)


def _as_autocast(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    device = output.device.type
    if torch.is_autocast_enabled(device) and output.is_floating_point():
        return output.to(torch.get_autocast_dtype(device))
    return output


def is_quantised(tensor: Optional[torch.Tensor]) -> bool:
    """A 4-bit weight (bitsandbytes' ``Params4bit``, quantised: it carries its quantisation state)."""
    return getattr(tensor, "quant_state", None) is not None


def values(tensor: torch.Tensor) -> int:
    """A parameter's values: a 4-bit weight's as it was before packing (two to a byte)."""
    state = getattr(tensor, "quant_state", None)
    return math.prod(state.shape) if state is not None else tensor.numel()


def weight_bytes(tensor: torch.Tensor) -> int:
    """A parameter's bytes on the device, with a 4-bit one's quantisation state (scales, nested scales, code maps)."""
    own = tensor.numel() * tensor.element_size()
    state = getattr(tensor, "quant_state", None)
    return own + (_state_bytes(state) if state is not None else 0)


def _state_bytes(state: Any) -> int:
    total = 0
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif type(value).__name__ == "QuantState":  # double quantisation: the scales' own state
            total += _state_bytes(value)
    return total


def largest_quantised(model: nn.Module) -> int:
    """Values of the largest 4-bit weight: each 4-bit matmul dequantises its weight into the compute dtype, uses it
    and frees it (in forward, and again in backward)."""
    return max(
        (m.in_features * m.out_features for m in model.modules() if is_quantised(getattr(m, "weight", None))), default=0
    )


def state_keys(module: nn.Module) -> list[str]:
    """The keys a module's state dict has beyond its parameters and buffers: the quantisation state bitsandbytes
    writes beside each 4-bit weight (``<weight>.absmax``, ``.quant_map``, ``.nested_absmax``, ...)."""
    quantised = [name for name, p in module.named_parameters() if is_quantised(p)]
    if not quantised:
        return []
    return [key for key in module.state_dict() if any(key.startswith(name + ".") for name in quantised)]


def has_quantised_base(model: nn.Module) -> bool:
    return any(is_quantised(p) for p in model.parameters())


def merged(model: nn.Module) -> nn.Module:
    """A peft model on a 4-bit base as a plain transformers model: the adapters' updates added to the base's weights
    dequantised in fp32 (not requantised, as peft's merge into a 4-bit layer would), the trained head kept."""
    from peft.tuners.lora import LoraLayer  # deferred: peft is heavy
    from transformers.integrations.bitsandbytes import dequantize_and_replace

    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and is_quantised(module.get_base_layer().weight):
            deltas[name] = sum(module.get_delta_weight(a).float() for a in module.active_adapters)
    prefix = "base_model.model."
    base = model.unload()  # the adapters gone, the head's trained copy in place
    config = getattr(getattr(base, "hf_quantizer", None), "quantization_config", None)
    base = dequantize_and_replace(base, quantization_config=config, dtype=torch.float32)
    if getattr(base, "hf_quantizer", None) is not None:
        base.hf_quantizer.remove_quantization_config(base)
    with torch.no_grad():
        for name, delta in deltas.items():
            weight = base.get_submodule(name.removeprefix(prefix)).weight
            weight.add_(delta.to(weight.device, weight.dtype))
    return base
