"""cards: plan's choice for each card, and README's table between its markers."""

from __future__ import annotations

import json
from dataclasses import replace

from conftest import CONFIGS, RECIPES
from test_plan import MODE_RECIPES, WIDE, base_setup

from lit_memory.memory.hardware.gpus import GPUS
from lit_memory.memory.margin import Limit
from lit_memory.planning.choose import mode_of
from lit_memory.tools.bench_table import embed
from lit_memory.tools.cards import README_MARKERS, Cell, plan_cards, table
from lit_memory.tools.plan import choose, load_recipe


def test_each_card_gets_what_plan_chooses_for_it_and_the_table_lands_between_the_markers():
    """The cards share one ranking predicted for the first (sm86/sm89 cards: the same attention kernels); on each the
    cell is what ``plan --budget CARD`` chooses without simulating."""
    base = base_setup(
        "cuda", "--config", str(CONFIGS / "bert-large.yaml"), f"--model.config_overrides={json.dumps(WIDE)}"
    )
    base = replace(base, target=replace(base.target, gpu=GPUS["rtx3050-4gb"]))
    recipes = [load_recipe(RECIPES / f"{name}.yaml") for name in MODE_RECIPES]
    cards = ("rtx3050-4gb", "rtx4060")
    cells = plan_cards(base, cards, recipes)
    for card in cards:
        on_card = replace(base, target=replace(base.target, gpu=GPUS[card]))
        chosen, _, _ = choose(on_card, Limit(GPUS[card].memory, card, on_card.margin), [], recipes, confirm=False)
        assert (cells[card].mode, cells[card].total) == (mode_of(chosen.setup), chosen.total), card
    text = table({"wide": {**cells, "rtx4060": Cell(None, 5 * 2**30)}}, {"wide": 3_000_000}, "cards", base.margin)
    assert "| wide (0.00 B) | full, " in text and "| no: needs 5.00 GiB |" in text
    start, end = README_MARKERS
    readme = f"# title\n{start}\nold table\n{end}\nafter\n"
    assert embed(readme, text, README_MARKERS) == f"# title\n{start}\n{text}{end}\nafter\n"
    assert embed("# no markers\n", text, README_MARKERS) is None
    assert embed(readme, text) is None  # the bench table's markers are not there
