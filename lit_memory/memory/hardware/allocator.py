"""A model of PyTorch's CUDA caching allocator, replayed over a step's allocations and frees.

What ``torch.cuda.max_memory_reserved`` reads: the segments the allocator has taken from the driver
with ``cudaMalloc`` and keeps, used or not. The rules are those of ``c10/cuda/CUDACachingAllocator.cpp``
(torch 2.x) and of torch's CUDA semantics notes ("Memory management"), no more:

- every request is rounded up to a multiple of 512 B (``roundup_power2_divisions`` rounds larger
  requests to the next power-of-two division instead);
- requests up to 1 MiB come from the small pool, carved out of 2 MiB segments; larger ones from the
  large pool: below 10 MiB out of 20 MiB segments, from 10 MiB on out of a segment of their own,
  rounded up to 2 MiB;
- a request takes the smallest cached free block of its pool that fits (best fit, lowest address on
  ties); a larger block is split when the rest is at least 512 B (small pool) or more than 1 MiB (large
  pool), and blocks at least ``max_split_size`` are never split nor handed to smaller requests;
- a freed block merges with free neighbours of its segment and stays cached: nothing is returned to
  the driver (that only happens on an out-of-memory retry or ``torch.cuda.empty_cache()``, which a
  prediction of the peak does not need);
- ``expandable_segments:True``: one segment per pool that grows by mapping 2 MiB (small pool) or
  20 MiB (large pool) pages at its end; blocks split whenever 512 B or more is left;
- under a cap (``torch.cuda.set_per_process_memory_fraction``, what ``memory.budget`` sets), a request no cached
  block serves first passes the cap's check: the reserve plus the request's whole segment size
  (``get_allocation_size``) must be within the cap, even where expandable segments then map only the pages past
  their free tail (``alloc_block`` in c10/core/CachingDeviceAllocator.h). A request that fails it makes the
  allocator synchronise, release every cached block (unmap every free page) and retry: ``num_alloc_retries``.
  ``peak_checked`` is the highest level that check saw, what a cap must allow for no retry.

Written here rather than taken from torch because torch has no CPU-side simulator of it (its memory
snapshot tools read a real CUDA allocator). One stream is modelled: a step's kernels run on one.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Iterator, Mapping, Optional

from lit_memory.errors import UserError

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: largest small-pool request
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: large-pool segment for requests under 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge
CUDA_ENV = "PYTORCH_CUDA_ALLOC_CONF"
UNIFIED_ENV = "PYTORCH_ALLOC_CONF"


def env_names(torch_version: Optional[str] = None) -> tuple[str, ...]:
    """The variables torch reads its allocator settings from, in the order it reads them; the first one set wins,
    and is read once, when the allocator's config is first used (c10/core/AllocatorConfig.cpp,
    ``AcceleratorAllocatorConfig::instance``). torch 2.8 to 2.11 read the unified ``PYTORCH_ALLOC_CONF`` first and
    warned that ``PYTORCH_CUDA_ALLOC_CONF`` is deprecated; from 2.12 the CUDA name is an alias again and read first
    (then ROCm's ``PYTORCH_HIP_ALLOC_CONF``, then the unified one: tests/memory/hardware/test_allocator.py checks the
    installed torch's order against this one); before 2.8 only the CUDA name existed."""
    if torch_version is None:
        # deferred: the allocator's settings are read and checked without torch (`memory.settings`, the CLI)
        import torch

        torch_version = torch.__version__
    match = re.match(r"(\d+)\.(\d+)", str(torch_version))
    version = (int(match[1]), int(match[2])) if match else (0, 0)
    if version >= (2, 12):
        return (CUDA_ENV, UNIFIED_ENV)
    if version >= (2, 8):
        return (UNIFIED_ENV, CUDA_ENV)
    return (CUDA_ENV,)


def environment_conf(
    environ: Optional[Mapping[str, str]] = None, torch_version: Optional[str] = None
) -> Optional[tuple[str, str]]:
    """(variable, settings) torch takes from the environment (``os.environ`` by default), or None: none is set."""
    environ = os.environ if environ is None else environ
    for name in env_names(torch_version):
        if name in environ:  # set, even empty: torch reads it (an empty one means the defaults)
            return name, environ[name]
    return None


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings (``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF``) that change how much it reserves."""

    expandable_segments: bool = False
    max_split_size: Optional[int] = None  # bytes (``max_split_size_mb``); None: unlimited
    roundup_power2_divisions: int = 0  # the single-number form; 0 or 1: off

    @classmethod
    def parse(cls, conf: Optional[str]) -> "AllocatorConfig":
        """``expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:4`` (other keys ignored)."""
        values: dict = {}
        for item in re.split(r"[,\s]+", conf or ""):
            key, _, value = item.partition(":")
            if key == "expandable_segments":
                values["expandable_segments"] = value.strip().lower() == "true"
            elif key == "max_split_size_mb" and value.strip().isdigit():
                values["max_split_size"] = int(value) << 20
            elif key == "roundup_power2_divisions" and value.strip().isdigit():
                values["roundup_power2_divisions"] = int(value)
        return cls(**values)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "AllocatorConfig":
        """The settings torch takes from the environment (`environment_conf`: either variable, in torch's order)."""
        found = environment_conf(environ)
        return cls.parse(found[1] if found else None)

    def describe(self) -> str:
        parts = ["expandable segments" if self.expandable_segments else "fixed segments"]
        if self.max_split_size is not None:
            parts.append(f"max_split_size {self.max_split_size >> 20} MiB")
        if self.roundup_power2_divisions > 1:
            parts.append(f"roundup_power2_divisions {self.roundup_power2_divisions}")
        return ", ".join(parts)


# The allocator settings' keys a recipe may set (torch's CUDA semantics notes), with their values' form: a
# recipe from someone else sets allocator knobs, nothing that loads a backend or a library.
RECIPE_KEYS = {
    "expandable_segments": r"(?i:true|false)",
    "max_split_size_mb": r"\d+",
    "roundup_power2_divisions": r"\d+",
    "garbage_collection_threshold": r"0?\.\d+",
}


def check_recipe_conf(conf: str) -> str:
    """``memory.allocator`` as a recipe writes it (``expandable_segments:True``), checked key by key: one
    `UserError` line for anything else."""
    items = [item for item in re.split(r"[,\s]+", str(conf).strip()) if item]
    for item in items:
        key, _, value = item.partition(":")
        if key not in RECIPE_KEYS or not re.fullmatch(RECIPE_KEYS[key], value):
            raise UserError(
                f"memory.allocator: {item!r} is not an allocator setting a recipe can make; use "
                + ", ".join(f"{k}:<{v}>" for k, v in RECIPE_KEYS.items())
                + f" (comma-separated), or set {CUDA_ENV} yourself"
            )
    return ",".join(items)


@contextlib.contextmanager
def recipe_settings(
    conf: Optional[str], environ: Optional[dict] = None, runtime: Optional["Runtime"] = None
) -> Iterator[Optional[str]]:
    """Make ``conf`` (a recipe's ``memory.allocator``, checked) this process's CUDA allocator settings for the length
    of the block, unless the environment names its own (either variable: `environment_conf`), which wins: the block
    then gets a warning line, else None. The variable torch reads first is set, for the processes a run starts, and
    torch's runtime setter applies the settings in this one (`Runtime`): torch reads the variables once, and a
    library may have read them already. At the end both are as they were (the allocator's settings apply to the
    segments it makes from then on), so one run's settings never reach the next run in the same process."""
    environ = os.environ if environ is None else environ
    if not conf:
        yield None
        return
    conf = check_recipe_conf(conf)
    found = environment_conf(environ)
    if found is not None:
        name, mine = found
        yield (
            None
            if mine == conf
            else f"warning: {name}={mine} from the environment, not the recipe's memory.allocator {conf}"
        )
        return
    name = env_names()[0]
    runtime = Runtime() if runtime is None else runtime
    before = runtime.get()
    environ[name] = conf
    runtime.set(conf)
    try:
        yield None
    finally:
        environ.pop(name, None)
        runtime.set(restoring(before, conf))


class Runtime:
    """torch's allocator settings in this process, read and set at run time:
    ``torch._C._accelerator_getAllocatorSettings`` and ``_accelerator_setAllocatorSettings`` (torch 2.9 on;
    ``torch.cuda.memory._set_allocator_settings`` is their deprecated wrapper, which warns). Older torch: its CUDA
    setter, once CUDA has started (before, the variable does it); nothing to read back. The seam a test replaces."""

    def __init__(self) -> None:
        import torch  # deferred, as in `env_names`

        self._get: Optional[Callable[[], str]] = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        self._set: Optional[Callable[[str], None]] = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if self._set is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._set = torch.cuda.memory._set_allocator_settings

    def get(self) -> Optional[str]:
        return self._get() if self._get is not None else None

    def set(self, conf: Optional[str]) -> None:
        if self._set is not None and conf is not None:
            self._set(conf)


def restoring(before: Optional[str], applied: str) -> Optional[str]:
    """The settings string that puts torch's allocator back to ``before`` after ``applied``: each parse resets the
    sizes and thresholds it is not given, but not ``expandable_segments``, which must be turned off by name.
    None: nothing to restore to (a torch that cannot read its settings back)."""
    if before is None:
        return "expandable_segments:False" if "expandable_segments" in applied else None
    if "expandable_segments" in applied and "expandable_segments" not in before:
        return ",".join(s for s in (before, "expandable_segments:False") if s)
    return before


def round_size(size: int, divisions: int = 0) -> int:
    """The allocator's ``round_size``: 512 B multiples, or the next power-of-two division."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size: int) -> int:
    """``get_allocation_size``: what ``cudaMalloc`` is asked for when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


class _Block:
    __slots__ = ("addr", "size", "free", "prev", "next", "pool")

    def __init__(self, addr: int, size: int, pool: "_Pool") -> None:
        self.addr, self.size, self.free, self.pool = addr, size, True, pool
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


class _Pool:
    """Free blocks of one pool, sorted by (size, address): best fit is a bisection."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.tail: Optional[_Block] = None  # expandable segments: the last block, before the unmapped space
        self.mapped = 0  # expandable segments: bytes mapped
        self.base = 0  # expandable segments: the segment's address

    def add(self, block: _Block) -> None:
        key = (block.size, block.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = (block.size, block.addr)
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]


class CachingAllocator:
    """One device's caching allocator: ``malloc(key, size)`` / ``free(key)``; ``allocated`` and
    ``reserved`` (current and peak) as ``torch.cuda.memory_allocated``/``memory_reserved`` count them
    (allocated counts rounded block sizes, as torch does)."""

    def __init__(self, config: AllocatorConfig = AllocatorConfig()) -> None:
        self.config = config
        self.pools = {True: _Pool(small=True), False: _Pool(small=False)}
        self.live: dict[Hashable, _Block] = {}
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.peak_checked = 0  # the cap's check: the reserve plus a request's whole segment size (module docstring)
        self._next_segment = 0
        if config.expandable_segments:  # one growing segment per pool, far apart in address space
            self.pools[True].base, self.pools[False].base = 0, 1 << 50

    # -- the public operations ---------------------------------------------------------------------

    def malloc(self, key: Hashable, size: int) -> None:
        if key in self.live:
            raise KeyError(f"{key!r} is already allocated")
        rounded = round_size(size, self.config.roundup_power2_divisions)
        pool = self.pools[rounded <= SMALL_SIZE]
        block = self._find(pool, rounded)
        if block is None:
            block = self._grow(pool, rounded)
        block = self._split(block, rounded)
        block.free = False
        self.live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        block = self.live.pop(key)
        self.allocated -= block.size
        block.free = True
        pool = block.pool
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                pool.remove(neighbour)
                self._merge(block, neighbour)
        pool.add(block)

    # -- finding and making blocks -----------------------------------------------------------------

    def _find(self, pool: _Pool, size: int) -> Optional[_Block]:
        i = bisect.bisect_left(pool.keys, (size, -1))
        if i == len(pool.keys):
            return None
        block = pool.blocks[pool.keys[i]]
        if self.config.expandable_segments and block is pool.tail:
            # The tail can grow, so best fit counts it as larger than any other block: take another if one fits.
            if i + 1 < len(pool.keys):
                block = pool.blocks[pool.keys[i + 1]]
        limit = self.config.max_split_size
        if limit is not None and not pool.small:
            if size < limit <= block.size:
                return None  # an oversize block is not handed to a smaller request
            if size >= limit and block.size >= size + LARGE_BUFFER:
                return None
        pool.remove(block)
        return block

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """A new segment (``cudaMalloc``), or more pages mapped at the end of the expandable segment."""
        self.peak_checked = max(self.peak_checked, self.reserved + segment_size(size))
        if not self.config.expandable_segments:
            total = segment_size(size)
            block = _Block(self._next_segment, total, pool)
            self._next_segment += total + (1 << 30)  # segments never touch: no merging across them
            self._reserve(total)
            return block
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        tail = pool.tail if pool.tail is not None and pool.tail.free else None
        have = tail.size if tail is not None else 0
        grow = page * ((size - have + page - 1) // page)
        self._reserve(grow)
        if tail is not None:
            pool.remove(tail)
            tail.size += grow
            block = tail
        else:
            block = _Block(pool.base + pool.mapped, grow, pool)
            block.prev = pool.tail
            if pool.tail is not None:
                pool.tail.next = block
            pool.tail = block
        pool.mapped += grow
        return block

    def _split(self, block: _Block, size: int) -> _Block:
        rest = block.size - size
        pool = block.pool
        if pool.small or self.config.expandable_segments:
            split = rest >= MIN_BLOCK
        else:
            limit = self.config.max_split_size
            split = (limit is None or size < limit) and rest > SMALL_SIZE
        if split:
            remainder = _Block(block.addr + size, rest, pool)
            remainder.prev, remainder.next = block, block.next
            if block.next is not None:
                block.next.prev = remainder
            block.next = remainder
            block.size = size
            if pool.tail is block:
                pool.tail = remainder
            pool.add(remainder)
        return block

    def _merge(self, block: _Block, other: _Block) -> None:
        if other is block.prev:
            block.addr, block.prev = other.addr, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size
        if block.pool.tail is other:
            block.pool.tail = block

    def _reserve(self, size: int) -> None:
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)


# -- replaying a step ------------------------------------------------------------------------------

# An event: ("+", key, bytes) allocates, ("-", key) frees, ("phase", name) starts a phase.
Event = tuple


@dataclass(frozen=True)
class Replay:
    """What the allocator held over a sequence of events: per phase (in order, each name once: the
    largest over its occurrences), the peak allocated within it and the reserved at its end."""

    allocated: dict[str, int]
    reserved: dict[str, int]
    peak_allocated: int
    peak_reserved: int
    peak_phase: Optional[str]  # the phase in which reserved last grew
    peak_checked: int = 0  # the highest level a cap's check saw (`CachingAllocator.peak_checked`)

    @property
    def room(self) -> int:
        """What a cap must allow beyond the reserved peak for the allocator never to release its cache and retry:
        none with fixed segments (a new segment is what the check counts); with expandable segments, the most a
        request's whole segment size passed what its pages past the free tail added."""
        return max(self.peak_checked - self.peak_reserved, 0)


def replay(events: Iterable[Event], config: AllocatorConfig = AllocatorConfig()) -> Replay:
    allocator = CachingAllocator(config)
    allocated: dict[str, int] = {}
    reserved: dict[str, int] = {}
    phase, grew_in = None, None

    def close() -> None:
        if phase is not None:
            allocated[phase] = max(allocated.get(phase, 0), phase_peak)
            reserved[phase] = max(reserved.get(phase, 0), allocator.reserved)

    phase_peak = 0
    malloc, free = allocator.malloc, allocator.free
    for event in events:
        kind = event[0]
        if kind == "+":
            before = allocator.reserved
            malloc(event[1], event[2])
            if allocator.reserved > before:
                grew_in = phase
            if allocator.allocated > phase_peak:
                phase_peak = allocator.allocated
        elif kind == "-":
            free(event[1])
        else:
            close()
            phase, phase_peak = event[1], allocator.allocated
    close()
    return Replay(
        allocated, reserved, allocator.peak_allocated, allocator.peak_reserved, grew_in, allocator.peak_checked
    )
