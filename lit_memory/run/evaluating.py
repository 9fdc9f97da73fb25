"""What `lit_memory.model.SequenceClassifier`'s evaluation hooks do: its metrics fed with the model's decisions, the
thresholds tuned at a validation's end, the per-class report, and ``predict``'s outputs and metrics."""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torchmetrics import MeanMetric, MetricCollection

from lit_memory.console import say
from lit_memory.hf import windows
from lit_memory.hf.anatomy import Anatomy
from lit_memory.task import class_weights as weights_
from lit_memory.task import evaluation
from lit_memory.task import thresholds as thresholds_


def logits(module: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A batch's logits, one row per text (``doc``: its windows' aggregated, `lit_memory.hf.windows`), and the loss
    where it has labels (weighted where class weights are set)."""
    labels, doc = batch.get("labels"), batch.get("doc")
    if doc is None and module.loss_weights is None and isinstance(labels, torch.Tensor) and "known" not in batch:
        out = module.model(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return out.logits, out.loss
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in ("labels", "known", "doc")}
    found = module.model(**inputs).logits
    if doc is not None:
        found = windows.aggregate(found, doc, module.kind)
    if not isinstance(labels, torch.Tensor) or "known" in batch:
        return found, None
    return found, weights_.loss(found, labels, module.kind, module.loss_weights)


def say_thresholds(module: Any, trainer: Any) -> None:
    if module.decision_thresholds is not None and trainer is not None and trainer.is_global_zero:
        say(module.decision_thresholds.describe(module.label_names, module.kind))


def tuning_now(module: Any, trainer: Any) -> bool:
    """Thresholds are chosen at every validation of ``fit`` (its sanity check's are not kept)."""
    return module.sweep is not None and trainer is not None and trainer.state.fn == "fit"


def step(module: Any, batch: dict[str, torch.Tensor], metrics: MetricCollection, stage: str) -> None:
    """A validation or test batch: its decisions into the metrics (or the sweep, while tuning), its loss logged."""
    found, loss = logits(module, batch)
    kind = module.kind
    labels = kind.metric_targets(batch["labels"])
    kind.before_evaluation()
    tuning = tuning_now(module, module.trainer)
    if tuning:  # its metrics come from the sweep, at the thresholds it chooses (epoch end)
        module.sweep.update(kind.probabilities(found), kind.sweep_targets(labels))
    else:
        limits = module.decision_thresholds.tensor if module.decision_thresholds is not None else None
        predicted = thresholds_.decide(found, kind, limits)
        metrics.update(predicted, labels)
        if module.per_label_f1 is not None:
            module.per_label_f1.update(predicted, labels)
        if module.class_counts is not None:
            module.class_counts.update(predicted, labels)
        module.log_dict(metrics, prog_bar=True)
    at_default = module.val_at_default if stage == "val" else module.test_at_default
    if at_default is not None and (tuning or thresholds_.differ_from_default(module.decision_thresholds)):
        default = torch.full((kind.threshold_count(found.shape[-1]),), thresholds_.DEFAULT)
        at_default.update(thresholds_.decide(found, kind, default), labels)
        module.log_dict(at_default)
    # Averaged over the ranks at the epoch's end (the metric objects synchronise themselves).
    module.log(f"{stage}_loss", loss, prog_bar=True, batch_size=labels.shape[0], sync_dist=True)


def tune(module: Any, stage: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The thresholds this validation's sweep chooses (kept, unless a sanity check), its metrics at them logged;
    returns the confusion counts and per-label F1 there."""
    trainer, hparams = module.trainer, module.hparams
    counts = module.sweep.compute()  # a collective under several processes: every rank computes
    module.sweep.reset()
    kind, num_labels = module.kind, hparams.num_labels
    index = thresholds_.choose(counts, module.tuning, kind, hparams.threshold_metric)
    chosen = thresholds_.at(counts, index)
    preds, targets = thresholds_.replay(chosen, kind)  # counts summed over the ranks already: no sync
    metrics = evaluation.task_metrics(kind, num_labels, sync_on_compute=False).clone(prefix=f"{stage}_")
    metrics.update(preds, targets)
    for name, value in metrics.compute().items():
        module.log(name, float(value), prog_bar=True)
    per_label = None
    f1 = kind.per_label_f1(num_labels, sync_on_compute=False)
    if f1 is not None:
        f1.update(preds, targets)
        per_label = f1.compute()
    if not trainer.sanity_checking:
        values = tuple(round(v, 2) for v in thresholds_.GRID[index.cpu()].tolist())
        how = "each label's F1" if module.tuning == "per_label" else (
            kind.tuned_for(module.tuning, hparams.threshold_metric))
        origin = f"tuned on validation at step {trainer.global_step} for {how}"
        module.decision_thresholds = thresholds_.Thresholds(values, origin)
    return thresholds_.confusion(chosen, kind), per_label


def end(module: Any, stage: str, trainer: Any) -> None:
    """Per-label F1 logged (multi-label); at the end of ``validate`` and ``test``, the per-class report and the
    confusion matrix (printed, and a PNG in the run folder); during ``fit``, the thresholds tuned, and a
    validation that predicts one class only (multi-label: the same labels for every row) noted."""
    counts, per_label = None, None
    if tuning_now(module, trainer):
        counts, per_label = tune(module, stage)
    else:
        if module.per_label_f1 is not None:
            per_label = module.per_label_f1.compute()
            module.per_label_f1.reset()
        if module.class_counts is not None:
            counts = module.class_counts.compute()  # a collective under several processes: every rank computes
            module.class_counts.reset()
    if per_label is not None:
        for name, score in zip(module.label_names, per_label.tolist()):
            module.log(f"{stage}_f1_{evaluation.metric_name(name)}", score)
    if counts is None or trainer is None or trainer.sanity_checking:
        return
    if stage == "val":
        module.validation_counts = counts  # the best-model record keeps its best's (`lit_memory.run.best`)
    if trainer.state.fn == "fit" and stage == "val":
        found = evaluation.one_sided(counts, module.label_names, module.kind, module.loss_weights is not None)
        if found:
            module.degenerate[trainer.global_step] = found
    if trainer.state.fn not in ("validate", "test"):
        return
    report(module, stage, counts, trainer)


def report(module: Any, stage: str, counts: torch.Tensor, trainer: Any, title: str = "") -> None:
    """The per-class report of an evaluation's confusion counts, printed by the global-zero process, and for
    single-label its confusion matrix drawn into the run folder (``fit`` reports its exported step's so)."""
    if trainer is None:
        return
    run_dir = trainer.log_dir or trainer.default_root_dir  # a collective under several processes: every rank asks
    if not trainer.is_global_zero:
        return
    weights = module.loss_weights.tolist() if module.loss_weights is not None else None
    print(evaluation.report(stage, counts, module.label_names, module.kind, title, weights=weights))
    if module.kind.draws_confusion and run_dir and Path(run_dir).is_dir():
        path = Path(run_dir) / f"confusion_matrix_{stage}.png"
        drawn = evaluation.draw_confusion(counts, module.label_names, path, f"{stage}{title}: confusion matrix")
        print(f"confusion matrix: {drawn}" if drawn else "confusion matrix: no picture (matplotlib is not installed)")


# -- predict -----------------------------------------------------------------------------------


def predict_start(module: Any) -> None:
    """Fresh metrics for a ``predict`` (made here, not in a fit's model summary)."""
    module.predict_labelled = False
    module.predict_results = {}
    module.predict_metrics = module.val_metrics.clone(prefix="predict_").to(module.device)
    module.predict_metrics.reset()
    module.predict_loss = MeanMetric().to(module.device)


def predict_step(module: Any, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A batch's predictions (``outputs``: class probabilities, the value, or each label's probability); where
    it has ``labels``, the metrics of the rows the model can score (``known``) are accumulated too, for
    `predict_end`. Windows of one text (``doc``) are aggregated first: one prediction per text."""
    with fp32_output(module.model):  # what is written is fp32, not a 16-bit autocast's (1.609375)
        found, _ = logits(module, batch)
    found = found.float()
    kind = module.kind
    labels = batch.get("labels")
    if labels is not None and module.predict_metrics is not None:  # (made by Lightning's predict loop)
        known = batch["known"] if "known" in batch else labels >= 0
        module.predict_labelled = True
        if known.any():
            limits = module.decision_thresholds.tensor if module.decision_thresholds is not None else None
            predicted = thresholds_.decide(found[known], kind, limits)
            targets = labels[known]
            kind.before_evaluation()
            module.predict_metrics.update(predicted, kind.metric_targets(targets))
            module.predict_loss.update(kind.loss(found[known], targets, reduction="none"))
    return {"outputs": kind.written(found)}


def predict_end(module: Any) -> None:
    """``predict_results``: the metrics over the labelled rows, where there were any."""
    # Every rank has as many batches, labelled or not alike, and joins the metrics' synchronisation (even one
    # whose rows all had labels the model does not know: its loss is then NaN, and nothing is reported).
    if module.predict_labelled:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method")
            results = {**module.predict_metrics.compute(), "predict_loss": module.predict_loss.compute()}
        if not math.isnan(float(results["predict_loss"])):
            module.predict_results = {k: float(v) for k, v in results.items()}


@contextlib.contextmanager
def fp32_output(model: nn.Module):
    """For the length of the block, the model's output layer (its head's last linear layer: the logits) computes in
    fp32 outside autocast, from its input and weights upcast: predictions written at fp32's precision, not bf16's 8
    bits (the body runs as the recipe says)."""
    anatomy = Anatomy.of(model)
    linears = [m for _, part in anatomy.head for m in part.modules() if isinstance(m, nn.Linear)]
    if not linears:
        yield
        return
    layer = linears[-1]

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = layer.bias.float() if layer.bias is not None else None
            return torch.nn.functional.linear(hidden.float(), layer.weight.float(), bias)

    layer.forward = forward  # an instance attribute over the class's forward, removed after
    try:
        yield
    finally:
        del layer.forward
