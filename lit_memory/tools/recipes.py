"""``python -m lit_memory recipes``: list the shipped recipes, show one, check a recipe someone sent."""

from __future__ import annotations

import functools
import os
import re
import tempfile
from argparse import ArgumentError
from pathlib import Path
from typing import Any, Optional

import yaml
from jsonargparse import Namespace

from lit_memory import files
from lit_memory.cli import resolve
from lit_memory.config import trusted as trusted_files
from lit_memory.config.arguments import ImportRefused
from lit_memory.config.shipped import listing, names, recipe_path, recipes_dir
from lit_memory.config.trust import HINT, TRUST_FLAG
from lit_memory.errors import UserError, shown
from lit_memory.memory.hardware.gpus import Target, gpu, gpu_key, is_gpu_name
from lit_memory.memory.margin import Fit
from lit_memory.memory.measure.footprint import format_bytes
from lit_memory.planning.prediction.analytic import analytic
from lit_memory.planning.prediction.step import Step
from lit_memory.planning.recompute import flops, planned
from lit_memory.policy import phases
from lit_memory.policy.refusal import Context
from lit_memory.sandbox import bounds, guard, roots
from lit_memory.settings import dotted_leaves, locate
from lit_memory.tools import arguments


def list_recipes() -> None:
    """Every shipped recipe, parents before children, with the latest bench run's numbers
    (`lit_memory.config.shipped.listing`)."""
    print(listing())


# -- the predicted line of every shipped recipe's header ------------------------------------------------

PREDICTED = "# predicted: "
HEADER_MODEL = "configs/bert-large.yaml"


FLOPS = "# flops: "
FLOPS_REFERENCE = "bf16"  # the recipe every other's FLOPs are stated against: no recompute


def header_step(path: Path) -> "Step":
    """A shipped recipe's step on BERT-large (``configs/bert-large.yaml``) for the card its ``memory.tier`` names
    (4gb.yaml: rtx3050-4gb), else the documented default GPU; its ``auto`` resolved for its tier."""
    return _header_step(str(path), path.read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=32)
def _header_step(path: str, text: str) -> "Step":  # the text keys the cache: a rewritten recipe is read again

    # configs/bert-large.yaml's two settings (the configs folder is not installed with the package)
    model = ["--model.model_name_or_path=bundled:bert-large", "--model.pretrained=false"]
    argv = ["fit", "--config", path, *model, "--cpu_bf16_fallback=false"]
    settings = resolve(argv, gpu=Target().gpu).settings.as_dict()
    tier = (settings.get("memory") or {}).get("tier")
    target = Target(gpu=gpu(tier)) if is_gpu_name(tier) else Target()
    if target.gpu.bf16 != Target().gpu.bf16:  # the precision a run there trains with (`lit_memory.optim.precision`)
        settings = resolve(argv, gpu=target.gpu).settings.as_dict()
    return planned(Step.from_settings(settings, target))


PLANNED = "# planned-for: "


def planned_line(path: Path) -> Optional[str]:
    """The header line of a recipe with a ``memory.tier``: what it is planned for and what BERT-large at the
    recipe's batch leaves free there, with the margin kept (`lit_memory.memory.margin`); None without a tier."""
    step = header_step(path)
    limit = step.memory.limit
    if limit is None:
        return None
    card = step.target.gpu
    tier = str((step.settings.get("memory") or {}).get("tier") or "")
    if card.key and tier and card.key == gpu_key_of(tier):
        bf16 = "bf16" if card.bf16 else "no bf16"
        where = (
            f"{card.key} ({card.name}, {format_bytes(card.memory)}, sm{card.capability[0]}{card.capability[1]}, {bf16})"
        )
    else:
        where = format_bytes(limit.bytes)
    fit = Fit(analytic(step).footprint.device, limit.bytes, step.margin, where)
    name = card.key if where != format_bytes(limit.bytes) else where
    return (
        f"{PLANNED}{name}; BERT-large {step.batch_size} x {step.max_length} {fit.line()} "
        "(python -m lit_memory recipes headers)"
    )


def gpu_key_of(value: str) -> str:
    return gpu_key(value) if is_gpu_name(value) else ""


def flops_line(path: Path) -> str:
    """The header line a shipped recipe states its counted FLOPs per step in, against the bf16 recipe's."""
    step = header_step(path)
    counted, reference = flops(step), flops(header_step(path.with_name(f"{FLOPS_REFERENCE}.yaml")))
    plan = step.checkpointing.describe(len_layers(step)) if step.checkpointing else "no checkpointing"
    plan += ", checkpoints offloaded" if step.offloading else ""
    return (
        f"{FLOPS}BERT-large {step.batch_size} x {step.max_length}, {plan}: {counted.total / 1e12:.2f} TFLOP per "
        f"micro-batch, {counted.total / reference.total:.3f}x {FLOPS_REFERENCE}.yaml's per micro-batch "
        f"({counted.per_sample / reference.per_sample:.3f}x per sample), recompute "
        f"{100 * counted.recompute_share:.1f} % "
        "(counted by torch's FlopCounterMode: matmuls and attention; python -m lit_memory recipes headers)"
    )


def len_layers(step: "Step") -> int:
    return step.module().hf_config.num_hidden_layers


def predicted_line(path: Path) -> str:
    """The header line a shipped recipe states its predicted memory in: BERT-large (``configs/bert-large.yaml``)
    with the recipe's own batch and length, analytic, at three levels, for the documented default GPU."""
    step = header_step(path)
    footprint = analytic(step).footprint
    return (
        f"{PREDICTED}BERT-large {step.batch_size} x {step.max_length}"
        + (f" x {step.accumulate_grad_batches} accumulated" if step.accumulate_grad_batches > 1 else "")
        + f" ({HEADER_MODEL}) on {step.target.gpu.name}: "
        f"tensors {format_bytes(footprint.peak)}, reserved {format_bytes(footprint.reserved)}, device "
        f"{format_bytes(footprint.device)} (python -m lit_memory recipes headers)"
    )


def with_predicted_line(text: str, line: str, prefix: str = PREDICTED, after: str = "# shrinks:") -> str:
    """``text`` with its header's ``prefix`` line replaced by ``line`` (added after the ``after`` line if missing)."""
    lines = text.splitlines()
    header_end = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    found = [i for i in range(header_end) if lines[i].startswith(prefix)]
    if found:
        lines[found[0]] = line
    else:
        where = next((i for i in range(header_end) if lines[i].startswith(after)), header_end - 1)
        lines.insert(where + 1, line)
    return "\n".join(lines) + "\n"


# README's sentence quoting three recipes' predicted device totals (in a checkout: the package has no README)
README_DEVICE = re.compile(
    r"(predicted at )[\d.]+ GiB( for the baseline, )[\d.]+ GiB( for `4gb\.yaml`\s+and )[\d.]+ GiB( for `2gb\.yaml`)"
)


def readme_with_devices(text: str, devices: dict[str, str]) -> str:
    """README's text with the baseline's, 4gb's and 2gb's predicted device totals as their headers state them."""
    values = [devices[name].removesuffix(" GiB") for name in ("baseline", "4gb", "2gb")]
    return README_DEVICE.sub(lambda m: f"{m[1]}{values[0]} GiB{m[2]}{values[1]} GiB{m[3]}{values[2]} GiB{m[4]}", text)


# A model config's header line stating one run's prediction: what to run (typed: which runs a config documents)
# -> what the memory model predicts for it (generated by `recipes headers`).
ESTIMATE = "# estimate: "
ARROW = " -> "


def estimate_text(config: Path, args: list[str]) -> str:
    """The generated part of a config's estimate line: ``args`` (recipes, overrides) with the config, analytic,
    on the documented default GPU; `auto` checkpointing resolved as a run resolves it, or why it cannot be."""
    run = resolve(
        ["fit", *expand_args(args, config), "--config", str(config), "--cpu_bf16_fallback=false"], gpu=Target().gpu
    )
    step = Step.from_settings(run.settings.as_dict(), Target())
    try:
        step = planned(step)
    except UserError as err:  # no per-layer plan fits the budget: the line says so, with the closest
        return (
            f"{step.batch_size} x {step.max_length}: does not fit ({str(err).split(': ', 1)[-1].split(' (python')[0]})"
        )
    footprint = analytic(step).footprint
    plan = step.checkpointing.describe(len_layers(step)) if step.checkpointing else "no checkpointing"
    return (
        f"{step.batch_size} x {step.max_length} on {step.target.gpu.name}: tensors {format_bytes(footprint.peak)}, "
        f"device {format_bytes(footprint.device)} ({plan}{', checkpoints offloaded' if step.offloading else ''})"
    )


def expand_args(args: list[str], config: Path) -> list[str]:
    """``recipes/NAME.yaml`` in an estimate line is the shipped recipe (checkout or package)."""
    return [str(recipe_path(Path(a).stem)) if a.startswith("recipes/") and a.endswith(".yaml") else a for a in args]


def config_estimates(check: bool) -> list[str]:
    """Rewrite each model config's ``# estimate:`` lines (configs/ of a checkout); returns the stale files."""
    folder = recipes_dir().parent / "configs"
    stale = []
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(ESTIMATE):
                wanted = line[len(ESTIMATE):].split(ARROW)[0]
                lines[i] = f"{ESTIMATE}{wanted}{ARROW}{estimate_text(path, wanted.split())}"
                print(f"{path.name}: {lines[i][len(ESTIMATE):]}")
        updated = "\n".join(lines) + "\n"
        if updated != text:
            stale.append(f"configs/{path.name}")
            if not check:
                files.write_text(path, updated)
    return stale


def headers(check: bool) -> None:
    """Write (or with ``check``, compare) each shipped recipe's predicted line, and README's sentence quoting them."""
    folder = recipes_dir()
    stale, devices = [], {}
    for name in names():
        path = folder / f"{name}.yaml"
        text = path.read_text(encoding="utf-8")
        predicted = predicted_line(path)
        devices[name] = predicted.rsplit("device ", 1)[1].split(" (")[0]
        updated = with_predicted_line(text, predicted)
        updated = with_predicted_line(updated, flops_line(path), FLOPS, PREDICTED)
        prefixes = (PREDICTED, FLOPS)
        if (line := planned_line(path)) is not None:
            updated = with_predicted_line(updated, line, PLANNED, "# shrinks:")
            prefixes += (PLANNED,)
        for prefix in prefixes:
            print(f"{name}: {next(line for line in updated.splitlines() if line.startswith(prefix))[len(prefix):]}")
        if updated != text:
            stale.append(name)
            if not check:
                files.write_text(path, updated)
    readme = folder.parent / "README.md"
    if readme.is_file() and {"baseline", "4gb", "2gb"} <= devices.keys():
        text = readme.read_text(encoding="utf-8")
        updated = readme_with_devices(text, devices)
        if updated != text:
            stale.append("README.md")
            if not check:
                files.write_text(readme, updated)
    stale += config_estimates(check)
    if check and stale:
        raise UserError(f"recipe headers out of date: {', '.join(stale)} (run: python -m lit_memory recipes headers)")


def check(path: Path, trusted: bool) -> None:
    """Resolve a recipe exactly as ``fit --config FILE`` would (`lit_memory.cli.resolve`), build and
    run nothing, and report every refused import and value with its key, what a run would refuse later
    (a checkpoint Lightning would resume from by itself, links planted in folders the recipe names),
    and every problem. Nothing is imported outside the allowlist, fetched or unpickled: checkpoints are
    read only through the guard's restricted readers."""
    if not _is_file(path):
        raise UserError(f"recipe not found: {path}")
    try:
        tree = bounds.read_yaml(path)
    except bounds.BoundExceeded as err:  # a bomb: nothing more is read of it, trusted or not
        _say(f"  {'problem' if trusted else 'REFUSED'}  {str(err).removeprefix('refusing ')}")
        verdict = "1 problem(s)" if trusted else f"1 refused; pass {TRUST_FLAG} only if you trust its source"
        raise UserError(f"{path}: {verdict}") from None
    refused: list[str] = []
    problems = [f"unknown keys: {', '.join(unknown)}"] if (unknown := _unknown_keys(tree, _fit_schema())) else []
    source, run = path, None
    with tempfile.TemporaryDirectory() as scratch:
        while run is None:
            try:
                run = resolve(["fit", "--config", str(source), *([TRUST_FLAG] if trusted else [])], collect=True,
                              trust_configs=False)  # judged as a stranger's, whoever trusted it
            except ImportRefused as err:
                # jsonargparse stops at the first refusal: drop that key and parse again, to find them all.
                refused += [f"import {p}  ({k})" for p, k, _ in err.denied]
                if not all(_drop(tree, outer) for _, _, outer in err.denied):
                    break
                source = Path(scratch) / path.name
                files.write_text(source, yaml.safe_dump(tree))
            except (ArgumentError, UserError) as err:
                line = " ".join(str(err).split())
                if line.startswith("refusing "):
                    refused.append(line.removesuffix("; " + HINT))
                else:
                    problems.append(line)
                break
    if run is not None:
        refused += [f"{r.key}={r.value!r}  ({r.reason})" for r in run.refusals]
        refused += [] if trusted else later_refusals(run.settings, [os.getcwd(), str(path.resolve().parent)])
        problems += run.problems
        imports = [
            f"{k.removesuffix('.class_path')}: {v}" for k, v in dotted_leaves(run.settings) if k.endswith("class_path")
        ]
        _say(f"{path}: parsed as `fit --config {path}`; imports {', '.join(imports) or 'nothing'}")
    for line in refused:
        _say(f"  REFUSED  {line}")
    for line in problems:
        _say(f"  problem  {line}")
    if (refused and not trusted) or problems:
        verdict = [f"{len(refused)} refused"] if refused and not trusted else []
        verdict += [f"{len(problems)} problem(s)"] if problems else []
        hint = f"; pass {TRUST_FLAG} only if you trust its source" if refused and not trusted else ""
        raise UserError(f"{path}: {', '.join(verdict)}{hint}")
    _say(f"ok: {path} parses against the `fit` schema" + ("" if refused else " and needs no " + TRUST_FLAG))


def _say(line: str) -> None:
    """A line of the check's report: the recipe's values in it (keys, refused values, class paths, its file name)
    with their escape sequences shown, never acted on by the terminal (an OSC 52 clipboard write, hidden text)."""
    print(shown(line))


def trust_status(path: Path) -> str:
    """How a run of ``path`` is judged now: shipped, trusted by the user, or confined (and why)."""
    verdict = trusted_files.judge(["--config", str(path)])
    if not verdict.trusted:
        why = verdict.untrusted[0][1]
        return (f"trust: a run of {path} is confined: it {why}; if you trust its source: "
                f"{trusted_files.COMMAND} {path}")
    shipped_as = trusted_files.shipped_digests().get(trusted_files.digest(path))
    what = f"is byte-identical to the shipped {shipped_as}" if shipped_as else "is trusted by you"
    return f"trust: {path} {what}: a run of it is not confined"


def later_refusals(settings: Namespace, folders: Optional[list[str]] = None) -> list[str]:
    """What an untrusted run of these settings would refuse before its confined child starts and once its Trainer
    exists, found from the settings alone: the launch and run phases of the policy (`lit_memory.policy`), every rule
    of each, with what they ask of the layers above them (a run folder's way from the working folder, a model folder's
    problems). ``folders``: where the recipe's own files may lie (its folder and the working folder)."""
    work = os.path.realpath(os.getcwd())
    context = Context(settings, work=work, folders=folders or [os.getcwd()],
                      walk=lambda path, key: roots.make(path, work, key, create=False),
                      model_folder_problems=lambda path: guard.model_folder_problems(Path(path)))
    found = [refusal.line() for phase in ("launch", "run") for refusal in phases.refusals(phase, context)]
    return list(dict.fromkeys(found))


def _fit_schema() -> Namespace:
    """Every key `fit` accepts, with its default."""
    return resolve(["fit"]).settings


def _unknown_keys(tree: Any, schema: Namespace) -> list[str]:
    """Keys of `tree` (a recipe's YAML) that have no place in `schema` (the parsed defaults). What sits
    inside a class spec (``class_path`` + ``init_args``), a dict or a list is left to the parser's type check."""
    unknown: list[str] = []
    for key, _ in dotted_leaves(tree):
        parts = key.split(".")
        known = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in schema), 0)
        if known == len(parts):
            continue
        nodes = [schema.get(".".join(parts[:n])) for n in range(1, known + 1)]
        inside_a_class_spec = any(isinstance(n, Namespace) and "class_path" in n for n in nodes)
        node = nodes[-1] if nodes else schema
        if isinstance(node, Namespace) and not inside_a_class_spec:
            name = ".".join(parts[: known + 1])
            if name not in unknown:
                unknown.append(name)
    return unknown


def _drop(tree: dict, key: str) -> bool:
    """Remove a dotted key from a YAML tree; whether it was there."""
    try:
        container, last = locate(tree, key)
    except KeyError:
        return False
    del container[last]
    return True


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a value too long or too odd to be a path
        return False


def main(argv: list[str]) -> None:
    parser = arguments.recipes()
    args = parser.parse_args(argv)
    if args.command == "show":
        print(recipe_path(args.name).read_text(encoding="utf-8"), end="")
    elif args.command == "check":
        try:
            check(args.file, args.trusted)
        finally:  # what a stranger's would refuse, then how a run of it is judged now
            if _is_file(args.file):
                _say(trust_status(args.file))
    elif args.command in ("trust", "untrust", "trusted"):
        trusted_files.main([args.command, *map(str, getattr(args, "files", []))])
    elif args.command == "headers":
        headers(args.check)
    else:
        list_recipes()
