"""The fused-step core on plain PyTorch loops: same numbers as the unfused optimizer, less gradient memory."""

from __future__ import annotations

import shutil

import pytest
import torch
from fused_worker import FP16_SCALER, RecordingScaler, batches, tiny_bert
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from transformers import Adafactor, get_scheduler

from lit_memory import fused as fused_module
from lit_memory.errors import UserError
from lit_memory.fused import Clipping, OptimizerInBackward, group_parameters
from lit_memory.hf.anatomy import parameter_units
from lit_memory.model import SequenceClassifier
from lit_memory.optim.configure import weight_decay_groups
from lit_memory.run.activation_checkpointing import enable_gradient_checkpointing

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for these small models


def model(dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    module = tiny_bert(dropout=dropout)
    module.configure_model()
    return module.model


# Every bucket setting; 0.1 MiB buckets hold a few of the tiny model's matrices, across layers and groups.
BUCKETS = ("layer", "0.1 MiB", "param")


def train(net, optimizer, fused: bool, steps: int = 10, start: int = 0, schedule=None, bucket: str = "layer"):
    """``steps`` closure-style steps on fixed batches; with ``fused``, stepped inside backward."""
    fusion = OptimizerInBackward(optimizer, parameter_units(net), bucket) if fused else None
    torch.manual_seed(1 + start)  # dropout masks
    for batch in batches(steps, seed=start):
        batch = {k: v[None] for k, v in batch.items()}

        @torch.enable_grad()  # as Lightning's closure: Adafactor steps under no_grad
        def closure():
            optimizer.zero_grad()
            loss = net(**batch).loss
            loss.backward()
            return loss

        optimizer.step(closure)
        if schedule:
            schedule.step()
        if fused:
            assert all(p.grad is None for p in net.parameters())  # every gradient freed by its step
    if fusion:
        fusion.remove()
    return net


def assert_same_parameters(a, b, atol: float) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=0, msg=name)


def warmup_and_decay(optimizer):
    return get_scheduler("linear", optimizer, num_warmup_steps=3, num_training_steps=10)


OPTIMIZERS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
    "SGD-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01),
    "Adafactor": lambda params: Adafactor(
        params, lr=1e-3, scale_parameter=False, relative_step=False, weight_decay=0.01
    ),
}


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_step_matches_the_unfused_optimizer(name, bucket):
    make = OPTIMIZERS[name]
    plain, fused = model(), model()
    plain_opt, fused_opt = make(weight_decay_groups(plain)), make(weight_decay_groups(fused))
    train(plain, plain_opt, fused=False, schedule=warmup_and_decay(plain_opt))
    train(fused, fused_opt, fused=True, schedule=warmup_and_decay(fused_opt), bucket=bucket)
    assert_same_parameters(plain, fused, atol=1e-6)
    # The state lives in the original optimizer, in its own format: same keys, same numbers.
    torch.testing.assert_close(fused_opt.state_dict(), plain_opt.state_dict(), atol=1e-6, rtol=0)


@pytest.fixture
def bitsandbytes_overrides():
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()
    manager.initialize()  # process-wide: start and end clean
    yield manager
    manager.initialize()


@pytest.mark.parametrize("bucket", BUCKETS)
def test_bitsandbytes_8bit_matches_unfused_with_a_32bit_override(bitsandbytes_overrides, bucket):
    """Tolerance 0: AdamW8bit quantises each parameter's state in blocks of 256 of that parameter's
    own elements and needs no statistic across parameters, so stepping a bucket at a time does the
    very same arithmetic. bitsandbytes' documented per-parameter override (32-bit state for the
    word embeddings, registered by position in the optimizer's groups) must reach that parameter in
    its bucket's copy, at its position there, and only it."""
    import bitsandbytes as bnb

    runs = []
    for fused in (False, True):
        bitsandbytes_overrides.initialize()
        net = model()
        bitsandbytes_overrides.override_config(net.bert.embeddings.word_embeddings.weight, "optim_bits", 32)
        groups = weight_decay_groups(net)
        bitsandbytes_overrides.register_parameters(groups)
        optimizer = bnb.optim.AdamW8bit(groups, lr=1e-3, weight_decay=0.01)
        schedule = warmup_and_decay(optimizer)
        runs.append((train(net, optimizer, fused=fused, schedule=schedule, bucket=bucket), optimizer))
    (plain, _), (fused, _) = runs
    assert_same_parameters(plain, fused, atol=0)
    dtypes = [{n: opt.state[p]["state1"].dtype for n, p in net.named_parameters()} for net, opt in runs]
    assert dtypes[0] == dtypes[1]
    assert dtypes[1]["bert.embeddings.word_embeddings.weight"] == torch.float32  # the override
    assert dtypes[1]["bert.encoder.layer.0.intermediate.dense.weight"] == torch.uint8  # 8-bit elsewhere


@pytest.mark.parametrize("resume_fused", [True, False], ids=["into-fused", "into-unfused"])
def test_state_dict_resumes_exactly(resume_fused):
    make = OPTIMIZERS["AdamW"]
    uninterrupted = model(dropout=0.0)
    optimizer = make(weight_decay_groups(uninterrupted))
    train(uninterrupted, optimizer, fused=True, steps=5)
    train(uninterrupted, optimizer, fused=True, steps=5, start=5)

    first = model(dropout=0.0)
    first_opt = make(weight_decay_groups(first))
    train(first, first_opt, fused=True, steps=5)
    second = model(dropout=0.0)
    second.load_state_dict(first.state_dict())
    second_opt = make(weight_decay_groups(second))
    second_opt.load_state_dict(first_opt.state_dict())  # a fused optimizer's state loads anywhere
    train(second, second_opt, fused=resume_fused, steps=5, start=5)
    assert_same_parameters(uninterrupted, second, atol=1e-6)


@pytest.mark.parametrize("bucket", ["layer", "param", "100 MiB"])
def test_memory_gradients_alive_are_at_most_the_largest_bucket_on_minilm(bucket):
    """MemTracker labels every parameter's gradient; it reports the breakdown only at the moment of
    the *total* peak, so the test reads its live gradient bytes each time a gradient has been
    accumulated, just before the fused step's hook (registered after the sampling one) runs."""
    sizes, peaks = None, {}
    for fused in (False, True):
        torch.manual_seed(0)
        module = SequenceClassifier("bundled:minilm")
        module.configure_model()
        net = module.model
        optimizer = torch.optim.AdamW(weight_decay_groups(net), lr=2e-5)
        batch = {k: v[None].repeat(2, 1) for k, v in batches(1)[0].items()}
        peaks[fused] = 0
        with MemTracker() as tracker:
            loss = net(**batch).loss  # the tracker hooks each parameter as its module runs...

            def sample(param):
                live = tracker.get_tracker_snapshot()[torch.device("cpu")][_MemRefType.GRAD]
                peaks[fused] = max(peaks[fused], live)

            handles = [p.register_post_accumulate_grad_hook(sample) for p in net.parameters()]
            # ...then the fused step's
            fusion = OptimizerInBackward(optimizer, parameter_units(net), bucket) if fused else None
            loss.backward()
        for handle in handles:
            handle.remove()
        if fusion:
            fusion.remove()
        sizes = [p.numel() * p.element_size() for p in net.parameters()]
        buckets = [
            sum(p.numel() * p.element_size() for p in b)
            for b in group_parameters(list(net.parameters()), parameter_units(net), bucket)
        ]
    assert peaks[False] == sum(sizes)  # unfused: every gradient alive at the end of backward
    assert peaks[True] == max(buckets)  # fused: the bucket being applied, at most; all of it at its step
    if bucket == "100 MiB":
        assert max(buckets) == sum(sizes)  # one bucket: all of MiniLM's 90.9 MB
    else:
        # Each layer is a bucket of 7.1 MB; the largest is the word embeddings' alone, about half of all gradients.
        assert max(buckets) == max(sizes) < sum(sizes) / 1.9


def test_remove_restores_ordinary_backward():
    net = model()
    fusion = OptimizerInBackward(torch.optim.SGD(net.parameters(), lr=0.1), parameter_units(net))
    fusion.remove()
    net(**{k: v[None] for k, v in batches(1)[0].items()}).loss.backward()
    assert all(p.grad is not None for p in net.parameters())


def test_bitsandbytes_steps_the_local_shard_of_a_sharded_parameter(tmp_path):
    """bitsandbytes cannot step a DTensor: the fused copy steps the rank's local shard, in place,
    with the 32-bit override intact. On a one-rank mesh that must equal plain AdamW8bit."""
    import bitsandbytes as bnb
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        start, grads = torch.randn(64, 64), [torch.randn(64, 64) for _ in range(3)]
        sharded = torch.nn.Parameter(distribute_tensor(start.clone(), init_device_mesh("cpu", (1,)), [Shard(0)]))
        plain = torch.nn.Parameter(start.clone())
        fused_opt, ref_opt = bnb.optim.AdamW8bit([sharded], lr=1e-2), bnb.optim.AdamW8bit([plain], lr=1e-2)
        fusion = OptimizerInBackward(fused_opt)
        assert fusion.steps_shards
        for grad in grads:
            (sharded * distribute_tensor(grad, sharded.device_mesh, [Shard(0)])).sum().backward()
            (plain * grad).sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert sharded.grad is None
        assert torch.equal(sharded.to_local(), plain.detach())
        assert fused_opt.state[sharded]["state1"].dtype == torch.uint8  # 8-bit state, keyed by the parameter
    finally:
        dist.destroy_process_group()


def test_a_bucket_whose_parameter_gets_no_gradient_is_stepped_at_the_end_of_backward():
    """One bucket holds the whole model and the loss uses neither the pooler nor the classifier, so the
    bucket never completes: at the end of backward it is stepped with the gradients it has (as an
    unfused step skips parameters without one), and no gradient is held past its backward."""
    plain, fused = model(dropout=0.0), model(dropout=0.0)
    plain_opt, fused_opt = (OPTIMIZERS["AdamW"](weight_decay_groups(net)) for net in (plain, fused))
    fusion = OptimizerInBackward(fused_opt, parameter_units(fused), "100 MiB")
    assert len(fusion.hooks.buckets) == 1
    for batch in batches(3):
        for net in (plain, fused):
            net.bert(input_ids=batch["input_ids"][None]).last_hidden_state.square().mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        assert all(p.grad is None for p in fused.parameters())
    fusion.remove()
    assert_same_parameters(plain, fused, atol=1e-6)
    assert torch.equal(fused.classifier.weight, model(dropout=0.0).classifier.weight)  # never had a gradient


def test_optimizer_state_for_a_checkpoint_load_is_created_one_bucket_at_a_time(tmp_path):
    """torch's distributed checkpoint (Lightning's FSDP2 resume) loads into existing optimizer state and
    otherwise creates it with a zero gradient for every parameter and a full step. Created bucket by
    bucket instead (on FSDP2 shards, one rank), the tracked peak is lower by all gradients but one
    bucket's, the state is the same and the parameters do not move. Eight layers train (the
    embeddings are frozen), so one layer's gradients stand against eight."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lit_memory.memory.measure.tracker import Tracker

    layers = {"num_hidden_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        runs = {}
        for bucketed in (True, False):
            torch.manual_seed(0)
            module = SequenceClassifier(
                "bundled:bert-large", pretrained=False, config_overrides=layers, freeze="embeddings"
            )
            module.configure_model()
            net = module.model
            for layer in net.bert.encoder.layer:
                fully_shard(layer)
            fully_shard(net)
            before = {n: p.detach().full_tensor().clone() for n, p in net.named_parameters()}
            optimizer = OPTIMIZERS["AdamW"](weight_decay_groups(net))
            fusion = OptimizerInBackward(optimizer, parameter_units(net))
            tracker = Tracker("cpu")
            tracker.track_external(net, optimizer)
            with tracker:
                tracker.enter_phase("step")
                fusion.initialize_state() if bucketed else _init_optim_state(optimizer)
            fusion.remove()
            assert all(torch.equal(p.full_tensor(), before[n]) for n, p in net.named_parameters())
            assert all(p.grad is None for p in net.parameters())
            state = {
                n: {k: v.shape for k, v in optimizer.state[p].items()}
                for n, p in net.named_parameters()
                if p.requires_grad
            }
            state_bytes = sum(
                (v.to_local() if isinstance(v, DTensor) else v).nbytes
                for s in optimizer.state.values()
                for v in s.values()
            )
            # Beyond the weights and the state created: the zero gradients and the step's temporaries.
            runs[bucketed] = (tracker.footprint.peak - tracker.footprint.categories["weights"] - state_bytes, state)
        (bucketed_extra, bucketed_state), (full_extra, full_state) = runs[True], runs[False]
        assert bucketed_state == full_state
        gradients = sum(4 * p.numel() for p in net.parameters() if p.requires_grad)
        layer = sum(4 * p.numel() for p in net.bert.encoder.layer[0].parameters())  # the largest bucket
        assert full_extra >= gradients > 7 * layer
        assert bucketed_extra <= 2 * layer  # one layer's gradients, and its step's temporaries
    finally:
        dist.destroy_process_group()


# -- clipping inside backward ----------------------------------------------------------------------


def clipped(net, clipping: Clipping, fused: bool, bucket: str = "layer", steps: int = 5) -> list[float]:
    """AdamW steps on batches of 4 with dropout, clipped: fused inside backward, else by torch.nn.utils after
    it. Returns per step the norm (by norm: fused, what the measuring backward found) or, unfused by value,
    the largest gradient value."""
    optimizer = torch.optim.AdamW(weight_decay_groups(net), lr=1e-3, weight_decay=0.01)
    fusion = OptimizerInBackward(optimizer, parameter_units(net), bucket, clipping) if fused else None
    torch.manual_seed(1)  # dropout masks
    seen = []
    samples = batches(4 * steps)
    for i in range(steps):
        batch = {k: torch.stack([s[k] for s in samples[4 * i : 4 * i + 4]]) for k in samples[0]}
        loss = net(**batch).loss
        if fused:
            norm = fusion.backward(loss.backward)
            assert all(p.grad is None for p in net.parameters())
        elif clipping.by_norm:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clipping.max_norm, clipping.norm_type)
        else:
            loss.backward()
            norm = torch.stack([p.grad.abs().max() for p in net.parameters() if p.grad is not None]).max()
            torch.nn.utils.clip_grad_value_(net.parameters(), clipping.value)
        seen.append(None if norm is None else norm.item())
        if not fused:
            optimizer.step()
            optimizer.zero_grad()
    if fusion:
        fusion.remove()
    return seen


CLIPPINGS = {"norm": Clipping(max_norm=0.3), "value": Clipping(value=0.01)}


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("name", CLIPPINGS)
def test_clipping_inside_backward_matches_torch_after_it(name, bucket):
    """By norm: a measuring backward first (each gradient freed once its norm is taken), then the fused one
    scaled by torch's coefficient; by value: each bucket clamps before its step. Clipping is active."""
    clipping = CLIPPINGS[name]
    plain, fusion = model(), model()
    plain_seen = clipped(plain, clipping, fused=False)
    fused_seen = clipped(fusion, clipping, fused=True, bucket=bucket)
    assert_same_parameters(plain, fusion, atol=1e-6)
    limit = clipping.max_norm if clipping.by_norm else clipping.value
    assert min(plain_seen) > limit  # clipped at every step
    if clipping.by_norm:
        torch.testing.assert_close(fused_seen, plain_seen, rtol=1e-5, atol=0)


def test_clipping_by_the_infinity_norm_with_recomputed_activations():
    """Non-reentrant checkpointing recomputes each layer in both backwards (the same dropout masks)."""
    clipping = Clipping(max_norm=0.01, norm_type=float("inf"))
    nets = []
    for fused in (False, True):
        net = model()
        enable_gradient_checkpointing(net)
        nets.append((net, clipped(net, clipping, fused=fused)))
    (plain, plain_norms), (fusion, fused_norms) = nets
    assert_same_parameters(plain, fusion, atol=1e-6)
    assert min(plain_norms) > 0.01 and fused_norms == pytest.approx(plain_norms, rel=1e-6)


@pytest.mark.skipif(shutil.which("c++") is None, reason="torch.compile (inductor) on CPU needs a C++ compiler")
def test_clipping_by_norm_with_compiled_layers():
    """Compiled backwards donate their saved tensors unless told not to: the fused step's hooks tell torch
    before the layers compile, so the second backward over a compiled forward works."""
    import torch._functorch.config

    # torch's default, restored after by torch's own patch (pytest's monkeypatch would delete the config entry
    # on undo: "torch._functorch.config.donated_buffer does not exist" in every later compile of the worker)
    with torch._functorch.config.patch(donated_buffer=True):
        _compiled_layers_clip_alike()


def _compiled_layers_clip_alike():
    nets = []
    for fused in (False, True):
        net = model(dropout=0.0)  # compiled dropout draws other masks than eager
        for layer in net.bert.encoder.layer:
            layer.compile()
        nets.append((net, clipped(net, Clipping(max_norm=0.3), fused=fused, steps=3)))
    (plain, plain_norms), (fusion, fused_norms) = nets
    assert_same_parameters(plain, fusion, atol=1e-5)
    assert fused_norms == pytest.approx(plain_norms, rel=1e-5)


def test_the_bucket_setting_is_parsed_once_into_a_value_that_prints_as_written():
    from lit_memory.fused import Bucketing, parse_bucket

    size = parse_bucket(" 16 MiB ")
    assert size == Bucketing("size", 16 * 2**20) and str(size) == "16 MiB"
    assert parse_bucket(size) is size  # a parsed value passes through every layer below unchanged
    assert [str(parse_bucket(s)) for s in ("layer", "param", "0.5 MiB")] == ["layer", "param", "0.5 MiB"]
    with pytest.raises(UserError, match="bucket must be layer, param or a size"):
        parse_bucket("0 MiB")


def test_units_decide_layer_buckets_and_parameters_in_no_unit_step_alone():
    """The core is given the units (it knows no model): a `layer` bucket per unit, in backward order."""
    a, b, c, d = (torch.nn.Parameter(torch.zeros(2)) for _ in range(4))
    assert group_parameters([a, b, c, d], [[a, b], [c]], "layer") == [[c], [b, a], [d]]
    assert group_parameters([a, b, c], [[a, b], [c]], "param") == [[c], [b], [a]]
    assert group_parameters([a, b, c], [[a, b], [c]], "16 MiB") == [[c, b, a]]


# -- fp16 loss scaling inside backward --------------------------------------------------------------


def scaled(net, fused: bool, clipping=None, steps: int = 10) -> list[float]:
    """AdamW steps under CPU fp16 autocast with torch's GradScaler (the scale overflows at the start and after
    each growth), clipped after unscaling as Lightning orders it. Fused, the loop is the same with the fused
    step's view of the scaler. Returns the scale after each step."""
    optimizer = torch.optim.AdamW(weight_decay_groups(net), lr=1e-3, weight_decay=0.01)
    scaler = RecordingScaler("cpu", **FP16_SCALER)
    fusion = OptimizerInBackward(optimizer, parameter_units(net), "layer", clipping, scaler=scaler) if fused else None
    loop_scaler = fusion.scaler if fused else scaler
    torch.manual_seed(1)  # dropout masks
    samples = batches(4 * steps)
    for i in range(steps):
        batch = {k: torch.stack([s[k] for s in samples[4 * i : 4 * i + 4]]) for k in samples[0]}
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loop_scaler.scale(net(**batch).loss)
        if fused:
            fusion.backward(loss.backward)
            assert all(p.grad is None for p in net.parameters())
        else:
            loss.backward()
        loop_scaler.unscale_(optimizer)
        if clipping is not None and not fused:
            if clipping.by_norm:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clipping.max_norm)
            else:
                torch.nn.utils.clip_grad_value_(net.parameters(), clipping.value)
        loop_scaler.step(optimizer)
        loop_scaler.update()
        optimizer.zero_grad()
    if fusion:
        fusion.remove()
    return scaler.scales


@pytest.mark.parametrize(
    "clipping", [None, Clipping(max_norm=0.3), Clipping(value=0.01)], ids=["none", "norm", "value"]
)
def test_fp16_loss_scaling_inside_backward_matches_gradscaler(clipping):
    """A measuring backward unscales and checks every gradient first (with clipping by norm, the same one
    that measures the norm): an overflow skips the step, as GradScaler skips it; otherwise every bucket
    unscales with GradScaler's kernel, then clips, then steps. Same weights, same scales, so the same steps
    skipped (a skipped step backs the scale off), and the steps that were not moved the weights."""
    plain, fusion = model(), model()
    plain_scales = scaled(plain, fused=False, clipping=clipping)
    fused_scales = scaled(fusion, fused=True, clipping=clipping)
    assert fused_scales == plain_scales
    skipped = sum(after < before for before, after in zip([2.0**20] + plain_scales, plain_scales))
    grown = sum(after > before for before, after in zip(plain_scales, plain_scales[1:]))
    assert 3 <= skipped <= 7 and grown >= 1  # overflows forced: the first steps and after each growth
    assert_same_parameters(plain, fusion, atol=1e-6)
    assert not torch.equal(next(plain.parameters()), next(model().parameters()))  # the other steps trained


def test_fp16_loss_scaling_needs_the_checking_backward():
    net = model()
    fusion = OptimizerInBackward(
        torch.optim.SGD(net.parameters(), lr=0.1), parameter_units(net), scaler=torch.amp.GradScaler("cpu")
    )
    loss = fusion.scaler.scale(net(**{k: v[None] for k, v in batches(1)[0].items()}).loss)
    with pytest.raises(UserError) as error:
        loss.backward()  # not through fusion.backward: the first bucket would step before any overflow is known
    assert str(error.value) == fused_module.UNCHECKED
    fusion.remove()


# -- stream order, device syncs, empty shards --------------------------------------------------------


def _8bit(params):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=1e-3, weight_decay=0.01)


def _trained_on(stream, make, streams=None, steps: int = 2):
    """A fused run whose backward runs inside ``stream`` (where FSDP2 and FSDP1 run the hooks that hand gradients
    over: torch.cpu's stream objects stand for CUDA's), ordered through ``streams``."""
    net = model(dropout=0.0)
    fusion = OptimizerInBackward(make(weight_decay_groups(net)), parameter_units(net), streams=streams)
    for batch in batches(steps):
        with torch.cpu.stream(stream):
            net(**{k: v[None] for k, v in batch.items()}).loss.backward()
    fusion.remove()
    return net, fusion


def test_each_bucket_steps_on_the_compute_stream_after_its_gradients(monkeypatch):
    """Gradients handed over on another stream than the default one (``rs``, as FSDP2's reduce-scatter): every
    bucket steps on the default (compute) stream, whatever stream its library launches on, after an event recorded
    on ``rs`` when the bucket completed, one bucket late (the wait then follows the next layer's backward, which the
    reduce-scatter overlaps); the last at the end of backward. So torch's AdamW allocates its temporaries and state
    in the one pool the memory model replays, not in a pool of the reduce-scatter stream's. No device sync, the
    numbers unchanged."""
    import bitsandbytes.optim.optimizer as bnb_optimizer
    from streams import Recording

    syncs = []
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda tensor: syncs.append(tensor))
    rs = torch.cpu.Stream()
    for make, launch in ((_8bit, "default"), (OPTIMIZERS["AdamW"], "current")):
        recording = Recording()
        try:
            net, fusion = _trained_on(rs, make, recording)
        finally:
            recording.remove()
        buckets = len(fusion.hooks.buckets)
        steps = recording.steps()
        assert len(steps) == 2 * buckets and {b.launch for b in fusion.hooks.buckets} == {launch}
        assert all(s["on"] is recording.default_stream and s["waited"] == [rs] for s in steps)
        kinds = [entry[0] for entry in recording.log if entry[0] in ("record", "step")]
        first_backward = kinds[: 2 * buckets]
        # one late, the last at the end
        assert first_backward == ["record"] + ["record", "step"] * (buckets - 1) + ["step"]
        used = [entry for entry in recording.log if entry[0] == "used"]
        assert used and all(stream is recording.default_stream for _, stream in used)  # gradients kept for it
        unordered, _ = _trained_on(rs, make)  # the CPU: no streams to order
        assert_same_parameters(unordered, net, atol=0)
    assert syncs == []  # bitsandbytes' per-parameter torch.cuda.synchronize(), left out


def test_a_paged_8bit_optimizer_synchronises_once_per_bucket(monkeypatch):
    """Paged state is prefetched and updated asynchronously: bitsandbytes' own sync at the end of a step stays,
    once per bucket instead of after every parameter."""
    import bitsandbytes as bnb
    import bitsandbytes.optim.optimizer as bnb_optimizer

    syncs = []
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda tensor: syncs.append(tensor))
    with pytest.warns(UserWarning, match="Paged optimizers are not supported on CPU"):
        _, fusion = _trained_on(torch.cpu.current_stream(), lambda p: bnb.optim.PagedAdamW8bit(p, lr=1e-3), steps=1)
    assert len(syncs) == len(fusion.hooks.buckets) < sum(len(b.params) for b in fusion.hooks.buckets)


@pytest.mark.parametrize("name", ["AdamW", "SGD-momentum", "Adafactor", "AdamW8bit"])
def test_an_empty_shard_reaches_no_optimizer_and_adds_nothing_to_the_norm(name):
    """FSDP2 gives the last ranks no rows of a parameter with fewer rows than ranks (a 2-label head on 3 ranks):
    a bucket hands its optimizer only the shards with values (bitsandbytes' CUDA kernels exit the process on a
    0-element launch), and the clipping norm skips it (an empty tensor has no infinity norm)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from lit_memory.fused import Bucket
    from lit_memory.fused.clipping import NormMeter

    make = _8bit if name == "AdamW8bit" else OPTIMIZERS[name]
    torch.manual_seed(0)
    full, empty = torch.nn.Parameter(torch.randn(2, 256)), torch.nn.Parameter(torch.empty(0, 256))
    bucket = Bucket(make([full, empty]), [full, empty])
    full.grad, empty.grad = torch.randn(2, 256), torch.empty(0, 256)
    handed = []
    hook = register_optimizer_step_pre_hook(
        lambda opt, *_: handed.extend(p.numel() for g in opt.param_groups for p in g["params"] if p.grad is not None)
    )
    try:
        bucket.step()
    finally:
        hook.remove()
    assert handed == [512] and full.grad is None and empty.grad is None
    for norm_type in (2.0, float("inf")):
        meter = NormMeter(norm_type)
        grad = torch.randn(2, 256)
        meter.add(grad)
        meter.add(torch.empty(0, 256))
        assert meter.total() == torch.linalg.vector_norm(grad, norm_type)
        only_empty = NormMeter(norm_type)
        only_empty.add(torch.empty(0, 256))
        assert only_empty.total() == 0  # a rank holding nothing still takes part, with 0
