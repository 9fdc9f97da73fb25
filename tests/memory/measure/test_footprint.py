"""Categories, phases and bytes."""

from __future__ import annotations

import pytest

from lit_memory.errors import UserError
from lit_memory.memory.measure.footprint import CATEGORIES, Footprint, format_bytes, parse_bytes


def test_parse_and_format_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("3.5 GB") == 3_500_000_000
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes(1000) == 1000
    assert format_bytes(3 * 2**30 // 2) == "1.50 GiB"
    with pytest.raises(UserError, match="cannot read '4 gigs' as a memory size"):
        parse_bytes("4 gigs")


def test_a_footprint_keeps_each_phases_largest_composition_and_round_trips():
    footprint = Footprint()
    footprint.add("forward", {"weights": 10, "activations": 5})
    footprint.add("forward", {"weights": 10, "activations": 3})  # smaller: not kept
    footprint.add("backward", {"weights": 10, "gradients": 8})
    assert footprint.peak_phase == "backward" and footprint.peak == 18
    assert footprint.phases["forward"]["activations"] == 5
    assert set(footprint.categories) == set(CATEGORIES)
    assert Footprint.from_dict(footprint.to_dict()) == footprint
