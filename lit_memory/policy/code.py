"""Code settings: Hugging Face settings (a config.json key, a config override, a config attribute) that would make
transformers fetch or run code.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from jsonargparse import Namespace

from lit_memory.policy.refusal import NOTHING, Context, Refusal, register

# Hugging Face settings that fetch or run code (config.json, config overrides, from_pretrained options).
KERNEL_SETTINGS = ("attn_implementation", "experts_implementation")
# transformers' `is_kernel`: org/name[@rev][:fn]
KERNEL_PATTERN = re.compile(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$")
CODE_SETTINGS = {
    "quantization_config": "transformers picks a quantizer by it, which imports (and can download) code of its own",
    "use_kernels": "it makes transformers download kernels from the Hugging Face Hub and import them",
    "kernel_config": "it makes transformers download kernels from the Hugging Face Hub and import them",
    "allow_all_kernels": "it lets transformers import kernels from any Hub repository",
    "custom_pipelines": "it names Python code to run the model with",
}


def code_setting(name: str, value: Any) -> Optional[str]:
    """Why a Hugging Face config setting (a config.json key, a config override, a config attribute) would
    make transformers fetch or run code, or None: an attention or experts implementation naming a kernel
    on the Hub (``kernels-community/flash-attn``: downloaded and imported where the ``kernels`` package
    is installed), a quantization config, kernel options."""
    bare = name.lstrip("_").removesuffix("_internal")
    if bare in KERNEL_SETTINGS:
        values = value.values() if isinstance(value, dict) else [value]
        kernels = [v for v in values if isinstance(v, str) and KERNEL_PATTERN.match(v)]
        if kernels:
            return f"{kernels[0]!r} names a kernel on the Hugging Face Hub that transformers downloads and imports"
        return None
    if bare in CODE_SETTINGS and value not in (None, False, {}):
        return CODE_SETTINGS[bare]
    return None


def config_code_problems(config: Any, where: str, depth: int = 0) -> list[str]:
    """`code_setting` over a config as a dict (config.json) or a transformers config, with its sub-configs."""
    found = []
    items = config.items() if isinstance(config, dict) else [
        (name, getattr(config, name, None))
        for name in ("_attn_implementation", "_experts_implementation", "quantization_config")
    ]
    for name, value in items:
        if isinstance(name, str) and (reason := code_setting(name, value)):
            found.append(f"{where}: {name.lstrip('_').removesuffix('_internal')}: {reason}")
    if depth < 4:
        subs = [v for v in config.values() if isinstance(v, dict)] if isinstance(config, dict) else [
            getattr(config, n, None) for n in (getattr(config, "sub_configs", None) or {})]
        for sub in subs:
            if sub is not None and sub is not config:
                found += config_code_problems(sub, where, depth + 1)
    return found


def code_refusals(overrides: Any, key: str = "model.config_overrides", depth: int = 0) -> list[Refusal]:
    """Config overrides that would make transformers fetch or run code (`code_setting`): at the top or
    in a sub-config's dict (``text_config: {attn_implementation: org/kernel}``)."""
    if isinstance(overrides, Namespace):
        overrides = overrides.as_dict()
    if not isinstance(overrides, dict) or depth > 4:
        return []
    found = []
    for name, value in overrides.items():
        if reason := code_setting(str(name), value):
            found.append(Refusal(f"{key}.{name}", value, reason))
        elif isinstance(value, dict):
            found += code_refusals(value, f"{key}.{name}", depth + 1)
    return found


@register("parse")
def settings(context: Context) -> list[Refusal]:
    """Config overrides that would make transformers fetch or run code (`code_refusals`)."""
    return code_refusals(context.get("model.config_overrides"))


@register("run")
def model_config(context: Context) -> list[Refusal]:
    """A loaded Hugging Face config (its file, the Hub's or a folder's, with the overrides) that would fetch or run code
    when the model is built (`config_code_problems`); an override the user typed is theirs."""
    if context.config is None:
        return []
    typed = {k.rsplit(".", 1)[-1] for k in context.typed_keys if k.startswith("model.config_overrides.")}
    found = []
    for problem in config_code_problems(context.config, "the model config"):
        where, name, reason = problem.split(": ", 2)
        if name not in typed and f"_{name}" not in typed:
            found.append(Refusal(name, NOTHING, reason, head=f"{where}: {name}"))
    return found
