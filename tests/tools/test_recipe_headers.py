"""`python -m lit_memory recipes headers`: every shipped recipe states its predicted memory in its header, as the
command generates it (numbers in headers are generated, not typed); the memory tiers keep their promise."""

from __future__ import annotations

import re

import yaml
from conftest import RECIPES

from lit_memory.config.shipped import header
from lit_memory.memory.measure.footprint import parse_bytes
from lit_memory.tools import recipes as commands


def predicted(text: str) -> dict[str, int]:
    """tensors / reserved / device from a predicted line."""
    levels = text.split(": ", 2)[-1].split(" (python")[0]
    return {
        name: parse_bytes(value.replace(" ", "")) for name, value in (part.split(" ", 1) for part in levels.split(", "))
    }


def test_every_header_states_the_prediction_the_command_makes(capsys):
    commands.headers(check=True)  # raises if any header differs from what the command writes now
    lines = capsys.readouterr().out.splitlines()
    estimates = [line for c in (RECIPES.parent / "configs").glob("*.yaml") for line in c.read_text().splitlines()
                 if line.startswith(commands.ESTIMATE)]
    tiers = [p for p in RECIPES.glob("*.yaml") if "tier" in (yaml.safe_load(p.read_text()).get("memory") or {})]
    # memory and FLOPs, what a tier is planned for; the configs' lines
    assert len(lines) == 2 * len(list(RECIPES.glob("*.yaml"))) + len(tiers) + len(estimates)
    assert len(estimates) >= 8 and all(commands.ARROW in line and "x 128" in line for line in estimates)
    for path in RECIPES.glob("*.yaml"):
        line = header(path)["predicted"]
        tier = (yaml.safe_load(path.read_text()).get("memory") or {}).get("tier")
        # the tier's card, else the default
        card = "GeForce RTX 3050 Laptop GPU 4GB" if tier == "rtx3050-4gb" else "A100 80GB"
        assert line.startswith("BERT-large ") and f"on {card}:" in line
        levels = predicted(line)
        assert levels["tensors"] <= levels["reserved"] < levels["device"]
        assert re.search(r"TFLOP per micro-batch, [0-9.]+x bf16.yaml's", header(path)["flops"]), path.name


def flops_ratio(name: str) -> float:
    return float(
        re.search(r"([0-9.]+)x bf16.yaml's per micro-batch", header(RECIPES / f"{name}.yaml")["flops"]).group(1)
    )


def test_the_tiers_recompute_less_than_every_layer_full():
    """`auto` keeps some layers whole or selective: fewer FLOPs than full checkpointing at the same batch."""
    every_layer_full = 4 / 3  # one more forward (a third of forward + backward) per step
    assert 1.0 < flops_ratio("4gb") < every_layer_full - 0.1
    assert flops_ratio("2gb") <= every_layer_full + 0.001
    assert flops_ratio("baseline") == 1.0


def test_the_memory_tiers_fit_their_cards_with_the_margin_to_spare():
    """The issue's bars: 4gb.yaml planned for rtx3050-4gb, BERT-large 32 x 128 fitting it with at least 8 % to spare
    at no more than 1.20x bf16.yaml's FLOPs; 2gb.yaml fitting 2 GiB with 8 % to spare (its header says what it
    gives up for that)."""
    from lit_memory.memory.hardware.gpus import GPUS

    planned = header(RECIPES / "4gb.yaml")["planned-for"]
    assert planned.startswith(
        "rtx3050-4gb; BERT-large 32 x 128 fits rtx3050-4gb (GeForce RTX 3050 Laptop GPU 4GB, 3.81 GiB"
    )
    spare = int(re.search(r"with (\d+) % to spare", planned).group(1))
    assert (
        spare >= 8
        and predicted(header(RECIPES / "4gb.yaml")["predicted"])["device"] <= 0.92 * GPUS["rtx3050-4gb"].memory
    )
    assert flops_ratio("4gb") <= 1.20
    assert yaml.safe_load((RECIPES / "4gb.yaml").read_text())["memory"]["tier"] == "rtx3050-4gb"
    planned = header(RECIPES / "2gb.yaml")["planned-for"]
    assert planned.startswith("2.00 GiB; BERT-large 32 x 128 fits 2.00 GiB with") and "gives-up" in header(
        RECIPES / "2gb.yaml"
    )
    assert predicted(header(RECIPES / "2gb.yaml")["predicted"])["device"] <= 0.92 * parse_bytes("2GiB")
    assert "32 x 128" in header(RECIPES / "2gb.yaml")["predicted"]


def test_a_stale_header_is_found_and_rewritten_in_place():
    text = (RECIPES / "fused.yaml").read_text()
    line = header(RECIPES / "fused.yaml")["predicted"]
    stale = text.replace(line, "BERT-large 32 x 128: tensors 1 B, reserved 1 B, device 1 B")
    assert stale != text
    assert commands.with_predicted_line(stale, commands.PREDICTED + line) == text
    without = "\n".join(line for line in text.splitlines() if not line.startswith(commands.PREDICTED)) + "\n"
    assert commands.with_predicted_line(without, commands.PREDICTED + line) == text  # added after `# shrinks:`


def test_readme_quotes_the_tiers_device_totals_as_their_headers_state_them():
    """README's sentence on the baseline, 4gb and 2gb device totals is rewritten by `recipes headers` (its check
    mode fails on a stale one): the numbers in it are the headers'."""
    readme = (RECIPES.parent / "README.md").read_text()
    devices = {
        name: header(RECIPES / f"{name}.yaml")["predicted"].rsplit("device ", 1)[1].split(" (")[0]
        for name in ("baseline", "4gb", "2gb")
    }
    assert commands.readme_with_devices(readme, devices) == readme
    stale = commands.readme_with_devices(readme, {**devices, "2gb": "9.99 GiB"})
    assert stale != readme and "9.99 GiB for `2gb.yaml`" in stale
    assert commands.readme_with_devices(stale, devices) == readme


def test_a_decoder_full_fine_tune_is_predicted_within_4_gib_of_device_memory():
    """Issue 22's bar, as configs/qwen3-0.6b.yaml states it (its estimate lines are generated, and checked above):
    nothing frozen, no LoRA, at batch 32 x 128, on the documented default GPU."""
    config = RECIPES.parent / "configs" / "qwen3-0.6b.yaml"
    lines = [line[len(commands.ESTIMATE):] for line in config.read_text().splitlines()
             if line.startswith(commands.ESTIMATE)]
    args, result = next(line.split(commands.ARROW) for line in lines if "--memory.tier 4GiB" in line)
    assert "freeze" not in args and "lora" not in args and "recipes/2gb.yaml" in args
    assert result.startswith("32 x 128 on A100 80GB")
    device = parse_bytes(re.search(r"device ([0-9.]+ GiB)", result).group(1).replace(" ", ""))
    assert 3 * 2**30 < device <= 4 * 2**30
