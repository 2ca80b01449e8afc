"""Many episodes of one `ExperienceStore.add_episodes` batch placed and copied as one block.

`arrowbuf.episode_batch.read_episodes` cuts a batch (E episodes shaped ``[E, T, ...]``, or a
list of E episodes of any lengths) into `Episode` objects, which `ShardEngine.add` would add one
by one: a plan, a copy per field and a table entry an episode. `add_block` places all their
rows as one run of the ring (`Ring.plan_block`), copies each field once and appends their
table entries: what E single adds store, in the same order, with the same evictions. Episodes
of one length that are the rows of one array per field (a rollout of E envs, the windows
`arrowbuf.compat` cuts at a rollout's end; `EpisodeBatch.blocks`: the episodes as read, none
replaced since) are copied as one strided block (`Shard.write_block`); others, of any lengths
(a list of demos, a rollout's end cut per env), are concatenated into the run (`Shard.write_parts`).
Anything else (ragged, text or encoded fields, a byte budget, a column that is not a plain
numpy array, a ring whose run would evict more than the count does) returns None, and the
caller adds the episodes one by one.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from arrowbuf._checks import metadata_text
from arrowbuf.shard import Episode, Shard, total_reward


class EpisodeBatch(list):
    """The episodes `read_episodes` cut, and the ``[E, T, ...]`` arrays they are views of, for
    `add_block` to copy each field of them at once.

    Attributes:
        arrays: field -> the batch's array (episode e's column is ``array[e, :rows]``); None
            where a field's rows are apart (ragged, text).
        cuts: each episode's columns as cut: an episode whose columns were replaced since
            (encoded, versioned, copied) no longer has them, and is not read from ``arrays``.
    """

    arrays: dict[str, Any] | None = None
    cuts: list[Any] | None = None

    def keep_arrays(self, arrays: dict[str, Any]) -> None:
        """The batch's arrays its episodes (all appended) are views of, as they are now."""
        self.arrays, self.cuts = arrays, [episode.columns for episode in self]

    def blocks(self) -> dict[str, Any] | None:
        """Field -> ``[E, rows, ...]`` view of the batch's rows, when every episode is as cut and
        all have one length and one row count (final observations or none); else None."""
        if self.arrays is None or self.cuts is None or len(self.cuts) != len(self) or not self:
            return None
        first = self[0]
        if any(episode.columns is not cut or episode.num_steps != first.num_steps or episode.num_rows != first.num_rows
               for episode, cut in zip(self, self.cuts)):
            return None
        return {name: array[:, :len(first.columns[name])] for name, array in self.arrays.items()}


def add_block(shard: Shard, episodes: list[Episode], before: Callable[[], None] | None = None) -> list[int] | None:
    """Add checked ``episodes`` (oldest first) to ``shard`` as one block; their ids, or None
    (nothing changed) where they do not form one (see the module docstring). ``before`` is
    called once they are known to, before anything changes (a new shard's sampler binds to it
    there, as `ShardEngine.add` binds it before the first episode goes in)."""
    if len(episodes) < 2:
        return None
    first = episodes[0]
    if shard.bounded or any(
            e.first_step or e.prev_piece >= 0 or e.open or e.columns.keys() != first.columns.keys() for e in episodes):
        return None
    blocks = episodes.blocks() if isinstance(episodes, EpisodeBatch) else None
    if blocks is not None and not all(type(shard.arena.get(name)) is np.ndarray and type(block) is np.ndarray
                                      for name, block in blocks.items()):
        return None
    parts = _parts(shard, episodes) if blocks is None else None
    if blocks is None and parts is None:
        return None
    sizes = [e.num_rows for e in episodes]
    plan = shard.placement.plan_block(sum(sizes), sum(shard.transitions_of(e) for e in episodes))
    if plan is None:
        return None
    count, steps = len(episodes), first.num_steps
    if blocks is not None:   # one length: each flag's last steps read at once
        flags = {flag: blocks[flag][:, steps - 1].reshape(count, -1)[:, 0].astype(bool).tolist()
                 if flag in blocks else [False] * count for flag in ("terminated", "truncated")}
    else:
        flags = {flag: [flag in first.columns and bool(e.columns[flag][e.num_steps - 1]) for e in episodes]
                 for flag in ("terminated", "truncated")}
    returns = ([total_reward(e.columns["reward"]) for e in episodes] if "reward" in first.columns
               else [float("nan")] * count)
    if before is not None:
        before()
    start = shard.placement.apply(plan, sum(sizes))
    for name in shard.schema.fields:
        if blocks is not None and name in blocks:
            shard.write_block(name, start, first.num_rows, blocks[name])
        elif parts is not None and name in parts:
            shard.write_parts(name, start, parts[name])
        else:   # a derived field the batch left out: zero until computed
            shard.zero_rows(name, start, start + sum(sizes))
    rows = np.asarray(sizes, np.int64)
    firsts = start + np.cumsum(rows) - rows
    now = time.time_ns()
    ids = shard.record_many(
        firsts, rows, [shard.transitions_of(e) for e in episodes], [e.has_final for e in episodes],
        flags["terminated"], flags["truncated"], returns, [e.env_id for e in episodes],
        metadata=[metadata_text(e.metadata) for e in episodes],
        inserted_at=[now if e.inserted_at is None else e.inserted_at for e in episodes])
    if shard.regions.count:   # an append drops the open tails published: the writers' are published again
        shard.publish_open()
    return ids


def _parts(shard: Shard, episodes: list[Episode]) -> dict[str, list[np.ndarray]] | None:
    """Per field the episodes are given, the arrays to copy one after the other into one run of rows:
    each episode's, and a zero row after a step field beside a final observation (one row short, as
    `Shard.write_episode` zeroes it); None where a column or a field is not a plain numpy array."""
    parts = {}
    for name in episodes[0].columns:
        column = shard.arena.get(name)
        if type(column) is not np.ndarray:
            return None
        zero = np.zeros((1, *column.shape[1:]), column.dtype)
        arrays = parts[name] = []
        for episode in episodes:
            data = episode.columns[name]
            if type(data) is not np.ndarray or data.shape[1:] != column.shape[1:]:
                return None
            arrays.append(data)
            if len(data) < episode.num_rows:
                arrays.append(zero)
    return parts
