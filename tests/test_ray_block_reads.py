"""BlockReads items of several blocks gathered into batches in their drawn order (no Ray needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arrowbuf.fields import Field
from arrowbuf.ray.gather import BlockGather
from arrowbuf.ray.block_reads import ROWWISE_BYTES, BlockReads, block_order
from arrowbuf.schema import Schema

SCHEMA = Schema({"obs": Field("float32", (3,), observation=True), "action": Field("int64"),
                 "terminated": Field("bool")})


def make_blocks(sizes: list[int]) -> tuple[list[dict], np.ndarray, dict]:
    """Blocks of consecutive rows: row r of the whole store holds obs (r, r, r), action r;
    (blocks, first virtual row of each, the whole store's columns)."""
    total = sum(sizes)
    whole = {"obs": np.repeat(np.arange(total, dtype=np.float32)[:, None], 3, axis=1),
             "action": np.arange(total, dtype=np.int64), "terminated": np.arange(total) % 7 == 0}
    bases = np.cumsum([0] + sizes[:-1])
    blocks = [{name: column[lo:lo + n] for name, column in whole.items()} for lo, n in zip(bases.tolist(), sizes)]
    return blocks, bases, whole


def order_reads(blocks: list[dict], bases: np.ndarray, rows: np.ndarray, scratch: dict) -> BlockReads:
    """What a `BlockReader` orders for one part of plain (1-step) rows."""
    block, touched, starts, order = block_order(bases, rows)
    base = bases.take(block) if block is not None else bases[0]
    local = rows - base
    if order is not None:
        local = local.take(order)
    inv = None
    if order is not None:
        inv = np.empty(len(rows), np.int64)
        inv[order] = np.arange(len(rows))
    pieces = [(blocks[b], lo, hi) for b, lo, hi in zip(touched.tolist(), starts[:-1].tolist(), starts[1:].tolist())]
    return BlockReads(pieces, (local, local, local + 1), {"index": rows * 10}, inv, len(rows), (), 1, scratch)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(2, 40), min_size=1, max_size=12), st.integers(1, 200), st.integers(0, 2**32 - 1))
def test_block_order_sorts_items_by_block_and_keeps_their_drawn_order_within_a_block(sizes, n, seed):
    _, bases, _ = make_blocks(sizes)
    rows = np.random.default_rng(seed).integers(0, sum(sizes), n)
    if seed % 3 == 0:
        rows.sort()   # already in block order: no order to apply
    block, touched, starts, order = block_order(bases, rows)
    expected = np.searchsorted(bases, rows, side="right") - 1
    if len(bases) > 1:
        np.testing.assert_array_equal(block, expected)
    drawn = np.arange(n) if order is None else order
    assert (np.diff(expected[drawn]) >= 0).all()
    np.testing.assert_array_equal(touched, np.unique(expected))
    np.testing.assert_array_equal(np.diff(starts), np.bincount(expected)[touched])
    for b, lo, hi in zip(touched, starts[:-1], starts[1:]):   # stable: drawn order inside each block
        assert (np.diff(drawn[lo:hi]) > 0).all() and (expected[drawn[lo:hi]] == b).all()
    if seed % 3 == 0:
        assert order is None


@pytest.mark.parametrize("rowwise_bytes", [1, 1 << 40], ids=["straight from the blocks", "through the scratch"])
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(2, 30), min_size=1, max_size=8), st.integers(1, 4), st.integers(1, 40),
       st.integers(0, 2**32 - 1))
def test_every_ordered_batch_holds_its_drawn_rows_in_drawn_order(rowwise_bytes, sizes, batches, batch_size, seed):
    blocks, bases, whole = make_blocks(sizes)
    steps = np.setdiff1d(np.arange(sum(sizes)), bases[1:] - 1)[:-1]   # rows whose next row is in their block
    rows = np.random.default_rng(seed).choice(steps, batches * batch_size)
    ordered = order_reads(blocks, bases, rows, {})
    gather = BlockGather(SCHEMA, rowwise_bytes)
    kept = []
    for k in range(batches):
        lo, hi = k * batch_size, (k + 1) * batch_size
        batch = gather(ordered, lo, hi, None)
        np.testing.assert_array_equal(batch["obs"].numpy(), whole["obs"][rows[lo:hi]])
        np.testing.assert_array_equal(batch["next", "obs"].numpy(), whole["obs"][rows[lo:hi] + 1])
        np.testing.assert_array_equal(batch["action"].numpy(), whole["action"][rows[lo:hi]])
        np.testing.assert_array_equal(batch["terminated"].numpy(), whole["terminated"][rows[lo:hi]])
        np.testing.assert_array_equal(batch["index"].numpy(), rows[lo:hi] * 10)
        kept.append((batch, rows[lo:hi]))
    for batch, expected in kept:   # batches kept are not overwritten by later ones
        np.testing.assert_array_equal(batch["action"].numpy(), whole["action"][expected])


@pytest.mark.parametrize("rowwise_bytes", [1, 1 << 40], ids=["straight from the blocks", "through the scratch"])
@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(2, 30), min_size=1, max_size=8), st.integers(2, 5), st.integers(1, 30),
       st.integers(0, 2**32 - 1))
def test_batches_gathered_together_each_hold_their_drawn_rows_and_a_kept_one_is_never_overwritten(
        rowwise_bytes, sizes, batches, batch_size, seed):
    blocks, bases, whole = make_blocks(sizes)
    steps = np.setdiff1d(np.arange(sum(sizes)), bases[1:] - 1)[:-1]
    rng = np.random.default_rng(seed)
    gather = BlockGather(SCHEMA, rowwise_bytes)
    kept = []
    for _ in range(3):   # later draws reuse what no kept batch holds
        rows = rng.choice(steps, batches * batch_size)
        together = gather.batches(order_reads(blocks, bases, rows, {}), 0, batches * batch_size, batch_size, None)
        assert len(together) == batches
        for k, batch in enumerate(together):
            expected = rows[k * batch_size:(k + 1) * batch_size]
            assert batch.batch_size == (batch_size,)
            np.testing.assert_array_equal(batch["obs"].numpy(), whole["obs"][expected])
            np.testing.assert_array_equal(batch["next", "obs"].numpy(), whole["obs"][expected + 1])
            np.testing.assert_array_equal(batch["action"].numpy(), whole["action"][expected])
            np.testing.assert_array_equal(batch["terminated"].numpy(), whole["terminated"][expected])
            np.testing.assert_array_equal(batch["index"].numpy(), expected * 10)
        kept.append((together[-1], rows[-batch_size:]))   # the others are dropped
        del together, batch
    for batch, expected in kept:
        np.testing.assert_array_equal(batch["obs"].numpy(), whole["obs"][expected])
        np.testing.assert_array_equal(batch["index"].numpy(), expected * 10)


def test_a_scratch_reused_by_a_new_ordering_is_read_from_its_blocks_again():
    blocks, bases, whole = make_blocks([10, 10, 10])
    gather, scratch = BlockGather(SCHEMA), {}
    rng = np.random.default_rng(0)
    for _ in range(5):
        rows = rng.choice([r for r in range(29) if r % 10 != 9], 16)
        batch = gather(order_reads(blocks, bases, rows, scratch), 0, 16, None)
        np.testing.assert_array_equal(batch["action"].numpy(), whole["action"][rows])
    assert scratch   # the draws crossed blocks: the ordered arrays were kept for reuse


def test_pixel_rows_are_copied_straight_from_the_blocks_into_the_batch_the_scratch_would_give():
    # Rows of ROWWISE_BYTES or more skip the scratch: one copy, as in the embedded store.
    pixels = (64, 64, 4)   # 16 KiB a row
    assert int(np.prod(pixels)) >= ROWWISE_BYTES
    schema = Schema({"pixels": Field("uint8", pixels, observation=True), "action": Field("int64")})
    sizes = [7, 9, 6]
    total = sum(sizes)
    whole = {"pixels": np.random.default_rng(0).integers(0, 255, (total, *pixels), dtype=np.uint8),
             "action": np.arange(total, dtype=np.int64)}
    bases = np.cumsum([0] + sizes[:-1])
    blocks = [{name: column[lo:lo + n] for name, column in whole.items()} for lo, n in zip(bases.tolist(), sizes)]
    rows = np.array([20, 3, 8, 14, 0, 9, 4, 17, 10, 1, 13, 3])   # every block, out of block order
    straight, through = BlockGather(schema), BlockGather(schema, rowwise_bytes=1 << 40)
    ordered, ordered_through = order_reads(blocks, bases, rows, {}), order_reads(blocks, bases, rows, {})
    assert ordered.inv is not None
    assert straight.sizes(ordered, 4)[0] == 4 * 8   # the actions only
    assert through.sizes(ordered, 4)[0] == 4 * 8 + 2 * 4 * int(np.prod(pixels))
    for lo in range(0, len(rows), 4):
        batch, again = straight(ordered, lo, lo + 4, None), through(ordered_through, lo, lo + 4, None)
        np.testing.assert_array_equal(batch["pixels"].numpy(), whole["pixels"][rows[lo:lo + 4]])
        np.testing.assert_array_equal(batch["next", "pixels"].numpy(), whole["pixels"][rows[lo:lo + 4] + 1])
        for key in (("pixels",), ("next", "pixels"), ("action",), ("index",)):
            np.testing.assert_array_equal(batch[key].numpy(), again[key].numpy())
    assert ordered.filled == {("action", 0)}   # nothing else went through the scratch
    assert ("pixels", 1) in ordered_through.filled and ("pixels", 2) in ordered_through.filled


def test_small_step_fields_are_read_as_one_record_a_row_and_match_their_columns():
    # action, reward and flags are packed one record a row per block (once, kept with
    # the block) and read with one take: the batch must hold each field's own rows.
    schema = Schema({"obs": Field("float32", (3,), observation=True), "action": Field("float32", (2,)),
                     "reward": Field("float32"), "terminated": Field("bool"), "truncated": Field("bool")})
    sizes = [9, 7, 11]
    total = sum(sizes)
    rng = np.random.default_rng(1)
    whole = {"obs": rng.random((total, 3), dtype=np.float32), "action": rng.random((total, 2), dtype=np.float32),
             "reward": rng.random(total, dtype=np.float32), "terminated": rng.random(total) < 0.5,
             "truncated": rng.random(total) < 0.5}
    bases = np.cumsum([0] + sizes[:-1])
    blocks = [{name: column[lo:lo + n] for name, column in whole.items()} for lo, n in zip(bases.tolist(), sizes)]
    steps = np.setdiff1d(np.arange(total), bases[1:] - 1)[:-1]
    gather = BlockGather(schema)
    for rows in (rng.choice(steps, 24), np.sort(rng.choice(steps, 24))):   # out of block order, then in it
        ordered = order_reads(blocks, bases, rows, {})
        for lo in range(0, 24, 8):
            batch = gather(ordered, lo, lo + 8, None)
            for name in whole:
                np.testing.assert_array_equal(batch[name].numpy(), whole[name][rows[lo:lo + 8]])
            np.testing.assert_array_equal(batch["next", "obs"].numpy(), whole["obs"][rows[lo:lo + 8] + 1])
        if ordered.inv is not None:   # the small fields went through the scratch as records, not one by one
            assert not {("action", 0), ("reward", 0), ("terminated", 0)} & ordered.filled
            assert any(key[0] == "packed" for key in ordered.filled)
    packed = [key for key in blocks[0] if isinstance(key, tuple)]
    assert len(packed) == 1   # each block packed once, kept for the next orderings
    record = blocks[0][packed[0]]
    assert record.shape == (sizes[0], 16)   # action 8 B, reward 4, two flags 1 each, padded to 4


def test_derived_bytes_an_ordering_keeps_in_a_block_are_reported_for_the_cache_bound():
    # Records of small fields, and a contiguous copy of a column that is not (a view of a
    # contiguous one costs nothing): both live in the block's dict, which the cache counts.
    blocks, bases, _ = make_blocks([6, 6])
    blocks[1]["obs"] = np.asfortranarray(blocks[1]["obs"])
    grown = []
    ordered = order_reads(blocks, bases, np.arange(12), {})
    ordered.grown = lambda columns, nbytes: grown.append((id(columns), nbytes))
    for block in blocks:
        assert bytes(ordered.column_bytes(block, "obs")) == np.ascontiguousarray(block["obs"]).tobytes()
    assert grown == [(id(blocks[1]), blocks[1]["obs"].nbytes)]
    ordered.block_records(blocks[0], (16, (("action", 0), ("terminated", 8))))
    assert grown[-1] == (id(blocks[0]), 6 * 16)
