"""A `arrowbuf.mixture.Mixture` batch drawn straight into one pooled slot.

The generic mixture samples each source (a pooled batch of its own), then joins
them: a ``torch.cat`` per key, a ``"source"`` tensor and a new TensorDict, which
cost more than the draws. When every source is a local store or a dataset whose
plain uniform sample takes `arrowbuf.direct`'s path, and the call has no
arguments, a `MixedPlan` lays out one slot for the whole batch (each key's rows
of every source back to back, then ``"source"``: `arrowbuf.layout.stacked_slot`) and each source draws and
gathers its rows into its share of it (`arrowbuf.direct.fill_plain_uniform`), with
its own generator in the same order as its own ``sample`` would. The plan is kept
per batch size and counts, and rebuilt when a source's shard or gatherer changes.

A dataset never changes, so its share is drawn `AHEAD` batches at a time (one draw and
one locate of ``AHEAD * count`` transitions, `arrowbuf.direct.draw_ahead`), and each
batch gathers the next slice. The draws are the ones ``AHEAD`` calls would make in turn
(the generator yields the same numbers in one call or several), so the batches are the
same; what is saved is the per-call cost of a draw and a locate (about 4 us of a W1
batch's 64 dataset rows, where the whole batch costs about 37 us).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from tensordict import TensorDict

from arrowbuf._bounds import check_batch
from arrowbuf._pool import SlotPool, SlotSpec
from arrowbuf.dataset import Dataset
from arrowbuf.direct import draw_ahead, fill_drawn, fill_plain_uniform
from arrowbuf.layout import stacked_slot
from arrowbuf.samplers import UniformSampler
from arrowbuf.store import ExperienceStore

_UNIFORM = UniformSampler()
#: Plans a mixture keeps (batch sizes x count splits, as an annealed schedule makes).
MAX_PLANS = 8
#: Batches of a dataset's share drawn at once (at most `AHEAD_ROWS` transitions).
AHEAD = 16
AHEAD_ROWS = 1 << 16


def in_process_source(source: Any) -> tuple[Any, Callable[[int], None] | None] | None:
    """(engine, rows callback) of a source a plan can draw from; None for others (Ray stores...)."""
    if isinstance(source, Dataset):
        return source.engine, source.touched
    if isinstance(source, ExperienceStore) and source.backend == "local":
        return source.engine, None
    return None


class _Part:
    __slots__ = ("engine", "account", "count", "shard", "gatherer", "plain", "start", "stop", "ahead", "drawn", "next")

    def __init__(self, engine: Any, account: Any, count: int, shard: Any, plain: tuple, ahead: int) -> None:
        self.engine, self.account, self.count = engine, account, count
        self.shard, self.gatherer, self.plain = shard, shard.gatherer, plain
        self.start = self.stop = 0
        self.ahead = ahead               # batches drawn at once (1: each batch draws its own)
        self.drawn: tuple = ()           # `draw_ahead`'s arrays, and the next batch's slice of them
        self.next = 0


class MixedPlan:
    """One slot's layout for a mixture's batch and each source's views into it."""

    def __init__(self, parts: list[_Part], spec: SlotSpec, source_at: int, source: np.ndarray) -> None:
        self.parts, self.spec, self.source_at, self.source = parts, spec, source_at, source
        self._steps = [(p.engine, p.shard, p.gatherer, p.count, p.plain, p.start, p.stop, p.account,
                        p if p.ahead > 1 else None) for p in parts]

    @classmethod
    def build(cls, sources: list[tuple[int, Any, Any, int]]) -> "MixedPlan | None":
        """The plan of ``(position, engine, rows callback, count)`` per source with rows (a
        callback marks a dataset: its share is drawn ahead); None when a source cannot take
        the direct path or the sources' fields differ."""
        parts, layouts = [], []
        for _, engine, account, count in sources:
            with engine.lock:
                direct = engine.direct()
                if direct is None:
                    return None
                # The batch's size is checked once: it depends on the schema, fixed with the gather.
                check_batch(direct[0].schema, _UNIFORM, direct[0].table, count)
                plain = direct[0].gatherer.plain_layout(count, None)
            ahead = max(1, min(AHEAD, AHEAD_ROWS // count)) if account is not None else 1
            parts.append(_Part(engine, account, count, direct[0], plain, ahead))
            layouts.append(plain[0].slot)
        stacked = stacked_slot(layouts, [part.count for part in parts], (("source",), np.dtype(np.int64)))
        if stacked is None:
            return None
        spec, ranges = stacked
        for part, (start, stop) in zip(parts, ranges):
            part.start, part.stop = start, stop
        source = np.repeat(np.array([k for k, *_ in sources], np.int64), [part.count for part in parts])
        return cls(parts, spec, len(spec.outs) - 1, source)

    def sample(self, pool: SlotPool) -> TensorDict | None:
        """A batch; None when a source's shard changed since the plan was built (the sources
        before it have drawn: their generators moved on, their counts are kept)."""
        outs, batch = pool.claim(self, self.spec)
        for engine, shard, gather, count, plain, start, stop, account, ahead in self._steps:
            with engine.lock:
                direct = engine.direct()
                if direct is None or direct[0] is not shard or shard.gatherer is not gather:
                    return None
                engine.require_data()
                if ahead is None:
                    fill_plain_uniform(shard, direct[1], count, plain, outs[start:stop])
                else:
                    if ahead.next == 0:
                        ahead.drawn = draw_ahead(shard, direct[1], count * ahead.ahead)
                    first = ahead.next * count
                    fill_drawn(plain, outs[start:stop], ahead.drawn, first, first + count)
                    ahead.next = (ahead.next + 1) % ahead.ahead
                engine.counted(samples=count)
            if account is not None:
                account(count)
        outs[self.source_at][...] = self.source
        return batch
