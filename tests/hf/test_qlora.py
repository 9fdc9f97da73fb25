"""QLoRA (`lit_memory.hf.qlora`, ``model.lora.base: nf4``) on the CPU with bitsandbytes' CPU backend: tiny decoders
learn through full fine-tuning, LoRA and QLoRA; a QLoRA model exports a plain model that reloads to its predictions; the
memory model counts the 4-bit base as bitsandbytes holds it; what cannot work is one line."""

from __future__ import annotations

import contextlib
import json

import families as fam
import pytest
import torch
from test_model import built_by_lightning
from transformers import AutoModelForSequenceClassification

from lit_memory.errors import UserError
from lit_memory.hf import qlora
from lit_memory.hf.config import quiet_transformers
from lit_memory.hf.lora import LoRA
from lit_memory.run import export
from lit_memory.settings import Precision

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster on two shared cores


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Qwen3 and Llama with their weights saved in bf16, as those families ship."""
    root = tmp_path_factory.mktemp("qlora")
    folders = {}
    for family in ("qwen3", "llama"):
        folder = fam.folder(family, root)
        fam.model(family, seed=1).to(torch.bfloat16).save_pretrained(folder)
        folders[family] = str(folder)
    return folders


def task(n: int, seed: int) -> dict[str, torch.Tensor]:
    """A synthetic task a decoder must read the whole text for: label 1 where token 77 occurs anywhere in it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 250, (n, 12), generator=g)
    ids[ids == 77] = 78
    labels = torch.randint(0, 2, (n,), generator=g)
    where = torch.randint(0, 12, (n,), generator=g)
    ids[labels == 1, where[labels == 1]] = 77
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


MODES = {
    "full": None,
    "LoRA": LoRA(rank=8, alpha=16, dropout=0.0),
    "QLoRA": LoRA(rank=8, alpha=16, dropout=0.0, base="nf4"),
}
LEARNING_RATES = {"full": 3e-3, "LoRA": 1e-2, "QLoRA": 1e-2}
STEPS = {"full": 80, "LoRA": 160, "QLoRA": 160}  # adapters of rank 8 on q/v of a 32-wide model learn slower


@pytest.mark.parametrize("mode", list(MODES))
def test_a_tiny_decoder_learns_a_synthetic_task_through_full_lora_and_qlora(saved, mode):
    """The stated metric: accuracy on 256 held-out texts at least 0.9 (chance: 0.5) after 80 AdamW steps of 32 (full)
    or 160 (LoRA, QLoRA; measured on this project's CPU: 0.94 and 0.94, full 0.9+ at 80). The weights were saved in
    bf16; full fine-tuning trains fp32 weights, LoRA and QLoRA fp32 adapters and head (QLoRA over 4-bit NF4 layers)."""
    lr = LEARNING_RATES[mode]
    torch.manual_seed(0)  # the adapters' and head's initialisation
    module, optimizer = built_by_lightning(
        "32-true", model_name_or_path=saved["qwen3"], lora=MODES[mode], optimizer=lambda p: torch.optim.AdamW(p, lr=lr)
    )
    trained = [p for p in module.model.parameters() if p.requires_grad]
    assert {p.dtype for p in trained} == {torch.float32}
    assert any(qlora.is_quantised(p) for p in module.model.parameters()) == (mode == "QLoRA")
    for step in range(STEPS[mode]):
        batch = task(32, seed=step)
        module.model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    module.model.eval()
    held_out = task(256, seed=10_000)
    with torch.no_grad():
        predicted = module.model(
            input_ids=held_out["input_ids"], attention_mask=held_out["attention_mask"]
        ).logits.argmax(-1)
    accuracy = (predicted == held_out["labels"]).float().mean().item()
    assert accuracy >= 0.9, (mode, accuracy)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_qlora_model_exports_a_plain_model_that_reloads_to_its_predictions(saved, tmp_path, precision):
    """hf_model/ is the 4-bit base dequantised with the adapters added in fp32 (peft would requantise the sum) and the
    trained head: no quantisation config, no adapter. Saved in fp32, a plain reload predicts what the QLoRA model
    predicts (32-true: to float rounding; bf16-mixed: the QLoRA model computed in bf16); saved in the checkpoint's bf16,
    the same classes."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    module, optimizer = built_by_lightning(
        precision, model_name_or_path=saved["llama"], lora=LoRA(rank=4, base="nf4"),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    def forward_context():  # Lightning's autocast for bf16-mixed
        return (
            MixedPrecision("bf16-mixed", "cpu").forward_context()
            if precision == "bf16-mixed"
            else contextlib.nullcontext()
        )

    batch = task(8, seed=1)
    for _ in range(3):  # the adapters (B starts at zero) and the head move away from their start
        with forward_context():
            loss = module.model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    module.model.eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad(), forward_context():
        expected = module.model(**inputs).logits.float()
    for save_dtype, folder in (("fp32", tmp_path / "fp32"), ("checkpoint", tmp_path / "checkpoint")):
        module.hparams.save_dtype = save_dtype
        if save_dtype == "checkpoint":  # a second export: the module now holds the merged plain model
            assert not any(qlora.is_quantised(p) for p in module.model.parameters())
            # the hf_model line says the dtype and how it was made
            assert export.dtype_words(module) == (
                "bf16 (the checkpoint's dtype; trained in fp32 adapters and head over a 4-bit base, merged into it "
                "dequantised)"
            )
        module.export_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        assert "quantization_config" not in config and config["dtype"] == (
            "float32" if save_dtype == "fp32" else "bfloat16"
        )
        with quiet_transformers():
            reloaded = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        assert not any("lora" in n for n, _ in reloaded.named_parameters())
        assert not any(qlora.is_quantised(p) for p in reloaded.parameters())
        with torch.no_grad():
            got = reloaded(**inputs).logits.float()
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        if save_dtype == "fp32":
            tolerance = 1e-5 if precision == "32-true" else 3e-2
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_the_memory_model_counts_the_4bit_base_as_bitsandbytes_holds_it(saved):
    """The meta build quantises with bitsandbytes' own meta kernels: its weights' bytes (packed 4-bit values, scales,
    nested scales, code maps) and parameter count equal the real CPU load's."""
    from lit_memory.planning.prediction.state_model import meta_build, state
    from lit_memory.planning.prediction.step import OptimizerSpec, Step

    real, _ = built_by_lightning("bf16-mixed", model_name_or_path=saved["qwen3"], lora=LoRA(rank=4, base="nf4"))
    step = Step(
        model={"model_name_or_path": saved["qwen3"], "num_labels": 2, "lora": {"rank": 4, "base": "nf4"}},
        optimizer=OptimizerSpec("torch.optim.AdamW"), precision="bf16-mixed",
    )
    module, optimizer = meta_build(step)
    predicted = state(step, module, optimizer)
    params = list(real.model.parameters())
    assert predicted.weights == sum(qlora.weight_bytes(p) for p in params) + sum(b.nbytes for b in real.model.buffers())
    assert predicted.parameters == sum(qlora.values(p) for p in params)
    quantised = [m for m in module.model.modules() if qlora.is_quantised(getattr(m, "weight", None))]
    assert quantised and all(
        qlora.values(m.weight) == m.in_features * m.out_features == 2 * m.weight.numel() for m in quantised
    )


def test_what_qlora_cannot_do_is_one_line():
    """A family whose layers hold no linear layer (SqueezeBERT: 1x1 convolutions) has nothing bitsandbytes quantises;
    a precision that casts every weight to 16 bits would train the adapters in 16 bits; a bf16 base needs bf16
    compute."""
    from transformers import SqueezeBertConfig

    from lit_memory.hf.anatomy import Anatomy

    config = SqueezeBertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        embedding_size=32,
    )
    with pytest.raises(UserError) as error:
        qlora.check_quantisable(Anatomy.of(AutoModelForSequenceClassification.from_config(config)))
    assert "\n" not in str(error.value) and "bitsandbytes cannot quantise this family" in str(error.value)
    assert "SqueezeBertForSequenceClassification's layers have none (Conv1d" in str(error.value)
    with pytest.raises(
        UserError, match=r"^model.lora.base nf4 \(QLoRA\) trains its adapters and head in fp32 .* bf16-true"
    ):
        LoRA(base="nf4").check_precision(Precision.of("bf16-true"))
    with pytest.raises(
        UserError, match=r"^model.lora.base bf16 holds the frozen base in bf16, .* 32-true computes in float32"
    ):
        LoRA(base="bf16").check_precision(Precision.of("32-true"))
    with pytest.raises(UserError, match=r"^model.lora.base 'int4' is not one of: null, bf16, nf4$"):
        LoRA(base="int4").check()
