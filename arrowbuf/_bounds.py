"""Resource bounds: requests refused before any memory is taken or any work is done.

Two checks, each a function the store calls once per request:

- `check_arena`: an arena of ``capacity`` rows must fit in the memory available
  when its schema becomes known (first write, or an explicit schema). The arena
  is allocated lazily (``np.empty``: pages are touched only when written), so a
  capacity beyond memory would otherwise construct and then fail in the middle of
  a write, or get the process killed once the ring fills.
- `check_batch`: a sample's gather buffer (and the sampler's index arrays) must
  fit, checked before the generator moves. Drawing with replacement beyond
  ``len(store)`` stays legal; only memory bounds a batch.

``n_step`` and ``frame_stack`` are not refused for being longer than the stored
episodes: both are well defined there (an n-step window stops at its episode's
end, a frame stack repeats the episode's first frame), and refusing them would
break a store whose first episodes are short. What made a huge ``n_step`` cost
gigabytes was the work, not the request: the store clamps the n-step window to
the longest live episode (`EpisodeTable.longest`, O(1)), which gives the same
result at O(batch x longest) cost. A frame stack's output grows with
``frame_stack``, so `check_batch` counts it.

"Available" is Linux's ``MemAvailable`` (``/proc/meminfo``: free memory plus the
page cache that can be reclaimed), lowered to what the process's cgroup still
allows (``memory.max - memory.current``); elsewhere ``os.sysconf`` free pages.
Where neither can be read, memory is not checked.
"""

from __future__ import annotations

import os
from pathlib import Path

from arrowbuf.errors import ResourceError
from arrowbuf.samplers import EpisodeSampler, Sampler, SequenceSampler
from arrowbuf.schema import Schema
from arrowbuf.table import EpisodeTable

#: Bytes per arena row besides its fields: the index -> episode map (4, up to 8 as
#: its size is a power of two), and for prioritized sampling the row -> episode map
#: (4) and the sum tree (8 and its upper levels), and reuse counts (4), rounded up.
ROW_OVERHEAD = 28
#: Bytes per drawn item besides its fields: the sampler's uniform draws, indices,
#: rows and positions (int64 / float64 each), index, episode_id, step, weight, mask.
DRAW_OVERHEAD = 64
#: Bytes per stacked frame besides the observations: its row and next row (int64).
FRAME_OVERHEAD = 16
#: Batches whose upper bound is below this are not checked against memory:
#: reading /proc/meminfo costs more than sampling a small batch.
SMALL_BATCH_BYTES = 64 << 20

_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")


def available_memory() -> int | None:
    """Bytes this process can still allocate, or None when the platform does not say.

    Linux: ``MemAvailable`` of ``/proc/meminfo``, at most the cgroup's
    ``memory.max - memory.current`` (cgroup v2) or ``limit_in_bytes -
    usage_in_bytes`` (v1). Elsewhere: free physical pages (``SC_AVPHYS_PAGES``).
    """
    available = _meminfo_available()
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _meminfo_available() -> int | None:
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024   # the file counts kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            text = (_CGROUP / limit).read_text().strip()
            if text == "max":
                return None
            return max(int(text) - int((_CGROUP / usage).read_text()), 0)
        except (OSError, ValueError):
            continue
    return None


def arena_row_bytes(schema: Schema) -> int:
    """Bytes one arena row takes up front: its fields (an encoded one's address) plus `ROW_OVERHEAD`."""
    return schema.stored_bytes + ROW_OVERHEAD


def check_arena(schema: Schema, capacity: int) -> None:
    """Refuse an arena of ``capacity`` rows of ``schema`` that cannot fit in memory.

    Raises:
        ResourceError: naming the capacity, the row bytes, the bytes needed and
            available, and the largest capacity that fits.
    """
    row = arena_row_bytes(schema)
    needed = capacity * row
    available = available_memory()
    if available is None or needed <= available:
        return
    raise ResourceError(
        f"capacity={capacity:,} rows of {row:,} bytes ({schema.stored_bytes:,} of fields + {ROW_OVERHEAD} of index) "
        f"need {_size(needed)}, but {_size(available)} of memory are available; use capacity <= "
        f"{available // row:,}, smaller rows (uint8 pixels, bfloat16), or a Ray store whose shards "
        "spread the capacity over several nodes")


def draw_steps(sampler: Sampler, table: EpisodeTable | None) -> int:
    """Rows each drawn item gathers: a sequence's length, the longest episode (1 when
    the table is not at hand: a Ray driver's), or 1."""
    if isinstance(sampler, SequenceSampler):
        return sampler.seq_len
    if isinstance(sampler, EpisodeSampler) and table is not None:
        return max(table.longest, 1)
    return 1


def batch_bytes(schema: Schema, items: int, frame_stack: int = 1) -> int:
    """Bytes a sample of ``items`` gathered rows takes: fields at t, ``next``
    observations, frame stacks on both, and the per-draw index arrays."""
    frames = frame_stack * (2 * schema.observation_bytes + FRAME_OVERHEAD)
    return items * (schema.field_bytes - schema.observation_bytes + frames + DRAW_OVERHEAD)


def check_batch(schema: Schema, sampler: Sampler, table: EpisodeTable | None, batch_size: int,
                frame_stack: int = 1) -> None:
    """Refuse a sample whose batch cannot be allocated, before anything is drawn.

    Raises:
        ResourceError: naming the batch size, the bytes needed and available.
    """
    items = batch_size * draw_steps(sampler, table)
    # An upper bound first, without reading /proc: the usual small batch stops here.
    if items * frame_stack * (2 * schema.field_bytes + FRAME_OVERHEAD + DRAW_OVERHEAD) < SMALL_BATCH_BYTES:
        return
    needed = batch_bytes(schema, items, frame_stack)
    available = available_memory()
    if available is None or needed <= available:
        return
    per_item = max(needed // items, 1)
    raise ResourceError(
        f"batch_size={batch_size:,} needs {_size(needed)} ({items:,} rows of ~{per_item:,} bytes with next "
        f"observations, frame_stack={frame_stack} and index arrays), but {_size(available)} of memory are "
        f"available; sample at most ~{available // per_item // max(items // batch_size, 1):,} at a time "
        "(iter_batches splits an epoch into batches)")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"
