"""A LightningModule around Hugging Face's `AutoModelForSequenceClassification`.

The Hugging Face config is read in `__init__` (cheap, and it fails early on a bad name); the
model itself is built in `configure_model`, so sharded strategies and low-precision init
contexts create it directly where and how it will train.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle
import warnings
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torchmetrics import MeanMetric, MetricCollection
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from lit_memory import bundled, evaluation, files, guard, optimizers
from lit_memory import task as task_
from lit_memory.best import restore_best
from lit_memory.console import say
from lit_memory.sandbox.rules import phase
from lit_memory.checkpointing import CheckpointPlan, OffloadActivations, enable_gradient_checkpointing
from lit_memory.anatomy import Anatomy, find_layers, skeleton, unwrap
from lit_memory.hf_loading import (
    DTYPES, config_label_names, dtype_name, label_names_or_default, load_config, quiet_transformers, report_loading,
    saved_dtype, set_pad_token,
)
from lit_memory.tokenizing import load_tokenizer
from lit_memory.eightbit import EmbeddingState, check_stable_embedding, swap_stable_embedding, unquantised, unquantised_dtype
from lit_memory.errors import UserError
from lit_memory.lora import LoRA, apply_lora, is_lora, lora_targets
from lit_memory.checks import check_optimizer
from lit_memory import qlora
from lit_memory.settings import Precision

log = logging.getLogger(__name__)

# transformers schedules that need nothing beyond warmup and total steps.
SCHEDULES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt")
Freeze = Optional[Union[Literal["body", "embeddings"], int]]
# true is "full" (every layer's forward recomputed in backward), as it always was; counts are a per-layer plan
# (`lit_memory.checkpointing.CheckpointPlan`); auto is resolved for a device budget before the module is built.
Checkpointing = Union[bool, Literal["full", "selective", "auto"], dict[str, int]]
SaveDtype = Literal["checkpoint", "fp32", "bf16", "fp16"]


CLOSURE_NOT_CALLED = (
    "the optimizer {name} did not call the closure its step is given: Lightning runs the forward and backward inside "
    "it, so a torch-style optimizer's step(closure) must call it (with torch.enable_grad(): loss = closure()) before "
    "it updates the parameters (docs/memory.md, Adding an optimizer)"
)
# The reference post's optimizer (lr 2e-5, weight decay 0.01): the module's default, and the CLI's.
DEFAULT_OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-5, "weight_decay": 0.01}}


def default_optimizer(params) -> torch.optim.Optimizer:
    """`DEFAULT_OPTIMIZER` as a callable, for a module built in Python."""
    return torch.optim.AdamW(params, **DEFAULT_OPTIMIZER["init_args"])


class SequenceClassifier(L.LightningModule):
    """Fine-tune (or train from scratch) a Hugging Face sequence classifier.

    Args:
        model_name_or_path: hub name, local folder, or ``bundled:minilm`` / ``bundled:bert-large``.
        num_labels: number of classes, 1 for regression (linked to the data module by the CLI); null: what the
            training data's labels show (``fit`` reads them first), else the model config's own.
        problem_type: Hugging Face's ``single_label_classification`` (cross-entropy), ``multi_label_classification``
            (BCE with logits, a 0/1 per label) or ``regression`` (MSE on one value); null: what the labels show, else
            the model config's own. Saved in ``hf_model/config.json``, so ``from_pretrained`` and ``pipeline``
            treat the model right.
        threshold: multi-label: a label is predicted where its probability is at least this (metrics, predict).
        pretrained: load the checkpoint's weights; ``false`` builds the architecture from its
            config with random weights (memory and speed work without downloading weights).
        config_overrides: keyword overrides for the Hugging Face config (e.g. ``num_hidden_layers``).
        tokenizer_name_or_path: defaults to ``model_name_or_path``.
        gradient_checkpointing: recompute activations in backward (non-reentrant), per layer. ``true``/``full``: each
            layer keeps its input and re-runs its forward; ``selective``: also keeps its matmul and fused-attention
            outputs, recomputing only cheap ops (GELU, dropout, LayerNorm, adds); counts ``{full: F, selective: S}``
            from the input side (the layers after them recompute nothing); ``auto`` (resolved by ``fit``/``estimate``):
            the plan with the fewest FLOPs predicted to fit ``memory.budget``, else the recipe's ``memory.tier``;
            ``false`` keeps everything.
        offload_activations: move the tensors autograd saves in the forward pass (with
            checkpointing: each layer's input) to pinned host memory, and back for backward. Needs
            every layer checkpointed; a no-op on CPU. ``auto`` (with ``gradient_checkpointing: auto``): where
            its copies are modelled to cost less time than the recompute the room buys (CUDA only).
        freeze: ``body`` (the whole encoder, as the seed did), ``embeddings``, or an int N for the
            embeddings plus the first N layers. The classifier head always trains.
        optimizer: any optimizer class path with its init args (the reference post's AdamW, lr 2e-5 and
            weight decay 0.01, by default: `DEFAULT_OPTIMIZER`, in Python and on the command line alike;
            bitsandbytes' 8-bit optimizers such as ``bitsandbytes.optim.AdamW8bit``). Biases and LayerNorm
            weights are put in a group without weight decay.
        embedding_optimizer_state: how a low-bit optimizer (bitsandbytes', torchao's) keeps the embedding matrices'
            state (`lit_memory.eightbit.unquantised`): ``32bit`` in fp32; ``unquantized`` in the parameters' own dtype
            (bitsandbytes: as ``32bit``); ``auto`` (default) as ``32bit`` up to `lit_memory.eightbit.AUTO_32BIT_VALUES`
            values (BERT's word embeddings), quantised above (128k-250k-token vocabularies: 32-bit state would cost
            0.7-1.4 GiB more); ``stable_embedding`` swaps in ``bitsandbytes.nn.StableEmbedding`` (a LayerNorm added,
            32-bit state; refused for a family's own embedding class, e.g. Gemma3's scaled one); ``8bit`` quantises
            them like the rest. Other optimizers ignore it (``stable_embedding`` still swaps).
        lora: LoRA adapters (peft); the rest of the model is frozen, the head parts a fine-tune
            initialises (classifier, pooler, score: `lit_memory.anatomy.Anatomy.head`) train in full,
            and the adapters are merged before export. Its ``target_modules`` default to the family's
            (`lit_memory.lora.lora_targets`).
        lr_scheduler_type: a transformers schedule name (``linear`` is the HF Trainer's default),
            stepped every optimizer step. ``constant`` by default, as in Lightning when no scheduler
            is configured: one short epoch learns more with a flat rate (on the bundled subset,
            linear decay reached val acc 0.78 where constant reached 0.88).
        warmup_ratio: fraction of the optimizer steps spent warming up.
        save_pretrained: at the end of fit, save model + tokenizer with ``save_pretrained`` into
            ``<run folder>/hf_model`` so the result loads with plain transformers.
        save_dtype: the dtype ``hf_model/`` is saved in (its ``config.json`` names it): ``checkpoint`` (default) the
            dtype the checkpoint was saved in (a bf16 checkpoint stays bf16 on disk, however it trained; the trained
            weights' where the checkpoint names none), or ``fp32``, ``bf16``, ``fp16``. The weights train in the
            dtype ``trainer.precision`` gives them, whatever the checkpoint's (`weights_dtype`).
        compile: ``torch.compile`` each transformer layer (regional: one compiled graph reused by
            every layer). Works with the fused step and checkpointing, not with
            ``offload_activations``; compiled dropout draws other masks than eager dropout.
    """

    # Arguments that change no matrix product or attention a training step computes: the optimizer's state layout
    # (``stable_embedding`` adds a LayerNorm: element-wise), where kept tensors wait, the schedule, the export. A FLOP
    # count is keyed without them (`lit_memory.memory.planning.recompute`); an argument not named here is counted (tests check
    # that each named one leaves the count as it is).
    SAME_FLOPS = frozenset({
        "embedding_optimizer_state", "offload_activations", "lr_scheduler_type", "warmup_ratio", "save_pretrained", "save_dtype",
    })

    def __init__(
        self,
        model_name_or_path: str = "bundled:minilm",
        num_labels: Optional[int] = None,
        problem_type: Optional[task_.ProblemType] = None,
        threshold: float = 0.5,
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
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer"])
        if num_labels is not None and (isinstance(num_labels, bool) or num_labels < 1):
            raise UserError(f"model.num_labels must be at least 1 (1: regression), got {num_labels}")
        if problem_type is not None and problem_type not in task_.PROBLEM_TYPES:
            raise UserError(f"model.problem_type {problem_type!r} is not one of: {', '.join(task_.PROBLEM_TYPES)}")
        if problem_type == task_.REGRESSION and num_labels not in (None, 1):
            raise UserError(f"model.num_labels {num_labels} with problem_type regression: it predicts one value (1)")
        if not 0.0 < threshold < 1.0:
            raise UserError(f"model.threshold must be in (0, 1), got {threshold}")
        if lr_scheduler_type not in SCHEDULES:
            raise UserError(f"unknown lr_scheduler_type {lr_scheduler_type!r}; choose one of: {', '.join(SCHEDULES)}")
        if not 0.0 <= warmup_ratio < 1.0:
            raise UserError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
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
        self.hf_config = load_config(model_name_or_path, num_labels, config_overrides, problem_type)
        # Read now: building the model writes the dtype it is built in over the config's (transformers' from_config).
        self.checkpoint_dtype: Optional[torch.dtype] = saved_dtype(self.hf_config, model_name_or_path)
        # Resolved: what checkpoints and the saved hyper-parameters hold (the config's own where none was given).
        num_labels, problem_type = self.hf_config.num_labels, self.hf_config.problem_type
        self.hparams.update(num_labels=num_labels, problem_type=problem_type)
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
        # Metrics of the problem type (`lit_memory.evaluation`); per-label F1 and the confusion counts beside them.
        self.val_metrics = evaluation.task_metrics(problem_type, num_labels, threshold).clone(prefix="val_")
        self.test_metrics = self.val_metrics.clone(prefix="test_")
        self.per_label_f1 = evaluation.per_label_f1(num_labels, threshold) if problem_type == task_.MULTI else None
        self.class_counts = (
            evaluation.ClassCounts(problem_type, num_labels, threshold) if problem_type != task_.REGRESSION else None
        )
        self.predict_metrics: Optional[MetricCollection] = None  # made at predict (not in a fit's model summary)
        self.predict_loss: Optional[MeanMetric] = None
        self.predict_results: dict[str, float] = {}  # the metrics of the last predict over labelled inputs
        self._labelled = False
        self.report_new_head = True  # off where a checkpoint is loaded after the model is built (the CLI says)
        # Class names in id order: the data's (set in `setup` when fitting), a checkpoint's, or the model config's
        # own (a fine-tuned folder's id2label); None: transformers' default names.
        self._label_names: Optional[list[str]] = config_label_names(self.hf_config)

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
        for config in {id(c): c for c in (self.hf_config, getattr(self.model, "config", None)) if c is not None}.values():
            self._name_classes(config)

    def _name_classes(self, config) -> None:
        id2label = dict(enumerate(self.label_names))
        config.id2label, config.label2id = id2label, {name: i for i, name in id2label.items()}

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None)
        resolved = getattr(data, "resolved_label_names", None)
        if stage == "fit" and resolved:  # the ids the data trains with: its names win
            self.set_label_names(resolved)
        elif self._label_names is None:  # else the model's own, then the data's (a checkpoint's come later)
            self.set_label_names(resolved or getattr(data, "hparams", {}).get("label_names"))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._label_names:
            checkpoint["id2label"] = dict(enumerate(self.label_names))
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
        build too (`lit_memory.memory.prediction.step.build`)."""
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
            self._name_classes(model.config)  # from_config copies the config it is given
        if self.hparams.compile:
            # Regional: one graph per transformer layer, compiled once and reused by all of them. Each
            # layer's backward still hands its gradients over as it ends, so the fused step's bound holds.
            for layer in anatomy.layers:
                layer.compile()
        return model

    def forward(self, **batch: torch.Tensor):
        return self.model(**batch)

    # -- steps ---------------------------------------------------------------------------------

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        with self.activation_offload or contextlib.nullcontext():
            loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["labels"].shape[0])
        return loss

    @property
    def problem_type(self) -> str:
        return self.hparams.problem_type

    @property
    def main_metric(self) -> str:
        """The validation metric the best checkpoint is kept by (`lit_memory.task.MAIN_METRIC`)."""
        return task_.MAIN_METRIC[self.problem_type]

    def _eval_step(self, batch: dict[str, torch.Tensor], metrics: MetricCollection, stage: str) -> None:
        out = self.model(**batch)
        predicted = evaluation.outputs(out.logits, self.problem_type)
        labels = evaluation.targets(batch["labels"], self.problem_type)
        metrics.update(predicted, labels)
        if self.per_label_f1 is not None:
            self.per_label_f1.update(predicted, labels)
        if self.class_counts is not None:
            self.class_counts.update(predicted, labels)
        # Averaged over the ranks at the epoch's end (the metric objects synchronise themselves).
        self.log(f"{stage}_loss", out.loss, prog_bar=True, batch_size=batch["labels"].shape[0], sync_dist=True)
        self.log_dict(metrics, prog_bar=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics, "test")

    def on_validation_epoch_end(self) -> None:
        self._end_of_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._end_of_evaluation("test")

    def _end_of_evaluation(self, stage: str) -> None:
        """Per-label F1 logged (multi-label); at the end of ``validate`` and ``test``, the per-class report and the
        confusion matrix (printed, and a PNG in the run folder)."""
        if self.per_label_f1 is not None:
            scores = self.per_label_f1.compute()
            self.per_label_f1.reset()
            for name, score in zip(self.label_names, scores.tolist()):
                self.log(f"{stage}_f1_{evaluation.metric_name(name)}", score)
        if self.class_counts is None:
            return
        counts = self.class_counts.compute()  # a collective under several processes: every rank computes
        self.class_counts.reset()
        trainer = self._trainer
        if trainer is None or trainer.state.fn not in ("validate", "test") or trainer.sanity_checking:
            return
        if trainer.is_global_zero:
            print(evaluation.report(stage, counts, self.label_names, self.problem_type))
            run_dir = trainer.log_dir or trainer.default_root_dir
            if self.problem_type == task_.SINGLE and run_dir and Path(run_dir).is_dir():
                path = Path(run_dir) / f"confusion_matrix_{stage}.png"
                drawn = evaluation.draw_confusion(counts, self.label_names, path, f"{stage}: confusion matrix")
                print(f"confusion matrix: {drawn}" if drawn else "confusion matrix: no picture (matplotlib is not installed)")

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        """A batch's predictions (``outputs``: class probabilities, the value, or each label's probability); where
        it has ``labels``, the metrics of the rows the model can score (``known``) are accumulated too, for
        `on_predict_epoch_end`."""
        inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in ("labels", "known")}
        logits = self.model(**inputs).logits.float()
        problem = self.problem_type
        shown = logits.softmax(-1) if problem == task_.SINGLE else evaluation.outputs(logits, problem)
        labels = batch.get("labels")
        if labels is not None and self.predict_metrics is not None:  # (made by Lightning's predict loop)
            known = batch["known"] if "known" in batch else labels >= 0
            self._labelled = True
            if known.any():
                predicted = evaluation.outputs(logits[known], problem)
                targets = labels[known]
                self.predict_metrics.update(predicted, evaluation.targets(targets, problem))
                self.predict_loss.update(task_loss(logits[known], targets, problem))
        if problem == task_.REGRESSION:
            shown = shown.unsqueeze(-1)
        return {"outputs": shown}

    def on_predict_epoch_start(self) -> None:
        self._labelled = False
        self.predict_results = {}
        self.predict_metrics = self.val_metrics.clone(prefix="predict_").to(self.device)
        self.predict_metrics.reset()
        self.predict_loss = MeanMetric().to(self.device)

    def on_predict_epoch_end(self) -> None:
        # Every rank has as many batches, labelled or not alike, and joins the metrics' synchronisation (even one
        # whose rows all had labels the model does not know: its loss is then NaN, and nothing is reported).
        if self._labelled:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method")
                results = {**self.predict_metrics.compute(), "predict_loss": self.predict_loss.compute()}
            if not math.isnan(float(results["predict_loss"])):
                self.predict_results = {k: float(v) for k, v in results.items()}

    # -- optimisation --------------------------------------------------------------------------

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The configured optimizer over the trainable parameters (no trainer needed: memory estimates use it)."""
        optimizer = self.optimizer_factory(weight_decay_groups(self.model))
        state = self.hparams.embedding_optimizer_state
        kept = [e.weight for e in unquantised(state, Anatomy.of(self.model).embeddings) if e.weight.requires_grad]
        optimizers.prepare(optimizer, kept, unquantised_dtype(state))  # what its library needs (`lit_memory.optimizers`)
        return optimizer

    def configure_optimizers(self):
        # deferred: transformers.optimization pulls in peft and bitsandbytes (1.5 s at start-up)
        from transformers import get_scheduler

        optimizer = self.build_optimizer()
        optimizers.use_fused_kernels(optimizer, self.device)  # torch's Adam/AdamW: one kernel per group
        total = self.trainer.estimated_stepping_batches
        schedule = get_scheduler(
            self.hparams.lr_scheduler_type,
            optimizer,
            num_warmup_steps=math.ceil(self.hparams.warmup_ratio * total),
            num_training_steps=total,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper around the user's optimizer
        # What its library's step runs inside (bitsandbytes: no device sync after every parameter).
        context = optimizers.library_of(inner).step_context(inner, [p for g in inner.param_groups for p in g["params"]])
        ran: list[bool] = []

        def closure() -> Any:
            ran.append(True)
            return optimizer_closure()

        with context if context is not None else contextlib.nullcontext():
            super().optimizer_step(epoch, batch_idx, optimizer, None if optimizer_closure is None else closure)
        if optimizer_closure is not None and not ran:  # Lightning's own message is a traceback about its loop
            raise UserError(CLOSURE_NOT_CALLED.format(name=f"{type(inner).__module__}.{type(inner).__qualname__}"))
        # Free the gradients now, as the HF Trainer does: Lightning zeroes them only after the next
        # training_step, so they would sit through the next forward (4 B per trainable parameter).
        optimizer.zero_grad(set_to_none=True)

    # -- export --------------------------------------------------------------------------------

    def on_train_start(self) -> None:
        phase("training")  # a confined run's preparation is over (`lit_memory.sandbox.launch`'s time bound)

    def on_fit_end(self) -> None:
        if self.hparams.save_pretrained:
            run_dir = self.trainer.log_dir or self.trainer.default_root_dir
            which = restore_best(self.trainer)  # the best validated weights, as HF's load_best_model_at_end
            path = Path(run_dir) / "hf_model"
            self.export_pretrained(path)
            say(f"hf_model: {which or 'the last weights (no validation kept a best checkpoint)'}, saved in "
                f"{self._export_words()} to {path} (loads with AutoModelForSequenceClassification.from_pretrained)")

    def _export_words(self) -> str:
        """The dtype ``hf_model/`` is saved in, and why: ``bf16 (the checkpoint's dtype; trained in fp32)``."""
        saved, trained = dtype_name(self.export_dtype), dtype_name(self.weights_dtype)
        setting = self.hparams.save_dtype
        why = "model.save_dtype" if setting != "checkpoint" else (
            "the checkpoint's dtype" if self.checkpoint_dtype is not None else "the checkpoint names none: as trained"
        )
        if self.lora is not None and self.lora.quantised:
            trained += " adapters and head over a 4-bit base, merged into it dequantised"
        return f"{saved} ({why}{'' if saved == trained else f'; trained in {trained}'})"

    def export_pretrained(self, path: Path) -> None:
        """Save model + tokenizer so ``AutoModelForSequenceClassification.from_pretrained(path)`` loads it."""
        sharded = is_sharded(self.model)
        if is_lora(self.model) and not sharded:  # training is over: fold the adapters into the weights
            # a 4-bit base: into its weights dequantised (peft would requantise the sum)
            with quiet_transformers():  # its line on dequantising: said in the hf_model line
                self.model = qlora.merged(self.model) if qlora.has_quantised_base(self.model) else self.model.merge_and_unload()
        state = full_state_dict(self.model)  # a collective under sharding: every rank calls it
        self._save_on_rank_zero(path, state, sharded)
        if self._trainer is not None:
            self.trainer.strategy.barrier("export_pretrained")

    @rank_zero_only
    def _save_on_rank_zero(self, path: Path, state: dict[str, torch.Tensor], sharded: bool) -> None:
        model = self.model
        if is_lora(model) and sharded:
            # peft cannot merge FSDP2's sharded (DTensor) weights: merge a plain copy of the gathered state.
            model = self.build_model(pretrained=False)
            model.load_state_dict(state)
            model = model.merge_and_unload()
            state = model.state_dict()
        if self._label_names:
            self._name_classes(model.config)
        dtype = self.export_dtype
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        built = model.config.dtype
        with quiet_transformers(), files.replacing_folder(path) as folder:  # whole, never through a link
            model.save_pretrained(folder, state_dict=state)
            # save_pretrained names the module's own dtype in config.json: name the one saved, which from_pretrained's
            # dtype="auto" then loads in
            model.config.dtype = dtype
            try:
                model.config.save_pretrained(folder)
            finally:
                model.config.dtype = built
            tokenizer = load_tokenizer(self.tokenizer_name_or_path)
            # Written from the tokenizer the run uses, nothing more: a classifier has no use for a chat template, and a
            # sent folder's (a link to a private file, once) is not copied into what the user shares.
            tokenizer.chat_template = None
            tokenizer.save_pretrained(folder)


# -- helpers shared with other modules ---------------------------------------------------------


def task_loss(logits: torch.Tensor, labels: torch.Tensor, problem_type: str) -> torch.Tensor:
    """Per-row loss as Hugging Face's heads compute it for their problem type (cross-entropy, MSE, BCE)."""
    if problem_type == task_.REGRESSION:
        return torch.nn.functional.mse_loss(logits.squeeze(-1), labels.float(), reduction="none")
    if problem_type == task_.MULTI:
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none").mean(-1)
    return torch.nn.functional.cross_entropy(logits, labels, reduction="none")


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


def weight_decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Trainable parameters in two groups: matrices with weight decay, biases/norms (1-D) without."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 has sharded the model (its parameters are DTensors)."""
    from torch.distributed.tensor import DTensor  # deferred: about 1 s to import; only sharded runs have them

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU, gathering shards when parameters are DTensors (FSDP2)."""
    if is_sharded(model):
        # deferred: torch's distributed checkpointing, for sharded models only
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}
