from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from lit_memory.errors import UserError
from lit_memory.model import SequenceClassifier, transformer_layers
from lit_memory.optim.configure import weight_decay_groups
from lit_memory.run import export

TINY_BERT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}


def minilm(**kwargs) -> SequenceClassifier:
    module = SequenceClassifier(**kwargs)
    module.configure_model()
    return module


def batch(n: int = 4, length: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(1000, 2000, (n, length), generator=g),
        "attention_mask": torch.ones(n, length, dtype=torch.long),
        "labels": torch.tensor([0, 1] * (n // 2)),
    }


def sgd_step(module: SequenceClassifier) -> None:
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    module.model(**batch()).loss.backward()
    opt.step()


@pytest.mark.parametrize(
    "freeze, frozen_prefixes",
    [
        ("body", ["bert."]),
        ("embeddings", ["bert.embeddings."]),
        (2, ["bert.embeddings.", "bert.encoder.layer.0.", "bert.encoder.layer.1."]),
    ],
)
def test_freeze_really_freezes(freeze, frozen_prefixes):
    module = minilm(freeze=freeze)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    sgd_step(module)
    for name, param in module.model.named_parameters():
        frozen = any(name.startswith(prefix) for prefix in frozen_prefixes)
        assert param.requires_grad is not frozen, name
        if frozen:
            assert param.grad is None, name
            assert torch.equal(param, before[name]), name
    assert not torch.equal(module.model.classifier.weight, before["classifier.weight"])  # the head trained


def test_freeze_out_of_range():
    with pytest.raises(UserError, match=r"freeze=7 is outside 0..6"):
        SequenceClassifier(freeze=7)


def test_gradient_checkpointing_is_on_when_asked():
    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    on = minilm(gradient_checkpointing=True, config_overrides=no_dropout)
    off = minilm(config_overrides=no_dropout)
    assert on.model.is_gradient_checkpointing and not off.model.is_gradient_checkpointing
    assert all(layer.gradient_checkpointing for layer in transformer_layers(on.model))
    # Checkpointing changes memory, not maths: the same gradients in train mode.
    off.model.load_state_dict(on.model.state_dict())
    for m in (on, off):
        m.model(**batch()).loss.backward()
    torch.testing.assert_close(on.model.bert.embeddings.word_embeddings.weight.grad,
                               off.model.bert.embeddings.word_embeddings.weight.grad)


def test_checkpointing_a_frozen_body_runs_no_backward_through_it():
    module = minilm(freeze="body", gradient_checkpointing=True)
    ids = batch()["input_ids"]
    assert not module.model.bert.embeddings(input_ids=ids).requires_grad  # nothing to differentiate below the head
    module.model(**batch()).loss.backward()
    assert module.model.classifier.weight.grad is not None


def test_model_is_in_train_mode_after_configure_model():
    module = minilm()
    assert all(m.training for m in module.model.modules())  # dropout active, as in any fine-tune


def test_weight_decay_groups_exclude_biases_and_norms():
    module = minilm()
    decay, no_decay = weight_decay_groups(module.model)
    assert "weight_decay" not in decay and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in module.model.named_parameters()}
    assert all(p.ndim == 2 for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"classifier.bias", "bert.embeddings.LayerNorm.weight"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.model.parameters()))


def test_random_init_from_bundled_bert_large_config():
    module = minilm(model_name_or_path="bundled:bert-large", pretrained=False, config_overrides=TINY_BERT)
    cfg = module.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (2, 64, 30522)
    assert module.model(**batch()).logits.shape == (4, 2)


def test_bundled_bert_large_is_the_335m_architecture():
    module = SequenceClassifier(model_name_or_path="bundled:bert-large", pretrained=False)
    with torch.device("meta"):
        module.configure_model()
    assert sum(p.numel() for p in module.model.parameters()) == 335_143_938


def test_unknown_model_and_schedule():
    with pytest.raises(UserError, match="unknown bundled model 'bundled:gpt'"):
        SequenceClassifier(model_name_or_path="bundled:gpt")
    with pytest.raises(UserError, match="cannot load model config 'no/such-model-here'"):
        SequenceClassifier(model_name_or_path="no/such-model-here")
    with pytest.raises(UserError, match="unknown lr_scheduler_type 'zigzag'"):
        SequenceClassifier(lr_scheduler_type="zigzag")


def test_metrics_on_known_predictions():
    module = SequenceClassifier()
    preds = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1])
    target = torch.tensor([1, 0, 0, 0, 1, 1, 1, 0])
    module.val_metrics.update(preds, target)
    got = {k: float(v) for k, v in module.val_metrics.compute().items()}
    # TP=3 FP=2 FN=1 TN=2 for the positive class; negative class: TP=2 FP=1 FN=2.
    f1_pos, f1_neg = 2 * 3 / (2 * 3 + 2 + 1), 2 * 2 / (2 * 2 + 1 + 2)
    mcc = (3 * 2 - 2 * 1) / ((3 + 2) * (3 + 1) * (2 + 2) * (2 + 1)) ** 0.5  # Matthews: (TP.TN - FP.FN) / sqrt(...)
    assert got == pytest.approx(
        {"val_acc": 5 / 8, "val_f1": f1_pos, "val_f1_macro": (f1_pos + f1_neg) / 2, "val_mcc": mcc}
    )


def test_export_reloads_with_plain_transformers_and_same_logits(tmp_path):
    module = minilm(num_labels=2)
    sgd_step(module)  # make the weights differ from the checkpoint on disk
    module.export_pretrained(tmp_path / "hf_model")
    module.model.eval()
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf_model").eval()
    inputs = {k: v for k, v in batch().items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, module.model(**inputs).logits)
    assert (tmp_path / "hf_model" / "tokenizer_config.json").exists()


def test_gradients_are_freed_after_each_optimizer_step_not_after_the_next_forward(tmp_path):
    import lightning as L

    class GradientsAtForward(L.Callback):
        def __init__(self) -> None:
            self.alive: list[int] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.alive.append(sum(p.grad is not None for p in pl_module.parameters()))

    module = SequenceClassifier(
        model_name_or_path="bundled:bert-large", pretrained=False, config_overrides=TINY_BERT,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    probe = GradientsAtForward()
    trainer = L.Trainer(
        max_steps=3, callbacks=[probe], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu",
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch() for _ in range(3)], batch_size=None))
    assert trainer.global_step == 3 and probe.alive == [0, 0, 0]  # Lightning alone: [0, n, n]


def test_an_optimizer_that_ignores_the_closure_is_one_line(tmp_path):
    """A torch-style optimizer must call the closure it is given (Lightning's forward and backward run in it); one
    that ignores it stops with the rule, not Lightning's traceback about its loop."""
    import lightning as L

    class IgnoresClosure(torch.optim.SGD):
        def step(self, closure=None):  # updates from gradients that were never computed
            return None

    module = SequenceClassifier(
        model_name_or_path="bundled:bert-large", pretrained=False, config_overrides=TINY_BERT,
        optimizer=lambda params: IgnoresClosure(params, lr=1e-3),
    )
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")
    with pytest.raises(UserError) as error:
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch()], batch_size=None))
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"the optimizer {IgnoresClosure.__module__}.")
    assert "must call it" in message


def test_predictions_are_written_at_fp32_not_at_the_autocast_precision():
    """Under a 16-bit autocast (the bf16 recipes') the head's output layer still computes in fp32: a regression value
    is not rounded to bf16's 8 bits (1.609375), and it is what the model computes in fp32 from the same body."""
    from lit_memory.hf.tokenizing import load_tokenizer

    torch.manual_seed(0)
    model = SequenceClassifier("bundled:bert-large", num_labels=1, problem_type="regression", pretrained=False,
                               config_overrides={"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
                                                 "intermediate_size": 128})
    model.configure_model()
    model.eval()
    batch = dict(load_tokenizer("bundled:bert-large")([f"text number {i}" for i in range(16)], return_tensors="pt",
                                                       padding=True))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        written = model.predict_step(batch, 0)["outputs"].squeeze(-1)
        body_16bit = model.model(**batch).logits.squeeze(-1)  # the whole model under autocast: bf16 values
    assert written.dtype == torch.float32
    assert torch.equal(body_16bit.float(), body_16bit.float().bfloat16().float())  # what was written before
    assert (written != written.bfloat16().float()).sum() >= 12  # fp32 values, not bf16's
    assert torch.allclose(written, body_16bit.float(), atol=0.05)  # the same prediction, at fp32's precision


def test_the_spearman_caution_is_said_once_and_only_where_an_evaluation_feeds_it(capsys, recwarn):
    from lit_memory.task import evaluation, kind_of

    evaluation.task_metrics(kind_of("regression"), 1)
    evaluation.task_metrics(kind_of("regression"), 1)
    assert not [w for w in recwarn if "SpearmanCorrcoef" in str(w.message)]  # building the metrics: nothing said
    from lit_memory.task.regression import Regression

    Regression._buffer_said = False
    kind_of("single_label_classification").before_evaluation()
    kind_of("regression").before_evaluation()
    kind_of("regression").before_evaluation()
    assert capsys.readouterr().err.count("note: spearman keeps every prediction and label") == 1


# -- the weights' dtype: the recipe's, whatever the checkpoint was saved in ------------------------------------


def _recipe(name: str) -> tuple[dict, str]:
    """A shipped recipe's model settings (its optimizer a callable, `auto` planned as the CLI would for a tiny model:
    full checkpointing) and its precision."""
    import functools
    import pkgutil

    import yaml
    from conftest import RECIPES

    from lit_memory.hf.lora import LoRA

    recipe = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    model = dict(recipe.get("model") or {})
    spec = model.pop("optimizer")
    model["optimizer"] = functools.partial(pkgutil.resolve_name(spec["class_path"]), **spec.get("init_args", {}))
    if model.get("lora") is not None:
        model["lora"] = LoRA(**model["lora"])
    model.update(
        {
            k: v
            for k, v in (("offload_activations", False), ("gradient_checkpointing", "full"))
            if model.get(k) == "auto"
        }
    )
    return model, recipe["trainer"].get("precision", "32-true")


def built_by_lightning(precision: str, **settings) -> tuple[SequenceClassifier, torch.optim.Optimizer]:
    """The module as a Trainer of ``precision`` builds it for fit (its init contexts around configure_model, then its
    precision plugin's conversion), and the optimizer it configures."""
    import lightning as L
    from lightning.pytorch.trainer import call

    trainer = L.Trainer(precision=precision, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = SequenceClassifier(num_labels=2, **settings)
    module.trainer = trainer
    trainer.strategy.connect(module)
    call._call_configure_model(trainer)
    trainer.precision_plugin.convert_module(module)
    return module, module.build_optimizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[tuple[str, torch.dtype], str]:
    """Tiny decoders (Qwen3, Llama) and encoders (BERT, ModernBERT) with weights saved in bf16 and in fp32."""
    import families as fam

    root = tmp_path_factory.mktemp("saved")
    folders = {}
    for family in ("qwen3", "llama", "bert", "modernbert"):
        for dtype in (torch.bfloat16, torch.float32):
            folder = fam.folder(family, root / str(dtype).removeprefix("torch."))
            fam.model(family).to(dtype).save_pretrained(folder)
            folders[family, dtype] = str(folder)
    return folders


def test_every_recipe_trains_the_weights_it_promises_whatever_dtype_the_checkpoint_was_saved_in(saved):
    """transformers >= 5 loads a checkpoint in its own dtype by default: a bf16-saved model trained bf16 weights
    without a master copy under the fp32 and bf16-mixed recipes. The recipe decides now: fp32 weights (the
    optimizer's masters) wherever it keeps fp32 weights, bf16 only under bf16-true (2gb, with stochastic rounding)."""
    from conftest import RECIPES

    from lit_memory.hf import qlora

    recipes = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    for (family, saved_in), folder in saved.items():  # one test item: a build is tens of milliseconds
        for recipe in recipes:
            settings, precision = _recipe(recipe)
            module, optimizer = built_by_lightning(precision, model_name_or_path=folder, **settings)
            promised = torch.bfloat16 if precision == "bf16-true" else torch.float32
            where = (family, saved_in, recipe)
            assert module.checkpoint_dtype == saved_in, where
            quantised = {id(p) for p in module.model.parameters() if qlora.is_quantised(p)}
            assert bool(quantised) == (recipe == "qlora"), where  # QLoRA: the layers' matrices in 4 bits
            dense = [p for p in module.model.parameters() if id(p) not in quantised]
            # the frozen base too (LoRA; QLoRA's embeddings, norms)
            assert {p.dtype for p in dense} == {promised}, where
            stepped = [p for group in optimizer.param_groups for p in group["params"]]
            assert {id(p) for p in stepped} == {id(p) for p in module.model.parameters() if p.requires_grad}, where
            assert {p.dtype for p in stepped} == {promised}, where  # the optimizer updates these: its master copy
            if recipe == "2gb":  # bf16 weights, no master copy: torchao rounds each update stochastically
                assert type(optimizer).__module__.startswith("torchao.optim") and optimizer.bf16_stochastic_round


def test_a_bf16_checkpoint_exports_in_bf16_and_reloads_with_plain_transformers_to_the_same_predictions(
    saved, tmp_path, capsys
):
    """hf_model/ is saved in the checkpoint's dtype (config.json names it), from the fp32 weights that trained: the
    reloaded weights are those weights rounded to bf16, bit for bit, so a reload in fp32 predicts exactly what the
    trained model predicts with its weights so rounded; a plain reload (bf16) agrees within bf16's rounding."""
    import json

    from lit_memory.hf.config import quiet_transformers

    module, optimizer = built_by_lightning("32-true", model_name_or_path=saved["qwen3", torch.bfloat16],
                                           optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    inputs = {"input_ids": torch.randint(10, 250, (4, 12), generator=torch.Generator().manual_seed(0))}
    module.model(**inputs, labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    optimizer.step()  # fp32 updates (lr 1e-2: most are far below a bf16 unit of the weights they move)
    assert {s["exp_avg"].dtype for s in optimizer.state.values()} == {torch.float32}
    trained = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    module.export_pretrained(tmp_path / "hf_model")
    assert json.loads((tmp_path / "hf_model" / "config.json").read_text())["dtype"] == "bfloat16"
    with quiet_transformers():
        plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf_model").eval()
        upcast = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf_model", dtype=torch.float32).eval()
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}
    for name, value in upcast.state_dict().items():
        assert torch.equal(value, trained[name].to(torch.bfloat16).to(value.dtype)), name
    module.model.load_state_dict({k: v.to(torch.bfloat16).to(v.dtype) for k, v in trained.items()})
    module.model.eval()
    with torch.no_grad():
        expected = module.model(**inputs).logits
        assert torch.equal(upcast(**inputs).logits, expected)
        torch.testing.assert_close(plain(**inputs).logits.float(), expected, atol=2e-2, rtol=2e-2)  # bf16: 8 bits
    assert export.dtype_words(module) == "bf16 (the checkpoint's dtype; trained in fp32)"
    module.hparams.save_dtype = "fp32"
    assert module.export_dtype == torch.float32 and export.dtype_words(module) == "fp32 (model.save_dtype)"


def test_the_bundled_demo_model_loads_as_transformers_loads_it():
    """The demo's quality table stands: MiniLM is saved in fp32 (its config names no dtype; the safetensors header
    says), and the module's weights are what transformers' own default loads, bit for bit; exported in fp32."""
    from lit_memory.hf import bundled
    from lit_memory.hf.config import quiet_transformers

    module = minilm(num_labels=2)
    with quiet_transformers():
        reference = AutoModelForSequenceClassification.from_pretrained(
            bundled.resolve_model("bundled:minilm"), num_labels=2
        )
    assert module.checkpoint_dtype == torch.float32 and module.export_dtype == torch.float32
    ours = module.model.state_dict()
    assert {v.dtype for v in ours.values() if v.is_floating_point()} == {torch.float32}
    for name, value in reference.state_dict().items():
        if not name.startswith("classifier."):  # the new head: initialised at random in each
            assert torch.equal(ours[name], value), name


def test_a_save_dtype_that_is_none_of_them_is_one_line():
    with pytest.raises(UserError, match=r"^model.save_dtype 'int8' is not one of: checkpoint, fp32, bf16, fp16$"):
        SequenceClassifier(save_dtype="int8")


def test_thresholds_travel_with_the_exported_folder_and_the_checkpoint_and_a_set_one_wins(tmp_path):
    from lit_memory.task.thresholds import Thresholds

    tiny = {"config_overrides": TINY_BERT, "pretrained": False, "problem_type": "multi_label_classification"}
    module = minilm(num_labels=3, **tiny)
    module.set_label_names(["joy", "anger", "fear"])
    module.decision_thresholds = Thresholds((0.31, 0.12, 0.5), "tuned on validation at step 8 for each label's F1")
    module.export_pretrained(tmp_path / "hf_model")
    config = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf_model").config
    assert config.thresholds == {"joy": 0.31, "anger": 0.12, "fear": 0.5}
    assert (tmp_path / "hf_model" / "README.md").read_text().startswith("---\nlibrary_name: transformers\n")
    reloaded = SequenceClassifier(model_name_or_path=str(tmp_path / "hf_model"), pretrained=False)
    assert reloaded.decision_thresholds.values == (0.31, 0.12, 0.5)
    assert reloaded.decision_thresholds.origin == f"saved in {tmp_path / 'hf_model'}'s config.json"
    assert reloaded.tuning == "per_label"  # multi-label: fit would tune them again
    mine = SequenceClassifier(model_name_or_path=str(tmp_path / "hf_model"), pretrained=False, threshold=0.3)
    assert mine.decision_thresholds.values == (0.3, 0.3, 0.3) and mine.tuning is None
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    mine.on_load_checkpoint(checkpoint)  # the user's threshold wins over the checkpoint's too
    assert mine.decision_thresholds.values == (0.3, 0.3, 0.3)
    reloaded.on_load_checkpoint(checkpoint)
    assert reloaded.decision_thresholds == module.decision_thresholds


def test_a_weighted_loss_trains_where_class_weights_are_set():
    from lit_memory.task.class_weights import loss

    module = minilm(num_labels=2, class_weights=[1.0, 3.0])
    assert module.kind.name == "single_label_classification"
    module.setup("fit")  # no data module: the weights as set
    module.model.eval()  # no dropout: the same logits twice
    data = batch()
    data["labels"] = torch.tensor([0, 0, 0, 1])
    with torch.no_grad():
        expected = loss(module.model(**{k: v for k, v in data.items() if k != "labels"}).logits, data["labels"],
                        module.kind, torch.tensor([1.0, 3.0]))
        plain = module.model(**data).loss
        torch.testing.assert_close(module.training_step(data, 0), expected)
    assert abs(float(expected) - float(plain)) > 1e-4
    with pytest.raises(UserError, match=r"^model.class_weights has 3 weight\(s\) for 2 classes"):
        SequenceClassifier(num_labels=2, class_weights=[1.0, 2.0, 3.0])
