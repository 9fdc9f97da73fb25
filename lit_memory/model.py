"""A LightningModule around Hugging Face's `AutoModelForSequenceClassification`.

The Hugging Face config is read in `__init__` (cheap, and it fails early on a bad name); the
model itself is built in `configure_model`, so sharded strategies and low-precision init
contexts create it directly where and how it will train.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from torchmetrics import MeanMetric, MetricCollection
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from lit_memory import task as task_
from lit_memory.console import RunningLoss, logging_step, say
from lit_memory.errors import UserError
from lit_memory.hf import bundled, qlora
from lit_memory.hf.anatomy import Anatomy, find_layers, skeleton, unwrap
from lit_memory.hf.config import (
    DTYPES,
    config_label_names,
    label_names_or_default,
    load_config,
    quiet_transformers,
    report_loading,
    saved_dtype,
    set_pad_token,
)
from lit_memory.hf.lora import LoRA, apply_lora, lora_targets
from lit_memory.optim import configure, optimizers

# Named here too, for the examples that import them from the model's module.
from lit_memory.optim.configure import (
    default_optimizer,
    weight_decay_groups,  # noqa: F401
)
from lit_memory.optim.eightbit import EmbeddingState, check_stable_embedding, swap_stable_embedding
from lit_memory.run import evaluating, export
from lit_memory.run.activation_checkpointing import CheckpointPlan, OffloadActivations, enable_gradient_checkpointing
from lit_memory.run.best import best_of, restore_best
from lit_memory.run.checks import check_optimizer
from lit_memory.run.compiling import CUDA_GRAPHS, Compile, compile_layers
from lit_memory.run.export import full_state_dict  # noqa: F401
from lit_memory.sandbox import guard
from lit_memory.sandbox.rules import phase
from lit_memory.settings import Precision
from lit_memory.task import class_weights as weights_
from lit_memory.task import evaluation
from lit_memory.task import thresholds as thresholds_

log = logging.getLogger(__name__)

Freeze = Optional[Union[Literal["body", "embeddings"], int]]
# true is "full" (every layer's forward recomputed in backward), as it always was; counts are a per-layer plan
# (`lit_memory.run.activation_checkpointing.CheckpointPlan`); auto is resolved for a device budget before the module is
# built.
Checkpointing = Union[bool, Literal["full", "selective", "auto"], dict[str, int]]
SaveDtype = Literal["checkpoint", "fp32", "bf16", "fp16"]



class SequenceClassifier(L.LightningModule):
    """Fine-tune (or train from scratch) a Hugging Face sequence classifier (every argument: docs/guide.md).

    Args:
        model_name_or_path: hub name, local folder, or ``bundled:minilm`` / ``bundled:bert-large``.
        num_labels: number of classes, 1 for regression; null: what the training labels show, else the config's.
        problem_type: ``single_label_classification``, ``multi_label_classification`` or ``regression``; null: inferred.
        threshold: a fixed decision threshold (multi-label: every label's; binary: class 1's); wins over tuned ones.
        tune_threshold: ``per_label``, ``global``, ``off`` or ``auto``: thresholds chosen on validation, then saved.
        threshold_metric: what a binary ``global`` threshold maximises: ``f1``, ``mcc``, ``acc`` or ``f1_macro``.
        class_weights: ``none``, ``balanced`` (from the training labels' counts) or one weight per class.
        pretrained: load the checkpoint's weights; ``false``: the architecture with random weights.
        config_overrides: keyword overrides for the Hugging Face config (e.g. ``num_hidden_layers``).
        tokenizer_name_or_path: defaults to ``model_name_or_path``.
        gradient_checkpointing: ``false``, ``true``/``full``, ``selective``, ``{full: F, selective: S}`` or ``auto``.
        offload_activations: checkpointed layers' inputs to pinned host memory (``true``, ``false``, ``auto``).
        freeze: ``body``, ``embeddings``, or N (the embeddings and the first N layers); the head always trains.
        optimizer: any optimizer class path with its init args; `DEFAULT_OPTIMIZER` (AdamW, lr 2e-5, decay 0.01).
        embedding_optimizer_state: a low-bit optimizer's embedding state: ``auto``, ``32bit``, ``unquantized``,
            ``stable_embedding`` or ``8bit``.
        lora: LoRA adapters (peft): ``rank``, ``alpha``, ``dropout``, ``target_modules``; merged before export.
        lr_scheduler_type: a transformers schedule name, stepped every optimizer step; ``constant`` by default.
        warmup_ratio: fraction of the optimizer steps spent warming up.
        save_pretrained: at the end of fit, save model and tokenizer into ``<run folder>/hf_model``.
        save_dtype: the dtype ``hf_model/`` is saved in: ``checkpoint`` (its own), ``fp32``, ``bf16`` or ``fp16``.
        compile: ``torch.compile`` each transformer layer; ``cudagraphs``: also replayed as CUDA graphs.
    """

    # Arguments that change no matrix product or attention a training step computes: the optimizer's state layout
    # (``stable_embedding`` adds a LayerNorm: element-wise), where kept tensors wait, the schedule, the export. A FLOP
    # count is keyed without them (`lit_memory.planning.recompute`); an argument not named here is counted (tests check
    # that each named one leaves the count as it is).
    SAME_FLOPS = frozenset(
        {
            "embedding_optimizer_state",
            "offload_activations",
            "lr_scheduler_type",
            "warmup_ratio",
            "save_pretrained",
            "save_dtype",
        }
    )
    # Arguments the saved weights depend on (their architecture, shapes, modules and vocabulary, what the outputs mean):
    # loading a checkpoint, a typed value other than its own is refused (`lit_memory.cli.LitMemoryCLI`); any other
    # typed value wins over it. How the optimizer keeps its state is not here: a resumed fit compares it
    # (`lit_memory.run.resume.RESUME_KEYS`), and an evaluation does not step.
    FIXED_BY_WEIGHTS = frozenset(
        {"model_name_or_path", "tokenizer_name_or_path", "num_labels", "problem_type", "lora", "config_overrides"}
    )

    def __init__(
        self,
        model_name_or_path: str = "bundled:minilm",
        num_labels: Optional[int] = None,
        problem_type: Optional[task_.ProblemType] = None,
        threshold: Optional[float] = None,
        tune_threshold: thresholds_.Tune = "auto",
        threshold_metric: thresholds_.Objective = "f1",
        class_weights: Optional[weights_.ClassWeights] = "none",
        pretrained: bool = True,
        config_overrides: Optional[dict[str, Any]] = None,
        tokenizer_name_or_path: Optional[str] = None,
        gradient_checkpointing: Checkpointing = False,
        offload_activations: Union[bool, Literal["auto"]] = False,
        freeze: Freeze = None,
        optimizer: OptimizerCallable = default_optimizer,
        embedding_optimizer_state: EmbeddingState = "auto",
        lora: Optional[LoRA] = None,
        lr_scheduler_type: str = "constant",
        warmup_ratio: float = 0.0,
        save_pretrained: bool = True,
        save_dtype: SaveDtype = "checkpoint",
        compile: Compile = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer"])
        if num_labels is not None and (isinstance(num_labels, bool) or num_labels < 1):
            raise UserError(f"model.num_labels must be at least 1 (1: regression), got {num_labels}")
        # The setting read once (the YAML's and the command line's string); None: the config's own, or the rule.
        given = task_.kind_of(problem_type) if problem_type is not None else None
        if given is not None:
            given.check_num_labels(num_labels)
        if threshold is not None and not 0.0 < threshold < 1.0:
            raise UserError(f"model.threshold must be in (0, 1), got {threshold}")
        configure.check_schedule(lr_scheduler_type, warmup_ratio)
        if save_dtype != "checkpoint" and save_dtype not in DTYPES:
            raise UserError(f"model.save_dtype {save_dtype!r} is not one of: checkpoint, {', '.join(DTYPES)}")
        if offload_activations == "auto":
            raise UserError(
                "model.offload_activations: auto is decided with gradient_checkpointing auto, before the model is "
                "built (`python -m lit_memory fit/estimate` do it)"
            )
        # Parsed once: what `build_model` switches on (the hyper-parameter keeps the setting as given).
        self.checkpoint_plan: Optional[CheckpointPlan] = CheckpointPlan.parse(gradient_checkpointing)
        plan = self.checkpoint_plan
        if offload_activations and plan is None:
            raise UserError(
                "model.offload_activations needs model.gradient_checkpointing (full or selective): without it every "
                "activation of every layer would cross to host memory and back each step"
            )
        if offload_activations and compile:
            raise UserError(
                "model.offload_activations does not work with model.compile: compiled layers hand their weights to "
                "autograd's saved-tensor hooks, which would copy them to host memory every step; drop one of the two"
            )
        # Entered around each training forward pass (saved-tensor hooks), reused across steps.
        self.activation_offload = OffloadActivations() if offload_activations else None
        check_optimizer(optimizer)  # its own checks and shared ranges, before anything trains
        self.optimizer_factory = optimizer
        # hparams hold plain data (LightningCLI's config, a checkpoint's dict): keep the dataclass here.
        self.lora = LoRA(**lora) if isinstance(lora, dict) else lora
        if self.lora is not None:
            self.lora.check()
        self.hf_config = load_config(model_name_or_path, num_labels, config_overrides, given)
        # Read now: building the model writes the dtype it is built in over the config's (transformers' from_config).
        self.checkpoint_dtype: Optional[torch.dtype] = saved_dtype(self.hf_config, model_name_or_path)
        # Resolved: what checkpoints and the saved hyper-parameters hold (the config's own where none was given).
        num_labels = self.hf_config.num_labels
        # The kind the module is from here on: the config's problem type (Hugging Face's field), read once.
        self.kind: task_.ProblemKind = task_.kind_of(self.hf_config.problem_type)
        kind = self.kind
        self.hparams.update(num_labels=num_labels, problem_type=kind.name)
        _check_freeze(freeze, self.hf_config.num_hidden_layers)
        if plan is not None:
            modes = plan.modes(self.hf_config.num_hidden_layers)  # counts beyond the model's layers: one error line
            if offload_activations and None in modes:
                raise UserError(
                    f"model.offload_activations needs every layer checkpointed, and "
                    f"{plan.describe(self.hf_config.num_hidden_layers)} leaves some whole: all their activations "
                    "would cross to host memory and back each step"
                )
        set_pad_token(self.hf_config, tokenizer_name_or_path or model_name_or_path)
        if self.lora is not None or embedding_optimizer_state == "stable_embedding":
            # Settings that name the model's parts, checked on a meta-device copy before anything is written.
            parts = skeleton(self.hf_config)
            if self.lora is not None:
                if self.lora.quantised:  # first: nothing else matters where bitsandbytes has nothing to quantise
                    qlora.check_quantisable(parts)
                lora_targets(parts, self.lora)
                self._head_names = parts.head_names  # what a 4-bit base keeps unquantised (it trains)
            if embedding_optimizer_state == "stable_embedding":
                check_stable_embedding(parts.word_embeddings)
        self.model: Optional[PreTrainedModel] = None
        # The precision the module is built for where no trainer says it (the memory model's builds): `precision`.
        self.built_for: Optional[Precision] = None
        # What decides (`lit_memory.task.thresholds`) and what the loss weighs (`lit_memory.task.class_weights`):
        # checked here.
        self.tuning = thresholds_.tuning(kind, num_labels, tune_threshold, threshold, threshold_metric)
        weights_.check(class_weights, kind, num_labels)
        self.loss_weights: Optional[torch.Tensor] = None  # resolved in `setup` (balanced: the training labels')
        # Metrics of the problem type (`lit_memory.task.evaluation`), fed with the model's decisions; per-label F1 and
        # the confusion counts beside them; where thresholds decide, the same metrics at 0.5 and the sweep that tunes.
        # (Fed 0/1 decisions, any threshold of theirs in (0, 1) reads them alike: they carry the one set, for the eye.)
        metric_threshold = threshold if threshold is not None else thresholds_.DEFAULT
        self.val_metrics = evaluation.task_metrics(kind, num_labels, metric_threshold).clone(prefix="val_")
        self.test_metrics = self.val_metrics.clone(prefix="test_")
        self.sweep = thresholds_.Sweep(kind.threshold_count(num_labels)) if self.tuning else None
        self.per_label_f1 = kind.per_label_f1(num_labels, metric_threshold)
        self.class_counts = (evaluation.ClassCounts(kind, num_labels, metric_threshold)
                             if kind.has_classes else None)
        self.degenerate: dict[int, str] = {}  # step -> the line saying its validation predicted one class (or none)
        self.predict_metrics: Optional[MetricCollection] = None  # made at predict (not in a fit's model summary)
        self.predict_loss: Optional[MeanMetric] = None
        self.predict_results: dict[str, float] = {}  # the metrics of the last predict over labelled inputs
        self.predict_labelled = False
        self._amp_scaling = False  # GradScaler's scale taken by the fused kernel (`configure_optimizers`)
        self.report_new_head = True  # off where a checkpoint is loaded after the model is built (the CLI says)
        self.validation_counts: Optional[torch.Tensor] = None  # the last validation's confusion counts
        self.running_loss = RunningLoss()  # the training loss since it was last logged (`on_train_batch_end`)
        self.progress_loss = RunningLoss()  # ... since the last progress line (`lit_memory.console.LogProgress`)
        self._progress_step = -1
        # Class names in id order: the data's (set in `setup` when fitting), a checkpoint's, or the model config's
        # own (a fine-tuned folder's id2label); None: transformers' default names.
        self._label_names: Optional[list[str]] = config_label_names(self.hf_config)
        saved, where = getattr(self.hf_config, thresholds_.CONFIG_KEY, None), f"{model_name_or_path}'s config.json"
        self.decision_thresholds: Optional[thresholds_.Thresholds] = thresholds_.first(
            kind, num_labels, threshold, saved, self.label_names, where)
        # The metrics at 0.5 beside those at the thresholds in use, where thresholds are tuned or may differ from it.
        beside = self.decision_thresholds is not None or self.tuning is not None
        at_default = f"_at_{thresholds_.DEFAULT:g}"
        self.val_at_default = self.val_metrics.clone(postfix=at_default) if beside else None
        self.test_at_default = self.test_metrics.clone(postfix=at_default) if beside else None

    @property
    def tokenizer_name_or_path(self) -> str:
        return self.hparams.tokenizer_name_or_path or self.hparams.model_name_or_path

    # -- label names: they travel with the model -------------------------------------------------

    @property
    def label_names(self) -> list[str]:
        """One name per class id (transformers' ``LABEL_<id>`` for ids without one)."""
        return label_names_or_default(self._label_names, self.hparams.num_labels)

    def set_label_names(self, names: Optional[list[str]]) -> None:
        """Name the classes: in the Hugging Face config (exported as id2label/label2id) and in checkpoints."""
        if not names:
            return
        self._label_names = list(names)
        for config in {
            id(c): c for c in (self.hf_config, getattr(self.model, "config", None)) if c is not None
        }.values():
            self.name_classes(config)

    def name_classes(self, config) -> None:
        """Write the class names into a Hugging Face config (id2label, label2id)."""
        id2label = dict(enumerate(self.label_names))
        config.id2label, config.label2id = id2label, {name: i for i, name in id2label.items()}

    def setup(self, stage: str) -> None:
        data = getattr(self._trainer, "datamodule", None)
        resolved = getattr(data, "resolved_label_names", None)
        if stage == "fit" and resolved:  # the ids the data trains with: its names win
            self.set_label_names(resolved)
        elif self._label_names is None:  # else the model's own, then the data's (a checkpoint's come later)
            self.set_label_names(resolved or getattr(data, "hparams", {}).get("label_names"))
        if stage == "fit" and self.hparams.threshold is None:  # a new fine-tune: a base folder's thresholds are stale
            self.decision_thresholds = thresholds_.default_for(self.kind, self.hparams.num_labels, None)
        counts = getattr(data, "label_counts", None)
        if counts is not None or self.hparams.class_weights not in (None, "none", "balanced"):
            self.loss_weights = weights_.resolve(self.hparams.class_weights, counts, self.kind,
                                                 self.hparams.num_labels)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._label_names:
            checkpoint["id2label"] = dict(enumerate(self.label_names))
        if self.decision_thresholds is not None:
            checkpoint["thresholds"] = {"values": list(self.decision_thresholds.values),
                                        "origin": self.decision_thresholds.origin}
        if self.loss_weights is not None:
            checkpoint["class_weights"] = self.loss_weights.tolist()
        if "state_dict" in checkpoint and self.model is not None:
            # A 4-bit base's quantisation state (its scales and code maps, which bitsandbytes adds beside each packed
            # weight) is made again from the checkpoint the run loads, bit for bit: saved, it would be keys the
            # module cannot load (resume, the best checkpoint restored before the export)
            for key in qlora.state_keys(self):
                checkpoint["state_dict"].pop(key, None)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        id2label = checkpoint.get("id2label")
        if id2label:
            self.set_label_names([id2label[i] for i in sorted(id2label)])
        saved = checkpoint.get("thresholds")
        if saved and self.hparams.threshold is None:  # a threshold the user set wins
            self.decision_thresholds = thresholds_.Thresholds(tuple(saved["values"]), saved["origin"])
        if checkpoint.get("class_weights") is not None:
            self.loss_weights = torch.tensor(checkpoint["class_weights"], dtype=torch.float32)

    # -- model ---------------------------------------------------------------------------------

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning may call this more than once
            return
        self.model = self.build_model(self.hparams.pretrained)

    @property
    def precision(self) -> Optional[Precision]:
        """The precision the module trains under: its trainer's, else `built_for` (set by a builder without a trainer:
        the memory model), else None (Python users, the HF Trainer peer: torch's default dtype decides)."""
        trainer = self._trainer
        if trainer is not None:
            return Precision.known(trainer.precision)
        return self.built_for

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the weights are built and trained in, whatever the checkpoint's (transformers >= 5 would load a
        bf16 checkpoint in bf16): the trainer precision's, fp32 under ``32-true`` and the mixed precisions (the
        optimizer steps fp32 weights, no update rounds away) and bf16 under ``bf16-true`` (the 2gb tier: stochastic
        rounding keeps its small updates); built without a trainer (the memory model, the HF Trainer peer, Python),
        torch's default dtype, which Lightning's init context for a ``-true`` precision sets, and the memory model's
        build too (`lit_memory.planning.prediction.step.build`)."""
        precision = self.precision
        return precision.param if precision is not None else torch.get_default_dtype()

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype linear layers compute in (autocast's under the mixed precisions): a 4-bit base's matmuls'."""
        precision = self.precision
        return precision.compute if precision is not None else self.weights_dtype

    @property
    def export_dtype(self) -> torch.dtype:
        """The dtype ``hf_model/`` is saved in: ``save_dtype``'s; by default the checkpoint's own, else (a config that
        names none, random weights) the trained weights'."""
        setting = self.hparams.save_dtype
        if setting != "checkpoint":
            return DTYPES[setting]
        return self.checkpoint_dtype or self.weights_dtype

    def build_model(self, pretrained: bool) -> nn.Module:
        """The Hugging Face model with the configured switches (freeze, embeddings, checkpointing, LoRA), its
        weights in `weights_dtype` (a LoRA base as ``model.lora.base`` holds it)."""
        dtype, lora = self.weights_dtype, self.lora
        if lora is not None and self.precision is not None:
            lora.check_precision(self.precision)
        base = lora.frozen_dtype(dtype) if lora is not None else dtype
        quantised = lora is not None and lora.quantised
        if quantised:
            compute, skip = self.compute_dtype, self._head_names
        if pretrained:
            path = bundled.resolve_model(self.hparams.model_name_or_path)
            extra = qlora.loading_kwargs(compute, skip) if quantised else {}
            try:
                with quiet_transformers():  # its loading report: said below in our own words
                    model, loading = guard.call(
                        AutoModelForSequenceClassification.from_pretrained, repr(self.hparams.model_name_or_path),
                        path, config=self.hf_config, output_loading_info=True, dtype=base, **extra,
                    )
            except pickle.UnpicklingError as err:  # transformers loads pickled weights with weights_only=True
                raise UserError(
                    f"cannot load the weights of {self.hparams.model_name_or_path!r} with weights_only=True: "
                    f"{str(err).splitlines()[0]} (convert them to safetensors from a trusted copy)"
                ) from None
            report_loading(model, loading, self.report_new_head)
        elif quantised:
            with quiet_transformers():
                model = qlora.random_weights(self.hf_config, base, compute, skip)
        else:
            model = AutoModelForSequenceClassification.from_config(self.hf_config, dtype=base)
        if quantised:
            model = qlora.prepare(model)
        model.train()  # from_pretrained returns eval mode (dropout off); Lightning keeps submodule modes
        if hasattr(model.config, "use_cache"):
            model.config.use_cache = False  # a classifier's training step has no use for a decoder's key/value cache
        anatomy = Anatomy.of(model)
        freeze_modules(model, self.hparams.freeze, anatomy)
        if self.hparams.embedding_optimizer_state == "stable_embedding":
            swap_stable_embedding(model)
        if self.checkpoint_plan is not None:
            enable_gradient_checkpointing(model, self.checkpoint_plan, anatomy.layers)
        if self.lora is not None:
            model = apply_lora(model, self.lora, trained=dtype)
        if self._label_names:
            self.name_classes(model.config)  # from_config copies the config it is given
        # Regional: one graph per transformer layer, compiled once and reused by all of them. Each layer's backward
        # still hands its gradients over as it ends, so the fused step's bound holds.
        compile_layers(anatomy.layers, self.hparams.compile)
        return model

    def forward(self, **batch: torch.Tensor):
        return self.model(**batch)

    # -- steps ---------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.hparams.compile == CUDA_GRAPHS:
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the graphs' outputs of the last one are done with
        with self.activation_offload or contextlib.nullcontext():
            if self.loss_weights is None:  # the head's own loss (Hugging Face's)
                loss = self.model(**batch).loss
            else:
                logits = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits
                loss = weights_.loss(logits, batch["labels"], self.kind, self.loss_weights)
        self.running_loss.add(loss)  # read on the logging steps only (`on_train_batch_end`): no device sync per step
        self.progress_loss.add(loss)  # read when a progress line is written
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer
        if trainer.global_step != self._progress_step and logging_step(trainer):
            self._progress_step = trainer.global_step
            # The mean over the micro-batches since the last logged step (as the HF Trainer logs its loss), on the
            # host: the progress bar reads it back every batch without touching the device.
            mean = self.running_loss.mean()
            if mean is not None:
                self.log("train_loss", mean, prog_bar=True, batch_size=batch["labels"].shape[0])

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer) -> None:
        """Nothing to do: `optimizer_step` frees the gradients right after every step (and the fused step inside
        backward), so Lightning's zero_grad before the next backward would find none to free."""

    @property
    def problem_type(self) -> str:
        """Hugging Face's name of the module's kind (the saved hyper-parameter)."""
        return self.kind.name

    @property
    def main_metric(self) -> str:
        """The validation metric the best checkpoint is kept by (the problem kind's)."""
        return self.kind.main_metric

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        evaluating.step(self, batch, self.val_metrics, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        evaluating.step(self, batch, self.test_metrics, "test")

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":
            evaluating.say_thresholds(self, self._trainer)

    def on_test_start(self) -> None:
        evaluating.say_thresholds(self, self._trainer)

    def on_validation_epoch_end(self) -> None:
        evaluating.end(self, "val", self._trainer)

    def on_test_epoch_end(self) -> None:
        evaluating.end(self, "test", self._trainer)

    def report_evaluation(self, stage: str, counts: torch.Tensor, title: str = "") -> None:
        """The per-class report of an evaluation's confusion counts (`lit_memory.run.evaluating.report`)."""
        evaluating.report(self, stage, counts, self._trainer, title)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        return evaluating.predict_step(self, batch)

    def on_predict_epoch_start(self) -> None:
        evaluating.say_thresholds(self, self._trainer)
        evaluating.predict_start(self)

    def on_predict_epoch_end(self) -> None:
        evaluating.predict_end(self)

    # -- optimisation --------------------------------------------------------------------------

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The configured optimizer over the trainable parameters (no trainer needed: memory estimates use it)."""
        return configure.build(self.model, self.optimizer_factory, self.hparams.embedding_optimizer_state)

    def configure_optimizers(self):
        optimizer = self.build_optimizer()
        self._amp_scaling = configure.takes_amp_scale(self.trainer)
        optimizers.use_fused_kernels(optimizer, self.device, amp_scaling=self._amp_scaling)
        total = self.trainer.estimated_stepping_batches
        schedule = configure.schedule(optimizer, self.hparams.lr_scheduler_type, self.hparams.warmup_ratio, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        parent = super().optimizer_step
        configure.step(optimizer, self._amp_scaling, optimizer_closure,
                       lambda closure: parent(epoch, batch_idx, optimizer, closure))

    # -- export --------------------------------------------------------------------------------

    def on_train_start(self) -> None:
        phase("training")  # a confined run's preparation is over (`lit_memory.confine.launch`'s time bound)

    def on_fit_end(self) -> None:
        which = None
        if self.hparams.save_pretrained:
            run_dir = self.trainer.log_dir or self.trainer.default_root_dir
            which = restore_best(self.trainer)  # the best validated weights, as HF's load_best_model_at_end
            path = Path(run_dir) / "hf_model"
            self.export_pretrained(path)
            say(f"hf_model: {which or 'the last weights (no validation kept a best checkpoint)'}, saved in "
                f"{export.dtype_words(self)} to {path} (loads with AutoModelForSequenceClassification.from_pretrained; "
                "model card: README.md)")
            if self.decision_thresholds is not None:
                say(self.decision_thresholds.describe(self.label_names, self.kind)
                    + f"; saved in {path / 'config.json'} ({thresholds_.CONFIG_KEY}) and used by predict")
        best = best_of(self.trainer)
        step = best.best_step() if best is not None and which else self.trainer.global_step
        if step in self.degenerate:  # the exported step's validation predicted one class, or no label
            say(self.degenerate[step])

    def export_pretrained(self, path: Path) -> None:
        """Save model + tokenizer so ``AutoModelForSequenceClassification.from_pretrained(path)`` loads it."""
        export.export_pretrained(self, path, self._trainer)


# -- helpers shared with other modules ---------------------------------------------------------


def transformer_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks of a Hugging Face model (or the one a peft model wraps)."""
    return find_layers(unwrap(model))


def _check_freeze(freeze: Freeze, num_layers: int) -> None:
    if isinstance(freeze, int) and not isinstance(freeze, bool) and not 0 <= freeze <= num_layers:
        raise UserError(f"freeze={freeze} is outside 0..{num_layers} (the model's layers)")


def freeze_modules(model: PreTrainedModel, freeze: Freeze, anatomy: Optional[Anatomy] = None) -> None:
    """Set ``requires_grad=False`` on the chosen part of the body; the head keeps training."""
    if freeze is None:
        return
    anatomy = anatomy or Anatomy.of(model)
    if freeze == "body":
        parts = [anatomy.model.base_model]
    elif freeze == "embeddings":
        parts = list(anatomy.embedding_modules)
    else:  # everything below layer N: frozen layers then need no backward at all
        parts = [*anatomy.embedding_modules, *anatomy.layers[:freeze]]
    for part in parts:
        part.requires_grad_(False)
