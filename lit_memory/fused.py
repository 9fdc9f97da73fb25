"""The fused backward + optimizer step: parameters are updated, and their gradients freed, as soon as
backward has produced those gradients, so a full set of gradients never exists.

Parameters are stepped in *buckets*. A bucket's optimizer steps once, over all of the bucket's
parameters (one call: torch's multi-tensor foreach or fused kernels where torch picks them or the user
asks for them), when backward has accumulated the last of their gradients; then those gradients are
freed. So at most about one bucket's gradients are alive, and the host makes one optimizer call per
bucket instead of one per parameter. The ``bucket`` setting (`parse_bucket`):

- ``layer`` (the default): each unit the caller gives is a bucket; the strategies give each
  transformer layer as a unit, and every other module's own parameters as one (the word embeddings,
  the position embeddings, the embeddings' LayerNorm, the pooler, the classifier: each its own bucket);
- ``"N MiB"``: consecutive parameters, in the order backward produces their gradients (the model's
  parameter order reversed), up to N MiB of gradients per bucket;
- ``param``: one bucket per parameter.

Two layers:

- `BucketHooks(buckets)`: the hooks. Each `Bucket` is an optimizer and the parameters it waits for;
  a bucket is stepped when its last gradient arrives, and at the end of every backward any bucket
  still waiting (a parameter that got no gradient this time) is stepped with the gradients it has.
- `OptimizerInBackward(optimizer, units, bucket)`: the optimizer the user configured, stepped
  inside backward through buckets whose optimizers are copies of it. ``units`` are the parameters
  that form one ``layer`` bucket each, in the model's order: the caller knows the model and gives
  them (`lit_memory.anatomy.parameter_units`); this module knows nothing of Hugging Face. Everyone else (Lightning,
  Fabric, LR schedulers, checkpoints) keeps talking to the original:

  - hyper-parameters: before each step a bucket's optimizer takes its groups' current values from
    the original's ``param_groups``, where LR schedulers write them, so weight-decay groups and
    schedules hold (a bucket may hold parameters of several groups: one group each);
  - state: every copy keeps its state in the original's ``state``, so ``state_dict()`` and
    ``load_state_dict()`` are the original's own, in its own format;
  - ``step(closure)`` is the original's: it runs the closure (forward and backward, during which every
    bucket is stepped) and then finds no gradient left. A gradient that did not come through
    backward (set by hand, or by torch's checkpoint utilities) is still applied there, by the original.

Gradient clipping (`Clipping`) happens inside backward, with the results of clipping after it: by value
as each bucket steps; by global norm with a first backward that only measures the norm
(`BucketHooks.backward`). fp16 loss scaling (`LossScaling`: torch's ``GradScaler``, 16-mixed) shares that
first backward: it unscales and checks every gradient, and an overflow skips the step exactly where
GradScaler would.

On a device with streams (CUDA), every bucket steps on the compute stream (the device's default stream), ordered
after its gradients whatever stream made them (`DeviceStreams`): FSDP2 and FSDP1 hand gradients over on their
reduce-scatter / post-backward stream, and bitsandbytes launches its kernels on the legacy default stream anyway.
Empty shards (FSDP2 gives the last ranks none of a parameter with fewer rows than ranks) are left out of every
optimizer's step and of the clipping norm.

What fusion cannot do is look at gradients after backward: no accumulation over micro-batches, no user code
that clips or inspects gradients after backward. The strategies refuse those settings with these messages
before training starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence

import torch
from torch.autograd import Variable
from torch.optim import Optimizer

from lit_memory.optimizers import copy_for, library_of
from lit_memory.errors import UserError


# One line each: what cannot work, and what to do instead.
ACCUMULATION = (
    "the fused step updates the parameters in every backward, so it cannot accumulate gradients: set "
    "trainer.accumulate_grad_batches to 1 (fit the batch with model.gradient_checkpointing) "
    "or remove the fused strategy"
)
ACCUMULATION_SCHEDULE = (
    "the fused step updates the parameters in every backward, so it cannot accumulate gradients: remove the "
    "GradientAccumulationScheduler callback (or keep its factors at 1), or remove the fused strategy"
)
CLIPPING_HOOK = (
    "the fused step applies each gradient as soon as backward produces it, so the module's "
    "configure_gradient_clipping finds no gradient to clip: remove that override (trainer.gradient_clip_val "
    "and gradient_clip_algorithm clip inside the fused step), or remove the fused strategy"
)
UNMEASURED = (
    "clipping by norm under the fused step needs the global norm before the first bucket steps, which only "
    "a backward that measures it first can give: call backward through the fused strategy or fabric.backward(loss), "
    "not loss.backward()"
)
UNSCALED = (
    "fp16 loss scaling: backward came before the loss was scaled (scaler.scale(loss)), so there is no scale to "
    "unscale the gradients by: scale the loss with the GradScaler first, as Lightning and Fabric do"
)
UNCHECKED = (
    "fp16 loss scaling under the fused step must know whether any gradient overflowed before the first bucket "
    "steps, which only a backward that checks them first can tell: call backward through the fused strategy or "
    "fabric.backward(loss), not loss.backward()"
)
MANUAL = (
    "the fused step runs the optimizer inside backward, where manual optimization cannot control it: "
    "use automatic optimization or remove the fused strategy"
)
SEVERAL = (
    "the fused step drives exactly one optimizer: put all parameters into one optimizer "
    "(parameter groups for different settings) or remove the fused strategy"
)

FABRIC_CLIPPING = (
    "fabric.clip_gradients runs after backward, when the fused step has already applied and freed every "
    "gradient: give the fused strategy (or fsdp_overlap_step_with_backward) max_norm or clip_val instead, "
    "which clip inside backward with the same results"
)

DEFAULT_BUCKET = "layer"  # the setting as written (strategies' signatures and YAML show it as text)
_MIB = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*MiB\s*")


@dataclass(frozen=True)
class Bucketing:
    """The ``bucket`` setting, parsed (`parse_bucket`): ``layer``, ``param``, or ``size`` (``size_bytes``
    of gradients at most per bucket). ``str()`` gives the setting back as written."""

    kind: Literal["layer", "param", "size"]
    size_bytes: int = 0

    def __str__(self) -> str:
        return f"{self.size_bytes / 2**20:g} MiB" if self.kind == "size" else self.kind


def parse_bucket(setting: Any) -> Bucketing:
    """``layer``, ``param`` or ``"N MiB"`` as a `Bucketing` (one given is returned as it is); anything
    else is one `UserError` line. Strategies parse their setting once and pass the value down."""
    if isinstance(setting, Bucketing):
        return setting
    if setting in ("layer", "param"):
        return Bucketing(setting)
    match = _MIB.fullmatch(setting) if isinstance(setting, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise UserError(f"bucket must be layer, param or a size such as '25 MiB', got {setting!r}")
    return Bucketing("size", int(float(match.group(1)) * 2**20))


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients one optimizer call applies, once all of them have arrived.

    ``optimizer`` steps exactly these parameters (for each ``params[i]``, ``shards[i]`` where given:
    the local shard it steps instead). With a ``source`` (the optimizer the user configured, of which
    ``optimizer`` is a copy), each of ``optimizer``'s groups takes the hyper-parameters of the
    source's group ``source_groups[i]`` before every step, and the state lives in the source's.
    Without one, ``optimizer`` is used as it is (an optimizer the user made for these parameters).
    """

    optimizer: Optimizer
    params: list[torch.Tensor]
    source: Optional[Optimizer] = None
    source_groups: Sequence[int] = ()
    shards: Optional[list[torch.Tensor]] = None
    arrived: int = field(default=0, init=False)  # gradients accumulated in this backward so far
    streams: set = field(default_factory=set, init=False)  # where they were made (`BucketHooks` with `DeviceStreams`)

    def __post_init__(self) -> None:
        self._shard_state = _ShardState(dict(zip(self.shards, self.params))) if self.shards else None
        library = library_of(self.optimizer)
        self.launch = library.launch_stream
        self._step_context = library.step_context  # what a step runs inside (bitsandbytes: one device sync)
        # FSDP2 shards dim 0 as torch.chunk does: with fewer rows than ranks the last ranks hold none. bitsandbytes'
        # CUDA kernels reject a 0-element launch (and exit the process), so no optimizer is handed one.
        self._empty = [p for p in self.params if _local(p).numel() == 0]

    def step(self, clip: Optional[Callable[[list[torch.Tensor]], None]] = None) -> None:
        """Apply the gradients the bucket's parameters hold, then free them. ``clip`` changes the
        gradients in place first (each a local tensor: a shard's under FSDP)."""
        if clip is not None:
            clip([_local(p.grad) for p in self.params if p.grad is not None])
        if self.source is not None:
            self._sync()
        for param in self._empty:
            param.grad = None
        if self.shards:
            for shard, param in zip(self.shards, self.params):
                shard.grad = None if param.grad is None else param.grad.to_local()
        context = self._step_context(self.optimizer, self.params)
        if context is not None:
            with context:
                self.optimizer.step()
        else:
            self.optimizer.step()
        for param in self.params:
            param.grad = None
        if self.shards:
            for shard in self.shards:
                shard.grad = None

    def _sync(self) -> None:
        # Re-read every step: LR schedulers write the source's groups, load_state_dict replaces its state.
        state = self.source.state
        if self._shard_state is None:
            self.optimizer.state = state
        else:
            self._shard_state.state = state
            self.optimizer.state = self._shard_state
        groups = self.source.param_groups
        for group, index in zip(self.optimizer.param_groups, self.source_groups):
            group.update((k, v) for k, v in groups[index].items() if k != "params")


@dataclass(frozen=True)
class Clipping:
    """Gradient clipping inside the fused step, with the results of clipping after an unfused backward.

    ``max_norm``: every gradient is multiplied by ``max_norm / (total_norm + 1e-6)`` where that is below
    1, ``total_norm`` being the ``norm_type``-norm of all the gradients together (of every rank), as
    `torch.nn.utils.clip_grad_norm_` does. The fused step applies the first bucket before the last
    gradient exists, so `BucketHooks.backward` first runs a backward that only measures the norm
    (LOMO's method): one more backward per step, and no gradient memory, since each gradient is freed
    as soon as its norm is taken.
    ``value``: each gradient is clamped to ``[-value, value]`` before its bucket's step, as
    `torch.nn.utils.clip_grad_value_` does: no extra pass.
    """

    max_norm: Optional[float] = None
    norm_type: float = 2.0
    value: Optional[float] = None

    def __post_init__(self) -> None:
        if self.max_norm is not None and self.value is not None:
            raise UserError("clip gradients either by norm (max_norm) or by value (clip_val), not both")
        for name, setting in (("max_norm", self.max_norm), ("clip_val", self.value), ("norm_type", self.norm_type)):
            if setting is not None and not float(setting) > 0:
                raise UserError(f"{name} must be positive, got {setting!r}")

    @property
    def by_norm(self) -> bool:
        return self.max_norm is not None

    def coefficient(self, total_norm: torch.Tensor) -> torch.Tensor:
        """The factor for every gradient, as `torch.nn.utils.clip_grads_with_norm_` computes it."""
        return torch.clamp(self.max_norm / (total_norm + 1e-6), max=1.0)


class _NormMeter:
    """The ``norm_type``-norm of gradients seen one at a time: the norm of their norms, as
    `torch.nn.utils.get_total_norm` takes it, where a sharded gradient's part is reduced over the
    ranks it is sharded over (a DTensor's shard dimensions, or FSDP1's group) as DTensor reduces a
    partial norm."""

    def __init__(self, norm_type: float) -> None:
        self.norm_type = float(norm_type)
        self.norms: dict[tuple, list[torch.Tensor]] = {}  # process groups the gradients are sharded over -> norms
        self.device = torch.device("cpu")

    def add(self, grad: torch.Tensor, group: Any = None) -> None:
        local = _local(grad)
        norms = self.norms.setdefault(_shard_groups(grad, group), [])  # the group takes part in the all-reduce even with nothing here
        self.device = local.device
        if local.numel():  # an empty shard adds nothing to a p-norm and has no infinity norm
            norms.append(torch.linalg.vector_norm(local, self.norm_type))

    def total(self) -> torch.Tensor:
        import torch.distributed as dist

        p = self.norm_type
        parts = []
        for groups, norms in self.norms.items():
            part = torch.linalg.vector_norm(torch.stack(norms), p) if norms else torch.zeros((), device=self.device)
            if groups:
                part = part if p == float("inf") else part**p
                for group in groups:
                    dist.all_reduce(part, dist.ReduceOp.MAX if p == float("inf") else dist.ReduceOp.SUM, group=group)
                part = part if p == float("inf") else part ** (1.0 / p)
            parts.append(part)
        if not parts:
            return torch.tensor(0.0)
        return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), p)


def _shard_groups(grad: torch.Tensor, group: Any = None) -> tuple:
    """The process groups a gradient is sharded over: a DTensor's shard dimensions, else ``group`` (FSDP1's)."""
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        return tuple(mesh.get_group(d) for d, place in enumerate(grad.placements) if place.is_shard())
    return () if group is None else (group,)


class _Measure:
    """What a backward that only measures finds, gradient by gradient (each freed after): the norm of all of
    them (clipping by norm) and, with loss scaling, whether any is inf or NaN, per optimizer (``keys``: the
    user's optimizers, in an order every rank shares; GradScaler decides each optimizer's step on its own
    gradients). With loss scaling each gradient is first unscaled in place by GradScaler's own kernel, so
    the norm is that of the unscaled gradients, as clipping after GradScaler's ``unscale_`` sees them."""

    def __init__(self, norm_type: Optional[float], scaling: Optional["LossScaling"], keys: Sequence[int] = ()) -> None:
        self.norms = _NormMeter(norm_type) if norm_type is not None else None
        self.scaling = scaling
        self.keys = list(keys)
        self.inv_scale: Optional[torch.Tensor] = None  # read at the first gradient: the loss is scaled by then
        self.found: dict[tuple[int, torch.device], torch.Tensor] = {}  # (optimizer, device): GradScaler's found_inf
        self.groups: dict[int, Any] = {}  # the process groups the checked gradients are sharded over

    def add(self, grad: torch.Tensor, group: Any = None, key: int = 0) -> None:
        if self.scaling is not None:
            if self.inv_scale is None:
                self.inv_scale = self.scaling.inv_scale()
            local = _local(grad)
            found = self.found.get((key, local.device))
            if found is None:
                found = self.found[key, local.device] = torch.zeros((), device=local.device)
            if local.numel():  # an empty shard (FSDP2's last ranks) has nothing to check, but joins the reduction
                torch._amp_foreach_non_finite_check_and_unscale_([local], found, self.inv_scale.to(local.device))
            self.groups.update((id(g), g) for g in _shard_groups(grad, group))
        if self.norms is not None:
            self.norms.add(grad, group)

    def result(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(the total norm, or None; per key, whether a gradient overflowed on any rank, nonzero if so, or None)."""
        total = self.norms.total() if self.norms is not None else None
        if self.scaling is None:
            return total, None
        found = torch.zeros(len(self.keys), device=self.scaling.scale_device)
        for (key, _), part in self.found.items():
            found[self.keys.index(key)] += part.to(found.device)
        if self.groups:  # an overflow on any rank skips the step on every rank: one reduction for all
            import torch.distributed as dist

            for group in self.groups.values():
                dist.all_reduce(found, dist.ReduceOp.MAX, group=group)
        return total, found


def _drop(bucket: Bucket) -> None:
    """Free a bucket's gradients without stepping it."""
    for param in bucket.params:
        param.grad = None
    for shard in bucket.shards or ():
        shard.grad = None


def _unscale(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> None:
    """GradScaler's unscaling (its kernel, per device and dtype), in place; whether they overflowed was decided
    by the measuring backward."""
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for grad in grads:
        if grad.numel():
            kinds.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), same in kinds.items():
        torch._amp_foreach_non_finite_check_and_unscale_(same, torch.zeros((), device=device), inv_scale.to(device))


class LossScaling:
    """fp16 dynamic loss scaling (torch's ``GradScaler``, as 16-mixed uses it) with the fused step, with the
    unfused step's results: each step either applies the same unscaled gradients (clipped after unscaling,
    as Lightning orders it) or is skipped exactly where GradScaler skips it, and the scale follows the same
    trajectory (backed off after an overflow, grown after ``growth_interval`` clean steps).

    Unfused, GradScaler looks at every gradient after backward before any step. Fused, the first bucket steps
    before the last gradient exists, so `BucketHooks.backward` first runs a backward that only checks
    (LOMO's method; the same pass clipping by norm measures in, shared): each gradient is unscaled in place
    by GradScaler's own kernel, checked and freed. An overflow on any rank (reduced over the ranks the
    gradients are sharded over) skips that optimizer's step, as GradScaler decides each optimizer's step on
    its own gradients: the stepping backward altogether when every optimizer is skipped (always, for the one
    optimizer the strategies fuse); otherwise every bucket of an optimizer that steps unscales its gradients
    with the same kernel and inverse scale before clipping and stepping, and a skipped one's buckets drop
    theirs. At the end of backward the scaler's own ``update`` takes the result (backed off if any overflowed). Cost: one more backward per step (none more when clipping
    by norm already runs it) and one host sync, as GradScaler's ``step`` has.

    ``view`` is the scaler the framework (Lightning's or Fabric's precision plugin, a plain loop) calls
    afterwards: its ``unscale_``/``step``/``update`` see that this backward already did their work.
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.view = ScalerView(self)
        self.skipped: Optional[set[int]] = None  # the last fused backward's skipped optimizers, until update()

    @classmethod
    def of(cls, scaler: Any) -> Optional["LossScaling"]:
        """For a precision's ``scaler``: None without one (or a disabled one)."""
        if isinstance(scaler, ScalerView):
            scaler = scaler.scaling.scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return cls(scaler)

    def inv_scale(self) -> torch.Tensor:
        """As GradScaler's ``unscale_`` computes it (the reciprocal in fp64)."""
        return self._scale().double().reciprocal().float()

    @property
    def scale_device(self) -> torch.device:
        return self._scale().device

    def _scale(self) -> torch.Tensor:
        scale = self.scaler._scale  # made by scaler.scale(loss), which every framework calls before backward
        if scale is None:
            raise UserError(UNSCALED)
        return scale

    def update(self, found_inf: torch.Tensor, skipped: set[int]) -> None:
        """The scale updated by the scaler's own rule, once this backward is over (the scaled loss's graph reads
        the scale: it changes only after the last backward through it); ``skipped``: the optimizers (by id)
        whose step GradScaler would skip."""
        found = found_inf.max() if found_inf.numel() else found_inf.new_zeros(())
        self.scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {found.device: found}
        self.scaler.update()
        self.skipped = skipped


class ScalerView:
    """The user's GradScaler as the framework sees it while the fused step scales: after a fused backward
    (which unscaled, stepped or skipped, and updated the scale) ``unscale_`` does nothing, ``step`` calls the
    optimizer's own step only if GradScaler would have (it finds no gradient left) and ``update`` nothing;
    without one (gradients set by hand) each is the scaler's own. Everything else is the scaler's (``scale``,
    ``get_scale``, ``state_dict``: checkpoints keep its format)."""

    def __init__(self, scaling: LossScaling) -> None:
        self.scaling = scaling

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scaling.scaler, name)

    def unscale_(self, optimizer: Optimizer) -> None:
        if self.scaling.skipped is None:
            self.scaling.scaler.unscale_(optimizer)

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        skipped = self.scaling.skipped
        if skipped is None:
            return self.scaling.scaler.step(optimizer, *args, **kwargs)
        return None if id(optimizer) in skipped else optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        skipped, self.scaling.skipped = self.scaling.skipped, None
        if skipped is None or new_scale is not None:
            self.scaling.scaler.update(new_scale)


def _allow_a_second_backward() -> None:
    """Clipping by norm runs two backwards over one forward. A torch.compile'd backward by default donates
    its saved tensors' memory to its outputs and then refuses a second backward; layers compiled from here
    on keep them, by torch's own switch (process-wide; a little more memory in compiled backwards)."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


# -- the order of a bucket's step and its gradients on a device with streams ------------------------


class DeviceStreams:
    """One device's streams, as the fused step orders its work on them: ``module`` is torch's module for the device
    type (``torch.cuda``; `device_streams` picks it). A test gives a recording one (a fake device handle).

    Where the gradients of a bucket are made and where its optimizer's kernels run can differ:

    - FSDP2 runs the post-accumulate-grad hooks inside its reduce-scatter stream (all-reduce stream under HSDP), a
      non-blocking stream from torch's pool (``foreach_reduce`` in torch/distributed/fsdp/_fully_shard/
      _fsdp_collectives.py: the hooks run in ``device_handle.stream(post_reduce_stream)``); FSDP1 steps its
      in-backward optimizers inside its post-backward stream; on one device, autograd runs a gradient's
      accumulation, and so its hook, on the stream of its forward;
    - torch's optimizers (and anything made of torch ops) launch on torch's current stream, which is where the
      gradient was made: in order. bitsandbytes 0.50 passes no stream to its optimizer kernels (``_optimizer_update_*``
      in bitsandbytes/backends/cuda/ops.py), so they run on the legacy default stream, which a non-blocking stream
      does not synchronise with (`lit_memory.optimizers.Library.launch_stream`).

    ``BucketHooks`` steps every bucket on the compute stream (the default stream): it waits for an event recorded
    where the gradients were made when the bucket completed, runs the whole step with that stream current (the
    library's torch ops, e.g. its zero-initialised first-step state, go where its kernels go) and marks the gradients
    used there (``record_stream``), so their memory is not reused before the step has read them. No host
    synchronisation.

    Why the compute stream for torch's optimizers too, rather than the reduce-scatter stream their hook runs on: the
    caching allocator keeps a pool per stream and reuses no block across them, so a step there would put its
    temporaries and its first-step state in a second pool (reserved memory growing by a bucket's temporaries per
    rank) that the memory model does not replay. On the compute stream every allocation is in the one pool the
    model replays; the step runs one bucket late (as bitsandbytes' always did), so the reduce-scatter still
    overlaps the next layer's backward."""

    def __init__(self, module: Any, device: torch.device) -> None:
        self.module, self.device = module, device

    def current(self) -> Any:
        return self.module.current_stream(self.device)

    def default(self) -> Any:
        return self.module.default_stream(self.device)

    def use(self, stream: Any) -> Any:
        return self.module.stream(stream)

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


def device_streams(device: Optional[torch.device]) -> Optional[DeviceStreams]:
    """The streams of ``device`` where work can run out of program order (CUDA, and devices with its stream
    API); None on the CPU, where it cannot. Module-level so that a test can put a recording handle in its place."""
    if device is None or device.type in ("cpu", "meta"):
        return None
    module = torch.get_device_module(device)
    if not all(hasattr(module, name) for name in ("current_stream", "default_stream", "stream")):
        return None
    return DeviceStreams(module, device)


class BucketHooks:
    """Step each bucket from its parameters' ``register_post_accumulate_grad_hook`` when backward has
    accumulated the last of their gradients; `remove` restores normal stepping.

    A parameter may get no gradient in some backward (a branch the batch did not use): at the end of
    every backward, buckets still waiting are stepped with the gradients they have, as an unfused step
    would skip the parameters without one, so no gradient is held past its backward. The end of
    backward is an autograd engine callback, as torch's FSDP queues its own.

    ``clipping`` clips every bucket's gradients before its step; by norm, and with ``scaling`` (`LossScaling`),
    backward must run through `backward`. Where gradients arrive by another route than the hooks (FSDP1 hands them over after
    reducing a flat parameter), that route calls `arrived`, names the process group in ``groups`` and
    tidies up in ``after_step``.

    ``streams`` (`DeviceStreams`; by default `device_streams` of the parameters' device, None on the CPU) orders
    each step after its gradients. A bucket whose gradients were made on another stream than the compute stream
    its step runs on (FSDP2's reduce-scatter, FSDP1's post-backward) is stepped one bucket later: when the next such bucket completes, or
    at the end of backward. By then the compute stream has been given the next layer's backward, so its wait for
    this reduce-scatter comes after that work and the reduce-scatter still overlaps it; stepped at once, the compute
    stream would wait for each layer's reduce-scatter before the next layer's backward. The cost: one more
    bucket's (sharded) gradients alive.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        clipping: Optional[Clipping] = None,
        streams: Optional[DeviceStreams] = None,
        scaling: Optional[LossScaling] = None,
    ) -> None:
        self.buckets = buckets
        self.clipping = clipping
        self.scaling = scaling
        if self._measures:
            _allow_a_second_backward()
        self.groups: dict[int, Any] = {}  # id(parameter) -> the group its plain-tensor gradient is sharded over
        self.after_step: list[Callable[[Bucket], None]] = []
        first = next((p for b in buckets for p in b.params), None)
        self.streams = streams if streams is not None else device_streams(None if first is None else first.device)
        self._deferred: Optional[tuple[Bucket, list, Any]] = None  # (bucket, events to wait for, its launch stream)
        self._bucket_of = {id(p): bucket for bucket in buckets for p in bucket.params}
        # loss scaling: GradScaler skips each of the user's optimizers on its own gradients (a bucket's source)
        self._optimizer_of = {b: id(b.source if b.source is not None else b.optimizer) for b in buckets}
        self._optimizers = list(dict.fromkeys(self._optimizer_of.values()))
        self._skipping: set[int] = set()  # this backward's optimizers whose buckets drop their gradients
        self._waiting: dict[Bucket, None] = {}  # buckets with some of their gradients (an ordered set)
        self._flushing = -1  # the backward (autograd graph task) whose end steps them
        self._meter: Optional[_Measure] = None  # while a backward only measures
        self._coefficient: Optional[torch.Tensor] = None  # clipping by norm: this backward's factor
        self._inv_scale: Optional[torch.Tensor] = None  # loss scaling: this backward's inverse scale
        self._handles = [p.register_post_accumulate_grad_hook(self.arrived) for b in buckets for p in b.params]

    def arrived(self, param: torch.Tensor) -> None:
        """``param``'s gradient for this backward is complete."""
        if self._meter is not None:  # a backward that only measures: take the norm, free the gradient
            self._meter.add(param.grad, self.groups.get(id(param)), self._optimizer_of[self._bucket_of[id(param)]])
            param.grad = None
            return
        if self.clipping is not None and self.clipping.by_norm and self._coefficient is None:
            raise UserError(UNMEASURED)
        if self.scaling is not None and self._inv_scale is None:
            raise UserError(UNSCALED if self.scaling.scaler._scale is None else UNCHECKED)
        backward = torch._C._current_graph_task_id()  # by id, not a flag: a failed backward runs no callback
        if backward != self._flushing:
            self._flushing = backward
            # Runs after every callback queued before it: FSDP2's (queued when backward starts), which
            # delivers the root module's gradients, comes first.
            Variable._execution_engine.queue_callback(self._flush)
        bucket = self._bucket_of[id(param)]
        bucket.arrived += 1
        if self.streams is not None:
            bucket.streams.add(self.streams.current())
        if bucket.arrived < len(bucket.params):
            self._waiting[bucket] = None
            return
        self._waiting.pop(bucket, None)
        self._step(bucket)

    @property
    def _measures(self) -> bool:
        return (self.clipping is not None and self.clipping.by_norm) or self.scaling is not None

    def backward(self, run: Callable[..., Any], **kwargs: Any) -> Optional[torch.Tensor]:
        """``run(**kwargs)``: a backward, during which the buckets step. Clipping by norm or scaling the loss, a
        first ``run(retain_graph=True)`` only measures: the total norm (returned) and which optimizers'
        gradients overflowed (their step is skipped; all of them: no second backward)."""
        if not self._measures:
            run(**kwargs)
            return None
        by_norm = self.clipping is not None and self.clipping.by_norm
        meter = self._meter = _Measure(self.clipping.norm_type if by_norm else None, self.scaling, self._optimizers)
        try:
            run(**{**kwargs, "retain_graph": True})
            total, found_inf = meter.result()
        finally:
            self._meter = None
        skipped: set[int] = set()
        if found_inf is not None:
            skipped = {key for key, found in zip(self._optimizers, found_inf.tolist()) if found}  # the one host sync
            if len(skipped) == len(self._optimizers):
                self.scaling.update(found_inf, skipped)
                return total  # skipped, as GradScaler skips the step
        self._coefficient = self.clipping.coefficient(total) if by_norm else None
        self._inv_scale = meter.inv_scale if self.scaling is not None else None
        self._skipping = skipped
        try:
            run(**kwargs)
        finally:
            self._coefficient = self._inv_scale = None  # every backward measures its own
            self._skipping = set()
        if found_inf is not None:
            self.scaling.update(found_inf, skipped)
        return total

    def _clip(self, grads: list[torch.Tensor]) -> None:
        if self._inv_scale is not None:  # GradScaler's order: unscale, then clip
            _unscale(grads, self._inv_scale)
        if self._coefficient is not None:
            for grad in grads:
                grad.mul_(self._coefficient.to(grad.device))
        elif self.clipping is not None and self.clipping.value is not None:
            for grad in grads:
                grad.clamp_(-self.clipping.value, self.clipping.value)

    def _step(self, bucket: Bucket, defer: bool = True) -> None:
        """Step ``bucket`` (all its gradients are here), ordered after them where they were made."""
        if self.streams is None:
            self._run(bucket)
            return
        target = self.streams.default()  # the compute stream: one allocator pool (`DeviceStreams`)
        made = [stream for stream in bucket.streams if stream != target]
        if not made:  # made on the stream its optimizer launches on: in order already
            self._run(bucket)
            return
        events = [self.streams.record(stream) for stream in made]
        if defer:  # step the one deferred before, defer this one
            previous, self._deferred = self._deferred, (bucket, events, target)
            if previous is None:
                return
            bucket, events, target = previous
        self._run_after(bucket, events, target)

    def _run_after(self, bucket: Bucket, events: list, target: Any) -> None:
        for event in events:
            self.streams.wait(target, event)
        with self.streams.use(target):
            for param in bucket.params:
                if param.grad is not None:
                    self.streams.used_on(_local(param.grad), target)
            self._run(bucket)

    def _run(self, bucket: Bucket) -> None:
        bucket.arrived = 0
        bucket.streams.clear()
        if self._skipping and self._optimizer_of[bucket] in self._skipping:
            _drop(bucket)  # GradScaler skips this optimizer's step: its gradients are only freed
        else:
            bucket.step(self._clip if self.clipping is not None or self.scaling is not None else None)
        for callback in self.after_step:
            callback(bucket)

    def _flush(self) -> None:
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self._run_after(*deferred)
        waiting, self._waiting = self._waiting, {}
        for bucket in waiting:
            self._step(bucket, defer=False)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class OptimizerInBackward:
    """Step ``optimizer`` bucket by bucket inside backward; `remove` restores normal stepping.

    ``optimizer`` stays the one that Lightning, LR schedulers and checkpoints use; its buckets step
    copies of it (`copy_bucket`). ``units``: the model's parameters in the units a ``layer`` bucket
    steps together, in the model's parameter order (`lit_memory.anatomy.parameter_units`: each
    transformer layer, each other module's own parameters); parameters in no unit are one bucket each.
    ``bucket``: a `Bucketing` or the setting as written (`parse_bucket`).
    ``clipping``: see `Clipping`; by norm, run backward through `backward`.
    ``streams``: see `BucketHooks` (by default the parameters' device's).
    ``scaler``: the loop's ``torch.amp.GradScaler`` (fp16): the loss it scales is unscaled and checked inside
    backward (`LossScaling`); run backward through `backward`, and call `scaler` (the scaler's view) where
    the loop called the GradScaler, or nothing: the scale is already updated.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        units: Optional[Sequence[Sequence[torch.Tensor]]] = None,
        bucket: Any = DEFAULT_BUCKET,
        clipping: Optional[Clipping] = None,
        streams: Optional[DeviceStreams] = None,
        scaler: Any = None,
    ) -> None:
        self.optimizer, self.units, self.clipping = optimizer, list(units or ()), clipping
        self.bucket = parse_bucket(bucket)
        self.streams = streams
        self.scaling = LossScaling.of(scaler)
        self._fuse()

    @property
    def scaler(self) -> Optional[ScalerView]:
        """The GradScaler as the loop sees it after a fused backward (`ScalerView`); None without one."""
        return self.scaling.view if self.scaling is not None else None

    def _fuse(self) -> None:
        self._trainable = self._signature()
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        groups = group_parameters(params, self.units, self.bucket)
        buckets = [copy_bucket(self.optimizer, group) for group in groups]
        self.hooks = BucketHooks(buckets, self.clipping, self.streams, self.scaling)

    def _signature(self) -> tuple:
        return tuple((id(p), p.requires_grad) for group in self.optimizer.param_groups for p in group["params"])

    def refresh(self) -> None:
        """Re-fuse if the optimizer's trainable parameters changed (a parameter group added, parameters
        unfrozen or frozen, as Lightning's `BaseFinetuning` does between epochs): a parameter without a
        hook would be stepped only after backward, its gradient held through it. One pass over the
        parameters' flags: call it before every backward."""
        if self._signature() != self._trainable:
            self.hooks.remove()
            self._fuse()

    def backward(self, run: Callable[..., Any], **kwargs: Any) -> Optional[torch.Tensor]:
        """Run backward (``run(**kwargs)``) as the clipping needs (`BucketHooks.backward`)."""
        return self.hooks.backward(run, **kwargs)

    @property
    def steps_shards(self) -> bool:
        """Whether some bucket steps local shards (bitsandbytes under FSDP2): their state is checkpointed by
        `lit_memory.eightbit_shards`, not by torch's optimizer state dict."""
        return any(bucket.shards for bucket in self.hooks.buckets)

    @torch.no_grad()
    def initialize_state(self) -> None:
        """Create the optimizer state as a first step would, one bucket at a time on zero gradients and
        a zero learning rate, if it does not exist yet.

        torch's distributed checkpoint loads optimizer state into existing state, and creates it
        otherwise (``_init_optim_state``) with a zero gradient for every parameter at once and a full
        unfused step: a full set of gradients, on exactly the setups that cannot afford one. Here at
        most one bucket's zero gradients exist at a time.
        """
        if self.optimizer.state:
            return
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:  # as torch does: lr 0 leaves the parameters as they are
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        try:
            for bucket in self.hooks.buckets:
                for param in bucket.params:
                    param.grad = torch.zeros_like(param)
                bucket.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr

    def remove(self) -> None:
        self.hooks.remove()


# -- which parameters share a bucket ---------------------------------------------------------------


def group_parameters(
    params: list[torch.Tensor], units: Sequence[Sequence[torch.Tensor]], setting: Any
) -> list[list[torch.Tensor]]:
    """``params`` split into buckets by ``setting`` (see the module docstring), in the order backward
    produces their gradients: the units' parameter order reversed (parameters in no unit last).
    ``layer``: a bucket per unit; ``param``: per parameter; a size: consecutive parameters up to it."""
    bucketing = parse_bucket(setting)
    wanted = {id(p) for p in params}
    ordered = [[p for p in reversed(unit) if id(p) in wanted] for unit in reversed(units)]
    ordered = [unit for unit in ordered if unit]
    seen = {id(p) for unit in ordered for p in unit}
    ordered += [[p] for p in params if id(p) not in seen]
    if bucketing.kind == "layer":
        return ordered
    order = [p for unit in ordered for p in unit]
    if bucketing.kind == "param":
        return [[p] for p in order]
    sized: list[list[torch.Tensor]] = []
    size = 0
    for p in order:
        nbytes = gradient_bytes(p)
        if sized and size + nbytes <= bucketing.size_bytes:
            sized[-1].append(p)
            size += nbytes
        else:
            sized.append([p])
            size = nbytes
    return sized


def gradient_bytes(param: torch.Tensor) -> int:
    """Bytes of the gradient this process holds for ``param`` (its local shard under FSDP2)."""
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    return local.numel() * local.element_size()


# -- a bucket of the configured optimizer ----------------------------------------------------------


def copy_bucket(optimizer: Optimizer, params: list[torch.Tensor]) -> Bucket:
    """A bucket stepping ``params`` (some of ``optimizer``'s) with a copy of ``optimizer`` that
    optimises exactly them, as the original would: one group per original group they come from
    (`lit_memory.optimizers.copy_for`).
    """
    wanted = {id(p) for p in params}
    entries = [
        (g, i, p) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"]) if id(p) in wanted
    ]
    shards = [_local_shard(optimizer, p) for _, _, p in entries]
    bucket_optimizer, source_groups = copy_for(optimizer, [(g, i, p, p if s is None else s) for (g, i, p), s in zip(entries, shards)])
    has_shards = any(s is not None for s in shards)
    return Bucket(
        bucket_optimizer,
        [p for _, _, p in entries],
        source=optimizer,
        source_groups=source_groups,
        shards=[p if s is None else s for (_, _, p), s in zip(entries, shards)] if has_shards else None,
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (sharing its storage), else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_shard(optimizer: Optimizer, param: torch.Tensor) -> Optional[torch.Tensor]:
    """Where the tensor a bucket's optimizer steps is decided.

    torch optimizers step FSDP2's sharded (DTensor) parameters directly. bitsandbytes' kernels know
    nothing of DTensor, so its copies step this rank's local shard: a plain tensor sharing the
    parameter's storage, so updating it updates the parameter.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and library_of(optimizer).steps_local_shards:
        return param.to_local().detach()
    return None


class _ShardState:
    """The original optimizer's state (keyed by the sharded parameters, as its ``state_dict`` needs)
    as seen by a copy that steps local shards: bitsandbytes reads ``state[t]`` and ``t in state``,
    memory trackers iterate ``values()``/``items()`` (this bucket's parameters)."""

    def __init__(self, param_of: dict[torch.Tensor, torch.Tensor]) -> None:
        self.param_of = param_of  # local shard -> its sharded parameter
        self.state: dict = {}

    def __getitem__(self, tensor: torch.Tensor) -> dict:
        return self.state[self.param_of.get(tensor, tensor)]

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return self.param_of.get(tensor, tensor) in self.state

    def items(self) -> list[tuple[torch.Tensor, dict]]:
        return [(shard, self.state[param]) for shard, param in self.param_of.items() if param in self.state]

    def values(self) -> list[dict]:
        return [state for _, state in self.items()]
