"""The episode table: FIFO columns, ids, ranks and rank -> row lookups."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from arrowbuf.table import EpisodeTable


def append(table: EpisodeTable, first_row: int, length: int, env_id: str = "env-0") -> int:
    return table.append(first_row=first_row, num_rows=length + 1, length=length, has_final=True,
                        terminated=True, truncated=False, ret=float(length), env_id=env_id)


def test_ids_count_from_the_offset_in_strides():
    table = EpisodeTable(shard=2, id_offset=2, id_stride=4)
    assert [append(table, 0, 1) for _ in range(3)] == [2, 6, 10]
    assert table.position_of(np.array([2, 6, 10, 14])).tolist() == [0, 1, 2, 3]


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.one_of(st.integers(0, 5).map(lambda n: ("add", n)), st.just(("pop", 1)),
                              st.just(("clear", 0))), max_size=80))
def test_table_columns_follow_a_list_model_through_growth_compaction_and_clear(ops):
    table = EpisodeTable()
    model: list[tuple[int, int, int]] = []   # (id, length, first_rank)
    added = next_rank = 0
    for op, n in ops:
        if op == "add":
            assert append(table, added, n, env_id=f"env-{added % 3}") == added
            model.append((added, n, next_rank))
            added += 1
            next_rank += n
        elif op == "pop" and model:
            table.pop_oldest(1)
            model.pop(0)
        elif op == "clear":
            table.clear()
            model.clear()
        assert len(table) == len(model)
        assert table.col("episode_id").tolist() == [m[0] for m in model]
        assert table.col("length").tolist() == [m[1] for m in model]
        assert table.col("first_rank").tolist() == [m[2] for m in model]
        assert table.col("first_row").tolist() == [m[0] for m in model]
        assert table.num_transitions == sum(m[1] for m in model)
        assert table.next_rank == next_rank
        exported = table.to_arrow()
        assert exported.column("episode_id").to_pylist() == [m[0] for m in model]
        assert exported.column("env_id").to_pylist() == [f"env-{m[0] % 3}" for m in model]


def test_ranks_keep_counting_after_clear_so_old_ranks_stay_stale():
    table = EpisodeTable()
    append(table, 0, 5)
    table.clear()
    assert table.num_transitions == 0
    assert not table.is_live(np.arange(5)).any()
    append(table, 0, 3)
    assert table.col("episode_id").tolist() == [1]
    assert table.is_live(np.arange(8)).tolist() == [False] * 5 + [True] * 3


def test_locate_skips_episodes_without_transitions():
    table = EpisodeTable()
    append(table, 0, 2)     # ranks 0, 1
    append(table, 10, 0)    # no transitions
    append(table, 20, 0)    # no transitions
    append(table, 30, 3)    # ranks 2, 3, 4
    pos, offset = table.locate(np.arange(5))
    assert pos.tolist() == [0, 0, 3, 3, 3]
    assert offset.tolist() == [0, 1, 0, 1, 2]
    assert table.rows_of(np.arange(5)).tolist() == [0, 1, 30, 31, 32]


def test_position_of_an_empty_table_is_out_of_range():
    table = EpisodeTable()
    assert table.position_of(0) < 0


def test_the_rank_map_finds_ranks_far_beyond_its_capacity():
    # Ranks keep counting for the life of a store; the map wraps them modulo its size.
    table = EpisodeTable(capacity=10)
    table.resume(episodes_added=3 * 10**9, next_rank=10**12 + 7)   # past 2**32 episodes too
    append(table, 0, 4)
    append(table, 5, 3)
    ranks = 10**12 + 7 + np.array([0, 3, 4, 6])
    pos, step = table.locate(ranks)
    assert pos.tolist() == [0, 0, 1, 1] and step.tolist() == [0, 3, 0, 2]
    assert table.rows_of(ranks).tolist() == [0, 3, 5, 7]
