"""The model's parts read from the model (`lit_memory.hf.anatomy`) and everything that acts on them, for every
family lit_memory supports: a tiny random model of each (tests/families.py: hidden 32, 2 layers, built
offline from small configs) through buckets, freeze, checkpointing, the fused step, LoRA, the decoders'
padding and pooling, the 8-bit embedding state, the simulation, and each shipped recipe's model settings.
A few end-to-end fits (marked ``fit``) run the CLI on some families and reload the result with plain
transformers."""

from __future__ import annotations

import functools
import math
import pkgutil
from pathlib import Path

import families as fam
import pytest
import torch
import yaml
from conftest import COMPILED, FAST, RECIPES, the_error
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from lit_memory.__main__ import main
from lit_memory.errors import UserError
from lit_memory.fused import OptimizerInBackward, group_parameters
from lit_memory.hf.anatomy import Anatomy, parameter_units, skeleton
from lit_memory.hf.lora import LoRA, family_targets
from lit_memory.hf.tokenizing import load_tokenizer
from lit_memory.memory.hardware.gpus import Target
from lit_memory.model import SequenceClassifier, freeze_modules
from lit_memory.optim import eightbit
from lit_memory.optim.configure import weight_decay_groups
from lit_memory.planning.prediction.predict import simulate_or_decline
from lit_memory.planning.prediction.step import OptimizerSpec, Step

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster on two shared cores
FAMILIES = list(fam.FAMILIES)
# family -> head parts, attention kind, MLP kind, norm kind, pooling, embedding matrices
EXPECTED = {
    "bert": (("classifier",), "bidirectional", "dense", "layernorm", "first", 3),
    "roberta": (("classifier",), "bidirectional", "dense", "layernorm", "first", 3),
    "xlm-roberta": (("classifier",), "bidirectional", "dense", "layernorm", "first", 3),
    "electra": (("classifier",), "bidirectional", "dense", "layernorm", "first", 3),
    "distilbert": (("pre_classifier", "classifier"), "bidirectional", "dense", "layernorm", "first", 2),
    "deberta-v2": (("pooler", "classifier"), "disentangled", "dense", "layernorm", "first", 2),  # + relative positions
    "deberta-v3": (("pooler", "classifier"), "disentangled", "dense", "layernorm", "first", 2),
    "modernbert": (("head", "classifier"), "global_local", "gated", "layernorm", "first", 1),
    "gpt2": (("score",), "causal", "dense", "layernorm", "last", 2),
    "qwen3": (("score",), "causal", "gated", "rmsnorm", "last", 1),
    "llama": (("score",), "causal", "gated", "rmsnorm", "last", 1),
    "gemma3": (("score",), "causal", "gated", "rmsnorm", "last", 1),
}
# peft's own defaults where it has them, the attention block's linear layers otherwise
LORA_TARGETS = {
    "bert": {"query", "value"}, "roberta": {"query", "value"}, "xlm-roberta": {"query", "value"},
    "electra": {"query", "value"}, "distilbert": {"q_lin", "k_lin", "v_lin", "out_lin"},
    "deberta-v2": {"query_proj", "value_proj"}, "deberta-v3": {"query_proj", "value_proj"},
    "modernbert": {"Wqkv", "Wo"}, "gpt2": {"c_attn"}, "qwen3": {"q_proj", "v_proj"}, "llama": {"q_proj", "v_proj"},
    "gemma3": {"q_proj", "v_proj"},
}
# fake tensors meet a scalar read back (ModernBERT). DeBERTa's head took its `nonzero` loss path only while the
# config's problem_type was unset; the module now always sets it (`lit_memory.hf.config.load_config`), and it simulates.
SIMULATION_DECLINES = {"modernbert"}
# 2gb: torchao compiles per shape; the compiled recipes are their parents compiled (tests/run/test_compiling.py)
RECIPE_NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml") if p.stem != "2gb" and p.stem not in COMPILED)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: fam.folder(family, root) for family in FAMILIES}


def module(folders, family: str, seed: int = 0, **settings) -> SequenceClassifier:
    """The family's classifier as `fit` builds it (pad token set from the tokenizer where the config has none)."""
    built = SequenceClassifier(model_name_or_path=str(folders[family]), pretrained=False, **settings)
    torch.manual_seed(seed)
    built.configure_model()
    return built


def step(model: nn.Module, optimizer, batch, seed: int = 0, autocast: bool = False) -> torch.Tensor:
    torch.manual_seed(seed)  # the same dropout masks in every copy
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


# -- the parts -------------------------------------------------------------------------------------


def test_the_parts_are_read_from_each_family():
    for family in FAMILIES:  # one test item: the per-test clean-up costs more than these checks
        check_parts(family)


def check_parts(family: str) -> None:
    model = fam.model(family)
    parts = Anatomy.of(model)
    head, attention, mlp, norm, pooling, embeddings = EXPECTED[family]
    assert len(parts.layers) == 2 and isinstance(parts.layers, nn.ModuleList)
    assert parts.head_names == head, family
    assert (parts.attention, parts.pooling, len(parts.embeddings)) == (attention, pooling, embeddings), family
    assert {(s.mlp, s.norm) for s in parts.shapes} == {(mlp, norm)}
    assert parts.word_embeddings in parts.embeddings
    assert parts.vocab_size == fam.VOCAB
    # every parameter is in exactly one of: the embedding modules, the layers, the head, or elsewhere in the body
    in_layers = {id(p) for layer in parts.layers for p in layer.parameters()}
    in_head = {id(p) for _, part in parts.head for p in part.parameters()}
    in_embeddings = {id(p) for m in parts.embedding_modules for p in m.parameters()}
    assert not (in_layers & in_head) and not (in_layers & in_embeddings) and not (in_head & in_embeddings)
    assert {id(e.weight) for e in parts.embeddings} <= in_embeddings


def test_a_peft_wrapper_and_a_meta_skeleton_have_the_same_parts(folders):
    lora = module(folders, "deberta-v3", lora=LoRA(rank=2))
    wrapped = Anatomy.of(lora.model)
    meta = skeleton(fam.config("deberta-v3"))
    assert wrapped.head_names == meta.head_names == ("pooler", "classifier")
    assert len(wrapped.layers) == len(meta.layers) == 2
    assert wrapped.linear_names == meta.linear_names  # peft's base_layer / lora_A / lora_B left out


@pytest.mark.parametrize(
    "family, config, dropout",
    [
        (
            "bert",
            {"hidden_dropout_prob": 0.11, "attention_probs_dropout_prob": 0.12, "classifier_dropout": 0.14},
            (0.11, 0.12, 0.11, 0.14),
        ),
        ("gpt2", {"resid_pdrop": 0.11, "attn_pdrop": 0.12, "embd_pdrop": 0.13}, (0.11, 0.12, 0.13, 0.0)),
        (
            "distilbert",
            {"dropout": 0.11, "attention_dropout": 0.12, "seq_classif_dropout": 0.14},
            (0.11, 0.12, 0.11, 0.14),
        ),
        (
            "modernbert",
            {"mlp_dropout": 0.11, "attention_dropout": 0.12, "embedding_dropout": 0.13, "classifier_dropout": 0.14},
            (0.11, 0.12, 0.13, 0.14),
        ),
        ("llama", {"attention_dropout": 0.12}, (0.0, 0.12, 0.0, 0.0)),
    ],
)
def test_dropout_is_read_under_each_familys_own_names(family, config, dropout):
    found = Anatomy.of(fam.model(family, **config)).dropout
    assert (found.hidden, found.attention, found.embedding, found.classifier) == dropout


def test_layer_shapes_follow_the_config_not_bert():
    qwen3 = Anatomy.of(fam.model("qwen3")).shapes[0]
    # q wider than hidden
    assert (qwen3.hidden, qwen3.heads, qwen3.kv_heads, qwen3.head_dim, qwen3.ffn) == (32, 4, 2, 16, 64)
    assert qwen3.activation == "silu"
    gpt2 = Anatomy.of(fam.model("gpt2")).shapes[0]
    assert (gpt2.ffn, gpt2.activation) == (128, "gelu_new")  # n_inner unset: 4 x hidden
    assert [s.window for s in Anatomy.of(fam.model("modernbert")).shapes] == [None, 8]  # global, then local (16 / 2)
    assert Anatomy.of(fam.model("deberta-v3")).attention_implementation == "eager"


# -- what acts on them -----------------------------------------------------------------------------


def test_each_transformer_layer_is_one_bucket():
    for family in FAMILIES:
        check_buckets(family)


def check_buckets(family: str) -> None:
    model = fam.model(family)
    parts = Anatomy.of(model)
    units = parameter_units(model)
    flat = [id(p) for unit in units for p in unit]
    assert sorted(flat) == sorted(id(p) for p in model.parameters())  # each parameter once
    buckets = group_parameters(list(model.parameters()), units, "layer")
    layer_buckets = [{id(p) for p in layer.parameters()} for layer in reversed(parts.layers)]  # backward order
    found = [{id(p) for p in b} for b in buckets if {id(p) for p in b} in layer_buckets]
    assert found == layer_buckets, family


def test_freeze_acts_on_the_familys_embeddings_and_layers():
    for family in FAMILIES:
        check_freeze(family)


def check_freeze(family: str) -> None:
    model = fam.model(family)
    parts = Anatomy.of(model)
    freeze_modules(model, 1, parts)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(p.requires_grad for e in parts.embeddings for p in e.parameters())
    assert not any(p.requires_grad for p in parts.layers[0].parameters())
    assert all(p.requires_grad for p in parts.layers[1].parameters())
    assert all(p.requires_grad for _, part in parts.head for p in part.parameters())
    body = fam.model(family)
    freeze_modules(body, "body")
    assert {n.split(".")[0] for n, p in body.named_parameters() if p.requires_grad} == set(EXPECTED[family][0])
    assert trains  # the rest of the model still trains


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_recomputes_every_layer_and_changes_no_gradient(folders, family):
    plain, checkpointed = module(folders, family), module(folders, family, gradient_checkpointing=True)
    assert all(layer.gradient_checkpointing for layer in Anatomy.of(checkpointed.model).layers)
    batch = fam.batch(family)
    for m in (plain, checkpointed):
        torch.manual_seed(1)
        m.model(**batch).loss.backward()
    for (name, a), (_, b) in zip(plain.model.named_parameters(), checkpointed.model.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_step_equals_the_unfused_one(folders, family):
    unfused, fused = module(folders, family), module(folders, family)
    optimizers = [torch.optim.AdamW(weight_decay_groups(m.model), lr=1e-3, weight_decay=0.01) for m in (unfused, fused)]
    fusion = OptimizerInBackward(optimizers[1], parameter_units(fused.model), "layer")
    assert len(fusion.hooks.buckets) < sum(1 for _ in fused.model.parameters())  # layers, not parameters
    for i in range(2):
        for m, opt in zip((unfused, fused), optimizers):
            step(m.model, opt, fam.batch(family, seed=i), seed=i)
    fusion.remove()
    for (name, a), (_, b) in zip(unfused.model.named_parameters(), fused.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapts_the_familys_targets_and_trains_the_untrained_head_in_full(folders, family, tmp_path):
    assert set(family_targets(Anatomy.of(fam.model(family)))) == LORA_TARGETS[family]
    lora = module(folders, family, lora=LoRA(rank=4))
    head = EXPECTED[family][0]
    trainable = {n for n, p in lora.model.named_parameters() if p.requires_grad}
    adapters = {n for n in trainable if "lora_" in n}
    assert adapters and all(any(t in n for t in LORA_TARGETS[family]) for n in adapters)
    full = trainable - adapters
    assert full and all(any(f".{h}." in n for h in head) for n in full)  # the head parts (DeBERTa's pooler too)
    assert {h for h in head if any(f".{h}." in n for n in full)} == set(head)
    before = {n: p.detach().clone() for n, p in lora.model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in lora.model.parameters() if p.requires_grad], lr=1e-2)
    step(lora.model, optimizer, fam.batch(family))
    changed = {n for n, p in lora.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed <= trainable
    assert any("lora_B" in n for n in changed) and any(n in full for n in changed)
    lora.model.eval()
    batch = {k: v for k, v in fam.batch(family).items() if k != "labels"}
    with torch.no_grad():
        expected = lora.model(**batch).logits
    lora.export_pretrained(tmp_path / "hf_model")  # adapters merged: a plain transformers model
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf_model").eval()
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_lora_targets_that_match_nothing_are_one_line_naming_the_linear_layers(folders, family):
    with pytest.raises(UserError) as err:
        SequenceClassifier(
            model_name_or_path=str(folders[family]), pretrained=False, lora=LoRA(target_modules=["nope"])
        )
    message = str(err.value)
    assert "\n" not in message and "match no layer" in message
    assert ", ".join(Anatomy.of(fam.model(family)).linear_names) in message  # GPT-2's Conv1D c_attn, c_fc, c_proj too


def test_lora_that_matches_nothing_stops_before_the_run_folder_exists(tmp_path, capsys):
    root = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--model.lora.target_modules=[nope]", f"--trainer.default_root_dir={root}"])
    assert exit_.value.code == 2
    assert the_error(capsys.readouterr().err).startswith("error: model.lora.target_modules (nope) match no layer of")
    assert not root.exists()


# -- decoders ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, pad", [("gpt2", 0), ("llama", 1), ("qwen3", 0), ("gemma3", 0)])
def test_a_decoder_pads_with_the_tokenizers_pad_token_or_its_eos(folders, family, pad):
    """GPT-2 and Llama have no pad token: EOS (0, 1) pads; Qwen3's tokenizer has one its config lacks."""
    built = SequenceClassifier(model_name_or_path=str(folders[family]), pretrained=False)
    tokenizer = load_tokenizer(str(folders[family]))
    assert built.hf_config.pad_token_id == tokenizer.pad_token_id == pad
    assert tokenizer.padding_side == "right"


@pytest.mark.parametrize("family", fam.DECODERS)
def test_last_token_pooling_reads_the_last_real_token_with_left_or_right_padding(folders, family):
    model = module(folders, family).model.eval()
    pad = model.config.pad_token_id
    long, short = [20, 30, 40, 50, 60], [70, 80, 90]
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([short])).logits[0]
        sides = {"right": [short + [pad, pad]]}
        if family != "gpt2":  # GPT-2's absolute positions would shift: lit_memory pads on the right
            sides["left"] = [[pad, pad] + short]
        for side, padded in sides.items():
            ids = torch.tensor([long] + padded)
            logits = model(input_ids=ids, attention_mask=(ids != pad).long()).logits
            torch.testing.assert_close(logits[1], alone, atol=1e-5, rtol=0, msg=side)
    if pad == model.config.eos_token_id:  # pad == eos: an EOS inside a text is not mistaken for padding
        with torch.no_grad():
            inside = torch.tensor([[20, pad, 30]])
            assert not torch.allclose(model(input_ids=inside).logits, model(input_ids=torch.tensor([[20, pad]])).logits)


# -- embeddings --------------------------------------------------------------------------------------


def test_stable_embedding_is_refused_for_gemma3s_scaled_embedding(folders):
    with pytest.raises(UserError, match="Gemma3TextScaledWordEmbedding") as err:
        SequenceClassifier(
            model_name_or_path=str(folders["gemma3"]), pretrained=False, embedding_optimizer_state="stable_embedding"
        )
    assert "\n" not in str(err.value)
    eightbit.check_stable_embedding(fam.model("bert").get_input_embeddings())  # a plain nn.Embedding is swapped


def test_auto_keeps_small_embeddings_on_32bit_state_and_quantises_large_ones(folders, monkeypatch):
    """Scaled down: a 9000-value bound between the position (256 x 32) and word (300 x 32) embeddings."""
    import bitsandbytes as bnb

    monkeypatch.setattr(eightbit, "AUTO_32BIT_VALUES", 9000)
    built = SequenceClassifier(
        model_name_or_path=str(folders["bert"]), pretrained=False, config_overrides={"max_position_embeddings": 256},
        optimizer=functools.partial(bnb.optim.AdamW8bit, lr=1e-3),
    )
    built.configure_model()
    optimizer = built.build_optimizer()
    step(built.model, optimizer, fam.batch("bert"))
    embeddings = built.model.bert.embeddings
    assert optimizer.state[embeddings.word_embeddings.weight]["state1"].dtype == torch.uint8
    assert optimizer.state[embeddings.position_embeddings.weight]["state1"].dtype == torch.float32


@pytest.mark.parametrize(
    "state, kept",
    [("auto", {"position", "token_type"}), ("32bit", {"word", "position", "token_type"}),
     ("unquantized", {"word", "position", "token_type"}), ("8bit", set())],
)
def test_one_embedding_state_setting_picks_the_same_matrices_under_both_low_bit_libraries(
    folders, monkeypatch, state, kept
):
    """``embedding_optimizer_state`` (`lit_memory.optim.eightbit.unquantised`): the matrices that keep unquantised
    state are the same for bitsandbytes (its per-parameter 32-bit override) and torchao (plain state tensors,
    `lit_memory.optim.lowbit.keep_plain_state`: fp32 here, the weights' dtype). Scaled down as above: the word
    embedding (9600 values) is above a 9000-value bound, the position (8192) and token type (64) ones below."""
    import bitsandbytes as bnb
    from torchao.optim import AdamW8bit

    monkeypatch.setattr(eightbit, "AUTO_32BIT_VALUES", 9000)
    for factory in (bnb.optim.AdamW8bit, AdamW8bit):
        built = SequenceClassifier(
            model_name_or_path=str(folders["bert"]),
            pretrained=False,
            config_overrides={"max_position_embeddings": 256},
            embedding_optimizer_state=state,
            optimizer=functools.partial(factory, lr=1e-3),
        )
        built.configure_model()
        optimizer = built.build_optimizer()
        embeddings = built.model.bert.embeddings
        named = {n: getattr(embeddings, f"{n}_embeddings").weight for n in ("word", "position", "token_type")}
        if factory is AdamW8bit:
            plain = getattr(optimizer, "plain_state", {})
            assert {n for n, p in named.items() if id(p) in plain} == kept, factory
            # the state's dtype (None: the weight's own): fp32 weights, fp32 state either way
            assert all((plain[id(named[n])] or named[n].dtype) == torch.float32 for n in kept)
        else:
            override = {n for n, p in named.items() if optimizer.mng.pid2config.get(id(p), {}).get("optim_bits") == 32}
            assert override == kept, factory


@pytest.mark.parametrize("family", FAMILIES)
def test_the_simulation_runs_or_declines_in_one_line(folders, family):
    described = Step(
        model={"model_name_or_path": str(folders[family]), "num_labels": 2},
        optimizer=OptimizerSpec("torch.optim.AdamW", {"lr": 1e-3}),
        batch_size=2,
        max_length=8,
        target=Target(type="cpu"),
    )
    prediction, declined = simulate_or_decline(described)
    if family in SIMULATION_DECLINES:
        assert prediction is None and "\n" not in declined and declined.startswith("not simulated:")
    else:
        assert declined is None and prediction.footprint.peak > 0


# (batch, length): two shapes, so the per-family terms are not fitted to one point (DeBERTa's relative terms
# scale with the batch and with the length apart from the tokens)
ACTIVATION_SHAPES = ((4, 32), (2, 64))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_analytic_activation_model_holds_every_family_within_15_percent(folders, family):
    """What each family's layers keep (`lit_memory.memory.model.layers.LayerSpec`: GQA, q/k norms, rotary, the
    activation's saved tensors, pre-norm and sandwich norms, DeBERTa's relative terms) against the same step
    on real tensors, tracked (`measure`): the peak, and the activations at the forward phase's peak.
    docs/memory.md shows the ratios (examples/family_ratios.py)."""
    from lit_memory.planning.prediction.analytic import analytic
    from lit_memory.planning.prediction.simulate import measure

    for batch, length in ACTIVATION_SHAPES:
        step = Step(
            model={"model_name_or_path": str(folders[family]), "num_labels": 2},
            optimizer=OptimizerSpec("torch.optim.AdamW", {"lr": 1e-3}),
            batch_size=batch, max_length=length, target=Target(type="cpu"),
        )
        predicted, measured = analytic(step, levels=False).footprint, measure(step).footprint
        forward = [f.phases["forward"]["activations"] for f in (predicted, measured)]
        assert predicted.peak == pytest.approx(measured.peak, rel=0.15), (batch, length, predicted.peak / measured.peak)
        assert forward[0] == pytest.approx(forward[1], rel=0.15), (batch, length, forward[0] / forward[1])


# -- every shipped recipe's model settings, one step on each family ------------------------------------------


def recipe_settings(name: str) -> tuple[dict, dict]:
    recipe = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    model, trainer = dict(recipe.get("model", {})), recipe.get("trainer", {})
    spec = model.pop("optimizer")
    model["optimizer"] = functools.partial(pkgutil.resolve_name(spec["class_path"]), **spec.get("init_args", {}))
    if model.get("lora") is not None:
        model["lora"] = LoRA(**model["lora"])
    # `auto` is resolved by the command line for a budget (tests/planning/test_recompute.py); here a per-layer
    # plan stands in: the first layer fully checkpointed, the others whole (every layer, where offloading needs it)
    if model.get("offload_activations") == "auto":
        model["offload_activations"] = False
    if model.get("gradient_checkpointing") == "auto":
        model["gradient_checkpointing"] = "full" if model.get("offload_activations") else {"full": 1}
    strategy = (trainer.get("strategy") or {}).get("init_args", {})
    return model, {
        "precision": trainer.get("precision", "32-true"),
        "fused": bool(strategy.get("fused")),
        "bucket": strategy.get("bucket", "layer"),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_each_recipe_trains_each_family(folders, family):
    for recipe in RECIPE_NAMES:  # a test item per family: the per-test clean-up would cost more than the steps
        check_recipe(folders, family, recipe)


def check_recipe(folders, family: str, recipe: str) -> None:
    settings, run = recipe_settings(recipe)
    built = module(folders, family, **settings)
    optimizer = built.build_optimizer()
    fusion = OptimizerInBackward(optimizer, parameter_units(built.model), run["bucket"]) if run["fused"] else None
    before = {n: p.detach().clone() for n, p in built.model.named_parameters()}
    loss = step(built.model, optimizer, fam.batch(family), autocast=run["precision"] == "bf16-mixed")
    if fusion is not None:
        fusion.remove()
    assert math.isfinite(loss.item()), recipe
    trains = {n for n, p in built.model.named_parameters() if p.requires_grad}
    changed = {n for n, p in built.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trains, recipe  # frozen parts stay as they were
    head = EXPECTED[family][0]
    assert any(any(f"{h}." in n for h in head) for n in changed), recipe  # the head learns under every recipe


# -- end to end --------------------------------------------------------------------------------------


# Families whose fit loads weights saved in bf16, as Qwen3, Llama and Gemma 3 are shipped (the others train from their
# config): the weights train in the recipe's dtype, whatever the checkpoint's, and hf_model/ is saved in the
# checkpoint's.
SAVED_IN_BF16 = {"qwen3", "llama", "gemma3", "modernbert"}


@pytest.mark.fit
@pytest.mark.parametrize(
    "family, recipe",
    [  # every family and every shipped recipe once
        ("bert", "short-seq"), ("roberta", "adafactor"), ("xlm-roberta", "8bit"), ("electra", "accumulate"),
        ("distilbert", "freeze"), ("deberta-v2", "checkpointing"), ("deberta-v3", "lora"), ("modernbert", "4gb"),
        ("gpt2", "bf16"), ("qwen3", "2gb"), ("llama", "qlora"), ("gemma3", "baseline"),  # fused: in 4gb's and 2gb's
    ],
)
def test_a_fit_saves_a_model_that_loads_with_plain_transformers(folders, family, recipe, tmp_path):
    from lit_memory.optim.precision import trains_with
    from lit_memory.settings import Precision

    folder, weights = folders[family], ["--model.pretrained=false"]
    if family in SAVED_IN_BF16:
        folder = fam.folder(family, tmp_path / "bf16")
        fam.model(family).to(torch.bfloat16).save_pretrained(folder)
        weights = ["--model.pretrained=true", "--trainer.enable_checkpointing=true"]
    main(["fit", "--recipe", recipe, f"--model.model_name_or_path={folder}", "--data.max_length=32", *FAST, *weights,
          f"--trainer.default_root_dir={tmp_path}"])
    exported = next(tmp_path.glob("lightning_logs/version_*/hf_model"))
    model = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None  # decoders: EOS where none was given
    batch = tokenizer(["a fine day", "the worst hotel ever"], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()
    assert not any("lora" in n for n, _ in model.named_parameters())
    if family in SAVED_IN_BF16:
        # the checkpoint holds the weights the recipe trains (fp32 but under bf16-true, which a CPU without bf16 runs
        # as 32-true), hf_model/ the checkpoint's bf16: the trained weights rounded to it
        precision = yaml.safe_load((RECIPES / f"{recipe}.yaml").read_text())["trainer"]["precision"]
        promised = Precision.of(trains_with(precision, "cpu")).param
        best = next(tmp_path.glob("lightning_logs/version_*/checkpoints/best-*.ckpt"))
        trained = {k.removeprefix("model."): v for k, v in torch.load(best, weights_only=True)["state_dict"].items()}
        assert {v.dtype for v in trained.values() if v.is_floating_point()} == {promised}
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        if recipe == "qlora":  # the 4-bit base dequantised, the adapters added: a plain model, nothing quantised
            assert "quantization_config" not in model.config.to_dict()
            assert any(v.dtype == torch.uint8 for v in trained.values())  # it trained on a 4-bit base (packed weights)
            return
        for name, value in model.state_dict().items():
            assert torch.equal(value, trained[name].to(torch.bfloat16)), name


def test_a_model_that_shares_its_layers_is_named_unsupported_in_one_line():
    """ALBERT runs one layer module num_hidden_layers times: nothing per layer (plans, buckets) applies."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    from lit_memory.hf.anatomy import find_layers

    config = AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                          intermediate_size=64, max_position_embeddings=32)
    with pytest.raises(UserError) as error:
        find_layers(AlbertForSequenceClassification(config))
    message = str(error.value)
    assert "\n" not in message and message.startswith("AlbertForSequenceClassification shares its layers")
    assert "does not support" in message
