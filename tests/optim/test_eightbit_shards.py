"""bitsandbytes' 8-bit state under FSDP2 in checkpoints (`lit_memory.optim.eightbit_shards`): the resharding arithmetic,
and a save and load through torch's distributed checkpoint on one rank. Runs on 2 to 4 ranks, killed and resumed
or resharded: tests/run/test_resume.py and tests/test_strategies.py."""

from __future__ import annotations

import bitsandbytes.functional as F
import pytest
import torch
import torch.distributed as dist

from lit_memory.errors import UserError
from lit_memory.optim import eightbit_shards
from lit_memory.optim.eightbit_shards import BLOCK, Layout, dequantise, requantise


def quantised_in(values: torch.Tensor, layout: Layout, qmap: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``values`` quantised as bitsandbytes does on each of ``layout``'s shards: codes per shard and the absmax
    of every shard padded to (shards, blocks), as saved."""
    codes, absmax = [], torch.zeros(layout.shards, layout.blocks)
    for index in range(layout.shards):
        start = layout.start(index)
        shard = values[start : min(start + layout.chunk, layout.rows)]
        if shard.numel():
            quantised, state = F.quantize_blockwise(shard.reshape(-1), code=qmap, blocksize=BLOCK)
            codes.append(quantised.view(shard.shape))
            absmax[index, : state.absmax.numel()] = state.absmax
        else:
            codes.append(torch.empty(shard.shape, dtype=torch.uint8))
    return codes, absmax


@pytest.mark.parametrize("shape", [(10, 300), (4096,), (2, 64)], ids=["rows-not-blocks", "bias", "2-label-head"])
def test_state_resharded_onto_another_number_of_ranks_decodes_as_saved_and_requantises_within_8_bits(shape):
    """Saved from 3 shards, loaded onto 4 (and 2): each new shard's rows decode to exactly the values bitsandbytes'
    own dequantisation gives for the saved shards, whichever saved shard and block held them (rows of 300 values and
    a bias cut in 3 cross 256-value blocks); quantised again in the new shard's blocks they differ by less than
    8-bit rounding. A 2-row head leaves the last ranks empty."""
    torch.manual_seed(0)
    qmap = F.create_dynamic_map(signed=True)
    values = torch.randn(shape) * torch.logspace(-3, 0, shape[0])[(...,) + (None,) * (len(shape) - 1)]
    saved = Layout.of(values, 3)
    codes, absmax = quantised_in(values, saved, qmap)
    decoded = torch.cat(
        [
            F.dequantize_blockwise(c.reshape(-1), absmax=a[: -(-c.numel() // BLOCK)], code=qmap, blocksize=BLOCK).view(
                c.shape
            )
            for c, a in zip(codes, absmax)
            if c.numel()
        ]
    )
    assert (decoded - values).abs().max() <= values.abs().max() * 0.02  # what 8 bits keep of them
    all_codes = torch.cat(codes)
    for shards in (4, 2):
        new = Layout.of(values, shards)
        rebuilt = []
        for index in range(shards):
            start = new.start(index)
            mine = all_codes[start : min(start + new.chunk, new.rows)]  # the codes DCP reshards by rows
            part = dequantise(mine, absmax, qmap, saved, start)
            assert torch.equal(part, decoded[start : start + len(mine)]), (shards, index)
            if mine.numel():
                out_codes, out_absmax = torch.empty_like(mine), torch.empty(-(-mine.numel() // BLOCK))
                requantise(part, qmap, out_codes, out_absmax)
                again = F.dequantize_blockwise(out_codes.reshape(-1), absmax=out_absmax, code=qmap, blocksize=BLOCK)
                rebuilt.append(again.view(mine.shape))
        assert (torch.cat(rebuilt) - decoded).abs().max() <= decoded.abs().max() * 0.02
    empty = Layout(rows=2, width=64, shards=4)
    assert [empty.start(i) for i in range(4)] == [0, 1, 2, 2]  # ranks 2 and 3 hold nothing


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_state_saved_as_dtensors_loads_back_bit_for_bit_into_existing_state(one_rank, tmp_path, monkeypatch):
    """One rank of FSDP2: the 8-bit and 32-bit state of every shard goes to torch's distributed checkpoint as
    DTensors (codes and moments of the parameter's placement, absmax per shard) and loads back into the state
    made one bucket at a time, bit for bit, with the step count and the learning rate. A checkpoint without it,
    or with another kind of state, is one line."""
    import bitsandbytes as bnb
    import torch.distributed.checkpoint as dcp
    from fused_worker import batches
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lit_memory.fused import OptimizerInBackward
    from lit_memory.hf.anatomy import parameter_units
    from lit_memory.model import SequenceClassifier
    from lit_memory.optim.configure import weight_decay_groups

    def built(lr: float = 1e-3):
        torch.manual_seed(0)
        module = SequenceClassifier(
            "bundled:bert-large",
            pretrained=False,
            config_overrides={
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 128,
            },
        )
        module.configure_model()
        for layer in module.model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(module.model)
        optimizer = bnb.optim.AdamW8bit(weight_decay_groups(module.model), lr=lr)
        return module, optimizer, OptimizerInBackward(optimizer, parameter_units(module.model))

    module, optimizer, fusion = built()
    for batch in batches(2):
        module.model(**{k: v[None] for k, v in batch.items()}).loss.backward()
    saved = eightbit_shards.state_dict(optimizer, module)
    query = saved["state"]["model.bert.encoder.layer.0.attention.self.query.weight"]
    assert isinstance(query["state1"], DTensor) and query["state1"].dtype == torch.uint8 and query["step"] == 2
    assert isinstance(query["absmax1"], DTensor) and query["absmax1"].shape == (1, 64 * 64 // BLOCK)
    assert saved["state"]["model.bert.embeddings.LayerNorm.weight"]["state1"].dtype == torch.float32  # < 4096 values
    dcp.save({"optimizer_0": saved}, checkpoint_id=tmp_path / "ckpt")

    other, fresh, fresh_fusion = built(lr=5e-4)
    fresh_fusion.initialize_state()
    assert not eightbit_shards.load_state_dict(fresh, other, tmp_path / "ckpt", "optimizer_0")  # not resharded
    assert len(fresh.state) == len(optimizer.state) == len(list(module.parameters()))
    for a, b in zip(optimizer.param_groups, fresh.param_groups):
        assert a["lr"] == b["lr"] == 1e-3
        for p, q in zip(a["params"], b["params"]):
            assert optimizer.state[p].keys() == fresh.state[q].keys()
            for key, value in optimizer.state[p].items():
                loaded = fresh.state[q][key]
                assert torch.equal(value, loaded) if isinstance(value, torch.Tensor) else value == loaded, key

    dcp.save({"optimizer_0": {"state": {}, "param_groups": []}}, checkpoint_id=tmp_path / "old")
    with pytest.raises(UserError, match="holds no bitsandbytes optimizer state"):
        eightbit_shards.load_state_dict(fresh, other, tmp_path / "old", "optimizer_0")
    name = "model.bert.encoder.layer.0.attention.self.query.weight"
    saved["state"][name] = {**saved["state"][name], "state1": saved["state"][name]["state1"].float()}
    dcp.save({"optimizer_0": saved}, checkpoint_id=tmp_path / "other")
    with pytest.raises(UserError, match=f"keeps {name}'s optimizer state as torch.float32, this run as torch.uint8"):
        eightbit_shards.load_state_dict(fresh, other, tmp_path / "other", "optimizer_0")

    # An empty shard (FSDP2's last ranks of a 2-row head) is described with its own parameter's step count, which the
    # ranks holding its rows report (an all-reduce of every parameter's count), not another parameter's.
    params = eightbit_shards._params(optimizer)
    head = module.model.classifier.weight
    assert eightbit_shards._steps_anywhere(optimizer, params) == [2] * len(params)  # one rank: its own counts
    del optimizer.state[head]  # this rank's shard of the head: no rows, never stepped here
    assert eightbit_shards._steps_anywhere(optimizer, params) == [0 if p is head else 2 for p in params]
    elsewhere = [3 if p is head else 2 for p in params]  # the ranks with the head's rows stepped it 3 times
    monkeypatch.setattr(eightbit_shards, "_steps_anywhere", lambda optimizer, params: elsewhere)
    described = eightbit_shards.state_dict(optimizer, module)["state"]["model.classifier.weight"]
    assert described["step"] == 3 and described["state1"].dtype == torch.float32  # 128 values: 32-bit state
    assert not described["state1"].to_local().any() and described["state1"].shape == head.shape
