"""Many episodes of one `ExperienceStore.add_episodes` batch placed and copied as one block.

`arrowbuf.episode_batch.read_episodes` cuts a batch of E episodes shaped ``[E, T, ...]``
into `Episode` views, each added on its own by `ShardEngine.add`: a plan, a copy per
field and a table entry an episode. Where the E episodes have one length and their
columns are the rows of one array per field (a rollout of E envs, the episodes
`arrowbuf.compat` cuts together at a rollout's end), `add_block` places all their rows
as one run of the ring (`Ring.plan_block`), copies each field once (`Shard.write_block`)
and appends their table entries: what E single adds store, in the same order, with the
same evictions (`EpisodeBatch.blocks`: the episodes as read, none replaced since). Anything else (ragged, text or encoded fields, a byte budget, episodes
of other lengths, a ring whose run would evict more than the count does) returns None,
and the caller adds the episodes one by one.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

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
        all have one length; else None."""
        if self.arrays is None or self.cuts is None or len(self.cuts) != len(self) or not self:
            return None
        first = self[0]
        if any(episode.columns is not cut or episode.num_steps != first.num_steps
               for episode, cut in zip(self, self.cuts)):
            return None
        return {name: array[:, :len(first.columns[name])] for name, array in self.arrays.items()}


def add_block(shard: Shard, episodes: list[Episode], before: Callable[[], None] | None = None) -> list[int] | None:
    """Add checked ``episodes`` (oldest first) to ``shard`` as one block; their ids, or None
    (nothing changed) where they do not form one (see the module docstring). ``before`` is
    called once they are known to, before anything changes (a new shard's sampler binds to it
    there, as `ShardEngine.add` binds it before the first episode goes in)."""
    first = episodes[0]
    rows, steps = first.num_rows, first.num_steps
    if len(episodes) < 2 or shard.bounded or any(
            e.num_rows != rows or e.has_final != first.has_final or e.first_step or e.prev_piece >= 0 or e.open
            or e.columns.keys() != first.columns.keys() for e in episodes):
        return None
    blocks = episodes.blocks() if isinstance(episodes, EpisodeBatch) else None
    if blocks is None or not all(type(shard.arena.get(name)) is np.ndarray and type(block) is np.ndarray
                                 for name, block in blocks.items()):
        return None
    count, length = len(episodes), shard.transitions_of(first)
    plan = shard.placement.plan_block(count * rows, count * length)
    if plan is None:
        return None
    flags = {flag: blocks[flag][:, steps - 1].reshape(count, -1)[:, 0].astype(bool).tolist()
             if flag in blocks else [False] * count for flag in ("terminated", "truncated")}
    returns = ([total_reward(e.columns["reward"]) for e in episodes] if "reward" in blocks
               else [float("nan")] * count)
    if before is not None:
        before()
    start = shard.placement.apply(plan, count * rows)
    for name in shard.schema.fields:
        if name in blocks:
            shard.write_block(name, start, rows, blocks[name])
        else:   # a derived field the batch left out: zero until computed
            shard.zero_rows(name, start, start + count * rows)
    ids = [shard.record(episode, start + k * rows, flags["terminated"][k], flags["truncated"][k], returns[k])
           for k, episode in enumerate(episodes)]
    if shard.regions.count:   # an append drops the open tails published: the writers' are published again
        shard.publish_open()
    return ids

