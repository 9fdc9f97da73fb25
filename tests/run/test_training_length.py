"""`lit_memory.run.training_length`: optimizer steps per epoch as Lightning counts them, and the floor a small file of
one's own trains to."""

from __future__ import annotations

import pytest

from lit_memory.run.training_length import MIN_STEPS, Length, floor, steps_per_epoch


@pytest.mark.parametrize("rows, batch, accumulate, world, steps", [
    (480, 32, 1, 1, 15), (481, 32, 1, 1, 16), (480, 32, 4, 1, 4), (480, 16, 1, 2, 15), (1, 32, 8, 4, 1),
])
def test_steps_per_epoch_count_the_last_short_batch_and_the_last_accumulation(rows, batch, accumulate, world, steps):
    assert steps_per_epoch(rows, batch, accumulate, world) == steps


def test_a_small_file_trains_enough_epochs_for_the_floor_and_a_large_one_its_epochs():
    small = floor(480, 32, 1, 1, max_epochs=1)
    assert (small.epochs, small.steps, small.raised_from) == (20, 300, 1) and MIN_STEPS == 300
    assert small.describe() == (
        "300 optimizer steps (20 epochs of 15): trainer.max_epochs raised from 1 so that your "
        "data trains at least 300 steps (set trainer.max_epochs or trainer.max_steps to choose)"
    )
    large = floor(20_000, 32, 1, 1, max_epochs=1)
    assert (large.epochs, large.steps, large.raised_from) == (1, 625, None)
    assert floor(480, 32, 1, 1, max_epochs=30).epochs == 30  # never fewer than set
    assert Length(20, 15, max_steps=40).describe() == "40 optimizer steps (trainer.max_steps; 15 per epoch)"
