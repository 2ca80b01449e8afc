"""`BlockCache`: the blocks a reader fetched, least recently used first, within a byte bound.

What a cached block holds is its columns (zero-copy views of the object store on
its node, or this process's copies with ``RayOptions.copy_blocks``) and what the
reader derives from them and keeps with them: the packed records of its small step
fields (`arrowbuf.ray.block_reads.BlockReads.block_records`, about as many bytes as those
fields), counted when they are built (`BlockCache.grew`), so the bound
``RayOptions.reader_cache_bytes`` holds for both.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from arrowbuf.ray.apart import own_copy
from arrowbuf.ray.blocks import BlockInfo, block_value
from arrowbuf.ray.options import ray_module


class BlockCache:
    """Fetched blocks by `BlockInfo.key`, least recently used first, within ``limit`` bytes
    (None: unbounded); ``copy``: keep copies in this process's memory."""

    def __init__(self, limit: int | None, copy: bool) -> None:
        self.limit = limit
        self.copy = copy
        self.entries: OrderedDict[Any, tuple[dict, int]] = OrderedDict()   # key -> (columns, bytes)
        self.nbytes = 0
        self.fetches = 0
        self._key_of: dict[int, Any] = {}   # id of a cached block's columns dict -> its key

    def columns(self, blocks: list[tuple[Any, BlockInfo]], keep: set) -> list[dict]:
        """The columns of each of ``blocks`` ((`BlockInfo.key`, block) pairs), fetched now
        where not cached; blocks in ``keep`` are not dropped."""
        return [self._get(key, block, keep) for key, block in blocks]

    def _get(self, key: Any, block: BlockInfo, keep: set) -> dict:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry[0]
        value = block_value(block, ray_module().get(block.ref))
        if self.copy:   # what a block from another node is: this process's own memory
            value = {name: own_copy(column) for name, column in value.items()}
        self.fetches += 1
        self.entries[key] = (value, block.nbytes)
        self._key_of[id(value)] = key
        self.nbytes += block.nbytes
        self._shrink(keep | {key})
        return value

    def grew(self, columns: dict, nbytes: int) -> None:
        """``nbytes`` more kept in a cached block's ``columns`` dict (records derived from
        it): counted, and other blocks dropped as the bound needs. A block no longer
        cached is left alone (what was derived goes with its last user)."""
        key = self._key_of.get(id(columns))
        entry = self.entries.get(key) if key is not None else None
        if entry is None or entry[0] is not columns:
            return
        self.entries[key] = (columns, entry[1] + nbytes)
        self.nbytes += nbytes
        self._shrink({key})

    def retain(self, keys: set) -> None:
        """Drop every block whose `BlockInfo.key` is not in ``keys`` (no manifest lists it any more)."""
        for key in [k for k in self.entries if k not in keys]:
            self._drop(key)

    def clear(self) -> None:
        self.entries.clear()
        self._key_of.clear()
        self.nbytes = 0

    def _shrink(self, keep: set) -> None:
        if self.limit is None:
            return
        for cached in list(self.entries):
            if self.nbytes <= self.limit:
                break
            if cached not in keep:
                self._drop(cached)

    def _drop(self, key: Any) -> None:
        columns, nbytes = self.entries.pop(key)
        self._key_of.pop(id(columns), None)
        self.nbytes -= nbytes
