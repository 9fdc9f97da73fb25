"""Known noise from the libraries a run uses, filtered by message so every other warning stays visible."""

from __future__ import annotations

import logging
import warnings

# Lightning's notice that tensorboardX is optional (the CSV logger it picks instead is what we want), its
# use of a pytree API torch deprecated, the model summary's note that it sizes bf16 weights as fp32, and
# torch's note, at the first compile of torchao's step, that its state tensors cannot key the AOT autograd cache.
NOISE = (
    r"Starting from v1\.9\.0, `tensorboardX` has been removed",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Precision .* is not supported by the model summary",
    r"OptimState\w+ does not implement _stable_hash_for_caching",  # torchao's state: compiles, is not cached
    # Lightning's advice to log more often than a short run has batches: the progress lines carry the loss.
    r"The number of training batches \(\d+\) is smaller than the logging interval",
    # Lightning's prediction writer would like batch indices, which a streamed file has no sampler for: every
    # row carries its own (`lit_memory.run.predict_file`).
    r"Couldn't infer the batch indices fetched from your dataloader",
)
# Outside fit: a checkpoint holds the state of the callbacks that resume a fit exactly (`lit_memory.run.resume`), which
# validate/test/predict neither have nor need; Lightning advises adding them.
EVALUATION_NOISE = (
    r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided",
)


class _DropTips(logging.Filter):
    """Lightning's advertisements for its cloud products, among its info lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_evaluation_noise() -> None:
    """`EVALUATION_NOISE` off, for a process that runs validate, test or predict."""
    for message in EVALUATION_NOISE:
        warnings.filterwarnings("ignore", message=message)


def quiet_known_noise() -> None:
    lightning_info = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropTips) for f in lightning_info.filters):
        lightning_info.addFilter(_DropTips())
    for message in NOISE:
        warnings.filterwarnings("ignore", message=message)
