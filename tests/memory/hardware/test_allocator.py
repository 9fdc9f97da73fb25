"""The caching-allocator model (lit_memory.memory.hardware.allocator): the rules of c10/cuda/CUDACachingAllocator.cpp,
one by one, on request sequences whose reserved bytes can be worked out by hand."""

from __future__ import annotations

import pytest

from lit_memory.memory.hardware.allocator import (
    AllocatorConfig,
    CachingAllocator,
    replay,
    round_size,
    segment_size,
)

KiB, MiB = 2**10, 2**20


def test_sizes_round_up_to_512_bytes_and_segments_follow_the_request_size():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert round_size(1200 * KiB, divisions=4) == 1280 * KiB  # the next of 4 divisions between 1 and 2 MiB
    assert segment_size(1 * MiB) == 2 * MiB  # small pool
    assert segment_size(1 * MiB + 512) == segment_size(9 * MiB) == 20 * MiB  # carved from 20 MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB) == 12 * MiB  # own segment, 2 MiB multiple


def test_small_requests_pack_into_2_mib_segments():
    allocator = CachingAllocator()
    for i in range(2048):  # 2048 x 1 KiB = 2 MiB: one segment
        allocator.malloc(i, 1000)
    assert allocator.reserved == 2 * MiB and allocator.allocated == 2 * MiB
    allocator.malloc("one more", 1000)
    assert allocator.reserved == 4 * MiB


def test_mid_sized_requests_share_20_mib_segments_and_large_ones_get_their_own():
    allocator = CachingAllocator()
    for i in range(5):
        allocator.malloc(i, 4 * MiB)
    assert allocator.reserved == 20 * MiB  # five 4 MiB blocks split out of one 20 MiB segment
    allocator.malloc(5, 4 * MiB)
    assert allocator.reserved == 40 * MiB
    allocator.malloc("large", 11 * MiB)
    assert allocator.reserved == 40 * MiB  # best fit: the 16 MiB left of the second segment
    fresh = CachingAllocator()
    fresh.malloc("large", 11 * MiB)
    assert fresh.reserved == 12 * MiB  # a segment of its own, rounded to 2 MiB
    assert fresh.allocated == 12 * MiB  # the 1 MiB left is not split off (only more than 1 MiB is)


def test_freed_blocks_stay_cached_and_best_fit_splits_them():
    allocator = CachingAllocator()
    allocator.malloc("a", 64 * MiB)
    allocator.free("a")
    assert allocator.reserved == 64 * MiB and allocator.allocated == 0  # nothing returned to the driver
    allocator.malloc("b", 16 * MiB)
    allocator.malloc("c", 40 * MiB)  # the rest of the split 64 MiB block
    assert allocator.reserved == 64 * MiB
    allocator.malloc("d", 16 * MiB)  # 8 MiB left in the cache: a new segment
    assert allocator.reserved == 80 * MiB
    allocator.free("b")
    allocator.free("c")  # merges with its free neighbour: one 56 MiB block again
    allocator.malloc("e", 56 * MiB)
    assert allocator.reserved == 80 * MiB


def test_fragmentation_makes_reserved_exceed_the_peak_of_allocated():
    # The classic pattern: a long-lived tensor lands in a freed large block, and the large request that
    # comes back no longer fits anywhere.
    allocator = CachingAllocator()
    allocator.malloc("activation", 64 * MiB)
    allocator.free("activation")
    allocator.malloc("state", 16 * MiB)  # optimizer state, kept: it takes a piece of the 64 MiB block
    allocator.malloc("activation", 64 * MiB)
    assert allocator.peak_allocated == 80 * MiB
    assert allocator.reserved == 128 * MiB  # the 48 MiB left of the first segment is of no use to it


def test_expandable_segments_grow_by_pages_and_reuse_adjacent_freed_space():
    fixed, expandable = CachingAllocator(), CachingAllocator(AllocatorConfig(expandable_segments=True))
    for allocator in (fixed, expandable):
        allocator.malloc("a", 30 * MiB)
        allocator.malloc("b", 30 * MiB)
        allocator.free("a")
        allocator.free("b")
        allocator.malloc("c", 50 * MiB)
    assert fixed.reserved == 30 * MiB + 30 * MiB + 50 * MiB  # two separate segments cannot merge
    assert expandable.reserved == 60 * MiB  # 20 MiB pages; the two freed blocks are one range


def test_max_split_size_keeps_large_blocks_whole():
    config = AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:False,garbage_collection_threshold:0.6")
    assert config == AllocatorConfig(expandable_segments=False, max_split_size=128 * MiB)
    allocator = CachingAllocator(config)
    allocator.malloc("big", 200 * MiB)
    allocator.free("big")
    allocator.malloc("small", 20 * MiB)  # not handed an oversize block
    assert allocator.reserved == 220 * MiB
    unlimited = CachingAllocator()
    unlimited.malloc("big", 200 * MiB)
    unlimited.free("big")
    unlimited.malloc("small", 20 * MiB)
    assert unlimited.reserved == 200 * MiB


def test_replay_reports_each_phase_and_where_reserved_last_grew():
    events = [
        ("phase", "setup"), ("+", "w", 8 * MiB),
        ("phase", "forward"), ("+", "act", 64 * MiB),
        ("phase", "backward"), ("-", "act"), ("+", "grad", 8 * MiB),
        ("phase", "step"), ("+", "state", 16 * MiB), ("-", "grad"),
        ("phase", "forward"), ("+", "act2", 64 * MiB), ("-", "act2"),
    ]
    found = replay(events)
    assert found.allocated == {"setup": 8 * MiB, "forward": 88 * MiB, "backward": 72 * MiB, "step": 32 * MiB}
    assert found.peak_allocated == 88 * MiB
    # w: a 20 MiB segment (12 MiB left); act: 64; grad: in the 12 MiB left; state: splits the freed 64 MiB block;
    # the second forward's 64 MiB needs a new segment: the state displaced it.
    assert found.peak_reserved == 20 * MiB + 64 * MiB + 64 * MiB
    assert found.peak_phase == "forward"
    with pytest.raises(KeyError):
        CachingAllocator().free("never allocated")


# -- a recipe's allocator settings (memory.allocator) ---------------------------------------------------------


def test_a_recipe_sets_allocator_knobs_and_nothing_else():
    from lit_memory.errors import UserError
    from lit_memory.memory.hardware.allocator import check_recipe_conf

    assert (
        check_recipe_conf(" expandable_segments:True, max_split_size_mb:128 ")
        == "expandable_segments:True,max_split_size_mb:128"
    )
    for bad in ("backend:cudaMallocAsync", "expandable_segments:maybe", "max_split_size_mb:-1", "expandable_segments"):
        with pytest.raises(
            UserError, match=r"^memory\.allocator: .* is not an allocator setting a recipe can make"
        ) as err:
            check_recipe_conf(bad)
        assert "\n" not in str(err.value)


class FakeRuntime:
    """torch's allocator settings read and set at run time (`allocator.Runtime`), as a CUDA process has them."""

    def __init__(self, settings: str = "") -> None:
        self.settings, self.calls = settings, []

    def get(self) -> str:
        return self.settings

    def set(self, conf) -> None:
        if conf is not None:
            self.calls.append(conf)
            self.settings = conf


def test_a_recipes_allocator_settings_hold_for_its_run_and_the_environment_wins():
    from lit_memory.memory.hardware.allocator import CUDA_ENV, UNIFIED_ENV, env_names, recipe_settings

    first = env_names()[0]  # the variable this torch reads first: set for the processes a run starts
    environ, runtime = {}, FakeRuntime("max_split_size_mb:64")
    with recipe_settings(None, environ, runtime) as warning:
        assert warning is None and environ == {} and runtime.calls == []
    with recipe_settings("expandable_segments:True", environ, runtime) as warning:
        assert warning is None and environ == {first: "expandable_segments:True"}
        assert runtime.settings == "expandable_segments:True"  # applied now: torch reads the variable only once
    # after the run: the environment as it was, and torch's settings (expandable segments turned off by name)
    assert environ == {} and runtime.settings == "max_split_size_mb:64,expandable_segments:False"
    for name in (CUDA_ENV, UNIFIED_ENV):  # either of torch's variables is the environment's own choice
        environ, runtime = {name: "max_split_size_mb:64"}, FakeRuntime()
        with recipe_settings("expandable_segments:True", environ, runtime) as warning:
            assert warning.startswith(f"warning: {name}=max_split_size_mb:64 from the environment, not the recipe's")
        assert environ == {name: "max_split_size_mb:64"} and runtime.calls == []
    with recipe_settings("max_split_size_mb:64", {CUDA_ENV: "max_split_size_mb:64"}, FakeRuntime()) as warning:
        assert warning is None  # the same settings: nothing to say


def test_torchs_own_runtime_setter_applies_them_without_its_deprecated_wrappers_warning():
    """In this process, the installed torch's settings: set through ``torch._C._accelerator_setAllocatorSettings``
    (``torch.cuda.memory._set_allocator_settings`` warns that it is deprecated), and put back after the run."""
    import warnings

    import torch

    from lit_memory.memory.hardware.allocator import recipe_settings

    before = AllocatorConfig.parse(torch._C._accelerator_getAllocatorSettings())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning fails the test
        with recipe_settings("expandable_segments:True,max_split_size_mb:64", {}):
            now = AllocatorConfig.parse(torch._C._accelerator_getAllocatorSettings())
            assert now.expandable_segments and now.max_split_size == 64 * MiB
    assert AllocatorConfig.parse(torch._C._accelerator_getAllocatorSettings()) == before


def test_the_environment_is_read_in_the_order_the_installed_torch_reads_it():
    """Which of the two variables wins when both are set, asked of torch itself: what its allocator config parsed
    from the environment (``torch._C._accelerator_getAllocatorSettings``, which a CPU build has too), in a fresh
    process (torch reads them once). Either alone is read (`test_predictions_use_the_recipes_allocator...`)."""
    import os
    import subprocess
    import sys

    from lit_memory.memory.hardware.allocator import CUDA_ENV, UNIFIED_ENV, env_names, environment_conf

    both = {CUDA_ENV: "max_split_size_mb:64", UNIFIED_ENV: "expandable_segments:True"}
    clean = {k: v for k, v in os.environ.items() if k not in (*both, "PYTORCH_HIP_ALLOC_CONF")}
    code = "import torch; print(torch._C._accelerator_getAllocatorSettings())"
    read = subprocess.run([sys.executable, "-c", code], env={**clean, **both}, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert environment_conf(both) == next((name, value) for name, value in both.items() if value == read)
    assert env_names("2.13.0") == (CUDA_ENV, UNIFIED_ENV)  # the installed torch's order (2.13: CUDA's first)
    assert env_names("2.9.1") == (UNIFIED_ENV, CUDA_ENV) and env_names("2.4.0") == (CUDA_ENV,)


def test_predictions_use_the_recipes_allocator_unless_one_is_given(monkeypatch):
    """A CUDA target nobody gave allocator settings takes the recipe's (as the run sets them); the environment's
    or an explicit one stays."""
    from lit_memory.memory.hardware.allocator import CUDA_ENV as ENV
    from lit_memory.memory.hardware.allocator import UNIFIED_ENV
    from lit_memory.memory.hardware.gpus import target
    from lit_memory.planning.prediction.step import Step

    settings = {"model": {"model_name_or_path": "bundled:minilm"}, "memory": {"allocator": "expandable_segments:True"}}
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(UNIFIED_ENV, raising=False)
    assert Step.from_settings(settings, target("cuda", "a100-80gb")).target.allocator.expandable_segments
    assert not Step.from_settings(
        {**settings, "memory": {}}, target("cuda", "a100-80gb")
    ).target.allocator.expandable_segments
    given = target("cuda", "a100-80gb", allocator=AllocatorConfig())
    assert not Step.from_settings(settings, given).target.allocator.expandable_segments
    monkeypatch.setenv(ENV, "max_split_size_mb:64")
    from_env = Step.from_settings(settings, target("cuda", "a100-80gb")).target.allocator
    assert not from_env.expandable_segments and from_env.max_split_size == 64 * MiB
    monkeypatch.delenv(ENV)
    monkeypatch.setenv(UNIFIED_ENV, "max_split_size_mb:128")  # the unified name is read as well
    assert Step.from_settings(settings, target("cuda", "a100-80gb")).target.allocator.max_split_size == 128 * MiB


def test_under_a_cap_the_check_counts_a_requests_whole_segment_and_expandable_segments_need_room_for_it():
    """c10/core/CachingDeviceAllocator.h, ``alloc_block``: with a fraction set, reserve + the request's whole
    segment size (``get_allocation_size``) must be within the cap, before expandable segments map only the pages
    past their free tail; a request that fails it makes the allocator release its cache and retry."""
    fixed, expandable = CachingAllocator(), CachingAllocator(AllocatorConfig(expandable_segments=True))
    for allocator in (fixed, expandable):
        allocator.malloc("a", 40 * MiB)
        allocator.malloc("b", 40 * MiB)
        allocator.free("b")  # 40 MiB free at the end
        allocator.malloc("c", 50 * MiB)  # fits nowhere cached: a new segment, or 20 MiB more mapped past the tail
    assert fixed.peak_reserved == fixed.peak_checked == 130 * MiB  # what the check counts is what it reserves
    assert expandable.peak_reserved == 100 * MiB and expandable.peak_checked == 80 * MiB + 50 * MiB
    events = [("+", "a", 40 * MiB), ("+", "b", 40 * MiB), ("-", "b"), ("+", "c", 50 * MiB)]
    assert replay(events).room == 0
    assert replay(events, AllocatorConfig(expandable_segments=True)).room == 30 * MiB  # a cap of 100 MiB retries
