"""NCCL's memory on each GPU of a distributed CUDA run: the communicators the run creates, what each holds on the
device outside the caching allocator (what ``nvidia-smi`` shows and the allocator's cap does not see), with the NCCL
settings in force; and the small settings a small tier's run uses.

**Which communicators** (`communicators`), per rank. Lightning hands ``init_process_group`` the rank's device
(``device_id``), so NCCL starts the default group's communicator (WORLD) at once, and torch's ``DeviceMesh``
(Lightning's ModelParallelStrategy meshes ``(data_parallel, tensor_parallel)``: ``(world, 1)`` for
`lit_memory.FSDP2Strategy`) reuses WORLD for a dimension as large as the world and splits one communicator per rank
from it (``ncclCommSplit``, at once) for every other. On one rank none is needed: FSDP2 on one rank neither gathers
nor reduces, so lit_memory's FSDP2 strategies keep the process group on gloo there (`backend`).

**What each holds** (`nccl_memory`; NCCL's sources at github.com/NVIDIA/nccl and published measurements):

- *setup*, once per process: 484 MiB, the initialization memory of a one-GPU communicator (NVIDIA/nccl#2366: RTX 3090,
  CUDA 13.0; it holds NCCL's kernels and state, and may hold part of the CUDA context: it errs high);
- *buffers*, per communicator of several ranks: per channel, a ring and a tree connection (2 peers; a ring has 2
  connections whatever the scale: NVIDIA/nccl#986), each with one buffer per protocol: Simple ``NCCL_BUFFSIZE``
  (4 MiB), LL128 ``NCCL_LL128_BUFFSIZE`` (120 x 640 threads x 8 steps x 8 B = 4.69 MiB), LL ``NCCL_LL_BUFFSIZE``
  (8 lines x 512 threads x 8 steps x 16 B = 512 KiB) (src/init.cc ``DEFAULT_*BUFFSIZE``, src/include/device.h). The
  memory is linear in the channels (NVIDIA/nccl#986): ``NCCL_MAX_NCHANNELS`` where set, else up to 32 over NVLink
  and NVSwitch (data-centre cards) and 4 over PCIe: 0.3 to 0.6 GiB per communicator over NVLink by default;
- *NVLS*, on NVSwitch systems of sm90 and newer (``NCCL_NVLS_ENABLE`` not 0): per rank of the node, 16 channels (24
  on sm100) x 2 x (128 KiB chunk x 8 steps) (src/transport/nvls.cc, ``ncclNvlsBufferSetup``);
- *a single-rank communicator's* NET shared buffer: p2p channels (64) x 16 steps x the P2P chunk (512 KiB over
  NVLink, at most ``NCCL_BUFFSIZE`` / 8) = 512 MiB in NCCL 2.28 (NVIDIA/nccl#2363: "Failed to CUDA calloc 536870912
  bytes", torch 2.11, CUDA 13.0), allocated at its first collective, or at its start with ``NCCL_RUNTIME_CONNECT=0``
  (#2366: 996 MiB against 484). An NCCL without it holds less: the prediction errs high.

Measured on this project's H200 (docs/gpu.md): FSDP2 on one GPU took the process from 518 MiB outside the allocator
to 1.29 GiB once its single-rank NCCL communicator started, a 512 MiB buffer and 291 MiB more.

A small tier's run (`SMALL_TIER` or less) sets ``NCCL_BUFFSIZE`` to 1 MiB, ``NCCL_MAX_NCHANNELS`` to 2 and
``NCCL_NVLS_ENABLE`` to 0 where the environment sets none of them (`for_run`): 25 MiB of buffers per communicator
instead of 0.3 to 0.6 GiB, at some bandwidth (a small card's PCIe link seldom fills more channels).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, Optional

from lit_memory.errors import UserError
from lit_memory.memory.margin import Limit
from lit_memory.memory.measure.footprint import format_bytes

KiB, MiB, GiB = 2**10, 2**20, 2**30
NCCL_STEPS = 8  # src/include/device.h
DEFAULT_BUFFSIZE = 4 * MiB  # Simple protocol (src/init.cc)
DEFAULT_LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8  # NCCL_LL128_ELEMS_PER_THREAD x MAX_NTHREADS x steps x 8 B
DEFAULT_LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16  # NCCL_LL_LINES_PER_THREAD x MAX_NTHREADS x steps x a 16 B line
PEERS_PER_CHANNEL = 2  # a ring's and a tree's connection
MAX_CHANNELS = 64  # MAXCHANNELS: a single-rank communicator's p2p channels
SHARED_STEPS = 16  # NCCL_SHARED_STEPS (src/transport/net.cc)
P2P_NVL_CHUNK = 512 * KiB  # NCCL_P2P_NVL_CHUNKSIZE
NVLS_CHUNK = 128 * KiB  # NCCL_NVLS_CHUNKSIZE
SETUP = 484 * MiB  # NVIDIA/nccl#2366: a one-GPU communicator's initialization memory
CHANNELS_NVLINK, CHANNELS_PCIE = 32, 4
SMALL_TIER = 8 * GiB  # a limit at most this: the run sets `SMALL`
SMALL = {"NCCL_BUFFSIZE": str(1 * MiB), "NCCL_MAX_NCHANNELS": "2", "NCCL_NVLS_ENABLE": "0"}
# Cards whose boards connect several GPUs by NVLink/NVSwitch (SXM): the catalogue's data-centre entries
# (`lit_memory.memory.hardware.gpus.GPUS`); others over PCIe.
NVLINK_CARDS = ("a100", "h100", "h200")
# The variables read, each with the field it sets; flags: a whole number, 0 for off. A communicator's channels are
# at most both NCCL_MAX_NCHANNELS and NCCL_MAX_CTAS (src/graph/connect.cc), NVLS's at most NCCL_MAX_CTAS.
NUMBERS = {
    "NCCL_BUFFSIZE": "buffsize", "NCCL_LL128_BUFFSIZE": "ll128_buffsize", "NCCL_LL_BUFFSIZE": "ll_buffsize",
    "NCCL_MAX_NCHANNELS": "max_channels", "NCCL_MAX_CTAS": "max_ctas", "NCCL_MIN_CTAS": "min_channels",
    "NCCL_P2P_NVL_CHUNKSIZE": "p2p_nvl_chunk", "NCCL_MAX_P2P_NCHANNELS": "max_p2p_channels",
}
FLAGS = {"NCCL_NVLS_ENABLE": "nvls", "NCCL_RUNTIME_CONNECT": "runtime_connect",
         "NCCL_COMM_SPLIT_SHARE_RESOURCES": "split_share"}


@dataclass(frozen=True)
class NcclSettings:
    """The NCCL settings that size its device memory, as NCCL reads them from the environment when a communicator
    starts (``NCCL_*``; None: NCCL's default)."""

    buffsize: int = DEFAULT_BUFFSIZE  # NCCL_BUFFSIZE: the Simple protocol's buffer per connection
    ll128_buffsize: int = DEFAULT_LL128_BUFFSIZE  # NCCL_LL128_BUFFSIZE
    ll_buffsize: int = DEFAULT_LL_BUFFSIZE  # NCCL_LL_BUFFSIZE
    max_channels: Optional[int] = None  # NCCL_MAX_NCHANNELS
    max_ctas: Optional[int] = None  # NCCL_MAX_CTAS: NVLS's channels too
    min_channels: Optional[int] = None  # NCCL_MIN_CTAS
    nvls: Optional[bool] = None  # NCCL_NVLS_ENABLE (None: NCCL decides, on where NVSwitch allows)
    runtime_connect: bool = True  # NCCL_RUNTIME_CONNECT: connections made at first use
    p2p_nvl_chunk: int = P2P_NVL_CHUNK  # NCCL_P2P_NVL_CHUNKSIZE
    max_p2p_channels: int = MAX_CHANNELS  # NCCL_MAX_P2P_NCHANNELS
    split_share: bool = False  # NCCL_COMM_SPLIT_SHARE_RESOURCES: a split communicator uses its parent's buffers

    given: tuple[str, ...] = field(default=(), compare=False)  # the variables the environment set

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "NcclSettings":
        """As NCCL reads them from ``environ`` (this process's); one error line for a value NCCL cannot read."""
        environ = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        given = []
        for name, field_name in (*NUMBERS.items(), *FLAGS.items()):
            value = environ.get(name)
            if value is None or not value.strip():
                continue
            try:
                number = int(value.strip(), 0)
            except ValueError:
                raise UserError(f"{name}={value!r}: NCCL reads a whole number") from None
            given.append(name)
            found[field_name] = number != 0 if name in FLAGS else number
        return cls(**found, given=tuple(given))

    def under(self, variables: Mapping[str, str]) -> "NcclSettings":
        """These settings with ``variables`` laid under them: each applies where the environment set none of the
        variables of its field."""
        mine = {NUMBERS.get(name) or FLAGS[name] for name in self.given}
        extra = NcclSettings.from_env(variables)
        fields_ = {NUMBERS.get(name) or FLAGS[name] for name in extra.given} - mine
        if not fields_:
            return self
        return replace(self, **{f: getattr(extra, f) for f in fields_},
                       given=self.given + tuple(n for n in extra.given if (NUMBERS.get(n) or FLAGS[n]) in fields_))

    def channels(self, default: int, nvls: bool = False) -> int:
        """The channels of a communicator whose topology gives ``default`` (``nvls``: NVLS's), within the minimum
        and maximums set."""
        limits = [m for m in (self.max_ctas, None if nvls else self.max_channels) if m is not None]
        return max(min([default, *limits]), self.min_channels or 1)

    @property
    def per_connection(self) -> int:
        """One connection's buffers: one per protocol."""
        return self.buffsize + self.ll128_buffsize + self.ll_buffsize

    def describe(self) -> str:
        parts = [f"NCCL_BUFFSIZE {format_bytes(self.buffsize)}"]
        for name, value in (("NCCL_MAX_NCHANNELS", self.max_channels), ("NCCL_MAX_CTAS", self.max_ctas)):
            if value is not None:
                parts.append(f"{name} {value}")
        if self.nvls is False:
            parts.append("NVLS off")
        return ", ".join(parts)


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank holds: its group, its ranks, whether the run's collectives use it."""

    group: str
    ranks: int
    collectives: bool = True


def backend(world_size: int) -> Optional[str]:
    """The process group's backend lit_memory's FSDP2 strategies ask for: gloo on one rank (no communicator is
    needed: FSDP2 on one rank neither gathers nor reduces, and the rest is Lightning's rendezvous and small objects),
    else None (Lightning's default: NCCL on CUDA)."""
    return "gloo" if world_size == 1 else None


def communicators(
    world_size: int, mesh: Optional[tuple[int, ...]] = None, names: tuple[str, ...] = ()
) -> tuple[Communicator, ...]:
    """The NCCL communicators one rank of a CUDA run on ``world_size`` ranks holds, for a device mesh of shape
    ``mesh`` (dimension ``names``; None: no mesh): none on one rank (`backend`), else WORLD's and one split from it
    for each mesh dimension smaller than the world. A dimension of one rank runs no collective (FSDP2 over the
    data-parallel dimension leaves Lightning's tensor-parallel one idle)."""
    if world_size <= 1:
        return ()
    found = [Communicator("WORLD", world_size)]
    for index, size in enumerate(mesh or ()):
        if size != world_size:
            name = names[index] if index < len(names) else f"mesh dimension {index}"
            found.append(Communicator(name, size, collectives=size > 1))
    return tuple(found)


@dataclass(frozen=True)
class NcclMemory:
    """What the communicators hold on one rank's GPU, bytes, by kind (module docstring)."""

    communicators: tuple[Communicator, ...] = ()
    settings: NcclSettings = NcclSettings()
    setup: int = 0
    buffers: int = 0
    nvls: int = 0
    single_rank: int = 0
    channels: int = 0

    @property
    def total(self) -> int:
        return self.setup + self.buffers + self.nvls + self.single_rank

    def describe(self) -> str:
        """One line: the communicators and their bytes."""
        if not self.communicators:
            return ""
        groups = ", ".join(f"{c.group} ({c.ranks} rank{'s' if c.ranks > 1 else ''})" for c in self.communicators)
        parts = [f"{format_bytes(self.setup)} setup"]
        if self.buffers:
            parts.append(
                f"{format_bytes(self.buffers)} buffers ({self.channels} channels x {PEERS_PER_CHANNEL} peers x "
                f"{format_bytes(self.settings.per_connection)})"
            )
        if self.nvls:
            parts.append(f"{format_bytes(self.nvls)} NVLS")
        if self.single_rank:
            parts.append(f"{format_bytes(self.single_rank)} single-rank NET buffers")
        return (f"NCCL: {format_bytes(self.total)} per rank outside the allocator for {groups}: {' + '.join(parts)} "
                f"({self.settings.describe()})")


def nvlink(card_key: str) -> bool:
    """Whether a card of the catalogue (`lit_memory.memory.hardware.gpus.GPUS`, by key) is one whose boards join
    their GPUs by NVLink/NVSwitch."""
    return any(card_key == k or card_key.startswith(k + "-") for k in NVLINK_CARDS)


def nccl_memory(
    found: tuple[Communicator, ...], settings: NcclSettings, card_key: str = "", capability: tuple[int, int] = (0, 0),
) -> NcclMemory:
    """What ``found`` (`communicators`) hold on one rank's GPU with ``settings``, on a card of the catalogue's
    ``card_key`` and compute ``capability`` (module docstring)."""
    if not found:
        return NcclMemory(settings=settings)
    linked = nvlink(card_key)
    channels = settings.channels(CHANNELS_NVLINK if linked else CHANNELS_PCIE)
    buffers = nvls = single = 0
    for index, comm in enumerate(found):
        shared = index > 0 and settings.split_share  # split from WORLD, on its resources
        if comm.ranks > 1 and not shared:
            buffers += channels * PEERS_PER_CHANNEL * settings.per_connection
            if linked and capability >= (9, 0) and settings.nvls is not False:
                nvls_channels = settings.channels(24 if capability >= (10, 0) else 16, nvls=True)
                nvls += nvls_channels * 2 * NVLS_CHUNK * NCCL_STEPS * comm.ranks
        elif comm.ranks == 1 and (comm.collectives or not settings.runtime_connect):
            p2p_channels = _pow2_up(min(settings.channels(MAX_CHANNELS), settings.max_p2p_channels))
            chunk = min(settings.p2p_nvl_chunk, settings.buffsize // NCCL_STEPS)
            single += p2p_channels * SHARED_STEPS * chunk
    return NcclMemory(found, settings, SETUP, buffers, nvls, single, channels)


def _pow2_up(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def small(limit: Optional[Limit], world_size: int) -> bool:
    """Whether a CUDA run on ``world_size`` ranks within ``limit`` (its memory.budget or tier) takes `SMALL`."""
    return world_size > 1 and limit is not None and limit.bytes <= SMALL_TIER


def for_run(
    limit: Optional[Limit], world_size: int, environ: Optional[Mapping[str, str]] = None
) -> tuple[dict[str, str], str]:
    """The variables a CUDA run on ``world_size`` ranks within ``limit`` (its memory.budget or tier) sets: `SMALL`,
    but where ``environ`` sets a variable of the same setting (the user's win); and one line saying so. Nothing for
    a larger tier, or one rank."""
    settings = NcclSettings.from_env(environ)
    if not small(limit, world_size):
        return {}, ""
    taken = settings.under(SMALL)
    setting = {name: SMALL[name] for name in taken.given if name in SMALL and name not in settings.given}
    if not setting:
        return {}, ""
    two = (Communicator("WORLD", world_size),)
    before = nccl_memory(two, settings, NVLINK_CARDS[-1], (9, 0))
    after = nccl_memory(two, taken, NVLINK_CARDS[-1], (9, 0))
    ours = {NUMBERS.get(n) or FLAGS[n] for n in SMALL}
    theirs = [n for n in settings.given if (NUMBERS.get(n) or FLAGS[n]) in ours]
    kept = f"; from the environment: {', '.join(f'{n}={environ_of(environ)[n]}' for n in theirs)}" if theirs else ""
    return setting, (
        f"nccl: small buffers for {limit}: {' '.join(f'{k}={v}' for k, v in setting.items())} (each communicator's "
        f"buffers {format_bytes(after.buffers + after.nvls)} instead of up to "
        f"{format_bytes(before.buffers + before.nvls)} "
        f"on NVLink; fewer channels, less bandwidth){kept}; set them yourself to choose others"
    )


def environ_of(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


@contextlib.contextmanager
def run_settings(setting: Mapping[str, str], environ: Optional[dict] = None) -> Iterator[None]:
    """``setting`` in the environment for the length of the block (the processes a run starts inherit them), each
    variable as it was at its end."""
    environ = os.environ if environ is None else environ
    before = {k: environ.get(k) for k in setting}
    environ.update(setting)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
