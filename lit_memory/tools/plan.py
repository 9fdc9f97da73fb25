"""``python -m lit_memory plan --budget 4GiB [configs...]``: the fastest recipe predicted to fit.

The candidates are the shipped recipes' switches (every setting that differs between recipes:
precision, checkpointing, optimizer, freezing, sequence length, strategy) in every combination,
with the configured effective batch split into micro-batches of every power of two. Each is
predicted analytically (milliseconds), one quality class of the rule at a time (`ranked`: full fine-tuning
before LoRA before QLoRA), until one fits; the fastest that fits is confirmed by the simulation and
written as a recipe, with its predicted breakdown and why its mode (``# mode:``) in the header.

"Fastest" follows the rule stated in `lit_memory.planning.choose` (quality, no accumulation, the least
recompute, the larger micro-batch, 16-bit compute on CUDA, more optimizer state, Lightning's step before
the fused step). The budget is a device budget: what ``nvidia-smi`` would show for the process, the
predicted tensors plus the caching allocator's reserve plus the CUDA context (`lit_memory.planning.prediction.predict`).

With ``--measure`` the measured time per optimizer step decides among the first candidates that fit.
"""

from __future__ import annotations

import functools
import gc
import io
import itertools
import shlex
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap

from lit_memory import files
from lit_memory.cli import resolve
from lit_memory.config import trust
from lit_memory.config.shipped import recipes_dir
from lit_memory.errors import UserError
from lit_memory.hf.lora import LoRA
from lit_memory.memory.hardware.gpus import GPUS
from lit_memory.memory.margin import Limit, usable
from lit_memory.memory.measure.footprint import CATEGORIES, format_bytes
from lit_memory.memory.measure.report import breakdown
from lit_memory.memory.settings import Size
from lit_memory.optim.optimizers import check_settings
from lit_memory.planning.choose import MODES, RULE, mode_of, quality_class, rank
from lit_memory.planning.prediction.analytic import analytic
from lit_memory.planning.prediction.predict import device_total, level, simulate_or_decline
from lit_memory.planning.prediction.step import Prediction, Step
from lit_memory.planning.recompute import planned
from lit_memory.planning.recompute import resolve as plan_layers
from lit_memory.run.monitor import StepTimer
from lit_memory.sandbox.bounds import read_yaml
from lit_memory.settings import dotted_leaves, key_of, locate, to_plain
from lit_memory.tools import arguments
from lit_memory.tools.arguments import MEASURED
from lit_memory.tools.estimate import step_of

BATCH_KEYS = ("data.batch_size", "trainer.accumulate_grad_batches")
# Not combined: memory.* keys that describe the run (its budget, its measuring), and model.compile, how a step runs
# rather than what it holds (the plan predicts the eager step; cudagraphs also needs its recipe's max_length padding)
NOT_COMBINED = ("memory.tier", "memory.budget", "memory.track_steps", "memory.simulate", "model.compile")
TIER = "memory.tier"  # written: the budget a planned recipe is made for
CONFIRMATIONS = 5  # candidates simulated, in rule order, before giving up
COMMENT_COLUMN = 34


@dataclass(frozen=True)
class Block:
    """One setting of a recipe: ``section.key``, its value (as YAML loads it: the nested maps keep their
    own comments) and its comment."""

    key: str
    value: Any
    comment: Optional[str] = None

    @functools.cached_property  # read for every combination of every candidate: once per block
    def plain(self) -> Any:
        """The value as plain dicts, lists and scalars (what the CLI parses)."""
        return to_plain(self.value)


@dataclass
class Recipe:
    name: str
    path: Path
    blocks: dict[str, Block]


def _yaml() -> YAML:
    yaml = YAML()  # round-trip: keeps comments, so a planned recipe says what each setting shrinks
    yaml.width = 120
    return yaml


def load_recipe(path: Path) -> Recipe:
    """A recipe's second-level settings, each with its value and its end-of-line comment (read round-trip, within
    the bounds a stranger's recipe is read with: `lit_memory.sandbox.bounds.read_yaml`)."""
    data = read_yaml(path, round_trip=True)
    blocks = {}
    for key, value in dotted_leaves(data, depth=2):
        container, name = locate(data, key)
        token = getattr(container, "ca", None) and container.ca.items.get(name, [None] * 3)[2]
        comment = token.value.strip().lstrip("#").strip() if token else None
        blocks[key] = Block(key, value, comment)
    return Recipe(path.stem, path, blocks)


def shipped_recipes(folder: Optional[Path] = None) -> list[Recipe]:
    """The shipped recipes (from the checkout or the installed package), baseline first."""
    folder = recipes_dir() if folder is None else folder
    paths = sorted(folder.glob("*.yaml"), key=lambda p: (p.stem != "baseline", p.stem))
    return [load_recipe(p) for p in paths]


# -- turning settings into setups ---------------------------------------------------------------


def _identity(step: Step) -> tuple:
    """What makes two candidates the same setup (settings a setup ignores dropped: only optimizers with quantised
    state read ``embedding_optimizer_state``, and only for embeddings that train (every freeze setting and LoRA
    freeze them), unless it swaps in StableEmbedding; LoRA freezes the whole base, so a freeze setting beside it
    changes nothing)."""
    model = dict(step.model)
    if model.get("lora") is not None:
        model.pop("freeze", None)
    low_bit = step.optimizer.library.quantises_state
    embeddings_train = model.get("freeze") is None and model.get("lora") is None
    if model.get("embedding_optimizer_state") != "stable_embedding" and not (low_bit and embeddings_train):
        model.pop("embedding_optimizer_state", None)
    return step.key(
        "model", "optimizer", "precision", "batch_size", "accumulate_grad_batches", "max_length", "fused", "target",
        model=model, target=step.target.allocator,
    )


@dataclass
class Candidate:
    blocks: dict[str, Block]  # every setting the planned recipe will state
    setup: Step
    prediction: Prediction  # analytic: tensors; the device total is computed when the rule gets to it

    @property
    def total(self) -> int:
        return device_total(self.setup)


def _micro_batches(effective: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs that keep the effective batch: every power-of-two split."""
    pairs = []
    accumulate = 1
    while accumulate <= effective:
        if effective % accumulate == 0:
            pairs.append((effective // accumulate, accumulate))
        accumulate *= 2
    return pairs


def _batch_blocks(micro: int, accumulate: int) -> dict[str, Block]:
    effective = micro * accumulate
    step = (
        "an optimizer step after every micro-batch"
        if accumulate == 1
        else f"activations: {accumulate} micro-batches of {micro} make one step of {effective}"
    )
    return {
        "data.batch_size": Block("data.batch_size", micro, "activations grow linearly with the micro-batch"),
        "trainer.accumulate_grad_batches": Block("trainer.accumulate_grad_batches", accumulate, step),
    }


def candidates(base: Step, recipes: list[Recipe], refused: Optional[dict[str, str]] = None) -> list[Candidate]:
    """Every combination of the recipes' differing settings, each micro-batch split, predicted. ``refused``: where
    given, what refused a mode of training outright (a LoRA base the model cannot have: a family bitsandbytes cannot
    quantise), by the mode's name (`mode_of`), for the line that says nothing fits."""
    found = (_predicted(blocks, setup, refused) for blocks, setup in _setups(base, recipes, refused))
    return [c for c in found if c is not None]


def ranked(
    base: Step, recipes: list[Recipe], refused: dict[str, str], everything: list[Candidate]
) -> Iterator[Candidate]:
    """`candidates` in the rule's order, predicted one quality class at a time (`quality_class`: 16-bit weights rounded
    to nearest or not, then full, LoRA, QLoRA): the rule reaches a class only after every setup of the classes before
    it, so a model that fits in full fine-tuning is never predicted with adapters. ``everything`` collects what has
    been predicted."""
    setups = _setups(base, recipes, refused)
    longest = max((setup.max_length for _, setup in setups), default=0)
    classes: dict[tuple, list[tuple[dict[str, Block], Step]]] = {}
    for blocks, setup in setups:
        classes.setdefault(quality_class(setup), []).append((blocks, setup))
    for key in sorted(classes):
        found = [c for c in (_predicted(blocks, setup, refused) for blocks, setup in classes[key]) if c is not None]
        everything.extend(found)
        yield from sorted(found, key=lambda c: rank(c.setup, c.prediction, longest))


def _setups(
    base: Step, recipes: list[Recipe], refused: Optional[dict[str, str]]
) -> list[tuple[dict[str, Block], Step]]:
    """Every combination of the recipes' differing settings, each micro-batch split, as a setup not yet predicted:
    one per setup that differs (`_identity`), with the settings closest to a shipped recipe."""
    # A recipe's tier is not a setting to combine (the plan's budget is the tier), its allocator settings are;
    # ``auto`` checkpointing is ranked as every layer full and refined per layer for the budget once chosen (`refine`).
    keys = list(dict.fromkeys(k for r in recipes for k in r.blocks if k not in BATCH_KEYS and k not in NOT_COMBINED))
    options: dict[str, list[Optional[Block]]] = {}
    for key in keys:
        seen: dict[str, Optional[Block]] = {}
        for recipe in recipes:
            block = recipe.blocks.get(key)
            if block is not None and key == CHECKPOINTING and block.plain == "auto":
                block = Block(key, True, "activations: keep layer inputs only, recompute the rest (non-reentrant)")
            if block is not None and key == OFFLOADING and block.plain == "auto":
                block = None  # weighed against recompute once a setup is chosen (`refine`)
            seen.setdefault(key_of(block.plain if block else "<absent>"), block)
        options[key] = list(seen.values())
    order = {k: i for i, k in enumerate(dict.fromkeys(k for r in recipes for k in r.blocks))}  # the recipes' order
    effective = base.batch_size * base.accumulate_grad_batches
    splits = [_batch_blocks(micro, accumulate) for micro, accumulate in _micro_batches(effective)]
    # How far each combination and split is from each recipe (the keys they differ in, as `_parent` counts them):
    # sums of one table per setting, so each option's plain value is compared once, not once per combination.
    differences = np.zeros([*map(len, options.values()), len(recipes)], dtype=np.int32)
    for axis, (key, choices) in enumerate(options.items()):
        table = np.array([[not _same(key, block, recipe) for recipe in recipes] for block in choices], dtype=np.int32)
        differences += table.reshape([len(choices) if i == axis else 1 for i in range(len(options))] + [len(recipes)])
    differences = differences.reshape(-1, len(recipes))  # in itertools.product's order
    split_differences = np.array(
        [[sum(not _same(key, split[key], recipe) for key in BATCH_KEYS) for recipe in recipes] for split in splits],
        dtype=np.int32,
    )
    kept: dict[tuple, tuple[dict[str, Block], Step, int]] = {}
    for index, combination in enumerate(itertools.product(*options.values())):
        chosen = {b.key: b for b in combination if b is not None}
        try:
            # Laid over once per combination; each micro-batch split is the same step with its two fields replaced
            # (neither changes what else a step reads from its settings).
            combined = base.with_settings({k: b.plain for k, b in chosen.items()})
        except UserError as err:
            _refusal(refused, chosen, err)
            continue  # settings refused together
        same_setting = _identity(combined)  # but for the two fields each split replaces
        for split, split_difference in zip(splits, split_differences):
            micro, accumulate = split["data.batch_size"].value, split["trainer.accumulate_grad_batches"].value
            if combined.fused and accumulate > 1:
                continue  # the fused step applies each gradient as it arrives: nothing to accumulate into
            identity = (same_setting, micro, accumulate)
            distance = int((differences[index] + split_difference).min())
            if identity in kept and distance >= kept[identity][2]:
                continue  # the same setup (it ignores where they differ): keep the settings closest to a recipe
            blocks = dict(sorted({**chosen, **split}.items(), key=lambda kv: order[kv[0]]))
            if identity in kept:
                kept[identity] = (blocks, kept[identity][1], distance)
            else:
                kept[identity] = (
                    blocks,
                    replace(combined, batch_size=micro, accumulate_grad_batches=accumulate),
                    distance,
                )
    return [(blocks, setup) for blocks, setup, _ in kept.values()]


def _predicted(blocks: dict[str, Block], setup: Step, refused: Optional[dict[str, str]]) -> Optional[Candidate]:
    """The setup predicted analytically, or None where its settings are refused together."""
    try:
        # settings fit refuses together (stochastic rounding without bf16 weights)
        check_settings(blocks["model.optimizer"].plain if "model.optimizer" in blocks else {}, setup.precision, False)
        if setup.model.get("lora"):  # a LoRA base the precision cannot train (QLoRA under bf16-true)
            LoRA(**setup.model["lora"]).check_precision(setup.precision)
        prediction = analytic(setup, levels=False)
    except UserError as err:
        _refusal(refused, blocks, err)
        return None  # settings refused together (also offloading without checkpointing, by the module)
    return Candidate(blocks, setup, prediction)


CHECKPOINTING = "model.gradient_checkpointing"
OFFLOADING = "model.offload_activations"
LORA = "model.lora"


def _refusal(refused: Optional[dict[str, str]], blocks: dict[str, Block], err: UserError) -> None:
    """Keep the first reason the model itself refused LoRA or QLoRA (its targets, a base it cannot have)."""
    lora = blocks[LORA].plain if LORA in blocks else None
    if refused is None or not isinstance(lora, dict) or not str(err).startswith("model.lora."):
        return
    refused.setdefault("QLoRA" if lora.get("base") == "nf4" else "LoRA", str(err))


def refine(chosen: Candidate, limit: Limit) -> Candidate:
    """A chosen setup that recomputes, with the per-layer checkpointing plan of fewest counted FLOPs predicted
    to fit ``limit`` (`lit_memory.planning.recompute.resolve`): as many layers left whole or selective as fit."""
    if chosen.setup.checkpointing is None:
        return chosen
    # offloading is weighed against recompute as `offload_activations: auto` does (CUDA only)
    probe = replace(chosen.setup, model={**chosen.setup.model, "offload_activations": "auto"})
    found = plan_layers(probe, limit.with_margin(chosen.setup.margin))
    value = found.plan.value() if found.plan else False
    if isinstance(value, dict):  # one line, so the planned recipe keeps one comment per setting
        value = CommentedMap(value)
        value.fa.set_flow_style()
    if found.plan == chosen.setup.checkpointing and found.offload == chosen.setup.offloading:
        return chosen
    words = f"predicted to fit {format_bytes(limit.bytes)} with the {100 * chosen.setup.margin:g} % margin"
    blocks = {
        **chosen.blocks,
        CHECKPOINTING: Block(
            CHECKPOINTING, value, f"activations: per layer, the least recompute (fewest FLOPs) {words}"
        ),
        OFFLOADING: Block(
            OFFLOADING,
            found.offload,
            "activations: checkpoints in host memory (copies modelled cheaper than the recompute they save)"
            if found.offload
            else "activations: stay on the device",
        ),
    }
    setup = chosen.setup.with_settings({CHECKPOINTING: blocks[CHECKPOINTING].plain, OFFLOADING: found.offload})
    return Candidate(blocks, setup, analytic(setup))


# -- measuring ----------------------------------------------------------------------------------


def measure(text: str, args: list[str], effective: int, steps: int = 3) -> float:
    """Seconds per optimizer step of a recipe (median after a warm-up step), from a short real run here."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "candidate.yaml"
        files.write_text(path, text)
        overrides = [
            f"--trainer.max_steps={steps + 1}",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp}",
            "--model.save_pretrained=false",
            "--memory.track_steps=0",
            f"--data.limit_train_samples={effective * (steps + 2)}",
        ]
        run = resolve(["fit", *args, "--config", str(path), *overrides])
        # The run's scope: its allocator settings, environment and trust decision are this candidate's alone, and
        # put back before the next candidate's (on CUDA its cached segments are returned: the next candidate's
        # are made under its own allocator settings).
        with run.scope():
            run.build()
            timer = StepTimer(warmup=1)
            run.trainer.callbacks.append(timer)
            run.trainer.fit(run.model, run.datamodule)
        del run
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gc.collect()
            torch.cuda.empty_cache()
    return timer.seconds_per_step


# -- the recipe ---------------------------------------------------------------------------------


def _parent(blocks: dict[str, Block], recipes: list[Recipe]) -> tuple[Recipe, list[str]]:
    """The recipe the chosen settings differ least from, and the keys they differ in. A recipe's ``auto``
    (checkpointing, offloading) is whatever plan the budget resolved it to; its tier is the plan's budget."""

    def differences(recipe: Recipe) -> list[str]:
        keys = dict.fromkeys([*blocks, *recipe.blocks])
        return [k for k in keys if k not in NOT_COMBINED and not _same(k, blocks.get(k), recipe)]

    parent = min(recipes, key=lambda r: len(differences(r)))
    return parent, differences(parent)


def _same(key: str, block: Optional[Block], recipe: Recipe) -> bool:
    """Whether ``block`` (None: not set) is what ``recipe`` sets for ``key``; a recipe's ``auto`` is any plan."""
    mine = block.plain if block is not None else None
    theirs = recipe.blocks[key].plain if key in recipe.blocks else None
    return mine == theirs or (key in (CHECKPOINTING, OFFLOADING) and theirs == "auto")


def _breakdown(prediction: Prediction) -> str:
    return breakdown(prediction.footprint, prediction.device)


def _as_written(chosen: Candidate, limit: Limit) -> dict[str, Block]:
    """The chosen settings as the recipe writes them, with the limit as its ``memory.tier`` (a card by its name). A
    per-layer plan is written as chosen (the one the simulation confirmed), not as a parent's ``auto``: ``auto``
    resolves again where the recipe runs, for that run's precision (a CPU's bf16 fallback: fp32) and device."""
    tier = Block(
        TIER,
        limit.words or _size(limit.bytes),
        "the device memory this recipe is planned for (what gradient_checkpointing auto would fit)",
    )
    return {**chosen.blocks, TIER: tier}


def _plain(block: Optional[Block]) -> Any:
    return block.plain if block is not None else None


def _size(n: int) -> str:
    """``n`` bytes as memory.tier reads them, exactly: 4GiB, 60MiB, or a plain byte count."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def recipe_text(
    chosen: Candidate, simulated: Optional[Prediction], recipes: list[Recipe], limit: Limit, command: str,
    everything: Optional[list[Candidate]] = None,
) -> str:
    parent, _ = _parent(chosen.blocks, recipes)
    blocks = _as_written(chosen, limit)
    changes = [
        k for k in dict.fromkeys([*blocks, *parent.blocks])
        if (k == TIER or k not in NOT_COMBINED) and _plain(blocks.get(k)) != _plain(parent.blocks.get(k))
    ]
    theirs = {k: b.plain for k, b in parent.blocks.items()}
    try:  # the parent as it would run at this budget (its `auto` resolved for it)
        parent_step = planned(chosen.setup.with_settings(theirs), limit)
    except UserError:  # its `auto` finds no plan within the budget: compare with every layer recomputed
        parent_step = chosen.setup.with_settings({**theirs, CHECKPOINTING: True, OFFLOADING: False})
    parent_prediction = analytic(parent_step, levels=False)
    shrinks = [
        c for c in CATEGORIES if chosen.prediction.footprint.categories[c] < parent_prediction.footprint.categories[c]
    ]
    where = f"{chosen.setup.model.get('model_name_or_path')}, {chosen.setup.target.describe()}"
    header = [
        f"# planned: the fastest setup predicted to fit {limit} ({where})",
        f"# fits: {limit.with_margin(chosen.setup.margin).fit(device_total(chosen.setup)).line()}",
        f"# mode: {why(chosen, everything, limit) if everything else mode_of(chosen.setup)}",
        f"# parent: {parent.name}",
        f"# changes: {', '.join(changes) if changes else 'none'}",
        f"# shrinks: {', '.join(shrinks) if shrinks else 'nothing'} (predicted, against {parent.name})",
        f"# predicted-analytic: {_breakdown(chosen.prediction)}",
    ]
    if simulated is not None:
        header.append(f"# predicted-simulated: {_breakdown(simulated)}")
    header += [f"# rule: {RULE}", f"# made by: {command}"]
    body = CommentedMap()
    for key, block in blocks.items():
        section, name = key.split(".", 1)
        settings = body.setdefault(section, CommentedMap())
        settings[name] = block.value
        if block.comment:
            settings.yaml_add_eol_comment(f"# {block.comment}", name, column=COMMENT_COLUMN)
    text = io.StringIO()
    _yaml().dump(body, text)
    return "\n".join(header) + "\n" + text.getvalue()


# -- the subcommand -----------------------------------------------------------------------------


def choose(
    base: Step,
    limit: Limit,
    args: list[str],
    recipes: Optional[list[Recipe]] = None,
    confirm: bool = True,
    measured: bool = False,
) -> tuple[Candidate, Optional[Prediction], list[Candidate]]:
    """Pick the candidate to write: (chosen, its simulation, the candidates predicted). Candidates are taken in the
    rule's order (`ranked`: predicted a quality class at a time); each one's device total (tensors, the allocator's
    reserve, the CUDA context) is predicted when the rule reaches it, and the first that fits the limit wins
    (confirmed by the simulation)."""
    recipes = shipped_recipes() if recipes is None else recipes
    refused: dict[str, str] = {}
    everything: list[Candidate] = []
    ordered = ranked(base, recipes, refused, everything)
    overhead = base.outside_allocator  # the CUDA context and NCCL's communicators
    room = limit.with_margin(base.margin).usable  # the margin kept free (`lit_memory.memory.margin`)
    fitting = (c for c in ordered if c.prediction.footprint.peak + overhead <= room and c.total <= room)
    wanted = MEASURED if measured else 1
    confirmed: list[tuple[Candidate, Optional[Prediction]]] = []
    for tried, candidate in enumerate(fitting):
        if tried >= (CONFIRMATIONS if confirm else wanted):
            break
        simulated = simulate_or_decline(candidate.setup)[0] if confirm else None  # None: the analytic stands alone
        if simulated is None or level(simulated.footprint) <= room:
            confirmed.append((candidate, simulated))
        if len(confirmed) == wanted:
            break
    if not confirmed:
        for _ in ordered:  # every mode predicted: the line says what the smallest needs, in any of them
            pass
        if not everything:
            raise UserError(
                f"no combination of the shipped recipes' settings can train this model{_refused_words(refused)}"
            )
        smallest = min(everything, key=lambda c: c.prediction.footprint.peak)
        if smallest.prediction.footprint.peak + overhead > room or smallest.total > room:
            raise UserError(
                f"no combination of the shipped recipes' settings is predicted to fit {format_bytes(limit.bytes)} "
                "with the "
                f"{100 * base.margin:g} % margin ({format_bytes(room)}), in any mode "
                f"({', '.join(_modes(everything))}); "
                f"the smallest needs {format_bytes(smallest.total)} ({smallest.setup.describe()})"
                f"{would_fit(smallest.total, base.margin)}{_refused_words(refused, everything)}"
            )
        raise UserError(
            f"the {CONFIRMATIONS} fastest setups predicted to fit {format_bytes(limit.bytes)} with the "
            f"{100 * base.margin:g} % margin do not fit in simulation"
        )
    if measured:
        effective = base.batch_size * base.accumulate_grad_batches
        timed = []
        for candidate, simulated in confirmed:
            seconds = measure(recipe_text(candidate, simulated, recipes, limit, ""), args, effective)
            print(f"measured {seconds:.3f} s per optimizer step: {candidate.setup.describe()}")
            timed.append((seconds, candidate, simulated))
        _, chosen, simulated = min(timed, key=lambda t: t[0])
        chosen.prediction = analytic(chosen.setup)
        return (*_refined(chosen, simulated, limit, confirm), everything)
    chosen, simulated = confirmed[0]
    chosen.prediction = analytic(chosen.setup)  # with the allocator's and the device's levels
    return (*_refined(chosen, simulated, limit, confirm), everything)


def why(chosen: Candidate, everything: list[Candidate], limit: Limit) -> str:
    """Why the chosen setup fine-tunes as it does: the modes the rule prefers (full, then LoRA, then QLoRA) and the
    smallest each needs with the same update semantics (exact, or 16-bit weights rounded to nearest), where it does
    not fit ``limit`` with the margin."""
    mode, exact = mode_of(chosen.setup), not chosen.setup.loses_small_updates
    before = []
    for other in MODES[: MODES.index(mode)]:
        found = [c for c in everything if mode_of(c.setup) == other and c.setup.loses_small_updates != exact]
        if found:
            smallest = min(found, key=lambda c: c.prediction.footprint.peak)
            before.append(f"{other} needs {format_bytes(smallest.total)} at the least")
    semantics = "" if exact else " (16-bit weights rounded to nearest: no exact setup fits)"
    if not before:
        return f"{mode}{semantics}: the rule's first choice that fits"
    return (
        f"{mode}{semantics}: {', '.join(before)}, over "
        f"{format_bytes(limit.with_margin(chosen.setup.margin).usable)} (the limit "
        f"less the margin){' with exact updates (fp32 weights, or bf16 with stochastic rounding)' if exact else ''}"
    )


def _modes(found: list[Candidate]) -> list[str]:
    return [mode for mode in MODES if any(mode_of(c.setup) == mode for c in found)]


def _refused_words(refused: dict[str, str], found: Sequence[Candidate] = ()) -> str:
    """Why a mode has no setup at all (not where only some of its combinations were refused)."""
    present = {mode_of(c.setup) for c in found}
    return "".join(f"; {mode} not possible: {reason}" for mode, reason in refused.items() if mode not in present)


def would_fit(total: int, margin: float) -> str:
    """What would hold ``total`` bytes of device memory with ``margin`` kept free: the smallest card of the
    catalogue (`lit_memory.memory.hardware.gpus.GPUS`), in words (``; it would fit rtx4060 (7.75 GiB) or larger``)."""
    cards = sorted((gpu.memory, key) for key, gpu in GPUS.items() if usable(gpu.memory, margin) >= total)
    if not cards:
        return "; no card of the catalogue holds it: more devices (configs/fsdp.yaml) or a smaller model"
    memory, key = cards[0]
    return f"; it would fit {key} ({format_bytes(memory)}) or a larger card"


def _refined(
    chosen: Candidate, simulated: Optional[Prediction], limit: Limit, confirm: bool
) -> tuple[Candidate, Optional[Prediction]]:
    """The chosen setup with its per-layer plan (`refine`), kept only if the simulation agrees it fits."""
    better = refine(chosen, limit)
    if better is chosen:
        return chosen, simulated
    again = simulate_or_decline(better.setup)[0] if confirm else None
    if again is None or level(again.footprint) <= limit.with_margin(better.setup.margin).usable:
        return better, again
    return chosen, simulated


def main(argv: list[str]) -> None:
    parser = arguments.plan()
    ours, rest = parser.parse_known_args(argv)
    if ours.measure and trust.Decision.of(argv).confined:
        raise UserError(
            "plan --measure trains each candidate in this process, which the training of a config nobody trusted never "
            "does (it runs confined: docs/sharing.md); trust it first (python -m lit_memory recipes trust FILE), pass "
            "--trust-recipe only if you trust the configs' source, or plan without --measure"
        )
    size = Size.parse(ours.budget)
    if size.card is not None and ours.gpu is None and ours.device == "cuda":
        ours.gpu = size.card  # a card as the budget: its context, kernels and workspace too
    base = step_of(rest, ours)
    limit = Limit(size.bytes, size.card or "", base.margin)  # a card by its name (the recipe's tier), else the size
    recipes = shipped_recipes()
    chosen, simulated, everything = choose(
        base, limit, rest, recipes, confirm=not ours.no_simulate, measured=ours.measure
    )
    command = "python -m lit_memory plan " + shlex.join(argv)
    files.write_text(ours.output, recipe_text(chosen, simulated, recipes, limit, command, everything))
    print(f"{len(everything)} setups predicted; the fastest by the rule predicted to fit {format_bytes(limit.bytes)}:")
    print(f"  {why(chosen, everything, limit)}")
    print(f"  {chosen.setup.describe()}")
    print(f"  analytic:  {_breakdown(chosen.prediction)}")
    print(f"  {limit.with_margin(chosen.setup.margin).fit(device_total(chosen.setup)).line()}")
    if simulated is not None:
        print(f"  simulated: {_breakdown(simulated)}")
    print(f"wrote {ours.output}: python -m lit_memory fit {shlex.join([*rest, '--config', ours.output])}")
