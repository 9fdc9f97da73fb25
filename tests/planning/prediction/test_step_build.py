"""`lit_memory.planning.prediction.step.build`: the configured module for the memory models: every tensor made in the
model's context."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lit_memory.planning.prediction.step import Step, adopt, build

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lora_step(batch_size: int = 4) -> Step:
    return Step.from_settings({"model": {"model_name_or_path": "bundled:minilm", "num_labels": 2, "lora": {}},
                               "data": {"batch_size": batch_size, "max_length": 32}})


def tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def test_adopt_replaces_what_the_context_does_not_own_and_keeps_ties():
    fake = FakeTensorMode()
    with fake:
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10), nn.BatchNorm1d(10))
    model[1].weight = model[0].weight  # tied, as word embeddings and decoders are
    model.add_module("adapter", nn.Linear(4, 4))  # real, as peft's adapters were
    with FakeTensorMode():  # fake, but of another mode, as peft's deep copies of the head were
        model.add_module("copy", nn.Linear(4, 2))
    assert adopt(model, fake) == 4 + 0  # adapter weight + bias, copy weight + bias
    assert all(isinstance(t, FakeTensor) and t.fake_mode is fake for _, t in tensors(model))
    assert model[1].weight is model[0].weight
    assert model.adapter.weight.requires_grad and model.adapter.weight.shape == (4, 4)
    assert not model[2].running_mean.requires_grad  # buffers stay buffers
    assert adopt(model, fake) == 0


def test_adopt_to_meta():
    model = nn.Linear(3, 5, dtype=torch.bfloat16)
    assert adopt(model, torch.device("meta")) == 2
    assert model.weight.is_meta and model.weight.dtype == torch.bfloat16 and model.weight.shape == (5, 3)


@pytest.mark.parametrize("context", ["fake", "meta"])
def test_a_lora_model_is_built_entirely_in_the_context(context):
    mode = FakeTensorMode(allow_non_fake_inputs=True) if context == "fake" else torch.device("meta")
    module, optimizer = build(lora_step(), mode)
    owned = [(n, t) for n, t in tensors(module.model)
             if (isinstance(t, FakeTensor) and t.fake_mode is mode if context == "fake" else t.is_meta)]
    assert len(owned) == len(tensors(module.model))
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in module.model.parameters() if p.requires_grad}


SIMULATIONS = """
import ctypes, gc
from lit_memory.planning.prediction.step import Step
from lit_memory.planning.prediction.simulate import simulate
step = Step.from_settings({"model": {"model_name_or_path": "bundled:minilm", "num_labels": 2, "lora": {}},
                           "data": {"batch_size": 4, "max_length": 128}})
trim = ctypes.CDLL("libc.so.6").malloc_trim
for _ in range(5):
    simulate(step)
    gc.collect()
    trim(0)  # walks glibc's free lists: a corrupted heap aborts here
print("ok")
"""


@pytest.mark.fit
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_repeated_lora_simulations_leave_the_heap_intact():
    """The regression test for the crash of issue 20: five LoRA simulations in one process, the heap
    walked after each (before the fix, every run died by SIGSEGV or a glibc abort within two)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", SIMULATIONS], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
