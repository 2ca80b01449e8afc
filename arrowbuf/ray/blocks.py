"""`BlockRing`: a shard actor's rows published as sealed blocks in Ray's object store.

A block holds whole episodes: one numpy array per field (the episodes' rows, back
to back), and beside it, as a small object of its own, the episodes' chunk of the
episode table (their ids, indices, lengths, flags; ``first_row`` counted inside the
block). It is put into the object store once (`ray.put` by the shard actor, or
by a writer: lent blocks, below) and never changes: every process on a node
reads it without a copy, Ray moves it across nodes once, and reference
counting frees it when the shard dropped it and no reader holds it any more. A
reader gathering from a block can therefore never see torn or overwritten rows.

*Lent blocks.* A writer in the process that started the shard actors puts an
episode of at least ``block_bytes / 8`` once, in a block's layout
(`block_columns`), and sends the ObjectRef instead of the rows; the shard reads
the rows from that object without a copy, and at the next seal the object
itself becomes the episode's block (`lend`), its one-episode chunk carried
inline in the manifest (a ``ray.put`` of it cost ~1 ms of the write).
The lent episodes of one write request are put together, as one object that
is a list of their rows: each becomes a block of its own that names its item
(`BlockInfo.part`), and the object is freed once none of those blocks is left.
Its owner is the writer's process: Ray frees an object when its owner dies, and
non-detached shard actors die with the process that started them, so such an
object outlives every block made of it. Writers in other processes (tasks,
attached stores) send rows as call arguments, and their shard copies them into
blocks, as it copies episodes below ``block_bytes / 8`` (merged with others).

The shard keeps its arena (`ShardEngine`) as well: it serves reads by index,
checkpoints, exports and `compute_gae`'s rewrites, and copied blocks are cut
from it. A lent episode's rows enter the arena only when the shard first reads
it (`arrowbuf.ray.lent`), not on the write's path: measured on W2 episodes (10.6
MB, 2 shards, 2 cores), the shard's part of an `add_episode` fell from ~4.3 ms
(0.6 reading the lent object, 1.5 copying it into the arena, 2.1 sealing with a
chunk put) to ~1.2 ms. Reading PER, logs and checkpoints from sealed objects
instead would rebuild the engine over immutable blocks. The price is that the
ring is held twice once it is filled: in the arena and in the object store (see
docs/ray.md).

Episodes written since the last seal are *open*. They are sealed into a new
block when they reach ``RayOptions.block_bytes``, or once the oldest has waited
``RayOptions.seal_latency`` (checked at each write and each reader's manifest
poll), or at once by `seal` (``store.flush()``). Blocks sealed early are small:
a new seal absorbs the newest block while that one is smaller than
``block_bytes / 8`` and than the new rows, so a slow writer leaves O(log) small
blocks, and each row is copied O(log) times at most. Once no write came for
``seal_latency``, the next manifest request compacts the small copied blocks
(below ``block_bytes / 2``) into blocks of up to ``block_bytes`` (a batch costs
one ``np.take`` per field and block it touches); a request its caller waits for
(one that seals: `flush`) never compacts. Lent blocks are left as they are:
compacting them copied every lent episode twice in the shard (into its arena,
then into a merged block), on the cores the writers and readers use, after every
burst of writes. Measured on W2 (2 shards, 2 cores): `sample_iter` ran alike from
38 lent blocks (6,400-6,700 batches/s) and from the 8 compacted ones (5,500-6,300),
a plain `sample()` ~12% slower (3,900-4,150 against 4,550-4,600); a W2 sample race
right after writes ran at 0.52-0.72x the embedded store while the shards compacted.

Eviction drops a block's reference once every episode in it is evicted. The
*manifest* names the blocks and the first live episode; its version changes at
each seal and `clear`, and its token at each start of the actor (a restarted
shard publishes its blocks anew).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from arrowbuf._version_spans import VERSION, episode_bounds
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import ResourceError
from arrowbuf.ray.apart import stored_concat
from arrowbuf.ray.options import ray_module
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode, position_runs
from arrowbuf.table import EpisodeTable

#: A seal absorbs the newest block while that one is below ``block_bytes / 8`` and at
#: most this many times the rows being sealed (a binary counter): at most
#: log2(block_bytes / 8 / rows per seal) merges per row, and blocks of W2 rows (a
#: tick's rows already above 8 MiB) are never merged. Every copy is paid by writes (a
#: factor of 4 here copied each W1 row ~2.5 times); the read side gets its few large
#: blocks from `BlockRing.compact` instead, at idle or every 50 ``seal_latency``.
MERGE = 1
#: The episode-table columns a block carries (those of a table without sampler counters).
CHUNK_COLUMNS = tuple(EpisodeTable().state_dict()["columns"])
#: What a chunk adds when its block has a policy_version column (`arrowbuf._version_spans.episode_bounds`).
VERSION_CHUNK = ("version_low", "version_high", "version_sorted")


@dataclass(frozen=True)
class BlockInfo:
    """What a manifest says of one block (the block itself stays in the object store)."""

    ref: Any                 # ObjectRef of the rows: {field: array}
    # The episodes' table chunk {column: array per episode}: an ObjectRef of it, or the
    # chunk itself for a lent block (one episode: smaller than a ref's round trip).
    episodes: Any
    first_serial: int        # serial (0, 1, ... per shard) of its first episode
    num_episodes: int
    num_rows: int
    nbytes: int
    # A lent block whose writer put several episodes as one object (a list of their
    # rows, each in a block's layout): which of them this block is; None: the whole object.
    part: int | None = None
    # A writer's object (`BlockRing.lend`), not cut from the shard's arena: never compacted.
    lent: bool = False

    @property
    def key(self) -> Any:
        """What names this block (readers cache by it): its ref, with its part if it has one."""
        return self.ref if self.part is None else (self.ref, self.part)


def block_value(block: BlockInfo, value: Any) -> dict[str, np.ndarray]:
    """The block's columns from ``value``, the object its ref names (the part it is of a shared one)."""
    return value if block.part is None else value[block.part]


@dataclass(frozen=True)
class Manifest:
    """A shard's published blocks, oldest first, and which of their episodes are live."""

    token: str               # this actor's publication (a restarted actor has another)
    version: int             # changes at each seal and clear
    blocks: tuple[BlockInfo, ...]
    first_live_serial: int   # episodes before it are evicted (their blocks may still be listed)
    stop_serial: int         # serial after the newest sealed episode
    stop_index: int           # index after its last transition
    draws_here: bool         # readers may draw themselves (no limiter, no per-row state)


class BlockRing:
    """The blocks of one shard (see the module docstring).

    Args:
        block_bytes: a block is sealed once its open rows reach this size.
        seal_latency: seconds an open episode may wait before it is sealed.
        draws_here: readers may draw from the blocks themselves (told in the manifest).
    """

    def __init__(self, block_bytes: int, seal_latency: float, draws_here: bool) -> None:
        self.block_bytes = block_bytes
        self.seal_latency = seal_latency
        self.draws_here = draws_here
        self.token = uuid.uuid4().hex
        self.version = 0
        self.blocks: list[BlockInfo] = []
        self._sealed_serial = 0        # serial of the first open episode
        self._open_since: float | None = None
        self._open_bytes = 0
        self._written = -np.inf          # when the last write came (compaction waits for a pause)
        self._compacted = -1             # the version last compacted, and when
        self._compacted_at = -np.inf
        self._lent: dict[int, tuple] = {}   # open serial -> (writer's object, part, bytes, versions)

    @property
    def nbytes(self) -> int:
        """Bytes of the listed blocks (what this shard keeps in the object store)."""
        return sum(b.nbytes for b in self.blocks)

    def resume(self, engine: ShardEngine) -> None:
        """Start publishing an engine that already holds episodes (loaded, recovered): they are open."""
        table = engine.table
        self._sealed_serial = table.episodes_added - len(table)
        if len(table):
            self._open_since = time.monotonic() - self.seal_latency   # due at once
            self._open_bytes = self.block_bytes   # sealed in full blocks

    def lend(self, serial: int, ref: Any, nbytes: int, part: int | None = None, versions: Any = None) -> None:
        """The episode of ``serial``, just written, is to be sealed as its own block: the object
        ``ref`` (or its item ``part``, when its writer put several episodes at once) of ``nbytes``
        bytes that its writer put in a block's layout (`block_columns`), without a copy;
        ``versions``: its policy_version column (a view of that object), if it has one.
        Call under the engine's lock, in the hold that wrote it."""
        self._lent[serial] = (ref, part, nbytes, versions)

    def added(self, engine: ShardEngine, nbytes: int) -> None:
        """After a write of ``nbytes`` (under the engine's lock): drop evicted blocks, seal what is due."""
        self._written = time.monotonic()
        if self._open_since is None:
            self._open_since = self._written
        self._open_bytes += nbytes
        self._drop_evicted(engine.table)
        if self._open_bytes >= self.block_bytes or self.due():
            self.seal(engine)

    def due(self) -> bool:
        """Open episodes have waited ``seal_latency``."""
        return self._open_since is not None and time.monotonic() - self._open_since >= self.seal_latency

    def republish(self, engine: ShardEngine) -> None:
        """Rows changed in place (`compute_gae`'s derived columns): every block is sealed
        again from the arena (readers holding the old ones keep them until their next manifest)."""
        table = engine.table
        self.blocks = []
        self._sealed_serial = table.episodes_added - len(table)
        self._open_since, self._open_bytes, self._lent = None, 0, {}   # the writers' objects lack the new columns
        if len(table):
            self._open_since = time.monotonic()
            self.seal(engine)
        else:
            self.version += 1

    def evicted(self, engine: ShardEngine) -> None:
        """The engine freed its oldest episodes (`ShardEngine.evict`): blocks left without
        a live episode are dropped, and readers told (a new version: their next manifest
        starts at the new first live episode)."""
        self._drop_evicted(engine.table)
        self.version += 1

    def clear(self) -> None:
        """The engine was cleared: every block is dropped."""
        self.blocks = []
        self._open_since, self._open_bytes, self._lent = None, 0, {}
        self.version += 1

    def seal(self, engine: ShardEngine) -> None:
        """Put the open episodes into blocks (absorbing small newest blocks); call under the engine's lock.

        A lent episode (`lend`) becomes a block of its own, its writer's
        object; the runs of open episodes between lent ones are copied from the arena.
        """
        table = engine.table
        first_live = table.episodes_added - len(table)
        self._drop_evicted(table)
        start = max(self._sealed_serial, first_live)
        stop = table.episodes_added
        lent, self._lent = self._lent, {}
        self._open_since, self._open_bytes = None, 0
        if start >= stop:
            if self._sealed_serial != stop:
                self._sealed_serial = stop
                self.version += 1
            return
        run = start
        for serial in sorted(k for k in lent if start <= k < stop):
            if run < serial:
                self._seal_copies(engine, run, serial, first_live)
            ref, part, nbytes, versions = lent[serial]
            position = serial - first_live
            episodes = _chunk(table, position, position + 1, versions)
            # Its chunk (one episode) travels inline in the manifest: a put costs ~1 ms of the write.
            self.blocks.append(BlockInfo(ref, episodes, serial, 1, int(table.col("num_rows")[position]), nbytes,
                                         part, lent=True))
            run = serial + 1
        if run < stop:
            self._seal_copies(engine, run, stop, first_live)
        self._sealed_serial = stop
        self.version += 1

    def _seal_copies(self, engine: ShardEngine, start: int, stop: int, first_live: int) -> None:
        """Blocks of serials [start, stop), copied from the arena (absorbing small newest blocks)."""
        sizes = _episode_bytes(engine, start - first_live, stop - first_live)
        new_bytes = int(sizes.sum())
        while self.blocks:
            last = self.blocks[-1]
            if last.nbytes >= self.block_bytes // 8 or last.nbytes > MERGE * new_bytes \
                    or last.first_serial < first_live \
                    or last.first_serial + last.num_episodes != start:
                break
            self.blocks.pop()
            start, new_bytes = last.first_serial, new_bytes + last.nbytes
            sizes = _episode_bytes(engine, start - first_live, stop - first_live)
        at = start
        while start < stop:   # full blocks first when much is open (a resumed engine)
            end = self._block_end(sizes[start - at:stop - at]) + start
            self.blocks.append(_put_block(engine, start - first_live, end - first_live, start))
            start = end

    def _block_end(self, sizes: np.ndarray) -> int:
        """How many of the episodes of ``sizes`` (bytes each) fill about one block (at least one)."""
        return min(len(sizes), 1 + int(np.searchsorted(np.cumsum(sizes), self.block_bytes, side="left")))

    def _drop_evicted(self, table: EpisodeTable) -> None:
        first_live = table.episodes_added - len(table)
        gone = 0
        while gone < len(self.blocks) and \
                self.blocks[gone].first_serial + self.blocks[gone].num_episodes <= first_live:
            gone += 1
        if gone:
            del self.blocks[:gone]

    def compact(self, engine: ShardEngine) -> None:
        """Merge runs of adjacent small blocks into blocks of up to ``block_bytes`` (the
        oldest one without its evicted episodes), once the shard is idle (no open
        episodes, no write for ``seal_latency``) or at most every 50 ``seal_latency``
        while writes go on; call under the engine's lock. Lent blocks are never merged,
        so every merged row was cut from the arena and is there: a lent episode's rows
        need not be copied into it (`arrowbuf.ray.lent`)."""
        if not self.compaction_due():
            return
        self._compacted, self._compacted_at = self.version, time.monotonic()
        table = engine.table
        first_live = table.episodes_added - len(table)
        merged, run = [], []

        def close_run() -> None:
            # The oldest block, partly evicted, is rewritten with its live episodes only.
            if len(run) > 1:
                a = max(run[0].first_serial, first_live)
                b = run[-1].first_serial + run[-1].num_episodes
                merged.append(_put_block(engine, a - first_live, b - first_live, a))
            else:
                merged.extend(run)
            run.clear()

        row_bytes = engine.schema.field_bytes
        for block in self.blocks:
            live = block.nbytes
            if block.first_serial < first_live:   # its evicted episodes would not be copied
                rows = table.col("num_rows")[:block.first_serial + block.num_episodes - first_live]
                live = int(rows.sum()) * row_bytes
            small = live < self.block_bytes // 2 and not block.lent
            if not small or (run and sum(b.nbytes for b in run) + live > self.block_bytes):
                close_run()
            if small:
                run.append(block)
            else:
                merged.append(block)
        close_run()
        if [b.key for b in merged] != [b.key for b in self.blocks]:
            self.blocks = merged
            self.version += 1
            self._compacted = self.version

    def compaction_due(self) -> bool:
        """Whether `compact` would look for blocks to merge now (it copies from the arena)."""
        now = time.monotonic()
        idle = self._open_since is None and now - self._written >= self.seal_latency
        return self._compacted != self.version and (idle or now - self._compacted_at >= 50 * self.seal_latency)

    def manifest(self, engine: ShardEngine) -> Manifest:
        """The current manifest (call under the engine's lock)."""
        table = engine.table
        first_live = table.episodes_added - len(table)
        stop = self._sealed_serial
        if len(table) and stop > first_live:
            position = stop - first_live - 1
            stop_index = int(table.col("first_index")[position] + table.col("length")[position])
        else:
            stop_index = table.live_range()[0]
        return Manifest(self.token, self.version, tuple(self.blocks), first_live, stop, stop_index,
                        self.draws_here)


def _episode_bytes(engine: ShardEngine, a: int, b: int) -> np.ndarray:
    """Bytes of each live episode at positions [a, b): its rows of the fixed-size fields, and the
    values of its ragged fields (a ragged field's row has no fixed size: its heap's sizes)."""
    table = engine.table
    num_rows = table.col("num_rows")[a:b].astype(np.int64)
    sizes = num_rows * engine.schema.field_bytes
    heaps = [engine.shard.arena[name] for name, f in engine.schema.fields.items() if f.ragged]
    if heaps and len(num_rows):
        ends = np.cumsum(num_rows)
        rows = np.repeat(table.col("first_row")[a:b] - (ends - num_rows), num_rows) + np.arange(int(ends[-1]))
        for column in heaps:
            sizes = sizes + np.add.reduceat(column.size[rows], ends - num_rows)
    return sizes


def _put_block(engine: ShardEngine, a: int, b: int, first_serial: int) -> BlockInfo:
    """Put the live episodes at positions [a, b) of the engine's table into the object store."""
    shard, table = engine.shard, engine.table
    first_row, num_rows = table.col("first_row")[a:b], table.col("num_rows")[a:b]
    runs = position_runs(first_row, num_rows)
    columns = {}
    for name in shard.schema.fields:   # numpy views of a host arena (a device arena's are copies)
        # Encoded, ragged and text fields' rows as stored (`EncodedRows`, `RaggedRows`, dictionary
        # arrays): readers decode or gather them apart (`arrowbuf.ray.apart`).
        parts = [shard.stored_rows(name, int(first_row[i]), int(first_row[j - 1] + num_rows[j - 1])) for i, j in runs]
        columns[name] = stored_concat(parts)   # ray.put copies once
    ray = ray_module()
    return BlockInfo(ray.put(columns), ray.put(_chunk(table, a, b, columns.get(VERSION))), first_serial, b - a, int(num_rows.sum()),
                     sum(c.nbytes for c in columns.values()))


def _chunk(table: EpisodeTable, a: int, b: int, versions: Any = None) -> dict[str, np.ndarray]:
    """The episode-table chunk of positions [a, b): ``first_row`` counted inside their block;
    with the block's ``versions`` column, each episode's least and greatest policy version
    and whether they are non-decreasing (`VERSION_CHUNK`: readers draw fresh steps by them)."""
    episodes = {name: table.col(name)[a:b].copy() for name in CHUNK_COLUMNS}
    num_rows = episodes["num_rows"]
    episodes["first_row"] = np.cumsum(num_rows) - num_rows
    if versions is not None:
        bounds = episode_bounds(episodes["first_row"], episodes["length"], versions)
        episodes.update(zip(VERSION_CHUNK, bounds))
    return episodes


def block_columns(episode: Episode, schema: Schema) -> dict[str, np.ndarray] | None:
    """A checked episode's rows laid out as a block's (`_put_block`'s: every field of the
    schema, ``num_rows`` rows of its stored dtype, a step field beside a final observation
    padded with a zero row, as the arena pads it), or None when it would need a
    conversion (a derived field, another dtype, not numpy): such an episode is copied by
    its shard instead. Only small step fields are copied; observations are the episode's."""
    if len(episode.columns) != len(schema.fields) or \
            any(f.codec is not None or f.ragged or f.text for f in schema.fields.values()):
        return None   # (an encoded field's rows are encoded by the shard; ragged and text rows are its columns')
    rows = episode.num_rows
    columns = {}
    for name, spec in schema.fields.items():
        data = episode.columns.get(name)
        if type(data) is not np.ndarray or data.dtype != spec.numpy_dtype or data.shape[1:] != spec.shape:
            return None
        if len(data) < rows:
            padded = np.zeros((rows, *spec.shape), data.dtype)
            padded[:len(data)] = data
            data = padded
        columns[name] = data
    return columns


def lent_episode(episode: Episode, columns: dict[str, np.ndarray], schema: Schema) -> Episode:
    """The shard's side of `block_columns`: the episode (sent without its columns) whose
    rows are ``columns``, the writer's object read without a copy, the padding rows of
    its step fields cut off again (``schema``: the writer's)."""
    if episode.has_final:
        columns = {name: data if schema.fields[name].observation else data[:episode.num_steps]
                   for name, data in columns.items()}
    return dataclasses.replace(episode, columns=columns)


def block_fits(columns: dict[str, np.ndarray], rows: int, schema: Schema) -> bool:
    """Whether ``columns`` (a writer's `block_columns`) can be a block of a shard of ``schema``
    (which may have gained derived fields since the writer's schema)."""
    return len(columns) == len(schema.fields) and all(
        (data := columns.get(name)) is not None and data.dtype == spec.numpy_dtype and data.shape == (rows, *spec.shape)
        for name, spec in schema.fields.items())


def check_object_store(rows: int, schema: Schema) -> None:
    """Refuse a store whose full ring of ``rows`` rows exceeds the cluster's object store:
    its shards keep every live row in sealed blocks there.

    Raises:
        ResourceError: naming the bytes of the ring and of the object store, and the fix.
    """
    ring = rows * schema.stored_bytes
    store = ray_module().cluster_resources().get("object_store_memory")
    if store is not None and ring > store:
        raise ResourceError(
            f"a full store of {rows:,} rows of {schema.stored_bytes:,} bytes keeps {ring / 2**30:,.2f} GiB of "
            f"sealed blocks in Ray's object store, which holds {store / 2**30:,.2f} GiB: use a smaller "
            "capacity, or start Ray with a larger object_store_memory")
