"""The episode table: FIFO columns, ids, indices and index -> row lookups."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from arrowbuf.checkpoint import upgrade_state
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
    model: list[tuple[int, int, int]] = []   # (id, length, first_index)
    added = next_index = 0
    for op, n in ops:
        if op == "add":
            assert append(table, added, n, env_id=f"env-{added % 3}") == added
            model.append((added, n, next_index))
            added += 1
            next_index += n
        elif op == "pop" and model:
            table.pop_oldest(1)
            model.pop(0)
        elif op == "clear":
            table.clear()
            model.clear()
        assert len(table) == len(model)
        assert table.col("episode_id").tolist() == [m[0] for m in model]
        assert table.col("length").tolist() == [m[1] for m in model]
        assert table.col("first_index").tolist() == [m[2] for m in model]
        assert table.col("first_row").tolist() == [m[0] for m in model]
        assert table.num_transitions == sum(m[1] for m in model)
        assert table.next_index == next_index
        exported = table.to_arrow()
        assert exported.column("episode_id").to_pylist() == [m[0] for m in model]
        assert exported.column("env_id").to_pylist() == [f"env-{m[0] % 3}" for m in model]


def test_indices_keep_counting_after_clear_so_old_indices_stay_stale():
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
    append(table, 0, 2)     # indices 0, 1
    append(table, 10, 0)    # no transitions
    append(table, 20, 0)    # no transitions
    append(table, 30, 3)    # indices 2, 3, 4
    pos, offset = table.locate(np.arange(5))
    assert pos.tolist() == [0, 0, 3, 3, 3]
    assert offset.tolist() == [0, 1, 0, 1, 2]
    assert table.rows_of(np.arange(5)).tolist() == [0, 1, 30, 31, 32]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_a_built_lookup_locates_as_the_binary_search_and_is_dropped_by_any_change(lengths, popped, seed):
    table, plain = EpisodeTable(), EpisodeTable()
    for length in lengths:
        for t in (table, plain):
            append(t, t.next_index, length)
    popped = min(popped, len(lengths) - 1)
    for t in (table, plain):
        t.pop_oldest(popped)
    rng = np.random.default_rng(seed)
    for change in ("append", "pop", "load"):
        table.build_lookup()
        assert table._lookup is not None
        indices = rng.integers(*plain.live_range(), 300)
        for got, expected in zip(table.locate(indices), plain.locate(indices)):
            np.testing.assert_array_equal(got, expected)
        if change == "append":   # a shorter episode than any: a stale lookup would place its indices wrongly
            for t in (table, plain):
                append(t, t.next_index, 1)
        elif change == "pop" and len(table) > 1:
            for t in (table, plain):
                t.pop_oldest(1)
        elif change == "load":
            table.load_state_dict(plain.state_dict())
        assert table._lookup is None
        indices = rng.integers(*plain.live_range(), 300)
        for got, expected in zip(table.locate(indices), plain.locate(indices)):
            np.testing.assert_array_equal(got, expected)


def test_position_of_an_empty_table_is_out_of_range():
    table = EpisodeTable()
    assert table.position_of(0) < 0


def test_the_index_map_finds_indices_far_beyond_its_capacity():
    # Indices keep counting for the life of a store; the map wraps them modulo its size.
    table = EpisodeTable(capacity=10)
    table.resume(episodes_added=3 * 10**9, next_index=10**12 + 7)   # past 2**32 episodes too
    append(table, 0, 4)
    append(table, 5, 3)
    indices = 10**12 + 7 + np.array([0, 3, 4, 6])
    pos, step = table.locate(indices)
    assert pos.tolist() == [0, 0, 1, 1] and step.tolist() == [0, 3, 0, 2]
    assert table.rows_of(indices).tolist() == [0, 3, 5, 7]


def test_the_index_map_finds_episodes_whose_serials_wrap_past_two_to_the_32():
    # The map keeps episode serials mod 2**32: the oldest episode's serial is
    # 2**32 - 1, the next one's wraps to 0, and positions must still be 0 and 1.
    table = EpisodeTable(capacity=16)
    table.resume(episodes_added=2**32 - 1, next_index=40)
    append(table, 0, 3)    # indices 40..42
    append(table, 4, 2)    # indices 43, 44
    pos, step = table.locate(np.array([44, 40, 43, 42]))
    assert pos.tolist() == [1, 0, 1, 0] and step.tolist() == [1, 0, 0, 2]
    assert pos.dtype == np.intp
    assert table.rows_of(np.array([44, 40, 43, 42])).tolist() == [5, 0, 4, 2]


def test_a_state_saved_with_the_old_rank_names_loads_under_the_index_names():
    table = EpisodeTable(capacity=64)
    for length in (3, 5):
        table.append(first_row=table.next_index, num_rows=length, length=length, has_final=False,
                     terminated=True, truncated=False, ret=1.0, env_id="e")
    state = table.state_dict()
    state["counters"]["rank"] = state["counters"].pop("index")
    state["columns"]["first_rank"] = state["columns"].pop("first_index")
    restored = EpisodeTable(capacity=64)
    restored.load_state_dict(upgrade_state(state))
    assert restored.next_index == table.next_index == 8
    assert restored.col("first_index").tolist() == [0, 3]
    assert restored.rows_of(np.array([0, 4, 7])).tolist() == table.rows_of(np.array([0, 4, 7])).tolist()


ENTRY = st.tuples(st.integers(0, 6), st.sampled_from(["ended", "cut"]), st.integers(0, 3),
                  st.sampled_from(["whole"] * 4 + ["older"] * 3 + ["batch", "twice"]))
# Batches of 32 or more take the vectorized path; fewer, one append each.
BATCH = st.one_of(st.lists(ENTRY, min_size=1, max_size=6), st.lists(ENTRY, min_size=32, max_size=48))


@settings(max_examples=150, deadline=None)
@given(capacity=st.sampled_from([None, 8, 64]),
       batches=st.lists(st.tuples(BATCH, st.integers(0, 3), st.booleans(), st.sampled_from(["mixed", "no batch", "plain"])),
                        min_size=1, max_size=8))
def test_append_many_leaves_the_table_as_that_many_appends_do(capacity, batches):
    """Ids, indices, the index map, continued pieces' episode ids, the longest live episode and the
    tips of each env: a batch (whole episodes, pieces continuing older ones or one of the batch)
    gives what one `append` an episode gives, through evictions, map wrap-around and a counter."""
    tables = [EpisodeTable(capacity=capacity * 4 if capacity else None) for _ in range(2)]
    for table in tables:
        table.add_counter("pairs", lambda n: n // 2)
    row = 0
    for batch, evict, clear, plain in batches:
        entries = []
        for length, end, env, kind in batch:
            if kind in {"mixed": (), "no batch": ("batch",), "plain": ("batch", "twice")}[plain]:
                kind = "older"
            serial = tables[0].episodes_added + len(entries)
            prev = {"whole": -1, "older": tables[0].episodes_added - 1 - len(entries),   # each another one
                    "batch": serial - 1 if entries else -1,   # (and a piece continued twice, as no writer does)
                    "twice": entries[-1]["prev_piece"] if entries else -1}[kind]
            entries.append(dict(first_row=row, num_rows=length + 1, length=length, has_final=True,
                                terminated=end == "ended", truncated=False, ret=float(length), env_id=f"env-{env}",
                                metadata=None if length % 2 else f'"m{serial}"', inserted_at=serial,
                                first_step=1 if prev >= 0 else 0, prev_piece=max(prev, -1)))
            row += length + 1
        singles = [tables[0].append(**e) for e in entries]
        many = tables[1].append_many(*(np.array([e[k] for e in entries]) for k in (
            "first_row", "num_rows", "length", "has_final", "terminated", "truncated", "ret")),
            [e["env_id"] for e in entries], metadata=[e["metadata"] for e in entries],
            inserted_at=np.array([e["inserted_at"] for e in entries]),
            first_step=np.array([e["first_step"] for e in entries]), prev_piece=np.array([e["prev_piece"] for e in entries]))
        assert many == singles
        for table in tables:
            table.pop_oldest(min(evict, len(table)))
            if clear:
                table.clear()
        a, b = (t.state_dict() for t in tables)
        for name in a["columns"]:
            np.testing.assert_array_equal(a["columns"][name], b["columns"][name], err_msg=name)
        assert {k: v for k, v in a.items() if k != "columns"} == {k: v for k, v in b.items() if k != "columns"}
        assert (tables[0].longest, tables[0].pieces) == (tables[1].longest, tables[1].pieces)
        first, stop = tables[0].live_range()
        assert (first, stop) == tables[1].live_range()
        if stop > first:
            units = np.arange(first, stop)
            for got, want in zip(tables[1].locate(units), tables[0].locate(units)):
                np.testing.assert_array_equal(got, want)
        for code in range(len(tables[0].env_names)):   # the tips: what a piece continuing each piece would get
            for serial in range(max(0, tables[0].episodes_added - 80), tables[0].episodes_added):
                assert tables[0]._episode_of(code, serial) == tables[1]._episode_of(code, serial)
