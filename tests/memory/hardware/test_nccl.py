"""NCCL's memory (`lit_memory.memory.hardware.nccl`): the communicators a run creates, what each holds with the
settings in force (NCCL's constants and the published figures), and a small tier's settings."""

from __future__ import annotations

import pytest

from lit_memory.errors import UserError
from lit_memory.memory.hardware import nccl
from lit_memory.memory.hardware.nccl import Communicator, NcclSettings, communicators, for_run, nccl_memory
from lit_memory.memory.margin import Limit

MiB = 2**20
LIGHTNING = ("data_parallel", "tensor_parallel")  # ModelParallelStrategy's mesh


def test_settings_are_read_as_nccl_reads_them():
    assert NcclSettings.from_env({}) == NcclSettings()
    assert NcclSettings().per_connection == 4 * MiB + 4_915_200 + 524_288  # Simple, LL128, LL (src/init.cc)
    found = NcclSettings.from_env({"NCCL_BUFFSIZE": "0x100000", "NCCL_MAX_NCHANNELS": "8", "NCCL_MAX_CTAS": "4",
                                   "NCCL_NVLS_ENABLE": "0", "NCCL_RUNTIME_CONNECT": "0", "NCCL_DEBUG": "INFO"})
    assert (found.buffsize, found.nvls, found.runtime_connect) == (MiB, False, False)
    assert found.channels(32) == 4 and found.channels(32, nvls=True) == 4  # the smaller of both maximums
    assert NcclSettings(max_channels=2).channels(16, nvls=True) == 16  # NVLS's: NCCL_MAX_CTAS only
    assert NcclSettings(min_channels=8).channels(4) == 8
    with pytest.raises(UserError, match="NCCL_BUFFSIZE='4M': NCCL reads a whole number"):
        NcclSettings.from_env({"NCCL_BUFFSIZE": "4M"})
    # a small tier's settings go under the environment's: the user's buffer size stays
    under = NcclSettings.from_env({"NCCL_BUFFSIZE": str(2 * MiB)}).under(nccl.SMALL)
    assert (under.buffsize, under.max_channels, under.nvls) == (2 * MiB, 2, False)


def test_a_run_holds_worlds_communicator_and_one_per_mesh_dimension_smaller_than_the_world():
    """torch's DeviceMesh reuses the default group for a dimension as large as the world and splits the others from
    it; one rank needs none (the process group is gloo there)."""
    assert communicators(1, (1, 1), LIGHTNING) == ()
    assert nccl.backend(1) == "gloo" and nccl.backend(2) is None
    assert communicators(2, (2, 1), LIGHTNING) == (
        Communicator("WORLD", 2), Communicator("tensor_parallel", 1, collectives=False),  # FSDP2 leaves it idle
    )
    assert communicators(4, (2, 2), LIGHTNING) == (
        Communicator("WORLD", 4), Communicator("data_parallel", 2), Communicator("tensor_parallel", 2),
    )


def test_each_communicator_holds_its_channels_buffers_and_a_single_rank_one_its_net_buffer():
    defaults = NcclSettings()
    assert nccl_memory((), defaults, "h200", (9, 0)).total == 0
    # FSDP2 over 2 H200s: setup, 32 channels x (a ring's and a tree's connection) x one buffer per protocol, NVLS
    two = nccl_memory(communicators(2, (2, 1), LIGHTNING), defaults, "h200", (9, 0))
    assert two.setup == 484 * MiB  # NCCL PR 2366
    assert two.buffers == 32 * 2 * (4 * MiB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16)
    assert two.nvls == 16 * 2 * (128 * 1024 * 8) * 2 and two.single_rank == 0  # the idle single-rank one: no buffer
    assert 0.3 * 2**30 < two.buffers < 0.9 * 2**30  # the range NCCL's maintainers' figures give over NVLink
    assert (
        nccl_memory(communicators(2, (2, 1), LIGHTNING), defaults, "rtx3090", (8, 6)).buffers
        == 4 * 2 * defaults.per_connection
    )
    # A single-rank communicator that runs collectives: NCCL 2.28's NET shared buffer, 536870912 bytes (NCCL issue
    # 2363's failed calloc); 996 MiB in all on one GPU with NCCL_RUNTIME_CONNECT=0 (PR 2366's measurement)
    alone = (Communicator("WORLD", 1),)
    assert nccl_memory(alone, defaults, "h200", (9, 0)).single_rank == 536_870_912
    idle = (Communicator("tensor_parallel", 1, collectives=False),)
    assert nccl_memory(idle, NcclSettings(runtime_connect=False), "rtx3090", (8, 6)).total == 996 * MiB
    # small settings: 2 channels of 1 MiB Simple buffers, no NVLS; the single-rank buffer 2 channels x 16 x 128 KiB
    small = defaults.under(nccl.SMALL)
    assert nccl_memory(communicators(8, (8, 1), LIGHTNING), small, "h200", (9, 0)).total == 484 * MiB + 2 * 2 * (
        MiB + 4_915_200 + 524_288)
    assert nccl_memory(alone, small, "h200", (9, 0)).single_rank == 2 * 16 * (MiB // 8)
    assert "NCCL: " in two.describe() and "tensor_parallel (1 rank)" in two.describe()


def test_a_small_tiers_distributed_run_sets_nccls_buffers_small_and_says_so():
    tier = Limit(3902 * MiB, "memory.tier rtx3050-4gb (3.81 GiB)")
    setting, line = for_run(tier, 2, {})
    assert setting == {"NCCL_BUFFSIZE": str(MiB), "NCCL_MAX_NCHANNELS": "2", "NCCL_NVLS_ENABLE": "0"}
    assert line.startswith(f"nccl: small buffers for {tier}: NCCL_BUFFSIZE=1048576 NCCL_MAX_NCHANNELS=2 "
                           "NCCL_NVLS_ENABLE=0 (each communicator's buffers 24.75 MiB instead of up to 652.00 MiB")
    kept, line = for_run(tier, 2, {"NCCL_MAX_NCHANNELS": "4"})  # the user's channels win
    assert (
        kept == {"NCCL_BUFFSIZE": str(MiB), "NCCL_NVLS_ENABLE": "0"}
        and "from the environment: NCCL_MAX_NCHANNELS=4" in line
    )
    assert for_run(tier, 1, {}) == ({}, "")  # one rank: no communicator
    # a large tier keeps NCCL's defaults
    assert for_run(Limit(80 * 2**30, "memory.budget 80.00 GiB"), 8, {}) == ({}, "")
    assert for_run(None, 8, {}) == ({}, "")
    environ = {"NCCL_BUFFSIZE": "7"}
    with nccl.run_settings({"NCCL_BUFFSIZE": "1", "NCCL_MAX_NCHANNELS": "2"}, environ):
        assert environ == {"NCCL_BUFFSIZE": "1", "NCCL_MAX_NCHANNELS": "2"}
    assert environ == {"NCCL_BUFFSIZE": "7"}


def test_devices_auto_counts_the_same_processes_for_the_run_and_its_plan():
    """``devices: auto`` (configs/fsdp.yaml's) on a machine with two GPUs: the run starts two ranks and sets NCCL's
    small buffers (`cli.world_size`); its plan, made for this machine (`gpus.target` reads its device count), counts
    the same two ranks and their communicators. For another machine (`estimate`) auto counts one."""
    from lit_memory.memory.hardware.gpus import Target
    from lit_memory.memory.settings import MemorySettings
    from lit_memory.planning.prediction.step import Step

    settings = {"trainer": {"devices": "auto", "strategy": "lit_memory.strategies.FSDP2Strategy"}}
    memory = MemorySettings(budget="3.5GiB")
    here = Step.from_settings(settings, Target(devices=2), memory=memory)
    elsewhere = Step.from_settings(settings, Target(), memory=memory)
    assert (here.world_size, elsewhere.world_size) == (2, 1)
    assert here.communicators.total > 0 and elsewhere.communicators.total == 0
