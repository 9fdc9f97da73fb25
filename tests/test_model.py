from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from lit_memory.errors import UserError
from lit_memory.model import SequenceClassifier, transformer_layers, weight_decay_groups

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
    assert got == pytest.approx({"val_acc": 5 / 8, "val_f1": f1_pos, "val_f1_macro": (f1_pos + f1_neg) / 2, "val_mcc": mcc})


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


def test_thresholds_travel_with_the_exported_folder_and_the_checkpoint_and_a_set_one_wins(tmp_path):
    from lit_memory.thresholds import Thresholds

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
    from lit_memory.class_weights import loss

    module = minilm(num_labels=2, class_weights=[1.0, 3.0])
    module.setup("fit")  # no data module: the weights as set
    module.model.eval()  # no dropout: the same logits twice
    data = batch()
    data["labels"] = torch.tensor([0, 0, 0, 1])
    with torch.no_grad():
        expected = loss(module.model(**{k: v for k, v in data.items() if k != "labels"}).logits, data["labels"],
                        "single_label_classification", torch.tensor([1.0, 3.0]))
        plain = module.model(**data).loss
        torch.testing.assert_close(module.training_step(data, 0), expected)
    assert abs(float(expected) - float(plain)) > 1e-4
    with pytest.raises(UserError, match=r"^model.class_weights has 3 weight\(s\) for 2 classes"):
        SequenceClassifier(num_labels=2, class_weights=[1.0, 2.0, 3.0])
