"""`ShardDraws`: samples drawn by the shards themselves, gathered by this process.

Prioritized sampling (the sum tree lives in each shard), rate-limited stores (each
shard judges its own samples), `WithoutReplacementSampler` epochs and
``track_reuse`` counts need the shard to draw. A request splits the batch across
the shards in proportion to the mass they last reported (priority mass for PER,
so proportional sampling is exact globally) and asks each for its share: the
shard answers with indices and extras (weights, masks) only, plus its manifest
when the reader's is not current, and the reader gathers the rows from the
shards' sealed blocks (`arrowbuf.ray.reader`). Requests can be kept in flight
(`prefetching`, `sample_iter`'s path).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Sequence

import numpy as np
from tensordict import TensorDict

from arrowbuf.errors import EmptyStoreError, ShardError
from arrowbuf.ray.handles import ShardHandles, SizeCache
from arrowbuf.ray.reader import BlockReader
from arrowbuf.sample_args import SampleArgs
from arrowbuf.samplers import PrioritizedSampler, Sampler, Selection


def _scaled(selection: Selection, scale: float) -> Selection:
    """A prioritized selection whose weights are multiplied by ``scale``."""
    extra = {**selection.extra, "weight": selection.extra["weight"] * scale}
    return Selection(selection.rows, selection.indices, selection.pos, extra, selection.step)


class ShardDraws:
    """Draws made by the shards (see the module docstring).

    Args:
        shards: the store's shard handles.
        sizes: the sizes (and masses) the shards last reported.
        sampler: the store's sampler.
        rng: the generator that splits batches across shards.
        reader: this process's reader, which gathers the drawn rows.
    """

    def __init__(self, shards: ShardHandles, sizes: SizeCache, sampler: Sampler, rng: np.random.Generator,
                 reader: BlockReader) -> None:
        self.shards = shards
        self._sizes = sizes
        self.sampler = sampler
        self._rng = rng
        self._reader = reader

    def _split(self, batch_size: int, shards: Sequence[int] | None = None) -> tuple[list[int], np.ndarray]:
        """Live shards (of ``shards``, default all) and how many items each draws
        (multinomial by the mass the shards last reported)."""
        live = self.shards.live()
        if (self._sizes.masses[live] <= 0).any():
            # A shard seen empty gets no draws, hence no answers that would update its
            # size: ask again, so a shard that filled since is not skipped forever.
            self._sizes.refresh()
            live = self.shards.live()
        if shards is not None:
            live = [s for s in live if s in shards] or live
        masses = self._sizes.masses[live]
        if masses.sum() <= 0:
            raise EmptyStoreError(f"cannot sample: the {self.shards.num_shards} shards of {self.shards.name!r} hold 0 transitions")
        return live, self._rng.multinomial(batch_size, masses / masses.sum())

    def request(self, batch_size: int, args: SampleArgs, timeout: float | None,
                shards: Sequence[int] | None = None) -> tuple:
        """Ask the shards (of ``shards``, default all) to draw ``batch_size`` items: the request in flight."""
        live, counts = self._split(batch_size, shards)
        population = None
        if isinstance(self.sampler, PrioritizedSampler):
            population = (int(self._sizes.transitions[live].sum()), float(self._sizes.masses[live].sum()))
        refs = {shard: self.shards.call(shard, "select", int(n), args, population, timeout,
                                        *self._reader.known(shard))
                for shard, n in zip(live, counts.tolist()) if n}
        return refs, population, (batch_size, args, timeout, shards)

    def collect(self, request: tuple) -> list:
        """The parts (view, selection) of a request's answers, for `BlockReader.gather`.

        Items of a shard that died answering (allow_partial), or whose rows this
        reader cannot find any more (evicted meanwhile), are drawn again from the
        survivors; prioritized weights of the first answers are rescaled to the
        redraw's population (w = (N p / M)^-beta).
        """
        return self._collect(request)[0]

    def _collect(self, request: tuple) -> tuple[list, Any]:
        refs, population, (batch_size, args, timeout, shards) = request
        parts = []
        answers = self.shards.get(refs)
        for shard in refs:
            if shard not in answers:
                continue
            indices, extra, manifest, reading = answers[shard]
            self._sizes.note(shard, reading)
            if manifest is not None:
                self._reader.apply(shard, manifest)
            part = self._reader.select(shard, indices, extra)
            if part is not None:
                parts.append(part)
        missing = batch_size - sum(len(selection.rows) for _, selection in parts)
        if missing:
            if not self.shards.live():
                raise ShardError(f"no shard of {self.shards.name!r} is alive")
            more, population_new = self._collect(self.request(missing, args, timeout, shards))
            if population is not None and population_new is not None:
                (n_old, m_old), (n_new, m_new) = population, population_new
                scale = ((n_old / m_old) / (n_new / m_new)) ** self.sampler.beta
                parts = [(view, _scaled(selection, scale)) for view, selection in parts]
            parts += more
        return parts, population

    def batch(self, batch_size: int, args: SampleArgs, timeout: float | None, keys: Any, device: Any,
              shards: Sequence[int] | None = None) -> TensorDict:
        """One batch drawn by the shards (of ``shards``, default all), gathered by the reader."""
        parts = self.collect(self.request(batch_size, args, timeout, shards))
        return self._reader.gather(parts, args, keys, device, isinstance(self.sampler, PrioritizedSampler),
                                   self._mixed(parts))

    def prefetching(self, batch_size: int, prefetch: int, args: SampleArgs, device: Any) -> Iterator[TensorDict]:
        """Endless batches, ``prefetch`` requests kept in flight."""
        pending = deque(self.request(batch_size, args, None) for _ in range(prefetch))
        normalize = isinstance(self.sampler, PrioritizedSampler)
        while True:
            request = pending.popleft()
            pending.append(self.request(batch_size, args, None))
            parts = self.collect(request)
            yield self._reader.gather(parts, args, None, device, normalize, self._mixed(parts))

    def _mixed(self, parts: list) -> list[np.ndarray] | None:
        """Batch positions that shuffle the parts several shards drew (None for one part):
        any slice of the batch is then a sample of every shard, as a local batch is."""
        if len(parts) < 2:
            return None
        sizes = [len(selection.rows) for _, selection in parts]
        return np.split(self._rng.permutation(sum(sizes)), np.cumsum(sizes)[:-1])
