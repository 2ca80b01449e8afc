"""`BlockReads`: the items of one or several batches, planned block by block before they are gathered.

A reader's draw picks items of several sealed blocks (of one or several shards),
in an order that must survive the gather: a batch's items come in the order the
sampler drew them, so that any slice of a uniform batch is itself uniform (a
trainer splitting a batch must not get sub-batches of the oldest rows). Blocks
are separate buffers, so each field is read block by block:

- `part_reads` looks up, for one part of a batch (one view's selection), its
  extras in drawn order (index, episode_id, step, n-step targets) and its view's
  rows by role (step, observation, next observation), across an episode's pieces
  as a local store does (`arrowbuf.indexing.look_ahead`);
- `block_order` sorts a selection's items by block (``order``) and says where each
  touched block's items start and stop in that order (items whose rows lie in
  several blocks last, read from a block of their own rows: `arrowbuf.ray.across`),
  and `block_rows` makes their rows block-local, in block order;
- `order_reads` orders every part of one or several batches (parts of several shards
  padded to one width first: `same_width`) into a `BlockReads`: the blocks' columns
  with the ranges of ordered items they hold, the rows, the extras in batch order,
  and ``inv`` (batch position -> ordered position) where the two orders differ;
- `BlockReads.fill` reads the items of one batch (or of several gathered together)
  into the views of a pooled slot, as `arrowbuf.ray.gather.BlockGather` laid it out.

`arrowbuf.ray.gather.BlockGather` then reads each field block by block into a
scratch array (ordered order; once for all the ordered batches) and takes it into
each batch's pooled output by ``inv``: per field, one take per touched block and
one per batch, instead of a take and a scatter per block and batch. Where the
orders agree (one block, or an unshuffled epoch chunk) the blocks are read
straight into the output. Large rows (`ROWWISE_BYTES`) of plain items are
copied straight from their blocks into the output too, row by row (`rows_into`):
there the second copy through the scratch costs more than a Python step per row.
Small per-step fields are ordered together as one record a row (`records_of`,
from records each block packs once: `block_records`), one take per block for all
of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from arrowbuf.indexing import look_ahead
from arrowbuf.ray.across import JoinedItems, ViewRows, crossing
from arrowbuf.sample_args import SampleArgs
from arrowbuf.samplers import Selection

#: Bytes of a row from which a batch's rows of a field are copied straight from their
#: blocks into the output (`BlockReads.rows_into`), rather than read into the scratch
#: array and taken from it (two copies). Measured here (numpy blocks of 400 MB in all,
#: 8 blocks, 6 batches of 32 random items ordered at once, each item's row and next
#: row, 2 shared cores; one concatenate of row views per field), per batch: rows of
#: 8 KiB 78 us through the scratch, 86 us straight; rows of 21 KiB (W2's 84x84x3
#: pixels) 157 us through the scratch, 121 us straight. Item by item (an item's row,
#: then its next row: one run of the block) was faster again on a Ray store's blocks:
#: 186 us a W2 batch with its draw, against 239 us by concatenates (the embedded
#: store's sample: 170 us).
ROWWISE_BYTES = 16 << 10

#: Bytes of batches `sample_iter` draws and orders at once when its draws are made
#: here (at most `MAX_READ_BATCHES` batches): one draw, one block plan and one read of
#: each field per block for all of them; each batch is then one take per field from
#: the ordered rows. Measured per batch (2 shared cores under other load, 2 shards,
#: best of 30 runs): W1 (200k rows, ~45 KB batches) 97 us one batch at a time, 61
#: four, 53 eight, 46 sixteen (the embedded store's sample: 41 us); W2 (20k pixel
#: rows, 1.35 MB batches, all through the scratch then) 262 us one, 230 four, 209
#: six, 297 eight (the ordered rows no longer stay in cache; the embedded store:
#: 121-145 us). Only the fields read through the scratch count
#: (`arrowbuf.ray.gather.BlockGather.sizes`): rows copied straight from the
#: blocks (`ROWWISE_BYTES`, W2's pixels) go through no scratch, so W2 now draws 16
#: batches at once (~450 B of scratch each).
READ_BYTES = 8 << 20
MAX_READ_BATCHES = 16


@dataclass
class BlockReads:
    """Items of one or several batches, ready to gather (see the module docstring).

    ``pieces`` hold, per touched block, its columns and the ordered range ``[lo, hi)``
    of its items; ``rows`` the block-local rows of every ordered item by role (step,
    observation, next observation; observation rows with a trailing frame axis);
    ``extra`` the per-item arrays in batch order; ``inv`` the ordered position of each
    batch position (None: the same order). ``scratch`` is the caller's reusable
    store of ordered field arrays (by field and role), ``filled`` those this ordering
    has filled; ``drawn`` what each batch counts as samples of each shard, when the
    reader drew the items (the shards count what they draw themselves).
    """

    pieces: list[tuple[Mapping[str, np.ndarray], int, int]]
    rows: tuple[np.ndarray, np.ndarray, np.ndarray]
    extra: dict[str, np.ndarray]
    inv: np.ndarray | None
    size: int
    item: tuple[int, ...]              # shape of one item's rows: () or (L,) for windows and episodes
    frames: int
    scratch: dict = field(default_factory=dict)
    filled: set = field(default_factory=set)
    drawn: np.ndarray | None = None    # items of each shard in each batch, [batches, shards] (a reader's draws)
    # (piece of each item in batch order, its block-local rows by role in batch order, each
    # piece's bytes of a column by column), for `rows_into`
    _where: tuple[list, dict, dict] | None = None
    # told (block's columns, bytes) when records are kept in a block's dict: the reader's
    # cache counts them against its bound (`arrowbuf.ray.cache.BlockCache.grew`)
    grown: Callable[[dict, int], None] | None = None

    def fill(self, layout: Any, outs: list[np.ndarray], start: int, stop: int) -> None:
        """Gather the ordered items ``[start, stop)`` into a slot's views, as ``layout`` (an
        `arrowbuf.layout.Layout` of `arrowbuf.ray.gather.BlockGather`'s) says: per field,
        its source and role (``plan``), how it is read (``fill[0]``: "take" through the
        scratch, "rowwise" row by row, "packed" in records), and the records' regions."""
        extra = self.extra
        inv = None if self.inv is None else self.inv[start:stop]
        direct = []
        for (source, role), how, out in zip(layout.plan, layout.fill[0], outs):
            if role < 0:
                # Same dtype and shape (`arrowbuf.layout.matches`): an item assignment, cheaper than np.copyto.
                out[...] = extra[source][start:stop]
            elif how == "packed":
                continue
            elif inv is None:
                rows = self.rows[role]
                for columns, lo, hi in self.pieces:
                    lo, hi = max(lo, start), min(hi, stop)
                    if lo < hi:
                        columns[source].take(rows[lo:hi], 0, out[lo - start:hi - start], "clip")
            elif how == "rowwise":
                direct.append((source, role, out))
            else:
                self.rows_of(source, role).take(inv, 0, out, "clip")
        if direct:
            self.rows_into(direct, start, stop)
        for group, _, region in layout.records:   # the small step fields, packed in records
            records = outs[region]
            if inv is None:
                rows = self.rows[0]
                for columns, lo, hi in self.pieces:
                    lo, hi = max(lo, start), min(hi, stop)
                    if lo < hi:
                        self.block_records(columns, group).take(rows[lo:hi], 0, records[lo - start:hi - start],
                                                                "clip")
            else:
                self.records_of(group).take(inv, 0, records, "clip")
        for target, source in layout.unpack:
            outs[target][...] = outs[source]

    def rows_of(self, source: str, role: int) -> np.ndarray:
        """Column ``source``'s rows of role ``role`` for every ordered item, in ordered order
        (read block by block on first use, into the scratch array kept for it)."""
        key = (source, role)
        out = self.scratch.get(key)
        if key in self.filled:
            return out
        rows = self.rows[role]
        sample = self.pieces[0][0][source]
        shape = (*rows.shape, *sample.shape[1:])
        if out is None or out.shape != shape or out.dtype != sample.dtype:
            out = self.scratch[key] = np.empty(shape, sample.dtype)
        for columns, lo, hi in self.pieces:
            columns[source].take(rows[lo:hi], axis=0, out=out[lo:hi], mode="clip")
        self.filled.add(key)
        return out

    def records_of(self, group: tuple[int, tuple[tuple[str, int], ...]]) -> np.ndarray:
        """The packed records (``group``: the record's bytes, each field and its byte
        offset) of every ordered item's step row, in ordered order (read block by block
        on first use, into the scratch array kept for them)."""
        key = ("packed", group)
        out = self.scratch.get(key)
        if key in self.filled:
            return out
        rows = self.rows[0]
        blocks = [(self.block_records(columns, group), lo, hi) for columns, lo, hi in self.pieces]
        shape = (*rows.shape, group[0])
        if out is None or out.shape != shape:
            out = self.scratch[key] = np.empty(shape, np.uint8)
        for records, lo, hi in blocks:
            records.take(rows[lo:hi], axis=0, out=out[lo:hi], mode="clip")
        self.filled.add(key)
        return out

    def block_records(self, columns: dict, group: tuple[int, tuple[tuple[str, int], ...]]) -> np.ndarray:
        """A block's fields of ``group`` packed one record a row (`arrowbuf.packing`):
        built on first use and kept in the block's dict (this process's own), so a block
        is packed once while it stays cached, and dropped with it (`grown` is told)."""
        key = ("packed", group)
        records = columns.get(key)
        if records is None:
            record_bytes, offsets = group
            rows = len(columns[offsets[0][0]])
            records = np.empty((rows, record_bytes), np.uint8)
            for name, at in offsets:
                row_bytes = columns[name].reshape(rows, -1).view(np.uint8)
                records[:, at:at + row_bytes.shape[1]] = row_bytes
            columns[key] = records
            if self.grown is not None:
                self.grown(columns, records.nbytes)
        return records

    def rows_into(self, targets: list[tuple[str, int, np.ndarray]], start: int, stop: int) -> None:
        """Copy the rows of batch positions ``[start, stop)`` straight from their blocks:
        for each target (column, role, output), each item's row of that role into the
        output's row of its batch position (plain items: rows of one dimension; see
        `ROWWISE_BYTES`). Item by item, every target's row in turn: an item's
        observation and next observation are adjacent in its block, read as one run.
        Rows are copied as byte slices of memoryviews (`column_bytes`), which cost less
        Python per row than numpy's row indexing."""
        if self._where is None:
            piece = np.repeat(np.arange(len(self.pieces)), [hi - lo for _, lo, hi in self.pieces])
            self._where = ((piece if self.inv is None else piece.take(self.inv)).tolist(), {}, {})
        pieces, by_role, by_source = self._where
        copies = []   # (the column's bytes in each piece, each item's byte offset there, the output's bytes, row bytes)
        for source, role, out in targets:
            rows = by_role.get(role)
            if rows is None:
                rows = by_role[role] = self.rows[role] if self.inv is None else self.rows[role].take(self.inv)
            columns = by_source.get(source)
            if columns is None:   # once per ordering, not per batch: a draw may touch dozens of blocks
                columns = by_source[source] = [self.column_bytes(piece[0], source) for piece in self.pieces]
            size = out.nbytes // len(out) if len(out) else 0
            copies.append((columns, (rows[start:stop] * size).tolist(), memoryview(out.reshape(-1).view(np.uint8)),
                           size))
        for i, p in enumerate(pieces[start:stop]):
            for columns, offsets, out, size in copies:
                at, to = offsets[i], i * size
                out[to:to + size] = columns[p][at:at + size]

    def column_bytes(self, columns: dict, source: str) -> memoryview:
        """A block's column ``source`` as one flat memoryview of its bytes: a view of a
        C-contiguous column (a block's are), else of a contiguous copy, counted as
        `block_records` counts its records; made on first use and kept in the block's dict."""
        key = ("bytes", source)
        view = columns.get(key)
        if view is None:
            column = columns[source]
            flat = np.ascontiguousarray(column)
            view = columns[key] = memoryview(flat.reshape(-1).view(np.uint8))
            if flat is not column and self.grown is not None:
                self.grown(columns, flat.nbytes)
        return view


def block_order(bases: np.ndarray, rows: np.ndarray, across: np.ndarray | None = None
                ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, np.ndarray | None]:
    """Where the items at virtual ``rows`` lie (``bases``: the first virtual row of each block;
    ``across``: items read from a joined block, `arrowbuf.ray.across.JoinedItems`, numbered
    ``len(bases)``, after every block): (the block of each item, None when there is one block;
    the blocks touched; where each one's items start and, last, stop in block order; and
    ``order``, the drawn position of each item in block order, None when they already are
    in block order)."""
    n = len(rows)
    if len(bases) == 1 and across is None:
        return None, np.zeros(1, np.int64), np.array([0, n]), None
    first = rows if rows.ndim == 1 else rows[:, 0]
    if len(bases) == 2 and across is None:   # two blocks (a shard's each, compacted): one comparison, no histogram
        block = (first >= bases[1]).view(np.uint8)
        upper = int(np.count_nonzero(block))
        if upper in (0, n):
            return block, np.array([int(upper > 0)]), np.array([0, n]), None
        order = None if not block[:n - upper].any() else np.argsort(block, kind="stable")
        return block, np.array([0, 1]), np.array([0, n - upper, n]), order
    count = len(bases) + (across is not None)
    # As small ints, the stable argsort below is a radix sort.
    block = (np.searchsorted(bases, first, side="right") - 1).astype(np.int16 if count < 1 << 15 else np.int64)
    if across is not None:
        block[across] = len(bases)
    counts = np.bincount(block, minlength=count)
    touched = np.flatnonzero(counts)
    starts = np.zeros(len(touched) + 1, np.int64)
    np.cumsum(counts.take(touched), out=starts[1:])
    if len(touched) == 1 or (block[1:] >= block[:-1]).all():   # already in order (one block, epochs)
        return block, touched, starts, None
    return block, touched, starts, np.argsort(block, kind="stable")


def placed(value: np.ndarray, where: np.ndarray) -> np.ndarray:
    """``value`` with item k moved to position ``where[k]``."""
    out = np.empty_like(value)
    out[where] = value
    return out


def part_reads(view: Any, selection: Selection, args: SampleArgs, reads: ViewRows | None
               ) -> tuple[dict, tuple[np.ndarray, np.ndarray | None, np.ndarray | None]]:
    """(extras, virtual rows by role: step, observation, next observation) of one view's
    selection, in its order; the observation rows are None where they are the step rows,
    the next ones None where they are the rows after them.

    The look-ups are `arrowbuf.indexing.look_ahead`'s, as a local store's: across an
    episode's held pieces (the view's `arrowbuf.indexing.PieceChains`), in the view's virtual
    rows, read from the blocks that hold them (``reads``; None: no look-up).

    Args:
        view: the `arrowbuf.ray.reader.ShardView` the selection was made in.
        args: the n-step and frame-stack look-ups.
    """
    table = view.table
    rows, pos, step = selection.rows, selection.pos, selection.step
    first = table.col("first_row").take(pos) if step is None or reads is not None else None
    base = view.index_base
    if step is None:   # a sampler's ``step`` is already within the episode (`Selection`); rows are not
        step = rows - first
        if table.pieces:   # the step within its episode of a piece that continues one (`arrowbuf.piece_cutting`)
            step = step + table.col("first_step").take(pos)
    extra = {"index": selection.indices + (base if isinstance(base, int) else base.take(pos)),
             "episode_id": table.col("episode").take(pos), "step": step.astype(np.int32), **selection.extra}
    if reads is None:
        return extra, (rows, None, None)
    looked, obs_rows, next_rows = look_ahead(table, view.chains(), rows, pos, step, first, args, reads.read)
    extra.update(looked)
    return extra, (rows, obs_rows, next_rows)


def block_rows(bases: np.ndarray, labels: np.ndarray | None, order: np.ndarray | None,
               roles: tuple[np.ndarray, np.ndarray | None, np.ndarray | None], joined: JoinedItems | None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each role's block-local rows of items at virtual ``roles`` (`part_reads`) in blocks
    ``labels`` (the same order; ``len(bases)``: the joined block's, ``joined``'s rows; None:
    one block), taken in ``order`` (None: as they are)."""
    base = bases[0] if labels is None else np.append(bases, 0).take(labels)

    def local(rows: np.ndarray) -> np.ndarray:
        out = rows - (base if labels is None else base.reshape(len(base), *(1,) * (rows.ndim - 1)))
        if joined is not None:
            out = joined.local(rows, out)
        return out if order is None else out.take(order, axis=0)

    rows, obs_rows, next_rows = roles
    step = local(rows)
    return step, step if obs_rows is None else local(obs_rows), step + 1 if next_rows is None else local(next_rows)


def _chosen(selection: Selection, order: np.ndarray) -> Selection:
    """``selection``'s items in ``order``."""
    return Selection(selection.rows.take(order, axis=0), selection.indices.take(order, axis=0),
                     selection.pos.take(order, axis=0), {k: v.take(order, axis=0) for k, v in selection.extra.items()},
                     None if selection.step is None else selection.step.take(order, axis=0))


def _ordered_part(view: Any, selection: Selection, args: SampleArgs, fetch: "_Fetcher") -> tuple:
    """One part's (extras in drawn order, block-local rows by role in block order, touched
    blocks, their starts in block order, ``order``: drawn position of each ordered item; None
    when the same, the touched blocks' columns).

    Plain items are ordered by the block of their rows (`block_order`). With look-ups the
    items are put in block order first and looked up in it, so that their reads go block by
    block (`arrowbuf.ray.across.ViewRows`); an item whose rows lie in several blocks (its
    episode's pieces sealed apart) moves after the others, into the joined block of its rows
    (`arrowbuf.ray.across.JoinedItems`).
    """
    bases, table = view.bases, view.table
    looks = args.n_step > 1 or args.frame_stack > 1   # (`SampleArgs.plain`, without a call per batch)
    pieces = table.pieces and (looks or selection.rows.ndim > 1)   # may read several pieces, and blocks
    if looks:
        block, touched, starts, order = block_order(bases, selection.rows)
        chosen = selection if order is None else _chosen(selection, order)
        labels = None if block is None else np.repeat(touched, np.diff(starts))   # block order
        extra, virtual = part_reads(view, chosen, args, ViewRows(bases, fetch, touched.tolist(), starts.tolist()))
        if order is not None:
            extra = {name: placed(value, order) for name, value in extra.items()}
    else:
        chosen, labels = selection, None
        extra, virtual = part_reads(view, selection, args, None)
    joined = None
    if pieces:
        rows, obs_rows, next_rows = virtual
        virtual = (rows, rows if obs_rows is None else obs_rows, rows + 1 if next_rows is None else next_rows)
        home = chosen.pos if chosen.pos.ndim == 1 else chosen.pos[:, 0]   # the entry of each first step
        across = crossing(bases, virtual, table.col("first_row").take(home), table.col("num_rows").take(home))
        joined = None if across is None else JoinedItems(across, virtual, bases, fetch)
    if not looks:   # in drawn order: ordered by block (the joined one last), then made block-local
        block, touched, starts, order = block_order(bases, selection.rows, None if joined is None else joined.across)
        local = block_rows(bases, block, order, virtual, joined)
    elif joined is None:   # already in block order
        local = block_rows(bases, labels, None, virtual, None)
    else:   # in block order: the joined items move after the others
        labels = np.repeat(touched, np.diff(starts)) if labels is None else labels
        labels[joined.across] = len(bases)
        moved = np.argsort(joined.across, kind="stable")
        local = block_rows(bases, labels, moved, virtual, joined)
        counts = np.bincount(labels, minlength=len(bases) + 1)
        touched = np.flatnonzero(counts)
        starts = np.zeros(len(touched) + 1, np.int64)
        np.cumsum(counts.take(touched), out=starts[1:])
        order = moved if order is None else order.take(moved)
    return extra, local, touched, starts, order, fetch.many(touched.tolist(), joined)


def order_reads(parts: list[tuple[Any, Selection]], cache: Any, args: SampleArgs, places: list[np.ndarray] | None,
          scratch: dict, by_shard: np.ndarray | None = None, weights_over_max: bool = False) -> BlockReads:
    """Every part's items ordered block by block, with ``scratch`` (a reader's reusable arrays).

    Args:
        parts: (`arrowbuf.ray.reader.ShardView`, its selection) of each part of the batches.
        cache: the reader's `arrowbuf.ray.cache.BlockCache`, which serves the touched blocks.
        args: the n-step and frame-stack look-ups.
        places: the batch positions of each part's items (an epoch's chunk order, or
            a shuffle of the parts drawn by several shards); None: the parts follow
            each other, each in drawn order.
        by_shard: items of each shard in each batch, [batches, shards] (a reader's draws), or None.
        weights_over_max: divide the ``"weight"`` extra by its largest (a prioritized draw's,
            as a local store's prioritized sample gives them).
    """
    ordered = _ordered(parts, cache, args, places, scratch, by_shard)
    if weights_over_max and "weight" in ordered.extra:
        ordered.extra["weight"] = ordered.extra["weight"] / ordered.extra["weight"].max()
    return ordered


def _ordered(parts: list[tuple[Any, Selection]], cache: Any, args: SampleArgs, places: list[np.ndarray] | None,
             scratch: dict, by_shard: np.ndarray | None) -> BlockReads:
    parts = same_width(parts)
    keep: set = set()   # the blocks of these batches: never dropped from the cache while they are read
    pieces, roles, extras, orders, offset = [], ([], [], []), [], [], 0
    for view, selection in parts:
        extra, local, touched, starts, order, columns = _ordered_part(view, selection, args,
                                                                      _Fetcher(view, cache, keep))
        orders.append(order)
        extras.append(extra)
        for role, part in zip(roles, local):
            role.append(part)
        pieces += [(c, offset + lo, offset + hi) for c, lo, hi in zip(columns, starts[:-1].tolist(),
                                                                      starts[1:].tolist())]
        offset += len(selection.rows)
    rows = tuple(r[0] if len(r) == 1 else np.concatenate(r or [np.zeros(0, np.int64)]) for r in roles)
    item = tuple(parts[0][1].rows.shape[1:]) if parts else ()
    if places is None and len(parts) == 1:   # one part in drawn order: a plain sample's
        order = orders[0]
        inv = None if order is None else placed(np.arange(offset), order)
        return BlockReads(pieces, rows, extras[0], inv, offset, item, args.frame_stack, scratch, grown=cache.grew,
                          drawn=by_shard)
    extra = {name: np.concatenate([e[name] for e in extras]) for name in extras[0]} if extras else {}
    ends = np.cumsum([0] + [len(selection.rows) for _, selection in parts]).tolist()
    drawn = np.concatenate([np.arange(lo, hi) if places is None else places[k]
                            for k, (lo, hi) in enumerate(zip(ends[:-1], ends[1:]))] or [np.zeros(0, np.int64)])
    # the batch position of each ordered item: its part's block order of its drawn positions
    in_block_order = np.concatenate([drawn[lo:hi] if order is None else drawn[lo:hi].take(order)
                                     for (lo, hi), order in zip(zip(ends[:-1], ends[1:]), orders)]
                                    or [np.zeros(0, np.int64)])
    inv = None
    if not (drawn == np.arange(offset)).all():
        extra = {name: placed(value, drawn) for name, value in extra.items()}
    if not (in_block_order == np.arange(offset)).all():   # batch position -> ordered position
        inv = placed(np.arange(offset), in_block_order)
    return BlockReads(pieces, rows, extra, inv, offset, item, args.frame_stack, scratch, grown=cache.grew,
                          drawn=by_shard)


class _Fetcher:
    """``fetch(b)``: the columns of ``view``'s block ``b``, from ``cache``, fetched once (and kept
    in the cache while these batches are read: added to ``keep``)."""

    def __init__(self, view: Any, cache: Any, keep: set) -> None:
        self.view, self.cache, self.keep = view, cache, keep
        self.fetched: dict[int, dict] = {}

    def __call__(self, b: int) -> dict:
        columns = self.fetched.get(b)
        return columns if columns is not None else self.many([b], None)[0]

    def many(self, blocks: list[int], joined: JoinedItems | None) -> list[dict]:
        """The columns of ``blocks`` (one cache call for those not fetched yet); the block after
        the view's last is ``joined``'s."""
        view, fetched = self.view, self.fetched
        new = [b for b in blocks if b not in fetched and b < len(view.blocks)]
        if new:
            keys = [view.keys[b] for b in new]
            self.keep.update(keys)
            for b, columns in zip(new, self.cache.columns([(k, view.blocks[b]) for k, b in zip(keys, new)], self.keep)):
                fetched[b] = columns
        return [fetched[b] if b < len(view.blocks) else joined.columns for b in blocks]


def same_width(parts: list[tuple[Any, Selection]]) -> list[tuple[Any, Selection]]:
    """Episode batches of several shards padded to one width (the last step repeated, masked out)."""
    widths = {s.rows.shape[1] for _, s in parts if s.rows.ndim == 2}
    if len(widths) <= 1:
        return parts
    width = max(widths)
    padded = []
    for view, s in parts:
        pad = width - s.rows.shape[1]
        if pad:
            edge = lambda a: np.pad(a, ((0, 0), (0, pad)), mode="edge")
            extra = {k: (np.pad(v, ((0, 0), (0, pad))) if k == "mask" else edge(v)) for k, v in s.extra.items()}
            s = Selection(edge(s.rows), edge(s.indices), edge(np.ascontiguousarray(s.pos)), extra,
                          None if s.step is None else edge(s.step))
        padded.append((view, s))
    return padded

