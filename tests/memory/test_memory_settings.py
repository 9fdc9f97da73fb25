"""The ``memory:`` block as one typed value (lit_memory.memory.settings.MemorySettings)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from lit_memory.__main__ import main
from lit_memory.cli import resolve
from lit_memory.errors import UserError
from lit_memory.memory.hardware.gpus import capacity
from lit_memory.memory.margin import Limit
from lit_memory.memory.settings import MemorySettings, Size


def test_sizes_and_cards_are_read_once_into_sizes():
    memory = MemorySettings(budget="4GiB", tier="rtx3050-4gb", margin="0.1")
    assert memory.budget == Size(4 * 2**30, "4GiB") and memory.tier == Size(capacity("rtx3050-4gb"), "rtx3050-4gb")
    assert memory.margin == 0.1 and memory.limit == memory.cap == Limit(4 * 2**30, "memory.budget 4.00 GiB", 0.1)
    tier = MemorySettings(tier="rtx3050-4gb")  # no budget: the tier is planned for, nothing is capped
    assert tier.limit == Limit(capacity("rtx3050-4gb"), "memory.tier rtx3050-4gb (3.81 GiB)") and tier.cap is None
    assert MemorySettings().limit is None and Size.parse("t4").card == "t4" and Size.parse("4GiB").card is None
    assert dataclasses.replace(memory, margin=0.05).budget is memory.budget  # built values are kept, not re-read


@pytest.mark.parametrize("values, message", [
    ({"track_steps": -1}, r"^memory.track_steps must be >= 0, got -1$"),
    ({"snapshot_steps": 0}, r"^memory.snapshot_steps must be >= 1, got 0$"),
    ({"snapshot": " "}, r"^memory.snapshot must be a file name"),
    ({"budget": "4 gigs"}, r"^cannot read '4 gigs' as a memory size"),
    ({"margin": 0.7}, r"^memory.margin must be a share of the limit"),
])
def test_a_bad_value_is_one_error_line_when_the_block_is_built(values, message):
    with pytest.raises(UserError, match=message):
        MemorySettings(**values)


def test_a_block_from_plain_settings_names_an_unknown_key():
    assert MemorySettings.of({"memory": {"tier": "t4"}}).tier.given == "t4"
    assert MemorySettings.of({}) == MemorySettings()
    with pytest.raises(
        UserError, match=r"^unknown memory setting\(s\): budgett; the memory block takes track_steps, budget"
    ):
        MemorySettings.of({"memory": {"budgett": "4GiB"}})


def test_the_command_line_block_is_the_dataclass_and_the_run_hands_that_one_value_down(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)["memory"]
    assert list(printed) == [f.name for f in dataclasses.fields(MemorySettings)]  # one declaration, no key list
    cli = resolve(["fit", "--memory.budget=rtx3050-4gb", "--memory.margin=0.12"])
    assert cli.memory == MemorySettings(budget="rtx3050-4gb", margin=0.12)
    step = cli.step()
    assert step.memory is cli.memory and step.margin == 0.12  # handed down, not parsed again
    assert step.with_settings({"data.batch_size": 4}).memory is cli.memory
    assert step.with_settings({"memory.margin": 0.2}).memory.margin == 0.2
