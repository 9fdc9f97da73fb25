from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from lit_memory.hf.lora import LoRA, is_lora
from lit_memory.model import SequenceClassifier


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (4, 12), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_only_adapters_and_the_head_train():
    module = SequenceClassifier(lora=LoRA(rank=4, target_modules=["query", "value"]))
    module.configure_model()
    trainable = {n: p.numel() for n, p in module.model.named_parameters() if p.requires_grad}
    assert all("lora_" in n or "classifier" in n for n in trainable)
    hidden, layers = 384, 6
    adapters = layers * 2 * (2 * 4 * hidden)  # query and value: A (r x h) + B (h x r) each
    head = hidden * 2 + 2
    assert sum(trainable.values()) == adapters + head  # N, the seed's PEFT accounting
    frozen = sum(p.numel() for p in module.model.parameters() if not p.requires_grad)
    assert frozen > 22_000_000  # K: the whole encoder (and the head's frozen original)


def test_export_merges_the_adapters_into_a_plain_transformers_model(tmp_path):
    module = SequenceClassifier(lora=LoRA(rank=4))
    module.configure_model()
    opt = torch.optim.SGD([p for p in module.model.parameters() if p.requires_grad], lr=0.5)
    module.model(**batch(), labels=torch.tensor([0, 1, 0, 1])).loss.backward()
    opt.step()  # lora_B leaves zero: the adapters now change the output
    module.model.eval()
    with torch.no_grad():
        expected = module.model(**batch()).logits
    module.export_pretrained(tmp_path / "hf_model")
    assert not is_lora(module.model)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf_model").eval()
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch()).logits, expected)
