"""Train a tiny random BERT for a few steps with a given strategy; used by tests/test_strategies.py.

Run in the test process (one device) or as a script (new processes: resuming, and FSDP, whose
launcher re-executes ``sys.argv`` for the other ranks, which must not be pytest):

    python tests/fused_worker.py OUT --strategy fused-fsdp --devices 2 [--resume CKPT] [--clip norm:0.5] [--optimizer
    torchao-8bit] [--fp16]

The data is fixed and unshuffled, 6 batches per epoch; a checkpoint is kept after every epoch
(step 6, ...) with every rank's random-number state (`lit_memory.run.resume.ExactResume`), so a
resumed run sees exactly the batches and dropout masks the uninterrupted run saw. At the end the
model is exported as the CLI does it (``OUT/hf_model``, gathered from the shards under FSDP) and
rank 0 writes the final full parameters to ``OUT/params.pt`` and each step's gradient norm (and with
``--fp16`` the loss scale after it) to ``OUT/norms.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

if __name__ == "__main__":  # a script: import this checkout's lit_memory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_memory.model import SequenceClassifier  # noqa: E402
from lit_memory.run.export import full_state_dict  # noqa: E402
from lit_memory.run.resume import ExactResume  # noqa: E402
from lit_memory.strategies import FSDP2Strategy, FusedFSDPStrategy, FusedSingleDeviceStrategy  # noqa: E402

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
STRATEGIES = {
    "single": lambda: "auto",
    "fused-single": FusedSingleDeviceStrategy,
    "fsdp": FSDP2Strategy,
    "fused-fsdp": FusedFSDPStrategy,
}
BATCH, BATCHES_PER_EPOCH, LENGTH = 4, 6, 16


def torchao_8bit(params) -> torch.optim.Optimizer:
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=1e-3, weight_decay=0.01)


OPTIMIZERS = {"adamw": None, "torchao-8bit": torchao_8bit}  # --optimizer: None is tiny_bert's AdamW
# A first scale that overflows and quick growth: the first steps and the step after each growth are skipped.
FP16_SCALER = {"init_scale": 2.0**20, "growth_interval": 2, "growth_factor": 2.0**4}


class RecordingScaler(torch.amp.GradScaler):
    """torch's GradScaler, keeping the scale after each update (fused or not, the scaler's own update runs)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scales: list[float] = []

    def update(self, new_scale=None) -> None:
        super().update(new_scale)
        self.scales.append(self.get_scale())


def fp16_plugin():
    """16-mixed on the CPU: fp16 autocast with its own GradScaler (Lightning turns a CPU's 16-mixed into
    bf16, so the precision comes as a plugin)."""
    from lightning.pytorch.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", RecordingScaler("cpu", **FP16_SCALER))


class Scales(Callback):
    """The loss scale after each step (the scaler backs off after a skipped step)."""

    def __init__(self) -> None:
        self.scales = []

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.scaler is not None:
            self.scales.append(trainer.scaler.get_scale())


def tiny_bert(optimizer=None, dropout: float = 0.1, schedule: str = "linear", cls=SequenceClassifier):
    overrides = {**TINY, "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01))
    return cls(
        "bundled:bert-large",
        pretrained=False,
        config_overrides=overrides,
        optimizer=optimizer,
        lr_scheduler_type=schedule,
        warmup_ratio=0.3,
    )


def batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (n, LENGTH), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]


class GradientNorms(Callback):
    """Per step, before Lightning's optimizer step: the global gradient norm and the largest gradient value
    (unfused: of the gradients about to be clipped; fused, by norm: what the measuring backward found),
    and how many gradients are held (fused: none). Under FSDP every rank takes part; rank 0 keeps them."""

    def __init__(self) -> None:
        self.norms, self.largest, self.held = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.held.append(len(grads))
        if grads:
            norm = torch.nn.utils.get_total_norm(grads)
            self.norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
            largest = torch.stack([g.abs().max() for g in grads]).max()
            self.largest.append((largest.full_tensor() if isinstance(largest, DTensor) else largest).item())
        elif getattr(trainer.strategy, "total_norm", None) is not None:
            self.norms.append(trainer.strategy.total_norm.item())


def train(
    out: Path,
    strategy: str = "fused-single",
    devices: int = 1,
    steps: int = 10,
    resume: Optional[str] = None,
    model: Optional[SequenceClassifier] = None,
    callbacks: Optional[list[Callback]] = None,
    clip: Optional[str] = None,
    fp16: bool = False,
) -> SequenceClassifier:
    """``clip``: ``norm:0.5`` or ``value:0.01``, the trainer's gradient_clip_algorithm and gradient_clip_val;
    ``fp16``: 16-mixed (`fp16_plugin`)."""
    L.seed_everything(42)
    model = model or tiny_bert()
    # Its own generator: a DataLoader otherwise draws from the global random state every epoch, which
    # a resumed run (restoring that state after the checkpoint's step) would not repeat.
    samples, generator = batches(BATCH * BATCHES_PER_EPOCH * devices), torch.Generator().manual_seed(0)
    data = DataLoader(samples, batch_size=BATCH, shuffle=False, generator=generator)
    algorithm, value = clip.split(":") if clip else (None, None)
    norms, scales = GradientNorms(), Scales()
    trainer = L.Trainer(
        strategy=STRATEGIES[strategy](),
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        gradient_clip_algorithm=algorithm,
        gradient_clip_val=None if value is None else float(value),
        limit_val_batches=0,
        plugins=[fp16_plugin()] if fp16 else None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[
            ModelCheckpoint(out / "checkpoints", save_top_k=-1, every_n_train_steps=BATCHES_PER_EPOCH),
            ExactResume(),
            norms,
            scales,
            *(callbacks or []),
        ],
    )
    trainer.fit(model, data, ckpt_path=resume)
    params = full_state_dict(model.model)  # a collective under FSDP: every rank calls it
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(params, out / "params.pt")
        torch.save(
            {"norms": norms.norms, "largest": norms.largest, "held": norms.held, "scales": scales.scales},
            out / "norms.pt",
        )
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", choices=STRATEGIES, default="fused-single")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--resume")
    parser.add_argument("--clip", help="norm:MAX_NORM or value:CLIP_VALUE")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--fp16", action="store_true", help="16-mixed with a GradScaler that overflows (fp16_plugin)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = tiny_bert(OPTIMIZERS[args.optimizer])
    train(args.out, args.strategy, args.devices, resume=args.resume, model=model, clip=args.clip, fp16=args.fp16)


if __name__ == "__main__":
    main()
