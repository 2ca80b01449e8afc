"""The ring arena: placement (`plan_write`), FIFO eviction, fixed mode, zero-copy views."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.errors import CapacityError
from arrowbuf.placement import plan_write
from arrowbuf.shard import Episode, Shard, position_runs
from arrowbuf.shard_arrow import episode_view, shard_table

from support.compare import column_numpy
from support.episodes import tagged_obs
from support.ring import reference_plan


SCHEMA = ab.Schema({"obs": ab.Field("float64", (2,), observation=True), "action": ab.Field("int64"),
                    "flag": ab.Field("bool"), "pixels": ab.Field("uint8", (2, 3)), "x": ab.Field("float32")})


def shard_episode(tag: int, steps: int, has_final: bool = True) -> Episode:
    t = np.arange(steps)
    return Episode({"obs": tagged_obs(tag, np.arange(steps + int(has_final))), "action": tag * 1000 + t,
                    "flag": t % 2 == 0, "pixels": np.full((steps, 2, 3), tag, np.uint8),
                    "x": (tag + t).astype(np.float32)}, steps, has_final)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 30), data=st.data())
def test_plan_write_agrees_with_the_row_by_row_reference(capacity, data):
    sizes = data.draw(st.lists(st.integers(1, capacity), min_size=1, max_size=25))
    live: list[tuple[int, int]] = []
    write_pos = 0
    for rows in sizes:
        first_rows = np.array([first for first, _ in live], np.int64)
        got = plan_write(first_rows, write_pos, capacity, rows)
        assert got == reference_plan(live, write_pos, capacity, rows)
        start, evicted = got
        live = live[evicted:] + [(start, rows)]
        write_pos = start + rows
        spans = sorted((first, first + n) for first, n in live)
        assert all(0 <= a < b <= capacity for a, b in spans)
        assert all(b <= a2 for (_, b), (a2, _) in zip(spans, spans[1:]))


def test_plan_write_appends_at_the_write_position_when_the_tail_has_room():
    assert plan_write(np.array([0, 4], np.int64), 7, 10, 3) == (7, 0)


def test_plan_write_skips_a_short_tail_and_evicts_the_previous_lap_first():
    # Live: [6, 9) from the previous lap (oldest), then [0, 3) and [3, 6); the tail
    # [6, 10) has room for 4 rows only once [6, 9) is gone, but 5 rows must go to row 0.
    first_rows = np.array([6, 0, 3], np.int64)
    assert plan_write(first_rows, 6, 10, 5) == (0, 3)
    assert plan_write(first_rows, 6, 10, 3) == (6, 1)


def test_plan_write_on_an_empty_table_never_evicts():
    assert plan_write(np.array([], np.int64), 0, 5, 5) == (0, 0)


def test_an_episode_never_wraps_the_ring_the_ring_grows_while_the_count_allows():
    shard = Shard(SCHEMA, capacity=10)
    shard.add(shard_episode(0, 5))          # rows [0, 6)
    shard.add(shard_episode(1, 4))          # 5 rows: the tail [6, 10) has 4, row 0 is live: the ring grows
    assert shard.table.col("first_row").tolist() == [0, 6]
    assert (len(shard), shard.ring, shard.write_pos) == (9, 11, 11)
    view = episode_view(shard, 1)
    np.testing.assert_array_equal(column_numpy(view.column("obs")), tagged_obs(1, np.arange(5)))


def test_an_episode_of_exactly_the_capacity_evicts_all_but_the_newest():
    shard = Shard(SCHEMA, capacity=6)
    shard.add(shard_episode(0, 2))
    shard.add(shard_episode(1, 6))
    assert shard.table.col("episode_id").tolist() == [1]
    assert len(shard) == 6


def test_a_write_evicts_the_oldest_transitions_as_few_as_it_must():
    shard = Shard(SCHEMA, capacity=6)
    shard.add(shard_episode(0, 3))
    shard.add(shard_episode(1, 2))
    shard.add(shard_episode(2, 3))          # 8 transitions: the oldest 2 (episode 0's first two) go
    assert len(shard) == 6
    assert shard.table.col("length").tolist() == [1, 2, 3]
    assert shard.table.col("first_step").tolist() == [2, 0, 0]
    assert shard.table.first_live_index == 2
    rows = shard.table.rows_of(np.arange(2, 8))
    np.testing.assert_array_equal(shard.arena["action"][rows], [2, 1000, 1001, 2000, 2001, 2002])


def test_an_episode_longer_than_the_capacity_is_refused_and_changes_nothing():
    shard = Shard(SCHEMA, capacity=6)
    shard.add(shard_episode(0, 3))
    arena = {name: column.copy() for name, column in shard.arena.items()}
    with pytest.raises(CapacityError, match=r"7 steps holds 7 transitions.*capacity of 6 transitions"):
        shard.add(shard_episode(1, 7))
    assert shard.table.col("episode_id").tolist() == [0]
    assert shard.write_pos == 4
    for name, column in arena.items():
        np.testing.assert_array_equal(shard.arena[name][:4], column[:4])


def test_fixed_mode_refuses_at_capacity_transitions_and_changes_nothing():
    shard = Shard(SCHEMA, capacity=6, mode="fixed")
    shard.add(shard_episode(0, 3))   # [0, 4)
    shard.add(shard_episode(1, 2))   # [4, 7): the ring grows past its 6 rows
    with pytest.raises(CapacityError, match=r"5 transitions held of its capacity=6.*mode='fixed'"):
        shard.add(shard_episode(2, 2))
    assert shard.table.col("episode_id").tolist() == [0, 1]
    assert shard.write_pos == 7
    shard.add(shard_episode(2, 1))   # the sixth transition fits
    assert shard.table.col("first_row").tolist() == [0, 4, 7]
    assert len(shard) == 6


def test_a_plan_names_what_its_write_evicts_before_the_rows_are_reused():
    shard = Shard(SCHEMA, capacity=6)
    shard.add(shard_episode(5, 3))
    shard.add(shard_episode(6, 3))
    episode = shard_episode(7, 3)
    plan = shard.check_fits(episode)   # 3 transitions past the capacity: the first episode, whole
    assert (plan.pieces, plan.trim, plan.open_trim, plan.start) == (1, 0, 0, 0)
    first, rows = shard.evicted_spans(plan.pieces)
    assert (first.tolist(), rows.tolist()) == ([0], [4])
    assert shard.arena["action"][first[0]] == 5000   # still the old episode's until the write
    shard.add(episode, plan)
    assert shard.table.col("episode_id").tolist() == [1, 2]


def test_the_final_row_holds_the_last_observation_and_zeros_in_step_fields():
    shard = Shard(SCHEMA, capacity=8)
    shard.add(shard_episode(3, 4))
    assert shard.arena["action"][4] == 0
    assert shard.arena["x"][4] == 0
    assert not shard.arena["flag"][4]
    np.testing.assert_array_equal(shard.arena["pixels"][4], 0)
    np.testing.assert_array_equal(shard.arena["obs"][4], [3, 4])


def test_indices_and_rows_of_live_transitions_line_up():
    shard = Shard(SCHEMA, capacity=6)
    shard.add(shard_episode(0, 4))                    # 4 transitions, rows [0, 5)
    shard.add(shard_episode(1, 3, has_final=False))   # 2 transitions, rows [5, 8)
    shard.add(shard_episode(2, 2))                    # 8 transitions: episode 0's first 2 go
    assert len(shard) == 6
    assert shard.table.first_live_index == 2
    np.testing.assert_array_equal(shard.table.rows_of(np.arange(2, 8)), [2, 3, 5, 6, 8, 9])


def test_runs_merge_adjacent_episodes_and_split_at_the_wrap():
    shard = Shard(SCHEMA, capacity=6)
    for tag, steps in enumerate([2, 2, 2, 3]):   # rows [0,3) [3,6) [6,9), then 3 past the capacity: [0,4)
        shard.add(shard_episode(tag, steps))
    # positions: episode 1 (its last step), episode 2, then episode 3 at the wrap: two runs
    assert shard.table.col("first_row").tolist() == [4, 6, 0]
    assert position_runs(shard.table.col("first_row"), shard.table.col("num_rows")) == [(0, 2), (2, 3)]
    table = shard_table(shard)
    assert [len(b) for b in table.to_batches()] == [5, 4]
    assert column_numpy(table.column("episode_id")).tolist() == [1, 1, 2, 2, 2, 3, 3, 3, 3]


def test_episode_views_are_zero_copy_slices_of_the_arena_except_for_packed_small_fields():
    shard = Shard(SCHEMA, capacity=20)
    shard.add(shard_episode(0, 5))
    shard.add(shard_episode(1, 3))
    # action, flag, pixels (6 bytes) and x are small per-step fields: one row-packed block.
    assert sorted(shard._pack_offsets) == ["action", "flag", "pixels", "x"]
    view = episode_view(shard, 1)
    for name in ("obs", "action", "pixels", "x"):
        arena = shard.arena[name]
        column = view.column(name)
        values = column.storage.values if isinstance(column.type, pa.FixedShapeTensorType) else column
        if name in shard._pack_offsets:   # strided in the arena: Arrow gets a contiguous copy
            assert not np.shares_memory(column_numpy(column), shard.packed), name
        else:
            assert values.buffers()[1].address == arena[6:].ctypes.data, name
        np.testing.assert_array_equal(column_numpy(column), arena[6:10], err_msg=name)
    shard.arena["obs"][6] = 99   # a view of a columnar field sees later writes to its rows
    assert view.column("obs")[0].as_py() == [99, 99]
    # The system columns are computed from the episode table, not stored per row.
    assert view.column("episode_id").to_pylist() == [1] * 4
    assert view.column("step").to_pylist() == [0, 1, 2, 3]
    assert view.column("is_first").to_pylist() == [True, False, False, False]
    assert view.column("is_last").to_pylist() == [False, False, False, True]


def test_shard_constructor_checks_capacity_and_mode():
    with pytest.raises(ValueError, match="capacity.*got 0"):
        Shard(SCHEMA, capacity=0)
    with pytest.raises(ValueError, match="mode.*'ring'"):
        Shard(SCHEMA, capacity=4, mode="ring")


def test_ids_of_several_shards_never_collide():
    shards = [Shard(SCHEMA, capacity=10, shard=k, num_shards=3) for k in range(3)]
    ids = [s.add(shard_episode(0, 1)) for s in shards for _ in range(3)]
    assert sorted(ids) == list(range(9))
