"""A reference model of the ring, and the exhaustive check of a store of tagged episodes against it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.errors import EmptyStoreError

from .compare import column_numpy
from .episodes import ExpectedEpisode, LiveTable, check_batch_reads_its_rows, tagged_action, tagged_obs


def reference_plan(live: list[tuple[int, int]], write_pos: int, capacity: int, rows: int) -> tuple[int, int]:
    """Slow, obviously-correct placement: the DESIGN rule written out row by row.

    The episode goes at ``write_pos`` when the tail can hold it, else at row 0; then
    the shortest prefix of the oldest episodes is evicted so that no remaining live
    episode shares a row with it (FIFO: a newer episode never goes before an older one).
    """
    start = write_pos if write_pos + rows <= capacity else 0
    span = set(range(start, start + rows))
    evicted = 0
    for i, (first, num_rows) in enumerate(live):
        if span & set(range(first, first + num_rows)):
            evicted = i + 1
    return start, evicted


@dataclass
class RingModel:
    """The live episodes a store of ``capacity`` rows should hold, by `reference_plan`."""

    capacity: int
    mode: str = "circular"
    live: list[ExpectedEpisode] = field(default_factory=list)
    added: list[ExpectedEpisode] = field(default_factory=list)
    write_pos: int = 0

    def fits(self, episode: ExpectedEpisode) -> bool:
        """``capacity`` counts transitions: a fixed store refuses past it."""
        if episode.length > self.capacity:
            return False
        return self.mode != "fixed" or sum(e.length for e in self.live) + episode.length <= self.capacity

    def add(self, episode: ExpectedEpisode) -> None:
        """The oldest transitions past the capacity go: whole episodes, then the front of the next."""
        episode.episode_id = len(self.added)
        self.live.append(episode)
        self.added.append(episode)
        excess = sum(e.length for e in self.live) - self.capacity
        while excess > 0:
            oldest = self.live[0]
            if oldest.length <= excess:
                excess -= oldest.length
                self.live.pop(0)
            else:
                oldest.first_step += excess
                excess = 0

    def clear(self) -> None:
        self.live = []
        self.write_pos = 0


def assert_store_matches(store: ab.ExperienceStore, model: RingModel, *, sample_size: int = 64,
                         epoch_batch: int = 7) -> None:
    """Check a store holding tagged episodes against its reference model, exhaustively.

    Checks the episode table (ids, placement, lengths, flags, returns), the ring
    invariants (episodes contiguous, inside the arena, disjoint), each episode's rows,
    `to_arrow`, uniform samples (``next`` observations, steps, actions, rewards) and one
    shuffled epoch of `iter_batches` (every live transition exactly once).
    """
    table = store.episodes()
    ids = table.column("episode_id").to_pylist()
    live = model.live
    # FIFO: the live ids are a suffix of every id ever added, in order.
    all_ids = [e.episode_id for e in model.added]
    assert ids == all_ids[len(all_ids) - len(ids):]
    assert ids == [e.episode_id for e in live]
    assert table.column("num_rows").to_pylist() == [e.num_rows for e in live]
    firsts = table.column("first_step").to_pylist() if "first_step" in table.column_names else [0] * len(live)
    assert firsts == [e.first_step for e in live]
    assert table.column("length").to_pylist() == [e.length for e in live]
    assert table.column("has_final").to_pylist() == [e.has_final for e in live]
    assert table.column("terminated").to_pylist() == [e.terminated for e in live]
    assert table.column("truncated").to_pylist() == [e.truncated for e in live]
    assert table.column("env_id").to_pylist() == [e.env_id for e in live]
    np.testing.assert_allclose(table.column("return").to_numpy(), [e.ret for e in live], rtol=1e-12)

    # The ring never splits an episode: every episode is one run of rows inside the arena.
    spans = sorted(zip(table.column("first_row").to_pylist(),
                       (table.column("first_row").to_numpy() + table.column("num_rows").to_numpy()).tolist()))
    for first, stop in spans:
        assert 0 <= first < stop <= store.engine.shard.rows
    for (_, stop), (first, _) in zip(spans, spans[1:]):
        assert stop <= first

    assert len(store) == sum(table.column("length").to_pylist()) == sum(e.length for e in live)
    assert store.num_episodes == table.num_rows == len(live)

    for e in live:
        batch = store.episode(e.episode_id)
        assert batch.num_rows == e.num_rows
        steps = e.first_step + np.arange(e.num_rows)
        np.testing.assert_array_equal(column_numpy(batch.column("obs")), tagged_obs(e.tag, steps))
        action = np.where(steps < e.steps, tagged_action(e.tag, np.minimum(steps, e.steps - 1)), 0)
        np.testing.assert_array_equal(column_numpy(batch.column("action")), action)
        np.testing.assert_array_equal(column_numpy(batch.column("step")), steps)
        np.testing.assert_array_equal(column_numpy(batch.column("episode_id")), np.full(e.num_rows, e.episode_id))
        np.testing.assert_array_equal(column_numpy(batch.column("is_first")), steps == 0)
        np.testing.assert_array_equal(column_numpy(batch.column("is_last")), steps == e.first_step + e.num_rows - 1)

    rows = store.to_arrow()
    assert rows.num_rows == sum(e.num_rows for e in live)
    if live:
        np.testing.assert_array_equal(column_numpy(rows.column("episode_id")),
                                      np.concatenate([np.full(e.num_rows, e.episode_id) for e in live]))
        np.testing.assert_array_equal(column_numpy(rows.column("obs")),
                                      np.concatenate([tagged_obs(e.tag, e.first_step + np.arange(e.num_rows))
                                                      for e in live]))

    # The table equals the model's (above), so checking samples against it checks them
    # against the model.
    recorded = {e.episode_id: e for e in live}
    live_table = LiveTable(store)
    if len(store) == 0:
        with pytest.raises(EmptyStoreError):
            store.sample(sample_size)
    else:
        check_batch_reads_its_rows(store.sample(sample_size), recorded, live_table)

    expected = {(e.episode_id, t) for e in live for t in range(e.first_step, e.first_step + e.length)}
    seen: list[tuple[int, int]] = []
    for batch in store.iter_batches(epoch_batch, shuffle=True):
        assert 1 <= batch.batch_size[0] <= epoch_batch
        check_batch_reads_its_rows(batch, recorded, live_table)
        seen += list(zip(batch["episode_id"].tolist(), batch["step"].tolist()))
    assert len(seen) == len(set(seen)), "a transition came twice in one epoch"
    assert set(seen) == expected
