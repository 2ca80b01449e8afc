"""Resident memory of memory-mapped files: what sampling a dataset's cache keeps in this process.

Reading a mapped page makes it resident in the process (and the pages around it: `FAULT_AROUND`).
`madvise` tells the kernel how a mapping is read (``MADV_RANDOM``: no readahead) and drops its
pages from the resident set (``MADV_DONTNEED``: they stay in the page cache); `file_resident`
reads how many file-backed bytes are resident; `ResidentBound` drops a dataset's mappings
(`arrowbuf._dataset_cache.MappedRows.release`) before sampling makes them hold more than a limit.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any, Protocol

import pyarrow as pa

#: Bytes one read fault of a file mapping can make resident: Linux maps the cached pages
#: around the faulting one too (``fault_around_bytes``, 64 KiB by default). Measured here:
#: 1,280 reads of single random bytes of a 1.5 GB mapping grew RSS by 90 MB, 69 KB a read
#: (with or without ``MADV_RANDOM``).
FAULT_AROUND = 64 << 10


def file_resident() -> int | None:
    """Bytes of file-backed (and shared) pages resident in this process (``/proc/self/statm``);
    None where that cannot be read (not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[2]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return None


class Mapped(Protocol):
    """Mapped files whose pages `release` drops from the resident set
    (`arrowbuf._dataset_cache.MappedRows`)."""

    def release(self) -> None: ...


class ResidentBound:
    """Keeps the pages sampling maps from `arrowbuf._dataset_cache.MappedRows` near ``limit`` resident bytes.

    Each gathered row may make ``row_cost`` bytes resident: a first guess, raised to what
    is measured. Reading the process's file-backed resident bytes (`file_resident`) costs
    ~10 us, so it is read only once the rows counted since the last reading could have
    used half the room left: ``rows x row_cost >= (limit - grown) / 2``. At each reading
    the bytes a row made resident since the last one raise ``row_cost`` (a fault maps more
    than the faulting page: `FAULT_AROUND`, and a whole large folio of the page cache where
    the kernel keeps them: ~120-200 KB a fault was seen on a 28 GB mapping), and when the
    rows of one more batch like the last could pass ``limit``, the mapping is dropped
    (`MappedRows.release`). Without `file_resident`, each time the rows counted reach the
    limit at ``row_cost`` (more releases than needed, never fewer, if the guess holds).
    """

    def __init__(self, rows: Mapped, limit: int, row_cost: int) -> None:
        self.rows, self.limit, self.row_cost = rows, limit, row_cost
        self.baseline = file_resident()
        self.grown = 0        # resident growth at the last reading
        self.counted = 0      # rows gathered since it
        self.room = limit // 4   # the first guess may be low: read early

    def touched(self, count: int) -> None:
        """Count ``count`` gathered rows; release the mapping before it holds ``limit`` bytes."""
        self.counted += count
        if self.counted * self.row_cost < self.room:
            return
        now = file_resident()
        if now is None or self.baseline is None:
            if self.counted * self.row_cost >= self.limit:
                self.release()
            else:
                self.room = self.limit
            return
        grown = now - self.baseline
        self.row_cost = max(self.row_cost, (grown - self.grown) // self.counted)
        self.grown, self.counted = grown, 0
        if grown + count * self.row_cost >= self.limit:
            self.release()
        else:
            self.room = (self.limit - grown) // 2

    def release(self) -> None:
        self.rows.release()
        self.baseline = file_resident()
        self.grown = self.counted = 0
        self.room = self.limit // 2


def madvise(buffer: pa.Buffer, advice: int) -> None:
    """``madvise`` the pages of a mapped ``buffer`` (Linux; a no-op elsewhere): 1 ``MADV_RANDOM``,
    4 ``MADV_DONTNEED``."""
    if not sys.platform.startswith("linux") or not buffer.size:
        return
    page = mmap.PAGESIZE
    start = buffer.address - buffer.address % page
    length = buffer.address + buffer.size - start
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return _LIBC
