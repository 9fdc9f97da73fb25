"""torchao's low-bit optimizers (`lit_memory.optim.lowbit`): the fused step, checkpoints, the analytic model's
bytes, stochastic rounding, and the settings refused.

torchao compiles its per-parameter update once per signature (shape, state kind, weight decay, dtype):
about 11 s for the first on this 2-core CPU, 3 s for each next. The toy BERT here is 64 wide everywhere
(hidden, FFN, vocabulary, positions), so its parameters have four signatures ((64, 64) quantised;
(64,), (2, 64) and (2,) plain), compiled once per test process and shared by these tests (and by
tests/memory/measure/test_tracker.py); inductor's on-disk cache keeps them for the next process.
"""

from __future__ import annotations

import io

import pytest
import torch
import yaml
from conftest import RECIPES
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.checkpoint import FileSystemReader
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8, _AdamW
from transformers import get_scheduler

from lit_memory.__main__ import main
from lit_memory.errors import UserError
from lit_memory.fused import OptimizerInBackward
from lit_memory.hf.anatomy import parameter_units
from lit_memory.model import SequenceClassifier
from lit_memory.optim import lowbit
from lit_memory.optim.configure import weight_decay_groups
from lit_memory.optim.lowbit import keep_plain_state
from lit_memory.optim.optimizer_state import optimizer_tensors
from lit_memory.planning.prediction.step import OptimizerSpec

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for these small models


TOY = {
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 64,
    "vocab_size": 64, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
}


def toy_bert(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    module = SequenceClassifier("bundled:bert-large", pretrained=False, config_overrides=TOY)
    module.configure_model()
    return module.model.to(dtype)


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 16), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 1, 0])}


def train(model, optimizer, fused: bool, steps: int, start: int = 0, bucket: str = "layer", schedule=None):
    fusion = OptimizerInBackward(optimizer, parameter_units(model), bucket) if fused else None
    for i in range(start, start + steps):
        model(**batch(i)).loss.backward()
        optimizer.step()  # fused: finds no gradient left
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    if fusion is not None:
        fusion.remove()


def schedule(optimizer):  # moves the learning rate every step: the buckets' copies must follow it
    return get_scheduler("linear", optimizer, num_warmup_steps=2, num_training_steps=8)


@pytest.mark.parametrize("bucket", ["layer", "param"])
@pytest.mark.parametrize("cls", [AdamW8bit, AdamW4bit], ids=["8bit", "4bit"])
def test_fused_buckets_step_exactly_as_the_unfused_optimizer(cls, bucket):
    """Bitwise: torchao updates one parameter at a time with the same compiled kernel and quantises each
    parameter's moments in blocks of its own values; nothing depends on which other parameters share the
    call, or on the order they are stepped in (without stochastic rounding, which draws a seed per
    parameter in update order: backward's order when fused, the groups' order unfused)."""
    runs = []
    for fused in (False, True):
        model = toy_bert()
        optimizer = cls(weight_decay_groups(model), lr=1e-3, weight_decay=0.01)
        train(model, optimizer, fused, steps=4, bucket=bucket, schedule=schedule(optimizer))
        runs.append((model, optimizer))
    (plain, plain_opt), (fused, fused_opt) = runs
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert torch.equal(p, q), name
    kinds = {type(v).__name__ for state in fused_opt.state.values() for v in state.values()}
    assert kinds == {"Tensor", f"OptimState{cls.__name__[-4:]}"}  # quantised moments, plain ones under 4096 values
    assert_same_state(fused_opt.state_dict(), plain_opt.state_dict())  # the original's state, in its own format


def assert_same_state(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        for key, value in state.items():
            other = b["state"][index][key]
            assert type(value) is type(other), (index, key)
            parts = value.__tensor_flatten__()[0] if is_traceable_wrapper_subclass(value) else [None]
            for part in parts:  # a quantised moment: its codes, block scales and lookup table
                assert torch.equal(*(getattr(t, part) if part else t for t in (value, other))), (index, key, part)


def test_state_resumes_exactly_from_a_weights_only_checkpoint():
    """The fused optimizer's state_dict holds torchao's state subclasses; torch.load with weights_only=True
    (how lit_memory loads every checkpoint) reads them, and training goes on as if never stopped."""
    uninterrupted = toy_bert()
    optimizer = AdamW8bit(weight_decay_groups(uninterrupted), lr=1e-3)
    train(uninterrupted, optimizer, fused=True, steps=6)

    first = toy_bert()
    first_opt = AdamW8bit(weight_decay_groups(first), lr=1e-3)
    train(first, first_opt, fused=True, steps=3)
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    second = toy_bert()
    second.load_state_dict(checkpoint["model"])
    second_opt = AdamW8bit(weight_decay_groups(second), lr=1e-3)
    second_opt.load_state_dict(checkpoint["optimizer"])
    train(second, second_opt, fused=True, steps=3, start=3)
    for (name, p), q in zip(uninterrupted.named_parameters(), second.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    "cls, dtype",
    [(AdamW8bit, torch.float32), (AdamW4bit, torch.float32), (AdamWFp8, torch.float32), (_AdamW, torch.bfloat16)],
    ids=["8bit", "4bit", "fp8", "plain-bf16"],
)
def test_the_analytic_model_counts_the_state_torchao_creates(cls, dtype):
    """Every byte of torchao's real state (codes, block scales, lookup tables, plain moments in the weights'
    dtype, step counters) against what the memory model measures (`optimizer_tensors`). One eager step: the state is
    what matters here."""
    model = toy_bert(dtype)
    optimizer = cls(weight_decay_groups(model), lr=1e-3)
    model(**batch(0)).loss.backward()
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()
    storages = {s for state in optimizer.state.values() for v in state.values() for s in get_untyped_storages(v)}
    assert optimizer_tensors(optimizer, "cpu").state_bytes == sum(s.nbytes() for s in storages)


@pytest.mark.parametrize("dtype", [torch.float32, None], ids=["32bit", "unquantized"])
def test_embeddings_keep_unquantised_state_and_the_fused_buckets_keep_it_too(dtype):
    """``embedding_optimizer_state: 32bit`` / ``unquantized`` for torchao (`keep_plain_state`, over torchao's
    private ``_new_buffer``): the embedding matrices' moments are plain tensors (fp32, or the weights' bf16),
    everything else as torchao makes it; the fused step's bucket copies create state the same way; the
    memory model counts every byte."""
    model = toy_bert(torch.bfloat16)
    optimizer = AdamW8bit(weight_decay_groups(model), lr=1e-3)
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert max(e.numel() for e in embeddings) >= 4096  # torchao would quantise the largest
    keep_plain_state(optimizer, embeddings, dtype)
    train(model, optimizer, fused=True, steps=1)
    for p, state in optimizer.state.items():
        kinds = {type(state[k]).__name__ for k in ("exp_avg", "exp_avg_sq")}
        if any(p is e for e in embeddings):
            assert kinds == {"Tensor"} and state["exp_avg"].dtype == (dtype or torch.bfloat16)
        elif p.numel() >= 4096:
            assert kinds == {"OptimState8bit"}
    storages = {s for state in optimizer.state.values() for v in state.values() for s in get_untyped_storages(v)}
    assert optimizer_tensors(optimizer, "cpu").state_bytes == sum(s.nbytes() for s in storages)


def test_stochastic_rounding_keeps_the_small_updates_rounding_to_nearest_loses():
    """The 2gb recipe's optimizer on bf16 weights at 1.0, a constant gradient and lr 1e-4: Adam moves each
    weight by lr per step, far below half a bf16 unit in the last place (2^-9 just under 1.0). Rounded to
    nearest, 40 steps leave every weight at 1.0; rounded stochastically, they move 40 x 1e-4 on average
    (4096 weights: the mean's spread is about 4 % of that)."""
    spec = yaml.safe_load((RECIPES / "2gb.yaml").read_text())["model"]["optimizer"]
    assert spec["init_args"]["bf16_stochastic_round"] is True
    moved = {}
    for rounding in (True, False):
        spec = {
            **spec,
            "init_args": {**spec["init_args"], "lr": 1e-4, "weight_decay": 0.0, "bf16_stochastic_round": rounding},
        }
        weights = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        optimizer = OptimizerSpec.of(spec).factory()([weights])
        torch.manual_seed(0)
        for _ in range(40):
            weights.grad = torch.full_like(weights, 0.5)
            optimizer.step()
        moved[rounding] = 1.0 - weights.float().mean().item()
    assert moved[False] == 0.0
    assert moved[True] == pytest.approx(40 * 1e-4, rel=0.15)


# -- settings refused, one line each, before anything is written ---------------------------------------


def test_stochastic_rounding_without_bf16_weights_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "fit",
                "--recipe",
                "2gb",
                "--trainer.precision=bf16-mixed",
                f"--trainer.default_root_dir={tmp_path / 'runs'}",
            ]
        )
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: model.optimizer.init_args.bf16_stochastic_round rounds bf16 weights, and trainer.precision bf16-mixed "
        "trains no bf16 weights (torchao ignores it there): set trainer.precision bf16-true, or drop "
        "bf16_stochastic_round"
    ]
    assert not (tmp_path / "runs").exists()


def test_fp8_state_on_a_gpu_without_fp8_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    fp8 = {"class_path": "torchao.optim.AdamWFp8", "init_args": {}}
    with pytest.raises(
        UserError,
        match=r"^torchao.optim.AdamWFp8 keeps FP8 state, which needs a GPU with compute "
        r"capability 8.9 or newer; this one has 8.0: use torchao.optim.AdamW8bit instead$",
    ):
        lowbit.check_settings(fp8, "bf16-mixed", on_gpu=True)
    lowbit.check_settings(fp8, "bf16-mixed", on_gpu=False)  # the CPU casts to FP8 itself
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    lowbit.check_settings(fp8, "bf16-mixed", on_gpu=True)


def test_torchao_over_sharded_parameters_compiles_without_the_autograd_cache(tmp_path):
    """torch's AOTAutograd cache keys a DTensor by its spec alone: a DTensor of torchao's quantised state and one
    of plain state of the same shape hash alike, so a later run found the other's compiled step on disk ("'Tensor'
    object has no attribute 'codes'"). A torchao optimizer over sharded parameters turns that cache off; over
    plain tensors it stays on. (When torch hashes the local tensor's type, the first assertion fails: the
    switch can go.)"""
    import torch._functorch.config as functorch_config

    # torch's own patch, not monkeypatch: pytest's monkeypatch reads a module's __dict__, misses the config
    # module's entry, and on undo deletes it, which hides the switch from every later compile in the process
    # ("torch._functorch.config.enable_autograd_cache does not exist").
    with functorch_config.patch(enable_autograd_cache=True):
        _cache_switch_follows_the_parameters(tmp_path, functorch_config)


def _cache_switch_follows_the_parameters(tmp_path, functorch_config):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
    from torchao.optim.subclass_8bit import OptimState8bit

    lowbit.compile_steps_without_the_dtensor_cache_collision(AdamW8bit([torch.nn.Parameter(torch.zeros(64, 64))]))
    assert functorch_config.enable_autograd_cache
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        quantised = DTensor.from_local(OptimState8bit.zeros((64, 64), True, 256), mesh, [Shard(0)], run_check=False)
        plain = DTensor.from_local(torch.zeros(64, 64), mesh, [Shard(0)], run_check=False)
        assert quantised._stable_hash_for_caching() == plain._stable_hash_for_caching()
        sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(64, 64), mesh, [Shard(0)]))
        lowbit.compile_steps_without_the_dtensor_cache_collision(AdamW8bit([sharded]))
        assert not functorch_config.enable_autograd_cache
    finally:
        dist.destroy_process_group()


def test_fsdp2_fused_torchao_resumes_exactly_from_its_sharded_checkpoint(tmp_path):
    """torchao's 8-bit state is DTensor-aware: under FSDP2 with the fused step it is saved in the sharded
    checkpoint and restored, so 6 steps + resume to 10 equal 10 steps (bitsandbytes': tests/run/test_resume.py)."""
    from test_strategies import CHECKPOINT, load, run_worker

    args = ["--strategy", "fused-fsdp", "--devices", "2", "--optimizer", "torchao-8bit"]
    run_worker(tmp_path / "full", *args)
    checkpoint = tmp_path / "full" / CHECKPOINT
    assert (checkpoint / "meta.pt").is_file()  # sharded (torch.distributed.checkpoint), with the 8-bit moments
    saved = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    assert any("exp_avg" in key and "optimizer" in key for key in saved), sorted(saved)[:20]
    run_worker(tmp_path / "resumed", *args, "--resume", str(checkpoint))
    full, resumed = load(tmp_path / "full"), load(tmp_path / "resumed")
    assert full.keys() == resumed.keys()
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], rtol=0, atol=1e-6, msg=name)
