"""A training step as the caching allocator sees it: the analytic model's allocations and frees, in order.

The analytic model (`lit_memory.planning.prediction.analytic`) knows each phase's tensors; the allocator's reserved
memory depends on the order and sizes in which they come and go. `events` writes them out: the parameters
and buffers as the model is moved to the device, then two optimizer steps (the first creates the optimizer
state lazily, as torch's optimizers do, so it lands in whatever the first step's activations freed), each
a forward pass layer by layer (`lit_memory.memory.model.layers.layer_tensors`: kept tensors and temporaries),
backward layer by layer in reverse (saved tensors released, gradient temporaries, parameter gradients
allocated or accumulated, the fused step's buckets stepped and freed), and the optimizer step with its
temporaries. `lit_memory.memory.hardware.allocator.replay` then replays it.

It is coarser than a real step (one event per tensor the models above name, none for the many small
scalars a step also makes); the analytic model uses the replay for what the allocator adds on top of
the tensors, not for the tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lit_memory.memory.hardware.allocator import Event
from lit_memory.memory.model.layers import Tensor


@dataclass
class Param:
    bytes: int
    trainable: bool
    layer: Optional[int]  # transformer layer index; None: embeddings (first) or head (last)
    head: bool = False  # outside the layers, after them (pooler, classifier)
    copy: int = 0  # autocast's 16-bit copy of this weight (linear weights that run under autocast)
    # Where in its layer's backward autograd makes the gradient (AccumulateGrad runs right after the weight's
    # matmul backward): "down", the FFN's output projection, first thing; "up", its input projection(s),
    # once backward reaches the FFN's input; None: the attention block and norms, at the layer's end.
    made_at: Optional[str] = None


@dataclass
class LayerRun:
    tensors: list[Tensor]  # per token, in forward order
    trains: bool  # has a backward (at or above the first trainable layer)
    input_kept: bool  # the layer's input is among what it keeps (no autocast)
    # "full", "selective" (`lit_memory.run.activation_checkpointing.CheckpointPlan`) or None
    checkpoint: Optional[str] = None


@dataclass
class StepModel:
    """What `events` needs, from the analytic model's meta build."""

    params: list[Param]
    buffers: int
    batch: int
    tokens: int
    hidden_bytes: int  # one token of the residual stream (h * p)
    layers: list[LayerRun]
    states: list[list[int]]  # per param (same order): the optimizer state tensors its first step creates
    step_temps: list[list[int]]  # per optimizer call (foreach group or parameter): temporaries alive together
    buckets: list[list[int]] = field(default_factory=list)  # fused: param indices per bucket, gradient order
    bucket_temps: list[list[int]] = field(default_factory=list)  # fused: temporaries of each bucket's step
    embeddings: list[Tensor] = field(default_factory=list)  # per token, kept when the embeddings train
    head: list[int] = field(default_factory=list)  # bytes kept by the pooler/classifier (whole tensors)
    selective: int = 0  # per token per selective layer, selective checkpointing's kept matmul outputs
    offload: bool = False
    fused: bool = False
    measures: bool = False  # fused: a first backward that only measures (clipping by norm, loss scaling)
    accumulate: int = 1
    gradients: str = "after_step"  # the loop's release (`lit_memory.planning.prediction.step.Loop`)
    autocast_cache: bool = False
    backward_temp: int = 0  # per token: gradients of activations in flight in a layer's backward
    workspace: int = 0  # cuBLAS workspace per thread (CUDA)
    shards: int = 1  # FSDP ranks: parameters, gradients and state are 1/shards
    gathers: bool = False  # FSDP2: a unit's parameters gathered while used (on one rank too: copies of the shards)


class _Trace:
    """The events, and for the picture of a step (`timeline`) each allocation's category and the marks that name
    where in the step the events are (``marking``: the steady-state step only)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._next = 0
        self.kinds: dict[int, str] = {}  # key -> category (weights, gradients, optimizer, activations, other)
        self.marks: list[tuple[int, str]] = []  # (events so far, label)
        self.marking = False

    def alloc(self, size: int, kind: str = "other") -> Optional[int]:
        if size <= 0:
            return None
        self._next += 1
        self.events.append(("+", self._next, int(size)))
        self.kinds[self._next] = kind
        return self._next

    def mark(self, label: str) -> None:
        if self.marking:
            self.marks.append((len(self.events), label))

    def free(self, *keys: Optional[int]) -> None:
        for key in keys:
            if key is not None:
                self.events.append(("-", key))

    def phase(self, name: str) -> None:
        self.events.append(("phase", name))


def events(m: StepModel) -> list[Event]:
    return trace(m).events


def timeline(m: StepModel) -> list[dict]:
    """The steady-state step as points a picture draws (`lit_memory.memory.measure.picture`): at each mark (each
    layer's forward, each layer's backward, each fused bucket's step or the optimizer step), and at the highest
    point between two marks, the bytes alive per category. What the allocator reserves is not in it."""
    t = trace(m)
    live = dict.fromkeys(("weights", "gradients", "optimizer", "activations", "other"), 0)
    sizes: dict[int, int] = {}
    points: list[dict] = []
    marks = iter(t.marks)
    mark = next(marks, None)
    started = False  # from the first mark on (the steady state's micro-batch)
    peak, peak_live = -1, dict(live)
    for index, event in enumerate(t.events, start=1):
        if event[0] == "+":
            sizes[event[1]] = event[2]
            live[t.kinds[event[1]]] += event[2]
        elif event[0] == "-":
            live[t.kinds[event[1]]] -= sizes.pop(event[1], 0)
        total = sum(live.values())
        if started and total > peak:
            peak, peak_live = total, dict(live)
        while mark is not None and mark[0] == index:
            if started and peak > total:  # the highest point since the last mark, where it was above this one
                points.append({"label": f"{mark[1]} (peak)", "categories": peak_live, "between": True})
            points.append({"label": mark[1], "categories": dict(live)})
            mark = next(marks, None)
            started = True
            peak, peak_live = -1, dict(live)
    return points


def trace(m: StepModel) -> _Trace:
    t = _Trace()
    t.phase("setup")
    n = m.shards
    labels = bucket_labels(m)
    for p in m.params:  # the model moved to the device, parameter by parameter (never freed)
        t.alloc(-(-p.bytes // n), "weights")
    t.alloc(m.buffers, "weights")
    grads: dict[int, Optional[int]] = {}
    states: dict[int, list[Optional[int]]] = {}
    workspaces: list[Optional[int]] = []
    layer_params: dict[Optional[int], list[int]] = {}
    for i, p in enumerate(m.params):
        layer_params.setdefault(p.layer if not p.head else "head", []).append(i)

    def grad(i: int) -> None:
        """Parameter i's gradient arrives: allocated (under FSDP a shard after its reduce-scatter), or added
        into the existing one (accumulating, or zeroed in place) through a temporary."""
        size = -(-m.params[i].bytes // n)
        if grads.get(i) is None:
            grads[i] = t.alloc(size, "gradients")
        else:
            t.free(t.alloc(size, "other"))

    def free_grads(indices) -> None:
        for i in indices:
            t.free(grads.pop(i, None))

    def step_optimizer(indices, temps) -> None:
        for i in indices:
            if i not in states:
                states[i] = [t.alloc(-(-s // n), "optimizer") for s in m.states[i]]
        for group in temps:
            t.free(*[t.alloc(-(-s // n), "optimizer") for s in group])

    def micro_batch(accumulating: bool) -> None:
        t.phase("forward")
        if not workspaces:
            workspaces.append(t.alloc(m.workspace, "other"))
        batch = t.alloc(m.batch, "other")
        forward_keys = _forward(t, m, layer_params)
        if m.gradients == "before_backward" and not accumulating:
            free_grads(list(grads))
        t.phase("backward")
        if len(workspaces) == 1:
            workspaces.append(t.alloc(m.workspace))  # autograd's backward thread has a cuBLAS handle of its own
        if m.fused and m.measures:  # a first backward that only measures (norm, overflow), keeping the graph
            _backward(t, m, forward_keys, layer_params, lambda i: t.free(t.alloc(m.params[i].bytes)), keep=True)
        done: set[int] = set()

        def arrived(i: int) -> None:
            grad(i)
            if m.fused:
                done.add(i)
                for b, bucket in enumerate(m.buckets):
                    if i in bucket and all(j in done for j in bucket):
                        step_optimizer(bucket, m.bucket_temps[b] if b < len(m.bucket_temps) else [])
                        t.mark(labels[b])
                        free_grads(bucket)

        _backward(t, m, forward_keys, layer_params, arrived, keep=False)
        t.free(batch)

    for step in range(2):  # the first step creates the optimizer state; the second is the steady state
        micros = 2 if m.accumulate > 1 else 1
        for micro in range(micros):
            t.marking = step == 1 and micro == micros - 1  # the picture: the steady state's last micro-batch
            if t.marking:
                t.mark("start")
            micro_batch(accumulating=micro > 0)
        t.phase("step")
        if not m.fused:
            step_optimizer([i for i, p in enumerate(m.params) if p.trainable], m.step_temps)
            t.mark("optimizer step")
            if m.gradients == "after_step":
                free_grads(list(grads))
                t.mark("gradients freed")
        t.marking = False
    return t


def bucket_labels(m: StepModel) -> list[str]:
    """Each fused bucket's step named by what it holds, in forward order (``step: layers 21-23``, ``step: layer 23 +
    head``, ``step: embeddings``; several buckets of one part are numbered in forward order, ``step: embeddings
    (2 of 3)``): the points' order is backward's, and the names say where in the model each is."""
    names = []
    for bucket in m.buckets:
        params = [m.params[i] for i in bucket]
        layers = sorted({p.layer + 1 for p in params if p.layer is not None})
        parts = ["embeddings"] if any(p.layer is None and not p.head for p in params) else []
        if layers:
            parts.append(f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}")
        if any(p.head for p in params):
            parts.append("head")
        names.append("step: " + " + ".join(parts))
    total = {name: names.count(name) for name in names}
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if total[name] > 1:
            seen[name] = seen.get(name, 0) + 1
            names[i] = f"{name} ({seen[name]} of {total[name]})"
    return names


# Tensors a layer keeps that have no gradient: masks, statistics, the kernel's bias and log-sum-exp.
NO_GRADIENT = ("mask", "stats", "dropout", "logsumexp", "bias")


def _run_layer(t: _Trace, layer: LayerRun, tokens: int) -> list[tuple[str, Optional[int]]]:
    """One layer's forward: allocate its tensors in order, free the temporaries; return what it keeps."""
    kept = []
    for tensor in layer.tensors:
        if tensor.name == "input":
            continue  # the previous layer's output
        key = t.alloc(tensor.bytes * tokens, "activations")
        if tensor.kept:
            kept.append((tensor.name, key))
        else:
            t.free(key)
    return kept


def _forward(t: _Trace, m: StepModel, layer_params) -> dict:
    """The forward pass: returns what backward will release, per layer."""
    tokens = m.tokens
    keys: dict = {"layers": {}, "copies": {}, "gathered": {}}
    gather = m.gathers
    cache: list[Optional[int]] = []  # autocast's weight cache: alive to the end of the forward pass

    def copies(layer_key, trains: bool) -> list[Optional[int]]:
        made = [t.alloc(m.params[i].copy, "other") for i in layer_params.get(layer_key, []) if m.params[i].copy]
        if m.autocast_cache and any(m.params[i].trainable for i in layer_params.get(layer_key, [])):
            cache.extend(made)
            return []
        if not trains:
            t.free(*made)
            return []
        return made

    if gather:  # the root unit (embeddings, head) is gathered from its forward to the end of backward
        root = layer_params.get(None, []) + layer_params.get("head", [])
        keys["gathered"]["root"] = t.alloc(sum(m.params[i].bytes for i in root), "weights")
    emb = [t.alloc(x.bytes * tokens, "activations") for x in m.embeddings]
    keys["embeddings"] = [k for k, x in zip(emb, m.embeddings) if x.kept]
    t.free(*[k for k, x in zip(emb, m.embeddings) if not x.kept])
    previous = t.alloc(m.hidden_bytes * tokens, "activations")  # the embeddings' output: the first layer's input
    t.mark("forward: embeddings")
    for index, layer in enumerate(m.layers):
        if gather:
            keys["gathered"][index] = t.alloc(sum(m.params[i].bytes for i in layer_params.get(index, [])), "weights")
        layer_copies = copies(index, layer.trains)
        kept = _run_layer(t, layer, tokens)
        if not layer.trains:
            t.free(*[key for _, key in kept])
            kept = []
        output = t.alloc(m.hidden_bytes * tokens, "activations")
        if layer.input_kept and layer.trains:
            kept.insert(0, ("input", previous))
        else:
            t.free(previous)  # consumed by the layer's residual add
        if layer.checkpoint and layer.trains:
            # only the layer's input (and selective's matmul outputs) stays; backward recomputes the rest
            t.free(*[key for _, key in kept], *layer_copies)
            kept = [("checkpoint_input", None if m.offload else t.alloc(m.hidden_bytes * tokens, "activations"))]
            if layer.checkpoint == "selective":
                kept.append(("selective", t.alloc(m.selective * tokens, "activations")))
            layer_copies = []
        keys["layers"][index] = kept
        keys["copies"][index] = layer_copies
        if gather:
            t.free(keys["gathered"].pop(index))
        previous = output
        t.mark(f"forward: layer {index + 1}")
    keys["head"] = [t.alloc(size, "activations") for size in m.head]
    t.mark("forward: head and loss")
    keys["last"] = previous  # the last hidden state (the pooler's input)
    t.free(*cache)  # autocast's context ends with the forward pass
    return keys


def _backward(t: _Trace, m: StepModel, keys: dict, layer_params, arrived, keep: bool) -> None:
    """Backward, layer by layer from the top; ``arrived(i)`` when parameter i's gradient is made; ``keep``:
    retain the graph (the fused step's norm-measuring backward). Inside a layer the gradient flows back
    through its tensors in reverse, each one's gradient (as large as it) made as the next is released."""
    tokens = m.tokens
    gather = m.gathers
    for i in layer_params.get("head", []):
        if m.params[i].trainable:
            arrived(i)
    if not keep:
        t.free(*keys["head"], keys["last"])
    incoming = t.alloc(m.hidden_bytes * tokens, "other")  # the gradient of the residual stream
    for index in reversed(range(len(m.layers))):
        layer = m.layers[index]
        if not layer.trains:
            break
        if gather:
            gathered = t.alloc(sum(m.params[i].bytes for i in layer_params.get(index, [])), "weights")
        saved = list(keys["layers"].get(index, []))
        recomputed: list[tuple[str, Optional[int]]] = []
        copies: list[Optional[int]] = []
        if layer.checkpoint:
            if m.offload:
                recomputed.append(("input", t.alloc(m.hidden_bytes * tokens, "activations")))  # back from the host
            copies = [t.alloc(m.params[i].copy, "other") for i in layer_params.get(index, []) if m.params[i].copy]
            recomputed += _run_layer(t, layer, tokens)
        unsharded = (
            [t.alloc(m.params[i].bytes, "gradients") for i in layer_params.get(index, []) if m.params[i].trainable]
            if gather
            else []
        )
        # what this layer's backward releases: the recomputed tensors, or (unless the graph is kept) the saved ones
        live = dict(recomputed) if layer.checkpoint else ({} if keep else dict(saved))
        trained = [i for i in layer_params.get(index, []) if m.params[i].trainable]
        made_at = {stage: [i for i in trained if m.params[i].made_at == stage] for stage in ("down", "up", None)}
        for i in made_at["down"]:
            arrived(i)
        gradient = None
        for tensor in reversed(layer.tensors):
            if not any(word in tensor.name for word in NO_GRADIENT):
                made = t.alloc(tensor.bytes * tokens, "other")
                t.free(gradient)
                gradient = made
            if tensor.name == "ffn_in":
                for i in made_at["up"]:
                    arrived(i)
            if tensor.name in live:
                t.free(live.pop(tensor.name))
        t.free(gradient)
        for i in made_at[None] + [i for i in made_at["up"] if not any(x.name == "ffn_in" for x in layer.tensors)]:
            arrived(i)
        t.free(*unsharded)
        t.free(*[key for _, key in live.items()], *copies)
        if not keep:
            t.free(*[key for name, key in saved if layer.checkpoint], *keys["copies"].get(index, []))
        outgoing = t.alloc(m.hidden_bytes * tokens, "other")
        t.free(incoming)
        incoming = outgoing
        if gather:
            t.free(gathered)
        if not keep:
            t.mark(f"backward: layer {index + 1}")
    for i in layer_params.get(None, []):
        if m.params[i].trainable:
            arrived(i)
    if not keep:
        t.free(*keys["embeddings"])
        if gather:
            t.free(keys["gathered"].pop("root", None))
    t.free(incoming)
    if not keep:
        t.mark("backward: embeddings")
