"""bitsandbytes 8-bit optimizers: 32-bit embedding state, StableEmbedding, and local shards under FSDP2."""

from __future__ import annotations

import copy

import bitsandbytes as bnb
import pytest
import torch
import torch.distributed as dist
from bitsandbytes.nn import StableEmbedding

from lit_memory.fused import OptimizerInBackward
from lit_memory.hf.anatomy import Anatomy, parameter_units
from lit_memory.model import SequenceClassifier
from lit_memory.optim.configure import weight_decay_groups
from lit_memory.optim.eightbit import keep_32bit, swap_stable_embedding

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    module = SequenceClassifier("bundled:bert-large", pretrained=False, config_overrides=TINY)
    module.configure_model()
    return module.model


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (4, 16), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 0, 1])}


def train(
    model: torch.nn.Module, fused: bool, steps: int = 3, embeddings_32bit: bool = False, streams=None
) -> torch.optim.Optimizer:
    optimizer = bnb.optim.AdamW8bit(weight_decay_groups(model), lr=1e-3)
    if embeddings_32bit:
        keep_32bit(optimizer, [e.weight for e in Anatomy.of(model).embeddings])
    step = OptimizerInBackward(optimizer, parameter_units(model), streams=streams) if fused else None
    for i in range(steps):
        torch.manual_seed(100 + i)  # the same dropout masks in every run
        model(**batch(i)).loss.backward()
        if not fused:
            optimizer.step()
            optimizer.zero_grad()
    if step is not None:
        step.remove()
    return optimizer


def state_bits(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.dtype:
    return optimizer.state[param]["state1"].dtype


@pytest.mark.parametrize("fused", [False, True])
def test_embeddings_keep_32bit_state_and_the_rest_goes_8bit(fused):
    model = tiny_bert()
    optimizer = train(model, fused, embeddings_32bit=True)
    embeddings = model.bert.embeddings
    for emb in (embeddings.word_embeddings, embeddings.position_embeddings):
        assert state_bits(optimizer, emb.weight) == torch.float32
    assert state_bits(optimizer, model.bert.encoder.layer[0].attention.self.query.weight) == torch.uint8


def test_without_the_override_embeddings_are_8bit_too():
    model = tiny_bert()
    optimizer = train(model, fused=True)
    assert state_bits(optimizer, model.bert.embeddings.word_embeddings.weight) == torch.uint8


def test_the_override_belongs_to_its_optimizer_alone():
    model = tiny_bert()
    first = bnb.optim.AdamW8bit(weight_decay_groups(model), lr=1e-3)
    keep_32bit(first, [e.weight for e in Anatomy.of(model).embeddings])
    second = bnb.optim.AdamW8bit(weight_decay_groups(model), lr=1e-3)  # e.g. a later model reusing freed ids
    assert id(model.bert.embeddings.word_embeddings.weight) in first.mng.pid2config
    assert id(model.bert.embeddings.word_embeddings.weight) not in second.mng.pid2config


def test_stable_embedding_keeps_the_pretrained_vectors_and_32bit_state():
    model = tiny_bert()
    before = model.get_input_embeddings().weight.detach().clone()
    swap_stable_embedding(model)
    emb = model.get_input_embeddings()
    assert isinstance(emb, StableEmbedding) and torch.equal(emb.weight, before)
    optimizer = train(model, fused=True)
    assert state_bits(optimizer, emb.weight) == torch.float32  # StableEmbedding registers its own override
    assert not torch.equal(emb.weight, before)  # and it trains


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fused_8bit_steps_fsdp_local_shards_exactly_as_unsharded(one_rank_group):
    """bitsandbytes knows nothing of DTensor: the core steps local shards. FSDP2 hands each gradient over inside its
    reduce-scatter stream (on the CPU too, as torch.cpu's stream objects, which `streams.Recording` reads): every
    8-bit step ran on the default stream, where bitsandbytes launches, after an event recorded on that stream."""
    from streams import Recording
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    plain = tiny_bert()
    sharded = copy.deepcopy(plain)
    for layer in sharded.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(sharded)
    reference = train(plain, fused=True, embeddings_32bit=True)
    recording = Recording()
    try:
        optimizer = train(sharded, fused=True, embeddings_32bit=True, streams=recording)
    finally:
        recording.remove()
    reduce_scatter = sharded._get_fsdp_state()._comm_ctx.reduce_scatter_stream
    steps = recording.steps()
    assert len(steps) == 3 * len(parameter_units(sharded))
    assert all(s["on"] is recording.default_stream and s["waited"] == [reduce_scatter] for s in steps)

    word = sharded.bert.embeddings.word_embeddings.weight
    assert isinstance(word, DTensor)
    assert state_bits(optimizer, word) == torch.float32  # the override reaches the shard's copy
    assert state_bits(optimizer, sharded.bert.encoder.layer[0].attention.self.query.weight) == torch.uint8
    assert set(optimizer.state_dict()["state"]) == set(range(len(list(sharded.parameters()))))  # keyed by parameter
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        assert torch.equal(p.detach(), q.full_tensor().detach()), name  # one rank: the shard is the whole
    assert all(q.grad is None for q in sharded.parameters())
    assert len(reference.state) == len(optimizer.state)


def test_an_unfused_8bit_step_makes_no_device_sync_per_parameter(monkeypatch):
    """bitsandbytes' step synchronises the device after every parameter (393 per BERT-large step: 0.89x the fp32
    baseline's speed on an H200, docs/gpu/h200-before.json); the module's step runs inside its library's context,
    also around fused buckets' own (nested: patched once, restored once)."""
    import bitsandbytes as bnb
    import bitsandbytes.optim.optimizer as bnb_optimizer

    from lit_memory.optim import optimizers

    syncs = []
    own = lambda tensor: syncs.append(tensor)  # noqa: E731
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", own)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    context = optimizers.library_of(optimizer).step_context(optimizer, list(model.parameters()))
    with context:
        inner = optimizers.library_of(optimizer).step_context(optimizer, list(model.parameters()))
        with inner:
            optimizer.step()
        assert bnb_optimizer.sync_gpu is not own  # the outer step's patch holds after an inner one ends
        optimizer.step()
    assert syncs == [] and bnb_optimizer.sync_gpu is own
    optimizer.step()  # outside: bitsandbytes' own behaviour
    assert len(syncs) == 4
