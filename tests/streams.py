"""A fake device handle for the fused step's stream seam (`lit_memory.fused.DeviceStreams`), and a probe of what each
fused bucket step was handed, for tests in this process and for runs the tests start.

The CPU runs work in program order, but FSDP2 and FSDP1 switch torch.cpu's *current stream* object as they switch
CUDA's (torch.cpu.stream is their device handle's context): the reduce-scatter / post-backward stream while their
hooks run. `Recording` reads those objects, and records instead of synchronising: which stream each event was
recorded on, what waited for it, where each optimizer step ran.

In a run the tests start: ``--trainer.callbacks+=streams.Probe --trainer.callbacks.out DIR`` puts a `Recording` in
every rank's fused step and writes ``DIR/rank{N}.pt`` at the end of training (`Probe.summary`).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lit_memory import fused
from lit_memory.fused import hooks


class Recording(fused.DeviceStreams):
    """torch.cpu's streams, recorded: ``log`` holds ("record", stream, event), ("wait", stream, event),
    ("used", stream) and ("step", stream, optimizer, sizes): sizes are the local numbers of values of the tensors
    with a gradient an optimizer step was handed."""

    def __init__(self) -> None:
        super().__init__(torch.cpu, torch.device("cpu"))
        self.default_stream = torch.cpu.current_stream()  # made outside FSDP's contexts: the default one
        self.log: list[tuple] = []
        self._events = itertools.count()
        self._hook = register_optimizer_step_pre_hook(self._step)

    def default(self) -> Any:
        return self.default_stream

    def record(self, stream: Any) -> Any:
        event = next(self._events)
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream: Any, event: Any) -> None:
        self.log.append(("wait", stream, event))

    def used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        self.log.append(("used", stream))

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        sizes = [_local(p).numel() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.log.append(("step", torch.cpu.current_stream(), optimizer, sizes))

    def remove(self) -> None:
        self._hook.remove()

    def steps(self) -> list[dict[str, Any]]:
        """Per optimizer step that was handed gradients: the stream it ran on, the streams of the events it waited
        for since the previous step, and the sizes it was handed."""
        recorded_on = {entry[2]: entry[1] for entry in self.log if entry[0] == "record"}
        out, waited = [], []
        for entry in self.log:
            if entry[0] == "wait":
                waited.append(recorded_on[entry[2]])
            elif entry[0] == "step" and entry[3]:
                out.append({"on": entry[1], "waited": waited, "optimizer": entry[2], "sizes": entry[3]})
                waited = []
        return out


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Probe(Callback):
    """Each rank's fused step ordered through a `Recording`, its bitsandbytes device syncs counted; at the end of
    training ``out/rank{N}.pt`` holds `summary`."""

    def __init__(self, out: str) -> None:
        import bitsandbytes.optim.optimizer as bnb_optimizer

        self.out = Path(out)
        self.recording = Recording()
        hooks.device_streams = lambda device: self.recording  # before the strategy fuses the optimizer
        self.syncs = 0
        sync = bnb_optimizer.sync_gpu

        def counted(tensor: torch.Tensor) -> None:
            self.syncs += 1
            sync(tensor)

        bnb_optimizer.sync_gpu = counted
        self.empty_shards = 0

    def on_train_start(self, trainer, pl_module) -> None:
        # (the optimizer's: FSDP2's sharded parameters; the module's root holds them gathered after a forward)
        self.empty_shards = sum(_local(p).numel() == 0 for g in trainer.optimizers[0].param_groups for p in g["params"])
        self.recording.log.clear()  # training's steps only (a resume first makes the state one bucket at a time)
        self.syncs = 0
        buckets = trainer.strategy._fused.hooks.buckets
        # buckets with values here: the others' optimizers are handed no gradient
        self.buckets = sum(any(_local(p).numel() for p in bucket.params) for bucket in buckets)

    def on_train_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.summary(), self.out / f"rank{trainer.global_rank}.pt")

    def summary(self) -> dict[str, Any]:
        default = self.recording.default_stream
        steps = self.recording.steps()
        return {
            "steps": len(steps),
            "buckets": self.buckets,
            "empty_shards": self.empty_shards,  # parameters of which this rank holds no values
            "smallest_handed": min(min(s["sizes"]) for s in steps),  # values of the smallest tensor an optimizer got
            "on_default": sum(s["on"] is default for s in steps),  # steps run on the default stream
            # steps that waited for an event recorded on another stream (where FSDP made the gradients)
            "ordered": sum(bool(s["waited"]) and all(w is not default for w in s["waited"]) for s in steps),
            "syncs": self.syncs,  # bitsandbytes' device synchronisations
        }

