"""``hf_model/README.md``: the model card written with every export, in the Hugging Face layout.

The YAML front matter is huggingface_hub's (`ModelCardData`: ``library_name``, ``pipeline_tag``, ``base_model``,
``tags``, ``datasets`` and a ``model-index`` with the validation metrics), so the hub shows it as its own; the text
says what the model does (task, labels, thresholds), what it learned from (each split's size and where it came
from), how well (the validation metrics of the exported step, as the run logged them), how it was trained (the
command, the settings that shape a run, the steps), the memory it took on which device, and how to load it.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any, Optional

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from lit_memory import task as task_
from lit_memory.memory.measure import records
from lit_memory.run.best import best_of

TAGS = ["lit_memory", "text-classification"]
# Metrics by the names the hub knows (https://hf.co/metrics), by what this project logs.
HUB_METRIC = {"acc": "accuracy", "f1": "f1", "f1_macro": "f1", "f1_micro": "f1", "mcc": "matthews_correlation",
              "mse": "mse", "pearson": "pearsonr", "spearman": "spearmanr", "loss": "loss"}


def validation_metrics(trainer: Any) -> tuple[Optional[int], dict[str, float]]:
    """The validation metrics of the exported step, as logged: the best checkpoint's (`BestCheckpoint`), else the
    last validation's."""
    best = best_of(trainer) if trainer is not None else None
    if best is not None and best.best_metrics:
        return best.best_step(), dict(best.best_metrics)
    if trainer is None:
        return None, {}
    found = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    return (trainer.global_step if found else None), found


def _hub_name(name: str) -> Optional[str]:
    """A model or dataset name as the hub knows it (``org/name``), None for local paths and bundled ones."""
    if name.startswith("bundled:") or Path(name).expanduser().exists() or name.count("/") != 1:
        return None
    return name


def _device(trainer: Any) -> str:
    import torch  # deferred: only for a CUDA device's name

    device = trainer.strategy.root_device
    if device.type == "cuda":
        return f"{trainer.num_devices} x {torch.cuda.get_device_name(device)}"
    return f"CPU ({platform.processor() or platform.machine()})"


def build(module: Any, trainer: Any = None, run_dir: Optional[Path] = None) -> str:
    """The card's text for ``module`` (a `lit_memory.model.SequenceClassifier`) as trained by ``trainer`` (None: a
    module exported outside a run: what the model itself knows) in ``run_dir`` (its memory record; asked of the
    trainer by every rank before: ``trainer.log_dir`` is a collective under several processes)."""
    hp = module.hparams
    kind, names = module.kind, list(module.label_names)
    data = getattr(trainer, "datamodule", None) if trainer is not None else None
    step, metrics = validation_metrics(trainer)
    source = str(data.hparams.source) if data is not None else None
    where = data.where if data is not None else None
    dataset = _hub_name(source) if source else None
    results = []
    for key, value in sorted(metrics.items()):
        short = key.removeprefix("val_")
        if short in HUB_METRIC and "_at_" not in short:
            results.append(
                EvalResult(
                    task_type="text-classification",
                    dataset_type=dataset or Path(source or "data").suffix.lstrip(".") or "data",
                    dataset_name=where or "validation",
                    dataset_split="validation",
                    metric_type=HUB_METRIC[short],
                    metric_name=short,
                    metric_value=round(value, 4),
                )
            )
    base = _hub_name(str(hp.model_name_or_path))
    card = ModelCardData(
        library_name="transformers", pipeline_tag="text-classification", tags=TAGS + [kind.title.replace(" ", "-")],
        base_model=base, datasets=[dataset] if dataset else None, model_name="hf_model",
        eval_results=results or None,
    )
    lines = [f"# A {kind.title} model fine-tuned with lit_memory", ""]
    lines += _task(module, kind, names)
    if data is not None:
        lines += _data(data)
    lines += _results(step, metrics)
    lines += _training(module, trainer, data, run_dir)
    lines += _usage(module, kind)
    return str(ModelCard(f"---\n{card.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


def _task(module: Any, kind: task_.ProblemKind, names: list[str]) -> list[str]:
    lines = ["## Task", "",
             f"- problem type: `{kind.name}` ({kind.title}), base model: `{module.hparams.model_name_or_path}`"]
    if kind.has_classes:
        lines.append(f"- labels ({len(names)}, in id order): " + ", ".join(f"`{n}`" for n in names))
    found = module.decision_thresholds
    if found is not None:
        lines.append(f"- {found.describe(names, kind)}; in `config.json` as `thresholds` "
                     "(a label is predicted where its probability is at least its threshold)")
    if module.loss_weights is not None:
        lines.append(
            f"- loss {kind.weight_name} "
            f"({module.hparams.class_weights if isinstance(module.hparams.class_weights, str) else 'as set'}): "
            + ", ".join(f"{n} {w:.3g}" for n, w in zip(names, module.loss_weights.tolist()))
        )
    return lines + [""]


def _data(data: Any) -> list[str]:
    said = data.summary.removeprefix("data: ") if data.summary else f"from {data.where}"
    return ["## Data", "", said, ""]


def _results(step: Optional[int], metrics: dict[str, float]) -> list[str]:
    if not metrics:
        return ["## Results", "", "No validation ran: the exported weights are the last.", ""]
    lines = ["## Results", "", f"Validation at step {step}, the step exported (as the run logged it):", "",
             "| metric | value |", "|---|---:|"]
    lines += [f"| {k.removeprefix('val_')} | {v:.4f} |" for k, v in sorted(metrics.items())]
    return lines + [""]


def _training(module: Any, trainer: Any, data: Any, run_dir: Optional[Path]) -> list[str]:
    hp = module.hparams
    lines = ["## Training", ""]
    if trainer is None:
        return lines + ["Exported outside a training run.", ""]
    optimizer = getattr(trainer, "optimizers", None)
    inner = getattr(optimizer[0], "optimizer", optimizer[0]) if optimizer else None
    lr = inner.param_groups[0].get("lr") if inner is not None else None
    lines += [
        f"- {trainer.global_step} optimizer steps over {trainer.current_epoch} epoch(s), precision "
        f"`{trainer.precision}`, optimizer `{type(inner).__module__}.{type(inner).__name__}`"
        + (f" (lr {lr:g})" if lr is not None else "") + f", schedule `{hp.lr_scheduler_type}`",
        f"- gradient checkpointing `{hp.gradient_checkpointing}`, freeze `{hp.freeze}`, LoRA `{hp.lora is not None}`",
    ]
    if data is not None:
        dh = data.hparams
        lines.append(f"- batch {dh.batch_size} x max_length {dh.max_length} ({dh.padding} padding), long texts "
                     f"`{dh.long_texts}`" + (f" (stride {dh.stride})" if dh.long_texts == "chunk" else ""))
    run_dir = Path(run_dir if run_dir is not None else trainer.default_root_dir)
    lines.append("- every setting: `config.yaml` and `recipe.yaml` (to share and rerun) in the run folder")
    peak = records.peak_summary(run_dir)
    lines.append(f"- measured peak memory: {peak or 'not measured'}, on {_device(trainer)}")
    return lines + [""]


def _usage(module: Any, kind: task_.ProblemKind) -> list[str]:
    names = module.label_names
    lines = ["## How to use", "", "```python", "from transformers import pipeline", "",
             'texts = ["your first text", "your second text"]',
             'classifier = pipeline("text-classification", model="path/to/hf_model", top_k=None)']
    lines += kind.usage(names, module.decision_thresholds is not None)
    lines += ["```", "", "or `python -m lit_memory predict --config RUN/config.yaml --model.model_name_or_path "
              "RUN/hf_model --data.predict_path texts.csv`, which applies the thresholds itself."]
    return lines + [""]
